"""tensordict's top-level ``pad`` and ``pad_sequence`` (_ops/_pad.py) and ``td.neg()``, with
tensordict as the oracle: values, batch sizes (nested ones too), the mask entries, the
errors; compiled with fullgraph, one frame, no recompile on new values."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as E

tensordict = pytest.importorskip("tensordict")


def _sample(lib: Any, n: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    inner = lib.TensorDict(c=torch.randn(n, 4, 5, generator=g), batch_size=[n, 4])
    return lib.TensorDict(
        x=torch.randn(n, 3, generator=g),
        ids=torch.randint(0, 9, (n,), generator=g),
        n=inner,
        batch_size=[n],
    )


def samples(lib: Any, lengths: tuple[int, ...] = (2, 4, 3), seed: int = 0) -> list[Any]:
    return [_sample(lib, n, seed + i) for i, n in enumerate(lengths)]


def assert_same(got: Any, want: Any) -> None:
    """Every leaf and every nested batch size of ``got`` equals ``want``'s (tensordict)."""
    assert got.batch_size == want.batch_size
    for path, v in tdfunc._keys.walk(got):
        w = want[path]
        if tdfunc.is_container(v):
            assert v.batch_size == w.batch_size, path
        else:
            assert v.dtype == w.dtype, path
            torch.testing.assert_close(v, w, msg=lambda m, p=path: f"{p}: {m}")
    assert len(list(tdfunc._keys.walk(got))) == len(
        list(want.keys(include_nested=True, leaves_only=False))
    )


# ------------------------------------------------------------------ pad_sequence
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"return_mask": True},
        {"return_mask": "mm", "padding_side": "left"},
        {"return_mask": ("m", "k"), "padding_value": 2.5},
        {"padding_value": {"ids": 7, ("n", "c"): -1.0}},
        {"padding_side": "left", "padding_value": {"x": -100}},
    ],
    ids=str,
)
def test_pad_sequence_of_different_lengths_equals_tensordict(kwargs: dict) -> None:
    ours, theirs = samples(tdfunc), samples(tensordict)
    before = [s.clone() for s in ours]
    got = tdfunc.pad_sequence(ours, **kwargs)
    want = tensordict.pad_sequence(theirs, **kwargs)
    assert got.batch_size == (3, 4)
    assert got["n"].batch_size == (3, 4, 4)
    assert_same(got, want)
    for s, b in zip(ours, before):
        tdfunc.testing.assert_close(s, b)


@pytest.mark.parametrize("pad_dim", [1, -1])
def test_pad_sequence_along_a_feature_dim_equals_tensordict(pad_dim: int) -> None:
    """``pad_dim`` past the batch dims: the batch is not padded; the masks get the padded
    length after the batch dims."""

    def make(lib: Any) -> list[Any]:
        g = torch.Generator().manual_seed(3)
        return [lib.TensorDict(x=torch.randn(2, n, generator=g), batch_size=[2]) for n in (3, 5)]

    got = tdfunc.pad_sequence(make(tdfunc), pad_dim=pad_dim, return_mask=True)
    want = tensordict.pad_sequence(make(tensordict), pad_dim=pad_dim, return_mask=True)
    assert got.batch_size == (2, 2)
    assert got["masks", "x"].shape == (2, 2, 5)
    assert_same(got, want)


def test_pad_sequence_without_batch_dims_equals_tensordict() -> None:
    def make(lib: Any) -> list[Any]:
        return [lib.TensorDict(a=torch.ones(n, 8), b=torch.zeros(6, 8)) for n in (3, 5)]

    got = tdfunc.pad_sequence(make(tdfunc), return_mask=True)
    want = tensordict.pad_sequence(make(tensordict), return_mask=True)
    assert got.batch_size == (2,)
    assert got["masks", "a"].sum(-1).tolist() == [3, 5]
    assert_same(got, want)


def test_pad_sequence_of_tensorclasses_keeps_the_class() -> None:
    @tdfunc.tensorclass
    class Seq:
        obs: torch.Tensor
        rew: torch.Tensor

    a = Seq(obs=torch.ones(2, 3), rew=torch.ones(2), batch_size=[2])
    b = Seq(obs=torch.ones(4, 3), rew=torch.ones(4), batch_size=[4])
    out = tdfunc.pad_sequence([a, b], padding_value=-1.0)
    assert type(out) is Seq
    assert out.batch_size == (2, 4)
    assert out.rew.tolist() == [[1.0, 1.0, -1.0, -1.0], [1.0] * 4]
    with pytest.raises(TypeError, match=re.escape(E.PAD_SEQUENCE_MASK_CLASS[:40])):
        tdfunc.pad_sequence([a, b], return_mask=True)


def test_pad_sequence_errors() -> None:
    ours = samples(tdfunc)
    with pytest.raises(ValueError, match=re.escape(E.PAD_SEQUENCE_EMPTY)):
        tdfunc.pad_sequence([])
    with pytest.raises(ValueError, match=re.escape(E.PAD_SEQUENCE_SIDE.format(side="up"))):
        tdfunc.pad_sequence(ours, padding_side="up")
    with pytest.raises(TypeError, match=re.escape(E.PAD_SEQUENCE_OUT)):
        tdfunc.pad_sequence(ours, out=ours[0])
    with pytest.raises(KeyError, match=r"padding_value names 'zz', .* 'x', 'ids', \('n', 'c'\)"):
        tdfunc.pad_sequence(ours, padding_value={"zz": 1.0})
    with pytest.raises(KeyError):  # tensordict: the same
        tensordict.pad_sequence(samples(tensordict), padding_value={"zz": 1.0})
    with pytest.raises(IndexError, match=r"pad_dim=-4 .* 'x' of shape \(2, 3\)"):
        tdfunc.pad_sequence(ours, pad_dim=-4)
    bad = [
        tdfunc.TensorDict(x=torch.ones(2, 3), batch_size=[2]),
        tdfunc.TensorDict(x=torch.ones(3, 4), batch_size=[3]),
    ]
    with pytest.raises(ValueError, match=r"'x' have shapes \[\(2, 3\), \(3, 4\)\]"):
        tdfunc.pad_sequence(bad)
    with pytest.raises(RuntimeError):  # tensordict: its own error type for the same input
        tensordict.pad_sequence([tensordict.TensorDict(x.to_dict(), [len(x)]) for x in bad])
    with pytest.raises(tdfunc.KeysDifferError):
        tdfunc.pad_sequence([ours[0], ours[1].exclude("x")])


def test_pad_sequence_compiled_fullgraph_without_recompiling() -> None:
    cnt = CompileCounterWithBackend("eager")

    def f(xs: list[Any]) -> Any:
        return tdfunc.pad_sequence(xs, return_mask=True, padding_value={"ids": 7})

    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for seed in (0, 10):
        xs = samples(tdfunc, seed=seed)
        tdfunc.testing.assert_close(cf(xs), f(xs))
        assert_same(
            cf(xs),
            tensordict.pad_sequence(
                samples(tensordict, seed=seed), return_mask=True, padding_value={"ids": 7}
            ),
        )
    assert cnt.frame_count == 1


# ------------------------------------------------------------------ pad
@pytest.mark.parametrize(
    ("pad_size", "value"),
    [([0, 1, 0, 2], 0.0), ([1, 2], -1.0), ([2, 0, 0, 1], 3.0), ([-1, 0], 0.0), ([], 0.0)],
    ids=str,
)
def test_pad_equals_tensordict(pad_size: list, value: float) -> None:
    def make(lib: Any) -> Any:
        g = torch.Generator().manual_seed(0)
        inner = lib.TensorDict(c=torch.randn(3, 4, 2, 5, generator=g), batch_size=[3, 4, 2])
        return lib.TensorDict(
            a=torch.randn(3, 4, 1, generator=g),
            b=torch.randn(3, 4, generator=g),
            n=inner,
            batch_size=[3, 4],
        )

    td = make(tdfunc)
    before = td.clone()
    got = tdfunc.pad(td, pad_size, value=value)
    want = tensordict.pad(make(tensordict), pad_size, value=value)
    assert_same(got, want)
    tdfunc.testing.assert_close(td, before)


def test_pad_of_a_tensorclass_keeps_the_class() -> None:
    @tdfunc.tensorclass
    class P:
        x: torch.Tensor

    out = tdfunc.pad(P(x=torch.ones(2, 3), batch_size=[2]), [1, 0], value=5.0)
    assert type(out) is P
    assert out.x[:, 0].tolist() == [5.0, 1.0, 1.0]


def test_pad_errors() -> None:
    td = tdfunc.TensorDict(a=torch.ones(3, 4), batch_size=[3])
    for bad in ([1], [1, 1, 1, 1]):
        with pytest.raises(ValueError, match=re.escape(f"pad_size {bad}")):
            tdfunc.pad(td, bad)
        with pytest.raises(RuntimeError):  # tensordict: RuntimeError for the same sizes
            tensordict.pad(tensordict.TensorDict(a=torch.ones(3, 4), batch_size=[3]), bad)
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("pad(inplace=True)")):
        tdfunc.pad(td, [1, 1], inplace=True)


def test_pad_compiled_fullgraph_without_recompiling() -> None:
    cnt = CompileCounterWithBackend("eager")

    def f(td: Any) -> Any:
        return tdfunc.pad(td, [0, 1, 2, 0], value=-1.0)

    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        td = tdfunc.TensorDict(a=torch.randn(3, 4, 2, generator=g), batch_size=[3, 4])
        tdfunc.testing.assert_close(cf(td), f(td))
        assert cf(td).batch_size == (4, 6)
    assert cnt.frame_count == 1


# ------------------------------------------------------------------ neg
def test_neg_is_a_method_and_equals_tensordict() -> None:
    ours, theirs = _sample(tdfunc, 3, 0), _sample(tensordict, 3, 0)
    assert "neg" in tdfunc._base.LIFTED_METHODS
    assert_same(ours.neg(), theirs.neg())
    tdfunc.testing.assert_close(ours.neg(), -ours)
    tdfunc.testing.assert_close(torch.neg(ours), -ours)

    @tdfunc.tensorclass
    class P:
        x: torch.Tensor

    p = P(x=torch.ones(2), batch_size=[2])
    assert type(p.neg()) is P
    assert p.neg().x.tolist() == [-1.0, -1.0]


def test_neg_compiled_fullgraph_without_recompiling() -> None:
    cnt = CompileCounterWithBackend("eager")

    def f(td: Any) -> Any:
        return td.neg() + td.exp().neg()

    cf = torch.compile(f, backend=cnt, fullgraph=True)
    for seed in (0, 1):
        td = _sample(tdfunc, 3, seed).exclude("ids")
        tdfunc.testing.assert_close(cf(td), f(td))
    assert cnt.frame_count == 1
