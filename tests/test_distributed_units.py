"""The unit-by-unit gathering of sharded_step (tdfunc/distributed/_training/units.py), in one
process: "gathering" a unit returns full values computed from the local leaves (a world of
one), so the placeholders, the unit cache and the saved-tensor hooks are checked without
collectives (tests/test_distributed_training.py runs them on gloo ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc._compat import lazy_clone
from tdfunc.distributed._training.units import (
    REST,
    Placeholder,
    UnitGather,
    unit_of_leaves,
)


def _setup(unit_of: tuple[int, ...], shapes: list[tuple[int, ...]]) -> tuple[Any, list[Any]]:
    """A UnitGather over leaves of these shapes (values 1, 2, 3... per leaf), and a
    placeholder per gathered leaf (the local leaf itself for unit -1)."""
    local = [
        torch.full(s, float(i + 1), dtype=torch.float64).requires_grad_()
        for i, s in enumerate(shapes)
    ]
    calls: list[tuple[str, tuple[int, ...]]] = []

    def gather(ix: list[int]) -> list[torch.Tensor]:
        calls.append(("gather", tuple(ix)))
        return [local[i].detach() * 1.0 for i in ix]  # fresh memory, as an all-gather's

    def scatter(ix: list[int], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(("scatter", tuple(ix)))
        return list(grads)

    keys = [f"k{i}" for i in range(len(shapes))]
    g = UnitGather(gather, scatter, unit_of, local, keys, REST)
    given = [
        Placeholder.make(torch.Size(s), torch.float64, torch.device("cpu"), g, i)
        if u >= 0
        else local[i]
        for i, (s, u) in enumerate(zip(shapes, unit_of))
    ]
    g.calls = calls  # type: ignore[attr-defined]
    return g, given


def test_metadata_and_copies_do_not_gather() -> None:
    g, (p,) = _setup((1,), [(3, 2)])
    assert p.shape == (3, 2)
    assert p.dtype == torch.float64
    assert p.size() == (3, 2)
    assert p.size(0) == 3
    assert p.dim() == 2
    assert p.numel() == 6
    assert p.requires_grad is False
    assert p.device.type == "cpu"
    assert p.is_floating_point()
    assert isinstance(p._version, int)
    for copy in (lazy_clone(p), p.clone(), p.detach(), torch.clone(p)):
        assert type(copy) is Placeholder
        assert copy._leaf == 0
    assert repr(p) == "Placeholder(k0, shape=(3, 2), dtype=torch.float64)"
    assert g.gathers == [0, 0]
    assert g.calls == []


def test_an_operation_gathers_the_unit_once_and_the_next_unit_replaces_it() -> None:
    g, (a, b, c) = _setup((1, 1, 2), [(2,), (2,), (2,)])
    assert (a + 0).tolist() == [1.0, 1.0]
    assert torch.mul(b, 2).tolist() == [4.0, 4.0]  # the same unit: no new gather
    assert g.gathers == [1, 0]
    assert g.unit == 1
    assert (c * 1).tolist() == [3.0, 3.0]
    assert g.gathers == [2, 0]
    assert g.unit == 2
    assert set(g.values) == {2}  # unit 1 let go
    assert torch.stack([a, c]).tolist() == [[1.0, 1.0], [3.0, 3.0]]  # lists are replaced too
    assert g.calls == [("gather", (0, 1)), ("gather", (2,)), ("gather", (0, 1)), ("gather", (2,))]


def test_the_rest_is_gathered_once_and_kept() -> None:
    g, (r, u1, u2) = _setup((REST, 1, 2), [(2,), (2,), (2,)])
    for x in (r, u1, r, u2, r):
        _ = x + 0
    assert g.gathers == [3, 0]  # the rest once, each unit once
    assert set(g.pinned) == {0}


@pytest.mark.parametrize(
    "write",
    [
        lambda p: p.mul_(2),
        lambda p: p.add_(1),
        lambda p: p.__setitem__(0, 1.0),
        lambda p: torch.add(torch.ones(2), 1, out=p),
        lambda p: p.zero_(),
    ],
)
def test_a_write_to_a_placeholder_is_a_type_error_naming_the_key(write: Any) -> None:
    g, (p,) = _setup((1,), [(2,)])
    with pytest.raises(TypeError, match=r"sharded_step: the forward writes parameter k0 in place"):
        write(p)
    assert g.gathers == [0, 0]  # refused before anything is gathered
    assert g.local[0].tolist() == [1.0, 1.0]


def test_a_use_under_no_grad_does_not_cut_the_gradient_of_a_later_use() -> None:
    g, (r, u) = _setup((REST, 1), [(2,), (2,)])
    with torch.no_grad():  # e.g. a target computed from the same parameters
        target = (r * 2 + u).detach()
    loss = ((r + u) * target).sum()  # both units gathered again, now with a graph
    assert g.gathers == [4, 0]
    gr, gu = torch.autograd.grad(loss, g.local)
    assert gr.tolist() == gu.tolist() == target.tolist() == [4.0, 4.0]


def test_a_forward_under_vmap_gathers_and_differentiates() -> None:
    g, (w,) = _setup((1,), [(3,)])
    xs = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    out = torch.vmap(lambda x: (x * w).sum())(xs)
    (gw,) = torch.autograd.grad(out.sum(), g.local)
    assert out.tolist() == [3.0, 12.0]
    assert gw.tolist() == xs.sum(0).tolist()
    assert g.gathers == [1, 0]


def test_augmented_assignment_makes_a_new_tensor() -> None:
    g, (p,) = _setup((1,), [(2,)])
    q = p
    q += 1  # torch answers NotImplemented for the in-place add: Python computes q = q + 1
    assert type(q) is torch.Tensor
    assert q.tolist() == [2.0, 2.0]
    assert type(p) is Placeholder  # the parameter is not written
    assert g.local[0].tolist() == [1.0, 1.0]


def test_gradients_through_the_hooks_match_plain_autograd() -> None:
    """Forward and backward over two units and the rest with the saved-tensor hooks: every
    saved view of a unit's parameter becomes a recipe, the backward gathers each unit again,
    and the gradients are those of the same function on plain tensors."""
    shapes = [(4, 3), (3, 3), (3, 3), (3,)]
    g, given = _setup((REST, 1, 2, -1), shapes)
    x = torch.randn(5, 4, dtype=torch.float64)

    def f(w0: Any, w1: Any, w2: Any, b: Any) -> torch.Tensor:
        h = torch.tanh(x @ w0)
        h = torch.tanh(h @ w1.t())  # a saved view (the transpose)
        h = torch.nn.functional.linear(h, w2, b)
        return (h**2).sum()

    saved: list[str] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (saved.append(type(g.pack(t)).__name__), g.pack(t))[1], g.unpack
    ):
        loss = f(*given)
    g.end_forward()
    got = torch.autograd.grad(loss, g.local)
    assert "_Saved" in saved
    assert g.gathers == [3, 2]  # forward: rest, unit 1, unit 2; backward: units 2 and 1
    plain = [t.detach().clone().requires_grad_() for t in g.local]
    want = torch.autograd.grad(f(*plain), plain)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert g.back_unit is None  # the last unit's backward let it go


def test_a_module_through_functional_call_sees_full_values() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    params = tdfunc.from_module(m)
    keys = [k for k, _ in params.items(include_nested=True, leaves_only=True)]
    shapes = [tuple(v.shape) for v in params.values(True, True)]
    g, given = _setup((1, 1, 2, 2), shapes)
    for i, v in enumerate(params.values(True, True)):
        g.local[i].data.copy_(v)
    x = torch.randn(5, 3, dtype=torch.float64)
    lazy = tdfunc.TensorDict(dict(zip(["/".join(k) for k in keys], given)))
    out = tdfunc.functional_call(m, lazy.unflatten_keys("/"), (x,))
    torch.testing.assert_close(out, m(x), rtol=0, atol=0)
    assert g.gathers == [2, 0]


def test_unit_of_leaves() -> None:
    paths = [("h", "0", "w"), ("h", "0", "b"), ("h", "1", "w"), ("h", "10", "w"), ("wte",)]
    sharded = [True, False, True, True, True]
    # "h.1" is not a prefix of "h.10" (whole key parts); the longest prefix wins
    assert unit_of_leaves(paths, sharded, ["h.0", "h.1", "h"]) == (1, -1, 2, 3, REST)
    with pytest.raises(KeyError, match=r"no sharded parameter's key starts with unit 'h\.2'"):
        unit_of_leaves(paths, sharded, ["h.0", "h.2"])
    with pytest.raises(KeyError, match=r"unit 'h\.0\.b'"):
        unit_of_leaves(paths, sharded, ["h.0.b"])  # a replicated leaf is not gathered
