"""The sharded training step against FSDP2, on gloo CPU ranks.

``sharded_train_gpt2``: a 2-layer GPT-2 (transformers, small config, float32) trained with
AdamW on a global batch of 8 sequences of 16 tokens split over 2 gloo ranks (one thread each).

* ``tdfunc``: ``tdfunc.distributed.sharded_step`` over ``distribute(from_module(model), mesh,
  [Shard(0)])`` (every parameter sharded by rows, as FSDP2 does) and ``optim.adamw``.
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block and on the
  model, ``torch.optim.AdamW`` (foreach), ``loss.backward()``, ``step()``, ``zero_grad()``.

Rows (per mode: eager; compiled: tdfunc one ``torch.compile(fullgraph=True)`` graph per rank,
FSDP2 with ``torch.compile`` on the model, its collectives run by its hooks):

* step time, paired rounds inside the ranks (each round: both ranks meet at a barrier, time
  ``calls`` steps of A then of B, order alternating; the round's time on each side is the
  slower rank's), the median of per-round ratios tdfunc / FSDP2, and an A/A control (tdfunc
  against a second tdfunc step) in the same run;
* ``peak_mib``: the growth of the resident set during one eager step of a larger model (4
  layers, 256 wide: 3.2M parameters; Linux ``VmHWM`` after a reset, warm process; one fresh
  2-rank launch per contender, tdfunc also with ``donate=True``), the larger of the two
  ranks;
* ``bytes_per_step``: the bytes each rank hands to collectives in one step of that model (the
  input of every all-gather, reduce-scatter and all-reduce, counted by a dispatch mode).

What the two do differently (see the distributed guide): FSDP2 gathers one block at a time
and gathers it again in the backward (its memory peak is near one block); tdfunc's step
gathers the whole model once per step.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
import torch

from tdfunc.testing import launch

CATEGORY = "distributed"
WORLD = 2
BATCH, SEQ, VOCAB = 8, 16, 256
LR, WD = 1e-3, 0.01
#: (layers, width): the timed model, and a larger one for the memory row (3.2M parameters,
#: 12.6 MiB: a peak that the allocator's own slack does not hide)
SIZES = {"time": (2, 64), "memory": (4, 256)}


# ----------------------------------------------------------------------------- rank side
def _gpt2(size: str = "time") -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    layers, width = SIZES[size]
    cfg = transformers.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _batch(rank: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ids.chunk(WORLD)[rank]


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    )


def _tdfunc_step(rank: int, compiled: bool, size: str = "time", donate: bool = False) -> Any:
    """A closure running one tdfunc sharded step on this rank (state kept inside)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import tdfunc
    from tdfunc import distributed as tdd
    from tdfunc import optim

    model = _gpt2(size)
    mesh = init_device_mesh("cpu", (WORLD,))
    params = tdd.distribute(tdfunc.from_module(model, buffers=False), mesh, [Shard(0)])
    opt = optim.adamw(LR, weight_decay=WD)

    def loss_fn(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return _lm_loss(tdfunc.functional_call(model, p, (ids,)).logits, ids)

    kw = {"compile": True, "backend": "inductor"} if compiled else {}
    step = tdd.sharded_step(loss_fn, opt, donate=donate, **kw)
    ids = _batch(rank)
    box = [params, opt.init(params)]

    def run() -> None:
        box[0], box[1], _ = step(box[0], box[1], ids)

    return run


def _fsdp2_step(rank: int, compiled: bool, size: str = "time") -> Any:
    """A closure running one FSDP2 step on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _gpt2(size)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    fwd = torch.compile(model) if compiled else model
    ids = _batch(rank)

    def run() -> None:
        _lm_loss(fwd(ids).logits, ids).backward()
        opt.step()
        opt.zero_grad()

    return run


def _rounds(a: Any, b: Any, rounds: int, calls: int) -> list[float]:
    """Per-round ratios A/B of the slower rank's time, order alternating."""
    import torch.distributed as dist

    def timed(fn: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        dist.barrier()
        return time.perf_counter() - t

    for _ in range(2):  # warm up (compile)
        a()
        b()
    out = []
    for r in range(rounds):
        if r % 2 == 0:
            ta, tb = timed(a), timed(b)
        else:
            tb = timed(b)
            ta = timed(a)
        both = torch.tensor([ta, tb], dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        out.append(both[0].item() / both[1].item())
    return out


def time_ranks(rank: int, world: int, rounds: int, calls: int, compiled: bool) -> dict[str, Any]:
    """Paired rounds tdfunc / FSDP2 and the A/A control tdfunc / tdfunc."""
    torch.set_num_threads(1)
    a, a2 = _tdfunc_step(rank, compiled), _tdfunc_step(rank, compiled)
    b = _fsdp2_step(rank, compiled)
    return {"ratios": _rounds(a, b, rounds, calls), "aa": _rounds(a, a2, rounds, calls)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class _Bytes:
    """A dispatch mode adding up the input bytes of every collective (functional or not)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        total = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                name = str(func)
                if name.startswith("_c10d_functional.") and (
                    "all_gather" in name or "reduce_scatter" in name or "all_reduce" in name
                ):
                    total[0] += args[0].numel() * args[0].element_size()
                elif name.startswith("c10d.") and ("allgather" in name or "reduce_scatter" in name):
                    total[0] += args[1].numel() * args[1].element_size()  # (output, input, ...)
                elif name.startswith("c10d.allreduce"):
                    total[0] += sum(t.numel() * t.element_size() for t in args[0])
                return func(*args, **(kwargs or {}))

        self.mode, self.total = Mode(), total


def live_peak(run: Any) -> int:
    """The high-water mark of the bytes torch's allocator holds while ``run()`` runs, above
    what it held before: torch's profiler records each allocation with the op that made it
    and each free, so the running sum in time order is the live bytes (an op's own
    temporaries that it frees before it returns show as their net)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def memory_ranks(rank: int, world: int, contender: str) -> dict[str, Any]:
    """Growth of live allocator bytes and of the resident set during one warm eager step,
    and the bytes sent by this rank."""
    torch.set_num_threads(1)
    compiled = contender.endswith("_compiled")
    if contender.startswith("fsdp2"):
        run = _fsdp2_step(rank, compiled, "memory")
    else:
        run = _tdfunc_step(rank, compiled, "memory", donate="donated" in contender)
    for _ in range(3):
        run()
    counter = _Bytes()
    if not compiled:  # a dispatch mode cannot run around compiled code
        with counter.mode:
            run()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set
    before = _status("VmRSS:")
    run()
    rss = _status("VmHWM:") - before
    return {"peak": rss, "live": live_peak(run), "bytes": counter.total[0]}


# ----------------------------------------------------------------------------- parent side
@pytest.mark.bench_full_only
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_sharded_train_step_vs_fsdp2(benchmark: Any, bench_quick: bool, mode: str) -> None:
    """tdfunc's sharded step / FSDP2 on the same model, mesh, batch and optimizer."""
    pytest.importorskip("transformers")
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the resident-set high-water mark")
    rounds, calls = (5, 2) if bench_quick else (15, 4)
    timing = launch(
        time_ranks, WORLD, args=(rounds, calls, mode == "compiled"), timeout=1800, pg_timeout=900
    )[0]
    # the memory of the step of this mode (eager, or compiled: tdfunc's one graph, FSDP2's
    # compiled model); bytes sent are counted eagerly only (a dispatch mode)
    suffix = "_compiled" if mode == "compiled" else ""
    mem = {
        c: launch(memory_ranks, WORLD, args=(c + suffix,), timeout=900, pg_timeout=600)
        for c in ("tdfunc", "tdfunc_donated", "fsdp2")
    }
    peak = {c: max(r["peak"] for r in res) / 2**20 for c, res in mem.items()}
    live = {c: max(r["live"] for r in res) / 2**20 for c, res in mem.items()}
    # bytes sent: counted in the eager step only (None in the compiled row)
    sent = {c: None if suffix else max(r["bytes"] for r in res) for c, res in mem.items()}
    ratios, aa = timing["ratios"], timing["aa"]
    info = {
        "workload": "sharded_train_gpt2",
        "mode": mode,
        "contender": "tdfunc",
        "category": CATEGORY,
        "against": "fsdp2",
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "aa": statistics.median(aa),
        "aa_min": min(aa),
        "aa_max": max(aa),
        "rounds": rounds,
        "calls_per_round": calls,
        "target": 1.0,
        "ranks": WORLD,
        "peak_mib_tdfunc": peak["tdfunc"],
        "peak_mib_fsdp2": peak["fsdp2"],
        "peak_mib_tdfunc_donated": peak["tdfunc_donated"],
        "peak_ratio": peak["tdfunc"] / peak["fsdp2"] if peak["fsdp2"] else float("nan"),
        "live_peak_mib_tdfunc": live["tdfunc"],
        "live_peak_mib_tdfunc_donated": live["tdfunc_donated"],
        "live_peak_mib_fsdp2": live["fsdp2"],
        "live_peak_ratio": live["tdfunc"] / live["fsdp2"] if live["fsdp2"] else float("nan"),
        "bytes_per_step_tdfunc": sent["tdfunc"],
        "bytes_per_step_fsdp2": sent["fsdp2"],
    }
    benchmark.extra_info.update(info)
    print(
        f"\nsharded_train_gpt2 [{mode}] tdfunc / fsdp2: {info['ratio']:.3f} "
        f"[{info['ratio_min']:.3f}-{info['ratio_max']:.3f}]; A/A {info['aa']:.3f}; "
        f"peak MiB {peak['tdfunc']:.1f} (donated {peak['tdfunc_donated']:.1f}) vs "
        f"{peak['fsdp2']:.1f}; live allocator peak MiB {live['tdfunc']:.1f} "
        f"(donated {live['tdfunc_donated']:.1f}) vs {live['fsdp2']:.1f}; "
        f"bytes/step {sent['tdfunc']} vs {sent['fsdp2']}"
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
