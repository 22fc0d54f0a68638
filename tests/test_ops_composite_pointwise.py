"""The few names the pointwise rule does not read from ATen tags
(``tdfunc._ops._pointwise._COMPOSITE_POINTWISE``) are checked here, so the list cannot claim
a function that is not elementwise: each output element must depend on the same position of
its inputs alone (perturb one input element, only that output element may change) and have
the input's shape."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tdfunc._ops import _pointwise


def _function(name: str) -> Any:
    for ns, attr in (
        (torch, name),
        (torch.special, name.removeprefix("special_")),
        (F, name),
        (F, name.replace("log_sigmoid", "logsigmoid")),
    ):
        f = getattr(ns, attr, None)
        if callable(f):
            return f
    raise AssertionError(f"{name}: no torch, torch.special or F function of that name")


def _inputs(name: str, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(7, generator=g) + 0.5
    y = torch.rand(7, generator=g) + 0.5
    if name in ("real", "imag", "conj", "isreal"):
        return (torch.complex(x, y),)
    return (x, y)[:n]


@pytest.mark.parametrize("name", sorted(_pointwise._COMPOSITE_POINTWISE))
def test_composite_pointwise_entries_are_elementwise(name: str) -> None:
    f = _function(name)
    args: tuple[torch.Tensor, ...] = ()
    for n in (1, 2):
        try:
            args = _inputs(name, n)
            base = f(*args)
            break
        except (TypeError, RuntimeError):
            continue
    else:
        raise AssertionError(f"{name}: callable with neither one nor two tensors")
    assert isinstance(base, torch.Tensor)
    assert base.shape == args[0].shape
    for i in range(len(args)):
        for j in range(args[i].shape[0]):
            moved = list(args)
            bump = torch.zeros_like(moved[i])
            bump[j] = 0.25 if not moved[i].is_complex() else 0.25 + 0.25j
            moved[i] = moved[i] + bump
            out = f(*moved)
            changed = (out != base).nonzero().flatten().tolist()
            assert set(changed) <= {j}, f"{name}: input {i}[{j}] changed outputs {changed}"
