"""Run the benchmark suite, then write the report.

``python -m compile_benchmarks.run --full`` (``make bench``) runs every
``compile_benchmarks/test_bench_*.py`` benchmark in interleaved passes and writes
``compile_benchmarks/RESULTS.md``, ``compile_benchmarks/ratios.png`` and, from that
``RESULTS.md``, the benchmark table of the repository's ``README.md`` (between its
``<!-- bench:start -->`` and ``<!-- bench:end -->`` lines).
``python -m compile_benchmarks.run --quick`` (``make bench-quick``, the CI smoke test) runs
every benchmark about once (see ``--bench-quick`` in ``conftest.py``) and writes its report
under ``compile_benchmarks/results/quick/``. ``--threads N`` (default 1) fixes the intra-op
and OpenMP threads of the benchmark process before it starts; ``--clock`` picks CPU time
(default with one thread) or wall time. The exit code is pytest's (non-zero when a
benchmark errors or a result check fails), never a missed performance target.

Example:
    >>> from compile_benchmarks.run import pytest_command
    >>> "--bench-quick" in pytest_command(quick=True, json_path="q.json")
    True
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

QUICK_ARGS = (
    "--bench-quick",
    "--benchmark-min-rounds=1",
    "--benchmark-max-time=0.000001",
    "--benchmark-warmup=off",
)
FULL_PASSES = 3
FULL_MAX_TIME = 0.2  # seconds per benchmark and pass
DEFAULT_THREADS = 1
#: ``--clock`` choices: the pytest-benchmark timer of each.
CLOCKS = {"cpu": "time.process_time", "wall": "time.perf_counter"}


def default_clock(threads: int) -> str:
    """CPU time with one thread (robust to a loaded machine), wall time with more.

    Example:
        >>> default_clock(1), default_clock(4)
        ('cpu', 'wall')
    """
    return "cpu" if threads == 1 else "wall"


def child_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the benchmark process: threads fixed before the interpreter starts.

    Example:
        >>> child_env(1, {})["OMP_NUM_THREADS"]
        '1'
    """
    env = dict(os.environ if base is None else base)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TDFUNC_BENCH_THREADS"):
        env[var] = str(threads)
    return env


def pytest_command(
    *,
    quick: bool,
    json_path: str | Path,
    passes: int | None = None,
    max_time: float = FULL_MAX_TIME,
    threads: int = DEFAULT_THREADS,
    clock: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The pytest command line of a quick or full run."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(HERE),
        "-p",
        "no:cacheprovider",
        "-o",
        "python_files=test_bench_*.py",
        "-q",
        f"--benchmark-json={json_path}",
        "--benchmark-disable-gc",
        "--benchmark-sort=name",
        "--benchmark-columns=median,iqr,rounds",
        f"--bench-threads={threads}",
        f"--benchmark-timer={CLOCKS[clock or default_clock(threads)]}",
    ]
    if quick:
        cmd += list(QUICK_ARGS)
    else:
        cmd += [
            f"--bench-passes={passes or FULL_PASSES}",
            "--benchmark-min-rounds=5",
            f"--benchmark-max-time={max_time}",
        ]
    return cmd + list(extra)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the tdfunc benchmark suite and write the report."
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--quick", action="store_true", help="smoke test: every benchmark about once"
    )
    which.add_argument("--full", action="store_true", help="full measurement, writes RESULTS.md")
    parser.add_argument(
        "--passes", type=int, default=None, help=f"interleaved passes (full; default {FULL_PASSES})"
    )
    parser.add_argument(
        "--max-time", type=float, default=FULL_MAX_TIME, help="seconds per benchmark and pass"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TDFUNC_BENCH_THREADS", "") or DEFAULT_THREADS),
        help="intra-op and OpenMP threads for the whole run (default 1)",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default=None,
        help="cpu (process CPU time) or wall; default: cpu with one thread, wall otherwise",
    )
    parser.add_argument("--out", type=Path, default=None, help="report directory")
    parser.add_argument("--no-report", action="store_true", help="only run the benchmarks")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / ("quick.json" if args.quick else "full.json")
    out_dir = args.out or (RESULTS / "quick" if args.quick else HERE)
    if json_path.exists():
        json_path.unlink()
    cmd = pytest_command(
        quick=args.quick,
        json_path=json_path,
        passes=args.passes,
        max_time=args.max_time,
        threads=args.threads,
        clock=args.clock,
        extra=args.pytest_args,
    )
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT, env=child_env(args.threads))
    print(
        f"benchmarks finished in {time.perf_counter() - t0:.0f} s (pytest exit code {rc})",
        flush=True,
    )
    if args.no_report or not json_path.exists():
        return rc
    # the report is written even when a benchmark failed (pytest's exit code is still
    # returned): a long run keeps the rows it measured
    from compile_benchmarks.report import RESULTS_MD, ROOT_README, write_headline, write_report

    title = (
        "tdfunc benchmark results (quick smoke run)" if args.quick else "tdfunc benchmark results"
    )
    md = write_report([json_path], out_dir, title=title)
    print(f"wrote {md} and {md.parent / 'ratios.png'}")
    if not args.quick and md == RESULTS_MD:
        # the README's benchmark table is written from the RESULTS.md just written
        changed = write_headline()
        print(f"{'rewrote' if changed else 'kept'} the benchmark table of {ROOT_README}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
