"""Train a small transformer sharded over 2 ranks, lose a rank, resume on 1 from the checkpoint.

The parameters are a TensorDict of DTensors: every matrix ``Shard(0)`` (FSDP's layout: each
rank holds a block of rows, uneven sizes allowed), every vector replicated (DDP's layout).
``tdfunc.distributed.sharded_step`` turns a loss function and a ``tdfunc.optim`` optimizer
into a pure step, ``params, state, loss = step(params, state, batch)``: it gathers the full
parameters, computes the gradient on this rank's part of the batch, reduce-scatters it back
to the shards (all-reduce for replicated leaves) and updates the shards.

The 2-rank job runs FSDP's schedule eagerly: ``units=["block"]`` gathers the transformer
block only when the forward reaches it and lets it go after it (it is gathered again for the
backward), and ``donate=True`` lets torch's fused AdamW write the new shards and state into
the ones passed in. The resumed job runs the step as one compiled graph per rank
(``compile=True``), collectives included: the same values either way.

The job checkpoints asynchronously every few steps (``save_checkpoint(async_save=True)``: the
next step runs while the files are written, and the save is committed after it); then rank 1
dies. A new job on 1 process loads
the last checkpoint, resharded to its own layout, and finishes the run. The losses of the
interrupted-and-resumed run are those of an uninterrupted run in one process.

Run: ``python examples/sharded_training.py``
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import tdfunc
from tdfunc import distributed as tdd
from tdfunc import optim
from tdfunc.testing import RankError, launch  # a small local launcher (real jobs use torchrun)

VOCAB, WIDTH, SEQ, BATCH, STEPS, SAVE_EVERY, DIES_AT = 13, 8, 6, 8, 8, 3, 5


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.block = torch.nn.TransformerEncoderLayer(
            WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, bias=False
        )
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(tokens)))


def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (the same on every process): learn next = 3 * token + 1."""
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return x, (3 * x + 1) % VOCAB


def loss_of(m: torch.nn.Module) -> Any:
    """``loss_fn(params, batch)``: the parameters are a TensorDict of plain tensors."""

    def loss_fn(params: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        logits = tdfunc.functional_call(m, params, (x,))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    return loss_fn


def optimizer() -> optim.GradientTransformation:
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2))


def setup(world: int) -> tuple[Any, Any, optim.GradientTransformation]:
    m = model()
    loss_fn, opt = loss_of(m), optimizer()
    mesh = init_device_mesh("cpu", (world,))
    params = tdd.distribute(
        tdfunc.from_module(m),
        mesh,
        lambda path, leaf: [Shard(0)] if leaf.dim() == 2 else [Replicate()],
    )
    return params, loss_fn, opt


def run(rank: int, world: int, path: str, start: int) -> list[float]:
    """Train from ``start`` (0: from scratch; else from the checkpoint at ``path``)."""
    params, loss_fn, opt = setup(world)
    state = opt.init(params)
    if start:
        # the checkpoint was written by another number of ranks: resharded to this layout
        loaded = tdd.load_checkpoint(path, tdfunc.TensorDict(params=params, state=state))
        params, state = loaded["params"], loaded["state"]
    if start == 0:  # eager, the block gathered on use, the shards updated in place
        # --8<-- [start:units]
        step = tdd.sharded_step(loss_fn, opt, units=["block"], donate=True)
        # --8<-- [end:units]
    else:  # one compiled graph per rank
        step = tdd.sharded_step(loss_fn, opt, compile=True, backend="aot_eager")
    losses, pending = [], None
    for i in range(start, STEPS):
        if world > 1 and rank == 1 and i == DIES_AT:
            os._exit(1)  # a machine is lost
        x, y = batch(i)
        params, state, loss = step(params, state, (x.chunk(world)[rank], y.chunk(world)[rank]))
        losses.append(loss.item())
        if pending is not None:
            pending.result()  # the save overlapped one step; it is committed now
            pending = None
        if (i + 1) % SAVE_EVERY == 0:
            ckpt = tdfunc.TensorDict(params=params, state=state)
            pending = tdd.save_checkpoint(path, ckpt, overwrite=True, async_save=True)
    if pending is not None:
        pending.result()
    return losses


def one_process() -> list[float]:
    """The same run in one process, without sharding: the reference."""
    m = model()
    loss_fn, opt = loss_of(m), optimizer()
    params = tdfunc.from_module(m)
    state = opt.init(params)
    losses = []
    for i in range(STEPS):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch(i))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
    return losses


def main() -> None:
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    try:
        launch(run, 2, args=(path, 0), timeout=300)
    except RankError as e:
        print(f"the 2-rank job failed at step {DIES_AT}: rank {e.rank} exited ({e.exitcode})")
    saved = (DIES_AT // SAVE_EVERY) * SAVE_EVERY  # the last checkpoint before the failure
    (resumed,) = launch(run, 1, args=(path, saved), timeout=300)
    reference = one_process()
    print(f"resumed on 1 rank from step {saved}: losses {[round(v, 4) for v in resumed]}")
    print(f"one process, never interrupted:     {[round(v, 4) for v in reference[saved:]]}")
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(reference[saved:]))
    print("same trajectory: ok")


if __name__ == "__main__":
    main()
