"""Memory-mapped storage: MemoryMappedTensor modes, save / load / memmap_like, the on-disk
format and its bad inputs, atomic saves, read-only safety (also through numpy / ctypes and
without file permissions, in child processes), pickling by reference, DataLoader workers,
torch.compile with the eager / aot_eager / inductor backends."""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import check_compiled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import (
    MemmapFormatError,
    MemoryMappedTensor,
    TensorDict,
    load,
    memmap_like,
    save,
    tensorclass,
)
from tdfunc.memmap import _errors as E
from tdfunc.memmap import _store as S
from tdfunc.memmap._tensor import DTYPES
from tdfunc.testing import assert_close

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HELPERS = HERE / "_memmap_helpers.py"
CHILD_TIMEOUT_S = 240


# ------------------------------------------------------------------------------ helpers
def sample(seed: int = 0, n: int = 6) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        obs=torch.randn(n, 3, generator=g),
        action=torch.randint(0, 5, (n,), generator=g),
        next={"reward": torch.randn(n, generator=g), "done": torch.rand(n, generator=g) > 0.5},
        batch_size=[n],
    )


def data_path(store: str | Path) -> Path:
    """The data file of a store (its name, unique to each saved version, is in the manifest)."""
    m = json.loads(Path(store, "manifest.json").read_text())
    return Path(store, m["data_file"])


def file_bytes(path: str | Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def leaf_file(tmp_path: Path, values: torch.Tensor, name: str = "x.bin") -> str:
    f = str(tmp_path / name)
    MemoryMappedTensor.from_tensor(values, f)
    return f


def fmt(template: str) -> str:
    """The constant part of a message template (up to its first placeholder), as a regex."""
    return re.escape(template.split("{")[0])


def run_child(args: list[str], **kw) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(HELPERS), *args],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
        cwd=str(ROOT),
        **kw,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


# ------------------------------------------------------------------------------ constructors
def test_from_tensor_writes_file_and_maps_read_write(tmp_path):
    src = torch.arange(12.0).reshape(3, 4)
    before = src.clone()
    f = tmp_path / "a.bin"
    m = MemoryMappedTensor.from_tensor(src, f)
    assert isinstance(m, MemoryMappedTensor)
    assert m.mode == "r+"
    assert m.filename == str(f)
    assert os.path.isabs(m.filename)
    assert m.shape == (3, 4)
    assert m.dtype == torch.float32
    torch.testing.assert_close(m, src)
    assert os.path.getsize(f) == 48
    np.testing.assert_array_equal(np.fromfile(f, dtype=np.float32), np.arange(12.0))
    torch.testing.assert_close(src, before)  # the input is not modified
    # non-contiguous input: row-major bytes
    m2 = MemoryMappedTensor.from_tensor(src.t(), tmp_path / "t.bin")
    np.testing.assert_array_equal(
        np.fromfile(tmp_path / "t.bin", dtype=np.float32), src.t().contiguous().reshape(-1).numpy()
    )
    assert m2.is_contiguous()
    # a memory-mapped source copied to another file
    m3 = MemoryMappedTensor.from_tensor(m[1:], tmp_path / "c.bin")
    assert m3.filename == str(tmp_path / "c.bin")
    assert torch.equal(m3, src[1:])


def test_from_tensor_exist_ok(tmp_path):
    f = tmp_path / "a.bin"
    MemoryMappedTensor.from_tensor(torch.zeros(3), f)
    with pytest.raises(FileExistsError, match="already exists; pass exist_ok=True") as ei:
        MemoryMappedTensor.from_tensor(torch.ones(3), f)
    assert str(f) in str(ei.value)
    np.testing.assert_array_equal(np.fromfile(f, dtype=np.float32), np.zeros(3))
    m = MemoryMappedTensor.from_tensor(torch.ones(2), f, exist_ok=True)
    assert m.tolist() == [1.0, 1.0]
    assert os.path.getsize(f) == 8
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # no temporary file left
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(f).st_mode & 0o777 == 0o666 & ~umask


def test_from_filename_offset_and_default_read_only(tmp_path):
    f = tmp_path / "raw.bin"
    np.arange(10, dtype=np.int64).tofile(f)
    m = MemoryMappedTensor.from_filename(f, torch.int64, (2, 3), offset=16)
    assert m.mode == "r"
    assert m.tolist() == [[2, 3, 4], [5, 6, 7]]
    assert MemoryMappedTensor.from_filename(f, torch.int64, 10).shape == (10,)


def test_from_filename_bad_input(tmp_path):
    f = tmp_path / "raw.bin"
    np.zeros(4, dtype=np.float32).tofile(f)
    with pytest.raises(ValueError, match="holds 16 bytes, but 20 bytes are needed") as ei:
        MemoryMappedTensor.from_filename(f, torch.float32, (5,))
    assert str(f) in str(ei.value)
    with pytest.raises(ValueError, match="holds 16 bytes, but 20 bytes"):
        MemoryMappedTensor.from_filename(f, torch.float32, (4,), offset=4)
    with pytest.raises(ValueError, match=fmt(E.BAD_OFFSET)):
        MemoryMappedTensor.from_filename(f, torch.float32, (2,), offset=2)
    with pytest.raises(ValueError, match=fmt(E.BAD_MODE)):
        MemoryMappedTensor.from_filename(f, torch.float32, (2,), mode="w")
    with pytest.raises(ValueError, match=fmt(E.BAD_SHAPE)):
        MemoryMappedTensor.from_filename(f, torch.float32, (2, -1))
    with pytest.raises(TypeError, match=fmt(E.UNSUPPORTED_DTYPE)):
        MemoryMappedTensor.from_filename(f, torch.qint8, (2,))
    with pytest.raises(FileNotFoundError):
        MemoryMappedTensor.from_filename(tmp_path / "nope.bin", torch.float32, (2,))


def test_empty_zeros_and_direct_construction(tmp_path):
    z = MemoryMappedTensor.zeros((2, 3), torch.float64, tmp_path / "z.bin")
    assert z.mode == "r+"
    assert z.dtype == torch.float64
    assert z.tolist() == [[0.0] * 3] * 2
    assert os.path.getsize(tmp_path / "z.bin") == 48
    e = MemoryMappedTensor.empty(5, torch.int16, tmp_path / "e.bin")
    assert e.shape == (5,)
    assert e.dtype == torch.int16
    e[1] = 7
    assert np.fromfile(tmp_path / "e.bin", dtype=np.int16).tolist() == [0, 7, 0, 0, 0]
    with pytest.raises(FileExistsError):
        MemoryMappedTensor.empty(5, torch.int16, tmp_path / "e.bin")
    empty = MemoryMappedTensor.zeros((0, 3), torch.float32, tmp_path / "n.bin")
    assert empty.shape == (0, 3)
    assert empty.numel() == 0
    with pytest.raises(TypeError, match=fmt(E.NO_CONSTRUCTOR)):
        MemoryMappedTensor(torch.zeros(2))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_supported_dtype_round_trips_bit_exact(tmp_path, name):
    dtype = DTYPES[name]
    raw = torch.randint(0, 256, (5, 3 * dtype.itemsize), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    t = raw.view(dtype)
    save(TensorDict(x=t, batch_size=[5]), tmp_path / "s")
    back = load(tmp_path / "s")["x"]
    assert back.dtype == dtype
    assert back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), raw)


_PROP_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.bfloat16]


@st.composite
def stored_trees(draw, depth: int = 0, batch: tuple = ()):
    """Random nested TensorDicts: random keys, dtypes, feature shapes (zero sizes included),
    nested batch dims, non-contiguous leaves."""
    batch = tuple(batch) + tuple(draw(st.lists(st.integers(0, 3), max_size=2 if depth == 0 else 1)))
    data = {}
    for i in range(draw(st.integers(0, 4))):
        if depth < 2 and draw(st.booleans()):
            data[f"n{i}"] = draw(stored_trees(depth + 1, batch))
        else:
            feat = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            dtype = draw(st.sampled_from(_PROP_DTYPES))
            g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
            leaf = (torch.randn(batch + feat, generator=g) * 10).to(dtype)
            if len(feat) == 2 and draw(st.booleans()):
                leaf = leaf.transpose(-1, -2)  # non-contiguous
            data[f"k{i}"] = leaf
    return TensorDict(data, batch_size=batch)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(td=stored_trees())
def test_property_save_load_pickle_round_trip(tmp_path, td):
    """Any container: load(save(td)) == td in every mode, and a pickled store loads equal."""
    path = tmp_path / "p"
    save(td, path, overwrite=True)
    for mode in ("r", "c"):
        back = load(path, mode=mode)
        assert back.batch_size == td.batch_size
        assert list(back.keys(include_nested=True)) == list(td.keys(include_nested=True))
        assert_close(back, td)
    assert_close(pickle.loads(pickle.dumps(load(path))), td)


# ------------------------------------------------------------------------------ modes and views
def test_arithmetic_is_plain_and_views_keep_mode(tmp_path):
    f = leaf_file(tmp_path, torch.arange(24.0).reshape(4, 6))
    x = MemoryMappedTensor.from_filename(f, torch.float32, (4, 6))
    for y in (x + 1, x * x, x.sum(0), x.clone(), torch.stack([x, x]), x[torch.tensor([0, 2])]):
        assert type(y) is torch.Tensor
    views = [
        x[1],
        x[1:3, ::2],
        x.view(24),
        x.reshape(2, 12),
        x.t(),
        x.detach(),
        x[0].expand(3, 6),
        *x.unbind(0),
        *x.split(2),
        *x.chunk(3, 1),
        x.unsqueeze(0),
        x.narrow(1, 2, 2),
    ]
    for v in views:
        assert isinstance(v, MemoryMappedTensor), v
        assert v.mode == "r"
        assert v.filename == f
    torch.testing.assert_close(x[1:3, ::2], torch.arange(24.0).reshape(4, 6)[1:3, ::2])


WRITES = {
    "add_": lambda x: x.add_(1),
    "copy_": lambda x: x.copy_(torch.zeros(4, 6)),
    "fill_": lambda x: x.fill_(3.0),
    "setitem": lambda x: x.__setitem__(0, 5.0),
    "setitem_mask": lambda x: x.__setitem__(x > 3, 0.0),
    "out=": lambda x: torch.add(torch.ones(4, 6), 1, out=x),
    "zero_view": lambda x: x[1:].zero_(),
    "unbind_view": lambda x: x.unbind(0)[2].mul_(2),
    "view_copy": lambda x: x.view(-1).copy_(torch.zeros(24)),
    "foreach": lambda x: torch._foreach_add_([x], 1.0),
    "relu_": lambda x: torch.relu_(x),
    "init": lambda x: torch.nn.init.normal_(x),
    "index_put_": lambda x: x.index_put_((torch.tensor([0]),), torch.tensor(1.0)),
    "resize_": lambda x: x.resize_(2),
}


@pytest.mark.parametrize("op", list(WRITES))
def test_write_to_read_only_leaf_raises_and_changes_nothing(tmp_path, op):
    f = leaf_file(tmp_path, torch.arange(24.0).reshape(4, 6))
    before = file_bytes(f)
    x = MemoryMappedTensor.from_filename(f, torch.float32, (4, 6), mode="r")
    with pytest.raises(PermissionError, match=fmt(E.READ_ONLY)) as ei:
        WRITES[op](x)
    assert f in str(ei.value)
    assert "mode='r+'" in str(ei.value)
    assert file_bytes(f) == before
    torch.testing.assert_close(x, torch.arange(24.0).reshape(4, 6))  # memory unchanged too
    assert x.shape == (4, 6)


def test_read_write_mode_reaches_the_file_and_other_mappings(tmp_path):
    f = leaf_file(tmp_path, torch.zeros(4, 6))
    w = MemoryMappedTensor.from_filename(f, torch.float32, (4, 6), mode="r+")
    r = MemoryMappedTensor.from_filename(f, torch.float32, (4, 6), mode="r")
    w[1] = 2.0
    w.unbind(0)[3].add_(5)
    torch.add(w[0], 1, out=w[0])
    expected = torch.zeros(4, 6)
    expected[0], expected[1], expected[3] = 1.0, 2.0, 5.0
    np.testing.assert_array_equal(np.fromfile(f, dtype=np.float32).reshape(4, 6), expected.numpy())
    torch.testing.assert_close(r, expected)  # a read-only mapping sees the writes


def test_copy_on_write_mode_keeps_the_file(tmp_path):
    f = leaf_file(tmp_path, torch.zeros(4, 6))
    before = file_bytes(f)
    c = MemoryMappedTensor.from_filename(f, torch.float32, (4, 6), mode="c")
    c[0] = 9.0
    c.add_(1)
    assert c[0, 0].item() == 10.0
    assert c[1, 0].item() == 1.0
    assert file_bytes(f) == before
    assert MemoryMappedTensor.from_filename(f, torch.float32, (4, 6))[0, 0].item() == 0.0


def test_numpy_escape(tmp_path):
    f = leaf_file(tmp_path, torch.arange(6.0))
    before = file_bytes(f)
    r = MemoryMappedTensor.from_filename(f, torch.float32, (6,))
    for arr in (r.numpy(), np.asarray(r), r[2:].numpy()):
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1.0
    assert file_bytes(f) == before
    w = MemoryMappedTensor.from_filename(f, torch.float32, (6,), mode="r+")
    w.numpy()[0] = 42.0
    assert np.fromfile(f, dtype=np.float32)[0] == 42.0


def test_scalar_conversions_and_repr(tmp_path):
    f = leaf_file(tmp_path, torch.tensor([[1.5, 2.0], [3.0, 4.0]]))
    x = MemoryMappedTensor.from_filename(f, torch.float32, (2, 2))
    assert x.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert x[0, 0].item() == 1.5
    assert float(x[0, 0]) == 1.5
    assert f"{x[0, 0]:.1f}" == "1.5"
    assert bool(x[1, 1])
    assert "MemoryMappedTensor(" in repr(x)
    assert "mode='r'" in repr(x)
    assert f in repr(x)


def test_deepcopy_is_an_in_memory_copy(tmp_path):
    f = leaf_file(tmp_path, torch.arange(4.0))
    x = MemoryMappedTensor.from_filename(f, torch.float32, (4,))
    y = copy.deepcopy(x)
    assert type(y) is torch.Tensor
    y.add_(1)  # writable, independent of the file
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------------------ pickling
def test_pickle_sends_a_reference_not_the_data(tmp_path):
    f = leaf_file(tmp_path, torch.arange(1 << 18, dtype=torch.float32).reshape(512, 512))
    x = MemoryMappedTensor.from_filename(f, torch.float32, (512, 512))
    for v in (x, x[100:200, 3::7], x.t()[5]):
        blob = pickle.dumps(v)
        assert len(blob) < 400, len(blob)  # 1 MiB of data, a few hundred bytes of pickle
        back = pickle.loads(blob)
        assert isinstance(back, MemoryMappedTensor)
        assert back.mode == "r"
        assert back.filename == f
        assert back.stride() == v.stride()
        torch.testing.assert_close(back, v)
    w = MemoryMappedTensor.from_filename(f, torch.float32, (512, 512), mode="r+")
    w2 = pickle.loads(pickle.dumps(w[7]))
    w2.fill_(-1.0)  # the copy maps the same file, shared
    assert w[7].sum().item() == -512.0
    assert x[7, 0].item() == -1.0
    empty = MemoryMappedTensor.zeros((0, 4), torch.float32, tmp_path / "e.bin")
    assert pickle.loads(pickle.dumps(empty)).shape == (0, 4)
    # copy-on-write leaves are pickled by reference too: private changes stay in this process
    c = MemoryMappedTensor.from_filename(f, torch.float32, (512, 512), mode="c")
    c[0] = 123.0
    c2 = pickle.loads(pickle.dumps(c))
    assert c2.mode == "c"
    assert c2[0, 0].item() == 0.0
    assert c[0, 0].item() == 123.0


def test_pickle_a_loaded_store_is_small(tmp_path):
    td = TensorDict(a=torch.randn(256, 256), b={"c": torch.randn(256, 128)}, batch_size=[256])
    save(td, tmp_path / "s")
    loaded = load(tmp_path / "s")
    blob = pickle.dumps(loaded)
    assert len(blob) < 2000, len(blob)
    back = pickle.loads(blob)
    assert_close(back, td)
    assert back["b", "c"].mode == "r"
    assert back.batch_size == (256,)


def test_dataloader_workers_read_and_write_a_store(tmp_path):
    """Two workers read from a read-only store; two workers write into a read-write store and
    the parent sees the writes."""
    sys.path.insert(0, str(HERE))
    from _memmap_helpers import RowDataset, collate

    n = 16
    td = TensorDict(x=torch.arange(n * 3.0).reshape(n, 3), seen=torch.zeros(n), batch_size=[n])
    save(td, tmp_path / "s")
    # (a store pickled by reference into a freshly started process, the way spawned workers
    # receive it, is checked in test_read_only_bypasses_and_killed_saves_in_child_processes)
    for mode, mark in (("r", False), ("r+", True)):
        store = load(tmp_path / "s", mode=mode)
        dl = torch.utils.data.DataLoader(
            RowDataset(store, mark),
            batch_size=4,
            num_workers=2,
            collate_fn=collate,
            timeout=120,
        )
        batches = list(dl)
        got = tdfunc.cat(batches)
        torch.testing.assert_close(got["x"], td["x"])
        if mark:
            assert store["seen"].tolist() == [1.0] * n  # the workers' writes, via the file
            assert (
                np.fromfile(data_path(tmp_path / "s"), dtype=np.float32)[-n:].tolist() == [1.0] * n
            )
        else:
            assert store["seen"].sum().item() == 0.0


# ------------------------------------------------------------------------------ save / load
def test_save_load_round_trip(tmp_path):
    td = sample().set("empty", torch.zeros(6, 0)).set(("deep", "er", "x"), torch.ones(6, 2, 2))
    before = td.clone()
    save(td, tmp_path / "s")
    data_name = data_path(tmp_path / "s").name
    assert data_name == "data.bin"
    assert sorted(os.listdir(tmp_path / "s")) == [data_name, "manifest.json"]
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
    umask = os.umask(0)
    os.umask(umask)
    for entry, full in (("s", 0o777), (f"s/{data_name}", 0o666), ("s/manifest.json", 0o666)):
        assert os.stat(tmp_path / entry).st_mode & 0o777 == full & ~umask, entry  # not private
    for mode in ("r", "r+", "c"):
        back = load(tmp_path / "s", mode=mode)
        assert type(back) is TensorDict
        assert back.batch_size == (6,)
        assert back["deep", "er"].batch_size == (6,)
        assert list(back.keys(include_nested=True)) == list(td.keys(include_nested=True))
        for leaf in back.values(include_nested=True, leaves_only=True):
            assert isinstance(leaf, MemoryMappedTensor)
            assert leaf.mode == mode
            assert leaf.filename == str(data_path(tmp_path / "s"))
        assert_close(back, td)
    assert_close(td, before)


def test_manifest_layout(tmp_path):
    td = TensorDict(
        a=torch.zeros(3, dtype=torch.int8), b={"c": torch.ones(3, 2)}, batch_size=[3], device="cpu"
    )
    save(td, tmp_path / "s")
    m = json.loads(file_bytes(tmp_path / "s" / "manifest.json"))
    assert m["format"] == "tdfunc.memmap"
    assert m["version"] == 1
    assert m["data_file"] == "data.bin"
    assert re.fullmatch("[0-9a-f]{24}", m["store_id"])
    root = m["root"]
    assert root["type"] == "tdfunc.TensorDict"
    assert root["batch_size"] == [3]
    assert root["device"] == "cpu"
    a, c = root["children"]["a"], root["children"]["b"]["children"]["c"]
    assert a == {"kind": "tensor", "dtype": "int8", "shape": [3], "offset": 0, "nbytes": 3}
    assert c["offset"] == 64  # 64-byte aligned
    assert c["nbytes"] == 24
    assert c["dtype"] == "float32"
    assert m["data_bytes"] == 88 == os.path.getsize(data_path(tmp_path / "s"))
    raw = np.fromfile(data_path(tmp_path / "s"), dtype=np.uint8)
    assert raw[3:64].tolist() == [0] * 61  # padding
    np.testing.assert_array_equal(raw[64:88].view(np.float32), np.ones(6, dtype=np.float32))


def test_device_none_and_empty_containers(tmp_path):
    empty = TensorDict(batch_size=[3, 2])
    save(empty, tmp_path / "e")
    back = load(tmp_path / "e")
    assert back.batch_size == (3, 2)
    assert back.keys() == []
    assert back.device is None
    nested_empty = TensorDict(a={}, b=torch.ones(4), batch_size=[4], device="cpu")
    save(nested_empty, tmp_path / "n")
    back = load(tmp_path / "n")
    assert back["a"].batch_size == (4,)
    assert back.device == torch.device("cpu")
    assert os.path.getsize(data_path(tmp_path / "e")) == 0
    # a store saved from an accelerator maps onto the host (memory maps live in host memory)
    m = json.loads(file_bytes(tmp_path / "n" / "manifest.json"))
    m["root"]["device"] = m["root"]["children"]["a"]["device"] = "cuda:0"
    (tmp_path / "n" / "manifest.json").write_text(json.dumps(m))
    back = load(tmp_path / "n")
    assert back.device == torch.device("cpu")
    assert back["a"].device == torch.device("cpu")
    assert back["b"].device == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_save_from_cuda_and_move_back(tmp_path):
    td = sample().to("cuda")
    save(td, tmp_path / "s")
    m = json.loads(file_bytes(tmp_path / "s" / "manifest.json"))
    assert m["root"]["device"] == str(td.device)
    back = load(tmp_path / "s")
    assert back.device == torch.device("cpu")
    assert_close(back.to("cuda"), td)
    assert type(back["obs"].cuda()) is torch.Tensor


def test_load_is_lazy(tmp_path):
    """Loading maps the file: no data is read (resident memory does not grow by the data)."""
    n = 32 << 20  # 32 MiB in 8 leaves
    td = TensorDict({f"k{i}": torch.ones(n // 32) for i in range(8)}, batch_size=[n // 32])
    save(td, tmp_path / "s")
    del td

    def rss() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    stores = [load(tmp_path / "s") for _ in range(4)]  # 128 MiB mapped
    assert rss() - before < (8 << 20)
    assert stores[0]["k3"][:10].sum().item() == 10.0


def test_overwrite(tmp_path):
    p = tmp_path / "s"
    save(sample(0), p)
    old = load(p)
    before = file_bytes(data_path(p))
    with pytest.raises(FileExistsError, match="pass overwrite=True") as ei:
        save(sample(1), p)
    assert str(p) in str(ei.value)
    assert file_bytes(data_path(p)) == before
    save(sample(1), p, overwrite=True)
    assert_close(load(p), sample(1))
    assert_close(old, sample(0))  # the old mapping stays valid: files are never rewritten
    assert sorted(os.listdir(tmp_path)) == ["s"]  # no hidden leftovers
    # a store saved onto itself from its own mapping
    save(load(p) * 2, p, overwrite=True)
    assert_close(load(p), sample(1) * 2)
    # an empty directory may be replaced, other data never
    (tmp_path / "emptydir").mkdir()
    save(sample(2), tmp_path / "emptydir", overwrite=True)
    assert_close(load(tmp_path / "emptydir"), sample(2))
    other = tmp_path / "mine"
    other.mkdir()
    (other / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="is not a tdfunc store"):
        save(sample(), other, overwrite=True)
    (tmp_path / "afile").write_text("keep")
    with pytest.raises(FileExistsError, match="is not a tdfunc store"):
        save(sample(), tmp_path / "afile", overwrite=True)
    assert (other / "precious.txt").read_text() == "keep"
    assert (tmp_path / "afile").read_text() == "keep"


def test_save_bad_input(tmp_path):
    with pytest.raises(TypeError, match=fmt(E.NOT_A_CONTAINER)):
        save({"a": torch.ones(2)}, tmp_path / "d")
    with pytest.raises(TypeError, match=fmt(E.NOT_A_CONTAINER)):
        save(torch.ones(2), tmp_path / "t")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
        q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    with pytest.raises(
        TypeError, match=r"dtype torch.qint8 cannot be memory-mapped \(key \('next', 'q'\)\)"
    ):
        save(TensorDict(a=torch.ones(4), next={"q": q}, batch_size=[4]), tmp_path / "q")
    sp = torch.eye(4).to_sparse()
    with pytest.raises(TypeError, match=r"key 'sp': a torch.sparse_coo tensor cannot"):
        save(TensorDict(sp=sp, batch_size=[4]), tmp_path / "sp")
    assert os.listdir(tmp_path) == []  # nothing was created


def test_memmap_like_preallocates_a_writable_store(tmp_path):
    spec = sample()
    buf = memmap_like(spec, tmp_path / "buf")
    assert list(buf.keys(include_nested=True)) == list(spec.keys(include_nested=True))
    for (k, a), b in zip(buf.items(True, True), spec.values(True, True)):
        assert a.mode == "r+", k
        assert a.shape == b.shape, k
        assert a.dtype == b.dtype, k
        assert not a.any()
    buf["obs"][2] = torch.tensor([1.0, 2.0, 3.0])
    buf["next", "done"][5] = True
    again = load(tmp_path / "buf")
    assert again["obs"][2].tolist() == [1.0, 2.0, 3.0]
    assert again["next", "done"][5].item()
    with pytest.raises(FileExistsError):
        memmap_like(spec, tmp_path / "buf")
    assert memmap_like(spec, tmp_path / "buf", overwrite=True)["obs"].sum().item() == 0.0


# ------------------------------------------------------------------------------ bad stores
def _break(tmp_path: Path, edit) -> Path:
    p = tmp_path / "s"
    if p.exists():
        shutil.rmtree(p)
    save(sample(), p)
    m = json.loads(file_bytes(p / "manifest.json"))
    edit(m)
    (p / "manifest.json").write_text(json.dumps(m))
    return p


def _set(path: tuple, value):
    def edit(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _leaf(*keys: str) -> tuple:
    out: tuple = ("root",)
    for k in keys:
        out += ("children", k)
    return out


BAD_MANIFESTS = {
    "version": (
        _set(("version",), 2),
        "format version 2; this version of tdfunc reads versions [1]",
    ),
    "format": (_set(("format",), "something"), "'format' is not 'tdfunc.memmap'"),
    "dtype": (
        _set((*_leaf("obs"), "dtype"), "float13"),
        "unknown or unsupported dtype 'float13' at key 'obs'",
    ),
    "type": (
        _set((*_leaf("next"), "type"), "nowhere.Missing"),
        "container type 'nowhere.Missing' at 'next' is not registered",
    ),
    "offset_past_end": (_set((*_leaf("obs"), "offset"), 1 << 20), "past data_bytes"),
    "nbytes": (_set((*_leaf("obs"), "nbytes"), 4), "do not fit shape"),
    "misaligned": (_set((*_leaf("obs"), "offset"), 2), "do not fit shape"),
    "overlap": (_set((*_leaf("action"), "offset"), 8), "overlap"),
    "shape_type": (_set((*_leaf("obs"), "shape"), "big"), "field 'shape' of entry 'obs'"),
    "batch": (
        _set((*_leaf("next"), "batch_size"), [5]),
        "leaf ('next', 'reward') does not start with batch [5]",
    ),
    "kind": (_set((*_leaf("obs"), "kind"), "blob"), "unknown kind 'blob'"),
    "missing_field": (
        lambda m: m["root"]["children"]["obs"].pop("offset"),
        "has no field 'offset'",
    ),
    "data_file_escape": (_set(("data_file",), "../other.bin"), "bad data_file '../other.bin'"),
    "data_bytes": (_set(("data_bytes",), -1), "bad data_bytes -1"),
    "root": (_set(("root",), [1, 2]), "field 'root'"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_load_rejects_bad_manifests(tmp_path, case):
    edit, message = BAD_MANIFESTS[case]
    p = _break(tmp_path, edit)
    with pytest.raises(MemmapFormatError, match=re.escape(message)) as ei:
        load(p)
    assert str(p / "manifest.json") in str(ei.value)


def test_load_rejects_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tdfunc store at"):
        load(tmp_path / "nothing")
    (tmp_path / "dir").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'manifest\.json' is missing"):
        load(tmp_path / "dir")
    p = _break(tmp_path, lambda m: None)
    (p / "manifest.json").write_bytes(b'{"format": "tdfunc.memmap", "vers')
    with pytest.raises(MemmapFormatError, match="not valid JSON") as ei:
        load(p)
    assert str(p / "manifest.json") in str(ei.value)
    (p / "manifest.json").write_bytes(b"\xff\xfe garbage")
    with pytest.raises(MemmapFormatError, match="not valid JSON"):
        load(p)
    p = _break(tmp_path, lambda m: None)
    data = data_path(p)
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(MemmapFormatError, match=f"holds {size - 1} bytes, but manifest") as ei:
        load(p)
    assert str(data) in str(ei.value)
    os.unlink(data)
    with pytest.raises(FileNotFoundError, match=r"data file .* is missing"):
        load(p)
    with pytest.raises(ValueError, match=fmt(E.BAD_MODE)):
        load(p, mode="w")


# ------------------------------------------------------------------------------ tensorclass
if tensorclass is not None:

    @tensorclass
    class MemInner:
        c: torch.Tensor

    @tensorclass
    class MemSample:
        obs: torch.Tensor
        inner: MemInner
        extra: TensorDict
        opt: torch.Tensor | None = None
        name: str = "sample"
        meta: tuple = (1, ("a", 2.5), None)

    @tensorclass
    class Unsavable:
        x: torch.Tensor
        tag: frozenset = frozenset({1})


def test_tensorclass_round_trip(tmp_path):
    tc = MemSample(
        torch.randn(4, 3),
        MemInner(torch.ones(4, 2, 5), batch_size=[4, 2]),
        TensorDict(x=torch.arange(4), batch_size=[4]),
        name="hello",
        batch_size=[4],
    )
    save(tc, tmp_path / "tc")
    m = json.loads(file_bytes(tmp_path / "tc" / "manifest.json"))
    assert m["root"]["type"] == f"{__name__}.MemSample"
    assert m["root"]["children"]["opt"] == {"kind": "none"}
    back = load(tmp_path / "tc")
    assert type(back) is MemSample
    assert type(back.inner) is MemInner
    assert back.name == "hello"
    assert back.meta == (1, ("a", 2.5), None)
    assert back.opt is None
    assert back.inner.batch_size == (4, 2)
    assert back.batch_size == (4,)
    assert isinstance(back.obs, MemoryMappedTensor)
    assert back.obs.mode == "r"
    assert_close(back, tc)
    like = memmap_like(tc, tmp_path / "like")
    assert type(like) is MemSample
    assert like.inner.c.mode == "r+"
    assert like.name == "hello"
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(
        lambda t: t.obs.sum(-1) + t.inner.c.sum((-1, -2)), backend=cnt, fullgraph=True
    )
    torch.testing.assert_close(f(back), tc.obs.sum(-1) + tc.inner.c.sum((-1, -2)))
    assert cnt.frame_count == 1


def test_tensorclass_bad_input(tmp_path):
    with pytest.raises(TypeError, match="field 'tag' of Unsavable holds a frozenset"):
        save(Unsavable(torch.ones(2), batch_size=[2]), tmp_path / "u")
    tc = MemInner(torch.ones(2), batch_size=[2])
    save(tc, tmp_path / "s")
    m = json.loads(file_bytes(tmp_path / "s" / "manifest.json"))
    m["root"]["type"] = "somewhere.NotImported"
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MemmapFormatError, match="import the module that defines that tensorclass"):
        load(tmp_path / "s")


# ------------------------------------------------------------------------------ progress bar
def test_progress_bar(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    save(sample(), tmp_path / "a", progress=True)
    assert "saving a" in capsys.readouterr().err
    save(sample(), tmp_path / "b", progress=False)
    memmap_like(sample(), tmp_path / "c")
    assert capsys.readouterr().err == ""
    memmap_like(sample(), tmp_path / "d", progress=True)
    assert "allocating d" in capsys.readouterr().err

    class Tty:
        def isatty(self) -> bool:
            return True

    # auto mode: only for >= 1 GiB and when stdout is a terminal
    assert S._progress(1 << 30, None, "x").__class__.__name__ == "nullcontext"  # not a tty
    monkeypatch.setattr(sys, "stdout", Tty())
    bar = S._progress(S.PROGRESS_MIN_BYTES, None, "x")
    assert bar.__class__.__name__ == "tqdm"
    bar.close()
    assert S._progress(S.PROGRESS_MIN_BYTES - 1, None, "x").__class__.__name__ == "nullcontext"
    assert S._progress(S.PROGRESS_MIN_BYTES, False, "x").__class__.__name__ == "nullcontext"
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name: None)  # tqdm missing
    assert S._progress(S.PROGRESS_MIN_BYTES, None, "x").__class__.__name__ == "nullcontext"
    with pytest.raises(ModuleNotFoundError, match="progress=True needs"):
        S._progress(10, True, "x")


# ------------------------------------------------------------------------------ torch.compile
def _reload_with(path: Path, td: TensorDict, mode: str = "r") -> TensorDict:
    save(td, path, overwrite=True)
    return load(path, mode=mode)


def read_step(td):
    return (td["obs"] * 2).sum(-1) + td["next", "reward"] + td["action"].float()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_read_same_store_does_not_recompile(tmp_path, backend):
    """fullgraph, equal to eager, one frame; new data saved at the same path reuses the graph."""
    seeds = iter(range(100))
    check_compiled(
        read_step, lambda: (_reload_with(tmp_path / "s", sample(next(seeds))),), backend=backend
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_ops_on_a_loaded_store(tmp_path, backend):
    save(sample(), tmp_path / "s")
    td = load(tmp_path / "s")
    ops = {
        "apply": lambda t: t.apply(lambda x: x * 2),
        "index": lambda t: t[torch.tensor([0, 3, 5])],
        "slice": lambda t: t[1:4],
        "stack": lambda t: tdfunc.stack([t, t]),
        "reshape": lambda t: t.reshape(2, 3),
    }
    for name, fn in ops.items():
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend(backend)
        got = torch.compile(fn, backend=cnt, fullgraph=True)(td)
        assert_close(got, fn(sample()))
        assert cnt.frame_count == 1, name
    # views returned by a compiled function keep file and mode
    torch._dynamo.reset()
    out = torch.compile(lambda t: t[2:], backend=backend, fullgraph=True)(td)
    assert isinstance(out["obs"], MemoryMappedTensor)
    assert out["obs"].mode == "r"
    assert out["obs"].filename == td["obs"].filename
    with pytest.raises(PermissionError):
        out["obs"].zero_()


def test_compiled_function_guards_on_store_and_mode(tmp_path):
    save(sample(0), tmp_path / "a")
    save(sample(1), tmp_path / "b")
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(read_step, backend=cnt, fullgraph=True)
    for name, mode, frames in (("a", "r", 1), ("a", "r", 1), ("b", "r", 2), ("a", "c", 3)):
        td = load(tmp_path / name, mode=mode)
        torch.testing.assert_close(f(td), read_step(sample(0 if name == "a" else 1)))
        assert cnt.frame_count == frames


def write_step(td):
    td["obs"][0] = 5.0
    td["next", "reward"].add_(1)
    return td["obs"].sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_write_to_read_only_raises_from_the_first_call(tmp_path, backend):
    save(sample(), tmp_path / "s")
    data = data_path(tmp_path / "s")
    before = file_bytes(data)
    cnt = CompileCounterWithBackend(backend)
    f = torch.compile(write_step, backend=cnt, fullgraph=True)
    for _ in range(2):
        td = load(tmp_path / "s")
        with pytest.raises(PermissionError, match=fmt(E.READ_ONLY)) as ei:
            f(td)
        assert str(data) in str(ei.value)
        assert file_bytes(data) == before
        assert_close(td, sample())  # nothing changed in memory either
    assert cnt.frame_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_write_to_read_write_store_reaches_the_file(tmp_path, backend):
    save(sample(), tmp_path / "s")
    f = torch.compile(write_step, backend=CompileCounterWithBackend(backend), fullgraph=True)
    td = load(tmp_path / "s", mode="r+")
    expected = sample()
    expected["obs"][0] = 5.0
    expected["next", "reward"].add_(1)
    torch.testing.assert_close(f(td), expected["obs"].sum())
    assert_close(load(tmp_path / "s"), expected)
    c = load(tmp_path / "s", mode="c")
    f(c)  # copy-on-write: in memory only
    assert_close(load(tmp_path / "s"), expected)
    torch.testing.assert_close(c["next", "reward"], expected["next", "reward"] + 1)


@pytest.mark.slow
def test_inductor_reads_writes_and_refuses(tmp_path):
    save(sample(), tmp_path / "s")
    data = data_path(tmp_path / "s")

    def step(td):
        td["next", "reward"].mul_(2)
        return read_step(td)

    f = torch.compile(step, backend="inductor", fullgraph=True)
    ro = load(tmp_path / "s")
    before = file_bytes(data)
    with pytest.raises(PermissionError, match=fmt(E.READ_ONLY)):
        f(ro)
    assert file_bytes(data) == before
    assert_close(ro, sample())
    rw = load(tmp_path / "s", mode="r+")
    expected = sample()
    expected["next", "reward"].mul_(2)
    torch.testing.assert_close(f(rw), read_step(expected))
    assert_close(load(tmp_path / "s"), expected)


# ------------------------------------------------------------------------------ child processes
@pytest.mark.slow
def test_read_only_bypasses_and_killed_saves_in_child_processes():
    """Writes that bypass tensor methods (numpy, torch.from_numpy, ctypes) never crash and never
    change a read-only file; a save killed at any stage leaves the previous complete store,
    the new complete store or nothing (the old one kept aside) - never a partial store; a store
    pickled by reference into another process (as spawned DataLoader workers get it) maps the
    same file there."""
    work = tempfile.mkdtemp(prefix="tdfunc-memmap-")
    try:
        # a read-write store pickled here and written to by the child through its own mapping
        shared = os.path.join(work, "shared")
        save(TensorDict(k0=torch.zeros(1 << 16), batch_size=[1 << 16]), shared)
        mine = load(shared, mode="r+")
        blob = pickle.dumps(mine)
        assert len(blob) < 1000
        with open(os.path.join(work, "shared.pkl"), "wb") as f:
            f.write(blob)
        rep = run_child(["root-checks", work])
        assert rep["unpickled"] == {"type": "MemoryMappedTensor", "mode": "r+", "sum": 7 * 65536}
        assert mine["k0"].eq(7.0).all()  # the child's writes, seen through this mapping
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for how in ("numpy", "from_numpy", "ctypes"):
        r = rep[f"bypass_{how}"]
        assert r["exit"] == 0, r
        assert "signal" not in r, r
        assert "error" not in r, r
        assert r["file_unchanged"], r
    assert rep["bypass_numpy"]["result"]["numpy_write"].startswith("ValueError")
    assert not rep["bypass_numpy"]["result"]["writeable"]
    old, new = {"values": [1.0], "keys": 4}, {"values": [2.0], "keys": 4}
    expected = {
        "kill_data_fresh": (None, []),
        "kill_data_overwrite": (old, []),
        "kill_before_rename_overwrite": (old, [new]),  # the finished, uncommitted new store
        "kill_after_exchange_overwrite": (new, [old]),  # the old one not yet deleted
        "kill_before_cleanup_overwrite": (new, [old]),
    }
    for name, (state, kept) in expected.items():
        r = rep[name]
        assert r.get("signal") == 9, r  # it really was killed mid-save
        assert r["state"] == state, (name, r)
        assert r["old"] == kept, (name, r)
        # the next save to the path removes what the killed one left behind
        assert r["after_next_save"] == {"state": {"values": [3.0], "keys": 4}, "hidden": []}
    for r in rep["kill_loop"]:
        st = r["state"]
        if st is None:  # killed between the two renames: the previous store is kept aside
            assert len(r["old"]) == 1
            assert len(r["old"][0]["values"]) == 1
            continue
        # a complete store of one save: every leaf holds the same value, the last or next save
        assert st["keys"] == 8, r
        assert len(st["values"]) == 1, r
        assert st["values"][0] in (float(r["saves"]), float(r["saves"] + 1)), r


def _unprivileged_runs() -> list[tuple[str, dict]]:
    if os.geteuid() != 0:
        return [("current user", {})]
    runs = [("uid 65534", {"user": 65534, "group": 65534, "extra_groups": []})]
    if shutil.which("setpriv"):
        runs.append(
            (
                "setpriv uid 65534",
                {"prefix": ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]},
            )
        )
        runs.append(
            (
                "root without CAP_DAC_OVERRIDE",
                {
                    "prefix": [
                        "setpriv",
                        "--inh-caps=-all",
                        "--bounding-set=-dac_override,-dac_read_search",
                    ]
                },
            )
        )
    return runs


@pytest.mark.slow
def test_files_without_write_permission():
    """``load(mode="r")`` works; ``mode="r+"`` raises PermissionError at load time. CI runs as
    root, which ignores permission bits, so the check runs in a child as an unprivileged uid
    (or, when that uid cannot import the environment, as root without CAP_DAC_OVERRIDE)."""
    work = tempfile.mkdtemp(prefix="tdfunc-memmap-perm-")
    try:
        os.chmod(work, 0o755)
        store = os.path.join(work, "s")
        save(TensorDict(k0=torch.full((4,), 3.0), batch_size=[4]), store)
        for f in os.listdir(store):
            os.chmod(os.path.join(store, f), 0o444)
        os.chmod(store, 0o555)
        before = file_bytes(data_path(store))
        for name in ("noread", "nosearch"):
            save(TensorDict(k0=torch.ones(4), batch_size=[4]), os.path.join(work, name))
        os.chmod(os.path.join(work, "noread", "data.bin"), 0o000)
        os.chmod(os.path.join(work, "nosearch"), 0o644)  # readable, not searchable
        rep, errors = None, []
        for label, how in _unprivileged_runs():
            prefix = how.pop("prefix", [])
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            try:
                proc = subprocess.run(
                    [*prefix, sys.executable, str(HELPERS), "permission-checks", store],
                    capture_output=True,
                    text=True,
                    timeout=CHILD_TIMEOUT_S,
                    env=env,
                    cwd=work,
                    **how,
                )
            except OSError as e:  # e.g. this uid may not execute the interpreter
                errors.append(f"{label}: {e}")
                continue
            if proc.returncode == 0:
                rep = json.loads(proc.stdout.split("REPORT ", 1)[1])
                break
            errors.append(f"{label}: {proc.stderr[-500:]}")
        if rep is None:
            pytest.skip("no unprivileged child could run: " + " | ".join(errors))
        assert rep["can_write_raw"] is False, rep
        assert rep["load_r"] == "ok: 12.0"
        assert rep["load_c"] == "ok: -5.0"
        data = str(data_path(store))
        for key in ("load_r+", "from_filename_r+"):
            assert re.match("PermissionError: " + fmt(E.NOT_WRITABLE), rep[key]), rep[key]
            assert data in rep[key]
        assert rep["from_filename_r"] == "ok: [3.0, 3.0, 3.0, 3.0]"
        noread = os.path.join(work, "noread", "data.bin")
        assert rep["unreadable_data"].startswith("PermissionError: cannot open ")
        assert noread in rep["unreadable_data"]
        assert rep["no_search"].startswith("PermissionError: cannot open the store directory")
        assert os.path.join(work, "nosearch") in rep["no_search"]
        assert file_bytes(data) == before
    finally:
        for dirpath, _, _ in os.walk(work):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(work, ignore_errors=True)


def test_resume_into_a_compiled_step_compiles_once_after_clone(tmp_path: Path) -> None:
    """The recipe of ``load``'s docstring: ``load(path).clone()`` gives plain tensors, so the
    step's second call (with the plain tensors it returned) does not recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend

    tdfunc.save(tdfunc.TensorDict(w=torch.ones(3)), tmp_path / "s")
    cnt = CompileCounterWithBackend("eager")
    step = torch.compile(lambda td: td * 2, backend=cnt, fullgraph=True)
    state = tdfunc.load(tmp_path / "s").clone()
    assert type(state["w"]) is torch.Tensor
    for _ in range(3):
        state = step(state)
    assert cnt.frame_count == 1
    assert state["w"].tolist() == [8.0, 8.0, 8.0]
