"""The alignment rule for a plain tensor next to a container (_ops/_math.py, _ops/_pointwise.py):
a plain tensor operand is shaped like the batch (it broadcasts to the batch size, right-aligned
within it, and is expanded over each leaf's feature dims); a mask selects leading batch
positions. tensordict is the oracle for every row; then the rule under torch.compile,
torch.vmap and torch.func.grad."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as E

tensordict = pytest.importorskip("tensordict")

KEYS = (("a",), ("b",), ("sq",), ("n", "c"))


def _leaves(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(2, 3, 5, generator=g),
        "b": torch.randn(2, 3, generator=g),
        "sq": torch.randn(2, 3, 3, generator=g),  # a feature dim of the batch's last size
        "n": {"c": torch.randn(2, 3, 4, 2, generator=g)},
    }


def ours(seed: int = 0) -> tdfunc.TensorDict:
    d = _leaves(seed)
    d["n"] = tdfunc.TensorDict(d["n"], batch_size=[2, 3, 4])  # a nested batch dim of its own
    return tdfunc.TensorDict(d, batch_size=[2, 3])


def theirs(seed: int = 0) -> Any:
    d = _leaves(seed)
    d["n"] = tensordict.TensorDict(d["n"], batch_size=[2, 3, 4])
    return tensordict.TensorDict(d, batch_size=[2, 3])


def w_of(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) + 0.5


#: the operators and lifted pointwise functions with a plain tensor operand ``w``
OPS: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "td * w": operator.mul,
    "w * td": lambda td, w: w * td,
    "td + w": operator.add,
    "w - td": lambda td, w: w - td,
    "td / w": operator.truediv,
    "td ** w": lambda td, w: td.abs() ** w,
    "td > w": operator.gt,
    "td == w": operator.eq,
    "torch.mul(td, w)": torch.mul,
    "torch.maximum(td, w)": torch.maximum,
    "torch.maximum(w, td)": lambda td, w: torch.maximum(w, td),
    "torch.lerp(td, 2 * td, w)": lambda td, w: torch.lerp(td, 2 * td, w),
    "torch.clamp(td, min=w)": lambda td, w: torch.clamp(td, min=w),
    "td.sub(w)": lambda td, w: td.sub(w),
}

#: the tensordict spelling where it differs: tensordict takes no part in dispatch when a
#: plain tensor comes first in a torch function (``TypeError: Multiple dispatch failed``)
THEIRS: dict[str, Callable[[Any, torch.Tensor], Any]] = {
    "torch.maximum(w, td)": torch.maximum,
}

#: plain tensors that fit batch_size [2, 3]
FITS = [(3,), (1, 3), (2, 1), (2, 3), (), (1,)]
#: plain tensors that do not
MISFITS = [(2,), (5,), (2, 3, 5), (4, 3), (3, 1)]


def _assert_same(got: Any, want: Any) -> None:
    assert got.batch_size == want.batch_size
    for k in KEYS:
        torch.testing.assert_close(got[k], want[k])


@pytest.mark.parametrize("shape", FITS, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_a_plain_tensor_that_fits_the_batch_equals_tensordict(name: str, shape: tuple) -> None:
    td, ref, w = ours(), theirs(), w_of(shape)
    before = td.clone()
    got, want = OPS[name](td, w), THEIRS.get(name, OPS[name])(ref, w)
    _assert_same(got, want)
    assert got["n"].batch_size == (2, 3, 4)
    tdfunc.testing.assert_close(td, before)  # the input is left as it was


@pytest.mark.parametrize("shape", MISFITS, ids=str)
@pytest.mark.parametrize("name", list(OPS))
def test_a_plain_tensor_that_does_not_fit_raises_a_value_error(name: str, shape: tuple) -> None:
    w = w_of(shape)
    with pytest.raises(RuntimeError):  # tensordict: torch's bare broadcasting error
        THEIRS.get(name, OPS[name])(theirs(), w)
    with pytest.raises(ValueError, match="next to a container must broadcast") as ei:
        OPS[name](ours(), w)
    msg = str(ei.value)
    assert f"shape {tuple(shape)}" in msg
    assert "batch_size (2, 3)" in msg
    assert "td.apply(lambda x: " in msg


def test_the_error_message_in_full() -> None:
    td = tdfunc.TensorDict(a=torch.ones(2, 3, 5), batch_size=[2, 3])
    w = torch.ones(2)
    want = E.PLAIN_OPERAND.format(op="mul", shape=(2,), batch_size=(2, 3), spelling="x * w")
    with pytest.raises(ValueError, match=re.escape(want)):
        td * w
    want = E.PLAIN_OPERAND.format(op="sub", shape=(2,), batch_size=(2, 3), spelling="w - x")
    with pytest.raises(ValueError, match=re.escape(want)):
        td.__rsub__(w)
    # ``w - td`` reaches torch's ``Tensor.__sub__`` first, which hands the container on
    want = E.PLAIN_OPERAND.format(
        op="sub", shape=(2,), batch_size=(2, 3), spelling="torch.sub(w, x)"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        w - td
    want = E.PLAIN_OPERAND.format(
        op="maximum", shape=(2,), batch_size=(2, 3), spelling="torch.maximum(x, w)"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        torch.maximum(td, w)
    want = E.PLAIN_OPERAND.format(
        op="clamp", shape=(2,), batch_size=(2, 3), spelling="torch.clamp(x, min=w)"
    )
    with pytest.raises(ValueError, match=re.escape(want)):
        torch.clamp(td, min=w)


def test_coincident_sizes_follow_the_batch_not_the_last_dim() -> None:
    """A leaf ``[3, 3]`` (batch ``[3]``) times ``w`` ``[3]``: tensordict scales the rows, and
    so does tdfunc (torch alone would scale the columns)."""
    x, w = torch.rand(3, 3), torch.tensor([1.0, 2.0, 3.0])
    got = tdfunc.TensorDict(a=x, batch_size=[3]) * w
    want = tensordict.TensorDict(a=x, batch_size=[3]) * w
    torch.testing.assert_close(got["a"], want["a"])
    torch.testing.assert_close(got["a"], x * w[:, None])
    assert not torch.allclose(got["a"], x * w)


def test_more_dims_than_the_batch_is_refused_where_tensordict_grows_the_batch() -> None:
    """A ``w`` with leading 1s past the batch (``[1, 1, 3]`` on ``[2, 3]``): tensordict
    returns a container with a grown batch ``[1, 2, 3]``; tdfunc refuses any ``w`` with more
    dims than the batch (the result would not be shaped like the input)."""
    w = w_of((1, 1, 3))
    assert (theirs() * w).batch_size == (1, 2, 3)
    with pytest.raises(ValueError, match=r"shape \(1, 1, 3\)"):
        ours() * w


def test_numbers_and_zero_d_tensors_are_scalars() -> None:
    td, ref = ours(), theirs()
    for v in (2, 0.5, torch.tensor(3.0)):
        _assert_same(td * v, ref * v)
        _assert_same(v - td, v - ref)


def test_a_tensorclass_follows_the_rule() -> None:
    @tdfunc.tensorclass
    class P:
        x: torch.Tensor
        y: torch.Tensor

    p = P(x=torch.rand(3, 3), y=torch.rand(3), batch_size=[3])
    w = torch.tensor([1.0, 2.0, 3.0])
    out = p * w
    assert type(out) is P
    torch.testing.assert_close(out.x, p.x * w[:, None])
    torch.testing.assert_close(out.y, p.y * w)
    with pytest.raises(ValueError, match=r"batch_size \(3,\)"):
        p + torch.ones(2)


# ------------------------------------------------------------------ masks keep leading alignment
MASKS = {
    "torch.where(m, td, 0.0)": lambda td, m: torch.where(m, td, 0.0),
    "td.where(m, 0.0)": lambda td, m: td.where(m, 0.0),
    "td.masked_fill(m, 1.5)": lambda td, m: td.masked_fill(m, 1.5),
}


@pytest.mark.parametrize("shape", [(2,), (2, 3)], ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_a_mask_selects_leading_batch_positions_as_tensordict(name: str, shape: tuple) -> None:
    m = w_of(shape, 3) > 1.0
    _assert_same(MASKS[name](ours(), m), MASKS[name](theirs(), m))


def test_a_mask_and_a_plain_tensor_in_one_call() -> None:
    """``torch.where(m, td, w)``: the mask ``[2]`` selects batch dim 0, the plain ``w``
    ``[3]`` lines up with batch dim 1 (tensordict raises torch's broadcasting error there)."""
    td = ours()
    m, w = torch.tensor([True, False]), torch.tensor([1.0, 2.0, 3.0])
    got = torch.where(m, td, w)
    x = td["a"]
    torch.testing.assert_close(got["a"], torch.where(m[:, None, None], x, w[:, None]))
    assert got.batch_size == (2, 3)


# ------------------------------------------------------------------ compile, vmap, grad
@pytest.mark.parametrize(
    "name", ["td * w", "w - td", "torch.maximum(td, w)", "torch.lerp(td, 2 * td, w)", "td > w"]
)
def test_compiled_fullgraph_without_recompiling(name: str) -> None:
    op = OPS[name]
    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(op, backend=cnt, fullgraph=True)
    for seed in (0, 1):
        td, w = ours(seed), w_of((3,), seed + 5)
        tdfunc.testing.assert_close(f(td, w), op(td, w))
        _assert_same(f(td, w), op(theirs(seed), w))
    assert cnt.frame_count == 1


def test_compiled_error_keeps_its_type_and_message() -> None:
    """With ``fullgraph=True`` Dynamo reports the error as ``Unsupported`` with the message;
    without, the caller sees the ``ValueError`` itself."""
    want = E.PLAIN_OPERAND.format(op="mul", shape=(2,), batch_size=(2, 3), spelling="x * w")
    with pytest.raises(torch._dynamo.exc.Unsupported, match=re.escape(want[:60])):
        torch.compile(lambda t, w: t * w, backend="eager", fullgraph=True)(ours(), torch.ones(2))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=re.escape("shape (2,) next to a container")):
        torch.compile(lambda t, w: t * w, backend="eager")(ours(), torch.ones(2))


def test_compiled_scalar_and_same_structure_stay_on_the_fast_path() -> None:
    """Numbers and containers of one structure: one frame, no recompile, no alignment."""
    cnt = CompileCounterWithBackend("eager")

    def step(td: Any, g: Any, lr: float) -> Any:
        return td - lr * g + td * 2

    f = torch.compile(step, backend=cnt, fullgraph=True)
    for seed in (0, 1):
        td, g = ours(seed), ours(seed + 2)
        tdfunc.testing.assert_close(f(td, g, 0.1), step(td, g, 0.1))
    assert cnt.frame_count == 1


def test_under_vmap_the_batch_excludes_the_vmapped_dim() -> None:
    """``torch.vmap`` over dim 0 of the container and of ``w``: inside, the batch is ``[3]``
    and ``w`` is ``[3]``; the result equals the loop over the vmapped dim, and tensordict."""
    td = ours()
    w = w_of((2, 3))

    def f(t: Any, v: torch.Tensor) -> Any:
        assert t.batch_size == (3,)
        return t * v + torch.maximum(t, v)

    got = torch.vmap(f)(td, w)
    want = torch.stack([f(td[i], w[i]) for i in range(2)])
    tdfunc.testing.assert_close(got, want)
    ref = theirs()
    _assert_same(got, ref * w + torch.maximum(ref, w))
    # w not vmapped: [3] lines up with the inner batch [3] of every slice
    w3 = w_of((3,))
    got = torch.vmap(lambda t: t * w3)(td)
    _assert_same(got, ref * w3)


def test_under_grad_the_gradient_of_w_sums_over_feature_dims() -> None:
    td = ours()
    w = w_of((3,))

    def loss(v: torch.Tensor) -> torch.Tensor:
        out = td * v
        return sum(x.sum() for x in out.leaves())

    g = torch.func.grad(loss)(w)
    want = sum(x.reshape(-1, 3, *x.shape[2:]).sum(dim=[0, *range(2, x.ndim)]) for x in td.leaves())
    torch.testing.assert_close(g, want)


def test_exported_with_a_dynamic_batch() -> None:
    """``w`` shares the container's dynamic batch dim: the check holds for every size."""

    class M(torch.nn.Module):
        def forward(self, td: Any, w: torch.Tensor) -> Any:
            return td * w + torch.maximum(td, w)

    def make(n: int) -> tuple[Any, torch.Tensor]:
        td = tdfunc.TensorDict(obs=torch.randn(n, 3), r=torch.randn(n), batch_size=[n])
        return td, torch.rand(n)

    b = torch.export.Dim("b")
    td, w = make(4)
    shapes = (tdfunc.dynamic_batch_shapes(td, {0: b}), {0: b})
    ep = torch.export.export(M(), (td, w), dynamic_shapes=shapes)
    td8, w8 = make(8)
    out = ep.module()(td8, w8)
    assert out.batch_size == (8,)
    tdfunc.testing.assert_close(out, M()(td8, w8))
