"""Handing a container to PyTorch APIs that take a state dict: ``to_state_dict``."""

from __future__ import annotations

import collections.abc
import os

import pytest
import torch
from helpers import check_compiled
from torch import nn

import tdfunc
from tdfunc import TensorDict, tensorclass
from tdfunc import _errors as E


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 2)))


def test_load_state_dict_from_a_tensordict():
    src, dst = _net(), _net()
    for p in dst.parameters():
        nn.init.zeros_(p)
    params = tdfunc.from_module(src)
    assert isinstance(params["0"], TensorDict)  # nested by submodule
    sd = params.to_state_dict()
    assert type(sd) is dict
    assert list(sd) == list(src.state_dict())
    result = dst.load_state_dict(sd)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    # the tensors are shared, not copied
    assert sd["0.weight"] is params["0", "weight"]


def test_load_state_dict_from_a_store_and_a_safetensors_file(tmp_path):
    src = _net()
    params = tdfunc.from_module(src)
    tdfunc.save(params, tmp_path / "store")
    dst = _net()
    for p in dst.parameters():
        nn.init.zeros_(p)
    dst.load_state_dict(tdfunc.load(tmp_path / "store").to_state_dict())
    torch.testing.assert_close(dst[0].weight, src[0].weight)
    path = os.path.join(tmp_path, "m.safetensors")
    tdfunc.save_safetensors(params, path)
    dst2 = _net()
    dst2.load_state_dict(tdfunc.load_safetensors(path).to_state_dict())
    torch.testing.assert_close(dst2[2][0].bias, src[2][0].bias)


def test_a_container_is_not_a_mapping():
    # len() and iteration follow the batch dim, as for a tensor: registering it as a
    # collections.abc.Mapping would make mapping-generic code iterate rows as if they were keys
    td = TensorDict(a=torch.zeros(5, 2), b=torch.ones(5), batch_size=[5])
    assert not isinstance(td, collections.abc.Mapping)
    assert len(td) == 5
    with pytest.raises(TypeError, match="dict-like"):
        nn.Linear(2, 1).load_state_dict(td)
    assert set(td.to_state_dict()) == {"a", "b"}


@tensorclass
class Agent:
    policy: TensorDict
    value: torch.Tensor
    extra: torch.Tensor | None = None


def test_tensorclass_and_separators():
    tc = Agent(TensorDict(w=torch.ones(2)), torch.zeros(1))
    assert list(tc.to_state_dict()) == ["policy.w", "value"]  # None fields are skipped
    assert list(tc.to_state_dict(sep="/")) == ["policy/w", "value"]


def test_name_collisions_name_both_paths():
    td = TensorDict({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(ValueError, match="both become") as ei:
        td.to_state_dict()
    assert str(ei.value) == E.FLATTEN_COLLISION.format(
        what="to_state_dict", a="'a.b'", b="('a', 'b')", name="a.b", sep="."
    )
    assert set(td.to_state_dict(sep="/")) == {"a.b", "a/b"}


def test_compiled():
    def fn(td: TensorDict) -> dict[str, torch.Tensor]:
        return {k: v * 2 for k, v in td.to_state_dict().items()}

    check_compiled(fn, lambda: (TensorDict(a={"b": torch.randn(3)}, c=torch.randn(3)),))
