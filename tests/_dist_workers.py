"""Rank functions for tests/test_distributed.py (importable by spawned processes).

Each ``run_*`` function runs on every rank of a fresh gloo group and returns a dict of plain
values (numbers, strings, booleans) that the test process asserts on. A check that must raise
records the exception type and message; the launcher reports any other failure with the
rank and its traceback.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import sys
import time
from typing import Any

import torch
import torch._dynamo.testing
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import tdfunc
from tdfunc import distributed as tdd
from tdfunc.distributed._common import wire
from tdfunc.distributed._redistribute import plan as _dist_plan


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
class GraphRecorder:
    """A torch.compile backend: counts Dynamo frames and keeps each AOT forward graph."""

    def __init__(self) -> None:
        self.frames = 0
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.common import aot_autograd

        self.frames += 1

        def fw(g: torch.fx.GraphModule, _: Any) -> Any:
            self.graphs.append(g)
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    def collectives(self, index: int = -1) -> list[str]:
        """Names of the functional collectives (wait_tensor excluded) in one graph."""
        out = []
        for node in self.graphs[index].graph.nodes:
            name = str(node.target)
            if (
                node.op == "call_function"
                and name.startswith("_c10d_functional.")
                and ("wait_tensor" not in name)
            ):
                out.append(name.split(".")[1])
        return out


class Laps:
    """Seconds spent in each named section of a rank function."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.times: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = round(now - self.t, 2)
        self.t = now


def caught(fn: Any) -> list[str]:
    """``[exception type name, message]`` of ``fn()``, or ``["", ""]`` if it did not raise."""
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e.args[0]) if e.args else ""]
    return ["", ""]


def reference_full(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The same full tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def make_source(
    full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Any, ...], seed: int
) -> DTensor:
    """A DTensor with ``placements``; along each Partial mesh dim, coordinate ``c`` of ``k``
    holds ``full * 2 (c + 1) / (k (k + 1))`` (the parts sum to ``full``)."""
    base = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    d = distribute_tensor(full, mesh, base, src_data_rank=None)
    if base == tuple(placements):
        return d
    scale = 1.0
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            c, k = mesh.get_local_rank(i), mesh.size(i)
            scale *= 2.0 * (c + 1) / (k * (k + 1))
    return DTensor.from_local(
        d.to_local() * scale,
        mesh,
        placements,
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def compare_leaves(got: Any, expected: list[DTensor]) -> float:
    """Max abs difference of local shards; inf if placements or shapes differ."""
    worst = 0.0
    for g, e in zip(got, expected):
        if not isinstance(g, DTensor) or g.placements != e.placements or g.shape != e.shape:
            return float("inf")
        a, b = g.to_local(), e.to_local()
        if a.shape != b.shape:
            return float("inf")
        if a.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return worst


def sweep(
    mesh: DeviceMesh,
    shapes: list[tuple[int, ...]],
    options: list[tuple[Any, ...]],
    compile: bool,
    backend: Any = "aot_eager",
) -> dict[str, Any]:
    """Every transition src -> dst of ``options`` on a container of ``shapes``; compare with
    DTensor.redistribute leaf by leaf."""
    worst = 0.0
    done = 0
    skipped = 0
    coalesced_groups = 0
    per_leaf_groups = 0
    for si, (src, dst) in enumerate(itertools.product(options, options)):
        if src == dst:
            continue
        fit = [
            s for s in shapes if all(not isinstance(p, Shard) or p.dim < len(s) for p in src + dst)
        ]
        leaves = {
            f"l{i}": make_source(reference_full(s, 100 * si + i), mesh, src, i)
            for i, s in enumerate(fit)
        }
        try:
            expected = [x.redistribute(mesh, dst) for x in leaves.values()]
        except Exception:
            skipped += 1
            continue
        td = tdfunc.TensorDict(leaves)
        out = tdd.redistribute(td, list(dst), compile=compile, backend=backend)
        worst = max(worst, compare_leaves([out[k] for k in leaves], expected))
        plan, _, _ = _dist_plan.build_plan(
            mesh, [_dist_plan.signature(x, dst) for x in leaves.values()]
        )
        coalesced_groups += sum(g.coalesce for g in plan.groups)
        per_leaf_groups += sum(not g.coalesce for g in plan.groups)
        done += 1
    return {
        "worst": worst,
        "done": done,
        "skipped": skipped,
        "coalesced": coalesced_groups,
        "per_leaf": per_leaf_groups,
    }


# --------------------------------------------------------------------------------------
# 2 ranks, 1-D mesh
# --------------------------------------------------------------------------------------
def run_two(rank: int, world: int) -> dict[str, Any]:
    """distribute / to_local / from_local / full_tensor / redistribute on a 1-D mesh of 2."""
    mesh = init_device_mesh("cpu", (world,))
    res: dict[str, Any] = {}
    lap = Laps()
    eager = {"compile": False}

    # distribute: values, nested, mapping, src_data_rank broadcast, batch size kept
    full = {
        "a": reference_full((5, 4), 1),
        "b": {"c": reference_full((5,), 2)},
        "i": torch.arange(5),
    }
    mine = {"a": full["a"] + rank, "b": {"c": full["b"]["c"] + rank}, "i": full["i"] + rank}
    td_in = tdfunc.TensorDict(mine, batch_size=[5])
    before = td_in.clone()
    d = tdd.distribute(td_in, mesh, {"a": [Shard(1)], "b": [Shard(0)]})
    res["distribute_types"] = [type(x).__name__ for x in d.leaves()]
    res["distribute_placements"] = [str(x.placements) for x in d.leaves()]
    res["distribute_batch"] = list(d.batch_size)
    fd = tdd.full_tensor(d, **eager)
    res["distribute_values"] = max(
        (fd[k] - v).abs().max().item()
        for k, v in [("a", full["a"]), (("b", "c"), full["b"]["c"]), ("i", full["i"])]
    )
    res["distribute_local_a"] = list(d["a"].to_local().shape)
    res["input_unchanged"] = bool((td_in == before).all().item())
    own = tdd.distribute(td_in, mesh, [Shard(0)], src_data_rank=None)
    res["own_values"] = (tdd.full_tensor(own, **eager)["a"][:3] - full["a"][:3]).abs().max().item()
    res["callable_spec"] = str(
        tdd.distribute(td_in, mesh, lambda path, x: [Shard(0)] if path == ("i",) else None)[
            "i"
        ].placements
    )
    res["distribute_grad"] = tdd.distribute(
        tdfunc.TensorDict(w=torch.ones(4, requires_grad=True)), mesh, [Shard(0)]
    )["w"].requires_grad
    lap("distribute")

    # to_local / from_local / full_tensor and batch sizes
    sh = tdd.distribute(
        tdfunc.TensorDict(x=full["a"], y=full["b"]["c"], batch_size=[5]), mesh, [Shard(0)]
    )
    loc = tdd.to_local(sh)
    res["to_local_batch"] = list(loc.batch_size)
    res["to_local_types"] = [type(x).__name__ for x in loc.leaves()]
    mixed = tdd.distribute(
        tdfunc.TensorDict(x=full["a"], y=full["b"]["c"], batch_size=[5]),
        mesh,
        {"x": [Shard(1)], "y": [Shard(0)]},
    )
    res["to_local_mixed_batch"] = list(tdd.to_local(mixed).batch_size)
    back = tdd.from_local(loc, mesh, [Shard(0)], shapes={"x": (5, 4), "y": (5,)})
    res["from_local_batch"] = list(back.batch_size)
    res["from_local_values"] = (tdd.full_tensor(back, **eager)["x"] - full["a"]).abs().max().item()
    even = tdfunc.TensorDict(x=torch.full((2, 3), float(rank)), batch_size=[2])
    ev = tdd.from_local(even, mesh, [Shard(0)])
    res["from_local_even_shape"] = list(ev["x"].shape)
    res["from_local_even_batch"] = list(ev.batch_size)
    res["full_tensor_even"] = tdd.full_tensor(ev, **eager)["x"][:, 0].tolist()
    res["full_tensor_batch"] = list(tdd.full_tensor(ev, **eager).batch_size)
    res["from_local_bad_shape"] = caught(
        lambda: tdd.from_local(loc, mesh, [Shard(0)], shapes={"x": (9, 4), "y": (5,)})
    )
    res["from_local_dtensor"] = caught(lambda: tdd.from_local(sh, mesh, [Shard(0)]))
    res["distribute_dtensor"] = caught(lambda: tdd.distribute(sh, mesh, [Shard(0)]))
    lap("local")

    # compiled coalesced graph: 1 frame, one collective for all leaves, no recompile, values
    many = tdfunc.TensorDict(
        {f"p{i}": reference_full((4, 3), 10 + i) for i in range(6)}
        | {"odd": reference_full((5, 3), 99), "nested": {"q": reference_full((6,), 7)}},
    )
    sharded = tdd.distribute(many, mesh, [Shard(0)])
    rec = GraphRecorder()
    out = tdd.redistribute(sharded, [Replicate()], backend=rec)
    ref = [x.redistribute(mesh, [Replicate()]) for x in sharded.leaves()]
    res["compiled_values"] = compare_leaves(out.leaves(), ref)
    res["compiled_frames"] = rec.frames
    res["compiled_collectives"] = rec.collectives()
    res["compiled_type"] = type(out).__name__
    res["compiled_input_placements"] = str(sharded["p0"].placements)
    sharded2 = tdd.distribute(many * 2.0, mesh, [Shard(0)])
    out2 = tdd.redistribute(sharded2, [Replicate()], backend=rec)
    res["second_call_frames"] = rec.frames
    res["second_call_values"] = compare_leaves(
        out2.leaves(), [x.redistribute(mesh, [Replicate()]) for x in sharded2.leaves()]
    )
    res["cache_hits"] = _dist_plan.compiled.cache_info().hits
    lap("compiled")
    # Shard(last) -> Shard(0) (all-to-all in DTensor terms) with uneven leaves, a new graph
    last = tdd.redistribute(out, lambda path, x: [Shard(x.ndim - 1)], **eager)
    moved = tdd.redistribute(last, [Shard(0)], backend=rec)
    res["new_transition_frames"] = rec.frames
    res["new_transition_collectives"] = rec.collectives()
    res["new_transition_values"] = compare_leaves(
        moved.leaves(), [x.redistribute(mesh, [Shard(0)]) for x in last.leaves()]
    )
    # partial -> replicate: one all_reduce per dtype
    parts = tdfunc.TensorDict(
        {
            f"g{i}": make_source(reference_full((3, 2), 40 + i), mesh, (Partial(),), i)
            for i in range(3)
        }
        | {"h": make_source(reference_full((4,), 60, torch.float64), mesh, (Partial(),), 0)}
    )
    rec2 = GraphRecorder()
    red = tdd.redistribute(parts, [Replicate()], backend=rec2)
    res["partial_collectives"] = rec2.collectives()
    res["partial_values"] = compare_leaves(
        red.leaves(), [x.redistribute(mesh, [Replicate()]) for x in parts.leaves()]
    )
    # autograd through the compiled graph (to_local / from_local path)
    w = tdd.distribute(
        tdfunc.TensorDict(a=reference_full((4, 3), 70), b=reference_full((5,), 71)).apply(
            lambda t: t.requires_grad_(True)
        ),
        mesh,
        [Shard(0)],
    )
    rw = tdd.redistribute(w, [Replicate()], backend="aot_eager")
    (rw["a"].to_local() * 2).sum().add((rw["b"].to_local() ** 2).sum()).backward()
    w2 = tdd.distribute(
        tdfunc.TensorDict(a=reference_full((4, 3), 70), b=reference_full((5,), 71)).apply(
            lambda t: t.requires_grad_(True)
        ),
        mesh,
        [Shard(0)],
    )
    e = [x.redistribute(mesh, [Replicate()]) for x in (w2["a"], w2["b"])]
    (e[0].to_local() * 2).sum().add((e[1].to_local() ** 2).sum()).backward()
    res["grad_requires"] = [rw["a"].requires_grad, rw["b"].requires_grad]
    res["grad_values"] = max(
        (w[k].grad.to_local() - w2[k].grad.to_local()).abs().max().item() for k in ("a", "b")
    )
    res["grad_placements"] = str(w["a"].grad.placements)
    lap("transitions")

    # outer compile with compile=False: traced into the caller's graph
    outer = GraphRecorder()

    def step(td: Any) -> Any:
        return tdd.redistribute(td, [Replicate()], compile=False)

    cstep = torch.compile(step, backend=outer, fullgraph=True)
    res["outer_values"] = compare_leaves(cstep(sharded).leaves(), ref)
    res["outer_frames"] = outer.frames
    res["outer_collectives"] = outer.collectives()
    cstep(sharded2)
    res["outer_recompiles"] = outer.frames - 1
    cnt = torch._dynamo.testing.CompileCounterWithBackend("eager")
    loc_c = torch.compile(tdd.to_local, backend=cnt, fullgraph=True)(sharded)
    res["to_local_compiled"] = bool(
        all(torch.equal(a, b) for a, b in zip(loc_c.leaves(), tdd.to_local(sharded).leaves()))
    )
    res["to_local_frames"] = cnt.frame_count
    lap("outer")

    # transition sweep against DTensor leaf by leaf (eager run of the traced code)
    opts = [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),)]
    shapes = [(4, 6), (5, 3), (3, 5), (1, 2), (2, 3, 4), (7,), (0, 3), ()]
    res["sweep"] = sweep(mesh, shapes, opts, compile=False)
    lap("sweep")

    # bad input
    res["err_length"] = caught(lambda: tdd.redistribute(sharded, [Replicate(), Replicate()]))
    res["err_shard_dim"] = caught(lambda: tdd.redistribute(sharded, {"nested": [Shard(1)]}))
    res["err_distribute_dim"] = caught(lambda: tdd.distribute(many, mesh, [Shard(2)]))
    res["err_distribute_length"] = caught(lambda: tdd.distribute(many, mesh, []))
    res["err_type"] = caught(lambda: tdd.redistribute(sharded, ["shard"]))
    res["err_key"] = caught(lambda: tdd.redistribute(sharded, {"missing": [Replicate()]}))
    other = DeviceMesh("cpu", list(reversed(range(world))))
    mixed_mesh = sharded.set("z", distribute_tensor(reference_full((4,), 3), other, [Shard(0)]))
    res["err_mixed"] = caught(lambda: tdd.redistribute(mixed_mesh, [Replicate()]))
    res["err_mixed_full"] = caught(lambda: tdd.full_tensor(mixed_mesh))
    res["err_container"] = caught(lambda: tdd.redistribute({"a": 1}, [Replicate()]))
    res["err_spec"] = caught(lambda: tdd.redistribute(sharded, 3))
    res["err_src_rank"] = caught(lambda: tdd.distribute(many, mesh, [Shard(0)], src_data_rank=7))
    lap("errors")

    # tensorclass
    res["tensorclass"] = _tensorclass_checks(mesh)
    res["tensors"] = returns_tensors(rank, world)  # tensors travel back by value
    res["laps"] = lap.times
    return res


def _tensorclass_checks(mesh: DeviceMesh) -> dict[str, Any]:
    from _dist_tc import Pair

    p = Pair(x=reference_full((4, 2), 1), y=reference_full((4,), 2), batch_size=[4])
    d = tdd.distribute(p, mesh, [Shard(0)])
    r = tdd.redistribute(d, [Replicate()], compile=False)
    f = tdd.full_tensor(d, compile=False)
    return {
        "type": type(r).__name__,
        "values": (f.x - p.x).abs().max().item(),
        "local_type": type(tdd.to_local(d)).__name__,
    }


# --------------------------------------------------------------------------------------
# 4 ranks: 2-D mesh and send / recv between meshes A = [0, 1] and B = [2, 3]
# --------------------------------------------------------------------------------------
def four_meshes() -> dict[str, DeviceMesh]:
    """The meshes of :func:`run_four` (every rank of the world builds them, in this order)."""
    return {
        "mesh2d": DeviceMesh("cpu", [[0, 1], [2, 3]]),
        "mesh_a": DeviceMesh("cpu", [0, 1]),
        "mesh_b": DeviceMesh("cpu", [2, 3]),
        "row_a": DeviceMesh("cpu", [[0, 1]]),
        "row_b": DeviceMesh("cpu", [[2, 3]]),
        "first4": DeviceMesh("cpu", [0, 1, 2, 3]),
    }


def run_four(rank: int, world: int, meshes: dict[str, DeviceMesh] | None = None) -> dict[str, Any]:
    """A 2-D mesh, then send / recv from mesh A (ranks 0, 1) to mesh B (ranks 2, 3); on
    ranks 0-3 of a larger world when ``meshes`` come from :func:`four_meshes`."""
    res: dict[str, Any] = {}
    lap = Laps()
    eager = {"compile": False}
    meshes = meshes or four_meshes()
    mesh2d, mesh_a, mesh_b = meshes["mesh2d"], meshes["mesh_a"], meshes["mesh_b"]
    row_a, row_b = meshes["row_a"], meshes["row_b"]
    lap("meshes")

    # 2-D mesh sweep against DTensor leaf by leaf
    opts = [
        (Shard(0), Shard(1)),
        (Shard(0), Replicate()),
        (Replicate(), Shard(0)),
        (Shard(0), Shard(0)),
        (Shard(1), Shard(0)),
        (Partial(), Shard(1)),
        (Replicate(), Replicate()),
    ]
    res["sweep2d"] = sweep(mesh2d, [(4, 4), (5, 6), (8, 2), (3, 1)], opts, compile=False)
    lap("sweep2d")
    # distribute on a 2-D mesh: rank 0's values reach every rank (one broadcast per mesh dim)
    mine = tdfunc.TensorDict(a=reference_full((4, 6), 3) + rank, b=torch.arange(4) + rank)
    d2 = tdd.distribute(mine, mesh2d, {"a": [Shard(0), Shard(1)]})
    f2 = tdd.full_tensor(d2, **eager)
    res["2d_broadcast"] = max(
        (f2["a"] - reference_full((4, 6), 3)).abs().max().item(),
        (f2["b"] - torch.arange(4)).abs().max().item(),
    )
    res["2d_local_a"] = list(d2["a"].to_local().shape)
    rec = GraphRecorder()
    td = tdfunc.TensorDict(
        {
            f"w{i}": distribute_tensor(reference_full((4, 6), i), mesh2d, [Shard(0), Shard(1)])
            for i in range(3)
        }
        | {"odd": distribute_tensor(reference_full((5, 3), 9), mesh2d, [Shard(0), Shard(1)])}
    )
    out = tdd.redistribute(td, [Replicate(), Replicate()], backend=rec)
    res["2d_values"] = compare_leaves(
        out.leaves(), [x.redistribute(mesh2d, [Replicate(), Replicate()]) for x in td.leaves()]
    )
    res["2d_frames"] = rec.frames
    res["2d_collectives"] = rec.collectives()
    lap("2d compiled")

    # send / recv
    src_full = {
        "w": reference_full((6, 4), 1),
        "odd": reference_full((5, 3), 2),  # uneven over 2 ranks
        "sub": {"b": reference_full((6,), 3), "col": reference_full((3, 5), 4)},
        "plain": torch.arange(4),
        "grad": reference_full((4, 2), 5).requires_grad_(True),
    }
    spec = {
        "w": [Shard(0)],
        "odd": [Shard(0)],
        ("sub", "b"): [Replicate()],
        ("sub", "col"): [Shard(1)],
        "grad": [Shard(0)],
    }
    in_a = rank in (0, 1)
    peer = rank + 2 if in_a else rank - 2
    base = tdfunc.TensorDict({k: v for k, v in src_full.items() if k != "plain"})
    if in_a:
        sharded = tdd.distribute(base, mesh_a, spec).set("plain", src_full["plain"] + rank)
        res["local_bytes"] = tdd.send(sharded, peer, strategy="local")
        res["full_bytes"] = tdd.send(sharded, peer, strategy="full", **eager)
        res["row_bytes"] = tdd.send(
            tdd.distribute(base.exclude("grad"), row_a, [Replicate(), Shard(0)]), peer
        )
        res["local_shard_bytes"] = sum(
            x.to_local().numel() * x.to_local().element_size()
            if isinstance(x, DTensor)
            else x.numel() * x.element_size()
            for x in sharded.leaves()
        )
        res["full_tensor_bytes"] = (
            sum(x.numel() * x.element_size() for x in src_full["sub"].values())
            + sum(src_full[k].numel() * 4 for k in ("w", "odd", "grad"))
            + src_full["plain"].numel() * 8
        )
    else:
        got = tdd.recv(peer, mesh=mesh_b)
        items = got.items(include_nested=True, leaves_only=True)
        res["recv_types"] = {
            ".".join(k) if isinstance(k, tuple) else k: type(v).__name__ for k, v in items
        }
        res["recv_placements"] = {
            ".".join(k) if isinstance(k, tuple) else k: str(v.placements)
            for k, v in items
            if isinstance(v, DTensor)
        }
        res["recv_grad"] = bool(got["grad"].requires_grad)
        res["recv_plain"] = got["plain"].tolist()
        res["recv_batch"] = list(got.batch_size)
        full_b = tdd.full_tensor(got, **eager)
        res["recv_values"] = max(
            (full_b[k] - (src_full[k] if isinstance(k, str) else src_full[k[0]][k[1]]))
            .abs()
            .max()
            .item()
            for k in ["w", "odd", ("sub", "b"), ("sub", "col"), "grad"]
        )
        res["recv_mesh"] = got["w"].device_mesh.mesh.tolist()
        full_got = tdd.recv(peer)  # strategy "full", no mesh: plain full tensors
        res["full_types"] = sorted({type(x).__name__ for x in full_got.leaves()})
        res["full_values"] = (full_got["odd"] - src_full["odd"]).abs().max().item()
        row = tdd.recv(peer, mesh=row_b, placements=[Replicate(), Replicate()], **eager)
        res["row_values"] = max(
            (row[k].to_local() - src_full[k]).abs().max().item() for k in ("w", "odd")
        )
        res["row_placements"] = str(row["odd"].placements)
        res["row_mesh"] = row["w"].device_mesh.mesh.tolist()
    lap("send/recv")
    # receive with placements: local shards rebuilt, then redistributed in a compiled graph
    if in_a:
        sharded = tdd.distribute(
            tdfunc.TensorDict(w=src_full["w"], odd=src_full["odd"]), mesh_a, [Shard(0)]
        )
        tdd.send(sharded, peer)
    else:
        rec_p = GraphRecorder()
        rp = tdd.recv(peer, mesh=mesh_b, placements=[Shard(1)], backend=rec_p)
        ref_w = distribute_tensor(src_full["w"], mesh_b, [Shard(1)], src_data_rank=None)
        ref_o = distribute_tensor(src_full["odd"], mesh_b, [Shard(1)], src_data_rank=None)
        res["recv_redistributed"] = compare_leaves([rp["w"], rp["odd"]], [ref_w, ref_o])
        res["recv_redistributed_frames"] = rec_p.frames
        res["recv_redistributed_collectives"] = rec_p.collectives()
    lap("recv compiled")

    # tensorclass across meshes
    from _dist_tc import Pair

    if in_a:
        p = Pair(x=reference_full((4, 2), 1), y=reference_full((4,), 2), batch_size=[4])
        tdd.send(tdd.distribute(p, mesh_a, [Shard(0)]), peer)
    else:
        got_tc = tdd.recv(peer, mesh=mesh_b)
        res["tc_type"] = type(got_tc).__name__
        res["tc_values"] = (
            (tdd.full_tensor(got_tc, **eager).x - reference_full((4, 2), 1)).abs().max().item()
        )

    # bad pairings: ValueError on both sides, nobody hangs
    small = tdfunc.TensorDict(w=src_full["w"])
    if in_a:
        s = tdd.distribute(small, mesh_a, [Shard(0)])
        crossed = 3 if rank == 0 else 2  # coordinate 0 -> coordinate 1: does not fit
        res["err_crossed"] = caught(lambda: tdd.send(s, crossed))
        res["err_shape"] = caught(lambda: tdd.send(s, peer))
        res["err_no_mesh"] = caught(lambda: tdd.send(s, peer))
        res["err_recv_len"] = caught(lambda: tdd.send(s, peer))
        res["err_recv_no_mesh"] = caught(lambda: tdd.send(s, peer))
        res["err_strategy"] = caught(lambda: tdd.send(s, peer, strategy="fastest"))
        mixed = s.set(
            "z",
            distribute_tensor(
                reference_full((4,), 9), mesh2d, [Replicate(), Replicate()], src_data_rank=None
            ),
        )
        res["err_send_mixed"] = caught(lambda: tdd.send(mixed, peer))
        tdd.send(s, peer)  # err_recv_dim
        res["err_recv_not_in_mesh"] = caught(lambda: tdd.send(s, peer))
        # our tag, not our protocol
        dist.send(torch.zeros(wire.HEADER_LEN, dtype=torch.int64), peer, tag=wire.HEADER_TAG)
    else:
        crossed = 1 if rank == 2 else 0
        res["err_crossed"] = caught(lambda: tdd.recv(crossed, mesh=mesh_b))
        res["err_shape"] = caught(lambda: tdd.recv(peer, mesh=mesh2d))
        res["err_no_mesh"] = caught(lambda: tdd.recv(peer))
        res["err_recv_len"] = caught(
            lambda: tdd.recv(peer, mesh=mesh_b, placements=[Replicate(), Replicate()])
        )
        res["err_recv_no_mesh"] = caught(lambda: tdd.recv(peer, placements=[Replicate()]))
        res["err_strategy"] = caught(lambda: tdd.recv(peer, mesh=mesh_b))
        res["err_send_mixed"] = caught(lambda: tdd.recv(peer, mesh=mesh_b))
        res["err_recv_dim"] = caught(lambda: tdd.recv(peer, mesh=mesh_b, placements=[Shard(3)]))
        res["err_recv_not_in_mesh"] = caught(lambda: tdd.recv(peer, mesh=mesh_a))
        res["err_bad_header"] = caught(lambda: tdd.recv(peer, mesh=mesh_b))
        res["err_not_in_mesh"] = caught(lambda: tdd.distribute(small, mesh_a, [Shard(0)]))
    dist.barrier(group=meshes["first4"].get_group())
    lap("errors")
    res["laps"] = lap.times
    return res


# --------------------------------------------------------------------------------------
# launcher checks
# --------------------------------------------------------------------------------------
def rank_one_fails(rank: int, world: int) -> int:
    """Rank 1 raises; rank 0 blocks in a barrier until the launcher kills it."""
    if rank == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()
    return rank


def sleeps(rank: int, world: int) -> int:
    """Never finishes in time."""
    time.sleep(600)
    return rank


def rank_one_exits(rank: int, world: int, how: str) -> int:
    """Rank 1 fails in the way ``how`` says while rank 0 waits for it in a barrier (and then
    fails itself, having lost its peer)."""
    if rank == 1:
        time.sleep(0.3)  # rank 0 is in the barrier by now
        if how == "exit":
            os._exit(3)
        if how == "raise":
            raise RuntimeError("boom on purpose")
        os.kill(os.getpid(), getattr(signal, how))
    dist.barrier()
    return rank


def returns_tensors(rank: int, world: int) -> dict[str, Any]:
    """Tensors come back by value (not as handles to this process's memory)."""
    return {"x": torch.arange(4) + rank, "y": torch.full((2, 2), float(rank))}


def returns_unpicklable(rank: int, world: int) -> Any:
    """Rank 1's result cannot be pickled."""
    return rank if rank == 0 else (lambda: rank)


# --------------------------------------------------------------------------------------
# ranks that disagree
# --------------------------------------------------------------------------------------
def run_disagree(rank: int, world: int) -> dict[str, Any]:
    """Ranks ask for different placements, structures, shapes and dtypes: every rank raises
    the same ValueError before any data moves, and the group stays usable."""
    mesh = init_device_mesh("cpu", (world,))
    res: dict[str, Any] = {}
    base = tdfunc.TensorDict(a=reference_full((4, 6), 1), b=reference_full((4,), 2))
    sharded = tdd.distribute(base, mesh, [Shard(0)])
    mine = [Replicate()] if rank == 0 else [Shard(0)]  # gather vs. stay: both valid
    res["placements"] = caught(lambda: tdd.redistribute(sharded, mine))
    invalid = [Replicate()] if rank == 0 else [Shard(1)]  # 'b' has one dim: rank 1 rejects
    res["rejected"] = caught(lambda: tdd.redistribute(sharded, invalid))
    res["rejected_distribute"] = caught(lambda: tdd.distribute(base, mesh, invalid))
    extra = sharded if rank == 0 else sharded.set("c", sharded["b"])
    res["keys"] = caught(lambda: tdd.redistribute(extra, [Replicate()]))
    res["full_keys"] = caught(lambda: tdd.full_tensor(extra))
    shapes = base if rank == 0 else base.set("b", reference_full((6,), 2))
    res["distribute_shapes"] = caught(lambda: tdd.distribute(shapes, mesh, [Shard(0)]))
    dtypes = base if rank == 0 else base.apply(lambda x: x.double())
    res["distribute_dtypes"] = caught(lambda: tdd.distribute(dtypes, mesh, [Replicate()]))
    res["distribute_src"] = caught(
        lambda: tdd.distribute(base, mesh, [Replicate()], src_data_rank=rank)
    )
    # the group still works, and agreeing ranks get the right values
    out = tdd.redistribute(sharded, [Replicate()])
    res["after_values"] = compare_leaves(
        out.leaves(), [x.redistribute(mesh, [Replicate()]) for x in sharded.leaves()]
    )
    res["cached"] = caught(lambda: tdd.redistribute(sharded, [Replicate()]))
    dist.barrier()
    return res


# --------------------------------------------------------------------------------------
# peers that never answer, and messages that are not ours
# --------------------------------------------------------------------------------------
def run_silent_peers(rank: int, world: int) -> dict[str, Any]:
    """Four ranks, two broken pairings (with gloo, a timeout closes every connection of the
    rank that timed out, so each rank times out at most once):

    * (0, 1): rank 0 sends a plain ``dist.send`` message larger than a transfer header to
      rank 1, which waits in ``recv``: rank 1 times out naming rank 0 (it used to abort);
      then rank 0 waits in ``recv`` for rank 2, which never sends;
    * (3, 2): rank 3 sends to rank 2, which never receives.
    """
    import datetime

    res: dict[str, Any] = {}
    td = tdfunc.TensorDict(x=torch.arange(6.0))
    res["bad_timeout"] = caught(lambda: tdd.recv((rank + 1) % world, timeout=-1.0))
    if rank == 0:
        work = dist.isend(torch.zeros(64, dtype=torch.int64), 1)  # tag 0, 512 bytes
        try:
            work.wait(datetime.timedelta(seconds=20))
            res["stray"] = "delivered"
        except RuntimeError:
            res["stray"] = "not delivered"
        res["recv_silent"] = caught(lambda: tdd.recv(2, timeout=1.5))
    elif rank == 1:
        res["stray_recv"] = caught(lambda: tdd.recv(0, timeout=1.0))
    elif rank == 2:
        time.sleep(4.0)  # never answers
    else:
        res["send_silent"] = caught(lambda: tdd.send(td, 2, timeout=1.0))
    return res


# --------------------------------------------------------------------------------------
# planned transfers between meshes (6 ranks): 4+2 and 2+2, disjoint and overlapping
# --------------------------------------------------------------------------------------
MIXED_DTYPES = (
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
MIXED_SHAPES = ((8, 6), (5, 7), (12,), (3, 5, 2), (7, 4), (1, 9), (4, 4), (9,))


def mixed_full(seed: int = 0) -> tdfunc.TensorDict:
    """A nested TensorDict of 60 leaves of mixed dtypes and shapes (even and uneven), the
    same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def leaf(i: int) -> torch.Tensor:
        shape = MIXED_SHAPES[i % len(MIXED_SHAPES)]
        dt = MIXED_DTYPES[i % len(MIXED_DTYPES)]
        x = torch.randn(shape, generator=g) * 50
        if dt == torch.bool:
            return x > 0
        if dt == torch.complex64:
            return torch.complex(x, x.flip(0))
        return x.to(dt)

    layers = {
        f"layer{j}": {"w": leaf(3 * j), "b": leaf(3 * j + 1), "s": {"v": leaf(3 * j + 2)}}
        for j in range(20)
    }
    return tdfunc.TensorDict(layers)


def _two_d(path: Any, x: Any) -> list[Any]:
    """(Shard(0), Shard(1)) where a leaf has two dims, else (Shard(0), Replicate())."""
    return [Shard(0), Shard(1)] if x.ndim >= 2 else [Shard(0), Replicate()]


def _last(path: Any, x: Any) -> list[Any]:
    return [Shard(x.ndim - 1)]


def _check_received(got: Any, full: Any, mesh: DeviceMesh) -> dict[str, Any]:
    """Each received leaf: a DTensor on ``mesh`` whose local shard is exactly the slice of the
    full tensor its placements assign to this rank (no communication)."""
    worst = 0.0
    wrong: list[str] = []
    for (path, x), (_, ref) in zip(
        got.items(include_nested=True, leaves_only=True),
        full.items(include_nested=True, leaves_only=True),
    ):
        if not isinstance(x, DTensor) or x.device_mesh != mesh or x.shape != ref.shape:
            wrong.append(str(path))
            continue
        expected = distribute_tensor(ref, mesh, x.placements, src_data_rank=None).to_local()
        if any(isinstance(p, Partial) for p in x.placements):
            expected = x.to_local()  # checked through full_tensor below
        local = x.to_local()
        if (
            local.dtype != ref.dtype
            or local.shape != expected.shape
            or not torch.equal(local, expected)
        ):
            wrong.append(str(path))
    return {"wrong": wrong, "worst": worst, "n": len(list(full.leaves()))}


def _float_full(got: Any) -> Any:
    """full_tensor of the float32 / float64 leaves (gloo reduces those)."""
    keep = got.select(
        *[
            k
            for k, v in got.items(include_nested=True, leaves_only=True)
            if v.dtype in (torch.float32, torch.float64)
        ]
    )
    return tdd.full_tensor(keep, compile=False)


def plan_meshes() -> dict[str, DeviceMesh]:
    """The meshes of :func:`run_plan` (every rank of the world builds them, in this order)."""
    return {
        "m_2x2": DeviceMesh("cpu", [[0, 1], [2, 3]]),
        "m_45": DeviceMesh("cpu", [4, 5]),
        "m_01": DeviceMesh("cpu", [0, 1]),
        "m_23": DeviceMesh("cpu", [2, 3]),
        "m_0123": DeviceMesh("cpu", [0, 1, 2, 3]),
        "m_34": DeviceMesh("cpu", [3, 4]),
        "m_12": DeviceMesh("cpu", [1, 2]),
        "m_4": DeviceMesh("cpu", [4]),
    }


def run_six(rank: int, world: int) -> dict[str, Any]:
    """One launch of 6 ranks for two modules: :func:`run_four` on ranks 0-3 (its results under
    ``"four"``), then :func:`run_plan` on all six (under ``"plan"``). Ranks 4 and 5 start the
    planned transfers at once and wait in the first handshake for ranks 0-3."""
    fm, pm = four_meshes(), plan_meshes()  # collective setup: every rank, same order
    four = run_four(rank, 4, fm) if rank < 4 else {}
    return {"four": four, "plan": run_plan(rank, world, pm)}


@functools.cache
def six() -> list[dict[str, Any]]:
    """The results of :func:`run_six`, launched once per test session."""
    from tdfunc.testing import launch

    return launch(run_six, 6, timeout=400, pg_timeout=60)


def run_plan(rank: int, world: int, meshes: dict[str, DeviceMesh] | None = None) -> dict[str, Any]:
    """Planned transfers on 6 ranks; every rank builds every mesh (collective setup)."""
    from _dist_tc import Pair

    res: dict[str, Any] = {}
    lap = Laps()
    meshes = meshes or plan_meshes()
    m_2x2, m_45, m_01, m_23 = meshes["m_2x2"], meshes["m_45"], meshes["m_01"], meshes["m_23"]
    m_0123, m_34, m_12, m_4 = meshes["m_0123"], meshes["m_34"], meshes["m_12"], meshes["m_4"]
    lap("meshes")
    full = mixed_full()
    res["leaves"] = len(list(full.leaves()))
    res["dtypes"] = sorted({str(x.dtype) for x in full.leaves()})

    # --- A. 4+2 disjoint, [2, 2] (S0, S1) -> [2] (S1): a reusable Transfer, compiled ---
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    if rank < 4:
        src = tdd.distribute(full, m_2x2, _two_d, src_data_rank=None)
        sync = tdd.Transfer(m_2x2, m_45.mesh.tolist(), like=src, backend=counter)
        sent = [sync.send(src)]
        src2 = tdd.distribute(
            full.apply(lambda x: x + 1 if x.dtype != torch.bool else ~x),
            m_2x2,
            _two_d,
            src_data_rank=None,
        )
        sent.append(sync.send(src2))
        res["A_sent"] = sent
        res["A_frames"] = counter.frame_count
        res["A_full_ok"] = all(
            torch.equal(a, b)
            for a, b in zip(
                tdd.full_tensor(_float_only(src), compile=False).leaves(),
                _float_only(full).leaves(),
            )
        )
    else:
        sync = tdd.Transfer(m_2x2, m_45, _last, backend=counter)
        got = sync.recv()
        res["A_check"] = _check_received(got, full, m_45)
        res["A_placements"] = str(got["layer0", "w"].placements)
        res["A_batch"] = list(got.batch_size)
        got2 = sync.recv()
        full2 = full.apply(lambda x: x + 1 if x.dtype != torch.bool else ~x)
        res["A_check2"] = _check_received(got2, full2, m_45)
        res["A_frames"] = counter.frame_count
        ff = _float_full(got2)
        res["A_full_tensor"] = all(
            torch.equal(ff[k], full2[k]) for k in ff.keys(include_nested=True, leaves_only=True)
        )
        res["A_type"] = type(got).__name__
    res["A_bytes"] = [sync.bytes.total, sync.bytes.messages, dict(sync.bytes.sent)]
    lap("A 4+2 disjoint")

    # --- B. 2+2 disjoint: [0, 1] (S0) -> [2, 3] (S(last)), one-shot send / recv ---
    if rank < 2:
        src = tdd.distribute(full, m_01, [Shard(0)], src_data_rank=None)
        res["B_sent"] = tdd.send(src, m_23, compile=False)
    elif rank < 4:
        got = tdd.recv(m_01, mesh=m_23, placements=_last, compile=False)
        res["B_check"] = _check_received(got, full, m_23)
        res["B_placements"] = str(got["layer1", "w"].placements)
    lap("B 2+2 disjoint")

    # --- C. 4+2 overlapping: [0, 1, 2, 3] (S0) -> [3, 4] (S(last)); rank 3 sends and receives
    if rank < 4:
        src = tdd.distribute(full, m_0123, [Shard(0)], src_data_rank=None)
    if rank in (0, 1, 2):
        res["C_sent"] = tdd.send(src, m_34, compile=False)
    elif rank in (3, 4):
        got = tdd.recv(
            m_0123, mesh=m_34, placements=_last, source=src if rank == 3 else None, compile=False
        )
        res["C_check"] = _check_received(got, full, m_34)
    lap("C 4+2 overlapping")

    # --- D. 2+2 overlapping: [0, 1] (S0) -> [1, 2] (S(last)); one recv call on every rank
    if rank < 3:
        src = tdd.distribute(full, m_01, [Shard(0)], src_data_rank=None) if rank < 2 else None
        got = tdd.recv(m_01, mesh=m_12, placements=_last, source=src, compile=False)
        res["D_none_on_pure_sender"] = got is None if rank == 0 else None
        if rank in (1, 2):
            res["D_check"] = _check_received(got, full, m_12)
    lap("D 2+2 overlapping")

    # --- E. replicated and partial sources, partial targets; a tensorclass; plain leaves ---
    small = tdfunc.TensorDict(
        r=reference_full((8, 6), 1),
        p=reference_full((6, 4), 2),
        q=reference_full((4,), 3, torch.float64),
        plain=torch.arange(5),
    )
    if rank < 4:
        parts = {
            "r": distribute_tensor(
                small["r"], m_2x2, [Replicate(), Shard(0)], src_data_rank=None
            ).requires_grad_(True),
            "p": make_source(small["p"], m_2x2, (Partial(), Shard(1)), 0),
            "q": make_source(small["q"], m_2x2, (Partial(), Partial()), 0),
            "plain": small["plain"],
        }
        src = tdfunc.TensorDict(parts)
        res["E_sent"] = tdd.send(src, m_45, compile=False)
    else:
        got = tdd.recv(
            m_2x2,
            mesh=m_45,
            placements={"r": [Shard(0)], "p": [Partial()], "q": [Replicate()]},
            compile=False,
        )
        ff = tdd.full_tensor(got.exclude("plain"), compile=False)
        res["E_values"] = max((ff[k] - small[k]).abs().max().item() for k in ("r", "p", "q"))
        res["E_plain"] = got["plain"].tolist()
        res["E_plain_type"] = type(got["plain"]).__name__
        res["E_grad"] = [got["r"].requires_grad, got["r"].is_leaf, got["p"].requires_grad]
        res["E_partial_local"] = float(got["p"].to_local().abs().sum())
    if rank < 2:
        p = Pair(x=reference_full((4, 2), 1), y=reference_full((4,), 2), batch_size=[4])
        tdd.send(tdd.distribute(p, m_01, [Shard(0)]), m_4, compile=False)
    elif rank == 4:
        tc = tdd.recv(m_01, mesh=m_4, placements=[Replicate()], compile=False)
        res["E_tc"] = [
            type(tc).__name__,
            list(tc.batch_size),
            torch.equal(tc.x.to_local(), reference_full((4, 2), 1)),
        ]
    lap("E replicated / partial")

    # --- F. mismatches: ValueError on both sides, never a hang ---
    probe = tdfunc.TensorDict(w=reference_full((4, 6), 7))
    if rank < 2:
        src = tdd.distribute(probe, m_01, [Shard(0)])
        res["F_expect"] = caught(lambda: tdd.send(src, m_23, placements=[Shard(0)], compile=False))
        res["F_disagree"] = caught(lambda: tdd.send(src, m_23, compile=False))
        doubled = tdd.distribute(probe.apply(lambda x: x.double()), m_01, [Shard(0)])
        bad = src if rank == 0 else doubled
        res["F_layout"] = caught(lambda: tdd.send(bad, m_23, compile=False))
        res["F_strategy"] = caught(lambda: tdd.send(src, m_23, strategy="full", compile=False))
        res["F_key"] = caught(lambda: tdd.send(src, m_23, compile=False))
        sync = tdd.Transfer(m_01, m_23, like=src, compile=False)
        res["F_step_ok"] = sync.send(src) > 0
        wider = tdd.distribute(probe.set("w", reference_full((4, 7), 7)), m_01, [Shard(0)])
        wrong = src if rank == 1 else wider
        res["F_step"] = caught(lambda: sync.send(wrong))
        res["F_after"] = sync.send(src) > 0
    elif rank < 4:
        res["F_expect"] = caught(
            lambda: tdd.recv(m_01, mesh=m_23, placements=[Shard(1)], compile=False)
        )
        mine = [Shard(1)] if rank == 2 else [Replicate()]
        res["F_disagree"] = caught(
            lambda: tdd.recv(m_01, mesh=m_23, placements=mine, compile=False)
        )
        res["F_layout"] = caught(
            lambda: tdd.recv(m_01, mesh=m_23, placements=[Shard(1)], compile=False)
        )
        res["F_strategy"] = caught(
            lambda: tdd.recv(m_01, mesh=m_23, placements=[Shard(1)], compile=False)
        )
        spec = {"nope": [Shard(0)]} if rank == 3 else [Shard(0)]
        res["F_key"] = caught(lambda: tdd.recv(m_01, mesh=m_23, placements=spec, compile=False))
        sync = tdd.Transfer(m_01, m_23, [Shard(1)], compile=False)
        res["F_step_ok"] = _check_received(sync.recv(), probe, m_23)["wrong"] == []
        res["F_step"] = caught(sync.recv)
        res["F_after"] = _check_received(sync.recv(), probe, m_23)["wrong"] == []
    # a rank in both meshes that calls send instead of recv(..., source=)
    if rank < 3:
        src = tdd.distribute(probe, m_01, [Shard(0)]) if rank < 2 else None
        if rank < 2:
            res["F_role"] = caught(lambda: tdd.send(src, m_12, compile=False))
        else:
            res["F_role"] = caught(lambda: tdd.recv(m_01, mesh=m_12, placements=[Shard(0)]))
    res["F_no_dtensor"] = caught(lambda: tdd.send(probe, m_12))
    res["F_outside"] = caught(lambda: tdd.recv(m_01, mesh=m_23, placements=[Shard(0)]))
    lap("F mismatches")
    dist.barrier()
    # last: a receiver whose sender never sends times out naming it (the others wait quietly:
    # with gloo, the timeout closes the receiver's connections)
    if rank == 4:
        res["G_timeout"] = caught(
            lambda: tdd.recv(m_01, mesh=m_45, placements=[Shard(0)], timeout=1.0)
        )
    else:
        time.sleep(3.0)
    res["laps"] = lap.times
    return res


def _float_only(td: Any) -> Any:
    keep = [
        k
        for k, v in td.items(include_nested=True, leaves_only=True)
        if v.dtype in (torch.float32, torch.float64)
    ]
    return td.select(*keep)


# --------------------------------------------------------------------------------------
# started by torchrun (python -m torch.distributed.run --standalone --nproc-per-node 4)
# --------------------------------------------------------------------------------------
def run_torchrun(out_dir: str) -> None:
    """A process group started the standard way (``env://``): a reusable 2+2 transfer over
    three steps, then an overlapping one-shot transfer; each rank writes its results as
    JSON to ``out_dir/rank<r>.json``."""
    import datetime
    import json

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict[str, Any] = {"rank": rank, "world": world}
    m_01 = DeviceMesh("cpu", [0, 1])
    m_23 = DeviceMesh("cpu", [2, 3])
    m_all = DeviceMesh("cpu", [[0, 1], [2, 3]])
    m_12 = DeviceMesh("cpu", [1, 2])
    full = mixed_full(3)
    steps = []
    if rank < 2:
        sync = tdd.Transfer(m_01, m_23, like=tdd.distribute(full, m_01, [Shard(0)]))
        for step in range(3):
            src = tdd.distribute(full.apply(lambda x, s=step: _bump(x, s)), m_01, [Shard(0)])
            steps.append(sync.send(src))
    else:
        sync = tdd.Transfer(m_01, m_23, _last)
        for step in range(3):
            got = sync.recv()
            steps.append(_check_received(got, full.apply(lambda x, s=step: _bump(x, s)), m_23))
    res["steps"] = steps
    res["bytes"] = sync.bytes.total
    src = tdd.distribute(full, m_all, _two_d, src_data_rank=None)
    got = tdd.recv(m_all, mesh=m_12, placements=[Replicate()], source=src, compile=False)
    res["overlap"] = None if got is None else _check_received(got, full, m_12)
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(res, f)
    # Leave without the interpreter's teardown, where torch destroys its gloo objects still
    # referenced by the meshes: under load that has aborted after all the work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _bump(x: torch.Tensor, step: int) -> torch.Tensor:
    """New values for each step (bool leaves flip)."""
    if x.dtype == torch.bool:
        return x ^ (step % 2 == 1)
    return x + step


if __name__ == "__main__":
    run_torchrun(sys.argv[1])
