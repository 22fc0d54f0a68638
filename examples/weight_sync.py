"""Weight synchronisation: a trainer mesh pushes its parameters to an inference mesh every step.

Six CPU processes join one gloo group. Ranks 0-3 are the trainer, a ``[2, 2]`` mesh that shards
every weight matrix by rows and columns (``[Shard(0), Shard(1)]``; biases ``[Shard(0),
Replicate()]``). Ranks 4 and 5 are the inference workers, a ``[2]`` mesh that wants every
parameter sharded along its last dim (``[Shard(-1)]``). One :class:`tdfunc.distributed.Transfer`
is planned once (a handshake among the six ranks); each step the trainer updates its shards and
sends them, and each inference rank receives exactly the slices it keeps: one message per
(trainer rank, inference rank) pair, the minimum number of bytes, no full tensor anywhere.
The inference ranks check every value and run the model with the received parameters.

Run: ``python examples/weight_sync.py`` (a small local launcher starts the six processes), or
as a real job: ``python -m torch.distributed.run --standalone --nproc-per-node 6
examples/weight_sync.py``.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tdfunc import distributed as tdd
from tdfunc import from_module, functional_call

STEPS = 4
LR = 0.01


def make_model() -> nn.Module:
    """The same model on every rank (fixed seed)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 130), nn.ReLU(), nn.Linear(130, 10)
    )


def trainer_layout(path: Any, x: torch.Tensor) -> list[Any]:
    return [Shard(0), Shard(1)] if x.ndim == 2 else [Shard(0), Replicate()]


def inference_layout(path: Any, x: torch.Tensor) -> list[Any]:
    return [Shard(x.ndim - 1)]


def update(p: torch.Tensor, step: int) -> torch.Tensor:
    """A stand-in for an optimizer step (elementwise, so it runs on the local shards).

    Only basic arithmetic, which rounds each element the same way in every layout and every
    call: the exact comparison below checks the transfer, not torch's math kernels. (A
    process's first multi-threaded ``torch.sin`` on a large float tensor has returned values
    1.5e-4 off the same call made again: oneMKL picks a VML kernel on first use, and threads
    racing there can run a low-accuracy one, pytorch/pytorch#188792.)
    """
    return p - LR * (p * p - 1.0) * (step + 1)


def rank_main(rank: int, world: int) -> dict[str, Any]:
    train_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])  # every rank builds both meshes
    infer_mesh = DeviceMesh("cpu", [4, 5])
    model = make_model()
    params = from_module(model).apply(lambda p: p.detach())  # a snapshot of the weights
    if rank < 4:
        sharded = tdd.distribute(params, train_mesh, trainer_layout, src_data_rank=None)
        sync = tdd.Transfer(train_mesh, infer_mesh, like=sharded)
        times, sent = [], []
        for step in range(STEPS):
            sharded = sharded.apply(lambda p, s=step: update(p, s))
            t = time.perf_counter()
            sent.append(sync.send(sharded))
            times.append(time.perf_counter() - t)
        return {"role": "trainer", "sent": sent, "plan": sync.bytes.total, "times": times}

    sync = tdd.Transfer(train_mesh, infer_mesh, inference_layout)
    reference = params
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    worst, same_output, times = 0.0, True, []
    for step in range(STEPS):
        t = time.perf_counter()
        got = sync.recv()
        times.append(time.perf_counter() - t)
        reference = reference.apply(lambda p, s=step: update(p, s))
        for key, leaf in got.items(include_nested=True, leaves_only=True):
            expected = distribute_tensor(
                reference[key], infer_mesh, leaf.placements, src_data_rank=None
            ).to_local()
            worst = max(worst, (leaf.to_local() - expected).abs().max().item())
        full = tdd.full_tensor(got, compile=False)  # an inference step with the new weights
        with torch.no_grad():
            out = functional_call(model, full, x)
            same_output &= torch.equal(out, functional_call(model, reference, x))
    full_bytes = sum(p.numel() * p.element_size() for p in params.leaves())
    return {
        "role": "inference",
        "placements": str(got["2", "weight"].placements),
        "local_weight": list(got["2", "weight"].to_local().shape),
        "received": sync.bytes.received[rank],
        "plan": sync.bytes.total,
        "model_bytes": full_bytes,
        "messages": sync.bytes.messages,
        "max_abs_error": worst,
        "same_output": same_output,
        "times": times,
    }


def report(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        if r["role"] == "trainer":  # its send waits for the receivers, busy checking values
            print(f"rank {rank} (trainer): sent {r['sent'][0]} B per step")
            continue
        step_ms = ", ".join(f"{t * 1e3:.1f}" for t in r["times"])
        print(
            f"rank {rank} (inference): received {r['received']} B per step; receive times "
            f"[{step_ms}] ms (the first one includes compiling the pack and unpack graphs)"
        )
    inference = [r for r in results if r["role"] == "inference"]
    first = inference[0]
    print(
        f"model: {first['model_bytes']} B; plan: {first['plan']} B per step in "
        f"{first['messages']} messages (every element once); strategy 'full' would ship "
        f"{2 * first['model_bytes']} B (the whole model to each inference rank)"
    )
    for r in inference:
        assert r["max_abs_error"] == 0.0, r
        assert r["same_output"], r
        assert r["placements"] == "(Shard(dim=1),)", r
    assert first["plan"] == first["model_bytes"], "the plan moved more than the minimum"
    print(f"{STEPS} steps: every inference rank holds exactly the trainer's weights")


def main() -> None:
    if "RANK" in os.environ:  # started by torchrun: one process per rank, env:// rendezvous
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        out = rank_main(dist.get_rank(), dist.get_world_size())
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, out)
        if dist.get_rank() == 0:
            report(gathered)
        dist.destroy_process_group()
        return
    from tdfunc.testing import launch

    report(launch(rank_main, 6, timeout=300, pg_timeout=120))


if __name__ == "__main__":
    main()
