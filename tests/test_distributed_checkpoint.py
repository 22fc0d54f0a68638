"""tdfunc.distributed.save_checkpoint / load_checkpoint on torch.distributed.checkpoint.

One 4-rank gloo launch (``tests/_dist_ckpt.py::run_four``) saves, reshards on 4 and 2 ranks,
and runs every multi-rank error path; the test process then loads the same checkpoint on one
process (no process group), checks the bytes on disk and exports it. A 2-rank launch kills a
rank midway through a save; one run starts under ``torch.distributed.run``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _dist_ckpt as W
import pytest
import torch
from safetensors.torch import load_file

import tdfunc
from tdfunc import distributed as tdd
from tdfunc.distributed._checkpoint import api as ck
from tdfunc.distributed._checkpoint import store
from tdfunc.distributed._common import errors as E
from tdfunc.distributed._common.launch import free_port
from tdfunc.testing import RankError, launch

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
#: bytes torch.save adds around each item DCP writes (zip entries, pickle, alignment):
#: measured 1.56 KiB per item on this torch
ITEM_OVERHEAD = 2048


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("ckpt4")
    return launch(W.run_four, 4, args=(str(out),), timeout=240, pg_timeout=60), out


def _same(results: list[dict[str, Any]], key: str) -> Any:
    """The value every rank reported for ``key`` (they must agree)."""
    vals = [r[key] for r in results]
    assert all(v == vals[0] for v in vals), vals
    return vals[0]


def _check(got: dict[str, Any], placements: dict[str, list[str]]) -> None:
    assert got["equal"] is True  # bit for bit, every leaf
    assert got["type"] == "TensorDict"
    assert got["layer_type"] == "Layer"
    assert got["static"] == "proj"
    assert got["batch"] == [[], [6]]
    assert got["placements"] == placements


SAVED = {"w": ["S(0)"], "e": ["S(0)", "S(1)"], "b": ["R"], "layer.weight": ["S(1)"]}
RESHARDED = {"w": ["S(1)"], "e": ["S(0)"], "b": ["S(0)"], "layer.weight": ["R"]}


# --------------------------------------------------------------------------------------
# 4 ranks: save, async save, reshard on 4 and on 2
# --------------------------------------------------------------------------------------
def test_save_and_load_on_four_ranks(four: Any) -> None:
    res, _ = four
    assert _same(res, "save0") == ["", ""]
    assert _same(res, "input_unchanged") is True
    for r in res:
        _check(r["v0"], SAVED)
        _check(r["load4_2d"], SAVED)  # a like of the saved layout: v1's values


def test_async_save(four: Any) -> None:
    res, out = four
    assert _same(res, "async_type") == "PendingSave"
    assert _same(res, "work_during_async") is True
    assert _same(res, "async_done") is True
    assert _same(res, "work_during_default_async") is True
    digest = _same(res, "async_default_digest")
    assert digest.startswith("sha256:")
    assert _same(res, "digest_on_disk") == digest
    path = str(out / "ck4")
    assert res[0]["exists"] == ["FileExistsError", E.CKPT_EXISTS_SAVE.format(path=path)]
    for r in res[1:]:
        assert r["exists"] == [
            "ValueError",
            E.CKPT_REJECTED.format(op="save_checkpoint", ranks=[0]),
        ]
    assert len(res[0]["versions"]) == 1  # the previous version was removed after the commit


def test_reshard_on_four_and_two_ranks(four: Any) -> None:
    """Shard(0) -> Shard(1), [2, 2] (S0, S1) -> [4] S0, Replicate -> Shard(0), Shard(1) ->
    Replicate; on 4 ranks and on ranks 0-1 (saved on 4)."""
    res, _ = four
    for r in res:
        _check(r["load4"], RESHARDED)
    for r in res[:2]:
        _check(r["load2"], RESHARDED)
        assert r["load2_like_unchanged"] is True  # `like` is never written


def test_load_on_one_process_without_group(four: Any) -> None:
    _, out = four
    full = W.full_values(1)
    got = tdd.load_checkpoint(out / "ck4")  # the saved container, full plain tensors
    assert type(got) is tdfunc.TensorDict
    assert type(got["layer"]) is W.Layer
    assert got["layer"].name == "proj"
    assert list(got["layer"].batch_size) == [6]
    for (path, x), (_, y) in zip(got.items(True, True), full.items(True, True)):
        assert type(x) is torch.Tensor, path
        assert x.dtype == y.dtype, path
        assert torch.equal(x, y), path
    like = W.full_values(0)
    before = like.clone()
    got = tdd.load_checkpoint(out / "ck4", like)  # plain leaves: no process group either
    tdfunc.testing.assert_close(got, full, rtol=0, atol=0)
    tdfunc.testing.assert_close(like, before, rtol=0, atol=0)


def test_bytes_written_equal_the_container(four: Any) -> None:
    """Every shard once, replicated leaves (b: 16 KiB on 4 ranks, step) once: the data
    files hold the container's bytes plus torch.save's per-item framing."""
    _, out = four
    root = out / "ck4"
    pointer = json.loads((root / store.POINTER).read_text())
    vdir = root / pointer["dir"]
    manifest = json.loads((vdir / store.MANIFEST).read_text())
    files = sorted(p.name for p in vdir.glob("*.distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    on_disk = sum((vdir / f).stat().st_size for f in files)
    assert on_disk == sum(manifest["files"].values())
    items = sum(len(e["chunks"]) for e in manifest["leaves"])
    # w: 4 shards, e: 4, layer.weight: 4; b, step, layer.extra.scale: 1 each, where
    # every rank holds them (4 copies of b would be 3 more items and 48 KiB more)
    assert items == 15
    nbytes = sum(x.numel() * x.element_size() for x in W.full_values(1).leaves())
    assert nbytes < on_disk < nbytes + items * ITEM_OVERHEAD


def test_failed_save_keeps_the_previous_checkpoint(four: Any) -> None:
    res, _ = four
    msg = E.CKPT_FAILED.format(
        op="save_checkpoint", ranks=[2], reason="OSError: disk full (simulated)"
    )
    assert _same(res, "failed_save") == ["CheckpointError", msg]
    for r in res:
        _check(r["after_failed_save"], SAVED)


def test_memmap_leaf_saves_its_data(four: Any) -> None:
    res, _ = four
    assert _same(res, "save_memmap") == ["", ""]
    assert _same(res, "memmap_back") == ["Tensor", True]


# --------------------------------------------------------------------------------------
# errors on every rank, before any data moves
# --------------------------------------------------------------------------------------
def test_arguments_the_ranks_reject(four: Any) -> None:
    res, out = four
    assert _same(res, "save_partial") == [
        "ValueError",
        E.CKPT_PARTIAL.format(key="'b'", op="sum"),
    ]
    assert _same(res, "like_partial") == ["ValueError", E.CKPT_PARTIAL.format(key="'b'", op="sum")]
    assert _same(res, "save_disagree") == [
        "ValueError",
        E.CKPT_DISAGREE.format(
            op="save_checkpoint", what="path or structure", ranks=[1, 2, 3], first=0
        ),
    ]
    keys = "load_checkpoint: structures differ: missing keys ['b'], extra keys []"
    assert _same(res, "like_keys") == ["KeysDifferError", keys]
    assert res[1]["like_one_rank"] == ["KeysDifferError", keys]
    others = E.CKPT_REJECTED.format(op="load_checkpoint", ranks=[1])
    for r in (0, 2, 3):
        assert res[r]["like_one_rank"] == ["ValueError", others]
    assert _same(res, "like_shape") == [
        "StructureError",
        E.CKPT_SHAPE.format(key="'b'", what="the shape", saved=[4096], wanted=[8]),
    ]
    assert _same(res, "like_dtype") == [
        "StructureError",
        E.CKPT_SHAPE.format(
            key="'step'", what="the dtype", saved="torch.int64", wanted="torch.float32"
        ),
    ]
    kind, text = _same(res, "like_static")
    assert kind == "NodeTypesDifferError"
    assert "'proj'" in text
    assert "'other'" in text
    path = str(out / "ck4-nothing")
    assert _same(res, "not_found") == [
        "FileNotFoundError",
        E.CKPT_NOT_FOUND.format(path=path, file=os.path.join(path, store.POINTER)),
    ]
    other = str(out / "other")
    assert res[0]["not_target"] == [
        "ValueError",
        E.CKPT_NOT_TARGET.format(path=other, pointer=store.POINTER),
    ]
    for r in res[1:]:
        assert r["not_target"] == [
            "ValueError",
            E.CKPT_REJECTED.format(op="save_checkpoint", ranks=[0]),
        ]


@pytest.mark.parametrize(
    ("how", "file", "detail"),
    [
        ("flip", "__1_0.distcp", "checksum mismatch"),
        ("truncate", "__2_0.distcp", "size "),
        ("missing", "__3_0.distcp", "missing"),
        ("manifest", store.MANIFEST, "checksum mismatch"),
        ("pointer", store.POINTER, "not JSON"),
    ],
)
def test_damaged_checkpoints_raise_on_every_rank(
    four: Any, how: str, file: str, detail: str
) -> None:
    res, out = four
    kind, text = _same(res, f"bad_{how}")
    assert kind == "CheckpointCorruptError"
    root = str(out / f"bad-{how}")
    assert text.startswith(f"checkpoint {root}: file {root}")
    assert text.split(" is corrupt: ")[0].endswith(file)  # names the file
    assert detail in text


def test_partial_source_the_backend_cannot_reduce(four: Any) -> None:
    """gloo cannot all-reduce int16: every rank raises ValueError naming the leaf, before
    any data moves (it used to fail inside gloo with ``Invalid scalar type``)."""
    res, _ = four
    for r in (0, 1):
        assert res[r]["partial_int16"] == [
            "ValueError",
            E.PLAN_PARTIAL_DTYPE.format(
                rank=r, key="'q'", op="sum", backend="gloo", dtype=torch.int16
            ),
        ]
    for r in (2, 3):
        kind, text = res[r]["partial_int16"]
        assert kind == "ValueError"
        assert text.endswith(
            E.PLAN_PARTIAL_DTYPE.format(
                rank=0, key="'q'", op="sum", backend="gloo", dtype=torch.int16
            )
        )


# --------------------------------------------------------------------------------------
# a rank killed midway, and torchrun
# --------------------------------------------------------------------------------------
def test_killed_save_never_damages_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    with pytest.raises(RankError, match="rank 1 of 2 exited with code 9"):
        launch(W.killed_save, 2, args=(str(path),), timeout=120, pg_timeout=10, grace=1.0)
    versions = sorted(p.name for p in path.glob("v-*"))
    # the committed one, and the half-written one unless the surviving coordinator removed
    # it before the launcher killed it
    assert 1 <= len(versions) <= 2
    got = tdd.load_checkpoint(path)
    tdfunc.testing.assert_close(got, W.full_values(0), rtol=0, atol=0)
    tdd.save_checkpoint(path, W.full_values(3), overwrite=True)  # the next save cleans up
    assert len(list(path.glob("v-*"))) == 1
    tdfunc.testing.assert_close(tdd.load_checkpoint(path), W.full_values(3), rtol=0, atol=0)


def test_torchrun(tmp_path: Path) -> None:
    # a signal (SIGABRT, SIGSEGV) in a rank prints its Python stacks into the message below
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(ROOT / "tests" / "_dist_ckpt.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in out:
        assert r["world"] == 2
        assert r["equal"] is True
        assert r["placements"] == {"w": ["S(1)"]}


# --------------------------------------------------------------------------------------
# one process, no process group
# --------------------------------------------------------------------------------------
def _plain_td() -> Any:
    return tdfunc.TensorDict(
        a=torch.arange(12.0).reshape(4, 3), n={"i": torch.arange(4)}, batch_size=[4]
    )


# DCP warns from its background thread when an asynchronous save runs without a group
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_round_trip_and_overwrite(tmp_path: Path) -> None:
    td = _plain_td()
    tdd.save_checkpoint(tmp_path / "ck", td)
    tdfunc.testing.assert_close(tdd.load_checkpoint(tmp_path / "ck", td), td, rtol=0, atol=0)
    with pytest.raises(FileExistsError) as e:
        tdd.save_checkpoint(tmp_path / "ck", td + 1)
    assert str(e.value) == E.CKPT_EXISTS_SAVE.format(path=str(tmp_path / "ck"))
    tdd.save_checkpoint(tmp_path / "ck", td + 1, overwrite=True)
    tdfunc.testing.assert_close(tdd.load_checkpoint(tmp_path / "ck"), td + 1, rtol=0, atol=0)
    entries = sorted(n for n in os.listdir(tmp_path / "ck") if not n.startswith(store.TRASH))
    assert entries[:2] == [".lock", store.POINTER]
    assert len(entries) == 3  # and one version folder
    job = tdd.save_checkpoint(tmp_path / "ck", td + 2, overwrite=True, async_save=True)
    assert isinstance(job, tdd.PendingSave)
    got = tdd.load_checkpoint(tmp_path / "ck")  # waits for the pending save first
    tdfunc.testing.assert_close(got, td + 2, rtol=0, atol=0)
    assert job.done()
    job.result()


def test_non_tensor_leaves_round_trip(tmp_path: Path) -> None:
    """A shared value and one value per sample are kept (in the manifest's structure, as
    JSON), nested and in a tensorclass field's container too."""
    td = tdfunc.TensorDict(
        {"a": torch.rand(3, 2), "text": "hi", "p": ["x", "y", "z"], "n": {"q": [1.5, None, 3]}},
        batch_size=[3],
    )
    tdd.save_checkpoint(tmp_path / "ck", td)
    got = tdd.load_checkpoint(tmp_path / "ck")
    assert got["text"] == "hi"
    assert list(got["p"]) == ["x", "y", "z"]
    assert got["n", "q"] == td["n", "q"]
    assert got.batch_size == (3,)
    torch.testing.assert_close(got["a"], td["a"], rtol=0, atol=0)
    assert (got[1]["p"], got[1]["text"]) == ("y", "hi")
    got_like = tdd.load_checkpoint(tmp_path / "ck", td)
    assert list(got_like["p"]) == ["x", "y", "z"]


def test_a_jagged_leaf_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    nt = torch.nested.nested_tensor([torch.arange(4.0), torch.arange(2.0)], layout=torch.jagged)
    td = tdfunc.TensorDict({"tok": nt, "r": torch.ones(2)}, batch_size=[2])
    with pytest.raises(TypeError) as e:
        tdd.save_checkpoint(tmp_path / "ck", td)
    assert str(e.value) == E.CKPT_LEAF_TYPE.format(key="'tok'", typ="NestedTensor")
    assert not (tmp_path / "ck").exists()


def test_single_process_flipped_byte(tmp_path: Path) -> None:
    td = tdfunc.TensorDict(a=torch.arange(16384.0))  # one item, mostly the leaf's 64 KiB
    tdd.save_checkpoint(tmp_path / "ck", td)
    data = glob.glob(str(tmp_path / "ck" / "v-*" / "__0_0.distcp"))[0]
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(tdd.CheckpointCorruptError, match="checksum mismatch") as e:
        tdd.load_checkpoint(tmp_path / "ck")
    assert data in str(e.value)
    assert "chunk of 'a' at bytes " in str(e.value)  # the leaf's values
    got = tdd.load_checkpoint(tmp_path / "ck", verify=False)  # the checksums skipped
    assert (got["a"] != td["a"]).sum().item() == 1
    os.truncate(data, os.path.getsize(data) - 1)
    with pytest.raises(tdd.CheckpointCorruptError, match="size "):  # sizes: checked anyway
        tdd.load_checkpoint(tmp_path / "ck", verify=False)


def test_manifest_is_checked(tmp_path: Path) -> None:
    tdd.save_checkpoint(tmp_path / "ck", _plain_td())
    manifest = glob.glob(str(tmp_path / "ck" / "v-*" / store.MANIFEST))[0]
    with open(manifest, "ab") as f:
        f.write(b" ")
    with pytest.raises(tdd.CheckpointCorruptError) as e:
        tdd.load_checkpoint(tmp_path / "ck")
    root = str(tmp_path / "ck")
    assert str(e.value) == E.CKPT_CORRUPT.format(
        path=root, file=manifest, detail="checksum mismatch"
    )
    pointer = tmp_path / "ck" / store.POINTER
    pointer.write_text(json.dumps({"format": store.FORMAT, "version": 2, "dir": "../x"}))
    with pytest.raises(tdd.CheckpointCorruptError, match=r"not a tdfunc\.checkpoint version 2"):
        tdd.load_checkpoint(tmp_path / "ck")


def test_save_errors(tmp_path: Path) -> None:
    clash = tdfunc.TensorDict({"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}})
    with pytest.raises(ValueError, match="both become the checkpoint name") as e:
        tdd.save_checkpoint(tmp_path / "c", clash)
    assert str(e.value) == E.CKPT_KEY_COLLISION.format(a="'a.b'", b="('a', 'b')", name="a.b")
    with pytest.raises(TypeError) as t:
        ck._plain(("k",), 3)
    assert str(t.value) == E.CKPT_LEAF_TYPE.format(key="'k'", typ="int")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a checkpoint"):
        tdd.save_checkpoint(tmp_path / "file", _plain_td())
    assert not (tmp_path / "c").exists()


def test_concurrent_commit_loses(tmp_path: Path) -> None:
    """The commit is a compare-and-swap: a save whose base version is no longer current
    is discarded with CheckpointConflictError."""
    root = tmp_path / "ck"
    tdd.save_checkpoint(root, _plain_td())
    now = json.loads((root / store.POINTER).read_text())["dir"]
    stale = root / "v-00000000000000aa"
    stale.mkdir()
    with pytest.raises(tdd.CheckpointConflictError) as e:
        store.commit(str(root), str(stale), "0" * 64, "v-0000000000000001")
    assert str(e.value) == E.CKPT_CONFLICT.format(
        path=str(root), now=now, base="v-0000000000000001"
    )
    assert not stale.exists()
    tdfunc.testing.assert_close(tdd.load_checkpoint(root), _plain_td(), rtol=0, atol=0)


def test_export_safetensors(four: Any, tmp_path: Path) -> None:
    _, out = four
    file = tmp_path / "all.safetensors"
    tdd.export_safetensors(out / "ck4", file)
    flat = load_file(str(file))
    full = W.full_values(1)
    names = [".".join(p if isinstance(p, tuple) else (p,)) for p, _ in full.items(True, True)]
    assert sorted(flat) == sorted(names)
    assert torch.equal(flat["layer.weight"], full["layer"].weight)
    back = tdfunc.load_safetensors(file)
    assert type(back["layer"]) is W.Layer
    tdfunc.testing.assert_close(back, full, rtol=0, atol=0)
    with pytest.raises(FileExistsError) as e:
        tdd.export_safetensors(out / "ck4", file)
    assert str(e.value) == E.CKPT_EXISTS.format(file=str(file))


def test_export_is_a_state_dict(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    tdd.save_checkpoint(tmp_path / "ck", tdfunc.from_module(model))
    tdd.export_safetensors(tmp_path / "ck", tmp_path / "m.safetensors")
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    other.load_state_dict(load_file(str(tmp_path / "m.safetensors")))
    x = torch.randn(5, 3)
    assert torch.equal(other(x), model(x))


def _rewrite_manifest(root: Path, change: Any) -> None:
    """Change the manifest and record its new SHA-256 in the pointer (a consistent but
    different checkpoint, as a writer with a bug could leave)."""
    import hashlib

    pointer = json.loads((root / store.POINTER).read_text())
    mfile = root / pointer["dir"] / store.MANIFEST
    manifest = json.loads(mfile.read_text())
    change(manifest)
    raw = json.dumps(manifest).encode()
    mfile.write_bytes(raw)
    pointer["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (root / store.POINTER).write_text(json.dumps(pointer))


@pytest.mark.parametrize(
    ("change", "error", "text"),
    [
        (
            lambda m: m["tree"][1].update(type="nowhere.Missing"),
            ValueError,
            E.CKPT_UNKNOWN_TYPE.format(name="nowhere.Missing"),
        ),
        (lambda m: m.update(tree=[1, 2]), tdd.CheckpointCorruptError, "bad structure"),
        (  # a nested container's type is named in its parent's context
            lambda m: m["tree"][1]["context"][7][0].__setitem__(1, "nowhere.Inner"),
            ValueError,
            E.CKPT_UNKNOWN_TYPE.format(name="nowhere.Inner"),
        ),
        (  # a malformed nested context: the decoder refuses it, the file is named
            lambda m: m["tree"][1]["context"][7][0].__setitem__(2, [1, 2]),
            tdd.CheckpointCorruptError,
            "manifest.json is corrupt: bad structure",
        ),
        (
            lambda m: m["leaves"].reverse(),
            tdd.CheckpointCorruptError,
            "the leaves do not match the structure",
        ),
        (lambda m: m["leaves"][0].update(shape=[-1]), tdd.CheckpointCorruptError, "bad leaf"),
        (
            lambda m: m["files"].update({"__0_0.distcp": 10}),
            tdd.CheckpointCorruptError,
            "chunk beyond the end of __0_0.distcp",
        ),
        (
            lambda m: m["files"].update({"../escape.distcp": 0}),
            tdd.CheckpointCorruptError,
            "bad file name '../escape.distcp'",
        ),
    ],
)
def test_manifest_contents_are_checked(
    tmp_path: Path, change: Any, error: type[Exception], text: str
) -> None:
    root = tmp_path / "ck"
    tdd.save_checkpoint(root, _plain_td())
    _rewrite_manifest(root, change)
    with pytest.raises(error) as e:
        tdd.load_checkpoint(root)
    assert text in str(e.value)


def test_item_framing_is_not_data(tmp_path: Path) -> None:
    """A flip in an item's zip directory (torch.save's framing around the values) changes
    nothing that is loaded: the loader reads the values' bytes at the offsets the manifest
    records and checks their SHA-256, never the framing, never the pickle."""
    root = tmp_path / "ck"
    tdd.save_checkpoint(root, _plain_td())
    data = glob.glob(str(root / "v-*" / "__0_0.distcp"))[0]
    raw = bytearray(Path(data).read_bytes())
    at = raw.rfind(b"PK\x01\x02")  # the last central directory entry of the last item
    raw[at + 16] ^= 0x01  # its CRC-32 field
    Path(data).write_bytes(bytes(raw))
    tdfunc.testing.assert_close(tdd.load_checkpoint(root), _plain_td(), rtol=0, atol=0)


def test_export_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    tdd.save_checkpoint(tmp_path / "ck", tdfunc.from_module(model))
    (tmp_path / "hf").mkdir()
    tdd.export_safetensors(tmp_path / "ck", tmp_path / "hf" / "model.safetensors")
    cfg.save_pretrained(tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 50, (2, 5))
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)


@pytest.mark.parametrize(
    ("name", "device", "backend"),
    [
        ("gloo", "cpu", "gloo"),
        ("nccl", "cuda", "nccl"),
        ("cpu:gloo,cuda:nccl", "cpu", "gloo"),
        ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
    ],
)
def test_backend_of_a_partial_source(name: str, device: str, backend: str) -> None:
    from tdfunc.distributed._transfer.session import REDUCIBLE, backend_for

    assert backend_for(name, device) == backend
    assert torch.int16 not in REDUCIBLE[backend]
    assert torch.float32 in REDUCIBLE[backend]
