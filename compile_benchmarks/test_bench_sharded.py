"""The sharded training step against FSDP2, on gloo CPU ranks.

``sharded_train_gpt2``: a 2-layer GPT-2 (transformers, small config, float32) trained with
AdamW on a global batch of 8 sequences of 16 tokens split over 2 gloo ranks (one thread each).

* ``tdfunc``: ``tdfunc.distributed.sharded_step`` over ``distribute(from_module(model), mesh,
  [Shard(0)])`` (every parameter sharded by rows, as FSDP2 does) and ``optim.adamw``; the
  whole model gathered once per step. ``tdfunc_units``: the same step with
  ``units=["transformer.h.0", ...]`` (eager: each block gathered when the forward reaches it,
  let go after it, gathered again for the backward; FSDP2's schedule; compiled: the loss of
  the shards compiled, the gathers recomputed in the backward graph); ``_donated``: with
  ``donate=True`` (eagerly, torch's fused AdamW writes the shards in place, as FSDP2's
  optimizer does).
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block and on the
  model, ``torch.optim.AdamW`` (foreach), ``loss.backward()``, ``step()``, ``zero_grad()``.

Rows (per mode: eager; compiled: tdfunc one ``torch.compile(fullgraph=True)`` graph per rank,
FSDP2 with ``torch.compile`` on the model, its collectives run by its hooks):

* step time, paired rounds inside the ranks (each round: both ranks meet at a barrier, time
  ``calls`` steps of A then of B, order alternating; the round's time on each side is the
  slower rank's), the median of per-round ratios tdfunc / FSDP2, and an A/A control (tdfunc
  against a second tdfunc step) in the same run; also ``tdfunc_units_donated`` / FSDP2;
* memory, on a larger model (4 layers, 256 wide: 3.2M parameters, 12.6 MiB), one fresh
  2-rank launch per contender, the larger of the two ranks, warm processes:
  ``heap_peak_mib``: the high-water mark of the bytes the C heap holds during one step above
  what it held before it (glibc's ``mallinfo2`` sampled by a thread; torch's CPU allocator
  takes its memory there), the highest of three steps; ``rss_peak_mib``: the growth of the
  resident set (Linux ``VmHWM`` after a reset; it moves with the allocator's slack, so it
  only resolves large differences);
* ``bytes_per_step``: the bytes each rank hands to collectives in one step of that model (the
  input of every all-gather, reduce-scatter and all-reduce, counted by a dispatch mode).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import pytest
import torch

from tdfunc.testing import launch

from .memory import heap_peak

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


def _tdfunc_step(
    rank: int, compiled: bool, size: str = "time", donate: bool = False, units: bool = False
) -> Any:
    """A closure running one tdfunc sharded step on this rank (state kept inside); ``units``:
    gathering block by block (``units=["transformer.h.0", ...]``)."""
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
    blocks = [f"transformer.h.{i}" for i in range(SIZES[size][0])] if units else None
    step = tdd.sharded_step(loss_fn, opt, donate=donate, units=blocks, **kw)
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
    """Paired rounds tdfunc / FSDP2 and the A/A control tdfunc / tdfunc; also tdfunc gathering
    block by block with donated shards (FSDP2's schedule, updating in place as FSDP2 does) /
    FSDP2."""
    torch.set_num_threads(1)
    a, a2 = _tdfunc_step(rank, compiled), _tdfunc_step(rank, compiled)
    b = _fsdp2_step(rank, compiled)
    out = {"ratios": _rounds(a, b, rounds, calls), "aa": _rounds(a, a2, rounds, calls)}
    u = _tdfunc_step(rank, compiled, donate=True, units=True)
    out["units_ratios"] = _rounds(u, b, rounds, calls)
    return out


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


def memory_ranks(rank: int, world: int, contender: str) -> dict[str, Any]:
    """Growth of the heap and of the resident set during one warm step, and the bytes sent
    by this rank (eager steps only)."""
    torch.set_num_threads(1)
    compiled = contender.endswith("_compiled")
    if contender.startswith("fsdp2"):
        run = _fsdp2_step(rank, compiled, "memory")
    else:
        run = _tdfunc_step(
            rank, compiled, "memory", donate="donated" in contender, units="units" in contender
        )
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
    heaps = [heap_peak(run) for _ in range(3)]
    heap = None if None in heaps else max(h for h in heaps if h is not None)
    return {"peak": rss, "heap": heap, "bytes": counter.total[0]}


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
    names = ["tdfunc", "tdfunc_donated", "tdfunc_units", "tdfunc_units_donated", "fsdp2"]
    mem = {
        c: launch(memory_ranks, WORLD, args=(c + suffix,), timeout=900, pg_timeout=600)
        for c in names
    }
    rss = {c: max(r["peak"] for r in res) / 2**20 for c, res in mem.items()}
    heap = {
        c: None if any(r["heap"] is None for r in res) else max(r["heap"] for r in res) / 2**20
        for c, res in mem.items()
    }
    sent = {c: None if suffix else max(r["bytes"] for r in res) for c, res in mem.items()}
    ratios, aa = timing["ratios"], timing["aa"]
    units = timing.get("units_ratios")
    info: dict[str, Any] = {
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
    }
    if units is not None:
        info.update(
            units_donated_ratio=statistics.median(units),
            units_donated_ratio_min=min(units),
            units_donated_ratio_max=max(units),
        )
    fsdp2_heap = heap["fsdp2"]
    for c in names:
        info[f"rss_peak_mib_{c}"] = rss[c]
        info[f"heap_peak_mib_{c}"] = heap[c]
        if c != "fsdp2":
            h = heap[c]
            info[f"heap_ratio_{c}"] = h / fsdp2_heap if h is not None and fsdp2_heap else None
        info[f"bytes_per_step_{c}"] = sent[c]
    benchmark.extra_info.update(info)

    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    lines = [
        f"\nsharded_train_gpt2 [{mode}] step time tdfunc / fsdp2: {info['ratio']:.3f} "
        f"[{info['ratio_min']:.3f}-{info['ratio_max']:.3f}]; A/A {info['aa']:.3f}"
    ]
    if units is not None:
        lines.append(
            f"  units + donated / fsdp2: {info['units_donated_ratio']:.3f} "
            f"[{info['units_donated_ratio_min']:.3f}-{info['units_donated_ratio_max']:.3f}]"
        )
    for c in names:
        lines.append(
            f"  {c}: heap peak {mib(heap[c])} MiB, resident-set peak {mib(rss[c])} MiB, "
            f"bytes/step {sent[c]}"
        )
    print("\n".join(lines))
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
