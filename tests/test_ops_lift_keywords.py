"""Lifted torch functions called with the container as a keyword argument (``input=``,
``other=``, ``tensor=``, ``tensors=``), as torch's own signature names it: the same result as
the positional call, for every family (pointwise, reductions, scans, softmax, sorting, shape
and index ops, the functions with a container method), eager and compiled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, compare, snapshot
from torch.overrides import get_overridable_functions

import tdfunc
from tdfunc import _errors as E


def make() -> tdfunc.TensorDict:
    g = torch.Generator().manual_seed(0)
    return tdfunc.TensorDict(
        a=torch.rand(3, 4, generator=g) + 0.5,
        n=tdfunc.TensorDict(b=torch.rand(3, 2, generator=g) + 0.5, batch_size=[3, 2]),
        batch_size=[3],
    )


MASK = torch.tensor([True, False, True])
INDEX = torch.tensor([2, 0, 1])

#: name -> (the positional call, the same call with the container(s) by keyword)
CASES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    # pointwise
    "exp": (lambda td: torch.exp(td), lambda td: torch.exp(input=td)),
    "add_other": (lambda td: torch.add(td, td), lambda td: torch.add(input=td, other=td)),
    "mul_number": (lambda td: torch.mul(td, 2.0), lambda td: torch.mul(input=td, other=2.0)),
    "clamp": (
        lambda td: torch.clamp(td, 0.6, 1.2),
        lambda td: torch.clamp(input=td, min=0.6, max=1.2),
    ),
    "where": (
        lambda td: torch.where(MASK, td, 0.0),
        lambda td: torch.where(condition=MASK, input=td, other=0.0),
    ),
    "where_other_td": (
        lambda td: torch.where(MASK, td, td * 2),
        lambda td: torch.where(MASK, td, other=td * 2),
    ),
    "silu": (lambda td: F.silu(td), lambda td: F.silu(input=td)),
    # reductions
    "sum_dim": (lambda td: torch.sum(td, 0), lambda td: torch.sum(input=td, dim=0)),
    "sum_whole": (lambda td: torch.sum(td), lambda td: torch.sum(input=td)),
    "mean_keepdim": (
        lambda td: torch.mean(td, 0, True),
        lambda td: torch.mean(input=td, dim=0, keepdim=True),
    ),
    "max_dim": (lambda td: torch.max(td, 0), lambda td: torch.max(input=td, dim=0)),
    "max_other": (lambda td: torch.max(td, td * 2), lambda td: torch.max(input=td, other=td * 2)),
    "all": (lambda td: torch.all(td > 0), lambda td: torch.all(input=td > 0)),
    "logsumexp": (lambda td: torch.logsumexp(td, 0), lambda td: torch.logsumexp(input=td, dim=0)),
    # scans, softmax, sorting
    "cumsum": (lambda td: torch.cumsum(td, 0), lambda td: torch.cumsum(input=td, dim=0)),
    "cummax": (lambda td: torch.cummax(td, 0), lambda td: torch.cummax(input=td, dim=0)),
    "softmax": (lambda td: torch.softmax(td, 0), lambda td: torch.softmax(input=td, dim=0)),
    "F_softmax": (lambda td: F.softmax(td, 0), lambda td: F.softmax(input=td, dim=0)),
    "sort": (lambda td: torch.sort(td, 0), lambda td: torch.sort(input=td, dim=0)),
    # shape and index ops
    "flip": (lambda td: torch.flip(td, (0,)), lambda td: torch.flip(input=td, dims=(0,))),
    "roll": (lambda td: torch.roll(td, 1, 0), lambda td: torch.roll(input=td, shifts=1, dims=0)),
    "narrow": (
        lambda td: torch.narrow(td, 0, 1, 2),
        lambda td: torch.narrow(input=td, dim=0, start=1, length=2),
    ),
    "tile": (lambda td: torch.tile(td, (2,)), lambda td: torch.tile(input=td, dims=(2,))),
    "gather": (
        lambda td: torch.gather(td, 0, INDEX),
        lambda td: torch.gather(input=td, dim=0, index=INDEX),
    ),
    "masked_select": (
        lambda td: torch.masked_select(td, MASK),
        lambda td: torch.masked_select(input=td, mask=MASK),
    ),
    "pad": (lambda td: F.pad(td, (1, 0)), lambda td: F.pad(input=td, pad=(1, 0))),
    # the functions with a container method of their own
    "zeros_like": (
        lambda td: torch.zeros_like(td, dtype=torch.float64),
        lambda td: torch.zeros_like(input=td, dtype=torch.float64),
    ),
    "full_like": (
        lambda td: torch.full_like(td, 2.0),
        lambda td: torch.full_like(input=td, fill_value=2.0),
    ),
    "reshape": (
        lambda td: torch.reshape(td, (3, 1)),
        lambda td: torch.reshape(input=td, shape=(3, 1)),
    ),
    "transpose": (
        lambda td: torch.transpose(td.unsqueeze(1), 0, 1),
        lambda td: torch.transpose(input=td.unsqueeze(1), dim0=0, dim1=1),
    ),
    "split": (
        lambda td: torch.split(td, 2, 0),
        lambda td: torch.split(tensor=td, split_size_or_sections=2, dim=0),
    ),
    "unbind": (lambda td: torch.unbind(td, 0), lambda td: torch.unbind(input=td, dim=0)),
    "stack": (lambda td: torch.stack([td, td], 1), lambda td: torch.stack(tensors=[td, td], dim=1)),
}


def _on_tensors(kw_call: Callable[[Any], Any]) -> None:
    """torch itself takes the keyword spelling (on a plain tensor of the batch shape)."""
    kw_call(torch.rand(3) + 0.5)


@pytest.mark.parametrize("name", CASES)
def test_keyword_equals_positional(name: str) -> None:
    pos, kw = CASES[name]
    _on_tensors(kw)
    td = make()
    before = snapshot(td)
    got, want = kw(td), pos(td)
    compare(got, want)  # values, and the batch size of every container
    for g, w in zip(*((x if isinstance(x, tuple) else (x,)) for x in (got, want)), strict=True):
        if tdfunc.is_container(w):
            assert g.batch_size == w.batch_size
    compare(td, before)


@pytest.mark.parametrize(
    "name", ["exp", "where", "sum_dim", "max_dim", "cumsum", "flip", "gather", "zeros_like"]
)
def test_keyword_compiled(name: str) -> None:
    _, kw = CASES[name]
    cnt = check_compiled(kw, lambda: (make(),))
    assert cnt.frame_count == 1


def test_keyword_errors_name_the_dim_and_the_function() -> None:
    td = make()
    with pytest.raises(IndexError) as info:
        torch.sum(input=td, dim=3)
    assert str(info.value) == E.BATCH_DIM_RANGE.format(dim=3, batch_size=(3,), batch_dims=1)
    index = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="gather") as info2:
        torch.gather(input=td, dim=0, index=index)
    assert str(info2.value) == E.BATCHDIM_ALIGN.format(
        op="gather", arg="index", shape=(3, 2), batch_size=(3,)
    )
    with pytest.raises(TypeError, match=r"torch\.matmul does not lift"):
        torch.matmul(input=td, other=td)
    with pytest.raises(ValueError, match=r"masked_select: the mask has shape \(2,\)"):
        torch.masked_select(input=td, mask=torch.tensor([True, False]))


def _same(a: Any, b: Any) -> bool:
    if tdfunc.is_container(a) or isinstance(a, torch.Tensor):
        if type(a) is not type(b):
            return False
        if tdfunc.is_container(a):
            return a.batch_size == b.batch_size and all(
                _same(x, y) for x, y in zip(a.leaves(), b.leaves(), strict=True)
            )
        return bool(a.shape == b.shape and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.filterwarnings("ignore")
def test_every_function_taking_input_by_keyword() -> None:
    """Every overridable torch function that lifts a container given by position, and that
    torch itself calls as ``f(input=tensor)``, gives the same result with ``input=td``."""
    td = make()
    t = torch.rand(3, 4)
    checked, bad = 0, []
    for fns in get_overridable_functions().values():
        for f in fns:
            name = getattr(f, "__name__", str(f))
            if "save" in name or "load" in name or "empty" in name:  # files; uninitialised
                continue
            try:
                torch.manual_seed(0)
                pos = f(td)
                f(input=t)
            except Exception:  # not a one-argument function of its input: not this test's
                continue
            checked += 1
            try:
                torch.manual_seed(0)
                got = f(input=td)
            except Exception as e:
                bad.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if not _same(pos, got):
                bad.append(f"{name}: differs")
    assert checked > 100
    assert not bad, bad
