"""Hostile checkpoints: directories crafted by an attacker, not only damaged by accident.

Each case ends in a typed error, runs no code (a marker file that a pickle payload would
create never appears) and returns no data its files do not describe. The helpers reseal
what they change (recompute the manifest's records and the pointer's SHA-256), as an
attacker who edits a downloaded checkpoint would; only a digest kept elsewhere catches a
consistent forgery.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import distributed as tdd
from tdfunc._shapes import MAX_BYTES, SHAPE_BYTES, SHAPE_UNSAVED
from tdfunc.distributed._checkpoint import api as ck
from tdfunc.distributed._checkpoint import store
from tdfunc.distributed._common import errors as E

Corrupt = tdd.CheckpointCorruptError


class Payload:
    """Unpickling this creates ``marker``: proof that code from the checkpoint ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _td() -> Any:
    return tdfunc.TensorDict(
        a=torch.arange(12.0).reshape(4, 3),
        n={"i": torch.arange(4, dtype=torch.int32), "f": torch.ones(4, 2)},
        batch_size=[4],
    )


def _saved(tmp_path: Path, td: Any = None) -> tuple[Path, Path, str]:
    root = tmp_path / "ck"
    digest = tdd.save_checkpoint(root, _td() if td is None else td)
    return root, _vdir(root), digest


def _vdir(root: Path) -> Path:
    return root / json.loads((root / store.POINTER).read_text())["dir"]


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((_vdir(root) / store.MANIFEST).read_text())


def _reseal(root: Path, manifest: dict[str, Any] | None = None) -> None:
    """Write ``manifest`` (or keep the current one) with the data files' sizes recomputed,
    and record its SHA-256 in the pointer."""
    v = _vdir(root)
    m = _manifest(root) if manifest is None else manifest
    for name in m["files"]:
        if (v / name).is_file() and not (v / name).is_symlink():
            m["files"][name] = os.path.getsize(v / name)
    _put_manifest(root, json.dumps(m).encode())


def _put_manifest(root: Path, raw: bytes) -> None:
    """``raw`` as the manifest, its SHA-256 recorded in the pointer."""
    (_vdir(root) / store.MANIFEST).write_bytes(raw)
    ptr = json.loads((root / store.POINTER).read_text())
    ptr["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (root / store.POINTER).write_text(json.dumps(ptr))


def _no_code(tmp_path: Path) -> None:
    assert not (tmp_path / "pwned").exists()


def _pickle(tmp_path: Path) -> bytes:
    return pickle.dumps(Payload(str(tmp_path / "pwned")))


# --------------------------------------------------------------------------------------
# no code runs
# --------------------------------------------------------------------------------------
def test_crafted_dcp_metadata_is_never_unpickled(tmp_path: Path) -> None:
    root, v, digest = _saved(tmp_path)
    (v / store.DCP_METADATA).write_bytes(_pickle(tmp_path))
    got = tdd.load_checkpoint(root, digest=digest)  # the manifest is unchanged
    tdfunc.testing.assert_close(got, _td(), rtol=0, atol=0)
    tdd.export_safetensors(root, tmp_path / "x.safetensors")
    tdd.load_checkpoint(root, verify=False)
    _no_code(tmp_path)


@pytest.mark.parametrize("target", ["pointer", "manifest", "data"])
@pytest.mark.parametrize("verify", [True, False])
def test_crafted_pickle_in_every_file_read(tmp_path: Path, target: str, verify: bool) -> None:
    root, v, _ = _saved(tmp_path)
    payload = _pickle(tmp_path)
    if target == "pointer":
        (root / store.POINTER).write_bytes(payload)
    elif target == "manifest":
        _put_manifest(root, payload)
    else:
        (v / "__0_0.distcp").write_bytes(payload)
        _reseal(root)
    with pytest.raises(Corrupt):
        tdd.load_checkpoint(root, verify=verify)
    with pytest.raises(Corrupt):
        tdd.export_safetensors(root, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    _no_code(tmp_path)


def test_data_is_read_as_raw_bytes_never_unpickled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The item's pickle (inside DCP's torch.save archive) is replaced by a payload: the
    loader never parses it (torch.load is not called at all)."""
    root, v, _ = _saved(tmp_path)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    data = bytearray((v / "__0_0.distcp").read_bytes())
    at = data.find(b"data.pkl")
    assert at > 0
    got = tdd.load_checkpoint(root)
    tdfunc.testing.assert_close(got, _td(), rtol=0, atol=0)
    _no_code(tmp_path)


def test_byte_io_items_are_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    root, _, _ = _saved(tmp_path)
    m = store.Manifest(str(root))
    try:
        reader = store.Reader(m, verify=True)
        reader.set_up_storage_reader(reader.read_metadata(), True)
        item = ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex("a"),
            dest_offsets=torch.Size([0]),
            storage_index=MetadataIndex("a", [0, 0]),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([0]),
        )
        with pytest.raises(Corrupt, match="'a' is not a tensor"):
            reader.read_data(LoadPlan([item]), None)  # type: ignore[arg-type]
    finally:
        m.close()


# --------------------------------------------------------------------------------------
# chunk entries: swapped, overlapping, out of range, of the wrong size or dtype
# --------------------------------------------------------------------------------------
def _chunks(m: dict[str, Any], name: str) -> list[Any]:
    return next(e for e in m["leaves"] if e["name"] == name)["chunks"]


def _edit(fn: Any) -> Any:
    def change(m: dict[str, Any]) -> None:
        fn(m)

    return change


CHUNK_EDITS = {
    "beyond the file": (
        lambda m: _chunks(m, "a")[0].__setitem__(3, 10**6),
        "chunk beyond the end of __0_0.distcp",
    ),
    "wrong size": (lambda m: _chunks(m, "a")[0].__setitem__(4, 8), "chunk of the wrong size"),
    "offsets beyond the shape": (
        lambda m: _chunks(m, "a")[0].__setitem__(0, [1, 0]),
        "bad chunk entry",
    ),
    "another leaf's bytes": (
        lambda m: _chunks(m, "n.f")[0].__setitem__(3, _chunks(m, "a")[0][3]),
        "overlap in __0_0.distcp",
    ),
    "two chunks overlap": (
        lambda m: _chunks(m, "a").append(list(_chunks(m, "a")[0])),
        "chunks overlap",
    ),
    "a missing chunk": (lambda m: _chunks(m, "a").clear(), "chunks do not tile it"),
    "a file outside the folder": (
        lambda m: _chunks(m, "a")[0].__setitem__(2, "../__0_0.distcp"),
        "bad chunk entry",
    ),
    "an unknown file": (
        lambda m: m["files"].update({"../x.distcp": 0}),
        "bad file name '../x.distcp'",
    ),
    "an unknown dtype": (
        lambda m: m["leaves"][0].update(dtype="pickle"),
        "unknown dtype 'pickle'",
    ),
    "an edited dtype": (
        lambda m: next(e for e in m["leaves"] if e["name"] == "n.i").update(dtype="float32"),
        "checksum mismatch",
    ),
    "a huge declared shape": (
        lambda m: m["leaves"][0].update(shape=[1 << 40, 1 << 20]),
        "chunks do not tile it",
    ),
}


@pytest.mark.parametrize("case", sorted(CHUNK_EDITS))
def test_inconsistent_chunk_entries(tmp_path: Path, case: str) -> None:
    edit, text = CHUNK_EDITS[case]
    root, _, digest = _saved(tmp_path)
    m = _manifest(root)
    edit(m)
    _reseal(root, m)
    with pytest.raises(Corrupt) as e:
        tdd.load_checkpoint(root)
    assert text in str(e.value)
    assert str(root) in str(e.value)
    with pytest.raises(tdd.CheckpointDigestError) as d:
        tdd.load_checkpoint(root, digest=digest)
    assert digest in str(d.value)


@pytest.mark.parametrize("shape", [[1 << 40, 1 << 40, 0], [0, 1 << 32, 1 << 32], [1 << 61, 0]])
def test_a_forged_shape_never_reaches_torch(tmp_path: Path, shape: list[int]) -> None:
    """A leaf without elements whose other dims hold more bytes than any tensor (torch's
    storage size computation overflows on the first two) is corrupt, named with its shape
    and the limit, on every path that reads the manifest."""
    root, _, digest = _saved(tmp_path)
    m = _manifest(root)
    next(e for e in m["leaves"] if e["name"] == "a").update(shape=shape, chunks=[])
    _reseal(root, m)
    detail = "leaf 'a': " + SHAPE_BYTES.format(shape=shape, dtype=torch.float32, limit=MAX_BYTES)
    want = E.CKPT_CORRUPT.format(path=root, file=_vdir(root) / store.MANIFEST, detail=detail)
    for read in (
        lambda: tdd.load_checkpoint(root),
        lambda: tdd.load_checkpoint(root, verify=False),
        lambda: tdd.export_safetensors(root, tmp_path / "x.safetensors"),
    ):
        with pytest.raises(Corrupt) as e:
            read()
        assert str(e.value) == want
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(tdd.CheckpointDigestError):
        tdd.load_checkpoint(root, digest=digest)


def test_a_leaf_a_load_would_refuse_is_never_saved(tmp_path: Path) -> None:
    td = tdfunc.TensorDict(a=torch.ones(2), e=torch.empty(1 << 61, 0))
    detail = SHAPE_BYTES.format(shape=[1 << 61, 0], dtype=torch.float32, limit=MAX_BYTES)
    with pytest.raises(ValueError, match="a load would refuse it") as e:
        tdd.save_checkpoint(tmp_path / "ck", td)
    assert str(e.value) == SHAPE_UNSAVED.format(key="'e'", detail=detail)
    assert not (tmp_path / "ck").exists()


def test_swapped_chunks_load_only_without_a_digest(tmp_path: Path) -> None:
    """Two leaves of one shape and dtype with their chunk entries swapped: a consistent
    forgery of the manifest. Only the digest catches it (as documented)."""
    td = tdfunc.TensorDict(x=torch.zeros(3), y=torch.ones(3))
    root, _, digest = _saved(tmp_path, td)
    m = _manifest(root)
    cx, cy = _chunks(m, "x"), _chunks(m, "y")
    cx[0], cy[0] = cy[0], cx[0]
    _reseal(root, m)
    got = tdd.load_checkpoint(root)
    assert torch.equal(got["x"], td["y"])  # what the (forged) manifest says
    with pytest.raises(tdd.CheckpointDigestError):
        tdd.load_checkpoint(root, digest=digest)


@pytest.mark.parametrize("how", ["truncated", "extended", "flipped"])
def test_changed_data_files(tmp_path: Path, how: str) -> None:
    td = tdfunc.TensorDict(a=torch.arange(4096.0))
    root, v, digest = _saved(tmp_path, td)
    data = v / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    if how == "truncated":
        data.write_bytes(raw[:-10])
    elif how == "extended":
        data.write_bytes(raw + b"\0" * 10)
    else:
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    text = "checksum mismatch" if how == "flipped" else "the manifest records"
    with pytest.raises(Corrupt, match=text) as e:
        tdd.load_checkpoint(root)
    assert str(data) in str(e.value)
    with pytest.raises(Corrupt, match=text):  # a digest implies verify
        tdd.load_checkpoint(root, verify=False, digest=digest)
    if how == "flipped":  # verify=False skips only the checksums: the flip loads
        got = tdd.load_checkpoint(root, verify=False)
        assert (got["a"] != td["a"]).sum().item() == 1


# --------------------------------------------------------------------------------------
# structure and size limits, files that are not regular files
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 100000])
def test_deeply_nested_manifest(tmp_path: Path, depth: int) -> None:
    root, _, _ = _saved(tmp_path)
    tree = "[" * depth + "]" * depth
    raw = f'{{"format": "{store.FORMAT}", "tree": {tree}}}'.encode()
    _put_manifest(root, raw)
    with pytest.raises(Corrupt, match=r"not JSON|nested"):
        tdd.load_checkpoint(root)


def test_manifest_nesting_3000_containers(tmp_path: Path) -> None:
    root, v, _ = _saved(tmp_path)
    node = '{"type": "tdfunc.TensorDict", "context": [["c"], 0, [], null, null, [], []], '
    leaf = '{"type": null, "context": null, "children_spec": []}'
    tree = (node + '"children_spec": [') * 3000 + leaf + "]}" * 3000
    text = (v / store.MANIFEST).read_text()
    start = text.index('"tree":') + len('"tree":')
    end = text.index(',"leaves":')
    raw = (text[:start] + "[1, " + tree + "]" + text[end:]).encode()
    _put_manifest(root, raw)
    with pytest.raises(Corrupt, match=r"not JSON|nested"):
        tdd.load_checkpoint(root)


def test_manifest_over_its_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, v, _ = _saved(tmp_path)
    size = os.path.getsize(v / store.MANIFEST)
    monkeypatch.setattr(store, "MAX_MANIFEST_BYTES", size - 1)
    with pytest.raises(Corrupt, match=f"{size} bytes \\(limit {size - 1}\\)"):
        tdd.load_checkpoint(root)


@pytest.mark.parametrize("target", ["pointer", "manifest", "data", "metadata"])
def test_symlinks_are_never_followed(tmp_path: Path, target: str) -> None:
    other, _, _ = _saved(tmp_path / "other", tdfunc.TensorDict(a=torch.full((4, 3), 7.0)))
    root, v, _ = _saved(tmp_path)
    file = {
        "pointer": root / store.POINTER,
        "manifest": v / store.MANIFEST,
        "data": v / "__0_0.distcp",
        "metadata": v / store.DCP_METADATA,
    }[target]
    file.unlink()
    source = "/dev/zero" if target == "metadata" else _vdir(other) / "__0_0.distcp"
    if target == "manifest":
        source = _vdir(other) / store.MANIFEST
    elif target == "pointer":
        source = other / store.POINTER
    file.symlink_to(source)
    if target == "metadata":  # never opened: the load reads the manifest only
        tdfunc.testing.assert_close(tdd.load_checkpoint(root), _td(), rtol=0, atol=0)
        return
    with pytest.raises(Corrupt, match="a symlink"):
        tdd.load_checkpoint(root, verify=False)


def test_a_fifo_never_blocks(tmp_path: Path) -> None:
    root, v, _ = _saved(tmp_path)
    (v / store.MANIFEST).unlink()
    os.mkfifo(v / store.MANIFEST)
    result: list[Any] = []

    def load() -> None:
        try:
            tdd.load_checkpoint(root)
        except Exception as e:
            result.append(e)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the load blocked on a FIFO"
    assert isinstance(result[0], Corrupt)
    assert "not a regular file" in str(result[0])


def test_deep_container_refused_before_writing(tmp_path: Path) -> None:
    def nest(depth: int) -> Any:
        td = tdfunc.TensorDict(x=torch.ones(1))
        for _ in range(depth - 1):
            td = tdfunc.TensorDict(c=td)
        return td

    deep = nest(400)
    with pytest.raises(ValueError, match="nested 400 deep") as e:
        tdd.save_checkpoint(tmp_path / "deep", deep)
    assert str(e.value) == E.CKPT_TOO_DEEP.format(
        key=ck.fmt_key(("c",) * 399), depth=400, limit=store.MAX_DEPTH
    )
    assert not (tmp_path / "deep").exists()
    ok = nest(store.MAX_DEPTH)  # the deepest allowed round-trips
    digest = tdd.save_checkpoint(tmp_path / "ok", ok)
    got = tdd.load_checkpoint(tmp_path / "ok", like=ok, digest=digest)
    tdfunc.testing.assert_close(got, ok, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# digest
# --------------------------------------------------------------------------------------
def test_digest_round_trip_and_errors(tmp_path: Path) -> None:
    root, _, digest = _saved(tmp_path)
    assert digest.startswith("sha256:")
    assert len(digest) == 7 + 64
    assert tdd.checkpoint_digest(root) == digest
    other = tdd.save_checkpoint(root, _td() + 1, overwrite=True)
    assert other != digest
    with pytest.raises(tdd.CheckpointDigestError) as e:
        tdd.load_checkpoint(root, digest=digest)
    assert str(e.value) == E.CKPT_DIGEST.format(path=str(root), want=digest, got=other)
    for bad in ("abc", "sha256:xyz", digest.upper(), 3):
        with pytest.raises(ValueError, match="digest must be") as v:
            tdd.load_checkpoint(root, digest=bad)  # type: ignore[arg-type]
        assert str(v.value) == E.CKPT_BAD_DIGEST.format(digest=bad)


# --------------------------------------------------------------------------------------
# `like` of another shape or dtype
# --------------------------------------------------------------------------------------
def test_like_mismatch_is_a_structure_error(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    shape = _td().set("a", torch.zeros(4, 5))
    with pytest.raises(tdfunc.StructureError) as e:
        tdd.load_checkpoint(root, like=shape)
    assert str(e.value) == E.CKPT_SHAPE.format(
        key="'a'", what="the shape", saved=[4, 3], wanted=[4, 5]
    )
    dtype = _td().set(("n", "i"), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(tdfunc.StructureError) as e:
        tdd.load_checkpoint(root, like=dtype)
    assert str(e.value) == E.CKPT_SHAPE.format(
        key="('n', 'i')", what="the dtype", saved="torch.int32", wanted="torch.int64"
    )


# --------------------------------------------------------------------------------------
# saves that were killed, a full disk, the lock file, concurrent saves, racing readers
# --------------------------------------------------------------------------------------
def test_leftovers_of_a_killed_first_save_never_block(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    (root / f"{store.POINTER}.tmp-0a1b2c3d").write_text("{")
    (root / "v-00000000000000ab").mkdir()
    (root / "v-00000000000000ab" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    digest = tdd.save_checkpoint(root, _td())
    assert tdd.load_checkpoint(root, digest=digest)["a"].sum().item() == 66.0
    names = sorted(n for n in os.listdir(root) if not n.startswith(store.TRASH))
    assert names == [".lock", store.POINTER, _vdir(root).name]


def test_full_disk_refused_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, v, digest = _saved(tmp_path)
    real = os.statvfs

    class Full:
        def __init__(self, st: Any) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 10

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))
    with pytest.raises(OSError, match="no space left on device") as e:
        tdd.save_checkpoint(root, _td() + 1, overwrite=True)
    assert e.value.errno == errno.ENOSPC
    assert "no space left on device" in str(e.value)
    assert sorted(p.name for p in root.glob("v-*")) == [v.name]  # nothing written
    monkeypatch.undo()
    assert tdd.load_checkpoint(root, digest=digest)["a"].sum().item() == 66.0


def test_lock_symlink_is_refused(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    (root / store.LOCK).unlink()
    outside = tmp_path / "outside"
    (root / store.LOCK).symlink_to(outside)
    with pytest.raises(tdd.CheckpointError) as e:
        tdd.save_checkpoint(root, _td() + 1, overwrite=True)
    assert str(e.value) == E.CKPT_BAD_LOCK.format(path=str(root), file=str(root / store.LOCK))
    assert not outside.exists()
    assert tdd.load_checkpoint(root)["a"].sum().item() == 66.0


def test_commit_spares_a_live_save_and_the_loser_gets_a_conflict(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    base = _vdir(root).name
    live = str(root / "v-00000000000000cc")
    owner = store.own_version(live)  # a save still writing
    try:
        tdd.save_checkpoint(root, _td() + 1, overwrite=True)  # commits, cleans up
        time.sleep(0.2)
        assert os.path.isdir(live)  # spared
        with pytest.raises(tdd.CheckpointConflictError) as e:
            store.commit(str(root), live, "0" * 64, base)  # it started from `base`
        assert str(e.value) == E.CKPT_CONFLICT.format(
            path=str(root), now=_vdir(root).name, base=base
        )
    finally:
        os.close(owner)
    assert tdd.load_checkpoint(root)["a"].sum().item() == 66.0 + 12


def test_a_load_keeps_the_version_it_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit (and the deletion of the old version) lands while the load is between
    opening the files and reading them: the load returns the old version, whole."""
    root, old, _ = _saved(tmp_path)
    real = store.Manifest.skeleton
    cleaned: list[bool] = []

    def commit_meanwhile(self: Any) -> Any:
        if not cleaned:
            cleaned.append(True)
            tdd.save_checkpoint(root, _td() + 100, overwrite=True)
            for _ in range(100):  # the old folder is deleted in the background
                if not old.exists():
                    break
                time.sleep(0.05)
            assert not old.exists()
        return real(self)

    monkeypatch.setattr(store.Manifest, "skeleton", commit_meanwhile)
    got = tdd.load_checkpoint(root)
    tdfunc.testing.assert_close(got, _td(), rtol=0, atol=0)
    monkeypatch.undo()
    tdfunc.testing.assert_close(tdd.load_checkpoint(root), _td() + 100, rtol=0, atol=0)


def test_version_folder_vanishing_before_open_retries(tmp_path: Path) -> None:
    """The pointer names a folder a commit has just replaced: the load follows the pointer
    again (and reports a missing folder only if the pointer did not move)."""
    root, old, _ = _saved(tmp_path)
    ptr = (root / store.POINTER).read_bytes()
    tdd.save_checkpoint(root, _td() + 1, overwrite=True)
    m = store.Manifest.__new__(store.Manifest)
    m.root = str(root)
    m.fds = {}
    assert isinstance(m._moved_or(ptr, str(old), "missing"), store._Moved)
    now = (root / store.POINTER).read_bytes()
    assert isinstance(m._moved_or(now, str(old), "missing"), Corrupt)


def test_missing_version_folder_is_corrupt(tmp_path: Path) -> None:
    root, v, _ = _saved(tmp_path)
    for f in v.iterdir():
        f.unlink()
    v.rmdir()
    with pytest.raises(Corrupt, match="missing"):
        tdd.load_checkpoint(root)


def test_files_on_disk(tmp_path: Path) -> None:
    """A small container's checkpoint: the data file, DCP's .metadata (for DCP's own
    reader) and the manifest; no side files are left."""
    root, v, _ = _saved(tmp_path)
    assert sorted(p.name for p in v.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert glob.glob(str(root / "*.tmp-*")) == []


def test_format_version_1_is_refused_with_a_reason(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    ptr = json.loads((root / store.POINTER).read_text())
    ptr["version"] = 1
    (root / store.POINTER).write_text(json.dumps(ptr))
    with pytest.raises(Corrupt) as e:
        tdd.load_checkpoint(root)
    assert E.CKPT_OLD_FORMAT in str(e.value)


def test_a_directory_that_is_not_a_checkpoint_is_left_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        tdd.save_checkpoint(root, _td())
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]  # no lock file either


# --------------------------------------------------------------------------------------
# a structure that names code: the decoder imports nothing, looks nothing up by a name
# from the file, and accepts only tdfunc's node kinds and context shapes
# --------------------------------------------------------------------------------------
_LEAF = {"type": None, "context": None, "children_spec": []}


def _enum_dict(fqn: str, name: str) -> dict[str, Any]:
    """A ``dict`` node whose context torch's decoder parses with its enum hook: it imports
    the module of ``fqn``, follows the attribute chain and subscripts it with ``name``."""
    ctx = json.dumps([{"__enum__": True, "fqn": fqn, "name": name}])
    return {"type": "builtins.dict", "context": ctx, "children_spec": [dict(_LEAF)]}


def _evil_library(tmp_path: Path) -> Path:
    """A shared library whose constructor writes the marker file (built with the C
    compiler when there is one)."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the library")
    src = tmp_path / "evil.c"
    marker = json.dumps(str(tmp_path / "pwned"))
    src.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void evil(void) {\n"
        f'    FILE *f = fopen({marker}, "w"); if (f) fclose(f);\n'
        "}\n"
    )
    lib = tmp_path / "ck" / "libevil.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _evil_module(tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``evil.py`` shipped in the version folder, importable because the checkpoint's
    parent is on ``sys.path`` (a script next to the checkpoint); returns its dotted name."""
    import importlib

    v = _vdir(root)
    (v / "evil.py").write_text(
        "import enum\n"
        f"open({str(tmp_path / 'pwned')!r}, 'w').close()\n"
        "class D(enum.Enum):\n"
        "    a = 'a'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return f"{root.name}.{v.name}.evil"


HOSTILE_NODES = ["enum import", "defaultdict import", "ctypes dlopen", "evil module", "list"]


def _hostile_node(
    case: str, tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], str | None]:
    """The node spec of ``case`` and the module it would import (None: none)."""
    if case == "enum import":
        return _enum_dict("this:s", "a"), "this"
    if case == "defaultdict import":
        ctx = {"default_factory_module": "this", "default_factory_name": "s", "dict_context": ["a"]}
        return {"type": "collections.defaultdict", "context": ctx, "children_spec": [_LEAF]}, "this"
    if case == "ctypes dlopen":
        return _enum_dict("ctypes:cdll", str(_evil_library(tmp_path))), None
    if case == "evil module":
        name = _evil_module(tmp_path, root, monkeypatch)
        return _enum_dict(f"{name}:D", "a"), name
    assert case == "list"
    return {"type": "builtins.list", "context": "null", "children_spec": [_LEAF]}, None


@pytest.mark.parametrize("case", HOSTILE_NODES)
def test_a_structure_naming_code_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Each node replaces the leaf ``a``: torch's JSON decoder would import a module named
    by the file (or dlopen a library shipped next to it); tdfunc's decoder refuses the
    node kind before looking at its context."""
    import sys

    root, _, digest = _saved(tmp_path)
    node, module = _hostile_node(case, tmp_path, root, monkeypatch)
    if module is not None:
        monkeypatch.delitem(sys.modules, module, raising=False)
    m = _manifest(root)
    m["tree"][1]["children_spec"][0] = node
    _reseal(root, m)
    with pytest.raises(Corrupt) as e:
        tdd.load_checkpoint(root)
    _no_code(tmp_path)
    assert module is None or module not in sys.modules
    assert str(root) in str(e.value)
    assert E.SPEC_NODE_KIND.format(name=node["type"]) in str(e.value)
    with pytest.raises(tdd.CheckpointDigestError):
        tdd.load_checkpoint(root, digest=digest)


@pytest.mark.parametrize("case", HOSTILE_NODES)
def test_transfer_metadata_naming_code_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The same structures received from a peer (send/recv metadata): the same decoder."""
    import sys

    from tdfunc.distributed._common import wire

    root, _, _ = _saved(tmp_path)
    node, module = _hostile_node(case, tmp_path, root, monkeypatch)
    if module is not None:
        monkeypatch.delitem(sys.modules, module, raising=False)
    tree = _manifest(root)["tree"]
    tree[1]["children_spec"][0] = node
    with pytest.raises(E.SpecFormatError) as e:
        wire.unflatten(tree, [torch.zeros(4, 3), torch.zeros(4, dtype=torch.int32)])
    _no_code(tmp_path)
    assert module is None or module not in sys.modules
    assert str(e.value) == E.SPEC_NODE_KIND.format(name=node["type"])


def test_a_context_naming_code_inside_a_container_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The enum hook's fields inside tdfunc's own context (keys, static fields, nested
    containers): plain JSON values to tdfunc's decoder, never looked up."""
    import sys

    root, _, _ = _saved(tmp_path)
    name = _evil_module(tmp_path, root, monkeypatch)
    hook = {"__enum__": True, "fqn": f"{name}:D", "name": "a"}
    for edit in (
        lambda c: c[0].__setitem__(0, hook),  # a key
        lambda c: c.__setitem__(5, [["s", hook]]),  # a static field
        lambda c: c[7][0].__setitem__(1, hook),  # a nested container's type
        lambda c: c.__setitem__(3, hook),  # the device
    ):
        m = _manifest(root)
        edit(m["tree"][1]["context"])
        _reseal(root, m)
        with pytest.raises(Corrupt, match="bad structure"):
            tdd.load_checkpoint(root)
    _no_code(tmp_path)
    assert name not in sys.modules


def test_a_dtype_name_is_never_looked_up_on_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``getattr(torch, name)`` would reach torch's module ``__getattr__`` (which imports
    lazy submodules and calls deprecated helpers): dtypes come from a table."""
    from tdfunc.distributed._common import wire

    asked: list[str] = []

    def record(name: str) -> Any:
        asked.append(name)
        raise AttributeError(name)

    monkeypatch.setattr(torch, "__getattr__", record, raising=False)
    root, _, _ = _saved(tmp_path)
    m = _manifest(root)
    m["leaves"][0]["dtype"] = "not_a_dtype"
    _reseal(root, m)
    with pytest.raises(Corrupt, match="unknown dtype 'not_a_dtype'"):
        tdd.load_checkpoint(root)
    with pytest.raises(ValueError, match="unknown dtype"):
        wire.dtype_from_name("not_a_dtype")
    assert "not_a_dtype" not in asked
    assert wire.dtype_from_name("bfloat16") is torch.bfloat16


def test_a_list_node_where_a_leaf_belongs_is_corrupt(tmp_path: Path) -> None:
    root, _, _ = _saved(tmp_path)
    m = _manifest(root)
    m["tree"][1]["children_spec"][0] = {
        "type": "builtins.list",
        "context": "null",
        "children_spec": [_LEAF],
    }
    _reseal(root, m)
    with pytest.raises(Corrupt, match="bad structure"):
        tdd.load_checkpoint(root)


# --------------------------------------------------------------------------------------
# duplicate JSON keys: one reading for every reader
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["manifest top", "manifest nested", "pointer"])
def test_duplicate_json_keys_are_corrupt(tmp_path: Path, where: str) -> None:
    root, v, _ = _saved(tmp_path)
    if where == "pointer":  # the first "dir" names nothing; the last one wins elsewhere
        raw = (root / store.POINTER).read_bytes()
        (root / store.POINTER).write_bytes(b'{"dir": "v-0000000000000000", ' + raw[1:])
        file = str(root / store.POINTER)
    else:
        raw = (v / store.MANIFEST).read_bytes()
        if where == "manifest top":
            raw = b'{"leaves": [], ' + raw[1:]
        else:
            raw = raw.replace(b'"dtype":', b'"dtype":"uint8","dtype":', 1)
        _put_manifest(root, raw)
        file = str(v / store.MANIFEST)
    with pytest.raises(Corrupt) as e:
        tdd.load_checkpoint(root)
    assert E.CKPT_CORRUPT.format(path=root, file=file, detail="") in str(e.value)
    assert "given twice" in str(e.value)


# --------------------------------------------------------------------------------------
# many chunks: the overlap check sorts (n log n), it does not compare every pair
# --------------------------------------------------------------------------------------
def _split_into_chunks(root: Path, n: int) -> dict[str, Any]:
    """The manifest of a one-leaf checkpoint ``x`` of ``n`` float32 values rewritten as
    ``n`` chunks of one value each (valid, resealed)."""
    m = _manifest(root)
    (entry,) = m["leaves"]
    ((_, _, rel, at, _, _),) = entry["chunks"]
    raw = (_vdir(root) / rel).read_bytes()
    header = store._chunk_header("float32", [1])
    chunks = []
    for i in range(n):
        piece = raw[at + 4 * i : at + 4 * i + 4]
        sha = hashlib.sha256(header + hashlib.sha256(piece).digest()).hexdigest()
        chunks.append([[i], [1], rel, at + 4 * i, 4, sha])
    entry["chunks"] = chunks
    return m


def test_a_leaf_of_the_most_chunks_loads(tmp_path: Path) -> None:
    n = store.MAX_CHUNKS_PER_LEAF
    td = tdfunc.TensorDict(x=torch.arange(float(n)))
    root, _, _ = _saved(tmp_path, td)
    _reseal(root, _split_into_chunks(root, n))
    got = tdd.load_checkpoint(root)
    assert torch.equal(got["x"], td["x"])


@pytest.mark.parametrize("how", ["duplicate", "overlapping", "gap"])
def test_a_leaf_of_many_chunks_that_overlap_is_refused(tmp_path: Path, how: str) -> None:
    n = store.MAX_CHUNKS_PER_LEAF
    td = tdfunc.TensorDict(x=torch.arange(float(n)))
    root, _, _ = _saved(tmp_path, td)
    m = _split_into_chunks(root, n)
    chunks = m["leaves"][0]["chunks"]
    if how == "duplicate":  # the same chunk twice, one missing: the volume still adds up
        chunks[-1] = list(chunks[0])
        text = "chunks overlap"
    elif how == "overlapping":  # two values in one chunk, the next one missing
        c = chunks[n // 2]
        c[1], c[4] = [2], 8
        c[5] = hashlib.sha256(
            store._chunk_header("float32", [2])
            + hashlib.sha256((_vdir(root) / c[2]).read_bytes()[c[3] : c[3] + 8]).digest()
        ).hexdigest()
        del chunks[n // 2 + 2]
        text = "chunks overlap"
    else:
        del chunks[n // 3]
        text = "chunks do not tile it"
    _reseal(root, m)
    with pytest.raises(Corrupt, match=text):
        tdd.load_checkpoint(root)


def test_chunks_of_a_grid_load_and_other_tilings_are_refused(tmp_path: Path) -> None:
    """A 2-D leaf in 2 x 2 chunks (what sharding along two mesh dims writes) loads; the
    same bytes described as a brick layout (rows of different cuts: a tiling that is not
    a grid, which no save writes) are refused."""
    td = tdfunc.TensorDict(x=torch.arange(16.0).reshape(4, 4))
    root, v, _ = _saved(tmp_path, td)
    m = _manifest(root)
    (entry,) = m["leaves"]
    ((_, _, rel, at, _, _),) = entry["chunks"]
    raw = (v / rel).read_bytes()
    values = td["x"]

    def chunk(off: list[int], size: list[int]) -> list[Any]:
        piece = values[off[0] : off[0] + size[0], off[1] : off[1] + size[1]].contiguous()
        data = piece.numpy().tobytes()
        at_piece = raw.find(data, at)
        if at_piece < 0:  # not laid out in the file: append its bytes
            at_piece = (v / rel).stat().st_size
            with open(v / rel, "ab") as f:
                f.write(data)
        header = store._chunk_header("float32", size)
        sha = hashlib.sha256(header + hashlib.sha256(data).digest()).hexdigest()
        return [off, size, rel, at_piece, len(data), sha]

    # full rows are contiguous in the file: a 2 x 1 grid of row blocks
    entry["chunks"] = [chunk([0, 0], [2, 4]), chunk([2, 0], [2, 4])]
    _reseal(root, m)
    assert torch.equal(tdd.load_checkpoint(root)["x"], values)
    # rows 0-1 as one block, rows 2-3 cut into two halves of columns: a valid tiling that
    # is not a grid (columns 0-1 / 2-3 do not cut rows 0-1)
    entry["chunks"] = [chunk([0, 0], [2, 4]), chunk([2, 0], [2, 2]), chunk([2, 2], [2, 2])]
    _reseal(root, m)
    with pytest.raises(Corrupt) as e:
        tdd.load_checkpoint(root)
    assert E.CKPT_NOT_GRID.format(name="x") in str(e.value)


def test_the_earlier_form_of_a_structure_still_loads() -> None:
    """Contexts of 7 entries with nested containers as child specs (what tdfunc wrote
    before nested nodes moved into the context) are within the allow-list."""
    from tdfunc.distributed._common import wire

    leaf = dict(_LEAF)
    inner = {
        "type": "tdfunc.TensorDict",
        "context": [["b"], 1, [2], None, None, [], []],
        "children_spec": [leaf],
    }
    old = [
        1,
        {
            "type": "tdfunc.TensorDict",
            "context": [["a", "n"], 1, [1, 1], None, None, [], []],
            "children_spec": [leaf, inner],
        },
    ]
    back = wire.unflatten(old, [torch.zeros(2), torch.ones(2, 3)])
    assert back.batch_size == (2,)
    assert back["n"].batch_size == (2,)
    assert back["n", "b"].shape == (2, 3)


def test_static_fields_of_nested_tuples_load_as_saved(tmp_path: Path) -> None:
    """JSON lists become tuples at every depth (they became lists below the first level,
    so the loaded static field differed from the saved one and ``like`` was refused)."""
    root, _, _ = _saved(tmp_path, Cuts(torch.zeros(2), batch_size=[2]))
    got = tdd.load_checkpoint(root, like=Cuts(torch.ones(2), batch_size=[2]))
    assert got.cuts == ((1, 2), (3, 4))
    assert tdd.load_checkpoint(root).cuts == ((1, 2), (3, 4))


@tdfunc.tensorclass
class Cuts:
    x: torch.Tensor
    cuts: tuple = ((1, 2), (3, 4))


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c[0].__setitem__(0, {"__enum__": True, "fqn": "this:s", "name": "a"}),
        lambda c: c.__setitem__(1, "1"),
        lambda c: c.__setitem__(2, [1, 1, 1]),
        lambda c: c.__setitem__(3, "cuda; import os"),
        lambda c: c.__setitem__(5, [["s", {"__enum__": True}]]),
        lambda c: c.__setitem__(6, [7]),
        lambda c: c[7][0].__setitem__(0, 5),
    ],
    ids=["key", "batch dims", "ndims", "device", "static", "leafless", "nested position"],
)
def test_torch_decoder_gets_the_same_checks_for_tdfunc_nodes(edit: Any) -> None:
    """``torch.utils._pytree.treespec_loads`` (used by ``torch.export.load``) hands a
    tdfunc node's context to tdfunc's check: a malformed one is a ``ValueError``."""
    import torch.utils._pytree as P

    from tdfunc._errors import BAD_CONTEXT

    td = _td()
    dumped = json.loads(P.treespec_dumps(P.tree_structure(td)))
    assert P.treespec_loads(json.dumps(dumped)) == P.tree_structure(td)
    edit(dumped[1]["context"])
    with pytest.raises(ValueError, match="malformed") as e:
        P.treespec_loads(json.dumps(dumped))
    assert str(e.value) == BAD_CONTEXT
