"""Storage safety of tdfunc.memmap: what a reader sees while another process overwrites a store,
two writers racing, pickles of a replaced store, cleanup after commits, stores whose files are
symbolic links, torch's storage-level APIs on a leaf, stores larger than RAM, and manifests
that do not fit their classes."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import tdfunc
from tdfunc import (
    MemmapFormatError,
    MemoryMappedTensor,
    StoreCleanupWarning,
    StoreReplacedError,
    TensorDict,
    load,
    save,
    tensorclass,
)
from tdfunc._shapes import MAX_BYTES, SHAPE_BYTES, SHAPE_DIM
from tdfunc.memmap import _errors as E
from tdfunc.memmap import _store as S

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HELPERS = HERE / "_memmap_helpers.py"
sys.path.insert(0, str(HERE))
from _memmap_helpers import VERSIONS, data_path  # noqa: E402


def fmt(template: str) -> str:
    return re.escape(template.split("{")[0])


def run_child(args: list[str], timeout: float = 120) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(HELPERS), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


def small(value: float = 1.0, n: int = 8) -> TensorDict:
    return TensorDict(a=torch.full((n,), value), b={"c": torch.full((n, 2), value)}, batch_size=[n])


# ------------------------------------------------------------------------------ 1. torn reads
def _whole_version(td: TensorDict) -> str | None:
    """The name of the version ``td`` is entirely made of, or ``None`` for a mix."""
    for name, v in VERSIONS.items():
        if (
            len(td.keys()) == v["n_leaves"]
            and td.batch_size == (v["numel"],)
            and all(
                leaf.dtype == getattr(torch, v["dtype"]) and bool((leaf == v["value"]).all())
                for leaf in td.values()
            )
        ):
            return name
    return None


@pytest.mark.slow
def test_load_during_overwrites_returns_one_whole_version(tmp_path):
    """A reader loading while another process replaces the store (two versions with
    different layouts) gets one complete version every time, or a typed error; never a mix."""
    path = str(tmp_path / "s")
    save(tdfunc.TensorDict(k0=torch.zeros(4), batch_size=[4]), path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen(
        [sys.executable, str(HELPERS), "writer", path, "6"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    seen: dict[str, int] = {}
    try:
        assert writer.stdout.readline().strip() == "STARTED"
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                td = load(path)
            except StoreReplacedError:
                seen["busy"] = seen.get("busy", 0) + 1
                continue
            name = _whole_version(td)
            if name is None and len(td.keys()) == 1:
                name = "initial"
            assert name is not None, {k: v[:3].tolist() for k, v in td.items()}
            seen[name] = seen.get(name, 0) + 1
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert seen.get("a", 0) + seen.get("b", 0) > 20, seen  # the race really happened


# ------------------------------------------------------------------------------ 2. by name
@tensorclass
class Pair:
    obs: torch.Tensor
    act: torch.Tensor
    name: str = "x"
    tag: str = "y"


@tensorclass
class WithTensor:
    x: torch.Tensor


def _edit(path: Path, fn) -> None:
    m = json.loads((path / "manifest.json").read_text())
    fn(m)
    (path / "manifest.json").write_text(json.dumps(m, sort_keys=True))


def test_tensorclass_fields_are_matched_by_name(tmp_path):
    p = tmp_path / "s"
    save(Pair(torch.ones(3), torch.zeros(3), name="n", tag="t", batch_size=[3]), p)
    # the same JSON object, written with its keys in another order: same store
    _edit(p, lambda m: m["root"]["static"].reverse())
    back = load(p)
    assert back.obs.tolist() == [1.0] * 3
    assert back.act.tolist() == [0.0] * 3
    assert back.name == "n"
    assert back.tag == "t"

    def rename(m):
        kids = m["root"]["children"]
        kids["other"] = kids.pop("act")

    _edit(p, rename)
    with pytest.raises(
        MemmapFormatError, match=r"fields of .*Pair at <root> are \['obs', 'other'\]"
    ):
        load(p)


# ------------------------------------------------------------------------------ 3. two writers
def test_save_without_overwrite_never_replaces_a_store_that_appeared(tmp_path, monkeypatch):
    """The check before writing passed, then another writer committed: this save must fail
    with FileExistsError and leave the other store alone."""
    p = tmp_path / "s"
    save(small(1.0), p)
    monkeypatch.setattr(S, "_check_target", lambda path, overwrite: None)
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        save(small(2.0), p)
    tdfunc.testing.assert_close(load(p), small(1.0))
    assert sorted(os.listdir(tmp_path)) == ["s"]


@pytest.mark.slow
def test_two_processes_saving_to_one_new_path(tmp_path):
    rep = run_child(["race-saves", str(tmp_path), "12"])
    for r in rep["rounds"]:
        outcomes = sorted(x.split()[0] for x in r["results"])
        assert outcomes == ["FileExistsError", "ok"], r
        winner = float(next(x for x in r["results"] if x.startswith("ok")).split()[1])
        assert r["state"] == {"values": [winner], "keys": 4}, r
        assert r["leftovers"] == [], r


# ------------------------------------------------------------------------------ 4. pickles
def test_unpickling_a_leaf_of_a_replaced_store_is_an_error(tmp_path):
    p = tmp_path / "s"
    save(small(1.0), p)
    leaf = load(p)["b", "c"][2:]
    blob = pickle.dumps(leaf)
    assert pickle.loads(blob).tolist() == [[1.0, 1.0]] * 6  # same version: fine
    save(TensorDict(a=torch.arange(100.0), batch_size=[100]), p, overwrite=True)
    with pytest.raises(StoreReplacedError, match=fmt(E.PICKLE_FILE_REPLACED)) as ei:
        pickle.loads(blob)
    assert str(data_path(p)) in str(ei.value)
    shutil.rmtree(p)
    with pytest.raises(StoreReplacedError, match=fmt(E.PICKLE_FILE_GONE)):
        pickle.loads(blob)
    # a raw file replaced at the same path
    f = tmp_path / "raw.bin"
    MemoryMappedTensor.from_tensor(torch.ones(4), f)
    sender = MemoryMappedTensor.from_filename(f, torch.float32, (4,))  # still mapped here
    blob = pickle.dumps(sender)
    os.unlink(f)
    MemoryMappedTensor.from_tensor(torch.zeros(4), f)
    with pytest.raises(StoreReplacedError):
        pickle.loads(blob)
    assert sender.tolist() == [1.0] * 4


def test_pickled_leaf_returned_by_a_compiled_function_keeps_its_identity(tmp_path):
    p = tmp_path / "s"
    save(small(1.0), p)
    view = torch.compile(lambda t: t[2:], backend="eager", fullgraph=True)(load(p))
    blob = pickle.dumps(view["a"])
    save(small(3.0, n=16), p, overwrite=True)
    with pytest.raises(StoreReplacedError):
        pickle.loads(blob)


# ------------------------------------------------------------------------------ 6. cleanup
def test_cleanup_failure_after_commit_is_a_warning(tmp_path, monkeypatch):
    p = tmp_path / "s"
    save(small(1.0), p)

    def refuse(path, *a, **k):
        raise PermissionError(13, "Operation not permitted")

    monkeypatch.setattr(S.shutil, "rmtree", refuse)
    with pytest.warns(StoreCleanupWarning, match="committed, but the temporary directory"):
        save(small(2.0), p, overwrite=True)
    tdfunc.testing.assert_close(load(p), small(2.0))  # the new store is in place


def test_next_save_removes_stale_temporaries_of_killed_saves(tmp_path):
    p = tmp_path / "s"
    save(small(1.0), p)
    for name in (".s.saving-aaaaaaaaaaaa", ".s.old-bbbbbbbbbbbb", ".s.saving-cccccccccccc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data.bin").write_bytes(b"x" * 100)
    (tmp_path / ".other.saving-dddddddddddd").mkdir()  # another store's: not touched
    live = os.open(tmp_path / ".s.saving-cccccccccccc", os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_EX)  # a save in progress holds its directory locked
    try:
        save(small(2.0), p, overwrite=True)
    finally:
        os.close(live)
    assert sorted(os.listdir(tmp_path)) == [
        ".other.saving-dddddddddddd",
        ".s.saving-cccccccccccc",
        "s",
    ]


def test_long_store_names_get_short_temporary_names(tmp_path):
    p = tmp_path / ("n" * 250)
    save(small(1.0), p)
    save(small(2.0), p, overwrite=True)
    tdfunc.testing.assert_close(load(p), small(2.0))


# ------------------------------------------------------------------------------ 7. symlinks
@pytest.mark.parametrize("mode", ["r", "r+", "c"])
def test_symlinked_store_files_are_refused(tmp_path, mode):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(64, dtype=np.float32).tobytes())
    before = outside.read_bytes()
    p = tmp_path / "s"
    save(TensorDict(k=torch.zeros(16), batch_size=[16]), p)
    os.unlink(p / "data.bin")
    os.symlink(outside, p / "data.bin")
    with pytest.raises(MemmapFormatError, match="is a symbolic link or not a regular file"):
        load(p, mode=mode)
    assert outside.read_bytes() == before
    os.unlink(p / "data.bin")
    os.symlink("../secret.bin", p / "data.bin")  # relative, escaping the store
    with pytest.raises(MemmapFormatError, match="symbolic link"):
        load(p, mode=mode)
    _edit(p, lambda m: m.update(data_file="manifest.json"))
    with pytest.raises(MemmapFormatError, match=re.escape("bad data_file 'manifest.json'")):
        load(p, mode=mode)
    os.mkdir(p / "sub")
    _edit(p, lambda m: m.update(data_file="sub"))
    with pytest.raises(MemmapFormatError, match="not a regular file"):
        load(p, mode=mode)
    assert outside.read_bytes() == before


def test_symlinked_manifest_is_refused(tmp_path):
    p = tmp_path / "s"
    save(small(), p)
    shutil.copy(p / "manifest.json", tmp_path / "m.json")
    os.unlink(p / "manifest.json")
    os.symlink(tmp_path / "m.json", p / "manifest.json")
    with pytest.raises(MemmapFormatError, match="symbolic link"):
        load(p)


# ------------------------------------------------------------------------------ 8. torch APIs
@pytest.mark.slow
def test_storage_level_torch_apis_never_crash(tmp_path):
    rep = run_child(["torch-apis", str(tmp_path)])
    for key, r in rep.items():
        assert r["exit"] == 0, (key, r)
        assert "signal" not in r, (key, r)
        mode, what = key.split(" ")
        if mode == "r":
            assert not r["file_changed"], (key, r)
            if what in ("from_dlpack", "untyped_storage_copy", "storage_fill", "numpy_from_dlpack"):
                assert r["error"].startswith("PermissionError: " + E.READ_ONLY.split("{")[0]), r
                continue
        assert "error" not in r, (key, r)
        if what == "data_ptr":
            assert r["result"] is True
        if what in ("from_dlpack", "untyped_storage_copy"):
            assert r["result"] == 9.0, (key, r)
            assert r["file_changed"] == (mode == "r+"), (key, r)
        if what == "storage_fill":
            assert r["result"] == 0.0, (key, r)
            assert r["file_changed"] == (mode == "r+"), (key, r)


def test_storage_apis_in_process(tmp_path):
    p = tmp_path / "s"
    save(small(1.0), p)
    for mode in ("r", "r+", "c"):
        leaf = load(p, mode=mode)["a"]
        assert leaf.data_ptr() != 0
        assert leaf.data_ptr() == leaf._inner.data_ptr()
        assert leaf.untyped_storage().nbytes() == 32
        assert leaf.share_memory_() is leaf
        assert leaf.is_shared() == (mode == "r+")
        assert torch.from_dlpack(leaf.__dlpack__(copy=True)).tolist() == [1.0] * 8
    ro = load(p)["a"]
    with pytest.raises(PermissionError, match=fmt(E.READ_ONLY)):
        ro.untyped_storage().fill_(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        typed = ro.storage()
    with pytest.raises(PermissionError):
        typed[0] = 5.0
    assert ro.tolist() == [1.0] * 8


# ------------------------------------------------------------------------------ 10. scale
def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux overcommit policy")
def test_store_larger_than_ram_loads_in_every_mode(tmp_path):
    """A sparse 2.5x-RAM store: mode "r" and "c" map it (a private writable mapping without
    MAP_NORESERVE is refused by the default overcommit policy); read-only guarantees hold."""
    n = int(_ram_bytes() * 2.5) // 4096 * 4096
    p = tmp_path / "big"
    save(TensorDict(x=torch.zeros(4096, dtype=torch.uint8), batch_size=[4096]), p)
    _edit(p, lambda m: m["root"]["children"]["x"].update(shape=[n], nbytes=n))
    _edit(p, lambda m: m["root"].update(batch_size=[n]))
    _edit(p, lambda m: m.update(data_bytes=n))
    with open(p / "data.bin", "r+b") as f:
        f.truncate(n)
        f.seek(n - 1)
        f.write(b"\x07")
    for mode in ("r", "c", "r+"):
        td = load(p, mode=mode)
        x = td["x"]
        assert x.shape == (n,)
        assert x[-1].item() == 7
        assert x[n // 2].item() == 0
        if mode == "r":
            with pytest.raises(PermissionError):
                x[-1] = 1
        if mode == "c":
            x[-2] = 9
            assert x[-2].item() == 9
        del td, x
    with open(p / "data.bin", "rb") as f:
        f.seek(n - 2)
        assert f.read() == b"\x00\x07"  # the file never changed
    assert os.stat(p / "data.bin").st_blocks * 512 < (16 << 20)  # still sparse


# ------------------------------------------------------------------------------ 11. bad input
def _nested(depth: int) -> dict:
    node = {
        "kind": "node",
        "type": "tdfunc.TensorDict",
        "batch_size": [],
        "device": None,
        "static": [],
        "children": {},
    }
    for _ in range(depth):
        node = {
            "kind": "node",
            "type": "tdfunc.TensorDict",
            "batch_size": [],
            "device": None,
            "static": [],
            "children": {"n": node},
        }
    return node


BAD = {
    "deep_json": (None, "nested too deeply"),
    "deep_nodes": (lambda m: m.update(root=_nested(400)), "nesting deeper than 256"),
    "static_not_pair": (lambda m: m["root"].update(static=[[1, 2, 3]]), "bad static item"),
    "static_on_td": (lambda m: m["root"].update(static=[["x", 1]]), "has static fields"),
    "static_value": (lambda m: m["root"].update(static=[["x", {"set": [1]}]]), "bad static value"),
    "absurd_shape": (
        lambda m: m["root"]["children"]["a"].update(shape=[0, 1 << 70]),
        "leaf 'a': " + SHAPE_BYTES.format(shape=[0, 1 << 70], dtype=torch.float32, limit=MAX_BYTES),
    ),
    "negative_dim": (
        lambda m: m["root"]["children"]["a"].update(shape=[8, -1]),
        "leaf 'a': " + SHAPE_DIM.format(shape=[8, -1], dim=1, value=-1),
    ),
    "too_many_dims": (
        lambda m: m["root"]["children"]["a"].update(shape=[1] * 100),
        "field 'shape' of entry 'a'",
    ),
    "none_in_td": (lambda m: m["root"]["children"].update(a={"kind": "none"}), "'none' child"),
    "batch_absurd": (lambda m: m["root"].update(batch_size=[1 << 70]), "field 'batch_size'"),
    # no elements, but the non-zero dims hold 2**63 bytes of float32: more than any tensor
    "shape_past_the_byte_limit": (
        lambda m: (
            m["root"].update(batch_size=[]),
            m["root"]["children"]["a"].update(shape=[1 << 61, 0], nbytes=0),
        ),
        "leaf 'a': " + SHAPE_BYTES.format(shape=[1 << 61, 0], dtype=torch.float32, limit=MAX_BYTES),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_manifests_are_format_errors(tmp_path, case):
    edit, message = BAD[case]
    p = tmp_path / "s"
    save(small(), p)
    m = json.loads((p / "manifest.json").read_text())
    if edit is None:  # deeper than the JSON parser's recursion limit
        text = json.dumps(m)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"
    else:
        edit(m)
        text = json.dumps(m)
    (p / "manifest.json").write_text(text)
    with pytest.raises(MemmapFormatError, match=re.escape(message)) as ei:
        load(p)
    assert str(p / "manifest.json") in str(ei.value)


def test_manifest_that_does_not_fit_the_tensorclass(tmp_path):
    p = tmp_path / "s"
    save(WithTensor(torch.ones(3), batch_size=[3]), p)
    good = json.loads((p / "manifest.json").read_text())
    sub = {
        "kind": "node",
        "type": "tdfunc.TensorDict",
        "batch_size": [3],
        "device": None,
        "static": [],
        "children": {},
    }
    for edit, message in (
        (lambda m: m["root"]["children"].update(x=sub), "does not fit"),
        (lambda m: m["root"]["children"].update(x={"kind": "none"}), "does not fit"),
        (lambda m: m["root"].update(static=[["x", 1]]), "static fields of"),
    ):
        m = json.loads(json.dumps(good))
        edit(m)
        (p / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(MemmapFormatError, match=message):
            load(p)


def test_a_manifest_key_given_twice_is_a_format_error(tmp_path):
    """JSON readers disagree on a key given twice (Python's keeps the last, others the
    first): the store refuses it instead of picking one."""
    p = tmp_path / "s"
    save(small(), p)
    raw = (p / "manifest.json").read_text()
    (p / "manifest.json").write_text('{"data_bytes": 0, ' + raw[1:])
    with pytest.raises(MemmapFormatError) as ei:
        load(p)
    assert str(ei.value) == E.CORRUPT_MANIFEST.format(
        manifest=str(p / "manifest.json"), detail=E.DUPLICATE_KEY.format(key="data_bytes")
    )
