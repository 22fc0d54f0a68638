"""Reads of memory-mapped leaves without Python ``__torch_dispatch__``: a fresh process reads
a store without torch's one-time import on the first subclass dispatch, and every result that
aliases a read-only leaf still refuses writes (the read path gives up no guarantee)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tdfunc
from tdfunc import MemoryMappedTensor, TensorDict, load, save
from tdfunc.memmap import _errors as E

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys
import torch
import tdfunc
store = tdfunc.load(sys.argv[1], mode=sys.argv[2])
x = store["x"]
out = {
    "sum": float(x.sum()),
    "rows": store[torch.tensor([1, 3])]["x"].tolist(),
    "slice": type(x[1:3]).__name__,
    "shape": list(x.shape),
    "mean_td": float(store.apply(lambda t: t * 2)["x"].mean()),
}
out["imported"] = "torch.distributed.tensor" in sys.modules
print("REPORT " + json.dumps(out))
"""


def _file_bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "s"
    save(TensorDict(x=torch.arange(12.0).reshape(6, 2), batch_size=[6]), path)
    return path


@pytest.mark.parametrize("mode", ["r", "c", "r+"])
def test_fresh_process_reads_without_the_subclass_dispatch_import(store, mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(store), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    out = json.loads(line[len("REPORT ") :])
    assert out["sum"] == 66.0
    assert out["rows"] == [[2.0, 3.0], [6.0, 7.0]]
    assert out["slice"] == "MemoryMappedTensor"
    assert out["shape"] == [6, 2]
    assert out["mean_td"] == 11.0
    # torch imports torch.distributed.tensor (~0.7 s) on the first Python dispatch of a
    # tensor subclass: a read must not get there
    assert out["imported"] is False


def _leaf(store: Path, mode: str = "r") -> MemoryMappedTensor:
    x = load(store, mode=mode)["x"]
    assert isinstance(x, MemoryMappedTensor)
    return x


ALIASES = {
    "to_same": lambda x: x.to(torch.float32),
    "to_copy_false": lambda x: x.to("cpu", copy=False),
    "contiguous": lambda x: x.contiguous(),
    "detach": lambda x: x.detach(),
    "view_as": lambda x: x.view_as(torch.empty(6, 2)),
    "as_strided": lambda x: torch.as_strided(x, (3,), (2,)),
    "transpose": lambda x: x.transpose(0, 1),
    "mT": lambda x: x.mT,
    "getitem_ellipsis": lambda x: x[...],
    "getitem_none": lambda x: x[None],
    "select": lambda x: torch.select(x, 0, 1),
    "flatten": lambda x: x.flatten(),
    "movedim": lambda x: torch.movedim(x, 0, 1),
    "broadcast_to": lambda x: torch.broadcast_to(x[0], (4, 2)),
    "real": lambda x: torch.real(x),
}


@pytest.mark.parametrize("op", list(ALIASES))
def test_results_aliasing_a_read_only_leaf_refuse_writes(store, op):
    data = store / "data.bin"
    before = _file_bytes(data)
    x = _leaf(store)
    y = ALIASES[op](x)
    assert isinstance(y, MemoryMappedTensor), type(y)
    assert y.mode == "r"
    assert y.filename == x.filename
    with pytest.raises(PermissionError, match=E.READ_ONLY.split("{")[0]):
        y.add_(1)
    with pytest.raises(PermissionError):
        y.zero_()
    assert _file_bytes(data) == before
    torch.testing.assert_close(x, torch.arange(12.0).reshape(6, 2))


def test_views_made_in_inference_mode_refuse_writes(store):
    x = _leaf(store)
    with torch.inference_mode():
        v = x[1:3]
    assert isinstance(v, MemoryMappedTensor)
    with pytest.raises(PermissionError):
        v.fill_(0)
    torch.testing.assert_close(x, torch.arange(12.0).reshape(6, 2))


def test_results_that_do_not_alias_are_plain(store):
    x = _leaf(store)
    results = [
        x + 1,
        1 + x,
        -x,
        x * x,
        x @ x.T,
        x == 2,
        x.sum(0),
        x.clone(),
        x.to(torch.float64),
        x[torch.tensor([0, 2])],
        x[x > 3],
        torch.stack([x, x]),
        torch.cat([x, x]),
        x.max(0).values,
        x.pin_memory() if torch.cuda.is_available() else x.clone(),
    ]
    for r in results:
        assert type(r) is torch.Tensor
    values, indices = x.max(0)
    assert type(values) is torch.Tensor
    assert type(indices) is torch.Tensor
    assert values.tolist() == [10.0, 11.0]
    parts = x.unbind(0)
    assert all(isinstance(p, MemoryMappedTensor) and p.mode == "r" for p in parts)
    assert [p.tolist() for p in parts[:2]] == [[0.0, 1.0], [2.0, 3.0]]


WRITES = {
    "out_kw": lambda x: torch.add(torch.ones(6, 2), 1, out=x),
    "out_into_view": lambda x: torch.sum(torch.ones(3, 2), 0, out=x[0]),
    "relu_inplace": lambda x: torch.nn.functional.relu(x, inplace=True),
    "dropout_inplace": lambda x: torch.nn.functional.dropout(x, 0.5, True, True),
    "init": lambda x: torch.nn.init.zeros_(x),
    "setitem_view": lambda x: x.T.__setitem__(0, 1.0),
    "iadd": lambda x: x.__iadd__(1),
    "foreach": lambda x: torch._foreach_mul_([x[0], x[1]], 2.0),
    "copy_into_alias": lambda x: x.to(torch.float32).copy_(torch.zeros(6, 2)),
    "masked_fill_": lambda x: x.masked_fill_(x > 2, 0.0),
    "set_": lambda x: x.set_(torch.zeros(3)),
}


@pytest.mark.parametrize("op", list(WRITES))
def test_writes_to_a_read_only_leaf_are_refused(store, op):
    data = store / "data.bin"
    before = _file_bytes(data)
    x = _leaf(store)
    with pytest.raises(PermissionError, match=E.READ_ONLY.split("{")[0]):
        WRITES[op](x)
    assert _file_bytes(data) == before
    torch.testing.assert_close(x, torch.arange(12.0).reshape(6, 2))


@pytest.mark.parametrize("mode", ["r+", "c"])
def test_writable_modes_write_through_the_read_path_views(store, mode):
    data = store / "data.bin"
    before = _file_bytes(data)
    x = _leaf(store, mode)
    v = x.to(torch.float32)[1]
    assert isinstance(v, MemoryMappedTensor)
    assert v.mode == mode
    v.add_(100)
    assert x[1].tolist() == [102.0, 103.0]
    if mode == "c":
        assert _file_bytes(data) == before
    else:
        assert load(store)["x"][1].tolist() == [102.0, 103.0]


def test_numpy_of_a_read_path_view_is_not_writeable(store):
    v = _leaf(store)[2:]
    arr = v.numpy()
    assert not arr.flags.writeable
    np.testing.assert_array_equal(arr, np.arange(4.0, 12.0, dtype=np.float32).reshape(4, 2))


class _Other(torch.Tensor):
    """A tensor subclass of another library (torch's default ``__torch_function__``)."""


def test_other_operands_keep_their_own_handlers(store):
    x = _leaf(store)
    other = torch.ones(6, 2).as_subclass(_Other)
    for r in (x + other, other + x, torch.add(x, other)):
        assert type(r) is _Other
        torch.testing.assert_close(
            r.as_subclass(torch.Tensor), torch.arange(12.0).reshape(6, 2) + 1
        )
    td = TensorDict(x=torch.ones(6, 2), batch_size=[6, 2])  # x is shaped like the batch
    r = x + td
    assert isinstance(r, TensorDict)
    torch.testing.assert_close(r["x"], torch.arange(12.0).reshape(6, 2) + 1)
    r = td * x
    assert isinstance(r, TensorDict)
    torch.testing.assert_close(r["x"], torch.arange(12.0).reshape(6, 2))


def test_metadata_is_the_leafs(store):
    x = _leaf(store)
    assert x.shape == (6, 2)
    assert x.size() == (6, 2)
    assert x.size(1) == 2
    assert x.stride() == (2, 1)
    assert x.dim() == 2
    assert x.ndim == 2
    assert x.numel() == 12
    assert x.dtype == torch.float32
    assert x.device == torch.device("cpu")
    assert x.is_contiguous()
    assert not x.requires_grad
    v = x[1:]
    assert v.storage_offset() == 2
    version = x._version
    with pytest.raises(PermissionError):
        x.add_(1)
    assert x._version == version


def test_autograd_through_reads(store):
    x = _leaf(store)
    w = torch.ones(2, requires_grad=True)
    (x * w).sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([30.0, 36.0]))
    assert not x.requires_grad


def test_tdfunc_ops_on_a_loaded_store(store):
    td = load(store)
    got = tdfunc.stack([td[0:2], td[4:6]])
    assert got.batch_size == (2, 2)
    torch.testing.assert_close(got["x"][1], torch.tensor([[8.0, 9.0], [10.0, 11.0]]))
    assert isinstance(td[1:]["x"], MemoryMappedTensor)
    assert type(td[torch.tensor([0, 5])]["x"]) is torch.Tensor
