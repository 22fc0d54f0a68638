"""Memory-mapped storage side by side: ``tdfunc.save`` / ``tdfunc.load`` against tensordict's
``memmap`` / ``load_memmap`` and raw ``numpy.memmap`` files (the floor).

The data: 16 float32 leaves of one batch dim. Two sizes:

* ``small`` (16 x 64 KiB = 1 MiB): always, also in quick mode (CI).
* ``large`` (16 x 64 MiB = 1 GiB): only with ``TDFUNC_BENCH_LARGE=1`` (or ``TDFUNC_BENCH_FULL=1``);
  it needs about 3 GiB of free disk space and 2 GiB of memory.

Workloads (all eager: file I/O is not compiled; every contender does the same work):

* ``memmap_save``: write the 16 leaves into a new directory and make them durable
  (tdfunc: ``save``, which fsyncs; numpy: one ``np.memmap(mode="w+")`` per leaf, assign, ``flush``
  (msync); tensordict: ``TensorDict.memmap`` then ``fsync`` of every file it wrote).
  ``extra_info["bytes"]`` gives the throughput; the target is at least 0.8x numpy's.
* ``memmap_load``: open a saved store (lazy; no data read). tdfunc ``load``, tensordict
  ``load_memmap``, numpy: 16 ``np.memmap(mode="r")``.
* ``memmap_first_read``: sum every leaf right after loading, with the files evicted from the
  page cache first (fsync + ``posix_fadvise(DONTNEED)``): the first full read from disk. The
  target is at least 0.9x numpy's.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tdfunc
from tdfunc import load, save

CATEGORY = "memmap"
LEAVES = 16
SIZES = {"small": 64 << 10, "large": 64 << 20}  # bytes per leaf
CONTENDERS = ("tdfunc", "tensordict", "numpy")
LARGE_ENV = ("TDFUNC_BENCH_LARGE", "TDFUNC_BENCH_FULL")


def _large_enabled() -> bool:
    return any(os.environ.get(v, "") not in ("", "0", "false", "no") for v in LARGE_ENV)


def _numel(size: str) -> int:
    if size == "large" and not _large_enabled():
        pytest.skip("the 1 GiB variant runs only with TDFUNC_BENCH_LARGE=1")
    return SIZES[size] // 4


def _source(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"k{i:02d}": torch.randn(n, generator=g) for i in range(LEAVES)}


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="tdfunc-bench-memmap-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fsync_tree(path: str, evict: bool) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                if evict:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ----------------------------------------------------------------------------- contenders
def _saver(contender: str, src: dict[str, torch.Tensor]) -> Callable[[str], None]:
    n = next(iter(src.values())).shape[0]
    if contender == "tdfunc":
        td = tdfunc.TensorDict(src, batch_size=[n])
        return lambda path: save(td, path)
    if contender == "tensordict":
        tensordict = pytest.importorskip("tensordict")
        ttd = tensordict.TensorDict(src, batch_size=[n])

        def td_save(path: str) -> None:
            ttd.memmap(path)
            _fsync_tree(path, evict=False)

        return td_save
    arrays = {k: v.numpy() for k, v in src.items()}

    def np_save(path: str) -> None:
        os.makedirs(path)
        for k, a in arrays.items():
            m = np.memmap(os.path.join(path, f"{k}.bin"), dtype=a.dtype, mode="w+", shape=a.shape)
            m[:] = a
            m.flush()
            del m

    return np_save


def _loader(contender: str, n: int) -> Callable[[str], Any]:
    if contender == "tdfunc":
        return lambda path: load(path)
    if contender == "tensordict":
        tensordict = pytest.importorskip("tensordict")
        return lambda path: tensordict.TensorDict.load_memmap(path)
    keys = [f"k{i:02d}" for i in range(LEAVES)]
    return lambda path: {
        k: np.memmap(os.path.join(path, f"{k}.bin"), dtype=np.float32, mode="r", shape=(n,))
        for k in keys
    }


def _leaves(store: Any) -> list[Any]:
    return [store[k] for k in sorted(store.keys())]


def _sum_all(store: Any) -> float:
    return float(sum(float(leaf.sum()) for leaf in _leaves(store)))


def _info(benchmark: Any, workload: str, contender: str, n: int, doc: str) -> None:
    benchmark.extra_info.update(
        workload=workload,
        mode="eager",
        contender=contender,
        category=CATEGORY,
        bytes=LEAVES * n * 4,
        leaves=LEAVES,
        doc=doc,
    )


def _rounds(bench_quick: bool, size: str) -> int:
    return 1 if bench_quick else (5 if size == "large" else 10)


# ----------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_memmap_save(benchmark, bench_quick, workdir, contender, size):
    """Save 16 float32 leaves into a new directory, durably (fsync / msync)."""
    n = _numel(size)
    src = _source(n)
    fn = _saver(contender, src)
    target = os.path.join(workdir, "store")

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        shutil.rmtree(target, ignore_errors=True)
        return (target,), {}

    _info(benchmark, f"memmap_save_{size}", contender, n, test_memmap_save.__doc__ or "")
    benchmark.pedantic(fn, setup=setup, rounds=_rounds(bench_quick, size), iterations=1)
    back = _loader(contender, n)(target)
    expected = sum(float(v.sum()) for v in src.values())
    assert abs(_sum_all(back) - expected) <= 1e-3 * max(1.0, abs(expected))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_memmap_load(benchmark, bench_quick, workdir, contender, size):
    """Open a saved 16-leaf store (lazy: no data is read)."""
    n = _numel(size)
    src = _source(n)
    target = os.path.join(workdir, "store")
    _saver(contender, src)(target)
    fn = _loader(contender, n)
    _info(benchmark, f"memmap_load_{size}", contender, n, test_memmap_load.__doc__ or "")
    store = benchmark.pedantic(fn, args=(target,), rounds=_rounds(bench_quick, size) * 10)
    assert len(_leaves(store)) == LEAVES


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_memmap_first_read(benchmark, bench_quick, workdir, contender, size):
    """Sum every leaf of a just-loaded store whose files were evicted from the page cache."""
    n = _numel(size)
    src = _source(n)
    target = os.path.join(workdir, "store")
    _saver(contender, src)(target)
    loader = _loader(contender, n)

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        # the previous round's store was dropped by read_all: nothing maps the files now, so
        # the eviction really empties the page cache of them
        gc.collect()
        _fsync_tree(target, evict=True)
        return ([loader(target)],), {}

    def read_all(holder: list[Any]) -> float:
        return _sum_all(holder.pop())

    _info(
        benchmark, f"memmap_first_read_{size}", contender, n, test_memmap_first_read.__doc__ or ""
    )
    total = benchmark.pedantic(
        read_all, setup=setup, rounds=_rounds(bench_quick, size), iterations=1
    )
    expected = sum(float(v.sum()) for v in src.values())
    assert abs(total - expected) <= 1e-3 * max(1.0, abs(expected))


# ----------------------------------------------------------------------------- first read by mode
FIRST_READ_BYTES = 256 << 20  # 16 leaves x 16 MiB
READ_CONTENDERS = ("tdfunc_r", "tdfunc_c", "tdfunc_r+", "numpy")

_FRESH = """
import sys, time, numpy as np, torch
torch.set_num_threads(1)
import tdfunc
path, how, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
keys = [f"k{i:02d}" for i in range(16)]
t0 = time.perf_counter()
if how == "numpy":
    store = {k: np.memmap(f"{path}/{k}.bin", dtype=np.float32, mode="r", shape=(n,)) for k in keys}
else:
    store = tdfunc.load(path, mode=how.split("_")[1])
total = sum(float(store[k].sum()) for k in keys)
print(time.perf_counter() - t0)
"""


def _fresh_process_s(path: str, how: str, n: int) -> float:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FRESH, path, how, str(n)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("contender", READ_CONTENDERS)
def test_memmap_first_read_by_mode(benchmark, bench_quick, workdir, contender, cache):
    """Load a 256 MiB, 16-leaf store and sum every leaf (the first full read), with the files in
    the page cache (warm) or evicted from it (cold). tdfunc in modes "r", "c" and "r+" against
    ``numpy.memmap(mode="r")``. The timed read runs in a process that has already used a
    memory-mapped leaf once; ``extra_info["fresh_process_s"]`` is the same load + read in a new
    process (``test_memmap_first_read_fresh`` compares that side by side with numpy)."""
    n = FIRST_READ_BYTES // LEAVES // 4
    src = _source(n)
    target = os.path.join(workdir, "store")
    if contender == "numpy":
        _saver("numpy", src)(target)
        how = "numpy"
        loader = _loader("numpy", n)
    else:
        save(tdfunc.TensorDict(src, batch_size=[n]), target)
        how = contender
        mode = contender.split("_")[1]

        def loader(path: str) -> Any:
            return load(path, mode=mode)

    # anything paid once per process is paid here, not in the rounds
    tmp = os.path.join(workdir, "warmup")
    save(tdfunc.TensorDict(x=torch.zeros(4), batch_size=[4]), tmp)
    float(load(tmp)["x"].sum())

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        gc.collect()
        _fsync_tree(target, evict=cache == "cold")
        if cache == "warm":
            _sum_all(loader(target))  # in the page cache
        return (target,), {}

    def first_read(path: str) -> float:
        return _sum_all(loader(path))

    _info(
        benchmark,
        f"memmap_first_read_256MiB_{cache}",
        contender,
        n,
        test_memmap_first_read_by_mode.__doc__ or "",
    )
    if cache == "cold":
        _fsync_tree(target, evict=True)
    benchmark.extra_info["fresh_process_s"] = _fresh_process_s(target, how, n)
    total = benchmark.pedantic(
        first_read, setup=setup, rounds=3 if bench_quick else 10, iterations=1
    )
    expected = sum(float(v.sum()) for v in src.values())
    assert abs(total - expected) <= 1e-3 * max(1.0, abs(expected))


# ----------------------------------------------------------------------------- first read, new process
FRESH_CONTENDERS = ("tdfunc_r", "tdfunc_c", "numpy", "numpy_aa")

_FRESH_PAIRED = """
import json, sys, time, numpy as np, torch
torch.set_num_threads(1)
import tdfunc
path, how = sys.argv[1], sys.argv[2]
meta = json.load(open(f"{path}/manifest.json"))
leaves = sorted(meta["root"]["children"].items())
t0 = time.perf_counter()
if how.startswith("numpy"):
    data = f"{path}/{meta['data_file']}"
    store = {
        k: np.memmap(data, dtype=np.float32, mode="r", offset=e["offset"], shape=tuple(e["shape"]))
        for k, e in leaves
    }
else:
    store = tdfunc.load(path, mode=how.split("_")[1])
total = sum(float(store[k].sum()) for k, _ in leaves)
print(time.perf_counter() - t0, total)
"""

#: the paired measurements, made by the first item and read by the others (once per run, not
#: once per pass: the rounds are paired and ``numpy_aa`` is their A/A control, so further
#: passes would only repeat what that control already gives: 44 new processes each)
_FRESH_RESULTS: dict[str, list[float]] = {}


def _fresh_paired_s(path: str, how: str) -> tuple[float, float]:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FRESH_PAIRED, path, how],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    seconds, total = out.stdout.strip().splitlines()[-1].split()
    return float(seconds), float(total)


def _fresh_rounds(path: str, rounds: int) -> dict[str, list[float]]:
    """Each round runs every contender once, each in a new process, in alternating order
    (forward, then reverse): the slow drifts of a shared machine hit every contender alike."""
    times: dict[str, list[float]] = {c: [] for c in FRESH_CONTENDERS}
    totals = []
    for r in range(rounds):
        order = FRESH_CONTENDERS if r % 2 == 0 else FRESH_CONTENDERS[::-1]
        for c in order:
            seconds, total = _fresh_paired_s(path, c)
            times[c].append(seconds)
            totals.append(total)
    # every contender read the same values (float32 sums may differ in the last digits)
    assert max(totals) - min(totals) <= 1e-3 * max(1.0, abs(totals[0])), totals
    return times


@pytest.mark.bench_full_only
@pytest.mark.parametrize("contender", FRESH_CONTENDERS)
def test_memmap_first_read_fresh(benchmark, bench_quick, workdir, contender):
    """Load a 256 MiB, 16-leaf store and sum every leaf in a new process (what each DataLoader
    worker does first), the files in the page cache: tdfunc in modes "r" and "c" against
    ``numpy.memmap(mode="r")`` over the same bytes of the same file. The rounds are paired:
    each runs every contender once, in alternating order, and the ratio is the median of the
    per-round ratios (``extra_info["ratio_vs_numpy"]``; target <= 1.2). ``numpy_aa`` is a second
    numpy run measured exactly like the others: its ratio shows the noise of the method."""
    import statistics

    n = FIRST_READ_BYTES // LEAVES // 4
    if not _FRESH_RESULTS:
        target = os.path.join(workdir, "store")
        save(tdfunc.TensorDict(_source(n), batch_size=[n]), target)
        _fsync_tree(target, evict=False)
        _fresh_paired_s(target, "numpy")  # the data in the page cache
        _FRESH_RESULTS.update(_fresh_rounds(target, 3 if bench_quick else 11))
    times = _FRESH_RESULTS
    mine, base = times[contender], times["numpy"]
    ratios = [a / b for a, b in zip(mine, base)]
    _info(
        benchmark,
        "memmap_first_read_fresh_256MiB",
        contender,
        n,
        test_memmap_first_read_fresh.__doc__ or "",
    )
    benchmark.extra_info.update(
        rounds_s=mine,
        ratio_vs_numpy=statistics.median(ratios),
        ratio_vs_numpy_rounds=ratios,
        ratio_vs_numpy_range=[min(ratios), max(ratios)],
    )
    # the timed rounds replay the times the children measured (their own clock, from before
    # the load to after the last sum), so the report's time columns are those times
    clock = iter([t for s in mine for t in (0.0, s)])
    benchmark._timer = lambda: next(clock)  # pytest-benchmark reads its timer from here
    benchmark.pedantic(lambda: None, rounds=len(mine), iterations=1)
