"""Torch functions over the batch dims of containers (``tdfunc._ops._batchdim``).

The oracle is torch on each leaf: every dim names a batch dim (a negative dim counts from
the end of the batch dims), an index tensor with one dim per batch dim is expanded over the
leaf's feature dims, and the result keeps each leaf's feature dims at the end.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import check_compiled, compare

import tdfunc
from tdfunc import _errors as E
from tdfunc._ops import _batchdim

BD = 2  # the batch dims of the corpus below


@tdfunc.tensorclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def make() -> tdfunc.TensorDict:
    """Batch (4, 3); leaves with no, one and two feature dims; a nested container with an
    extra batch dim of its own; a tensorclass."""
    g = torch.Generator().manual_seed(0)
    return tdfunc.TensorDict(
        a=torch.randn(4, 3, generator=g),
        b=torch.randn(4, 3, 2, generator=g),
        n=tdfunc.TensorDict(c=torch.randn(4, 3, 5, 2, generator=g), batch_size=[4, 3, 5]),
        p=Pair(
            x=torch.randn(4, 3, 2, generator=g), y=torch.randn(4, 3, generator=g), batch_size=[4, 3]
        ),
        batch_size=[4, 3],
    )


def per_leaf(td: Any, fn: Callable[[torch.Tensor], Any]) -> list[Any]:
    return [fn(x) for x in td.leaves()]


def al(t: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    """``t`` (one dim per batch dim) expanded over ``leaf``'s feature dims."""
    feat = leaf.shape[BD:]
    return t.reshape(t.shape + (1,) * len(feat)).expand(t.shape + feat)


IDX = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0]])  # (4, 2): picks along batch dim 1
ROWS = torch.tensor([3, 0, 0])

#: (id, call on the container, the same call on one leaf)
CASES: list[tuple[str, Callable[[Any], Any], Callable[[torch.Tensor], Any]]] = [
    # reductions
    ("sum", lambda t: torch.sum(t, 1), lambda x: torch.sum(x, 1)),
    ("sum_neg_keepdim", lambda t: torch.sum(t, -2, keepdim=True), lambda x: x.sum(0, keepdim=True)),
    ("mean_dims", lambda t: torch.mean(t, (0, 1)), lambda x: x.mean((0, 1))),
    ("nansum", lambda t: torch.nansum(t, 0), lambda x: torch.nansum(x, 0)),
    ("nanmean", lambda t: torch.nanmean(t, -1), lambda x: torch.nanmean(x, 1)),
    ("std_unbiased", lambda t: torch.std(t, 0, False), lambda x: torch.std(x, 0, False)),
    (
        "var_correction",
        lambda t: torch.var(t, dim=1, correction=0),
        lambda x: x.var(1, correction=0),
    ),
    ("logsumexp", lambda t: torch.logsumexp(t, 0), lambda x: torch.logsumexp(x, 0)),
    ("norm", lambda t: torch.norm(t, dim=1), lambda x: torch.norm(x, dim=1)),
    (
        "vector_norm",
        lambda t: torch.linalg.vector_norm(t, 3, dim=0),
        lambda x: torch.linalg.vector_norm(x, 3, dim=0),
    ),
    (
        "count_nonzero",
        lambda t: torch.count_nonzero(t > 0, 1),
        lambda x: torch.count_nonzero(x > 0, 1),
    ),
    ("argmax", lambda t: torch.argmax(t, 1), lambda x: torch.argmax(x, 1)),
    (
        "argmin",
        lambda t: torch.argmin(t, dim=-2, keepdim=True),
        lambda x: x.argmin(0, keepdim=True),
    ),
    ("amax", lambda t: torch.amax(t, (0, 1)), lambda x: torch.amax(x, (0, 1))),
    ("all", lambda t: torch.all(t > 0, 1), lambda x: torch.all(x > 0, 1)),
    ("max_dim", lambda t: torch.max(t, 1), lambda x: torch.max(x, 1)),
    (
        "min_dim_keepdim",
        lambda t: torch.min(t, dim=0, keepdim=True),
        lambda x: x.min(0, keepdim=True),
    ),
    ("median", lambda t: torch.median(t, 0), lambda x: torch.median(x, 0)),
    (
        "mode",
        lambda t: torch.mode(t.apply(torch.round), 0),
        lambda x: torch.mode(torch.round(x), 0),
    ),
    ("kthvalue", lambda t: torch.kthvalue(t, 2, 0), lambda x: torch.kthvalue(x, 2, 0)),
    (
        "quantile",
        lambda t: torch.quantile(t, torch.tensor([0.25, 0.5]), dim=0),
        lambda x: torch.quantile(x, torch.tensor([0.25, 0.5]), dim=0),
    ),
    ("aminmax", lambda t: torch.aminmax(t, dim=1), lambda x: torch.aminmax(x, dim=1)),
    # scans
    ("cumsum", lambda t: torch.cumsum(t, 0), lambda x: torch.cumsum(x, 0)),
    ("cumprod_neg", lambda t: torch.cumprod(t, -1), lambda x: torch.cumprod(x, 1)),
    ("cummax", lambda t: torch.cummax(t, 1), lambda x: torch.cummax(x, 1)),
    ("cummin", lambda t: torch.cummin(t, 0), lambda x: torch.cummin(x, 0)),
    ("logcumsumexp", lambda t: torch.logcumsumexp(t, 1), lambda x: torch.logcumsumexp(x, 1)),
    # softmax
    ("softmax", lambda t: torch.softmax(t, 0), lambda x: torch.softmax(x, 0)),
    ("F.softmax", lambda t: F.softmax(t, dim=-1), lambda x: F.softmax(x, dim=1)),
    ("F.log_softmax", lambda t: F.log_softmax(t, 0), lambda x: F.log_softmax(x, 0)),
    (
        "log_softmax_dtype",
        lambda t: torch.log_softmax(t, 1, torch.float64),
        lambda x: torch.log_softmax(x, 1, torch.float64),
    ),
    # sorting
    ("sort", lambda t: torch.sort(t, 1), lambda x: torch.sort(x, 1)),
    (
        "sort_default_dim",
        lambda t: torch.sort(t, descending=True),
        lambda x: torch.sort(x, 1, descending=True),
    ),
    ("argsort", lambda t: torch.argsort(t, dim=0), lambda x: torch.argsort(x, dim=0)),
    ("topk", lambda t: torch.topk(t, 2, dim=0), lambda x: torch.topk(x, 2, dim=0)),
    (
        "topk_default_dim",
        lambda t: torch.topk(t, 2, largest=False),
        lambda x: torch.topk(x, 2, 1, largest=False),
    ),
    # shape ops
    ("flip", lambda t: torch.flip(t, [0, -1]), lambda x: torch.flip(x, [0, 1])),
    ("roll", lambda t: torch.roll(t, 1, 0), lambda x: torch.roll(x, 1, 0)),
    ("roll2", lambda t: torch.roll(t, (1, 2), (0, 1)), lambda x: torch.roll(x, (1, 2), (0, 1))),
    ("rot90", lambda t: torch.rot90(t), lambda x: torch.rot90(x, 1, (0, 1))),
    ("narrow", lambda t: torch.narrow(t, 1, 1, 2), lambda x: torch.narrow(x, 1, 1, 2)),
    ("movedim", lambda t: torch.movedim(t, 0, 1), lambda x: torch.movedim(x, 0, 1)),
    ("moveaxis", lambda t: torch.moveaxis(t, -1, 0), lambda x: torch.moveaxis(x, 1, 0)),
    ("swapdims", lambda t: torch.swapdims(t, 0, 1), lambda x: torch.swapdims(x, 0, 1)),
    ("swapaxes", lambda t: torch.swapaxes(t, 1, 0), lambda x: torch.swapaxes(x, 1, 0)),
    (
        "repeat_interleave",
        lambda t: torch.repeat_interleave(t, 2, dim=1),
        lambda x: torch.repeat_interleave(x, 2, dim=1),
    ),
    (
        "repeat_interleave_tensor",
        lambda t: torch.repeat_interleave(t, torch.tensor([1, 0, 2, 1]), dim=0),
        lambda x: torch.repeat_interleave(x, torch.tensor([1, 0, 2, 1]), dim=0),
    ),
    ("tensor_split", lambda t: torch.tensor_split(t, 2, 1), lambda x: torch.tensor_split(x, 2, 1)),
    (
        "tensor_split_indices",
        lambda t: torch.tensor_split(t, [1, 3], dim=0),
        lambda x: torch.tensor_split(x, [1, 3], dim=0),
    ),
    ("repeat", lambda t: t.repeat(2, 1), lambda x: x.repeat(2, 1, *(1,) * (x.ndim - BD))),
    (
        "repeat_new_dim",
        lambda t: t.repeat(2, 1, 3),
        lambda x: x.repeat(2, 1, 3, *(1,) * (x.ndim - BD)),
    ),
    ("tile", lambda t: torch.tile(t, (2,)), lambda x: x.repeat(1, 2, *(1,) * (x.ndim - BD))),
    # index ops
    ("gather", lambda t: torch.gather(t, 1, IDX), lambda x: torch.gather(x, 1, al(IDX, x))),
    (
        "take_along_dim",
        lambda t: torch.take_along_dim(t, IDX, 1),
        lambda x: torch.take_along_dim(x, al(IDX, x), 1),
    ),
    (
        "index_select",
        lambda t: torch.index_select(t, 0, ROWS),
        lambda x: torch.index_select(x, 0, ROWS),
    ),
    (
        "scatter_value",
        lambda t: torch.scatter(t, 1, IDX, 0.5),
        lambda x: torch.scatter(x, 1, al(IDX, x), 0.5),
    ),
    (
        "scatter_add_self",
        lambda t: torch.scatter_add(t, 1, IDX, t.narrow(1, 0, 2)),
        lambda x: torch.scatter_add(x, 1, al(IDX, x), x.narrow(1, 0, 2)),
    ),
    (
        "scatter_reduce",
        lambda t: torch.scatter_reduce(t, 1, IDX, t.narrow(1, 0, 2), "amax"),
        lambda x: torch.scatter_reduce(x, 1, al(IDX, x), x.narrow(1, 0, 2), "amax"),
    ),
    # pad
    ("pad", lambda t: F.pad(t, (1, 2)), lambda x: F.pad(x, (0, 0) * (x.ndim - BD) + (1, 2))),
    (
        "pad_two_dims",
        lambda t: F.pad(t, (1, 0, 0, 1), value=-1.0),
        lambda x: F.pad(x, (0, 0) * (x.ndim - BD) + (1, 0, 0, 1), value=-1.0),
    ),
]


def _as_container(td: Any, parts: list[Any]) -> Any:
    """The expected container(s) from per-leaf results (a tuple of results per leaf gives a
    tuple of containers)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        feat = td.leaves()[0].ndim - BD
        bs = first.shape[: first.ndim - feat]
        it = iter(parts)
        return td.apply(lambda x: next(it), batch_size=bs)
    return tuple(_as_container(td, [p[j] for p in parts]) for j in range(len(first)))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_oracle_per_leaf(case: tuple[str, Any, Any]) -> None:
    _, on_td, on_leaf = case
    td = make()
    before = td.clone()
    got = on_td(td)
    want = _as_container(td, per_leaf(td, on_leaf))
    if isinstance(want, tuple):
        assert isinstance(got, tuple)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.batch_size == w.batch_size
            tdfunc.testing.assert_close(g, w)
    else:
        assert tdfunc.is_container(got)
        assert got.batch_size == want.batch_size
        tdfunc.testing.assert_close(got, want)
    tdfunc.testing.assert_close(td, before)  # the input is not modified
    leaves = got if tdfunc.is_container(got) else got[0]
    assert isinstance(leaves["p"], Pair)  # the tensorclass stays a tensorclass
    assert leaves["n"].batch_dims == leaves.batch_dims + 1  # its own extra batch dim kept


def test_named_tuples_hold_containers() -> None:
    td = make()
    r = torch.max(td, dim=1)
    assert isinstance(r, torch.return_types.max)
    assert r.values.batch_size == (4,)
    assert r.indices.batch_size == (4,)
    assert r.indices["b"].dtype == torch.int64
    v, i = torch.sort(td, 0)
    assert isinstance(torch.sort(td, 0), torch.return_types.sort)
    compare(torch.gather(td, 0, i.get("a")).get("a"), v.get("a"))


def test_whole_leaf_reductions_without_dim() -> None:
    td = make()
    for fn in (torch.sum, torch.amax, torch.mean, torch.argmax):
        got = fn(td)
        assert got.batch_size == ()
        for x, g in zip(td.leaves(), got.leaves()):
            compare(g, fn(x))
    # an explicit empty dim list names every batch dim (torch: every dim)
    got = torch.sum(td, dim=[])
    compare(got, torch.sum(td, (0, 1)))
    got = torch.amax(td)
    assert got.batch_size == ()
    assert got["b"].shape == ()


def test_zero_d_batch_takes_dim_0() -> None:
    td = tdfunc.TensorDict(a=torch.tensor([1.0, -2.0]), b=torch.tensor(3.0))
    compare(torch.sum(td, 0), td)
    compare(torch.cumsum(td, -1), td)
    assert torch.argmax(td, 0)["a"].tolist() == [0, 0]
    assert torch.sum(td, 0, keepdim=True).batch_size == ()
    with pytest.raises(IndexError):
        torch.sum(td, 1)


def test_no_leaves_keeps_the_batch_size() -> None:
    td = tdfunc.TensorDict(batch_size=[4, 3])
    assert torch.cumsum(td, 0).batch_size == (4, 3)
    assert torch.sum(td, 1).batch_size == (4,)
    assert torch.narrow(td, 0, 1, 2).batch_size == (2, 3)
    assert torch.max(td, 0).values.batch_size == (3,)


def test_dim_outside_the_batch_dims() -> None:
    td = make()
    for call in (
        lambda: torch.sum(td, 2),
        lambda: torch.cumsum(td, -3),
        lambda: torch.softmax(td, 2),
        lambda: torch.flip(td, [0, 2]),
        lambda: torch.gather(td, 2, IDX),
    ):
        with pytest.raises(IndexError, match=r"^dim -?\d is out of range for batch_size \(4, 3\)"):
            call()
    with pytest.raises(IndexError, match=r"dim 2 is out of range for batch_size \(4, 3\)"):
        torch.sum(td, 2)


def test_ops_that_need_a_dim() -> None:
    td = make()
    msg = E.BATCHDIM_NEEDS_DIM.format(op="roll", arg="dims", batch_size=(4, 3), value=[])
    with pytest.raises(ValueError, match=re.escape(msg)):
        torch.roll(td, 1)
    with pytest.raises(ValueError, match="must name batch dims"):
        torch.repeat_interleave(td, 2)
    with pytest.raises(ValueError, match="must name batch dims"):
        F.softmax(td)


def test_index_needs_one_dim_per_batch_dim() -> None:
    td = make()
    bad = torch.zeros(4, 2, 2, dtype=torch.long)
    msg = E.BATCHDIM_ALIGN.format(op="gather", arg="index", shape=(4, 2, 2), batch_size=(4, 3))
    with pytest.raises(ValueError, match=re.escape(msg)):
        torch.gather(td, 1, bad)


def test_masked_select_batch_mask() -> None:
    td = make()
    mask = torch.tensor(
        [[True, False, True], [False, False, False], [True, True, True], [False, True, False]]
    )
    got = torch.masked_select(td, mask)
    assert got.batch_size == (6,)
    compare(got, td[mask])
    for x, g in zip(td.leaves(), got.leaves()):
        compare(g, x[mask])
    msg = E.BATCHDIM_MASK.format(op="masked_select", shape=(3,), batch_size=(4, 3))
    with pytest.raises(ValueError, match=re.escape(msg)):
        torch.masked_select(td, mask[0])


@pytest.mark.parametrize("dtype", [torch.long, torch.uint8, torch.float32])
def test_masked_select_refuses_a_mask_that_is_not_bool(dtype: torch.dtype) -> None:
    """As torch does (``masked_select: expected BoolTensor for mask``): an integer mask of
    zeros is not a silent empty selection."""
    td = make()
    mask = torch.zeros(4, 3, dtype=dtype)
    with pytest.raises(TypeError) as info:
        torch.masked_select(td, mask)
    assert str(info.value) == E.BATCHDIM_MASK_DTYPE.format(op="masked_select", dtype=dtype)
    with pytest.raises(TypeError):
        td.masked_select(mask)


def test_expand_as() -> None:
    td = tdfunc.TensorDict(a=torch.randn(1, 3, 2), batch_size=[1, 3])
    other = tdfunc.TensorDict(b=torch.zeros(4, 3), batch_size=[4, 3])
    got = td.expand_as(other)
    assert got.batch_size == (4, 3)
    assert got["a"].shape == (4, 3, 2)
    compare(got["a"], td["a"].expand(4, 3, 2))
    assert td.expand_as(torch.zeros(4, 3)).batch_size == (4, 3)


def test_pad_errors() -> None:
    td = make()
    with pytest.raises(ValueError, match="mode 'reflect'"):
        F.pad(td, (1, 1), mode="reflect")
    with pytest.raises(ValueError, match="6 pad values do not fit 2 batch dims"):
        F.pad(td, (1, 1, 1, 1, 1, 1))


def test_repeat_needs_a_count_per_batch_dim() -> None:
    with pytest.raises(ValueError, match="repeats has 1 entries, but the container has 2 batch"):
        make().repeat(2)


def test_pad_sequence() -> None:
    a = tdfunc.TensorDict(x=torch.randn(2, 3), n={"y": torch.randn(2)}, batch_size=[2])
    b = tdfunc.TensorDict(x=torch.randn(4, 3), n={"y": torch.randn(4)}, batch_size=[4])
    for batch_first in (True, False):
        got = torch.nn.utils.rnn.pad_sequence([a, b], batch_first=batch_first, padding_value=-1.0)
        assert got.batch_size == ((2, 4) if batch_first else (4, 2))
        for key in ("x", ("n", "y")):
            want = torch.nn.utils.rnn.pad_sequence(
                [a.get(key), b.get(key)], batch_first=batch_first, padding_value=-1.0
            )
            compare(got.get(key), want)


# --------------------------------------------------------------------------------------
# methods: sugar over the same rules
# --------------------------------------------------------------------------------------
METHOD_CASES = [
    ("softmax", (0,), {}),
    ("cumsum", (1,), {}),
    ("flip", (0,), {}),
    ("flip_varargs", (0, 1), {}),
    ("max", (), {"dim": 0}),
    ("gather", (1, IDX), {}),
    ("logsumexp", (0,), {}),
    ("sort", (1,), {}),
    ("topk", (2,), {"dim": 0}),
    ("roll", (1, 0), {}),
    ("narrow", (1, 0, 2), {}),
    ("movedim", (0, 1), {}),
    ("tensor_split", (2,), {"dim": 1}),
    ("masked_select", (torch.ones(4, 3, dtype=torch.bool),), {}),
    ("tile", ((2, 1),), {}),
    ("argmax", (1,), {}),
    ("nansum", (0,), {}),
]


@pytest.mark.parametrize("case", METHOD_CASES, ids=[c[0] for c in METHOD_CASES])
def test_methods_are_the_torch_functions(case: tuple[str, tuple, dict]) -> None:
    name, args, kwargs = case
    name = name.removesuffix("_varargs")
    assert name in _batchdim.METHODS
    td = make()
    rule = _batchdim.rule_for(_batchdim.METHODS[name])
    compare(getattr(td, name)(*args, **kwargs), rule(td, *args, **kwargs))


def test_method_table_covers_the_families() -> None:
    for name in [
        "sum",
        "mean",
        "nansum",
        "nanmean",
        "prod",
        "amax",
        "amin",
        "std",
        "var",
        "logsumexp",
        "norm",
        "count_nonzero",
        "argmax",
        "argmin",
        "max",
        "min",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "logcumsumexp",
        "softmax",
        "log_softmax",
        "sort",
        "argsort",
        "topk",
        "flip",
        "roll",
        "rot90",
        "repeat",
        "repeat_interleave",
        "tile",
        "expand_as",
        "narrow",
        "movedim",
        "moveaxis",
        "swapdims",
        "swapaxes",
        "tensor_split",
        "gather",
        "scatter",
        "index_select",
        "take_along_dim",
        "masked_select",
    ]:
        assert name in _batchdim.METHODS, name


def test_rule_for() -> None:
    assert _batchdim.rule_for(torch.exp) is None
    assert _batchdim.rule_for(torch.add) is None
    for f in (
        torch.sum,
        torch.Tensor.sum,
        F.softmax,
        torch.special.logsumexp,
        torch.linalg.vector_norm,
        F.pad,
    ):
        assert callable(_batchdim.rule_for(f))


def test_reduce_keeps_its_signature() -> None:
    td = make()
    compare(td.prod(dim=(0, 1)), torch.prod(torch.prod(td, 1), 0))
    compare(td.std(0, correction=0), torch.std(td, 0, correction=0))
    compare((td > 0).all(dim=(0, 1)), torch.all(torch.all(td > 0, 1), 0))


# --------------------------------------------------------------------------------------
# torch.compile, vmap, grad: a sample of each family
# --------------------------------------------------------------------------------------
def _fresh() -> tuple[Any, ...]:
    return (make().apply(lambda x: x + torch.randn_like(x)), torch.randint(0, 3, (4, 2)))


FAMILY_SAMPLES: dict[str, Callable[..., Any]] = {
    "reduction": lambda t, i: (torch.sum(t, 0), torch.std(t, -1), torch.logsumexp(t, 0)),
    "max_dim": lambda t, i: tuple(torch.max(t, dim=1)),
    "scan": lambda t, i: (torch.cumsum(t, 0), torch.cummax(t, 1).values),
    "softmax": lambda t, i: (torch.softmax(t, 0), F.log_softmax(t, dim=-1)),
    "sorting": lambda t, i: (torch.sort(t, 1).values, torch.topk(t, 2, dim=0).indices),
    "shape": lambda t, i: (
        torch.flip(t, [0]),
        torch.roll(t, 1, 1),
        torch.movedim(t, 0, 1),
        *torch.tensor_split(t, 2, 0),
    ),
    "index": lambda t, i: (
        torch.gather(t, 1, i),
        torch.take_along_dim(t, i, 1),
        torch.index_select(t, 0, ROWS),
    ),
    "sizes_pad": lambda t, i: (torch.tile(t, (2,)), F.pad(t, (1, 0))),
}


@pytest.mark.parametrize("family", list(FAMILY_SAMPLES))
def test_compiled_fullgraph_one_frame(family: str) -> None:
    cnt = check_compiled(FAMILY_SAMPLES[family], _fresh)
    assert cnt.frame_count == 1


@pytest.mark.parametrize(
    "family", ["reduction", "scan", "softmax", "sorting", "shape", "index", "sizes_pad"]
)
def test_vmap_matches_a_loop(family: str) -> None:
    fn = FAMILY_SAMPLES[family]
    stacked = tdfunc.stack([make(), make().apply(torch.neg), make().apply(torch.exp)], 0)

    def one(t: Any) -> Any:
        return fn(t, IDX[:, :2])

    got = torch.vmap(one)(stacked)
    want = [one(x) for x in stacked.unbind(0)]
    for j, g in enumerate(got):
        compare(g, tdfunc.stack([w[j] for w in want], 0))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: torch.logsumexp(t, 0),
        lambda t: torch.softmax(t, 1),
        lambda t: torch.cumsum(t, 0),
        lambda t: torch.max(t, dim=0).values,
        lambda t: torch.gather(t, 1, IDX),
        lambda t: torch.flip(t, [1]),
        lambda t: F.pad(t, (1, 1)),
    ],
    ids=["logsumexp", "softmax", "cumsum", "max", "gather", "flip", "pad"],
)
def test_grad_matches_per_leaf(op: Callable[[Any], Any]) -> None:
    td = make()
    w = torch.linspace(0.5, 1.5, 7)

    def loss(t: Any) -> torch.Tensor:
        r = op(t)
        return sum((x * w[: x.shape[-1]]).sum() for x in r.leaves())

    g = torch.func.grad(loss)(td)
    leaves = [x.detach().requires_grad_() for x in td.leaves()]
    it = iter(leaves)
    loss(td.apply(lambda x: next(it))).backward()
    for a, b in zip(g.leaves(), leaves):
        compare(a, b.grad)


def test_container_must_be_the_input() -> None:
    td = make()
    msg = E.BATCHDIM_SELF.format(op="gather", typ="Tensor")
    with pytest.raises(TypeError, match=re.escape(msg)):
        torch.gather(torch.zeros(4, 3), 1, td)


def test_arguments_no_overload_takes() -> None:
    msg = E.BATCHDIM_NO_OVERLOAD.format(op="cumsum", args="TensorDict, str")
    with pytest.raises(TypeError, match=re.escape(msg)):  # torch's parser refuses it first
        _batchdim.rule_for(torch.cumsum)(make(), "x")


def test_layout_and_dtype_queries() -> None:
    td = make()
    assert td.layout == torch.strided
    assert tdfunc.TensorDict(batch_size=[2]).layout == torch.strided
    assert torch.is_floating_point(td) is True
    assert torch.is_floating_point(td.set("i", torch.zeros(4, 3, dtype=torch.long))) is False
    assert torch.is_complex(td) is False


def test_torch_masked_reduction_over_batch_dims() -> None:
    """``torch.masked`` reductions are Python code over torch functions: with a batch-shaped
    mask they reduce the batch dims of every leaf (the mask expanded over feature dims)."""
    td = make()
    mask = torch.rand(4, 3, generator=torch.Generator().manual_seed(1)) > 0.5
    got = torch.masked.amax(td, 1, mask=mask)
    for x, g in zip(td.leaves(), got.leaves()):
        compare(g, torch.masked.amax(x, 1, mask=al(mask, x)))


def test_top_level_tensorclass() -> None:
    p = Pair(x=torch.randn(5, 2), y=torch.randn(5), batch_size=[5])
    got = torch.cumsum(p, 0)
    assert isinstance(got, Pair)
    compare(got.x, torch.cumsum(p.x, 0))
    r = torch.sort(p, 0)
    assert isinstance(r.values, Pair)
    assert isinstance(r.indices, Pair)
    compare(r.indices.y, torch.sort(p.y, 0).indices)


DIFFERENTIAL_OPS: list[Callable[[Any, int], Any]] = [
    lambda t, d: torch.sum(t, d),
    lambda t, d: torch.logsumexp(t, d, keepdim=True),
    lambda t, d: torch.cumsum(t, d),
    lambda t, d: torch.softmax(t, d),
    lambda t, d: torch.argsort(t, d),
    lambda t, d: torch.flip(t, [d]),
    lambda t, d: torch.roll(t, 2, d),
    lambda t, d: torch.max(t, d).indices,
]


@pytest.mark.parametrize("seed", range(12))
def test_differential_random_shapes_and_dims(seed: int) -> None:
    """Random batch shapes, feature shapes and dims (negative too): each op on the container
    against the same op on every leaf with the dim counted over the batch dims."""
    g = torch.Generator().manual_seed(seed)
    bd = int(torch.randint(1, 4, (), generator=g))
    bs = [int(s) for s in torch.randint(1, 4, (bd,), generator=g)]
    feats = [[], [2], [3, 2]]
    td = tdfunc.TensorDict(
        {f"k{i}": torch.randn(*bs, *f, generator=g) for i, f in enumerate(feats)}, batch_size=bs
    )
    for op in DIFFERENTIAL_OPS:
        d = int(torch.randint(-bd, bd, (), generator=g))
        got = op(td, d)
        for x, y in zip(td.leaves(), got.leaves()):
            compare(y, op(x, d % bd))


def test_compiled_dynamic_batch_sizes_one_frame() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    def fn(td: Any, idx: torch.Tensor) -> Any:
        return (
            torch.sum(td, 0),
            torch.cumsum(td, 1),
            torch.gather(td, 1, idx),
            torch.max(td, 1).values,
            torch.flip(td, [0]),
        )

    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=True)
    for n in (4, 5, 7):
        td = tdfunc.TensorDict(
            a=torch.randn(n, 3, 2), n={"b": torch.randn(n, 3)}, batch_size=[n, 3]
        )
        idx = torch.randint(0, 3, (n, 2))
        compare(cfn(td, idx), fn(td, idx))
    assert cnt.frame_count == 1


#: the methods of these families that tensordict 0.15 has: (args, kwargs)
TENSORDICT_SAME: dict[str, tuple[tuple, dict]] = {
    "sum": ((0,), {}),
    "mean": ((1,), {}),
    "std": ((0,), {}),
    "var": ((0,), {}),
    "prod": ((0,), {}),
    "amax": ((0,), {}),
    "amin": ((1,), {}),
    "nansum": ((0,), {}),
    "nanmean": ((0,), {}),
    "logsumexp": ((0,), {}),
    "max": ((), {"dim": 0}),
    "min": ((), {"dim": 1}),
    "softmax": ((0,), {}),
    "flip": ((0,), {}),
    "roll": ((1, 0), {}),
    "repeat": ((2, 1), {}),
    "repeat_interleave": ((2,), {"dim": 0}),
    "tile": (((2, 1),), {}),
    "narrow": ((0, 1, 2), {}),
    "movedim": ((0, 1), {}),
    "swapdims": ((0, 1), {}),
    "tensor_split": ((2,), {"dim": 0}),
    "gather": ((1, IDX), {}),
    "masked_select": ((torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 1], [0, 1, 0]]).bool(),), {}),
}


@pytest.mark.parametrize("name", list(TENSORDICT_SAME))
def test_same_as_tensordict(name: str) -> None:
    tensordict = pytest.importorskip("tensordict")
    g = torch.Generator().manual_seed(3)
    data = {"a": torch.randn(4, 3, 2, generator=g), "n": {"b": torch.randn(4, 3, generator=g)}}
    ref = tensordict.TensorDict(data, batch_size=[4, 3])
    td = tdfunc.TensorDict(data, batch_size=[4, 3])
    args, kwargs = TENSORDICT_SAME[name]
    want = getattr(ref, name)(*args, **kwargs)
    got = getattr(td, name)(*args, **kwargs)
    wants = (want,) if isinstance(want, tensordict.TensorDict) else tuple(want)
    gots = (got,) if tdfunc.is_container(got) else tuple(got)
    assert len(gots) == len(wants)
    for w, x in zip(wants, gots):
        assert tuple(x.batch_size) == tuple(w.batch_size)
        for key in (("a",), ("n", "b")):
            compare(x.get(key), w.get(key))


def test_max_min_of_two_containers_are_pointwise() -> None:
    a = make()
    b = a.apply(torch.neg)
    for f in (torch.max, torch.min):
        got = f(a, b)
        assert got.batch_size == a.batch_size
        for x, y, g in zip(a.leaves(), b.leaves(), got.leaves()):
            compare(g, f(x, y))
    compare(a.max(b), torch.max(a, b))
