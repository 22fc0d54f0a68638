"""torch's default collate stacks TensorDicts and tensorclasses (DataLoader with workers)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import tdfunc
import tdfunc._collate
from tdfunc import TensorDict, tensorclass
from tdfunc.testing import assert_close


@tensorclass
class Step:
    obs: torch.Tensor
    reward: torch.Tensor


class Items(Dataset):
    """Item ``i``: a TensorDict, a tensorclass and a label, all made from ``i``."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        td = TensorDict(x=torch.full((3,), float(i)), nested={"y": torch.tensor(i)})
        return td, Step(torch.full((2,), float(i)), torch.tensor(float(-i))), i


def test_default_collate_stacks_nodes():
    items = [Items()[i] for i in range(4)]
    tds, steps, labels = default_collate(items)
    assert type(tds) is TensorDict
    assert tds.batch_size == (4,)
    assert_close(tds, tdfunc.stack([it[0] for it in items]))
    assert type(steps) is Step
    assert steps.batch_size == (4,)
    assert steps.reward.tolist() == [0.0, -1.0, -2.0, -3.0]
    assert labels.tolist() == [0, 1, 2, 3]
    assert items[0][0]["x"].tolist() == [0.0] * 3  # inputs unchanged


def test_mismatched_items_raise_value_error():
    a = TensorDict(x=torch.zeros(3))
    b = TensorDict(x=torch.zeros(4))
    with pytest.raises(ValueError, match=r"key 'x' has shape \(4,\) in element 1"):
        default_collate([a, b])


def test_dataloader_with_workers_just_works():
    dl = DataLoader(Items(), batch_size=32, num_workers=2, timeout=60)
    batches = list(dl)
    assert len(batches) == 2
    tds, steps, labels = batches[1]
    assert tds.batch_size == (32,)
    assert tds["nested", "y"].tolist() == list(range(32, 64))
    assert type(steps) is Step
    assert steps.obs.shape == (32, 2)
    assert labels.tolist() == list(range(32, 64))


def test_memory_mapped_items_collate_to_plain_tensors(tmp_path):
    tdfunc.save(TensorDict(x=torch.arange(12.0).reshape(6, 2), batch_size=[6]), tmp_path / "s")
    store = tdfunc.load(tmp_path / "s")
    batch = default_collate([store[i] for i in range(6)])
    assert type(batch["x"]) is torch.Tensor
    assert batch["x"].tolist() == store["x"].tolist()
