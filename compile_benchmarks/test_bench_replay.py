"""Replay-buffer sampling from an on-disk store, side by side: ``tdfunc.load`` against
tensordict's memmap and raw ``numpy.memmap`` files (the floor).

The store: ``ROWS`` transitions of ``obs`` ``[124]`` float32, ``("next", "obs")`` ``[124]``
float32, ``action`` ``[6]`` float32, ``reward`` float32 and ``done`` bool (1021 bytes a row):
2**20 rows = 1.0 GiB in full mode, 2**14 rows = 16 MiB in quick mode (CI). Every contender
writes its own copy once per session (tdfunc: :func:`tdfunc.save`; tensordict:
``TensorDict.memmap``; numpy: one raw file per leaf), opens it lazily (``tdfunc.load``,
``TensorDict.load_memmap``, ``numpy.memmap(mode="r")``) and the workload is:

* ``replay_sample_256``: gather 256 random rows (the same indices for every contender, a new
  set each call from a seeded generator) into in-memory tensors: ``store[idx]`` for the two
  containers, ``torch.from_numpy(array[idx])`` per leaf for numpy. ``extra_info["rows"]`` turns
  the time into rows/s (the target is tdfunc >= 1.0x numpy's rows/s, i.e. a time ratio
  <= 1.0).

The pages are in the page cache (the store was just written): this measures the cost of
gathering rows through each library, not the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tdfunc

CATEGORY = "replay"
BATCH = 256
ROWS = {"full": 1 << 20, "quick": 1 << 14}
LEAVES: dict[tuple[str, ...], tuple[tuple[int, ...], torch.dtype]] = {
    ("obs",): ((124,), torch.float32),
    ("next", "obs"): ((124,), torch.float32),
    ("action",): ((6,), torch.float32),
    ("reward",): ((), torch.float32),
    ("done",): ((), torch.bool),
}
CONTENDERS_HERE = ("tdfunc", "tensordict", "numpy")


def _nested(rows: int) -> dict[str, Any]:
    """The seeded source data as nested dicts of tensors (generated leaf by leaf)."""
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for path, (shape, dtype) in LEAVES.items():
        if dtype == torch.bool:
            value = torch.rand((rows, *shape), generator=g) < 0.05
        else:
            value = torch.randn((rows, *shape), generator=g, dtype=dtype)
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def _leaf(d: dict[str, Any], path: tuple[str, ...]) -> torch.Tensor:
    for k in path:
        d = d[k]
    return d  # type: ignore[return-value]


@pytest.fixture(scope="module")
def stores(bench_size: Callable[[Any, Any], Any]) -> Iterator[dict[str, Any]]:
    """The three on-disk copies of one store, opened lazily; removed after the module."""
    rows = bench_size(ROWS["full"], ROWS["quick"])
    root = tempfile.mkdtemp(prefix="tdfunc-bench-replay-")
    try:
        src = _nested(rows)
        opened: dict[str, Any] = {"rows": rows}
        td = tdfunc.TensorDict(src, batch_size=[rows])
        tdfunc.save(td, os.path.join(root, "tdfunc"))
        opened["tdfunc"] = tdfunc.load(os.path.join(root, "tdfunc"))
        del td
        tensordict = pytest.importorskip("tensordict", reason="tensordict is not installed")
        if tensordict is not None:
            path = os.path.join(root, "tensordict")
            tensordict.TensorDict(src, batch_size=[rows]).memmap(path)
            opened["tensordict"] = tensordict.TensorDict.load_memmap(path)
        arrays = {}
        for leaf_path in LEAVES:
            value = _leaf(src, leaf_path).numpy()
            fname = os.path.join(root, "numpy_" + "_".join(leaf_path) + ".bin")
            value.tofile(fname)
            arrays[leaf_path] = np.memmap(fname, dtype=value.dtype, mode="r", shape=value.shape)
        opened["numpy"] = arrays
        del src
        yield opened
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _numpy_sample(arrays: dict[tuple[str, ...], np.memmap], idx: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, arr in arrays.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = torch.from_numpy(arr[idx])
    return out


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
def test_replay_sample(measure: Callable[..., Any], stores: dict[str, Any], contender: str) -> None:
    """Replay sampling: 256 random rows gathered from an on-disk store into memory."""
    if contender not in stores:
        pytest.skip(f"{contender} is not installed")
    rows = stores["rows"]
    store = stores[contender]
    # A new generator per contender: the first call (the harness's check that every contender
    # returns the same rows) draws the same indices everywhere; later calls draw new ones.
    gen = torch.Generator().manual_seed(1)

    if contender == "numpy":

        def sample() -> Any:
            idx = torch.randint(0, rows, (BATCH,), generator=gen)
            return _numpy_sample(store, idx.numpy())

    else:

        def sample() -> Any:
            idx = torch.randint(0, rows, (BATCH,), generator=gen)
            return store[idx]

    measure(
        sample,
        workload="replay_sample_256",
        mode="eager",
        contender=contender,
        category=CATEGORY,
        rows=BATCH,
        store_rows=rows,
        store_bytes=rows * _row_bytes(),
        doc=f"{BATCH} random rows gathered from a {rows * _row_bytes() / 2**20:.0f} MiB store",
    )


def _row_bytes() -> int:
    total = 0
    for shape, dtype in LEAVES.values():
        n = 1
        for s in shape:
            n *= s
        total += n * torch.empty((), dtype=dtype).element_size()
    return total
