"""Rank functions for tests/test_distributed_training.py (importable by spawned processes).

Each ``run_*`` function runs on every rank of a fresh gloo group and returns plain values
(lists of floats, strings, booleans) that the test process compares with one process
training on the whole batch (:func:`reference`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch._dynamo.testing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import tdfunc
from tdfunc import distributed as tdd
from tdfunc import optim
from tdfunc.distributed._training.step import _layout

VOCAB, WIDTH, SEQ, BATCH = 11, 6, 5, 8  # rows 11, 6 and 3: uneven over 2 and 4 ranks
STEPS = 50
SPLIT = 25  # the checkpoint is taken after this many steps
DONATED_STEPS = 5
#: units gathered one at a time (the 2-D weights of the block's three parts; the embedding and
#: head weights are the rest, gathered once per step; the 1-D leaves are replicated)
UNITS = {"tiny": ["block.self_attn", "block.linear1", "block.linear2"]}
UNITS["gpt2"] = ["transformer.h.0", "transformer.h.1"]


class TinyLM(torch.nn.Module):
    """A one-block transformer language model (embedding, attention, MLP, norms, head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.block = torch.nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=3, dropout=0.0, batch_first=True, bias=False
        )  # no biases: an attention key bias has no gradient, and AdamW amplifies the rounding
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def model(kind: str = "tiny") -> torch.nn.Module:
    """The model, float64: ``"tiny"`` (:class:`TinyLM`) or ``"gpt2"`` (transformers' GPT-2
    from a small config: two blocks, tied embedding and head)."""
    torch.manual_seed(0)
    if kind == "tiny":
        return TinyLM().double()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=8,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg).double()


def global_batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((x, (3 * x + 1) % VOCAB))  # a rule the model can learn: the loss goes down
    return out


def loss_fn_of(m: torch.nn.Module) -> Any:
    def loss_fn(params: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        out = tdfunc.functional_call(m, params, (x,))
        logits = out if isinstance(out, torch.Tensor) else out.logits  # GPT-2's output
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    return loss_fn


def optimizer() -> optim.GradientTransformation:
    # the clip reduces over every leaf: across ranks in the sharded step
    # the clip reduces over every leaf (across ranks in the sharded step); 0.05 is below the
    # gradient norm of every step, so it always scales
    return optim.chain(optim.clip_by_global_norm(0.05), optim.adamw(3e-2, weight_decay=0.1))


def reference(steps: int = STEPS, kind: str = "tiny") -> tuple[list[float], dict[str, list[float]]]:
    """One process, the whole batch: the losses and the final parameters."""
    m = model(kind)
    loss_fn, opt = loss_fn_of(m), optimizer()
    params = tdfunc.from_module(m)
    state = opt.init(params)
    losses = []
    for batch in global_batches(steps):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses, _flat(params)


def _flat(params: Any) -> dict[str, list[float]]:
    return {
        ".".join(k): v.reshape(-1).tolist()
        for k, v in params.items(leaves_only=True, include_nested=True)
    }


def _full(params: Any) -> dict[str, list[float]]:
    return _flat(tdd.full_tensor(params, compile=False))


def _placements(path: Any, leaf: torch.Tensor) -> list[Any]:
    # the matrices sharded by rows (FSDP), the 1-D vectors (biases, norms) replicated (DDP)
    return [Shard(0)] if leaf.dim() == 2 else [Replicate()]


def _local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> Any:
    return tuple(t.chunk(world)[rank] for t in batch)


def train(rank: int, world: int, step: Any, params: Any, state: Any, batches: list[Any]) -> Any:
    losses = []
    for batch in batches:
        params, state, loss = step(params, state, _local(batch, rank, world))
        losses.append(loss.item())
    return params, state, losses


def run_train(
    rank: int, world: int, ckpt: str, compiled: bool = True, kind: str = "tiny"
) -> dict[str, Any]:
    """Eager (and compiled) training, the inputs left alone, one graph, a checkpoint."""
    mesh = init_device_mesh("cpu", (world,))
    m = model(kind)
    opt = optimizer()
    res: dict[str, Any] = {}
    params0 = tdd.distribute(tdfunc.from_module(m), mesh, _placements)
    state0 = opt.init(params0)
    res["placements"] = {
        ".".join(k): repr(v.placements[0])
        for k, v in params0.items(leaves_only=True, include_nested=True)
    }
    before = [v.to_local().clone() for v in params0.values(True, True)]
    batches = global_batches()

    step = tdd.sharded_step(loss_fn_of(m), opt)
    params, state, losses = train(rank, world, step, params0, state0, batches[:DONATED_STEPS])
    res["after_first"] = _full(params)
    params, state, rest = train(rank, world, step, params, state, batches[DONATED_STEPS:SPLIT])
    losses += rest
    # a checkpoint after SPLIT steps, then the rest
    tdd.save_checkpoint(ckpt, tdfunc.TensorDict(params=params, state=state), overwrite=True)
    params, state, more = train(rank, world, step, params, state, batches[SPLIT:])
    res["eager_losses"] = losses + more
    res["eager_params"] = _full(params)
    res["inputs_unchanged"] = all(
        torch.equal(a, b.to_local()) for a, b in zip(before, params0.values(True, True))
    )
    res["out_placements"] = [repr(v.placements[0]) for v in params.values(True, True)]

    # gathered unit by unit (eager, plain autograd): the values of the whole-model step
    ustep = tdd.sharded_step(loss_fn_of(m), opt, units=UNITS[kind])
    p_units, _, units_losses = train(rank, world, ustep, params0, state0, batches)
    res["units_losses"] = units_losses
    res["units_params"] = _full(p_units)
    res["units_gathers"] = ustep.gathers
    if world == 2:
        # compiled: the loss of the shards compiled (forward and backward graphs, the
        # all-gathers differentiable), the update eager
        ccnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        custep = tdd.sharded_step(loss_fn_of(m), opt, units=UNITS[kind], compile=True, backend=ccnt)
        p_cu, _, res["units_compiled_losses"] = train(rank, world, custep, params0, state0, batches)
        res["units_compiled_params"] = _full(p_cu)
        res["units_compiled_frames"] = ccnt.frame_count
        # and donated: the fused kernel writes the given shards
        dstep = tdd.sharded_step(loss_fn_of(m), opt, units=UNITS[kind], donate=True)
        p, s = params0.clone(), state0.clone()
        memory = [v.to_local().data_ptr() for v in p.values(True, True)]
        p, s, d_losses = train(rank, world, dstep, p, s, batches[:DONATED_STEPS])
        res["units_donated"] = {
            "losses": d_losses,
            "in_place": [v.to_local().data_ptr() for v in p.values(True, True)] == memory,
        }

    if world == 2:
        # small buckets: several collectives per dtype, the same values (each element is
        # reduced over the same ranks whatever buffer carries it)
        tiny = tdd.sharded_step(loss_fn_of(m), opt, bucket_mb=0.0005)
        first = batches[:DONATED_STEPS]
        p_small, _, small_losses = train(rank, world, tiny, params0, state0, first)
        res["buckets"] = {
            "groups": len(_layout(params0, tiny.bucket_bytes)[0].sharded_groups),
            "default_groups": len(_layout(params0, step.bucket_bytes)[0].sharded_groups),
            "losses_equal": small_losses == losses[:DONATED_STEPS],
            "params_equal": _full(p_small) == res["after_first"],
        }

    if not compiled:
        return res
    # aot_eager: AOTAutograd functionalizes the graph with its collectives, as inductor does
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    cstep = tdd.sharded_step(loss_fn_of(m), opt, compile=True, backend=cnt)
    params, state, losses = train(rank, world, cstep, params0, state0, batches)
    res["compiled_losses"] = losses
    res["compiled_params"] = _full(params)
    res["frames"] = cnt.frame_count

    # donated, eager and compiled: the values of the undonated steps, in the given shards
    dcnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for name, kw in (("eager", {}), ("compiled", {"compile": True, "backend": dcnt})):
        dstep = tdd.sharded_step(loss_fn_of(m), opt, donate=True, **kw)
        p, s = params0.clone(), state0.clone()
        memory = [v.to_local().data_ptr() for v in p.values(True, True)]
        first = p
        losses, same_objects = [], []
        for batch in batches[:DONATED_STEPS]:
            given = list(p.values(True, True))  # p is consumed by the call
            p, s, loss = dstep(p, s, _local(batch, rank, world))
            same_objects.append(all(a is b for a, b in zip(p.values(True, True), given)))
            losses.append(loss.item())
        res[f"donated_{name}"] = {
            "losses": losses,
            "in_place": [v.to_local().data_ptr() for v in p.values(True, True)] == memory,
            "same_objects": same_objects,  # the first call's inputs require grad: detached
            "reuse": _caught(lambda first=first, s=s, dstep=dstep: dstep(first, s, batches[0])),
        }
    res["donated_frames"] = dcnt.frame_count
    return res


def run_resume(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Load the checkpoint taken after SPLIT steps on this (other) number of ranks and train
    the remaining steps."""
    mesh = init_device_mesh("cpu", (world,))
    m = model()
    opt = optimizer()
    like_params = tdd.distribute(tdfunc.from_module(m), mesh, _placements)
    like = tdfunc.TensorDict(params=like_params, state=opt.init(like_params))
    loaded = tdd.load_checkpoint(ckpt, like)
    step = tdd.sharded_step(loss_fn_of(m), opt)
    params, _, losses = train(
        rank, world, step, loaded["params"], loaded["state"], global_batches()[SPLIT:]
    )
    return {"losses": losses, "params": _full(params)}


def _caught(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def run_errors(rank: int, world: int) -> dict[str, Any]:
    """Bad input on one rank: every rank raises, before any data moves."""
    mesh = init_device_mesh("cpu", (world,))
    m = model()
    opt = optimizer()
    params = tdd.distribute(tdfunc.from_module(m), mesh, _placements)
    state = opt.init(params)
    step = tdd.sharded_step(loss_fn_of(m), opt)
    x, y = _local(global_batches(1)[0], rank, world)
    res: dict[str, Any] = {}
    # rank 1 passes a longer batch part than rank 0
    bad = (x, y) if rank == 0 else (torch.cat([x, x]), torch.cat([y, y]))
    res["batch_shape"] = _caught(lambda: step(params, state, bad))
    # rank 1 passes one parameter sharded by columns
    if rank == 1:  # built locally: no collective that rank 0 would have to join
        shard = torch.zeros(VOCAB, WIDTH // world, dtype=torch.float64)
        cols = params.set(("embed", "weight"), DTensor.from_local(shard, mesh, [Shard(1)]))
    else:
        cols = params
    res["placement"] = _caught(lambda: step(cols, state, (x, y)))
    # rank 0 passes plain tensors
    plain = tdd.to_local(params) if rank == 0 else params  # no collective either
    res["plain"] = _caught(lambda: step(plain, state, (x, y)))
    # after all that, a good call still works on every rank
    _, _, loss = step(params, state, (x, y))
    res["good_after"] = bool(torch.isfinite(loss))
    res["local_errors"] = {
        "loss_fn": _caught(lambda: tdd.sharded_step(3, opt)),  # type: ignore[arg-type]
        "optimizer": _caught(lambda: tdd.sharded_step(loss_fn_of(m), object())),  # type: ignore[arg-type]
        "container": _caught(lambda: step([1], state, (x, y))),
    }
    return res


def run_dead_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 dies before the step; the others must fail, not hang."""
    mesh = init_device_mesh("cpu", (world,))
    m = model()
    opt = optimizer()
    params = tdd.distribute(tdfunc.from_module(m), mesh, _placements)
    state = opt.init(params)
    step = tdd.sharded_step(loss_fn_of(m), opt)
    if rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    step(params, state, _local(global_batches(1)[0], rank, world))
    return {"elapsed": time.monotonic() - t0}


def is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def run_layout_errors(rank: int, world: int) -> dict[str, Any]:
    """Parameters the step refuses on their own (one rank): none, or on a 2-D mesh."""
    mesh2 = init_device_mesh("cpu", (world, 1))
    m = model()
    opt = optimizer()
    step = tdd.sharded_step(loss_fn_of(m), opt)
    batch = global_batches(1)[0]
    on_2d = tdd.distribute(tdfunc.from_module(m), mesh2, [Shard(0), Replicate()])
    mesh3 = init_device_mesh("cpu", (world, 1, 1))
    on_3d = tdd.distribute(tdfunc.from_module(m), mesh3, [Replicate(), Replicate(), Shard(0)])
    # two 1-D meshes over the same ranks (different dim names): the head on the second
    mesh_a = init_device_mesh("cpu", (world,), mesh_dim_names=("a",))
    mesh_b = init_device_mesh("cpu", (world,), mesh_dim_names=("b",))
    mixed = tdd.distribute(tdfunc.from_module(m), mesh_a, [Shard(0)])
    head = tdd.distribute(tdfunc.from_module(m.head), mesh_b, [Shard(0)])
    mixed = mixed.set("head", head)
    return {
        "empty": _caught(lambda: step(tdfunc.TensorDict(), tdfunc.TensorDict(), batch)),
        "mesh_2d": _caught(lambda: step(on_2d, opt.init(on_2d), batch)),
        "mesh_3d": _caught(lambda: step(on_3d, opt.init(on_3d), batch)),
        "mixed_mesh": _caught(lambda: step(mixed, opt.init(mixed), batch)),
    }


def run_donated_dtensors(rank: int, world: int) -> dict[str, Any]:
    """``tdfunc.compile(..., donate=...)`` over a container of DTensors, eager and compiled."""
    mesh = init_device_mesh("cpu", (world,))
    base = tdfunc.TensorDict(a=torch.arange(12.0).reshape(4, 3), b=torch.ones(3))
    placements = {"a": [Shard(0)], "b": [Replicate()]}
    params = tdd.distribute(base, mesh, lambda path, leaf: placements[path[-1]])

    def f(p: Any) -> Any:
        return p.apply(lambda x: x * 2 + 1)

    res: dict[str, Any] = {}
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for name, kw in (("eager", {"disable": True}), ("compiled", {"backend": cnt})):
        g = tdfunc.compile(f, donate=(0,), fullgraph=True, **kw)
        p = params.clone()
        donors = {k: p[k] for k in ("a", "b")}
        out = g(p)
        out = g(out)  # the outputs are donated in turn
        res[name] = {
            "same_objects": all(out[k] is donors[k] for k in donors),
            "placements": [repr(out[k].placements[0]) for k in ("a", "b")],
            "values": tdd.full_tensor(out, compile=False)["a"].tolist(),
            "reuse": _caught(lambda p=p, g=g: g(p)),
        }
    res["frames"] = cnt.frame_count
    # two donated leaves over one local memory: the same DTensor under two keys, and another
    # DTensor around the same local shard
    g = tdfunc.compile(f, donate=(0,), disable=True)
    res["alias"] = _caught(lambda: g(params.set("c", params["a"])))
    other = DTensor.from_local(params["a"].to_local(), mesh, [Shard(0)], run_check=False)
    res["alias_local"] = _caught(lambda: g(params.set("c", other)))
    return res


def run_unit_schedule(rank: int, world: int) -> dict[str, Any]:
    """What the unit-by-unit step keeps alive, and its error paths (2 ranks)."""
    import gc

    from tdfunc.distributed._training import units as U

    mesh = init_device_mesh("cpu", (world,))
    m = model()
    opt = optimizer()
    params = tdd.distribute(tdfunc.from_module(m), mesh, _placements)
    state = opt.init(params)
    batch = _local(global_batches(1)[0], rank, world)
    res: dict[str, Any] = {}

    # the memory of the full values handed to the forward, by unit: a storage is in use by
    # something else while its reference count is above the one held here
    seen: dict[int, list[Any]] = {}
    full = U.UnitGather.full

    def spy(self: Any, leaf: int) -> torch.Tensor:
        t = full(self, leaf)
        seen.setdefault(self.unit_of[leaf], []).append(t.untyped_storage())
        return t

    alive: dict[str, dict[int, int]] = {}

    def count(where: str) -> None:
        gc.collect()
        alive[where] = {
            u: sum(torch._C._storage_Use_Count(st._cdata) > 1 for st in storages)
            for u, storages in seen.items()
        }

    base = loss_fn_of(m)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        loss = base(p, b)
        count("end of forward")  # the last unit is still in use here
        loss.register_hook(lambda g: count("start of backward"))
        return loss

    U.UnitGather.full = spy  # type: ignore[method-assign]
    try:
        step = tdd.sharded_step(loss_fn, opt, units=UNITS["tiny"])
        _, _, loss = step(params, state, batch)
    finally:
        U.UnitGather.full = full  # type: ignore[method-assign]
    res["alive"] = alive
    res["gathers"] = step.gathers
    res["loss"] = loss.item()
    # the same call gathering the whole model at once
    _, _, whole = tdd.sharded_step(base, opt)(params, state, batch)
    res["whole_loss"] = whole.item()

    # a forward that writes a parameter in place: a TypeError naming it, on every rank
    def writes(p: Any, b: Any) -> torch.Tensor:
        p["head", "weight"].mul_(2)
        return base(p, b)

    res["write"] = _caught(
        lambda: tdd.sharded_step(writes, opt, units=["block.linear1"])(params, state, batch)
    )
    # a prefix no sharded parameter has (one rank): a KeyError there, the other rank hears it
    bad = ["block.linear1", "nope"] if rank == 1 else ["block.linear1"]
    res["missing"] = _caught(lambda: tdd.sharded_step(base, opt, units=bad)(params, state, batch))
    # ranks that gather different units: a ValueError on every rank before data moves
    other = ["block.linear2"] if rank == 1 else ["block.linear1"]
    res["disagree"] = _caught(
        lambda: tdd.sharded_step(base, opt, units=other)(params, state, batch)
    )
    # a good call still works afterwards
    _, _, again = tdd.sharded_step(base, opt, units=UNITS["tiny"])(params, state, batch)
    res["good_after"] = again.item() == res["loss"]
    return res


def run_fused_dtensor_step(rank: int, world: int) -> dict[str, Any]:
    """``optim.step`` over DTensor leaves runs torch's fused kernel on the local tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = tdfunc.TensorDict(w=torch.randn(5, 3, dtype=torch.float64), b=torch.randn(3).double())
    placements = {"w": [Shard(0)], "b": [Replicate()]}
    params = tdd.distribute(base, mesh, lambda path, leaf: placements[path[-1]])
    grads = tdd.distribute(base * 0.5 - 0.1, mesh, lambda path, leaf: placements[path[-1]])
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(params)

    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    updates, want_state = opt.update(grads, state, params)
    want = optim.apply_updates(params, updates)
    with Ops():
        got, got_state = optim.step(opt, grads, state, params)
    pure_ops = list(ops)
    ops.clear()
    p, s = params.clone(), state.clone()
    memory = [v.to_local().data_ptr() for v in p.values(True, True)]
    with Ops():
        donated, _ = optim.step(opt, grads, s, p, donate=True)
    return {
        "pure_fused": any("_fused_adamw_" in o for o in pure_ops),
        "donated_fused": any("_fused_adamw_" in o for o in ops),
        "placements": [repr(v.placements[0]) for v in got.values(True, True)],
        "close": all(
            torch.allclose(a.to_local(), b.to_local(), rtol=1e-12, atol=1e-14)
            for a, b in zip(got.values(True, True), want.values(True, True))
        )
        and all(
            torch.allclose(a.to_local(), b.to_local(), rtol=1e-12, atol=1e-14)
            for a, b in zip(got_state.values(True, True), want_state.values(True, True))
            if isinstance(a, DTensor)
        ),
        "donated_equal": all(
            torch.equal(a.to_local(), b.to_local())
            for a, b in zip(donated.values(True, True), got.values(True, True))
        ),
        "in_place": [v.to_local().data_ptr() for v in donated.values(True, True)] == memory,
        "input_unchanged": torch.equal(params["w"].to_local(), base["w"].chunk(world)[rank]),
    }


def _hsdp_placements(path: Any, leaf: torch.Tensor) -> list[Any]:
    # HSDP on a (replicate, shard) mesh: matrices sharded by rows within a replica group
    return [Replicate(), Shard(0)] if leaf.dim() == 2 else [Replicate(), Replicate()]


def run_hsdp(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """A 2 x 2 (replicate, shard) mesh: eager, gathered by unit, compiled; a checkpoint."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    m = model()
    opt = optimizer()
    params0 = tdd.distribute(tdfunc.from_module(m), mesh, _hsdp_placements)
    state0 = opt.init(params0)
    batches = global_batches()
    res: dict[str, Any] = {}
    step = tdd.sharded_step(loss_fn_of(m), opt)
    params, state, losses = train(rank, world, step, params0, state0, batches[:SPLIT])
    tdd.save_checkpoint(ckpt, tdfunc.TensorDict(params=params, state=state), overwrite=True)
    params, state, more = train(rank, world, step, params, state, batches[SPLIT:])
    res["eager_losses"] = losses + more
    res["eager_params"] = _full(params)
    res["placements"] = sorted({repr(v.placements) for v in params.values(True, True)})
    ustep = tdd.sharded_step(loss_fn_of(m), opt, units=UNITS["tiny"], donate=True)
    p, _, units_losses = train(rank, world, ustep, params0.clone(), state0.clone(), batches)
    res["units_losses"] = units_losses
    res["units_params"] = _full(p)
    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    cstep = tdd.sharded_step(loss_fn_of(m), opt, compile=True, backend=cnt)
    _, _, res["compiled_losses"] = train(rank, world, cstep, params0, state0, batches[:10])
    res["frames"] = cnt.frame_count
    return res
