"""Train a sharded model on 2 ranks, checkpoint it, and evaluate it in a 1-process job.

Two CPU processes join a gloo group on 127.0.0.1. The parameters of a small regression model
live in a TensorDict of DTensors: ``w`` sharded row-wise over the 2 ranks (``Shard(0)``, 33
rows: uneven shards), ``b`` replicated. A few steps of plain SGD run on the shards (gradients
of DTensors are DTensors with the same placements), then ``save_checkpoint`` writes the
checkpoint with torch.distributed.checkpoint: each rank writes its own rows, ``b`` is written
once, the structure and checksums go along, and the commit is atomic.

Then this process, with no process group at all, loads the checkpoint: ``load_checkpoint``
reshards the 2 shards into full tensors (the same call on M ranks with a ``like`` of DTensors
would reshard to those placements), checks every byte it reads against the saved checksums,
and the model is evaluated; ``export_safetensors`` writes one file that any safetensors
reader can use.

Run: ``python examples/distributed_checkpoint.py``
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import tdfunc
from tdfunc import distributed as tdd
from tdfunc.testing import launch  # a small local launcher (real programs use torchrun)

FEATURES, STEPS, LR = 33, 25, 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The same regression problem on every process (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, FEATURES, generator=g)
    true_w = torch.randn(FEATURES, 1, generator=g)
    return x, x @ true_w + 0.5


def loss_of(params: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


def train(rank: int, world: int, path: str) -> dict[str, Any]:
    mesh = DeviceMesh("cpu", list(range(world)))
    x, y = data()
    init = tdfunc.TensorDict(w=torch.zeros(FEATURES, 1), b=torch.zeros(1))
    params = tdd.distribute(init, mesh, {"w": [Shard(0)]})  # b: replicated
    first = None
    for _ in range(STEPS):
        leaves = params.apply(lambda p: p.detach().requires_grad_())
        loss = loss_of(tdd.full_tensor(leaves, compile=False), x, y)
        loss.backward()
        first = first if first is not None else loss.item()
        params = tdfunc.TensorDict(
            w=leaves["w"].detach() - LR * leaves["w"].grad,
            b=leaves["b"].detach() - LR * leaves["b"].grad,
        )
    digest = tdd.save_checkpoint(path, params)  # keep it where the readers trust it
    return {
        "digest": digest,
        "rows_here": params["w"].to_local().shape[0],
        "first_loss": first,
        "last_loss": loss.item(),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        ranks = launch(train, 2, args=(path,), timeout=300, pg_timeout=60)
        for r, res in enumerate(ranks):
            print(
                f"rank {r}: {res['rows_here']} of {FEATURES} rows of w, loss "
                f"{res['first_loss']:.3f} -> {res['last_loss']:.4f}"
            )
        files = sorted(
            (f, os.path.getsize(os.path.join(root, f)))
            for root, _, names in os.walk(path)
            for f in names
            if f.endswith(".distcp")
        )
        print("data files:", ", ".join(f"{f} ({n} B)" for f, n in files))

        # one process, no process group: reshard the 2 shards into full tensors
        # the digest (kept apart from the files) makes the load refuse any other content
        params = tdd.load_checkpoint(path, digest=ranks[0]["digest"])
        print(f"digest {ranks[0]['digest'][:23]}... checked")
        x, y = data()
        with torch.no_grad():
            loss = loss_of(params, x, y).item()
        print(f"1-process job: w {tuple(params['w'].shape)}, eval loss {loss:.4f}")
        assert abs(loss - ranks[0]["last_loss"]) < 0.05 * ranks[0]["first_loss"]

        out = os.path.join(tmp, "model.safetensors")
        tdd.export_safetensors(path, out)
        back = tdfunc.load_safetensors(out)
        assert torch.equal(back["w"], params["w"])
        print(f"exported {sorted(back.keys())} to one safetensors file")


if __name__ == "__main__":
    main()
