"""Stored benchmark results: one JSON file per benchmark file, written as that file completes.

``python -m compile_benchmarks.run --full`` (``make bench``) and ``--compile``
(``make bench-compile``) load this module as a pytest plugin
(``-p compile_benchmarks.store --bench-results-dir DIR``). When the last selected item of a
benchmark file has run, that file's rows are written to ``DIR/<file stem>.json`` (the
pytest-benchmark JSON layout plus a header), stamped with:

* ``stamp``: the commit measured (``git rev-parse HEAD``), ``dirty`` (uncommitted changes to
  the measured code: ``tdfunc/``, the benchmark directory's ``*.py``, ``pyproject.toml``),
  ``diff`` (a digest of those changes, so two dirty runs of different code never count as
  one), the torch version and the date the file completed;
* ``settings``: what else decides the numbers (kind of run, passes, threads, clock, seconds
  per benchmark);
* ``complete``: every selected item of the file ran and none failed; ``seconds``: how long the
  file took.

A run that stops keeps every file it finished; when pytest itself ends (an error, ``-x``,
Ctrl-C) the rows of the file it was in are written too, marked incomplete. The next run skips
the files whose stored result :func:`is_current` (complete, same commit, same uncommitted
changes, same torch and settings) and measures the rest; the report is assembled from the
stored file of each benchmark file, each with its own date and commit.

Example:
    >>> is_current({"complete": True, "stamp": {"commit": "abc", "diff": None, "torch": "2"},
    ...             "settings": {"kind": "full"}},
    ...            {"commit": "abc", "diff": None, "torch": "2"}, {"kind": "full"})
    True
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from compile_benchmarks import RUN_KINDS

HERE = Path(__file__).resolve().parent
#: Directory of the stored results (ignored by git), one subdirectory per kind of run.
RESULTS = HERE / "results"
#: Kinds of stored runs: the make target that measures each.
KINDS = RUN_KINDS
#: Environment variable through which the runner hands the stamp and settings to pytest.
RUN_ENV = "TDFUNC_BENCH_RUN"
#: Paths (relative to the repository root) whose changes change what is measured, besides the
#: benchmark directory's Python files.
MEASURED_PATHS = ("tdfunc", "pyproject.toml")
FORMAT = 1


# ----------------------------------------------------------------------------- stamp
def git(cwd: Path, *args: str) -> str | None:
    """``git args`` run in ``cwd``: its stdout, or None when git fails or is missing."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.decode("utf-8", "replace") if out.returncode == 0 else None


def source_stamp(bench_dir: Path = HERE) -> dict[str, Any]:
    """The commit checked out where ``bench_dir`` lives, and its uncommitted changes to the
    measured code (``commit`` None outside a git checkout).

    Example:
        >>> sorted(source_stamp())
        ['commit', 'diff', 'dirty']
    """
    bench_dir = Path(bench_dir).resolve()
    top = git(bench_dir, "rev-parse", "--show-toplevel")
    commit = git(bench_dir, "rev-parse", "HEAD")
    if not top or not commit:
        return {"commit": None, "dirty": None, "diff": None}
    root = Path(top.strip())
    rel = bench_dir.relative_to(root).as_posix() if bench_dir != root else ""
    specs = [f"{rel}/*.py" if rel else "*.py", *(p for p in MEASURED_PATHS if (root / p).exists())]
    h = hashlib.sha256()
    changed = False
    diff = git(root, "diff", "HEAD", "--binary", "--", *specs) or ""
    if diff:
        changed = True
        h.update(diff.encode())
    others = git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *specs) or ""
    for name in sorted(n for n in others.split("\0") if n):
        changed = True
        h.update(name.encode() + b"\0")
        with contextlib.suppress(OSError):  # removed since listed: its name counts
            h.update((root / name).read_bytes())
    return {
        "commit": commit.strip(),
        "dirty": changed,
        "diff": h.hexdigest()[:16] if changed else None,
    }


def torch_version() -> str | None:
    """The installed torch's version (without importing torch)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def now() -> str:
    """The local date and time, ISO 8601 with its offset, to the second."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- stored files
def result_path(results_dir: Path, bench_file: str | Path) -> Path:
    """Where the result of ``bench_file`` is stored in ``results_dir``.

    Example:
        >>> result_path(Path("r"), "compile_benchmarks/test_bench_optim.py").as_posix()
        'r/test_bench_optim.json'
    """
    return Path(results_dir) / f"{Path(bench_file).stem}.json"


def read_result(path: Path) -> dict[str, Any] | None:
    """A stored result, or None when it is missing or unreadable (then it is measured again)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == FORMAT else None


def write_result(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=repr) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def is_current(
    result: dict[str, Any] | None, stamp: dict[str, Any], settings: dict[str, Any]
) -> bool:
    """True when ``result`` is complete and measured the code of ``stamp`` (same commit, same
    uncommitted changes, same torch) with the same ``settings``: a resumed run skips it."""
    if not result or not result.get("complete") or not stamp.get("commit"):
        return False
    got = result.get("stamp", {})
    same = all(got.get(k) == stamp.get(k) for k in ("commit", "diff", "torch"))
    return same and result.get("settings") == settings


def stored(
    results_dir: Path, names: Iterable[str] | None = None
) -> list[tuple[Path, dict[str, Any]]]:
    """The stored results in ``results_dir`` (only those of the benchmark file ``names``, when
    given), by file name; unreadable ones are left out."""
    keep = None if names is None else {Path(n).stem for n in names}
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        if keep is not None and path.stem not in keep:
            continue
        doc = read_result(path)
        if doc is not None:
            out.append((path, doc))
    return out


def stored_paths(results: Path = RESULTS, bench_dir: Path = HERE) -> list[Path]:
    """The stored results the report is assembled from: for each kind of run, the file of each
    benchmark file still in ``bench_dir`` that holds rows."""
    names = {p.name for p in Path(bench_dir).glob("test_bench_*.py")}
    return [
        path
        for kind in KINDS
        for path, doc in stored(Path(results) / kind)
        if doc.get("file") in names and doc.get("benchmarks")
    ]


# ----------------------------------------------------------------------------- pytest plugin
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("tdfunc benchmarks").addoption(
        "--bench-results-dir",
        default=None,
        help="write each benchmark file's results to DIR/<file stem>.json as the file "
        "completes (compile_benchmarks/store.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    out = config.getoption("--bench-results-dir", None)
    if out:
        config.pluginmanager.register(ResultWriter(config, Path(out)), "tdfunc-bench-store")


def _item_rows(item: pytest.Item) -> list[dict[str, Any]]:
    """The pytest-benchmark row of ``item`` (none when it did not run a benchmark)."""
    fixture = (getattr(item, "funcargs", None) or {}).get("benchmark")
    stats = getattr(fixture, "stats", None)
    if stats is None or getattr(fixture, "has_error", False):
        return []
    return [stats.as_dict(include_data=False)]


class ResultWriter:
    """Writes the rows of each benchmark file when its last selected item has run."""

    def __init__(self, config: pytest.Config, results_dir: Path) -> None:
        self.config = config
        self.results_dir = results_dir
        run = json.loads(os.environ.get(RUN_ENV, "") or "{}")
        self.kind: str = run.get("kind", "full")
        self.stamp: dict[str, Any] = run.get("stamp") or {}
        self.settings: dict[str, Any] = run.get("settings") or {"kind": self.kind}
        self.collected: set[Path] = set()
        self.file_of: dict[str, Path] = {}
        self.pending: dict[Path, int] = defaultdict(int)
        self.rows: dict[Path, list[dict[str, Any]]] = defaultdict(list)
        self.failed: dict[Path, list[str]] = defaultdict(list)
        self.started: dict[Path, float] = {}
        self.written: set[Path] = set()
        self._machine: dict[str, Any] | None = None

    # ------------------------------------------------------------- hooks
    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> Any:
        self.collected = {Path(it.path) for it in items}  # before any deselection
        yield

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not self.stamp:  # pytest run by hand with --bench-results-dir
            where = Path(session.items[0].path).parent if session.items else None
            self.stamp = source_stamp(where or Path(session.config.rootpath))
            self.stamp["torch"] = torch_version()
        for item in session.items:
            path = Path(item.path)
            self.file_of[item.nodeid] = path
            self.pending[path] += 1
        for path in sorted(self.collected - set(self.pending)):
            self._write(path, complete=True)  # nothing of it selected for this kind of run

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        path = self.file_of.get(nodeid)
        if path is not None:
            self.started.setdefault(path, time.perf_counter())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        outcome = yield
        report = outcome.get_result()
        path = Path(item.path)
        if report.failed:
            self.failed[path].append(item.nodeid)
        if call.when == "call":
            self.rows[path].extend(_item_rows(item))

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        path = self.file_of.get(nodeid)
        if path is None:
            return
        self.pending[path] -= 1
        if self.pending[path] == 0:
            self._write(path, complete=not self.failed[path])

    def pytest_sessionfinish(self) -> None:
        # pytest stopped inside a file (an error with -x, Ctrl-C): keep what that file measured
        for path, left in self.pending.items():
            if left > 0 and path not in self.written and self.rows[path]:
                self._write(path, complete=False)

    # ------------------------------------------------------------- writing
    def _machine_info(self) -> dict[str, Any]:
        if self._machine is None:
            hook = getattr(self.config.hook, "pytest_benchmark_generate_machine_info", None)
            self._machine = dict(hook(config=self.config)) if hook is not None else {}
        return self._machine

    def _write(self, path: Path, complete: bool) -> None:
        self.written.add(path)
        rows = self.rows.pop(path, [])
        started = self.started.get(path)
        doc: dict[str, Any] = {
            "format": FORMAT,
            "file": path.name,
            "kind": self.kind,
            "complete": complete,
            "failed": self.failed.get(path, []),
            "stamp": {**self.stamp, "date": now()},
            "settings": self.settings,
            "seconds": None if started is None else round(time.perf_counter() - started, 1),
            "machine_info": self._machine_info() if rows else {},
            "benchmarks": rows,
        }
        update = getattr(self.config.hook, "pytest_benchmark_update_json", None)
        if update is not None and rows:
            update(config=self.config, benchmarks=[], output_json=doc)  # adds tdfunc_bench
        write_result(result_path(self.results_dir, path), doc)


__all__ = [
    "KINDS",
    "RESULTS",
    "RUN_ENV",
    "ResultWriter",
    "git",
    "is_current",
    "read_result",
    "result_path",
    "source_stamp",
    "stored",
    "stored_paths",
    "torch_version",
    "write_result",
]
