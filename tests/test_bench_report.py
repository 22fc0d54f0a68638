"""The benchmark report's bookkeeping: a run stores each benchmark file as it completes and
resumes where it stopped (``compile_benchmarks/run.py``, ``store.py``), the report dates each
section with its file's run, and the README's benchmark table is never much older than the
library it measures."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


# ------------------------------------------------------------------------ README table age
def test_readme_benchmark_table_is_not_older_than_the_library():
    from compile_benchmarks import report

    table = report.readme_table_date(README.read_text(encoding="utf-8"))
    changed = report.newest_change(ROOT, "tdfunc")
    message = report.stale_table_message(table, changed)
    assert message is None, message


def _readme(day: str) -> str:
    from compile_benchmarks import report

    return (
        f"# x\n\n{report.HEADLINE_START}\n`make bench` of {day}: torch 2.13.0, some CPU.\n\n"
        f"| workload | tdfunc against | ratio | target |\n|---|---|---|---|\n"
        f"{report.HEADLINE_END}\n"
    )


def test_a_readme_table_30_days_older_than_the_library_is_stale():
    from compile_benchmarks import report

    changed = dt.datetime(2026, 12, 31, 9, 0, tzinfo=dt.UTC)
    table = report.readme_table_date(_readme("2026-12-01"))
    assert table == dt.date(2026, 12, 1)
    message = report.stale_table_message(table, changed, path=Path("README.md"))
    assert message is not None
    assert "measured on 2026-12-01, but tdfunc/ changed on 2026-12-31, 30 days later" in message
    assert "run `make bench`" in message
    # at most 14 days older is fine, 15 is not; a table newer than the change is fine
    assert report.stale_table_message(dt.date(2026, 12, 17), changed) is None
    assert report.stale_table_message(dt.date(2026, 12, 16), changed) is not None
    assert report.stale_table_message(dt.date(2027, 1, 5), changed) is None


def test_the_oldest_day_of_a_table_spanning_several_days_counts():
    from compile_benchmarks import report

    text = _readme("2026-11-20 to 2026-12-03")
    assert report.readme_table_date(text) == dt.date(2026, 11, 20)


def test_a_readme_table_without_a_date_is_an_error():
    from compile_benchmarks import report

    with pytest.raises(ValueError, match=r"the benchmark table carries no date"):
        report.readme_table_date(_readme("").replace("of :", "of last week:"))
    with pytest.raises(ValueError, match=r"no benchmark table between"):
        report.readme_table_date("# no table\n")


def test_newest_change_is_the_commit_date_or_else_the_newest_file(tmp_path):
    from compile_benchmarks import report

    lib = tmp_path / "tdfunc"
    (lib / "sub").mkdir(parents=True)
    (lib / "a.py").write_text("a = 1\n")
    (lib / "sub" / "b.py").write_text("b = 1\n")
    old, new = dt.datetime(2026, 10, 1).timestamp(), dt.datetime(2026, 11, 2, 12).timestamp()
    os.utime(lib / "a.py", (old, old))
    os.utime(lib / "sub" / "b.py", (new, new))
    # not a git checkout: the newest modification time
    got = report.newest_change(tmp_path, "tdfunc")
    assert got == dt.datetime.fromtimestamp(new, tz=dt.UTC)
    if shutil.which("git") is None:
        return
    _git_commit(tmp_path, date="2026-09-15T08:00:00+00:00")
    assert report.newest_change(tmp_path, "tdfunc") == dt.datetime(2026, 9, 15, 8, tzinfo=dt.UTC)


def _git_commit(repo: Path, date: str | None = None) -> None:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    if date is not None:
        env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=bench", "-c", "user.email=bench@example.com", "commit", "-qm", "x"],
    ):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True, capture_output=True)


# ------------------------------------------------------------------------ resumable runs
# A stand-in benchmark directory: its conftest accepts the options the runner passes (and,
# where pytest-benchmark is not installed, provides a one-call `benchmark` fixture), each file
# logs that it ran; the second file kills its pytest process while FAKE_STOP is set.
_CONFTEST = """
import time

import pytest

try:
    import pytest_benchmark
except ImportError:
    pytest_benchmark = None


def pytest_addoption(parser):
    group = parser.getgroup("stand-in")
    for name in ("--bench-threads", "--bench-passes", "--bench-compile-rows"):
        group.addoption(name, default=None)
    if pytest_benchmark is None:
        group.addoption("--benchmark-disable-gc", action="store_true")
        for name in ("sort", "columns", "timer", "min-rounds", "max-time"):
            group.addoption(f"--benchmark-{name}", default=None)


if pytest_benchmark is None:

    class _Stats:
        def __init__(self, fixture, seconds):
            self.fixture, self.seconds = fixture, seconds

        def as_dict(self, include_data=False):
            s = self.seconds
            return {
                "name": self.fixture.name,
                "fullname": self.fixture.fullname,
                "extra_info": self.fixture.extra_info,
                "stats": {"median": s, "min": s, "max": s, "iqr": 0.0, "rounds": 1},
            }

    class _Benchmark:
        has_error = False

        def __init__(self, node):
            self.name, self.fullname = node.name, node.nodeid
            self.extra_info, self.stats = {}, None

        def __call__(self, fn, *args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.stats = _Stats(self, time.perf_counter() - t0)
            return out

    @pytest.fixture
    def benchmark(request):
        return _Benchmark(request.node)
"""

_BENCH = """
import os


def test_{name}(benchmark):
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write("{name}\\n")
    if "{name}" == "b" and os.environ.get("FAKE_STOP"):
        os._exit(3)  # the process dies while it measures this file
    benchmark.extra_info.update(
        workload="w_{name}", mode="eager", contender="pytree", category="fake_{name}"
    )
    benchmark(sum, range(10))
"""


def _run(
    bench: Path, results: Path, out: Path, log: Path, stop: bool
) -> subprocess.CompletedProcess:
    env = {**os.environ, "FAKE_LOG": str(log)}
    env.pop("FAKE_STOP", None)
    if stop:
        env["FAKE_STOP"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "compile_benchmarks.run",
        "--full",
        "--bench-dir",
        str(bench),
        "--results",
        str(results),
        "--out",
        str(out),
        "--no-readme",
        "--passes",
        "1",
        "--max-time",
        "0.001",
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("git") is None, reason="a run resumes only in a git checkout")
def test_a_stopped_run_keeps_its_files_and_the_next_run_resumes(tmp_path):
    from compile_benchmarks import report, store

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    for name in ("a", "b"):
        (bench / f"test_bench_{name}.py").write_text(_BENCH.format(name=name))
    _git_commit(tmp_path)
    results, out, log = tmp_path / "results", tmp_path / "out", tmp_path / "log.txt"

    # 1. the process dies in the second file: the first is stored, stamped, and reported
    first = _run(bench, results, out, log, stop=True)
    assert first.returncode != 0, first.stdout + first.stderr
    stored_a = results / "full" / "test_bench_a.json"
    assert stored_a.exists(), first.stdout + first.stderr
    assert not (results / "full" / "test_bench_b.json").exists()
    doc = json.loads(stored_a.read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    assert doc["complete"] is True
    assert doc["stamp"]["commit"] == head
    assert doc["stamp"]["dirty"] is False
    assert doc["stamp"]["torch"] == store.torch_version()
    measured = dt.datetime.fromisoformat(doc["stamp"]["date"]).date()
    assert abs((measured - dt.date.today()).days) <= 1  # today (midnight may pass)
    assert [b["extra_info"]["workload"] for b in doc["benchmarks"]] == ["w_a"]
    assert "w_a" in (out / "RESULTS.md").read_text()

    # the first file was measured on an earlier day (same commit): it keeps its own date
    doc["stamp"]["date"] = "2026-11-20T10:00:00+00:00"
    stored_a.write_text(json.dumps(doc))
    kept = stored_a.read_bytes()

    # 2. the rerun skips the first file and measures the second
    second = _run(bench, results, out, log, stop=False)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "skip test_bench_a.py: measured 2026-11-20" in second.stdout
    assert log.read_text().split() == ["a", "b", "b"]  # a measured once
    assert stored_a.read_bytes() == kept
    doc_b = json.loads((results / "full" / "test_bench_b.json").read_text())
    day_b = dt.datetime.fromisoformat(doc_b["stamp"]["date"]).date().isoformat()

    # 3. the report holds both files, each section with its own date and commit
    md = (out / "RESULTS.md").read_text()
    assert "w_a" in md
    assert "w_b" in md
    short = head[:10]
    assert f"Measured: `test_bench_a.py` 2026-11-20, commit `{short}`." in md
    assert f"Measured: `test_bench_b.py` {day_b}, commit `{short}`." in md
    assert f"| date | 2026-11-20 to {day_b} |" in md
    sources = report.md_tables(md)["Sources"]
    assert [row[0] for row in sources[1:]] == ["`test_bench_a.py`", "`test_bench_b.py`"]

    # 4. nothing left: a third run measures nothing
    third = _run(bench, results, out, log, stop=False)
    assert "nothing to run" in third.stdout
    assert log.read_text().split() == ["a", "b", "b"]


def test_a_stored_result_is_current_only_for_the_same_code_and_settings():
    from compile_benchmarks import store

    stamp = {"commit": "c1", "diff": None, "torch": "2.13.0"}
    settings = {"kind": "full", "passes": 3}
    doc = {"complete": True, "stamp": {**stamp, "date": "2026-12-01"}, "settings": settings}
    assert store.is_current(doc, stamp, settings)
    assert not store.is_current({**doc, "complete": False}, stamp, settings)
    assert not store.is_current(doc, {**stamp, "commit": "c2"}, settings)
    assert not store.is_current(doc, {**stamp, "diff": "0123"}, settings)  # uncommitted edits
    assert not store.is_current(doc, {**stamp, "torch": "2.15.0"}, settings)
    assert not store.is_current(doc, stamp, {**settings, "passes": 5})
    assert not store.is_current(doc, stamp, {**settings, "kind": "compile"})
    assert not store.is_current(doc, {**stamp, "commit": None}, settings)  # no checkout
    assert not store.is_current(None, stamp, settings)
