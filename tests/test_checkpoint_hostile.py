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
