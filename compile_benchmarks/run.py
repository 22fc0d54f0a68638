"""Run the benchmark suite, then write the report.

``python -m compile_benchmarks.run --full`` (``make bench``) runs the
``compile_benchmarks/test_bench_*.py`` benchmarks in interleaved passes, all but the
compile-cost rows (items marked ``bench_compile``), which ``--compile``
(``make bench-compile``) runs alone. Each benchmark file's rows are stored as the file
completes, in ``compile_benchmarks/results/<full|compile>/<file stem>.json``, stamped with the
commit, the torch version and the date (``compile_benchmarks/store.py``): a run that stops
keeps what it measured, and the next run for the same commit and settings measures only the
files not stored yet (``--force``: all of them; ``--only FILE ...``: some). Then it writes
``compile_benchmarks/RESULTS.md`` and ``compile_benchmarks/ratios.png`` from the stored file of
every benchmark file (each section dated with its file's date and commit) and, from that
``RESULTS.md``, the benchmark table of the repository's ``README.md`` (between its
``<!-- bench:start -->`` and ``<!-- bench:end -->`` lines). Extra pytest arguments (after
``--``, e.g. ``-k``) make a run apart: stored and reported under ``results/adhoc/``, never
resumed, the README left alone.
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
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    """The environment of the benchmark process: threads fixed before the interpreter starts;
    none of the variables of a pytest session the runner may itself run in (an xdist worker's
    id would make pytest-benchmark switch itself off).

    Example:
        >>> env = child_env(1, {"PYTEST_XDIST_WORKER": "gw0"})
        >>> env["OMP_NUM_THREADS"], "PYTEST_XDIST_WORKER" in env
        ('1', False)
    """
    env = dict(os.environ if base is None else base)
    for var in [v for v in env if v.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_TEST"))]:
        del env[var]
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TDFUNC_BENCH_THREADS"):
        env[var] = str(threads)
    return env


def pytest_command(
    *,
    quick: bool,
    json_path: str | Path | None = None,
    passes: int | None = None,
    max_time: float = FULL_MAX_TIME,
    threads: int = DEFAULT_THREADS,
    clock: str | None = None,
    extra: Sequence[str] = (),
    files: Sequence[str | Path] = (),
    results_dir: str | Path | None = None,
    compile_rows: str = "include",
) -> list[str]:
    """The pytest command line of a run: every benchmark file (or ``files``), the whole run's
    JSON at ``json_path`` and/or each file's stored result in ``results_dir``
    (``compile_benchmarks/store.py``), ``compile_rows`` the items marked ``bench_compile``
    (``include``, ``skip`` or ``only``)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *([str(f) for f in files] or [str(HERE)]),
        "-p",
        "no:cacheprovider",
        "-o",
        "python_files=test_bench_*.py",
        "-q",
        "--benchmark-disable-gc",
        "--benchmark-sort=name",
        "--benchmark-columns=median,iqr,rounds",
        f"--bench-threads={threads}",
        f"--benchmark-timer={CLOCKS[clock or default_clock(threads)]}",
    ]
    if json_path is not None:
        cmd.append(f"--benchmark-json={json_path}")
    if results_dir is not None:
        # a file that fails to import is measured again next time; the others run now
        cmd += [
            "-p",
            "compile_benchmarks.store",
            f"--bench-results-dir={results_dir}",
            "--continue-on-collection-errors",
        ]
    if compile_rows != "include":
        cmd.append(f"--bench-compile-rows={compile_rows}")
    if quick:
        cmd += list(QUICK_ARGS)
    else:
        cmd += [
            f"--bench-passes={passes or FULL_PASSES}",
            "--benchmark-min-rounds=5",
            f"--benchmark-max-time={max_time}",
        ]
    return cmd + list(extra)


def bench_files(bench_dir: Path, only: Sequence[str] = ()) -> list[Path]:
    """The benchmark files of ``bench_dir`` (``test_bench_*.py``), or those named in ``only``
    (file names or stems, with or without the ``test_bench_`` prefix).

    Example:
        >>> [p.name for p in bench_files(HERE, ["optim", "test_bench_replay.py"])]
        ['test_bench_optim.py', 'test_bench_replay.py']
    """
    files = sorted(Path(bench_dir).glob("test_bench_*.py"))
    if not only:
        return files
    want = {Path(n).stem.removeprefix("test_bench_") for n in only}
    picked = [f for f in files if f.stem.removeprefix("test_bench_") in want]
    missing = want - {f.stem.removeprefix("test_bench_") for f in picked}
    if missing:
        raise SystemExit(f"no benchmark file {sorted(missing)} in {bench_dir}")
    return picked


def _call(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run ``cmd``; on Ctrl-C let it finish writing what it measured, then return 130."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # pytest got the same SIGINT: it stops and writes the rows of the file it was in
        try:
            proc.wait(timeout=120)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        return 130


def _when(doc: dict[str, Any]) -> str:
    stamp = doc.get("stamp", {})
    commit = stamp.get("commit") or "no commit"
    return f"measured {stamp.get('date', '?')} at {commit[:10]}"


def run_stored(args: argparse.Namespace, kind: str) -> int:
    """``--full`` / ``--compile``: measure the benchmark files not yet stored for this commit
    and settings (all with ``--force``), each stored as it completes; then the report from
    every stored file."""
    from compile_benchmarks import store

    bench_dir = Path(args.bench_dir).resolve()
    adhoc = bool(args.pytest_args)  # a selection (e.g. -k): kept apart from the report's files
    root = Path(args.results) / "adhoc" if adhoc else Path(args.results)
    results_dir = root / kind
    files = bench_files(bench_dir, args.only)
    stamp = {**store.source_stamp(bench_dir), "torch": store.torch_version()}
    settings = {
        "kind": kind,
        "passes": args.passes or FULL_PASSES,
        "threads": args.threads,
        "clock": args.clock or default_clock(args.threads),
        "max_time": args.max_time,
    }
    if adhoc and results_dir.exists():
        shutil.rmtree(results_dir)
    todo = []
    for f in files:
        doc = store.read_result(store.result_path(results_dir, f))
        if not args.force and not adhoc and store.is_current(doc, stamp, settings):
            assert doc is not None
            print(f"skip {f.name}: {_when(doc)} (--force to measure it again)", flush=True)
        else:
            todo.append(f)
    if stamp["commit"] is None:
        print("not a git checkout: every file is measured (a run resumes only in one)")
    rc = 0
    if todo:
        cmd = pytest_command(
            quick=False,
            passes=args.passes,
            max_time=args.max_time,
            threads=args.threads,
            clock=args.clock,
            extra=args.pytest_args,
            files=todo,
            results_dir=results_dir,
            compile_rows="only" if kind == "compile" else "skip",
        )
        env = child_env(args.threads)
        env[store.RUN_ENV] = json.dumps({"kind": kind, "stamp": stamp, "settings": settings})
        print("+", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        rc = _call(cmd, env)
        print(
            f"benchmarks finished in {time.perf_counter() - t0:.0f} s (pytest exit code {rc}); "
            f"each file's results are in {results_dir}",
            flush=True,
        )
    else:
        print(f"every file is measured for commit {str(stamp['commit'])[:10]}: nothing to run")
    if args.no_report:
        return rc
    from compile_benchmarks.report import RESULTS_MD, ROOT_README, write_headline, write_report

    paths = store.stored_paths(root, bench_dir)
    if not paths:
        print("no stored result to report")
        return rc
    out_dir = args.out or (root if adhoc else HERE)
    md = write_report(paths, out_dir, shift_passes=False)
    print(f"wrote {md} (and {md.parent / 'ratios.png'} when a row has a ratio to draw)")
    if md == RESULTS_MD and not args.no_readme:
        try:
            changed = write_headline()
        except ValueError as e:  # e.g. no headline row measured yet
            print(f"kept the benchmark table of {ROOT_README}: {e}")
        else:
            print(f"{'rewrote' if changed else 'kept'} the benchmark table of {ROOT_README}")
    return rc


def run_quick(args: argparse.Namespace) -> int:
    """``--quick``: every benchmark about once, one JSON, the report under results/quick/."""
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    json_path = results / "quick.json"
    out_dir = args.out or (results / "quick")
    if json_path.exists():
        json_path.unlink()
    cmd = pytest_command(
        quick=True,
        json_path=json_path,
        threads=args.threads,
        clock=args.clock,
        extra=args.pytest_args,
        files=(
            bench_files(Path(args.bench_dir), args.only)
            if args.only or Path(args.bench_dir).resolve() != HERE
            else ()
        ),
    )
    print("+", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = _call(cmd, child_env(args.threads))
    print(
        f"benchmarks finished in {time.perf_counter() - t0:.0f} s (pytest exit code {rc})",
        flush=True,
    )
    if args.no_report or not json_path.exists():
        return rc
    # the report is written even when a benchmark failed (pytest's exit code is still returned)
    from compile_benchmarks.report import write_report

    md = write_report([json_path], out_dir, title="tdfunc benchmark results (quick smoke run)")
    print(f"wrote {md}")
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the tdfunc benchmark suite and write the report."
    )
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--quick", action="store_true", help="smoke test: every benchmark about once"
    )
    which.add_argument(
        "--full",
        action="store_true",
        help="make bench: every benchmark but the compile-cost rows, resumable; writes RESULTS.md",
    )
    which.add_argument(
        "--compile",
        action="store_true",
        help="make bench-compile: only the compile-cost rows (cold first calls in fresh "
        "processes, compile by blocks), resumable; writes RESULTS.md",
    )
    parser.add_argument(
        "--passes", type=int, default=None, help=f"interleaved passes (default {FULL_PASSES})"
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
    parser.add_argument(
        "--force",
        action="store_true",
        help="measure every file again, even those already measured for this commit",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        default=[],
        metavar="FILE",
        help="only these benchmark files (e.g. optim or test_bench_optim.py)",
    )
    parser.add_argument("--out", type=Path, default=None, help="report directory")
    parser.add_argument("--no-report", action="store_true", help="only run the benchmarks")
    parser.add_argument(
        "--no-readme", action="store_true", help="leave the README's benchmark table as it is"
    )
    parser.add_argument(
        "--bench-dir", type=Path, default=HERE, help="where the test_bench_*.py files are"
    )
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help=f"stored results (default {RESULTS})"
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if args.quick:
        return run_quick(args)
    return run_stored(args, "compile" if args.compile else "full")


if __name__ == "__main__":
    sys.exit(main())
