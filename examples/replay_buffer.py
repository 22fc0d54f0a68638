"""Replay buffers as values (``tdfunc.rl``), in memory and on disk.

1. A prioritised buffer: ``init`` / ``add`` / ``sample`` / ``update_priorities`` are pure
   functions of the state; compiled with the state donated (``tdfunc.compile(..., donate=0)``),
   ``add`` writes the new rows into the state's own memory.
2. The same buffer on disk: ``create_store`` / ``store_add`` write rows into the store's file
   in place, and a reader (here the same process; usually another one) samples from it.

Run: ``python examples/replay_buffer.py``
"""

from __future__ import annotations

import os
import tempfile

import torch

import tdfunc
from tdfunc import rl


def steps(first: int, n: int) -> tdfunc.TensorDict:
    """``n`` transitions whose values are their step numbers."""
    t = torch.arange(first, first + n)
    return tdfunc.TensorDict(
        obs=t[:, None].float().expand(n, 4).clone(),
        reward=t.float(),
        next={"done": t % 10 == 9},
        batch_size=[n],
    )


def in_memory() -> None:
    # --8<-- [start:memory]
    example = steps(0, 1)[0]  # one row: the shapes and dtypes
    state = rl.init(example, capacity=256, prioritized=True, alpha=0.6, beta=0.4)
    add = tdfunc.compile(rl.add, donate=0, backend="eager", fullgraph=True)
    obs = state.storage["obs"]
    for first in range(0, 1000, 50):  # 1000 rows into 256: the ring wraps around
        state = add(state, steps(first, 50))  # the rows are written into obs itself
    assert state.storage["obs"] is obs
    assert int(rl.size(state)) == 256

    batch, info = rl.sample(state, 32, torch.Generator().manual_seed(0))
    assert batch.batch_size == (32,)
    td_error = torch.rand(32)  # a learner's |TD error| per sampled row
    state = rl.update_priorities(state, info["index"], td_error)
    slices, _ = rl.sample_slices(state, num_slices=4, slice_len=5)  # inside one episode each
    assert slices.batch_size == (4, 5)
    # --8<-- [end:memory]
    print(f"in memory: {int(rl.size(state))} rows, weights {info['weight'][:4].tolist()}")


def on_disk(path: str) -> None:
    # --8<-- [start:disk]
    store = rl.create_store(path, steps(0, 1)[0], capacity=256)  # mode "r+"
    for first in range(0, 1000, 50):
        rl.store_add(store, steps(first, 50))  # rows first, then the counter: the commit
    reader = rl.open_store(path)  # read-only: what another process would do
    batch, info = rl.store_sample(reader, rl.sample, 32)  # whole rows, even while adding
    assert bool((batch["reward"] >= 1000 - 256).all())
    # --8<-- [end:disk]
    print(f"on disk: {int(rl.size(reader))} rows, sampled rows {info['index'][:4].tolist()}")


def main() -> None:
    in_memory()
    with tempfile.TemporaryDirectory(prefix="tdfunc-replay-") as tmp:
        on_disk(os.path.join(tmp, "buffer"))


if __name__ == "__main__":
    main()
