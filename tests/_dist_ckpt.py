"""Rank functions for tests/test_distributed_checkpoint.py (importable by spawned processes).

Each function runs on every rank of a fresh gloo group and returns plain values (booleans,
strings, numbers) that the test process asserts on; checks that must raise record the
exception type and message with :func:`caught`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import tdfunc
from tdfunc import distributed as tdd
from tdfunc import tensorclass
from tdfunc.distributed._checkpoint import store


@tensorclass
class Layer:
    """A tensorclass with a nested TensorDict and a static field."""

    weight: torch.Tensor
    extra: tdfunc.TensorDict
    name: str = "layer"


def caught(fn: Any) -> list[str]:
    """``[exception type name, message]`` of ``fn()``, or ``["", ""]`` if it did not raise."""
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e.args[0]) if e.args else ""]
    return ["", ""]


def full_values(step: int = 0) -> tdfunc.TensorDict:
    """The full (unsharded) container, the same on every rank; ``step`` shifts the values."""
    g = torch.Generator().manual_seed(7)
    layer = Layer(
        weight=torch.randn(6, 4, generator=g) + step,
        extra=tdfunc.TensorDict(scale=torch.arange(6, dtype=torch.int32) + step, batch_size=[6]),
        name="proj",
        batch_size=[6],
    )
    return tdfunc.TensorDict(
        w=torch.randn(10, 6, generator=g) + step,  # uneven over 4 ranks (3, 3, 3, 1)
        e=(torch.randn(7, 5, generator=g) * 100).to(torch.bfloat16) + step,  # 2-D, uneven
        b=torch.randn(4096, generator=g) + step,  # Replicate(): written once
        step=torch.tensor(step, dtype=torch.int64),  # a plain leaf: written once
        layer=layer,
    )


def sharded(full: Any, m4: DeviceMesh, m2x2: DeviceMesh) -> Any:
    """``full`` as saved: w Shard(0) on [4], e (Shard(0), Shard(1)) on [2, 2], b Replicate,
    layer.weight Shard(1) on [4], step and layer.extra plain."""
    layer = full["layer"]
    return (
        full.set("w", distribute_tensor(full["w"], m4, [Shard(0)]))
        .set("e", distribute_tensor(full["e"], m2x2, [Shard(0), Shard(1)]))
        .set("b", distribute_tensor(full["b"], m4, [Replicate()]))
        .set("layer", layer.replace(weight=distribute_tensor(layer.weight, m4, [Shard(1)])))
    )


def resharded_like(full: Any, mesh: DeviceMesh) -> Any:
    """Other placements on a 1-D mesh: Shard(0) -> Shard(1), 2-D -> 1-D, Replicate ->
    Shard, Shard(1) -> Replicate."""
    layer = full["layer"]
    weight = distribute_tensor(torch.zeros_like(layer.weight), mesh, [Replicate()])
    return (
        full.set("w", distribute_tensor(torch.zeros_like(full["w"]), mesh, [Shard(1)]))
        .set("e", distribute_tensor(torch.zeros_like(full["e"]), mesh, [Shard(0)]))
        .set("b", distribute_tensor(torch.zeros_like(full["b"]), mesh, [Shard(0)]))
        .set("layer", layer.replace(weight=weight))
    )


def equal_to(got: Any, full: Any) -> dict[str, Any]:
    """Bit-for-bit comparison of every leaf's full value, and the layout of the result."""
    out: dict[str, Any] = {"type": type(got).__name__, "layer_type": type(got["layer"]).__name__}
    out["static"] = got["layer"].name
    out["batch"] = [list(got.batch_size), list(got["layer"].batch_size)]
    same = True
    for (_, x), (_, y) in zip(got.items(True, True), full.items(True, True)):
        val = x.full_tensor() if isinstance(x, DTensor) else x
        same = same and val.dtype == y.dtype and torch.equal(val, y)
    out["equal"] = same
    out["placements"] = {
        ".".join(p if isinstance(p, tuple) else (p,)): [str(q) for q in x.placements]
        for p, x in got.items(True, True)
        if isinstance(x, DTensor)
    }
    return out


def _copy_and_damage(src: str, dst: str, how: str) -> None:
    """A copy of checkpoint ``src`` at ``dst`` with one file damaged."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, store.POINTER)) as f:
        vdir = os.path.join(dst, json.load(f)["dir"])
    if how == "flip":
        data = os.path.join(vdir, "__1_0.distcp")
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
    elif how == "truncate":
        data = os.path.join(vdir, "__2_0.distcp")
        os.truncate(data, os.path.getsize(data) - 10)
    elif how == "missing":
        os.remove(os.path.join(vdir, "__3_0.distcp"))
    elif how == "manifest":
        meta = os.path.join(vdir, store.MANIFEST)
        with open(meta, "r+b") as f:
            f.seek(20)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "pointer":
        with open(os.path.join(dst, store.POINTER), "w") as f:
            f.write("{not json")


def run_four(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Save on 4 ranks (sync, then async), load back resharded on 4 and on 2 ranks, and
    every error path on every rank."""
    res: dict[str, Any] = {}
    m4 = DeviceMesh("cpu", [0, 1, 2, 3])
    m2x2 = DeviceMesh("cpu", [[0, 1], [2, 3]])
    m01 = DeviceMesh("cpu", [0, 1])
    g01 = dist.new_group([0, 1], backend="gloo")
    side = dist.new_group(backend="gloo")  # for the background thread of async saves
    path = os.path.join(out_dir, "ck4")

    # --- save v0 (sync), then v1 (async) over it ---
    full0, full1 = full_values(0), full_values(1)
    td0 = sharded(full0, m4, m2x2)
    before = {k: v.to_local().clone() for k, v in td0.items(True, True) if isinstance(v, DTensor)}
    res["save0"] = caught(lambda: tdd.save_checkpoint(path, td0))
    res["input_unchanged"] = all(torch.equal(td0[k].to_local(), v) for k, v in before.items())
    res["v0"] = equal_to(tdd.load_checkpoint(path, td0), full0)
    res["exists"] = caught(lambda: tdd.save_checkpoint(path, td0))
    job = tdd.save_checkpoint(
        path, sharded(full1, m4, m2x2), overwrite=True, group=side, async_save=True
    )
    res["async_type"] = type(job).__name__
    work = tdd.full_tensor(td0.select("w", "b"), compile=False)  # the world group works meanwhile
    res["work_during_async"] = torch.equal(work["w"], full0["w"])
    job.result()
    res["async_done"] = job.done()
    # on the default group: the background part runs on a private group, so the world
    # group's collectives go on meanwhile
    job = tdd.save_checkpoint(path, sharded(full1, m4, m2x2), overwrite=True, async_save=True)
    res["work_during_default_async"] = bool(dist.all_reduce(torch.ones(1)) is None)
    res["async_default_digest"] = job.result()
    res["digest_on_disk"] = tdd.checkpoint_digest(path)
    dist.barrier()
    if rank == 0:
        res["versions"] = sorted(n for n in os.listdir(path) if n.startswith("v-"))

    # --- load v1 resharded on 4 ranks; on 2 ranks (ranks 0, 1) ---
    res["load4"] = equal_to(tdd.load_checkpoint(path, resharded_like(full1, m4)), full1)
    res["load4_2d"] = equal_to(tdd.load_checkpoint(path, sharded(full0, m4, m2x2)), full1)
    if rank < 2:
        like2 = resharded_like(full1, m01)
        res["load2"] = equal_to(tdd.load_checkpoint(path, like2, group=g01), full1)
        res["load2_like_unchanged"] = bool((like2["w"].to_local() == 0).all())
    dist.barrier()

    # --- a save that fails on one rank leaves the previous checkpoint ---
    orig = store.Writer.write_data

    def failing(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 2:
            raise OSError("disk full (simulated)")
        return orig(self, plan, planner)

    store.Writer.write_data = failing  # type: ignore[method-assign]
    try:
        res["failed_save"] = caught(lambda: tdd.save_checkpoint(path, td0, overwrite=True))
    finally:
        store.Writer.write_data = orig  # type: ignore[method-assign]
    res["after_failed_save"] = equal_to(tdd.load_checkpoint(path, td0), full1)

    # --- what ranks disagree on, and what they reject, before any data moves ---
    partial = td0.set(
        "b",
        DTensor.from_local(full0["b"] / 4, m4, [Partial()], run_check=False),
    )
    res["save_partial"] = caught(lambda: tdd.save_checkpoint(path + "-p", partial))
    extra = td0.set("z", torch.zeros(2)) if rank == 0 else td0
    res["save_disagree"] = caught(lambda: tdd.save_checkpoint(path + "-d", extra))
    res["like_keys"] = caught(lambda: tdd.load_checkpoint(path, td0.exclude("b")))
    res["like_one_rank"] = caught(
        lambda: tdd.load_checkpoint(path, td0.exclude("b") if rank == 1 else td0)
    )
    wrong_shape = td0.set("b", distribute_tensor(torch.zeros(8), m4, [Shard(0)]))
    res["like_shape"] = caught(lambda: tdd.load_checkpoint(path, wrong_shape))
    res["like_dtype"] = caught(
        lambda: tdd.load_checkpoint(path, td0.set("step", torch.tensor(0.0)).set("b", td0["b"]))
    )
    layer2 = Layer(
        weight=td0["layer"].weight,
        extra=td0["layer"].extra,
        name="other",
        batch_size=[6],
    )
    res["like_static"] = caught(lambda: tdd.load_checkpoint(path, td0.set("layer", layer2)))
    res["like_partial"] = caught(lambda: tdd.load_checkpoint(path, partial))
    res["not_found"] = caught(lambda: tdd.load_checkpoint(path + "-nothing", td0))
    os.makedirs(os.path.join(out_dir, "other"), exist_ok=True)
    if rank == 0:
        with open(os.path.join(out_dir, "other", "notes.txt"), "w") as f:
            f.write("not a checkpoint")
    dist.barrier()
    res["not_target"] = caught(lambda: tdd.save_checkpoint(os.path.join(out_dir, "other"), td0))

    # --- a memory-mapped leaf is saved as its plain data ---
    mm = tdfunc.MemoryMappedTensor.from_tensor(full0["b"], os.path.join(out_dir, f"mm{rank}.bin"))
    with_mm = tdfunc.TensorDict(mm=mm, w=td0["w"])
    res["save_memmap"] = caught(lambda: tdd.save_checkpoint(path + "-mm", with_mm))
    got = tdd.load_checkpoint(path + "-mm", with_mm)
    res["memmap_back"] = [type(got["mm"]).__name__, torch.equal(got["mm"], full0["b"])]

    # --- a transfer whose Partial source the backend cannot all-reduce: refused first ---
    m01_, m23 = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    if rank < 2:
        local = torch.arange(6, dtype=torch.int16).reshape(3, 2)
        src = tdfunc.TensorDict(
            q=DTensor.from_local(local, m01_, [Partial()], run_check=False),
            f=distribute_tensor(torch.ones(4), m01_, [Shard(0)]),
        )
        res["partial_int16"] = caught(lambda: tdd.send(src, m23, timeout=30))
    else:
        res["partial_int16"] = caught(
            lambda: tdd.recv(m01_, mesh=m23, placements=[Shard(0)], timeout=30)
        )
    dist.barrier()

    # --- damaged copies: every rank raises the same typed error, nobody hangs ---
    for how in ("flip", "truncate", "missing", "manifest", "pointer"):
        bad = os.path.join(out_dir, f"bad-{how}")
        if rank == 0:
            _copy_and_damage(path, bad, how)
        dist.barrier()
        res[f"bad_{how}"] = caught(lambda bad=bad: tdd.load_checkpoint(bad, td0))
    dist.barrier()
    return res


def killed_save(rank: int, world: int, path: str) -> None:
    """Save v0; then rank 1 dies while it writes v1 (the launcher then kills rank 0)."""
    m = DeviceMesh("cpu", list(range(world)))
    full = full_values(0)
    tdd.save_checkpoint(path, full.set("w", distribute_tensor(full["w"], m, [Shard(0)])))
    orig = store.Writer.write_data

    def dies(self: Any, plan: Any, planner: Any) -> Any:
        out = orig(self, plan, planner)  # its data file is written
        if rank == 1:
            os._exit(9)
        return out

    store.Writer.write_data = dies  # type: ignore[method-assign]
    full1 = full_values(1)
    td1 = full1.set("w", distribute_tensor(full1["w"], m, [Shard(0)]))
    tdd.save_checkpoint(path, td1, overwrite=True)


def run_torchrun(out_dir: str) -> None:
    """Started by ``torch.distributed.run`` (env://): save sharded on 2 ranks, load back
    with other placements; each rank writes its results as JSON."""
    import datetime
    import json

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    m = DeviceMesh("cpu", [0, 1])
    full = full_values(2)
    td = full.set("w", distribute_tensor(full["w"], m, [Shard(0)]))
    tdd.save_checkpoint(os.path.join(out_dir, "ck"), td)
    like = full.set("w", distribute_tensor(torch.zeros_like(full["w"]), m, [Shard(1)]))
    got = tdd.load_checkpoint(os.path.join(out_dir, "ck"), like)
    res = {"rank": rank, "world": dist.get_world_size(), **equal_to(got, full)}
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    # Leave without the interpreter's teardown: there torch's gloo objects, still referenced
    # by the mesh and the DTensors, are destroyed, and under load that has aborted
    # ("terminate called without an active exception") after every result above was written.
    # What this run checks (save and load under env:// rendezvous) is done by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_torchrun(sys.argv[1])
