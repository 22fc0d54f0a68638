"""Batch-dim indexing and shape ops, combination, transforms, arithmetic, reductions."""

from __future__ import annotations

import pytest
import torch
from helpers import check_compiled, compare, snapshot

import tdfunc
from tdfunc import TensorDict
from tdfunc.testing import assert_close


def make_td() -> TensorDict:
    g = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "a": torch.randn(4, 3, 2, generator=g),
            "n": TensorDict(
                {"c": torch.randn(4, 3, 1, 5, generator=g), "i": torch.arange(12).reshape(4, 3, 1)},
                batch_size=[4, 3, 1],
            ),
            "e": torch.randn(4, 3, generator=g),
        },
        batch_size=[4, 3],
    )


def leafwise(td, fn):
    """Reference: the same batch-dim op applied leaf by leaf."""
    return [fn(x) for x in td.leaves()]


# ------------------------------------------------------------------ indexing
@pytest.mark.parametrize(
    ("idx", "bs"),
    [
        (0, (3,)),
        (-1, (3,)),
        (slice(1, 3), (2, 3)),
        ((slice(None), 1), (4,)),
        ((0, 2), ()),
        (None, (1, 4, 3)),
        ((Ellipsis, 0), (4,)),
        ((None, Ellipsis, None), (1, 4, 3, 1)),
        (torch.tensor([0, 2, 3]), (3, 3)),
        ([1, 0], (2, 3)),
        ((slice(None), torch.tensor([2, 0])), (4, 2)),
        (torch.tensor([True, False, True, False]), (2, 3)),
    ],
)
def test_indexing(idx, bs):
    td = make_td()
    out = td[idx]
    assert out.batch_size == torch.Size(bs)
    norm = idx if not isinstance(idx, list) else torch.tensor(idx)
    ell_free = {
        (Ellipsis, 0): (slice(None), 0),
        (None, Ellipsis, None): (None, slice(None), slice(None), None),
    }.get(idx if isinstance(idx, tuple) and Ellipsis in idx else None, norm)
    expected = [x[ell_free] for x in td.leaves()]
    for got, exp in zip(out.leaves(), expected):
        assert torch.equal(got, exp)
    # nested node keeps its extra batch dim
    assert out["n"].batch_size == out.batch_size + torch.Size([1])


def test_bool_mask_2d():
    td = make_td()
    mask = td["e"] > 0
    out = td[mask]
    assert out.batch_size == torch.Size([int(mask.sum())])
    assert torch.equal(out["a"], td["a"][mask])


def test_indexing_past_batch_dims():
    td = make_td()
    with pytest.raises(IndexError, match=r"too many indices.*batch_size \(4, 3\)"):
        td[0, 0, 0]
    with pytest.raises(IndexError, match="too many indices"):
        td[..., 0, 0, 0]
    with pytest.raises(IndexError, match="too many indices"):
        td[torch.ones(4, 3, 2, dtype=torch.bool)]
    with pytest.raises(IndexError, match="single ellipsis"):
        td[..., ...]


# ------------------------------------------------------------------ shape ops
@pytest.mark.parametrize(
    ("op", "leaf_fn", "bs"),
    [
        (lambda t: t.reshape(12), lambda x: x.reshape(12, *x.shape[2:]), (12,)),
        (lambda t: t.reshape(-1, 2), lambda x: x.reshape(6, 2, *x.shape[2:]), (6, 2)),
        (lambda t: t.reshape((2, 6)), lambda x: x.reshape(2, 6, *x.shape[2:]), (2, 6)),
        (lambda t: t.view(3, 4), lambda x: x.view(3, 4, *x.shape[2:]), (3, 4)),
        (lambda t: t.permute(1, 0), lambda x: x.permute(1, 0, *range(2, x.ndim)), (3, 4)),
        (lambda t: t.transpose(0, -1), lambda x: x.transpose(0, 1), (3, 4)),
        (lambda t: t.unsqueeze(1), lambda x: x.unsqueeze(1), (4, 1, 3)),
        (lambda t: t.unsqueeze(-1), lambda x: x.unsqueeze(2), (4, 3, 1)),
        (lambda t: t.unsqueeze(0).squeeze(), lambda x: x, (4, 3)),
        (lambda t: t.unsqueeze(0).squeeze(0), lambda x: x, (4, 3)),
        (lambda t: t.squeeze(0), lambda x: x, (4, 3)),
        (lambda t: t.flatten(), lambda x: x.flatten(0, 1), (12,)),
        (lambda t: t.unflatten(0, (2, 2)), lambda x: x.unflatten(0, (2, 2)), (2, 2, 3)),
        (lambda t: t.expand(2, 4, 3), lambda x: x.expand(2, *x.shape), (2, 4, 3)),
        (lambda t: t[:, :1].expand(4, 3), lambda x: x[:, :1].expand(4, 3, *x.shape[2:]), (4, 3)),
    ],
)
def test_shape_ops(op, leaf_fn, bs):
    td = make_td()
    before = td.clone()
    out = op(td)
    assert out.batch_size == torch.Size(bs)
    for got, exp in zip(out.leaves(), leafwise(td, leaf_fn)):
        assert torch.equal(got, exp)
    assert out["n"].batch_size == out.batch_size + torch.Size([1])
    assert_close(td, before)


def test_shape_op_errors():
    td = make_td()
    with pytest.raises(IndexError, match=r"dim 2 is out of range.*batch_size \(4, 3\)"):
        td.transpose(0, 2)
    with pytest.raises(IndexError, match="out of range"):
        td.unsqueeze(4)
    with pytest.raises(RuntimeError, match="number of dims don't match"):
        td.permute(0)
    with pytest.raises(RuntimeError, match="not a permutation"):
        td.permute(0, 0)
    with pytest.raises(RuntimeError, match="must be greater or equal"):
        td.expand(4)
    with pytest.raises(RuntimeError):
        td.reshape(5)


# ------------------------------------------------------------------ combination
def test_stack_cat_unbind_split_chunk():
    td = make_td()
    s = tdfunc.stack([td, td * 2], dim=1)
    assert s.batch_size == (4, 2, 3)
    assert torch.equal(s["a"][:, 1], td["a"] * 2)
    assert s["n"].batch_size == (4, 2, 3, 1)
    assert torch.stack([td, td]).batch_size == (2, 4, 3)
    c = tdfunc.cat([td, td[:1]], dim=0)
    assert c.batch_size == (5, 3)
    assert torch.equal(c["e"][4], td["e"][0])
    assert torch.cat([td, td], dim=1).batch_size == (4, 6)
    parts = td.unbind(1)
    assert len(parts) == 3
    assert parts[2].batch_size == (4,)
    assert torch.equal(parts[2]["n", "c"], td["n", "c"][:, 2])
    assert len(torch.unbind(td, 0)) == 4
    sp = td.split([1, 3])
    assert [p.batch_size for p in sp] == [(1, 3), (3, 3)]
    sp2 = td.split(2, dim=1)
    assert [p.batch_size for p in sp2] == [(4, 2), (4, 1)]
    assert [p.batch_size for p in torch.split(td, 3)] == [(3, 3), (1, 3)]
    ch = td.chunk(3, dim=0)
    assert [p.batch_size for p in ch] == [(2, 3), (2, 3)]
    assert_close(tdfunc.cat(list(td.chunk(2))), td)
    assert_close(tdfunc.stack(td.unbind(0)), td)


def test_stack_cat_errors():
    td = make_td()
    with pytest.raises(ValueError, match=r"structures differ.*missing keys \['e'\]"):
        tdfunc.stack([td, td.exclude("e")])
    with pytest.raises(ValueError, match="extra keys \\['z'\\]"):
        tdfunc.cat([td, td.set("z", torch.zeros(4, 3))])
    with pytest.raises(ValueError, match="element 1 has batch_size \\(2, 3\\)"):
        tdfunc.stack([td, td[:2]])
    with pytest.raises(ValueError, match="element 1 has batch_size"):
        tdfunc.cat([td, td[:, :2]], dim=0)
    with pytest.raises(ValueError, match="key 'a' has shape \\(4, 3, 7\\)"):
        tdfunc.stack([td, td.replace(a=torch.zeros(4, 3, 7))])
    with pytest.raises(ValueError, match="non-empty"):
        tdfunc.stack([])


# ------------------------------------------------------------------ transforms
def test_apply_named_apply_to_clone():
    td = make_td()
    out = td.apply(lambda x: x * 2)
    assert torch.equal(out["a"], td["a"] * 2)
    assert out["n", "i"].dtype == torch.int64
    two = td.apply(lambda x, y: x + y, td)
    assert_close(two, td * 2)
    s = td.apply(lambda x: x.sum(0), batch_size=[3])
    assert s.batch_size == (3,)
    assert s["n"].batch_size == (3, 1)
    with pytest.raises(ValueError, match="after apply"):
        td.apply(lambda x: x.sum(0))
    with pytest.raises(TypeError, match="produced int"):
        td.apply(lambda x: 3)
    with pytest.raises(KeyError, match="missing keys"):
        td.apply(torch.add, td.exclude("a"))
    seen = []
    out = td.named_apply(lambda p, x: (seen.append(p), x + 1)[1])
    assert seen == [("a",), ("n", "c"), ("n", "i"), ("e",)]
    assert torch.equal(out["n", "i"], td["n", "i"] + 1)
    d = td.to(torch.float64)
    assert all(x.dtype == torch.float64 for x in d.leaves())
    assert td.to("cpu").device == torch.device("cpu")
    assert td.double()["a"].dtype == torch.float64
    assert td.double().float()["a"].dtype == torch.float32
    c = td.clone()
    assert c["a"] is not td["a"]
    assert torch.equal(c["a"], td["a"])
    r = td.apply(lambda x: x.float().requires_grad_())
    assert not r.detach()["a"].requires_grad
    t = td.permute(1, 0)
    assert t.contiguous()["a"].is_contiguous()
    assert not t["a"].is_contiguous()


def test_like_functions():
    td = make_td()
    assert torch.equal(tdfunc.zeros_like(td)["a"], torch.zeros(4, 3, 2))
    assert torch.equal(tdfunc.ones_like(td)["n", "i"], torch.ones(4, 3, 1, dtype=torch.int64))
    assert tdfunc.empty_like(td, dtype=torch.float16)["a"].dtype == torch.float16
    assert torch.equal(tdfunc.full_like(td, 7)["e"], torch.full((4, 3), 7.0))
    assert torch.equal(torch.zeros_like(td)["e"], torch.zeros(4, 3))


def test_consolidate():
    td = make_td().set("flag", torch.ones(4, 3, dtype=torch.bool))
    c = td.consolidate()
    assert_close(c, td)
    ptrs = {x.untyped_storage().data_ptr() for x in c.leaves()}
    assert len(ptrs) == 1
    assert all(x.data_ptr() % 8 == 0 for x in c.leaves())
    assert_close(TensorDict(batch_size=[2]).consolidate(), TensorDict(batch_size=[2]))


# ------------------------------------------------------------------ arithmetic
def test_arithmetic_numbers_tensors_tds():
    td = make_td()
    f = td.exclude("n")
    t = torch.randn(3, 1)  # broadcasts against leaves of shape (4, 3)... per leaf
    assert_close(f + 1, f.apply(lambda x: x + 1))
    assert_close(1 + f, f + 1)
    assert_close(f - 2, f.apply(lambda x: x - 2))
    assert_close(2 - f, f.apply(lambda x: 2 - x))
    assert_close(f * 3, f.apply(lambda x: x * 3))
    assert_close(f / 4, f.apply(lambda x: x / 4))
    assert_close(4 / (f.abs() + 1), f.apply(lambda x: 4 / (x.abs() + 1)))
    assert_close(f // 2, f.apply(lambda x: x // 2))
    assert_close(f % 2, f.apply(lambda x: x % 2))
    assert_close(f**2, f.apply(lambda x: x**2))
    assert_close(2**f, f.apply(lambda x: 2**x))
    assert_close(-f, f.apply(torch.neg))
    assert_close(abs(f), f.apply(torch.abs))
    assert_close(f + f, f.apply(lambda x: x * 2))
    assert_close(f * f, f.apply(lambda x: x * x))
    assert_close(f - f, tdfunc.zeros_like(f))
    assert_close(f / f, f.apply(lambda x: x / x))
    s = torch.tensor(2.0)
    assert_close(s * f, f * 2)
    assert_close(f * s, f * 2)
    assert_close(s + f, f + 2)
    assert_close(s - f, 2 - f)
    e = TensorDict(e=torch.randn(4, 3), batch_size=[4, 3])
    col = torch.randn(4, 3)
    assert_close(e + col, TensorDict(e=e["e"] + col, batch_size=[4, 3]))
    assert_close(col * e, TensorDict(e=col * e["e"], batch_size=[4, 3]))
    assert_close(torch.mul(col, e), col * e)
    assert_close(torch.add(e, 1), e + 1)
    assert_close(torch.maximum(e, torch.zeros(())), e.apply(lambda x: x.clamp_min(0)))
    del t


def test_comparisons_and_logic():
    td = make_td()
    eq = td == td
    assert all(x.dtype == torch.bool for x in eq.leaves())
    assert eq.all().item() is True
    assert (td != td).any().item() is False
    lt = td < 0
    assert torch.equal(lt["a"], td["a"] < 0)
    assert isinstance((td > 0).all(), torch.Tensor)
    assert (td > 0).all().ndim == 0
    b = td > 0
    assert_close(~b, b.apply(torch.logical_not))
    assert_close(b & b, b)
    assert_close(b | ~b, tdfunc.ones_like(b))
    assert_close(b ^ b, tdfunc.zeros_like(b))
    assert (td >= td).all()
    assert (td <= td).all()
    assert_close(td.all(dim=0), td.apply(lambda x: x.all(0), batch_size=[3]))
    assert_close(td.any(dim=1), td.apply(lambda x: x.any(1), batch_size=[4]))


def test_arithmetic_key_mismatch():
    td = make_td()
    with pytest.raises(KeyError, match="missing keys \\['a'\\], extra keys \\['z'\\]"):
        td + td.exclude("a").set("z", torch.zeros(4, 3))
    with pytest.raises(KeyError, match="missing keys \\[\\('n', 'c'\\)\\]"):
        td * td.exclude(("n", "c"))
    with pytest.raises(TypeError):
        td + "x"  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"shape \(2, 4, 3\) .* batch_size \(4, 3\)"):
        TensorDict(e=torch.zeros(4, 3), batch_size=[4, 3]) + torch.zeros(2, 4, 3)


# ------------------------------------------------------------------ reductions
@pytest.mark.parametrize("name", ["sum", "mean", "prod", "amax", "amin", "std", "var"])
def test_reductions(name):
    td = make_td().exclude("n")
    fn = getattr(torch, name)
    whole = getattr(td, name)()
    assert whole.batch_size == ()
    assert torch.allclose(whole["a"], fn(td["a"]))
    d0 = getattr(td, name)(dim=0)
    assert d0.batch_size == (3,)
    kwargs = {}
    exp = fn(td["a"], 0, **kwargs) if name != "amax" else td["a"].amax(0)
    assert torch.allclose(d0["a"], exp)
    both = getattr(td, name)(dim=(0, 1))
    assert both.batch_size == ()
    exp2 = td["e"].prod(1).prod(0) if name == "prod" else fn(td["e"], (0, 1))
    assert torch.allclose(both["e"], exp2)
    keep = getattr(td, name)(dim=-1, keepdim=True)
    assert keep.batch_size == (4, 1)


def test_reduction_nested_and_torch_sum():
    td = make_td()
    r = td.sum(dim=1)
    assert r.batch_size == (4,)
    assert r["n"].batch_size == (4, 1)
    assert torch.equal(r["n", "i"], td["n", "i"].sum(1))
    whole = td.sum()
    assert whole["n"].batch_size == ()
    assert whole["n", "c"].ndim == 0
    assert_close(torch.sum(td, dim=0), td.sum(0))
    with pytest.raises(IndexError, match="out of range"):
        td.sum(dim=2)
    assert isinstance(td.all(), torch.Tensor)
    assert td.all().dtype == torch.bool


def test_arithmetic_mixed_dtypes_with_autograd():
    w = torch.randn(3, requires_grad=True)
    td = TensorDict(w=w, steps=torch.arange(3))
    out = td * 2 + 1
    assert out["steps"].dtype == torch.int64
    assert torch.equal(out["steps"], torch.arange(3) * 2 + 1)
    out["w"].sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))
    both = td + td
    assert torch.equal(both["steps"], torch.arange(3) * 2)


# ------------------------------------------------------------------ row gather (index_select)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_row_gather_equals_advanced_indexing(dtype):
    """``td[idx]`` with a 1-D integer tensor: the values of ``x[idx]`` for every leaf,
    negative and repeated rows included; the input is not modified."""
    td = make_td()
    before = snapshot(td)
    idx = torch.tensor([3, -1, 0, 0, -4], dtype=dtype)
    out = td[idx]
    assert out.batch_size == torch.Size([5, 3])
    assert out["n"].batch_size == torch.Size([5, 3, 1])
    for got, leaf in zip(out.leaves(), td.leaves()):
        assert torch.equal(got, leaf[idx])
    compare(td, before)
    assert td[idx[:0]].batch_size == torch.Size([0, 3])


@pytest.mark.parametrize("row", [4, -5, 100])
def test_row_gather_out_of_range_is_index_error(row):
    """Out-of-range rows raise IndexError, as ``x[idx]`` does."""
    td = make_td()
    with pytest.raises(IndexError):
        td["a"][torch.tensor([0, row])]
    with pytest.raises(IndexError):
        td[torch.tensor([0, row])]


def test_row_gather_compiles():
    """One frame, equal to eager, no recompile on new rows."""

    def make():
        return make_td(), torch.randint(-4, 4, (6,))

    check_compiled(lambda td, i: td[i], make)


def test_row_gather_from_a_store(tmp_path):
    """Rows of a memory-mapped store: plain in-memory tensors equal to the source rows."""
    src = tdfunc.TensorDict(
        {"x": torch.randn(50, 3), "n": {"y": torch.arange(50)}}, batch_size=[50]
    )
    tdfunc.save(src, tmp_path / "store")
    store = tdfunc.load(tmp_path / "store")
    idx = torch.tensor([7, -1, 7, 0])
    out = store[idx]
    assert out.batch_size == torch.Size([4])
    assert torch.equal(out["x"], src["x"][idx])
    assert torch.equal(out["n", "y"], src["n", "y"][idx])
    assert not isinstance(out["x"], tdfunc.MemoryMappedTensor)
