"""The pointwise family and the dispatch of torch functions on containers (_ops/_lift.py,
_ops/_pointwise.py): tag-derived lifting, the batch alignment rule for masks, casts,
methods, user operators, foreach, the TypeError of what does not lift."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as E
from tdfunc._ops import _lift, _pointwise


def make(seed: int = 0) -> tdfunc.TensorDict:
    g = torch.Generator().manual_seed(seed)
    return tdfunc.TensorDict(
        a=torch.randn(3, 2, 4, generator=g),
        n={"b": torch.randn(3, 2, generator=g), "c": torch.randn(3, 2, 5, 2, generator=g)},
        batch_size=[3, 2],
    )


@tdfunc.tensorclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def make_tc() -> Pair:
    return Pair(x=torch.randn(3, 4), y=torch.randn(3), batch_size=[3])


def compiled(fn):
    cnt = CompileCounterWithBackend("eager")
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


# ------------------------------------------------------------------ the alignment rule
def test_where_with_a_batch_mask_matches_tensordict():
    tensordict = pytest.importorskip("tensordict")
    td = make()
    mask = torch.tensor([True, False, True])
    got = torch.where(mask, td, 0)
    ref = torch.where(mask, tensordict.TensorDict(td.to_dict(), batch_size=[3, 2]), 0)
    for k in (("a",), ("n", "b"), ("n", "c")):
        torch.testing.assert_close(got[k], ref[k])
    assert got.batch_size == td.batch_size
    assert (got["a"][1] == 0).all()
    assert (got["a"][0] == td["a"][0]).all()


def test_where_full_batch_mask_and_method():
    td = make()
    mask = torch.rand(3, 2) > 0.5
    got = td.where(mask, torch.zeros(()))
    want = torch.where(mask[..., None], td["a"], 0.0)
    torch.testing.assert_close(got["a"], want)
    torch.testing.assert_close(got["n", "c"], torch.where(mask[..., None, None], td["n", "c"], 0.0))


def test_masked_fill_aligns_the_mask_with_the_batch():
    td = make()
    mask = torch.tensor([True, False, False])
    got = td.masked_fill(mask, 1.5)
    assert (got["a"][0] == 1.5).all()
    assert (got["a"][1:] == td["a"][1:]).all()
    assert (got["n", "c"][0] == 1.5).all()


def test_mask_with_more_dims_than_the_batch_broadcasts_as_torch():
    td = make()
    mask = torch.rand(3, 2, 4) > 0.5  # shaped like leaf "a": torch's broadcasting
    td1 = tdfunc.TensorDict(a=td["a"], batch_size=[3, 2])
    torch.testing.assert_close(torch.where(mask, td1, 0.0)["a"], torch.where(mask, td["a"], 0.0))


def test_arithmetic_with_a_tensor_is_shaped_like_the_batch():
    """A plain tensor next to a container lines up with the batch dims, not with each leaf's
    last dims: ``w`` of shape ``[4]`` on ``batch_size=[3]`` is refused even where torch would
    broadcast it against a leaf ``[3, 4]`` (tests/test_alignment.py has every row)."""
    td = tdfunc.TensorDict(a=torch.randn(3, 4), batch_size=[3])
    with pytest.raises(ValueError, match=r"shape \(4,\) .* batch_size \(3,\)"):
        torch.add(td, torch.randn(4))
    w = torch.randn(3)
    torch.testing.assert_close(torch.add(td, w)["a"], td["a"] + w[:, None])
    torch.testing.assert_close((td + w)["a"], td["a"] + w[:, None])


def test_arithmetic_with_a_batch_shaped_tensor_equals_tensordict():
    """Where a leaf's last dim has the batch's size (``[3, 3]`` with ``w`` ``[3]``) tdfunc
    computes what tensordict computes: ``w`` scales the rows."""
    tensordict = pytest.importorskip("tensordict")
    w = torch.tensor([1.0, 2.0, 3.0])
    square, wide = torch.rand(3, 3), torch.rand(3, 4)
    ours = tdfunc.TensorDict(a=square, b=wide, batch_size=[3]) * w
    theirs = tensordict.TensorDict(a=square, b=wide, batch_size=[3]) * w
    for k in ("a", "b"):
        torch.testing.assert_close(ours[k], theirs[k])
    torch.testing.assert_close(ours["a"], square * w[:, None])


def test_masked_mean_with_a_mask_on_feature_dims_is_exact():
    """``torch.masked.mean(td, 0, mask=m)`` divides by a plain count shaped like the batch:
    exact on a leaf with feature dims whose size coincides with the batch's."""
    g = torch.Generator().manual_seed(0)
    x, m = torch.rand(4, 4, 4, generator=g), torch.rand(4, 4, generator=g) > 0.3
    td = tdfunc.TensorDict(a=x, r=x[..., 0], batch_size=[4, 4])
    want = torch.stack([torch.masked.mean(x[..., f], 0, mask=m) for f in range(4)], -1)
    direct = torch.masked.mean(td, 0, mask=m)
    torch.testing.assert_close(direct["a"], want)
    torch.testing.assert_close(direct["r"], want[..., 0])


def test_align_to_batch():
    leaf = torch.zeros(3, 2, 4)
    assert _lift.align_to_batch(torch.ones(3, 2), 2, leaf).shape == (3, 2, 4)
    assert _lift.align_to_batch(torch.ones(3), 2, leaf).shape == (3, 1, 4)
    t = torch.ones(3, 2, 4, 1)
    assert _lift.align_to_batch(t, 2, leaf) is t


def test_where_tensorclass_and_compiled_and_vmap():
    tc = make_tc()
    mask = torch.tensor([True, False, True])
    out = torch.where(mask, tc, 0.0)
    assert type(out) is Pair
    assert (out.x[1] == 0).all()
    assert out.y[1] == 0
    f, cnt = compiled(lambda t, m: torch.where(m, t, 0.0))
    torch.testing.assert_close(f(tc, mask).x, out.x)
    f(make_tc(), ~mask)
    assert cnt.frame_count == 1
    td = make()
    masks = torch.rand(5, 3, 2) > 0.5
    tds = torch.stack([td] * 5)
    got = torch.vmap(lambda m, t: torch.where(m, t, 0.0))(masks, tds)
    torch.testing.assert_close(got["a"], torch.where(masks[..., None], tds["a"], 0.0))


# ------------------------------------------------------------------ the pointwise table
@pytest.mark.parametrize(
    "name", ["exp", "log", "sqrt", "tanh", "sigmoid", "isnan", "isfinite", "sign", "floor"]
)
def test_unary_function_and_method(name):
    td = make().abs() + 0.1
    f = getattr(torch, name)
    want = f(td["n", "c"])
    torch.testing.assert_close(f(td)["n", "c"], want)
    torch.testing.assert_close(getattr(td, name)()["n", "c"], want)
    assert getattr(td, name)().batch_size == td.batch_size


def test_clamp_lerp_isclose_activations():
    td, other = make(0), make(1)
    torch.testing.assert_close(td.clamp(min=0)["a"], td["a"].clamp(min=0))
    torch.testing.assert_close(td.clamp(-0.5, 0.5)["n", "b"], td["n", "b"].clamp(-0.5, 0.5))
    torch.testing.assert_close(
        torch.lerp(td, other, 0.3)["a"], torch.lerp(td["a"], other["a"], 0.3)
    )
    assert torch.isclose(td, td)["a"].all()
    for f in (F.silu, F.elu, F.gelu, F.softplus, F.leaky_relu, F.logsigmoid, F.softsign):
        torch.testing.assert_close(f(td)["n", "c"], f(td["n", "c"]))


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bool", torch.bool),
        ("int", torch.int32),
        ("long", torch.int64),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float", torch.float32),
        ("double", torch.float64),
    ],
)
def test_casts(name, dtype):
    td = make()
    out = getattr(td, name)()
    assert out.dtype == dtype
    assert out["n", "c"].dtype == dtype
    assert td.dtype == torch.float32  # input unchanged


def test_tuple_results_are_tuples_of_containers():
    td = make()
    m, e = torch.frexp(td)
    wm, we = torch.frexp(td["a"])
    torch.testing.assert_close(m["a"], wm)
    torch.testing.assert_close(e["a"], we)


def test_same_structure_required():
    td = make()
    other = tdfunc.TensorDict(a=td["a"], batch_size=[3, 2])
    with pytest.raises(tdfunc.StructureError):
        torch.atan2(td, other)


def test_methods_come_from_the_table():
    for name in ("exp", "clamp", "sigmoid", "isnan", "bool", "half", "where", "masked_fill"):
        assert name in _lift.METHODS
        assert callable(getattr(tdfunc.TensorDict, name))
    assert callable(Pair.exp)
    assert torch.exp in _pointwise.FUNCTIONS
    assert torch.matmul not in _pointwise.FUNCTIONS


def test_unary_uses_one_foreach_call(monkeypatch):
    calls = []
    real = _pointwise.unary_foreach["exp"]

    def spy(xs):
        calls.append(len(xs))
        return real(xs)

    monkeypatch.setitem(_pointwise.unary_foreach, "exp", spy)
    td = make()
    torch.testing.assert_close(td.exp()["a"], td["a"].exp())
    assert calls == [3]
    torch.vmap(torch.exp)(td)  # per leaf under vmap (foreach has no batching rule)
    assert calls == [3]


@pytest.mark.parametrize("f", [torch.exp, torch.sigmoid, F.silu, lambda t: t.clamp(min=0)])
def test_compiled_one_frame(f):
    g, cnt = compiled(f)
    torch.testing.assert_close(g(make(0))["n", "c"], f(make(0))["n", "c"])
    g(make(1))
    assert cnt.frame_count == 1


def test_input_is_not_changed():
    td = make()
    before = td["a"].clone()
    td.exp()
    torch.where(torch.tensor([True, False, True]), td, 0)
    assert torch.equal(td["a"], before)


def _flat_td() -> tdfunc.TensorDict:
    g = torch.Generator().manual_seed(3)
    return tdfunc.TensorDict(
        {f"k{i}": torch.randn(3, 2, generator=g) for i in range(4)}, batch_size=[3]
    )


@pytest.mark.parametrize("method", [True, False])
def test_unary_on_a_flat_container_is_a_new_container_with_the_same_layout(method: bool) -> None:
    """The flat path (every child a tensor: one C-level check, the dict rebuilt by ``zip``)
    gives what the general path gives: new leaves by key, the same batch size and device, a
    dict of its own, the input untouched."""
    td = _flat_td()
    before = {k: v.clone() for k, v in td.items()}
    got = td.exp() if method else torch.exp(td)
    assert list(got.keys()) == list(td.keys())
    assert got.batch_size == td.batch_size
    assert got.device == td.device
    for k, v in before.items():
        torch.testing.assert_close(got[k], v.exp())
        assert torch.equal(td[k], v)
    assert got._data is not td._data
    # the general path (a nested container) agrees leaf by leaf
    nested = tdfunc.TensorDict(n=td, batch_size=[3]).exp()
    for k in before:
        torch.testing.assert_close(nested["n", k], got[k])
    on_device = tdfunc.TensorDict(a=torch.zeros(2), device="cpu", batch_size=[2]).exp()
    assert on_device.device == torch.device("cpu")


def test_flat_leaves_only_for_containers_of_tensors() -> None:
    from tdfunc._tree import flat_leaves

    td = _flat_td()
    assert flat_leaves(td) == list(td.values())
    assert flat_leaves(tdfunc.TensorDict(n=td, batch_size=[3])) is None
    assert flat_leaves(tdfunc.TensorDict(a=torch.zeros(3), n=td, batch_size=[3])) is None
    assert flat_leaves(tdfunc.TensorDict()) == []

    @tdfunc.tensorclass
    class P:
        x: torch.Tensor

    assert flat_leaves(P(x=torch.zeros(2), batch_size=[2])) is None  # not a dict layout
    torch.testing.assert_close(P(x=torch.zeros(2), batch_size=[2]).exp().x, torch.ones(2))


def test_unary_flat_and_nested_compiled_one_frame_each() -> None:
    """Dynamo traces the general path (the flat check's twin answers None)."""
    f, cnt = compiled(lambda td: td.exp())
    td = _flat_td()
    torch.testing.assert_close(f(td)["k1"], td["k1"].exp())
    f(td + 1)
    assert cnt.frame_count == 1
    nested = tdfunc.TensorDict(n=td, a=td["k0"], batch_size=[3])
    torch.testing.assert_close(f(nested)["n", "k2"], td["k2"].exp())
    assert cnt.frame_count == 2


def test_functions_sharing_a_name_reach_their_own_rule() -> None:
    """``__torch_function__`` finds a rule by name, then by function: ``torch.relu`` and
    ``F.relu`` share a name (and ``torch.softmax`` / ``F.softmax``, ``torch.sum`` /
    ``Tensor.sum``), each reaches its own rule, eagerly and compiled."""
    td = _flat_td()
    calls = {
        "relu": (torch.relu, F.relu),
        "softmax": (lambda t: torch.softmax(t, 0), lambda t: F.softmax(t, 0)),
        "log_softmax": (lambda t: torch.log_softmax(t, 0), lambda t: F.log_softmax(t, 0)),
    }
    want = {"relu": td["k0"].relu(), "softmax": td["k0"].softmax(0)}
    want["log_softmax"] = td["k0"].log_softmax(0)
    for name, fs in calls.items():
        for f in fs:
            torch.testing.assert_close(f(td)["k0"], want[name])
            g, cnt = compiled(f)
            torch.testing.assert_close(g(td)["k0"], want[name])
            assert cnt.frame_count == 1
    torch.testing.assert_close(torch.sum(td, 0)["k2"], td["k2"].sum(0))


# ------------------------------------------------------------------ a user operator
@torch.library.custom_op("tdfunc_test::twice", mutates_args=(), tags=(torch.Tag.pointwise,))
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


def test_user_operator_tagged_pointwise_lifts_eager_and_compiled():
    td = make()
    op = torch.ops.tdfunc_test.twice
    torch.testing.assert_close(op(td)["n", "c"], td["n", "c"] * 2)
    torch.testing.assert_close(op.default(td)["a"], td["a"] * 2)
    g, cnt = compiled(lambda t: op(t))
    torch.testing.assert_close(g(td)["a"], td["a"] * 2)
    g(make(1))
    assert cnt.frame_count == 1


# ------------------------------------------------------------------ what does not lift
@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda td: torch.matmul(td, td), "torch.matmul"),
        (lambda td: torch.matmul(td["a"], td), "torch.matmul"),
        (lambda td: torch.mm(td, td), "torch.mm"),
        (lambda td: F.linear(td, torch.ones(2, 2)), "linear"),
        (lambda td: torch.einsum("ij->i", td), "einsum"),
        (lambda td: torch.exp(td, out=td), "torch.exp"),
        (lambda td: F.relu(td, inplace=True), "relu"),
        (lambda td: torch.relu_(td), "torch.relu_"),
    ],
)
def test_not_liftable_is_a_type_error_naming_apply(call, name):
    td = make()
    with pytest.raises(TypeError) as info:
        call(td)
    msg = str(info.value)
    assert "Multiple dispatch failed" not in msg
    assert name in msg
    assert "td.apply(" in msg


def test_not_liftable_message_constants():
    err = _lift.not_liftable(torch.matmul, E.LIFT_REASON_UNKNOWN)
    assert str(err) == E.LIFT_NOT_LIFTABLE.format(op="torch.matmul", reason=E.LIFT_REASON_UNKNOWN)


# ------------------------------------------------------------------ the reference page
def test_reference_page_is_generated_from_the_table():
    import os
    import pathlib

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "lifted-ops.md"
    want = _lift.reference_markdown()
    if os.environ.get("TDFUNC_WRITE_DOCS") == "1":
        page.write_text(want, encoding="utf-8")
    text = page.read_text(encoding="utf-8")
    for name in _lift.METHODS:
        assert f"`{name}`" in text, name
    stamp = ".".join(torch.__version__.split(".")[:2])
    if f"on torch\n     {stamp}:" in text:  # the table is torch's: exact on that version
        assert text == want, "docs/lifted-ops.md is stale: TDFUNC_WRITE_DOCS=1 pytest -k reference"


def test_like_factories_make_one_leaf_per_leaf() -> None:
    """``torch.rand_like(td)`` & co. (a ``*_like`` ATen schema: one tensor of the input's
    shape) lift leaf by leaf: each leaf gets its own tensor of its shape and dtype options."""
    td = tdfunc.TensorDict(a=torch.randn(3, 2), n={"b": torch.randn(3)}, batch_size=[3])
    before = td.clone()
    r = torch.rand_like(td)
    assert r.batch_size == (3,)
    assert r["a"].shape == (3, 2)
    assert r["n", "b"].shape == (3,)
    assert bool(((r["a"] >= 0) & (r["a"] < 1)).all())
    assert torch.randint_like(td, 5)["a"].dtype == torch.float32
    assert torch.randn_like(td, dtype=torch.float64)["n", "b"].dtype == torch.float64
    torch.manual_seed(0)
    one = torch.randn_like(td)
    torch.manual_seed(0)
    assert torch.equal(one["a"], torch.randn_like(td["a"]))  # the first leaf draws first
    tdfunc.testing.assert_close(td, before)


def test_one_container_calls_align_masks_per_leaf_rank() -> None:
    """One container among the arguments (the common case, one argument list per leaf rank):
    every leaf gets the mask aligned to its own rank, wherever the container sits."""
    g = torch.Generator().manual_seed(0)
    td = tdfunc.TensorDict(
        a=torch.randn(3, generator=g),
        b=torch.randn(3, 2, generator=g),
        c=torch.randn(3, 2, 4, generator=g),
        n=tdfunc.TensorDict(d=torch.randn(3, 5, 2, generator=g), batch_size=[3, 5]),
        batch_size=[3],
    )
    before = td.clone()
    mask = torch.tensor([True, False, True])

    def per_leaf(f):
        return [f(x, mask.reshape(3, *(1,) * (x.ndim - 1))) for x in td.leaves()]

    cases = [
        (torch.where(mask, td, 0.0), per_leaf(lambda x, m: torch.where(m, x, 0.0))),
        (torch.where(mask, 1.5, td), per_leaf(lambda x, m: torch.where(m, 1.5, x))),
        (td.masked_fill(mask, 5.0), per_leaf(lambda x, m: x.masked_fill(m, 5.0))),
        (torch.masked_fill(td, mask=mask, value=5.0), per_leaf(lambda x, m: x.masked_fill(m, 5.0))),
    ]
    for got, want in cases:
        assert got.batch_size == (3,)
        assert got["n"].batch_size == (3, 5)
        for x, w in zip(got.leaves(), want, strict=True):
            assert torch.equal(x, w)
    mant, expo = torch.frexp(td)  # a tuple result: a container per field
    for x, m, e in zip(td.leaves(), mant.leaves(), expo.leaves(), strict=True):
        assert torch.equal(m, torch.frexp(x).mantissa)
        assert torch.equal(e, torch.frexp(x).exponent)
    tdfunc.testing.assert_close(td, before)


#: the eager-only functions, called as a user would, and their compiled spelling
EAGER_ONLY = {
    "torch.rand_like": (lambda td: torch.rand_like(td), lambda td: td.apply(torch.rand_like)),
    "torch.randn_like": (lambda td: torch.randn_like(td), lambda td: td.apply(torch.randn_like)),
    "torch.randint_like": (
        lambda td: torch.randint_like(td, 5),
        lambda td: td.apply(lambda x: torch.randint_like(x, 5)),
    ),
    "torch.nn.functional.sigmoid": (lambda td: F.sigmoid(td), lambda td: td.sigmoid()),
    "torch.nn.functional.tanh": (lambda td: F.tanh(td), lambda td: torch.tanh(td)),
    "torch.nn.functional.hardsigmoid": (
        lambda td: F.hardsigmoid(td),
        lambda td: td.apply(F.hardsigmoid),
    ),
}


def test_eager_only_list_is_torchs() -> None:
    """The eager-only functions are read from torch (``torch.overrides``); these are today's,
    on torch 2.13 and 2.15 alike. A change here means torch changed: update the cases."""
    assert _lift.eager_only() == sorted(EAGER_ONLY)


@pytest.mark.parametrize("name", sorted(EAGER_ONLY))
def test_eager_only_functions_lift_eagerly_and_stop_torch_compile(name: str) -> None:
    """Pinned limitation (docs/lifted-ops.md, "Under torch.compile"): Dynamo never hands these
    to ``__torch_function__`` (torch lists them as not overridable), so a compiled call fails
    in Dynamo before tdfunc sees it; eagerly they lift, and the spelling the page gives
    compiles in one frame with the same structure and dtypes."""
    call, spelling = EAGER_ONLY[name]
    td = tdfunc.TensorDict(a=torch.rand(3, 2), n={"b": torch.rand(3)}, batch_size=[3])
    before = td.clone()
    eager = call(td)
    assert eager.batch_size == (3,)
    assert [x.shape for x in eager.leaves()] == [(3, 2), (3,)]
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Failed to convert args/kwargs"):
        torch.compile(call, backend="eager", fullgraph=True)(td)
    cnt = CompileCounterWithBackend("eager")
    got = torch.compile(spelling, backend=cnt, fullgraph=True)(td)
    assert cnt.frame_count == 1
    assert got.batch_size == eager.batch_size
    assert [(x.shape, x.dtype) for x in got.leaves()] == [
        (x.shape, x.dtype) for x in eager.leaves()
    ]
    if "rand" not in name:
        tdfunc.testing.assert_close(got, eager)
    tdfunc.testing.assert_close(td, before)


def test_no_torch_function_ends_in_multiple_dispatch_failed() -> None:
    """Every function torch lets a ``__torch_function__`` override, called with containers
    (one, two, a container and a number), either lifts or raises tdfunc's own error: never
    torch's "Multiple dispatch failed ... returned NotImplemented"."""
    from torch.overrides import get_overridable_functions

    td = tdfunc.TensorDict(a=torch.rand(3, 2), n={"b": torch.rand(3)}, batch_size=[3])
    bad = []
    calls = 0
    for fns in get_overridable_functions().values():
        for f in fns:
            name = getattr(f, "__name__", str(f))
            if "save" in name or "load" in name:  # nothing here may touch files
                continue
            for args in ((td,), (td, td), (td, 1)):
                calls += 1
                try:
                    f(*args)
                except Exception as e:  # any error but torch's is fine here
                    if "Multiple dispatch failed" in str(e) or "NotImplemented" in str(e):
                        bad.append(f"{name}/{len(args)}")
    assert calls > 3000
    assert bad == []
