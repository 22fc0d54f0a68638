"""safetensors files: round trips, files of other tools, zero-copy read-only loading, errors."""

from __future__ import annotations

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
    theirs = {d for d in safetensors_torch._TYPES.values() if d is not None}
    assert set(ST_NAMES) <= theirs | {torch.complex64}


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
    with pytest.raises(TypeError, match=re.escape(E.NOT_A_CONTAINER.format(typ="dict"))):
        save_safetensors({"a": torch.zeros(1)}, f)
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
    write_raw(f, {"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(TypeError, match=re.escape(f"from {str(f)!r}: safetensors dtype 'F4'")):
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
