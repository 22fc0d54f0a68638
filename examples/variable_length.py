"""Variable-length data and text: RL episodes of different lengths and a batch of prompts with
token sequences, as jagged leaves (``torch.nested``) and non-tensor leaves of one container.

Run: ``python examples/variable_length.py`` (a few seconds, CPU).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import tdfunc

torch.manual_seed(0)

# --8<-- [start:rollouts]
# episodes of different lengths: each one a container over its own steps
episodes = [
    tdfunc.TensorDict(
        obs=torch.randn(n, 4),
        reward=torch.rand(n),
        task=f"reach-{i}",  # a non-tensor value shared by the episode
        batch_size=[n],
    )
    for i, n in enumerate([7, 3, 5])
]
batch = tdfunc.as_jagged(episodes)  # batch_size [3]: obs and reward are jagged leaves
assert batch["obs"].is_nested
assert batch["task"] == ("reach-0", "reach-1", "reach-2")

scaled = batch * 0.5  # elementwise ops run on every leaf; the text passes through
returns = scaled["reward"].sum(1)  # one return per episode: no padding, no mask
first_two = batch[:2]  # indexing follows the batch, text included
assert first_two["task"] == ("reach-0", "reach-1")
assert returns.shape == (3,)

padded = tdfunc.to_padded(batch, 0.0)  # dense [3, 7, 4] leaves and a mask per leaf
assert padded["obs"].shape == (3, 7, 4)
assert padded["masks", "reward"].sum(1).tolist() == [7, 3, 5]
# --8<-- [end:rollouts]

# --8<-- [start:prompts]
# a dataset of prompts: a token sequence and its text per sample
texts = ["hello", "a longer prompt here", "hi", "tokens of every length", "ok"]
data = [
    tdfunc.TensorDict(tok=torch.tensor([ord(c) % 64 for c in t]), prompt=t, score=torch.rand(()))
    for t in texts
]
loader = DataLoader(data, batch_size=2, collate_fn=tdfunc.collate_jagged)
embed = torch.nn.Embedding(64, 8)
seen = []
for prompts in loader:
    vectors = embed(prompts["tok"])  # a jagged [2, j, 8] tensor: torch's modules take it
    pooled = vectors.mean(1)  # the mean over each prompt's own tokens
    assert pooled.shape == (prompts.batch_size[0], 8)
    seen += prompts["prompt"]  # the texts, one per sample, in batch order
assert seen == texts

# the same batches, padded, with the masks beside them
padded_loader = DataLoader(
    data, batch_size=2, collate_fn=functools.partial(tdfunc.collate_jagged, pad=True)
)
first = next(iter(padded_loader))
assert first["tok"].shape == (2, 20)
assert first["masks", "tok"].sum().item() == 25
# --8<-- [end:prompts]

# --8<-- [start:shapes]
# fixed shapes for a compiled step: batches of similar lengths, padded to a multiple of 8
# (a handful of shapes over an epoch), or to one length with long rows truncated
lengths = [len(d["tok"]) for d in data]
grouped = DataLoader(
    data,
    batch_sampler=tdfunc.LengthGroupedSampler(lengths, batch_size=2),
    # keys: the leaves padded in every batch, also one whose rows have one length
    collate_fn=functools.partial(
        tdfunc.collate_jagged, pad=True, keys=["tok"], pad_to_multiple_of=8
    ),
)
assert {b["tok"].shape[1] for b in grouped} == {8, 24}
fixed = DataLoader(
    data,
    batch_size=2,
    collate_fn=functools.partial(
        tdfunc.collate_jagged,
        pad=True,
        keys=["tok"],
        length=16,
        max_length=16,
        padding_side="left",
    ),
)
assert {b["tok"].shape for b in fixed} == {torch.Size([2, 16]), torch.Size([1, 16])}
# --8<-- [end:shapes]

# --8<-- [start:store]
with tempfile.TemporaryDirectory() as tmp:
    tdfunc.save(batch, Path(tmp) / "episodes")  # values, offsets and the text (as JSON)
    back = tdfunc.load(Path(tmp) / "episodes")
    assert back["task"] == batch["task"]
    assert torch.equal(back["obs"].values(), batch["obs"].values())
# --8<-- [end:store]
print("variable-length data: ok")
