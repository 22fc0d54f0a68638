"""safetensors files: ``tdfunc.save_safetensors`` / ``load_safetensors`` against the
``safetensors`` package (``safetensors.torch.save_file`` / ``load_file``) and tdfunc's own
store (``tdfunc.save`` / ``tdfunc.load``).

The data: 200 float32 leaves in a nested TensorDict (20 modules x 10 tensors, the shape of a
model's state dict). Two sizes:

* ``small`` (200 x 5 KiB = 1 MiB): always, also in quick mode (CI).
* ``large`` (200 x 5.24 MiB = 1 GiB): only with ``TDFUNC_BENCH_LARGE=1`` (or
  ``TDFUNC_BENCH_FULL=1``); it needs about 3 GiB of free disk space and 2 GiB of memory.

Workloads (eager: file I/O is not compiled):

* ``safetensors_save``: write the 200 leaves as a new file (tdfunc: ``save_safetensors``, which
  fsyncs; safetensors: ``save_file`` then ``fsync``; tdfunc store: ``save``, which fsyncs).
* ``safetensors_load``: open a saved file. tdfunc maps it (reads the header only);
  ``load_file`` reads every tensor into memory; ``tdfunc.load`` maps its store.
* ``safetensors_load_read``: open and sum every leaf (the whole file read through the page
  cache), so a lazy open is compared with an eager read fairly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import load_safetensors, save_safetensors

CATEGORY = "interop"
MODULES, PER_MODULE = 20, 10
LEAVES = MODULES * PER_MODULE
SIZES = {"small": 5 << 10, "large": (1 << 30) // LEAVES}  # bytes per leaf
CONTENDERS = ("tdfunc", "safetensors", "tdfunc_store")
LARGE_ENV = ("TDFUNC_BENCH_LARGE", "TDFUNC_BENCH_FULL")


def _large_enabled() -> bool:
    return any(os.environ.get(v, "") not in ("", "0", "false", "no") for v in LARGE_ENV)


def _numel(size: str) -> int:
    if size == "large" and not _large_enabled():
        pytest.skip("the 1 GiB variant runs only with TDFUNC_BENCH_LARGE=1")
    return SIZES[size] // 4


def _source(n: int) -> tdfunc.TensorDict:
    g = torch.Generator().manual_seed(0)
    return tdfunc.TensorDict(
        {
            f"layer{m}": {f"w{i}": torch.randn(n, generator=g) for i in range(PER_MODULE)}
            for m in range(MODULES)
        }
    )


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="tdfunc-bench-interop-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- contenders
def _saver(contender: str, td: tdfunc.TensorDict) -> Callable[[str], None]:
    if contender == "tdfunc":
        return lambda path: save_safetensors(td, path)
    if contender == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        flat = {".".join(k): v for k, v in td.items(include_nested=True, leaves_only=True)}

        def st_save(path: str) -> None:
            st.save_file(flat, path)
            _fsync(path)

        return st_save
    return lambda path: tdfunc.save(td, path)


def _loader(contender: str) -> Callable[[str], Any]:
    if contender == "tdfunc":
        return load_safetensors
    if contender == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        return st.load_file
    return tdfunc.load


def _leaves(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, dict):
        return list(obj.values())
    return [v for _, v in obj.items(include_nested=True, leaves_only=True)]


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
    return 1 if bench_quick else (3 if size == "large" else 10)


# ----------------------------------------------------------------------------- workloads
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_safetensors_save(benchmark, bench_quick, workdir, contender, size):
    """Write 200 float32 leaves (20 modules x 10) as a new file, durably."""
    n = _numel(size)
    td = _source(n)
    fn = _saver(contender, td)
    target = os.path.join(workdir, "x")

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.exists(target):
            os.unlink(target)
        return (target,), {}

    _info(benchmark, f"safetensors_save_{size}", contender, n, test_safetensors_save.__doc__ or "")
    benchmark.pedantic(fn, setup=setup, rounds=_rounds(bench_quick, size), iterations=1)
    back = _loader(contender)(target)
    assert len(_leaves(back)) == LEAVES


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_safetensors_load(benchmark, bench_quick, workdir, contender, size):
    """Open a saved 200-leaf file (tdfunc: mapped, lazy; load_file: read into memory)."""
    n = _numel(size)
    target = os.path.join(workdir, "x")
    _saver(contender, _source(n))(target)
    fn = _loader(contender)
    _info(benchmark, f"safetensors_load_{size}", contender, n, test_safetensors_load.__doc__ or "")
    out = benchmark.pedantic(fn, args=(target,), rounds=_rounds(bench_quick, size) * 5)
    assert len(_leaves(out)) == LEAVES


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("contender", CONTENDERS)
def test_safetensors_load_read(benchmark, bench_quick, workdir, contender, size):
    """Open a saved 200-leaf file and sum every leaf (warm page cache)."""
    n = _numel(size)
    target = os.path.join(workdir, "x")
    src = _source(n)
    _saver(contender, src)(target)
    loader = _loader(contender)

    def read_all() -> float:
        return float(sum(float(v.sum()) for v in _leaves(loader(target))))

    _info(
        benchmark,
        f"safetensors_load_read_{size}",
        contender,
        n,
        test_safetensors_load_read.__doc__ or "",
    )
    total = benchmark.pedantic(read_all, rounds=_rounds(bench_quick, size))
    expected = float(sum(float(v.sum()) for v in _leaves(src)))
    assert abs(total - expected) <= 1e-3 * max(1.0, abs(expected))
