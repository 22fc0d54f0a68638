"""Regression tests for silent wrong results of the core (each failed before its fix)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict, tensorclass
from tdfunc import _errors as E
from tdfunc.testing import assert_close


@tensorclass
class TcA:
    x: torch.Tensor
    y: torch.Tensor


def _compiled(fn):
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


def check_batch_invariant(node, prefix=()):
    """Every leaf of every node starts with that node's batch size; nested nodes too."""
    bs = node.batch_size
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            assert v.shape[: len(bs)] == bs, ((*prefix, k), v.shape, bs)
        else:
            assert v.batch_size[: len(bs)] == bs, ((*prefix, k), v.batch_size, bs)
            check_batch_invariant(v, (*prefix, k))


# ---------------------------------------------------------------------------- 1. rename_key
def test_rename_onto_existing_key_raises_unless_overwrite():
    td = TensorDict({"a": torch.zeros(2), "b": torch.ones(2)}, batch_size=[2])
    with pytest.raises(KeyError, match="the target key 'b' already exists"):
        td.rename_key("a", "b")
    out = td.rename_key("a", "b", overwrite=True)
    assert out.keys() == ["b"]
    assert torch.equal(out["b"], torch.zeros(2))
    assert torch.equal(td["b"], torch.ones(2))  # input unchanged
    assert td.keys() == ["a", "b"]


def test_rename_nested_onto_existing_key_same_rule():
    td = TensorDict({"n": {"c": torch.zeros(2), "d": torch.ones(2)}}, batch_size=[2])
    with pytest.raises(KeyError, match=r"the target key \('n', 'd'\) already exists"):
        td.rename_key(("n", "c"), ("n", "d"))
    out = td.rename_key(("n", "c"), ("n", "d"), overwrite=True)
    assert out["n"].keys() == ["d"]
    assert torch.equal(out["n", "d"], torch.zeros(2))
    moved = td.rename_key(("n", "c"), "top")
    assert moved.keys(include_nested=True) == [("n", "d"), "n", "top"]


def test_rename_equals_exclude_then_set_and_keeps_position_in_parent():
    td = TensorDict(a=torch.zeros(2), b=torch.ones(2), c=torch.full((2,), 2.0), batch_size=[2])
    r = td.rename_key("b", "z")
    assert r.keys() == ["a", "z", "c"]
    ref = td.exclude("b").set("z", td["b"])
    assert sorted(r.keys()) == sorted(ref.keys())
    # iterating a TensorDict walks its first batch dim, not its keys
    assert all(r[k] is ref[k] for k in ref.keys())  # noqa: SIM118


def test_rename_compiles():
    td = TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2])
    f, cnt = _compiled(lambda t: t.rename_key("a", "b", overwrite=True) + 1)
    assert torch.equal(f(td)["b"], torch.ones(2))
    assert cnt.frame_count == 1


# ---------------------------------------------------------------------------- 2. vmap batch size
def test_vmap_batch_size_ignores_children_without_leaves():
    x = TensorDict({"f": TensorDict({}, batch_size=[2]), "n1": torch.randn(2)}, batch_size=[2])
    seen = []

    def f(t):
        seen.append((t.batch_size, t["f"].batch_size, t["n1"].shape))
        return t

    out = torch.vmap(f)(x)
    assert seen == [(torch.Size([]), torch.Size([]), torch.Size([]))]
    assert out.batch_size == (2,)
    assert out["f"].batch_size == (2,)
    check_batch_invariant(out)


def test_vmap_output_with_a_leafless_first_child():
    out = torch.vmap(lambda t: TensorDict({"f": TensorDict({}), "n1": t["n1"]}))(
        TensorDict({"n1": torch.randn(2)}, batch_size=[2])
    )
    assert out.batch_size == (2,)
    assert out["f"].batch_size == (2,)
    check_batch_invariant(out)


def test_unflatten_leafless_child_with_extra_dims_follows_parent():
    x = TensorDict(
        {"f": TensorDict({}, batch_size=[3, 5]), "n1": torch.randn(3, 4)}, batch_size=[3]
    )
    out = torch.vmap(lambda t: t)(x)
    assert out["f"].batch_size == (3, 5)
    inner = []
    torch.vmap(lambda t: inner.append(t["f"].batch_size) or t)(x)
    assert inner == [torch.Size([5])]


# ---------------------------------------------------------------------------- 3. apply invariant
def _nested_extra():
    return TensorDict(
        {"a": torch.randn(2, 4), "n": TensorDict({"c": torch.randn(2, 3)}, batch_size=[2, 3])},
        batch_size=[2],
    )


def test_apply_checks_nested_batch_sizes():
    td = _nested_extra()
    with pytest.raises(ValueError, match=r"key \('n', 'c'\): leaf shape \(2,\) does not start"):
        td.apply(lambda t: t.sum(-1))
    with pytest.raises(ValueError, match=r"key \('n', 'c'\)"):
        td.named_apply(lambda p, t: t.sum(-1))


def test_apply_keeps_valid_nested_results():
    td = _nested_extra()
    out = td.apply(lambda t: t * 2)
    check_batch_invariant(out)
    assert out["n"].batch_size == (2, 3)


def test_binary_with_broadcasting_tensor_checks_nested_nodes():
    td = _nested_extra()
    # a plain operand is shaped like the batch: one with more dims is refused before any leaf
    with pytest.raises(ValueError, match=r"shape \(2, 1, 1\) .* batch_size \(2,\)"):
        td + torch.ones(2, 1, 1)
    # a mask with more dims than the batch is broadcast by torch: leaf n.c (2, 3) becomes
    # (2, 2, 3), which moves the nested batch dims
    with pytest.raises(ValueError, match=r"\('n', 'c'\)"):
        torch.where(torch.ones(2, 1, 1, dtype=torch.bool), td, 0.0)


# ---------------------------------------------------------------------------- 4. operators
_BIN = [
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.and_,
    operator.or_,
    operator.xor,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
]
_BITWISE = {operator.and_, operator.or_, operator.xor}


@pytest.mark.parametrize("op", _BIN, ids=lambda o: o.__name__)
@pytest.mark.parametrize("kind", ["number", "tensor", "container"])
@pytest.mark.parametrize("reflected", [False, True], ids=["td-op-x", "x-op-td"])
def test_every_binary_operator_both_orders_eager_and_compiled(op, kind, reflected):
    dtype = torch.int64 if op in _BITWISE else torch.float32
    td = TensorDict(
        a=torch.arange(1, 7).reshape(2, 3).to(dtype),
        n={"b": torch.ones(2, dtype=dtype) + 2},
        batch_size=[2],
    )
    other = {
        "number": 3,
        "tensor": torch.full((2,), 3, dtype=dtype),
        "container": td.apply(lambda t: torch.full_like(t, 2)),
    }[kind]

    def f(x, o):
        if kind == "tensor":
            return op(o, x) if reflected else op(x, o)
        return op(o, x) if reflected else op(x, o)

    def leafwise(t):  # the same op leaf by leaf on plain tensors
        if kind == "container":
            return None
        o = other if kind == "number" else other.reshape((2,) + (1,) * (t.ndim - 1))
        return op(o, t) if reflected else op(t, o)

    if kind in ("number", "tensor"):
        # a tensor of shape batch_size lines up with the batch dims of every leaf
        expected = {k: leafwise(v) for k, v in td.items(include_nested=True, leaves_only=True)}
    else:
        expected = {
            k: (op(other[k], v) if reflected else op(v, other[k]))
            for k, v in td.items(include_nested=True, leaves_only=True)
        }
    eager = f(td, other)
    for k, v in expected.items():
        assert torch.equal(eager[k], v), k
    cf, cnt = _compiled(f)
    assert_close(cf(td, other), eager)
    assert cnt.frame_count == 1
    cf(td + 1 if op not in _BITWISE else td, other)
    assert cnt.frame_count == 1  # no recompile on new values


def test_reflected_bitwise_with_numbers():
    td = TensorDict(a=torch.tensor([1, 2, 3]), batch_size=[3])
    assert torch.equal((2 & td)["a"], 2 & td["a"])
    assert torch.equal((2 | td)["a"], 2 | td["a"])
    assert torch.equal((2 ^ td)["a"], 2 ^ td["a"])


def test_invert_and_bitwise_not():
    td = TensorDict(m=torch.tensor([True, False]), i=torch.tensor([1, 2]), batch_size=[2])
    assert torch.equal((~td)["m"], ~td["m"])
    assert torch.equal((~td)["i"], ~td["i"])
    f, cnt = _compiled(lambda t: t.bitwise_not())
    assert_close(f(td), ~td)
    assert cnt.frame_count == 1


# ---------------------------------------------------------------------------- 5. tensorclass paths
def _with_tc():
    return TensorDict({"n": TcA(x=torch.zeros(2), y=torch.ones(2), batch_size=[2])}, batch_size=[2])


def test_key_ops_through_a_tensorclass_field_are_consistent():
    td = _with_tc()
    assert torch.equal(td["n", "x"], torch.zeros(2))
    assert ("n", "x") in td
    assert td.get(("n", "zz")) is None
    with pytest.raises(TypeError, match="has the fixed fields"):
        td.exclude(("n", "x"))
    with pytest.raises(TypeError, match="has the fixed fields"):
        td.rename_key(("n", "x"), "z")
    with pytest.raises(TypeError, match="has the fixed fields"):
        td.select(("n", "x"))
    # selecting / excluding a whole tensorclass, or every field of it, is fine
    assert td.select(("n", "x"), ("n", "y"))["n"].x is td["n"].x
    assert td.exclude("n").keys() == []
    # set goes through the field (and validates)
    out = td.set(("n", "x"), torch.full((2,), 5.0))
    assert type(out["n"]) is TcA
    assert torch.equal(out["n", "x"], torch.full((2,), 5.0))
    with pytest.raises(KeyError, match="'zz' not found"):
        td.set(("n", "zz"), torch.zeros(2))
    assert torch.equal(td["n", "x"], torch.zeros(2))  # input unchanged


def test_tensorclass_own_key_ops():
    t = TcA(x=torch.zeros(2), y=torch.ones(2), batch_size=[2])
    with pytest.raises(TypeError, match="has the fixed fields"):
        t.exclude("x")
    assert t.select("x", "y").x is t.x


# ---------------------------------------------------------------------------- 6. reshape / view
@pytest.mark.parametrize(
    ("batch", "shape"),
    [
        ((0,), (-1, 0)),
        ((1,), (-1, -1)),
        ((6,), (4, -1)),
        ((6,), (2, 3)),
        ((6,), (-1, 2)),
        ((2, 3), (-1,)),
        ((4,), (2, 3)),
    ],
)
@pytest.mark.parametrize("method", ["reshape", "view"])
def test_batch_shape_ops_behave_like_a_plain_tensor(batch, shape, method):
    td = TensorDict(a=torch.zeros(*batch, 2), batch_size=batch)
    plain = torch.zeros(batch)
    try:
        expected = getattr(plain, method)(shape).shape
    except Exception as e:  # the container must raise the same type
        with pytest.raises(type(e)):
            getattr(td, method)(*shape)
        return
    out = getattr(td, method)(*shape)
    assert out.batch_size == expected
    assert out["a"].shape == (*expected, 2)


# ---------------------------------------------------------------------------- 7. at[].add, unflatten_keys
def test_at_add_accumulates_repeated_indices_like_jax():
    td = TensorDict(a=torch.zeros(3, 2), n={"b": torch.zeros(3)}, batch_size=[3])
    out = td.at[[0, 0, 2]].add(1.0)
    assert out["a"].tolist() == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    assert out["n", "b"].tolist() == [2.0, 0.0, 1.0]
    ref = torch.zeros(3).index_add(0, torch.tensor([0, 0, 2]), torch.ones(3))
    assert torch.equal(out["n", "b"], ref)
    assert torch.equal(td["a"], torch.zeros(3, 2))  # input unchanged
    mask = td.at[torch.tensor([True, False, True])].add(td[torch.tensor([True, False, True])] + 5)
    assert mask["n", "b"].tolist() == [5.0, 0.0, 5.0]


def test_at_add_compiles():
    td = TensorDict(a=torch.zeros(3), batch_size=[3])
    idx = torch.tensor([1, 1])
    f, cnt = _compiled(lambda t, i: t.at[i].add(1.0))
    assert f(td, idx)["a"].tolist() == [0.0, 2.0, 0.0]
    f(td + 1, idx)
    assert cnt.frame_count == 1


def test_unflatten_keys_inverts_flatten_keys_for_keys_and_values():
    td = TensorDict(
        a={"b": torch.zeros(2), "c": {"d": torch.ones(2)}}, e=torch.ones(2), batch_size=[2]
    )
    back = td.flatten_keys().unflatten_keys()
    assert_close(back, td)


def test_unflatten_keys_documents_the_loss_of_nested_extra_dims():
    td = _nested_extra()
    back = td.flatten_keys().unflatten_keys()
    assert back["n"].batch_size == (2,)  # documented: flat keys do not record nested batch dims
    assert torch.equal(back["n", "c"], td["n", "c"])


def test_flatten_keys_collision_raises_naming_both_paths():
    td = TensorDict({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(ValueError, match=r"'a.b' and \('a', 'b'\) both become 'a.b'"):
        td.flatten_keys()


# ---------------------------------------------------------------------------- other core contract
def test_zeros_like_keeps_torch_keyword_arguments():
    td = TensorDict(a=torch.ones(2), batch_size=[2])
    z = torch.zeros_like(td, device="meta")
    assert z["a"].device.type == "meta"
    assert z.device == torch.device("meta")
    f = torch.full_like(td, 3.0, dtype=torch.float64)
    assert f["a"].dtype == torch.float64
    assert f["a"].tolist() == [3.0, 3.0]
    r = torch.ones_like(td, requires_grad=True)
    assert r["a"].requires_grad


@pytest.mark.parametrize(
    ("bs", "exc"), [([-1], ValueError), ([True], TypeError), ([2.0], TypeError), ("ab", TypeError)]
)
def test_bad_batch_sizes_are_refused(bs, exc):
    with pytest.raises(exc, match="batch_size"):
        TensorDict(batch_size=bs)


def test_from_dict_batch_dims_must_be_non_negative():
    with pytest.raises(ValueError, match="batch_dims must be an int >= 0, got -1"):
        TensorDict.from_dict({"a": torch.zeros(2)}, batch_dims=-1)
    with pytest.raises(TypeError, match="batch_dims must be an int"):
        TensorDict.from_dict({"a": torch.zeros(2)}, batch_dims=True)


def test_structure_errors_have_one_type_per_kind():
    td = TensorDict(a=torch.zeros(2), b=torch.zeros(2), batch_size=[2])
    for fn in (lambda: tdfunc.stack([td, td.exclude("b")]), lambda: td + td.exclude("b")):
        with pytest.raises(E.KeysDifferError, match=r"missing keys \['b'\]"):
            fn()
    t1 = TcA(x=torch.zeros(2), y=torch.zeros(2), batch_size=[2])
    t2 = TensorDict(x=torch.zeros(2), y=torch.zeros(2), batch_size=[2])
    for fn in (lambda: tdfunc.stack([t1, t2]), lambda: t1 + t2):
        with pytest.raises(E.NodeTypesDifferError, match="different node types"):
            fn()


# ---------------------------------------------------------------------------- tensorclass parity
def test_tensorclass_membership_means_keys():
    t = TcA(x=torch.zeros(2), y=torch.ones(2), batch_size=[2])
    assert "x" in t
    assert "z" not in t
    assert ("x",) in t
    t0 = TcA(x=torch.zeros(()), y=torch.ones(()))
    assert "x" in t0  # batch_size=(): no iteration involved


def test_tensorclass_keys_values_items_flatten_keys():
    td = TensorDict(y=torch.ones(2), batch_size=[2])

    @tensorclass
    class Rec:
        x: torch.Tensor
        extra: TensorDict | None = None

    r = Rec(torch.zeros(2), extra=td, batch_size=[2])
    assert r.keys() == ["x", "extra"]
    assert r.keys(include_nested=True, leaves_only=True) == ["x", ("extra", "y")]
    assert r.values()[0] is r.x
    assert r.items()[1][1] is r.extra
    assert Rec(torch.zeros(2), batch_size=[2]).keys() == ["x"]  # None fields are not entries
    flat = r.flatten_keys()
    assert type(flat) is TensorDict
    assert flat.keys() == ["x", "extra.y"]


def test_symbolic_scalar_batch_size_exports_with_a_dynamic_batch():
    class M(torch.nn.Module):
        def forward(self, x):
            return TensorDict(x=x * 2, batch_size=x.shape[0])

    ep = torch.export.export(
        M(), (torch.randn(4, 3),), dynamic_shapes={"x": {0: torch.export.Dim("b")}}
    )
    out = ep.module()(torch.randn(7, 3))
    assert out.batch_size == (7,)
    assert out["x"].shape == (7, 3)


def test_nested_compile_region_takes_a_container():
    @torch.compiler.nested_compile_region
    def inner(t):
        return t * 2 + 1

    td = TensorDict(a=torch.ones(3), n={"b": torch.zeros(3)}, batch_size=[3])
    f, cnt = _compiled(lambda t: inner(inner(t)))
    out = f(td)
    assert_close(out, (td * 2 + 1) * 2 + 1)
    assert cnt.frame_count == 1


def test_tensorclass_with_a_tensor_default_constructs_inside_compile():
    @tensorclass
    class WithDefault:
        x: torch.Tensor
        cache: torch.Tensor = torch.zeros(3)

    f, cnt = _compiled(lambda x: WithDefault(x=x * 2))
    out = f(torch.ones(3))
    assert type(out) is WithDefault
    assert torch.equal(out.cache, torch.zeros(3))
    assert torch.equal(out.x, torch.full((3,), 2.0))
    assert cnt.frame_count == 1
    assert torch.equal(WithDefault(x=torch.ones(3), cache=torch.ones(3)).cache, torch.ones(3))
