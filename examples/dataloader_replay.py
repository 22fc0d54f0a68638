"""Read a store on disk with DataLoader workers, whole minibatches at a time, and sample replay.

1. A dataset saved with ``tdfunc.save`` is read by a ``DataLoader`` with two worker processes.
   A ``BatchSampler`` hands each worker the indices of a whole minibatch, and the worker
   gathers them with one indexing of the memory-mapped store (one read per leaf, not one
   ``__getitem__`` and one collate per row). The store travels to the workers by reference:
   they map the same file.
2. A replay buffer: ``tdfunc.memmap_like`` preallocates a writable store on disk, new
   transitions are written into it in place (a ring buffer), and minibatches are sampled
   uniformly from the part written so far.

Run: ``python examples/dataloader_replay.py``
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import tdfunc

N, BATCH = 4096, 256


# --8<-- [start:dataset]
class Minibatches(Dataset):
    """A store on disk, indexed by whole minibatches: ``ds[[i, j, ...]]`` is one batch."""

    def __init__(self, path: str) -> None:
        self.data = tdfunc.load(path)  # read-only ("r"), nothing is read yet

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, rows: list[int]) -> tdfunc.TensorDict:
        return self.data[torch.tensor(rows)]  # one gather per leaf: plain tensors


def loader(path: str) -> DataLoader:
    ds = Minibatches(path)
    return DataLoader(
        ds,
        # the sampler yields lists of row indices; batch_size=None: no per-row collate
        sampler=BatchSampler(RandomSampler(ds), batch_size=BATCH, drop_last=True),
        batch_size=None,
        num_workers=2,
        timeout=60,
    )
    # --8<-- [end:dataset]


def read_with_workers(path: str) -> None:
    td = tdfunc.TensorDict(
        obs=torch.randn(N, 8),
        action=torch.randint(0, 4, (N,)),
        next={"obs": torch.randn(N, 8)},
        batch_size=[N],
    )
    tdfunc.save(td, path)
    # --8<-- [start:epoch]
    data = tdfunc.load(path)
    seen = 0
    for batch in loader(path):
        assert batch.batch_size == (BATCH,)
        # a row of the batch is the same row of the store (the obs are unique per row)
        row = int((data["obs"] == batch["obs"][0]).all(-1).nonzero())
        tdfunc.testing.assert_close(batch[0], data[row])
        seen += len(batch)
    # --8<-- [end:epoch]
    assert seen == N // BATCH * BATCH
    print(f"one epoch with 2 workers: {seen} rows in minibatches of {BATCH}")


def replay(path: str) -> None:
    capacity, chunk = 1024, 96
    # --8<-- [start:replay]
    spec = tdfunc.TensorDict(
        obs=torch.empty(capacity, 8), reward=torch.empty(capacity), batch_size=[capacity]
    )
    buffer = tdfunc.memmap_like(spec, path)  # zero-filled, writable ("r+"), on disk
    cursor, size = 0, 0

    def add(steps: tdfunc.TensorDict) -> None:
        """Write ``steps`` at the cursor, wrapping around: the oldest rows are replaced."""
        nonlocal cursor, size
        rows = (cursor + torch.arange(len(steps))) % capacity
        for key, value in steps.items(include_nested=True, leaves_only=True):
            buffer[key][rows] = value  # in place, into the mapped file
        cursor, size = (cursor + len(steps)) % capacity, min(size + len(steps), capacity)

    def sample(batch_size: int, generator: torch.Generator) -> tdfunc.TensorDict:
        rows = torch.randint(0, size, (batch_size,), generator=generator)
        return buffer[rows]  # reads only these rows

    g = torch.Generator().manual_seed(0)
    for step in range(20):  # 20 x 96 transitions: the buffer wraps around once
        steps = tdfunc.TensorDict(
            obs=torch.full((chunk, 8), float(step)),
            reward=torch.full((chunk,), float(step)),
            batch_size=[chunk],
        )
        add(steps)
        batch = sample(64, g)
    # --8<-- [end:replay]
    assert size == capacity
    assert batch.batch_size == (64,)
    assert set(batch["reward"].tolist()) <= {float(s) for s in range(20)}
    # after wrapping, the oldest transitions (steps 0 to 8) were overwritten
    assert buffer["reward"].min().item() == 9.0
    assert torch.equal(batch["obs"][:, 0], batch["reward"])
    print(f"replay buffer: {size} rows on disk, sampled {tuple(batch.batch_size)}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tdfunc-loader-") as tmp:
        read_with_workers(os.path.join(tmp, "dataset"))
        replay(os.path.join(tmp, "replay"))


if __name__ == "__main__":
    main()
