"""safetensors files: round trips, files of other tools, zero-copy read-only loading, errors."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import struct

import pytest
import torch
from helpers import check_compiled

import tdfunc
from tdfunc import (
    MemoryMappedTensor,
    SafetensorsFormatError,
    TensorDict,
    load_safetensors,
    save_safetensors,
)
from tdfunc.interop import _errors as E
from tdfunc.interop._safetensors import FORMAT_VERSION, META_KEY, ST_NAMES
from tdfunc.testing import assert_close


@tdfunc.tensorclass
class Obs:
    pixels: torch.Tensor
    mask: torch.Tensor | None = None
    scale: float = 1.0
    tags: tuple = ("a", 1)


@tdfunc.tensorclass
class Step:
    obs: Obs
    extra: TensorDict | None = None
    name: str = "step"


def corpus() -> dict[str, object]:
    """Containers covering nesting, tensorclasses, mixed dtypes, 0-dim and empty leaves."""
    return {
        "flat": TensorDict(a=torch.randn(3, 2), b=torch.arange(3), batch_size=[3]),
        "nested": TensorDict(
            a=torch.randn(2, 4),
            n={"b": torch.ones(2, dtype=torch.int8), "m": {"c": torch.zeros(2, 3, 1)}},
            batch_size=[2],
        ),
        "dtypes": TensorDict(
            {
                "f16": torch.randn(5).half(),
                "bf16": torch.randn(5).bfloat16(),
                "f64": torch.randn(5, dtype=torch.float64),
                "u8": torch.arange(5, dtype=torch.uint8),
                "bool": torch.tensor([True, False, True, False, True]),
                "i16": torch.arange(5, dtype=torch.int16),
                "u32": torch.arange(5).to(torch.uint32),
                "c64": torch.randn(5, dtype=torch.complex64),
                "i64": torch.arange(5),
            },
            batch_size=[5],
        ),
        "scalar_and_empty": TensorDict(
            s=torch.tensor(3.5), e=torch.zeros(0, 4), ei=torch.zeros(0, dtype=torch.int64)
        ),
        "empty_batch": TensorDict(x=torch.zeros(0, 3), batch_size=[0]),
        "no_leaves": TensorDict(n={}, batch_size=[4]),
        "tensorclass": Step(
            Obs(torch.rand(4, 2, 2), scale=0.5, tags=("x", (1, 2)), batch_size=[4]),
            extra=TensorDict(r=torch.ones(4), batch_size=[4]),
            name="s",
            batch_size=[4],
        ),
        "two_batch_dims": TensorDict(
            x=torch.randn(2, 3, 4), n={"y": torch.ones(2, 3, 5, 6)}, batch_size=[2, 3]
        ),
    }


CORPUS = corpus()


def same(a: object, b: object) -> None:
    """Same types, structure, batch sizes, static fields and values."""
    assert type(a) is type(b)
    assert a.batch_size == b.batch_size  # type: ignore[attr-defined]
    assert a._tdf_keys() == b._tdf_keys()  # type: ignore[attr-defined]
    assert a._tdf_static() == b._tdf_static()  # type: ignore[attr-defined]
    for x, y in zip(a._tdf_children(), b._tdf_children()):  # type: ignore[attr-defined]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor)
            assert x.dtype == y.dtype
            assert x.shape == y.shape
            assert torch.equal(x.cpu(), torch.as_tensor(y).clone())
        elif x is None:
            assert y is None
        else:
            same(x, y)


# ================================================================== round trips
@pytest.mark.parametrize("name", list(CORPUS))
def test_round_trip_keeps_structure_and_values(tmp_path, name):
    td = CORPUS[name]
    before = td.clone()
    f = tmp_path / "x.safetensors"
    save_safetensors(td, f)
    back = load_safetensors(f)
    same(td, back)
    same(td, before)  # the input is not modified


def test_loaded_leaves_are_read_only_memory_maps(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["nested"], f)
    back = load_safetensors(f)
    leaf = back["n", "m", "c"]
    assert isinstance(leaf, MemoryMappedTensor)
    assert leaf.mode == "r"
    assert leaf.filename == str(f)
    with pytest.raises(PermissionError, match=re.escape(str(f))):
        leaf.add_(1)
    with pytest.raises(PermissionError):
        back["a"][0] = 1.0
    assert (leaf == 0).all()  # nothing was written


def test_mode_r_plus_writes_to_the_file_and_c_does_not(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(4)), f)
    c = load_safetensors(f, mode="c")
    c["a"].add_(5)
    assert load_safetensors(f)["a"].tolist() == [0.0] * 4
    w = load_safetensors(f, mode="r+")
    w["a"][1] = 2.0
    del w
    assert load_safetensors(f)["a"].tolist() == [0.0, 2.0, 0.0, 0.0]


def test_load_reads_nothing_but_the_header(tmp_path):
    f = tmp_path / "big.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(1 << 20), b=torch.ones(1 << 20)), f)
    with open(f, "r+b") as fh:  # corrupt data bytes only: loading must not look at them
        fh.seek(os.path.getsize(f) - 4)
        fh.write(b"\xff\xff\xff\xff")
    back = load_safetensors(f)
    assert back["a"].shape == (1 << 20,)
    assert back["b"][:3].tolist() == [1.0, 1.0, 1.0]
    assert not torch.equal(back["b"][-1:], torch.ones(1))


def test_device_argument_copies_to_the_device(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["flat"], f)
    back = load_safetensors(f, device="cpu")
    assert back.device == torch.device("cpu")
    assert_close(back, CORPUS["flat"].to("cpu"))


def test_key_order_and_dotted_keys_survive(tmp_path):
    td = TensorDict({"z": torch.ones(1), "a.b": torch.zeros(1), "m": {"k": torch.ones(1)}})
    f = tmp_path / "x.safetensors"
    save_safetensors(td, f)
    back = load_safetensors(f)
    assert back.keys() == ["z", "a.b", "m"]
    assert back["a.b"].tolist() == [0.0]


def test_tied_leaves_stay_one_tensor(tmp_path):
    w = torch.randn(3, 2)
    td = TensorDict(emb={"weight": w}, head={"weight": w}, other=torch.randn(3, 2))
    f = tmp_path / "x.safetensors"
    save_safetensors(td, f)
    back = load_safetensors(f)
    assert back["head", "weight"] is back["emb", "weight"]
    assert back["other"] is not back["emb", "weight"]
    safetensors_torch = pytest.importorskip("safetensors.torch")
    flat = safetensors_torch.load_file(f)  # both names hold the data
    assert torch.equal(flat["head.weight"], w)
    assert torch.equal(flat["emb.weight"], w)


def test_non_contiguous_and_views_are_written_by_value(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    td = TensorDict(t=base.t(), s=base[:, ::2], e=torch.zeros(3).expand(4, 3), batch_size=[])
    f = tmp_path / "x.safetensors"
    save_safetensors(td, f)
    back = load_safetensors(f)
    for k in ("t", "s", "e"):
        assert torch.equal(back[k], td[k])


def test_memory_mapped_leaves_can_be_saved(tmp_path):
    src = tmp_path / "store"
    tdfunc.save(CORPUS["nested"], str(src))
    stored = tdfunc.load(str(src))
    f = tmp_path / "x.safetensors"
    save_safetensors(stored, f)
    same(CORPUS["nested"], load_safetensors(f))


def test_overwrite_replaces_only_when_asked(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(2)), f)
    with pytest.raises(FileExistsError, match=re.escape(E.FILE_EXISTS.format(filename=str(f)))):
        save_safetensors(TensorDict(a=torch.ones(2)), f)
    assert load_safetensors(f)["a"].tolist() == [0.0, 0.0]
    save_safetensors(TensorDict(a=torch.ones(2)), f, overwrite=True)
    assert load_safetensors(f)["a"].tolist() == [1.0, 1.0]
    assert sorted(os.listdir(tmp_path)) == ["x.safetensors"]  # no temporary file left


def test_old_mapping_survives_an_overwrite(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(3)), f)
    old = load_safetensors(f)
    save_safetensors(TensorDict(a=torch.ones(3)), f, overwrite=True)
    assert old["a"].tolist() == [0.0, 0.0, 0.0]
    assert load_safetensors(f)["a"].tolist() == [1.0, 1.0, 1.0]


def test_user_metadata_is_kept_and_format_is_pt(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(1)), f, metadata={"author": "me"})
    meta = read_header(f)["__metadata__"]
    assert meta["author"] == "me"
    assert meta["format"] == "pt"
    desc = json.loads(meta[META_KEY])
    assert desc["version"] == FORMAT_VERSION


def test_data_is_aligned_for_every_dtype(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["dtypes"], f)
    header = read_header(f)
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    assert (8 + n) % 8 == 0
    for name, e in header.items():
        if name != "__metadata__":
            itemsize = CORPUS["dtypes"][name].dtype.itemsize
            assert e["data_offsets"][0] % itemsize == 0, name


def test_loaded_leaves_pickle_by_reference(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["flat"], f)
    back = load_safetensors(f)
    data = pickle.dumps(back)
    assert len(data) < 2000
    again = pickle.loads(data)
    assert_close(again, back)
    assert isinstance(again["a"], MemoryMappedTensor)


def test_loaded_container_compiles(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["flat"], f)

    def fn(td):
        return (td * 2)["a"].sum() + td["b"].sum()

    check_compiled(fn, lambda: (load_safetensors(f),))


def test_write_into_read_only_leaf_under_compile_raises(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(3)), f)
    back = load_safetensors(f)

    @torch.compile(backend="eager", fullgraph=True)
    def bump(td):
        td["a"].add_(1)
        return td["a"]

    with pytest.raises(PermissionError):
        bump(back)
    assert back["a"].tolist() == [0.0, 0.0, 0.0]


# ================================================================== other tools


def test_file_written_by_safetensors_loads_nested(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    f = tmp_path / "m.safetensors"
    safetensors_torch.save_file(dict(m.state_dict()), str(f))
    back = load_safetensors(f)
    assert back.batch_size == torch.Size(())
    assert sorted(back.keys(True, True)) == sorted(tuple(k.split(".")) for k in m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(back[tuple(k.split("."))], v)
    flat = load_safetensors(f, structure="flat")
    assert sorted(flat.keys()) == sorted(m.state_dict())


def test_file_written_by_safetensors_with_metadata_and_all_dtypes(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {k: v.contiguous() for k, v in CORPUS["dtypes"].items()}
    tensors["scalar"] = torch.tensor(2.0)
    tensors["empty"] = torch.zeros(0, 3)
    f = tmp_path / "x.safetensors"
    safetensors_torch.save_file(tensors, str(f), metadata={"a": "b"})
    back = load_safetensors(f)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype, k
        assert torch.equal(back[k], v), k


def test_file_written_by_tdfunc_loads_in_safetensors_and_load_state_dict(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    f = tmp_path / "m.safetensors"
    save_safetensors(tdfunc.from_module(m), f)
    flat = safetensors_torch.load_file(str(f))
    assert set(flat) == set(m.state_dict())
    m2 = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    m2.load_state_dict(flat)
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v)
    with safetensors_torch.safe_open(str(f), "pt") as fh:
        assert fh.metadata()["format"] == "pt"
        assert set(fh.keys()) == set(m.state_dict())


@pytest.mark.parametrize("name", list(CORPUS))
def test_every_corpus_file_is_valid_for_safetensors(tmp_path, name):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS[name], f)
    flat = safetensors_torch.load_file(str(f))
    mine = load_safetensors(f, structure="flat")
    assert set(flat) == set(mine.keys())
    for k, v in flat.items():
        assert torch.equal(v, mine[k])


def test_supported_dtypes_match_the_safetensors_package():
    safetensors_torch = pytest.importorskip("safetensors.torch")
    known = [*safetensors_torch._TYPES.values(), *safetensors_torch._SIZE]
    assert set(ST_NAMES) <= {d for d in known if d is not None}


# ================================================================== errors
def read_header(f) -> dict:
    with open(f, "rb") as fh:
        raw = fh.read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def write_raw(f, header: dict, data: bytes = b"") -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)) + h + data)


def test_key_collision_names_both_keys_and_the_file(tmp_path):
    f = tmp_path / "x.safetensors"
    td = TensorDict({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    msg = E.KEY_COLLISION.format(filename=str(f), a="'a.b'", b="('a', 'b')", name="a.b")
    with pytest.raises(ValueError, match=re.escape(msg)):
        save_safetensors(td, f)
    assert not f.exists()


def test_unsupported_dtype_names_key_and_file(tmp_path):
    f = tmp_path / "x.safetensors"
    td = TensorDict(n={"z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(TypeError, match=re.escape("cannot save key ('n', 'z') to " + repr(str(f)))):
        save_safetensors(td, f)
    assert not f.exists()


def test_sparse_leaf_is_refused(tmp_path):
    f = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="no raw bytes"):
        save_safetensors(TensorDict(s=torch.eye(2).to_sparse()), f)


def test_not_a_container_and_bad_metadata(tmp_path):
    f = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match=re.escape(E.NOT_A_CONTAINER.format(typ="tuple"))):
        save_safetensors((torch.zeros(1),), f)
    with pytest.raises(TypeError, match="strings to strings"):
        save_safetensors(TensorDict(a=torch.zeros(1)), f, metadata={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=re.escape(E.RESERVED_METADATA.format(key=META_KEY))):
        save_safetensors(TensorDict(a=torch.zeros(1)), f, metadata={META_KEY: "x"})


def test_static_field_that_is_not_json(tmp_path):
    @tdfunc.tensorclass
    class WithObj:
        x: torch.Tensor
        obj: object = None

    f = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="is not JSON data"):
        save_safetensors(WithObj(torch.zeros(1), obj=frozenset()), f)


def test_truncated_files_name_the_file(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(CORPUS["nested"], f)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut in (0, 5, 8 + n // 2, len(raw) - 1):
        g = tmp_path / f"cut{cut}.safetensors"
        g.write_bytes(raw[:cut])
        with pytest.raises(SafetensorsFormatError, match=re.escape(f"{str(g)!r} is truncated")):
            load_safetensors(g)


def test_corrupt_headers(tmp_path):
    f = tmp_path / "x.safetensors"
    cases = [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, "hold 4 bytes"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 8, "bad shape"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, b"\0" * 8, "bad data_offsets"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            "overlap",
        ),
        ({"a": 3}, b"", "not an object"),
        ({"__metadata__": {"x": 1}}, b"", "strings to strings"),
    ]
    for header, data, detail in cases:
        write_raw(f, header, data)
        with pytest.raises(SafetensorsFormatError, match=re.escape(repr(str(f)))) as ei:
            load_safetensors(f)
        assert detail in str(ei.value)
    f.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(SafetensorsFormatError, match="not JSON"):
        load_safetensors(f)


def test_unknown_dtype_in_a_file(tmp_path):
    f = tmp_path / "x.safetensors"
    # a dtype of the format that torch has no type for (the reference refuses it too)
    write_raw(f, {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}, b"\0" * 3)
    msg = f"from {str(f)!r}: safetensors dtype 'F6_E2M3' is not supported"
    with pytest.raises(SafetensorsFormatError, match=re.escape(msg)):
        load_safetensors(f)
    # a name that is no dtype of the format
    write_raw(f, {"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    msg = E.ENTRY_BAD_DTYPE.format(name="a", dtype="X9")
    with pytest.raises(SafetensorsFormatError, match=re.escape(msg)):
        load_safetensors(f)


def test_newer_format_version_is_refused_but_tensors_stay_readable(tmp_path):
    f = tmp_path / "x.safetensors"
    meta = {META_KEY: json.dumps({"version": FORMAT_VERSION + 1, "root": {}})}
    write_raw(
        f,
        {"__metadata__": meta, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0" * 4,
    )
    msg = E.NEWER_VERSION.format(
        filename=str(f), version=FORMAT_VERSION + 1, supported=FORMAT_VERSION
    )
    with pytest.raises(SafetensorsFormatError, match=re.escape(msg)):
        load_safetensors(f)
    assert load_safetensors(f, structure="nested")["a"].tolist() == [0.0]


def test_structure_that_does_not_fit_the_tensors(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(2, 3), batch_size=[2]), f)
    header = read_header(f)
    data = f.read_bytes()[-24:]
    desc = json.loads(header["__metadata__"][META_KEY])
    desc["root"]["batch_size"] = [5]
    header["__metadata__"][META_KEY] = json.dumps(desc)
    write_raw(f, header, data)
    with pytest.raises(SafetensorsFormatError, match="does not fit"):
        load_safetensors(f)
    desc["root"]["batch_size"] = [2]
    desc["root"]["children"][0][1]["leaf"] = "nope"
    header["__metadata__"][META_KEY] = json.dumps(desc)
    write_raw(f, header, data)
    with pytest.raises(SafetensorsFormatError, match="names no tensor"):
        load_safetensors(f)


def test_unknown_node_type(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(1)), f)
    header = read_header(f)
    desc = json.loads(header["__metadata__"][META_KEY])
    desc["root"]["type"] = "some.module.Missing"
    header["__metadata__"][META_KEY] = json.dumps(desc)
    write_raw(f, header, f.read_bytes()[-4:])
    with pytest.raises(TypeError, match=re.escape("'some.module.Missing', which is not")):
        load_safetensors(f)
    desc["root"]["type"] = None  # not a name at all: the structure is corrupt
    header["__metadata__"][META_KEY] = json.dumps(desc)
    write_raw(f, header, f.read_bytes()[-4:])
    with pytest.raises(
        SafetensorsFormatError, match=re.escape(E.STRUCT_BAD_TYPE.format(where="<root>", name=None))
    ):
        load_safetensors(f)


def test_name_conflict_without_structure(tmp_path):
    f = tmp_path / "x.safetensors"
    write_raw(
        f,
        {
            "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            "a.b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
        },
        b"\0" * 8,
    )
    with pytest.raises(ValueError, match=re.escape("structure='flat'")):
        load_safetensors(f)
    assert sorted(load_safetensors(f, structure="flat").keys()) == ["a", "a.b"]


def test_bad_arguments(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(1)), f)
    with pytest.raises(ValueError, match="mode"):
        load_safetensors(f, mode="w")
    with pytest.raises(ValueError, match=re.escape(E.BAD_STRUCTURE_ARG.format(value="x"))):
        load_safetensors(f, structure="x")
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "missing.safetensors")


def test_functional_call_with_a_loaded_checkpoint(tmp_path):
    m = torch.nn.Linear(3, 2)
    f = tmp_path / "m.safetensors"
    save_safetensors(tdfunc.from_module(m), f)
    x = torch.randn(4, 3)
    out = tdfunc.functional_call(m, load_safetensors(f), (x,))
    torch.testing.assert_close(out, m(x))
    # writable modes: the module works on a copy; the file is never written
    state = load_safetensors(f, mode="c")
    before = f.read_bytes()
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).train()
    g = tmp_path / "bn.safetensors"
    save_safetensors(tdfunc.from_module(net), g)
    for mode in ("r", "c", "r+"):
        loaded = load_safetensors(g, mode=mode)
        _y, new = tdfunc.functional_call(net, loaded, (x,), return_state=True)
        assert torch.equal(loaded["1", "running_mean"], torch.zeros(2))
        assert not torch.equal(new["1", "running_mean"], torch.zeros(2))
    assert state is not None
    assert f.read_bytes() == before


# ================================================================== a file is trusted for nothing
# Each rule below is one the ``safetensors`` reference reader applies (see
# tests/test_safetensors_fuzz.py for the differential fuzzer against it).
def write_bytes(f, header: bytes | str, data: bytes = b"", pad: bool = True) -> None:
    h = header.encode() if isinstance(header, str) else header
    if pad:
        h += b" " * (-len(h) % 8)
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def refused(f, *details: str) -> str:
    """Loading ``f`` raises SafetensorsFormatError naming the file and each detail."""
    with pytest.raises(SafetensorsFormatError) as ei:
        load_safetensors(f)
    msg = str(ei.value)
    assert repr(str(f)) in msg
    for d in details:
        assert d in msg, (d, msg)
    return msg


def u8(n: int, begin: int, end: int) -> dict:
    return {"dtype": "U8", "shape": [n], "data_offsets": [begin, end]}


def test_header_length_one_byte_short_is_refused(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.arange(8, dtype=torch.uint8)), f)
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    assert raw[8 + n - 1 : 8 + n] == b" "  # a padding space: the JSON still parses
    raw[:8] = struct.pack("<Q", n - 1)
    f.write_bytes(bytes(raw))
    refused(f, E.DATA_TRAILING.format(covered=8, size=9))


def test_data_must_be_covered_without_holes_overlaps_or_trailing_bytes(tmp_path):
    f = tmp_path / "x.safetensors"
    write_raw(f, {"a": u8(4, 0, 4), "b": u8(2, 6, 8)}, bytes(8))  # a hole
    refused(f, E.ENTRY_NOT_CONTIGUOUS.format(name="b", offsets=[6, 8], start=4))
    write_raw(f, {"a": u8(4, 4, 8)}, bytes(8))  # a hole at the start
    refused(f, E.ENTRY_NOT_CONTIGUOUS.format(name="a", offsets=[4, 8], start=0))
    write_raw(f, {"a": u8(8, 0, 8), "z": u8(0, 3, 3)}, bytes(8))  # empty, inside 'a'
    refused(f, E.ENTRY_NOT_CONTIGUOUS.format(name="z", offsets=[3, 3], start=8))
    write_raw(f, {"a": u8(8, 0, 8)}, bytes(9))  # a trailing byte
    refused(f, E.DATA_TRAILING.format(covered=8, size=9))
    write_raw(f, {"a": u8(8, 0, 8), "b": u8(2, 6, 8)}, bytes(8))  # an overlap
    refused(f, "must begin at byte 8")
    # empty tensors at a boundary are fine, in any order of the header
    write_raw(f, {"z": u8(0, 8, 8), "b": u8(4, 4, 8), "y": u8(0, 4, 4), "a": u8(4, 0, 4)}, bytes(8))
    back = load_safetensors(f)
    assert back.keys() == ["z", "b", "y", "a"]
    assert back["y"].shape == (0,)
    assert back["b"].shape == (4,)


def test_repeated_names_are_refused(tmp_path):
    f = tmp_path / "x.safetensors"
    one = '{"dtype":"U8","shape":[4],"data_offsets":[0,4]}'
    two = '{"dtype":"U8","shape":[8],"data_offsets":[0,8]}'
    write_bytes(f, '{"a":' + one + ',"a":' + two + "}", bytes(range(8)))
    refused(f, E.HEADER_DUPLICATE.format(name="a", what="the header"))
    write_bytes(f, '{"a":{"dtype":"U8","dtype":"U8","shape":[8],"data_offsets":[0,8]}}', bytes(8))
    refused(f, E.HEADER_DUPLICATE.format(name="dtype", what="the header"))


@pytest.mark.parametrize("encoding", ["bom", "utf-16", "utf-8-surrogate", "escaped-surrogate"])
def test_header_must_be_utf8_json_without_bom_or_unpaired_surrogates(tmp_path, encoding):
    f = tmp_path / "x.safetensors"
    text = json.dumps({"a": u8(8, 0, 8)})
    detail = {
        "bom": E.HEADER_BOM,
        "utf-16": "the header is not UTF-8 text",
        "utf-8-surrogate": "the header is not UTF-8 text",
        "escaped-surrogate": E.HEADER_SURROGATE.format(text="a\ud800", what="the header"),
    }[encoding]
    if encoding == "bom":
        h = b"\xef\xbb\xbf" + text.encode()
    elif encoding == "utf-16":
        h = text.encode("utf-16")
    elif encoding == "utf-8-surrogate":
        h = text.replace('"a"', '"a\ud800"').encode("utf-8", "surrogatepass")
    else:
        h = text.replace('"a"', '"a\\ud800"').encode()
    write_bytes(f, h, bytes(8))
    refused(f, detail)
    write_bytes(f, text.replace('"a"', '"\\ud83d\\ude00"'), bytes(8))  # a paired escape
    assert load_safetensors(f, structure="flat").keys() == ["\U0001f600"]


@pytest.mark.parametrize("depth", [128, 10_000])
def test_deep_nesting_is_a_format_error(tmp_path, depth):
    from tdfunc.interop._safetensors import MAX_DEPTH

    f = tmp_path / "x.safetensors"
    extra = "[" * (depth - 2) + "]" * (depth - 2)
    write_bytes(f, '{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":' + extra + "}}")
    refused(f, E.HEADER_TOO_DEEP.format(limit=MAX_DEPTH, what="the header"))
    extra = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)  # the deepest header accepted
    write_bytes(
        f, '{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":' + extra + "}}", b"x" * 8
    )
    assert load_safetensors(f)["a"].tolist() == [120] * 8


@pytest.mark.parametrize("value", ["NaN", "-Infinity", "1e400", "1" * 400])
def test_numbers_out_of_range_are_refused(tmp_path, value):
    f = tmp_path / "x.safetensors"
    write_bytes(f, '{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":' + value + "}}")
    refused(f, E.HEADER_NUMBER.format(text=value[:40], what="the header"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("shape", [8.0]), ("shape", [True]), ("shape", [2**64]), ("data_offsets", [0, 8, 8])],
)
def test_sizes_must_be_unsigned_64_bit_integers(tmp_path, field, value):
    f = tmp_path / "x.safetensors"
    entry = u8(8, 0, 8)
    entry[field] = value
    write_raw(f, {"a": entry}, bytes(8))
    what = E.ENTRY_BAD_SHAPE if field == "shape" else E.ENTRY_BAD_OFFSETS
    refused(f, what.split("{")[0].format() + "'a'")


def test_zero_element_tensors_with_huge_dims(tmp_path):
    f = tmp_path / "x.safetensors"
    big = 2**62

    def zero(shape):
        write_raw(
            f,
            {"e": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}, "a": u8(8, 0, 8)},
            bytes(8),
        )

    zero([0, big, big])  # the reference accepts it: so does tdfunc, without a stride overflow
    back = load_safetensors(f)
    assert back["e"].shape == (0, big, big)
    assert back["e"].numel() == 0
    assert back["e"].dtype == torch.float32
    assert back["a"].tolist() == [0] * 8
    zero([0, 2**70])
    refused(f, E.ENTRY_BAD_SHAPE.format(name="e", shape=[0, float(2**70)]))  # as a JSON double
    zero([0, 2**63])
    refused(f, "tensor 'e': torch cannot hold shape")
    zero([big, big, 0])  # the element count overflows 64 bits before the 0 (left to right)
    refused(f, E.ENTRY_OVERFLOW.format(name="e", shape=[big, big, 0], dtype="F32"))
    zero([2, 2**63 - 1, 0])  # the count fits 64 unsigned bits on the way: accepted
    assert load_safetensors(f)["e"].shape == (2, 2**63 - 1, 0)
    zero([0, 2**32, 2**31])  # torch's strides overflow: the reference refuses it too
    refused(f, "tensor 'e': torch cannot hold shape [0, 4294967296, 2147483648]")


def test_a_forged_zero_element_shape_loads_as_the_reference_or_is_refused(tmp_path):
    """No forged shape reaches torch unchecked: every zero-element shape of huge dims below
    (``[2**40, 2**40, 0]`` among them) loads with the shape the reference gives it, or is
    refused with SafetensorsFormatError naming the tensor where the reference refuses it,
    never with torch's RuntimeError. Unlike the other readers of a shape, this one accepts
    exactly the reference's shapes (so ``[0, 2**62, 2**62]`` loads)."""
    reference = pytest.importorskip("safetensors.torch")
    f = tmp_path / "x.safetensors"
    dims = [0, 2, 2**31, 2**32, 2**40, 2**62, 2**63 - 1]
    outcomes = set()
    for shape in itertools.product(dims, repeat=3):
        if 0 not in shape:
            continue
        write_raw(f, {"e": {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}})
        try:
            want = reference.load_file(str(f))["e"].shape
        except Exception:  # the reference's errors have no common type
            refused(f, "tensor 'e'")
            outcomes.add("refused")
        else:
            assert load_safetensors(f)["e"].shape == want == shape
            outcomes.add("loaded")
    assert outcomes == {"loaded", "refused"}
    write_raw(f, {"e": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}})
    refused(f, E.ENTRY_OVERFLOW.format(name="e", shape=[2**40, 2**40, 0], dtype="F32"))


def test_float8_e8m0_and_float4_files(tmp_path):
    f = tmp_path / "x.safetensors"
    write_raw(f, {"a": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}}, bytes(range(8)))
    back = load_safetensors(f)
    assert back["a"].dtype == torch.float8_e8m0fnu
    assert back["a"].view(torch.uint8).tolist() == list(range(8))
    # F4: two values a byte; the header counts values, torch.float4_e2m1fn_x2 pairs
    write_raw(f, {"a": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]}}, bytes(range(4)))
    back = load_safetensors(f)
    assert back["a"].dtype == torch.float4_e2m1fn_x2
    assert back["a"].shape == (2, 2)
    assert back["a"].view(torch.uint8).flatten().tolist() == [0, 1, 2, 3]
    write_raw(f, {"a": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, bytes(3))
    refused(f, E.ENTRY_F4_SHAPE.format(name="a", shape=[2, 3]))
    write_raw(f, {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, bytes(1))
    refused(f, E.ENTRY_PARTIAL_BYTE.format(name="a", shape=[3], dtype="F4"))
    # written back: the reference reads the same values and shape
    g = tmp_path / "y.safetensors"
    save_safetensors(TensorDict(p=back_f4(), e=torch.ones(2).to(torch.float8_e8m0fnu)), g)
    mine = load_safetensors(g)
    assert mine["p"].shape == (2, 2)
    assert mine["e"].dtype == torch.float8_e8m0fnu
    safetensors_torch = pytest.importorskip("safetensors.torch")
    theirs = safetensors_torch.load_file(str(g))
    assert theirs["p"].dtype == torch.float4_e2m1fn_x2
    assert theirs["p"].shape == (2, 2)
    assert torch.equal(theirs["p"].view(torch.uint8), back_f4().view(torch.uint8))
    with pytest.raises(
        TypeError, match=re.escape(E.ZERO_DIM_F4.format(key="'p'", filename=str(g)))
    ):
        save_safetensors(TensorDict(p=back_f4()[0, 0]), g, overwrite=True)


def back_f4() -> torch.Tensor:
    return torch.arange(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2).reshape(2, 2)


def test_metadata_must_map_strings_to_strings(tmp_path):
    f = tmp_path / "x.safetensors"
    for meta in ({"x": 1}, {"x": None}, [], "x"):
        write_raw(f, {"__metadata__": meta, "a": u8(8, 0, 8)}, bytes(8))
        refused(f, E.HEADER_METADATA)
    write_raw(f, {"__metadata__": None, "a": u8(8, 0, 8)}, bytes(8))  # null: no metadata
    assert load_safetensors(f)["a"].shape == (8,)


def test_a_missing_field_or_an_entry_that_is_no_object(tmp_path):
    f = tmp_path / "x.safetensors"
    write_raw(f, {"a": {"dtype": "U8", "shape": [8]}}, bytes(8))
    refused(f, E.ENTRY_MISSING.format(name="a", field="data_offsets"))
    write_raw(f, {"a": [1]}, bytes(8))
    refused(f, E.ENTRY_NOT_OBJECT.format(name="a"))
    write_raw(f, [1], b"")
    refused(f, E.HEADER_NOT_OBJECT)
    # unknown fields are ignored (as by the reference); so is the other spelling of a dtype
    write_raw(f, {"a": {**u8(8, 0, 8), "dtype": {"U8": None}, "note": [1, {"k": "v"}]}}, bytes(8))
    assert load_safetensors(f)["a"].dtype == torch.uint8


# ------------------------------------------------------------------ ties
def tied_file(tmp_path):
    w = torch.arange(6.0).reshape(3, 2)
    f = tmp_path / "tied.safetensors"
    save_safetensors(TensorDict(emb={"weight": w}, head={"weight": w}), f)
    return f


def test_a_tie_whose_second_copy_differs_is_refused(tmp_path):
    f = tied_file(tmp_path)
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin = json.loads(raw[8 : 8 + n])["head.weight"]["data_offsets"][0]
    raw[8 + n + begin : 8 + n + begin + 4] = struct.pack("<f", 100.0)  # another tool's edit
    f.write_bytes(bytes(raw))
    detail = E.STRUCT_TIE_DIFFERS.format(
        a="('emb', 'weight')",
        b="('head', 'weight')",
        na="emb.weight",
        nb="head.weight",
        what="value",
    )
    refused(f, detail)
    # each name's own copy stays readable
    nested = load_safetensors(f, structure="nested")
    assert nested["head", "weight"][0, 0].item() == 100.0
    assert nested["emb", "weight"][0, 0].item() == 0.0


def test_a_tied_container_refuses_mode_r_plus(tmp_path):
    f = tied_file(tmp_path)
    msg = E.TIED_WRITABLE.format(
        filename=str(f),
        a="('emb', 'weight')",
        b="('head', 'weight')",
        na="emb.weight",
        nb="head.weight",
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_safetensors(f, mode="r+")
    for structure in ("nested", "flat"):  # the tie is known from the structure all the same
        with pytest.raises(ValueError, match="mode='r\\+'"):
            load_safetensors(f, mode="r+", structure=structure)
    before = f.read_bytes()
    c = load_safetensors(f, mode="c")  # copy-on-write: one tensor under both keys
    assert c["head", "weight"] is c["emb", "weight"]
    c["emb", "weight"].add_(1)
    assert c["head", "weight"][0, 0].item() == 1.0
    assert f.read_bytes() == before


def test_an_untied_container_keeps_mode_r_plus(tmp_path):
    f = tmp_path / "x.safetensors"
    w = torch.zeros(2)
    save_safetensors(TensorDict(a=w, b=w.clone()), f)
    back = load_safetensors(f, mode="r+")
    back["b"].add_(1)
    assert load_safetensors(f)["a"].tolist() == [0.0, 0.0]
    assert load_safetensors(f)["b"].tolist() == [1.0, 1.0]


# ------------------------------------------------------------------ structure vs tensor table
def edit_structure(f, edit) -> None:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    desc = json.loads(header["__metadata__"][META_KEY])
    edit(desc["root"])
    header["__metadata__"][META_KEY] = json.dumps(desc)
    write_raw(f, header, raw[8 + n :])


def two_leaves(tmp_path):
    f = tmp_path / "x.safetensors"
    save_safetensors(TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}), f, overwrite=True)
    return f


def test_swapped_leaf_names_are_refused(tmp_path):
    f = two_leaves(tmp_path)

    def swap(root):
        a, b = root["children"][0][1], root["children"][1][1]["children"][0][1]
        a["leaf"], b["leaf"] = b["leaf"], a["leaf"]

    edit_structure(f, swap)
    refused(f, E.STRUCT_WRONG_NAME.format(key="'a'", name="n.b", expected="a"))


def test_a_renamed_child_key_is_refused(tmp_path):
    f = two_leaves(tmp_path)
    edit_structure(f, lambda root: root["children"][1][1]["children"][0].__setitem__(0, "zz"))
    refused(f, E.STRUCT_WRONG_NAME.format(key="('n', 'zz')", name="n.b", expected="n.zz"))


def test_a_tensor_named_by_two_keys_is_refused(tmp_path):
    f = two_leaves(tmp_path)
    edit_structure(f, lambda root: root["children"].append(["a", {"leaf": "a"}]))
    refused(f, E.STRUCT_NAMED_TWICE.format(name="a", key="'a'"))
    f = two_leaves(tmp_path)
    edit_structure(f, lambda root: root["children"].pop())
    refused(f, E.STRUCT_UNUSED.format(names=["n.b"]))
    f = two_leaves(tmp_path)
    edit_structure(f, lambda root: root["children"][1][1]["children"][0][1].update(tie="zz"))
    refused(f, E.STRUCT_BAD_TIE.format(key="('n', 'b')", tie="zz"))


# ------------------------------------------------------------------ names that cannot load back
def test_save_refuses_names_that_cannot_round_trip(tmp_path):
    f = tmp_path / "x.safetensors"
    msg = E.RESERVED_NAME.format(key="'__metadata__'", filename=str(f), name="__metadata__")
    with pytest.raises(ValueError, match=re.escape(msg)):
        save_safetensors(TensorDict({"__metadata__": torch.zeros(1)}), f)
    msg = E.INVALID_TEXT.format(what="key", text="a\ud800", filename=str(f))
    with pytest.raises(ValueError, match=re.escape(msg)):
        save_safetensors(TensorDict(n={"a\ud800": torch.zeros(1)}), f)
    msg = E.INVALID_TEXT.format(what="metadata key", text="k\udc00", filename=str(f))
    with pytest.raises(ValueError, match=re.escape(msg)):
        save_safetensors(TensorDict(a=torch.zeros(1)), f, metadata={"k\udc00": "v"})
    msg = E.INVALID_TEXT.format(what="metadata value", text="\udc00", filename=str(f))
    with pytest.raises(ValueError, match=re.escape(msg)):
        save_safetensors(TensorDict(a=torch.zeros(1)), f, metadata={"k": "\udc00"})
    with pytest.raises(TypeError, match="unpaired surrogate is not JSON data"):
        save_safetensors(Obs(torch.zeros(2, 1), tags=("\ud800",), batch_size=[2]), f)
    assert not f.exists()
    # a nested "__metadata__" key and a paired surrogate are fine
    save_safetensors(
        TensorDict(n={"__metadata__": torch.zeros(1)}, e={"\U0001f600": torch.ones(1)}), f
    )
    back = load_safetensors(f)
    assert back["n", "__metadata__"].tolist() == [0.0]
    assert back["e", "\U0001f600"].tolist() == [1.0]


def test_mode_r_plus_without_a_readable_structure_maps_each_name(tmp_path):
    f = tied_file(tmp_path)
    header = read_header(f)
    data = f.read_bytes()[-48:]
    header["__metadata__"][META_KEY] = "{{ not json"  # the escape hatch still opens it
    write_raw(f, header, data)
    back = load_safetensors(f, mode="r+", structure="nested")
    back["head", "weight"].add_(1)
    assert load_safetensors(f, structure="nested")["head", "weight"][0, 0].item() == 1.0
    with pytest.raises(SafetensorsFormatError, match="the structure is not JSON"):
        load_safetensors(f)
    header["__metadata__"][META_KEY] = '{"version": 1, "version": 1}'  # checked as strictly
    write_raw(f, header, data)
    msg = E.HEADER_DUPLICATE.format(name="version", what="the structure")
    with pytest.raises(SafetensorsFormatError, match=re.escape(msg)):
        load_safetensors(f)


def test_save_refuses_a_header_readers_would_refuse(tmp_path, monkeypatch):
    from tdfunc.interop import _safetensors

    monkeypatch.setattr(_safetensors, "MAX_HEADER", 64)
    f = tmp_path / "x.safetensors"
    with pytest.raises(
        ValueError, match=re.escape(f"cannot save to {str(f)!r}: the header would take")
    ):
        save_safetensors(TensorDict(a=torch.zeros(1)), f)
    assert not f.exists()


def test_tied_module_round_trip_through_state_dict(tmp_path):
    """A tied tensor is one leaf of from_module, written under its first name; the round
    trip into load_state_dict goes through tdfunc.state_dict, which fills the tied names."""
    m = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    m[1].weight = m[0].weight
    params = tdfunc.from_module(m).apply(lambda t: torch.full_like(t, 2.0))
    tdfunc.save_safetensors(params, tmp_path / "m.safetensors")
    loaded = tdfunc.load_safetensors(tmp_path / "m.safetensors")
    assert sorted(loaded.to_state_dict()) == ["0.weight"]
    fresh = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    fresh[1].weight = fresh[0].weight
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "1.weight"'):
        fresh.load_state_dict(loaded.to_state_dict())
    fresh.load_state_dict(tdfunc.state_dict(fresh, loaded))
    assert torch.equal(fresh[1].weight, torch.full((5, 3), 2.0))
    assert fresh[1].weight is fresh[0].weight


# ------------------------------------------------------------------ mappings (state dicts)
class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([2.0]))


def test_save_a_state_dict_with_tied_names(tmp_path):
    """A mapping of names to tensors (``tdfunc.state_dict(m, params)``) saves as it is: every
    name, tied ones included (two copies, as other tools expect); it loads back nested at
    ".", as the same file from another tool would, the tied names one tensor."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    m = _Tied()
    params = tdfunc.from_module(m).detach() * 3
    sd = tdfunc.state_dict(m, params)
    assert sd["head.weight"] is sd["emb.weight"]
    before = {k: v.clone() for k, v in sd.items()}
    f = tmp_path / "m.safetensors"
    save_safetensors(sd, f)
    assert list(sd) == list(before)  # the mapping is left as it was
    for k, v in sd.items():
        assert torch.equal(v, before[k])
    theirs = safetensors_torch.load_file(str(f))
    assert sorted(theirs) == sorted(m.state_dict())
    for k, v in sd.items():
        assert torch.equal(theirs[k], v)
    back = load_safetensors(f)
    assert sorted(back.flatten_keys(".").keys()) == sorted(sd)
    assert back["head", "weight"] is back["emb", "weight"]
    assert_close(back, TensorDict(sd).unflatten_keys("."))
    assert list(load_safetensors(f, structure="flat").keys()) == list(sd)
    m2 = _Tied()
    m2.load_state_dict(tdfunc.state_dict(m2, back))
    assert torch.equal(m2.head.weight, sd["head.weight"])
    assert torch.equal(m2.scale, sd["scale"])
    # the module's own state_dict (an OrderedDict) too
    save_safetensors(m.state_dict(), f, overwrite=True)
    assert sorted(safetensors_torch.load_file(str(f))) == sorted(m.state_dict())


def test_a_mapping_whose_names_do_not_nest_loads_back_flat(tmp_path):
    f = tmp_path / "x.safetensors"
    d = {"a": torch.zeros(1), "a.b": torch.ones(2), "c.d": torch.ones(1)}
    save_safetensors(d, f)
    back = load_safetensors(f)
    assert list(back.keys()) == ["a", "a.b", "c.d"]
    for k, v in d.items():
        assert torch.equal(back[k], v)


def test_a_mapping_that_is_not_names_to_tensors_is_refused(tmp_path):
    f = tmp_path / "x.safetensors"
    with pytest.raises(TypeError) as e:
        save_safetensors({1: torch.zeros(1)}, f)  # type: ignore[dict-item]
    assert str(e.value) == E.MAPPING_KEY.format(key=1, typ="int")
    with pytest.raises(TypeError) as e:
        save_safetensors({"a": torch.zeros(1), "b": {"c": torch.zeros(1)}}, f)
    assert str(e.value) == E.MAPPING_VALUE.format(key="b", typ="dict")
    with pytest.raises(TypeError) as e:
        save_safetensors([torch.zeros(1)], f)
    assert str(e.value) == E.NOT_A_CONTAINER.format(typ="list")
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict(a=torch.zeros(3), batch_size=[3])  # a Mapping too
    with pytest.raises(TypeError) as e:
        save_safetensors(theirs, f)
    assert str(e.value) == E.FROM_TENSORDICT.format(typ="TensorDict")
    assert not f.exists()


def test_the_guide_round_trip_to_transformers(tmp_path, monkeypatch):
    """The checkpoints guide's transformers section (``examples/checkpoints.py``) runs: a tiny
    GPT-2 (built from a config, no download), ``save_safetensors(tdfunc.state_dict(model,
    params), ...)`` and ``from_pretrained`` of that directory give the logits of
    ``functional_call`` with the params bit for bit (the tied ``lm_head.weight`` included)."""
    import importlib.util
    import sys

    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "examples", "checkpoints.py")
    with open(path) as fh:
        source = fh.read()
    section = source.split("# --8<-- [start:transformers]")[1].split("# --8<-- [end:transformers]")[
        0
    ]
    assert "tdfunc.save_safetensors(sd, " in section
    assert "sd = tdfunc.state_dict(gpt, params)" in section
    with open(os.path.join(root, "docs", "guides", "checkpoints.md")) as fh:
        assert "<!-- code: examples/checkpoints.py:transformers " in fh.read()
    spec = importlib.util.spec_from_file_location("_checkpoints_example_st", path)
    assert spec is not None
    assert spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ex)
    spec.loader.exec_module(ex)
    ex.transformers_round_trip(str(tmp_path))  # asserts the logits are equal
    assert os.path.isfile(tmp_path / "gpt2" / "model.safetensors")
    # the guide says AutoModel reads the same directory: every weight found, none left over
    transformers = pytest.importorskip("transformers")
    base, info = transformers.AutoModel.from_pretrained(
        str(tmp_path / "gpt2"), output_loading_info=True
    )
    assert type(base).__name__ == "GPT2Model"
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
