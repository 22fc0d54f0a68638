"""A dataset on disk: build it as a memory-mapped store, reopen it read-only, train from it.

1. ``tdfunc.memmap_like`` preallocates a read-write store (a directory with ``manifest.json``
   and one ``data.bin``) and a data pipeline fills it chunk by chunk, never holding the whole
   dataset in memory.
2. ``tdfunc.load(path)`` reopens it read-only: loading maps the file, nothing is read until a
   batch is indexed, and any write into it raises ``PermissionError``.
3. A compiled training step (``torch.compile(fullgraph=True)``: forward, gradients and a pure
   ``tdfunc.optim.sgd`` update) runs on batches indexed out of the store.

Run: ``python examples/memmap_dataset.py``
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F

import tdfunc

N, FEATURES, CLASSES, CHUNK, BATCH = 8192, 16, 4, 1024, 256


def build(path: str, seed: int = 0) -> None:
    """Write a synthetic classification dataset to ``path`` one chunk at a time."""
    g = torch.Generator().manual_seed(seed)
    spec = tdfunc.TensorDict(
        x=torch.empty(N, FEATURES), y=torch.empty(N, dtype=torch.long), batch_size=[N]
    )
    store = tdfunc.memmap_like(spec, path)  # zero-filled, mode="r+": writes go to the file
    w_true = torch.randn(FEATURES, CLASSES, generator=g)
    for start in range(0, N, CHUNK):
        x = torch.randn(CHUNK, FEATURES, generator=g)
        store["x"][start : start + CHUNK] = x
        store["y"][start : start + CHUNK] = (x @ w_true).argmax(-1)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tdfunc-dataset-") as tmp:
        train(os.path.join(tmp, "train"))


def train(path: str) -> None:
    """Build the dataset at ``path``, reopen it read-only and train a linear classifier."""
    build(path)
    data = tdfunc.load(path)  # read-only, O(number of leaves): nothing is read yet
    print(f"dataset at {path}: {sorted(os.listdir(path))}, batch_size={tuple(data.batch_size)}")
    print(f"leaf type {type(data['x']).__name__}, mode {data['x'].mode!r}")
    try:
        data["x"][0] = 0.0
    except PermissionError as e:
        print(f"a write into the read-only store is refused: {str(e)[:60]}...")

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    params = tdfunc.from_module(model).detach()
    opt = tdfunc.optim.sgd(lr=0.5)
    state = opt.init(params)

    def loss_fn(p: tdfunc.TensorDict, batch: tdfunc.TensorDict) -> torch.Tensor:
        return F.cross_entropy(tdfunc.functional_call(model, p, (batch["x"],)), batch["y"])

    @torch.compile(fullgraph=True)
    def train_step(p: tdfunc.TensorDict, state: tdfunc.TensorDict, batch: tdfunc.TensorDict):
        grads, loss = torch.func.grad_and_value(loss_fn)(p, batch)
        updates, state = opt.update(grads, state, p)
        return tdfunc.optim.apply_updates(p, updates), state, loss

    for epoch in range(3):
        total = 0.0
        for idx in torch.randperm(N).split(BATCH):
            batch = data[idx]  # reads these rows from the mapped file
            params, state, loss = train_step(params, state, batch)
            total += loss.item() * len(idx)
        print(f"epoch {epoch}: mean loss {total / N:.4f}")

    hits = tdfunc.functional_call(model, params, (data["x"],)).argmax(-1) == data["y"]
    acc = hits.float().mean().item()
    print(f"training accuracy {acc:.3f}")
    assert acc > 0.8, acc


if __name__ == "__main__":
    main()
