"""``@tensorclass``: construction, dataclass behaviour, frozenness, static and None fields,
every shared op eager (against TensorDict) and compiled, nesting, pytree / optree / vmap /
export, pickling, bad input."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import pickle
import re
import typing

import optree
import pytest
import torch
import torch.utils._pytree as pytree
from corpus import FLOAT_ONLY, OPS
from helpers import check_compiled, compare
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict, is_tensorclass, tensorclass
from tdfunc import _errors as E
from tdfunc.testing import assert_close


# ------------------------------------------------------------------------------ classes
@tensorclass
class Transition:
    obs: torch.Tensor
    action: torch.Tensor
    info: TensorDict | None = None
    discount: float = 0.99


@tensorclass
class Inner:
    c: torch.Tensor
    d: torch.Tensor


@tensorclass
class Outer:
    """batch [4, 3]: a leaf, a nested tensorclass with an extra batch dim, a nested
    TensorDict, an optional field left None, and a static field."""

    a: torch.Tensor
    inner: Inner
    td: TensorDict
    opt: torch.Tensor | None = None
    name: str = "outer"


@tensorclass
class Flat:
    x: torch.Tensor
    y: torch.Tensor
    i: torch.Tensor


@tensorclass
class WithPost:
    x: torch.Tensor
    y: torch.Tensor | None = None
    scale: float = 2.0

    def __post_init__(self) -> None:
        if self.y is None:
            object.__setattr__(self, "y", self.x * self.scale)


@tensorclass
class WithFactory:
    x: torch.Tensor
    z: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(3))
    tags: tuple = dataclasses.field(default_factory=tuple)
    step: int = dataclasses.field(default=0, kw_only=True)


@tensorclass
class Base:
    x: torch.Tensor

    def total(self) -> torch.Tensor:
        return self.x.sum()


@tensorclass
class Derived(Base):
    y: torch.Tensor = dataclasses.field(default_factory=lambda: torch.ones(()))

    def total(self) -> torch.Tensor:
        return super().total() + self.y.sum()


@tensorclass
class Chain:
    value: torch.Tensor
    next: Chain | None = None


def make_outer(b: int = 4) -> Outer:
    return Outer(
        torch.randn(b, 3, 2),
        Inner(torch.randn(b, 3, 2), torch.randn(b, 3, 2, 5), batch_size=[b, 3, 2]),
        TensorDict(e=torch.randn(b, 3), batch_size=[b, 3]),
        batch_size=[b, 3],
    )


def make_flat() -> Flat:
    return Flat(
        torch.randn(4, 2),
        torch.randn(4, dtype=torch.float64),
        torch.randint(0, 10, (4, 3)),
        batch_size=[4],
    )


def make_transition(b: int = 8) -> Transition:
    return Transition(torch.randn(b, 3), torch.randn(b), batch_size=[b])


def as_td(x):
    """Tensorclasses anywhere in a result become TensorDicts (for comparing with TensorDict)."""
    if isinstance(x, (tuple, list)):
        return type(x)(as_td(v) for v in x)
    return x.to_tensordict() if is_tensorclass(x) else x


def assert_classes(result, like):
    """The result of an op keeps the class (and static fields) of its input, at every level."""
    if isinstance(result, (tuple, list)):
        for r in result:
            assert_classes(r, like)
        return
    if not tdfunc.is_container(result):
        return
    assert type(result) is type(like)
    if is_tensorclass(like):
        assert result._tdf_static() == like._tdf_static()
        for a, b in zip(result._tdf_children(), like._tdf_children()):
            assert (a is None) == (b is None)
            assert_classes(a, b)


# ------------------------------------------------------------------------------ construction
def test_construction_positional_keyword_and_attributes():
    obs, action = torch.randn(32, 4), torch.randn(32)
    t = Transition(obs, action, batch_size=[32])
    assert t.obs is obs  # no copies
    assert t.action is action
    assert t.info is None
    assert t.discount == 0.99
    assert t.batch_size == torch.Size([32])
    assert t.device is None
    t2 = Transition(action=action, obs=obs, discount=0.5, batch_size=32)
    assert t2.obs is obs
    assert t2.discount == 0.5
    assert t2.batch_size == torch.Size([32])
    t3 = Transition(obs, action=action, batch_size=torch.Size([32, 4])[:1])
    assert t3.batch_size == torch.Size([32])
    assert Transition(torch.zeros(()), torch.zeros(())).batch_size == torch.Size([])


def test_batch_size_and_device_are_keyword_only():
    sig = inspect.signature(Transition)
    assert list(sig.parameters) == ["obs", "action", "info", "discount", "batch_size", "device"]
    assert sig.parameters["batch_size"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["device"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(TypeError, match="takes at most 4 positional field values"):
        Transition(torch.zeros(2), torch.zeros(2), None, 0.99, [2])


def test_device_moves_leaves_and_is_kept():
    t = Transition(torch.randn(2, 3), torch.randn(2), batch_size=[2], device="meta")
    assert t.device == torch.device("meta")
    assert t.obs.device.type == "meta"
    assert t.action.device.type == "meta"
    assert (t + 1).device == torch.device("meta")
    assert t.replace(obs=torch.zeros(2, 3)).obs.device.type == "meta"


def test_defaults_factory_kw_only_fields():
    w = WithFactory(torch.ones(3))
    assert torch.equal(w.z, torch.zeros(3))
    assert w.tags == ()
    assert w.step == 0
    w2 = WithFactory(torch.ones(3))
    assert w.z is not w2.z  # a fresh value from the factory each time
    assert WithFactory(torch.ones(3), step=4).step == 4
    with pytest.raises(TypeError, match="takes at most 3 positional"):
        WithFactory(torch.ones(3), torch.ones(3), (), 4)


def test_nested_values_dict_becomes_tensordict():
    t = Transition(torch.zeros(2, 3), torch.zeros(2), {"r": torch.ones(2)}, batch_size=[2])
    assert isinstance(t.info, TensorDict)
    assert t.info.batch_size == torch.Size([2])
    assert torch.equal(t.info["r"], torch.ones(2))


def test_post_init_runs_on_construction_not_on_ops():
    calls = []

    @tensorclass
    class Counted(WithPost):
        def __post_init__(self) -> None:
            calls.append(1)
            super().__post_init__()

    w = Counted(torch.ones(3), batch_size=[3])
    assert torch.equal(w.y, torch.full((3,), 2.0))
    assert len(calls) == 1
    r = (w + 1)[1:].reshape(2).replace(x=torch.zeros(2)).clone()
    assert len(calls) == 1  # operations and .replace do not re-run it
    assert type(r) is Counted
    assert torch.equal(r.y, torch.full((2,), 3.0))
    pytree.tree_unflatten(*pytree.tree_flatten(w))
    assert len(calls) == 1
    w2 = dataclasses.replace(w, x=torch.zeros(3), y=None)  # a user construction: runs it
    assert len(calls) == 2
    assert torch.equal(w2.y, torch.zeros(3))


def test_initvar_is_passed_to_post_init():
    @tensorclass
    class Scaled:
        x: torch.Tensor
        factor: dataclasses.InitVar[float] = 1.0

        def __post_init__(self, factor: float) -> None:
            object.__setattr__(self, "x", self.x * factor)

    s = Scaled(torch.ones(2), 3.0, batch_size=[2])
    assert torch.equal(s.x, torch.full((2,), 3.0))
    assert [f.name for f in dataclasses.fields(Scaled)] == ["x"]
    assert not hasattr(s, "factor") or not isinstance(s.factor, torch.Tensor)


def test_inheritance_adds_fields_and_super_works():
    d = Derived(torch.ones(2), torch.full((), 3.0))
    assert [f.name for f in dataclasses.fields(Derived)] == ["x", "y"]
    assert isinstance(d, Base)
    assert is_tensorclass(d)
    assert d.total().item() == 5.0  # zero-argument super() reaches Base.total
    assert type(d * 2) is Derived
    assert torch.equal((d * 2).y, torch.full((), 6.0))
    assert Derived(torch.ones(2)).y.item() == 1.0


def test_self_referencing_annotation():
    c = Chain(torch.ones(2), Chain(torch.zeros(2), batch_size=[2]), batch_size=[2])
    assert isinstance(c.next, Chain)
    assert c.next.next is None
    assert len(pytree.tree_leaves(c)) == 2
    assert torch.equal((c + 1).next.value, torch.ones(2))


def test_local_classes_and_string_annotations_resolve():
    @tensorclass
    class Leaf:
        v: torch.Tensor

    @tensorclass
    class Holder:
        leaf: Leaf
        maybe: Leaf | None = None

    h = Holder(Leaf(torch.ones(2), batch_size=[2]), batch_size=[2])
    assert type((h + 1).leaf) is Leaf
    assert h.maybe is None
    with pytest.raises(TypeError, match="is annotated Leaf"):
        Holder(torch.ones(2), batch_size=[2])


# ------------------------------------------------------------------------------ dataclass
def test_is_a_frozen_dataclass():
    t = make_transition()
    assert dataclasses.is_dataclass(Transition)
    assert dataclasses.is_dataclass(t)
    assert [f.name for f in dataclasses.fields(Transition)] == ["obs", "action", "info", "discount"]
    assert [f.name for f in dataclasses.fields(t)] == ["obs", "action", "info", "discount"]
    assert Transition.__dataclass_params__.frozen
    assert Transition.__match_args__ == ("obs", "action", "info", "discount")
    assert not hasattr(t, "__dict__")
    assert isinstance(hash(t), int)
    assert set(Transition.__slots__) == {"obs", "action", "info", "discount"}
    assert "frozen_default" in tensorclass.__dataclass_transform__["kwargs"]


def test_pattern_matching():
    t = make_transition()
    match t:
        case Transition(obs, action):
            assert obs is t.obs
            assert action is t.action
        case _:
            pytest.fail("no match")


@pytest.mark.parametrize("how", ["method", "dataclasses"])
def test_replace_keeps_batch_size_device_and_input(how):
    t = Transition(torch.randn(4, 3), torch.randn(4), batch_size=[4], device="cpu")
    before = t.clone()
    new_obs = torch.zeros(4, 3)
    r = t.replace(obs=new_obs) if how == "method" else dataclasses.replace(t, obs=new_obs)
    assert type(r) is Transition
    assert r.obs is new_obs
    assert r.action is t.action
    assert r.batch_size == t.batch_size
    assert r.device == torch.device("cpu")
    assert r.discount == t.discount
    assert_close(t, before)
    r2 = t.replace(discount=0.5) if how == "method" else dataclasses.replace(t, discount=0.5)
    assert r2.discount == 0.5
    with pytest.raises(ValueError, match="field 'obs' has shape \\(5, 3\\)"):
        t.replace(obs=torch.zeros(5, 3)) if how == "method" else dataclasses.replace(
            t, obs=torch.zeros(5, 3)
        )


def test_copy_replace_protocol():
    t = make_transition()
    r = Transition.__replace__(t, discount=0.1)
    assert r.discount == 0.1
    assert r.batch_size == t.batch_size


# ------------------------------------------------------------------------------ frozen
def test_frozen_assignment_and_deletion_raise_with_hint():
    t = make_transition()
    with pytest.raises(dataclasses.FrozenInstanceError) as e:
        t.obs = torch.zeros(8, 3)
    assert str(e.value) == E.FROZEN.format(cls="Transition", what="assign to", name="obs")
    assert "t.replace(obs=...)" in str(e.value)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'obs'"):
        del t.obs
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.new_attribute = 1
    with pytest.raises(TypeError, match="immutable"):
        t["obs"] = torch.zeros(8, 3)


# ------------------------------------------------------------------------------ bad input
def test_missing_required_field():
    with pytest.raises(TypeError) as e:
        Transition(torch.zeros(2, 3), batch_size=[2])
    assert str(e.value) == E.MISSING_FIELD.format(
        cls="Transition", name="action", fields=["obs", "action", "info", "discount"]
    )


def test_unknown_keyword():
    with pytest.raises(TypeError, match="Transition\\(\\) got an unknown field 'reward'"):
        Transition(torch.zeros(2, 3), torch.zeros(2), reward=torch.zeros(2), batch_size=[2])
    t = make_transition()
    with pytest.raises(TypeError, match=r"Transition\.replace\(\) got an unknown field 'reward'"):
        t.replace(reward=torch.zeros(8))
    with pytest.raises(TypeError, match="unknown field 'reward'"):
        dataclasses.replace(t, reward=torch.zeros(8))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"obs": [1.0, 2.0]},
            "field 'obs' is annotated torch.Tensor and needs a tensor, got a value of type list",
        ),
        (
            {"obs": 1.0},
            "field 'obs' is annotated torch.Tensor and needs a tensor, got a value of type float",
        ),
        ({"obs": None}, "field 'obs' is annotated torch.Tensor, which does not allow None"),
        ({"info": torch.zeros(2)}, "field 'info' is annotated TensorDict \\| None and needs"),
        ({"discount": torch.tensor(0.5)}, "field 'discount' is static \\(annotated float\\)"),
        ({"discount": TensorDict()}, "field 'discount' is static"),
        ({"discount": [0.5]}, "static field 'discount' needs a hashable value"),
        ({"discount": (0.5, [1])}, "static field 'discount' needs a hashable value"),
    ],
)
def test_wrong_kind_of_value_is_a_type_error(kwargs, match):
    args = {"obs": torch.zeros(2, 3), "action": torch.zeros(2), **kwargs}
    with pytest.raises(TypeError, match=match):
        Transition(**args, batch_size=[2])
    t = Transition(torch.zeros(2, 3), torch.zeros(2), batch_size=[2])
    with pytest.raises(TypeError, match=match):
        t.replace(**kwargs)


def test_shape_mismatch_names_field_and_shapes():
    expected = E.FIELD_SHAPE.format(cls="Transition", name="obs", shape=(3, 4), batch_size=(2,))
    with pytest.raises(ValueError, match=re.escape(expected)) as e:
        Transition(torch.zeros(3, 4), torch.zeros(2), batch_size=[2])
    assert str(e.value) == expected
    with pytest.raises(ValueError, match=r"field 'info' has shape \(3,\).*batch_size \(2,\)"):
        Transition(torch.zeros(2), torch.zeros(2), TensorDict(batch_size=[3]), batch_size=[2])
    with pytest.raises(ValueError, match="field 'c' has shape \\(4,\\)"):
        Inner(torch.zeros(4), torch.zeros(5), batch_size=[5])


@pytest.mark.parametrize(
    "name",
    [
        "shape",
        "apply",
        "batch_size",
        "device",
        "replace",
        "set",
        "to_tensordict",
        "_batch_size",
        "_tdf_x",
        "__x",
    ],
)
def test_field_name_shadowing_a_method_fails_at_definition(name):
    ns: dict = {"__annotations__": {name: torch.Tensor}, "__module__": __name__}
    cls = type("Bad", (), ns)
    with pytest.raises(TypeError) as e:
        tensorclass(cls)
    assert f"field name {name!r} shadows" in str(e.value)


def test_bad_annotations_fail_at_definition():
    with pytest.raises(TypeError, match="mixes tensor/container types with other types"):

        @tensorclass
        class Mixed:
            x: torch.Tensor | int

    with pytest.raises(TypeError, match="cannot resolve the annotation 'NoSuchType'"):

        @tensorclass
        class Unresolved:
            x: NoSuchType  # noqa: F821

    with pytest.raises(TypeError, match="do not define __slots__"):

        @tensorclass
        class Slotted:
            __slots__ = ("x",)
            x: torch.Tensor

    with pytest.raises(TypeError, match="cannot inherit from TensorDict"):
        tensorclass(type("Sub", (TensorDict,), {"__annotations__": {"x": torch.Tensor}}))


# ------------------------------------------------------------------------------ static / None
def test_static_fields_are_structure():
    a = Transition(torch.zeros(2, 3), torch.zeros(2), discount=0.9, batch_size=[2])
    b = a.replace(discount=0.5)
    _, spec_a = pytree.tree_flatten(a)
    _, spec_b = pytree.tree_flatten(b)
    assert spec_a != spec_b
    assert pytree.tree_flatten(a)[0] == pytree.tree_flatten(b)[0]
    assert pytree.tree_unflatten(pytree.tree_leaves(a), spec_b).discount == 0.5
    with pytest.raises(ValueError, match="different node types or static fields"):
        tdfunc.stack([a, b])
    with pytest.raises(TypeError, match="different node types or static fields"):
        a + b
    assert (a + a).discount == 0.9


def test_none_field_stays_in_structure_not_leaves():
    t = make_transition()
    leaves, spec = pytree.tree_flatten(t)
    assert len(leaves) == 2  # obs, action; info is None
    seen = []
    out = pytree.tree_map(lambda x: seen.append(x.shape) or x * 2, t)
    assert seen == [torch.Size([8, 3]), torch.Size([8])]
    assert out.info is None
    assert pytree.tree_unflatten(leaves, spec).info is None
    assert torch.vmap(lambda s: s * 2)(t).info is None


# ------------------------------------------------------------------------------ reading / set
def test_getitem_get_and_nested_paths():
    o = make_outer()
    assert o["a"] is o.a
    assert o["inner", "c"] is o.inner.c
    assert o["td", "e"] is o.td["e"]
    assert o["name"] == "outer"
    assert o.get("opt") is None
    assert o.get("missing", 3) == 3
    assert o.get(("inner", "zz"), 4) == 4
    with pytest.raises(KeyError, match="key 'missing' not found in Outer"):
        o["missing"]
    with pytest.raises(KeyError, match="not a nested container"):
        o["a", "b"]
    assert o[0].batch_size == torch.Size([3])


def test_set_field_and_nested_path():
    t = make_transition()
    r = t.set("obs", torch.zeros(8, 3))
    assert torch.equal(r.obs, torch.zeros(8, 3))
    assert not torch.equal(t.obs, r.obs)
    r2 = t.set(("info", "next", "obs"), torch.ones(8, 3))  # None TensorDict field is created
    assert torch.equal(r2.info["next", "obs"], torch.ones(8, 3))
    assert t.info is None
    o = make_outer()
    r3 = o.set(("inner", "c"), torch.zeros(4, 3, 2))
    assert type(r3.inner) is Inner
    assert torch.equal(r3.inner.c, torch.zeros(4, 3, 2))
    with pytest.raises(KeyError, match="key 'nope' not found"):
        t.set("nope", torch.zeros(8))
    with pytest.raises(TypeError, match="leads to a Tensor, not a nested container"):
        t.set(("obs", "x"), torch.zeros(8))


def test_tensorclass_inside_tensordict_and_tensordict_inside_tensorclass():
    t = make_transition().set(("info", "r"), torch.ones(8))
    td = TensorDict(t=t, z=torch.zeros(8), batch_size=[8])
    assert type(td["t"]) is Transition
    assert td["t", "info", "r"] is t.info["r"]
    out = (td * 2)[2:]
    assert type(out["t"]) is Transition
    assert out["t"].discount == 0.99
    assert out["t"].batch_size == torch.Size([6])
    assert isinstance(out["t"].info, TensorDict)
    td2 = td.set(("t", "obs"), torch.zeros(8, 3))
    assert type(td2["t"]) is Transition
    assert torch.equal(td2["t", "obs"], torch.zeros(8, 3))
    assert torch.equal(td["t", "obs"], t.obs)
    assert "Transition(" in repr(td)
    assert "discount=0.99" in repr(td)
    assert next(k for k, _ in pytree.tree_flatten_with_path(td)[0]) == (
        pytree.MappingKey("t"),
        pytree.GetAttrKey("obs"),
    )


def test_to_tensordict_and_from_tensordict():
    o = make_outer()
    td = o.to_tensordict()
    assert type(td) is TensorDict
    assert td.keys() == ["a", "inner", "td"]
    assert type(td["inner"]) is TensorDict
    assert td["inner"].batch_size == torch.Size([4, 3, 2])
    back = Outer.from_tensordict(td)
    assert type(back.inner) is Inner
    assert back.name == "outer"
    assert back.opt is None
    assert_close(back, o)
    assert Outer.from_tensordict(td, name="x").name == "x"
    with pytest.raises(KeyError, match="unknown field 'zz'"):
        Outer.from_tensordict(td.set("zz", torch.zeros(4, 3)))
    with pytest.raises(TypeError, match="missing required field 'td'"):
        Outer.from_tensordict(td.exclude("td"))


def test_repr_is_readable():
    o = make_outer()
    text = repr(o)
    assert text.startswith("Outer(\n    a=Tensor(shape=(4, 3, 2), dtype=torch.float32),")
    assert "    inner=Inner(\n        c=Tensor(shape=(4, 3, 2)" in text
    assert "opt=None," in text
    assert "name='outer'," in text
    assert text.endswith("batch_size=(4, 3), device=None)")


# ------------------------------------------------------------------------------ the op corpus
CORPUS = {**OPS, **FLOAT_ONLY}
CONTAINERS = {"outer": make_outer, "flat": make_flat}
# to_dict is the identity on non-TensorDicts in the corpus: nothing to compare with
EAGER_CASES = [
    (c, o)
    for c in CONTAINERS
    for o in CORPUS
    if not (c == "flat" and o in FLOAT_ONLY) and o != "to_dict"
]


@pytest.mark.parametrize(("container", "op"), EAGER_CASES, ids=[f"{c}-{o}" for c, o in EAGER_CASES])
def test_op_corpus_eager_matches_tensordict_and_keeps_class(container, op):
    t = CONTAINERS[container]()
    before = t.clone()
    out = CORPUS[op](t)
    assert_classes(out, t) if not isinstance(out, torch.Tensor) else None
    compare(as_td(out), as_td(CORPUS[op](t.to_tensordict())))
    assert_close(t, before)  # the input is never modified


@pytest.mark.parametrize("op", [o for o in CORPUS if o != "to_dict"])
def test_op_corpus_compiled(op):
    """Every op of the shared corpus over a tensorclass: one frame, equal to eager, no
    recompile on new values."""
    cnt = check_compiled(CORPUS[op], lambda: (make_outer(),))
    assert cnt.frame_count == 1


# ------------------------------------------------------------------------------ compile
def _one_frame(fn, make, **kw):
    cnt = check_compiled(fn, make, **kw)
    assert cnt.frame_count == 1
    return cnt


def test_compiled_construction_positional_keyword_defaults():
    def f(obs, action):
        a = Transition(obs * 2, action, batch_size=[obs.shape[0]])
        b = Transition(action=action + 1, obs=obs, discount=0.5, batch_size=obs.shape[:1])
        return a, b, a.discount + b.discount

    _one_frame(f, lambda: (torch.randn(5, 3), torch.randn(5)))


def test_compiled_construction_factory_post_init_and_inheritance():
    def f(x):
        w = WithFactory(x * 1, step=3)
        p = WithPost(x + 1, batch_size=[3])
        d = Derived(x, x.flip(0), batch_size=[3])
        return w, p, d, d.total()

    _one_frame(f, lambda: (torch.randn(3),))
    x = torch.randn(3)
    p = torch.compile(f, backend="eager", fullgraph=True)(x)[1]
    assert torch.allclose(p.y, (x + 1) * 2)  # __post_init__ ran inside the compiled function


def test_compiled_attribute_access_and_replace_chain():
    def chain(t):
        for i in range(10):
            t = t.replace(obs=t.obs + i, action=t.action * 1)
        return t, t.obs.sum() + t.action.sum()

    _one_frame(chain, lambda: (make_transition(),))
    _one_frame(
        lambda t: dataclasses.replace(t, obs=t.obs * 2, discount=0.1), lambda: (make_transition(),)
    )


def test_compiled_set_to_from_tensordict_and_getitem():
    def f(o):
        r = o.set(("inner", "c"), o["inner", "c"] * 2).set(("td", "new"), o.a[..., 0])
        back = Outer.from_tensordict(r.to_tensordict() + 1, name="y")
        return r, back

    _one_frame(f, lambda: (make_outer(),))


def test_compiled_tensorclass_in_tensordict():
    def f(td):
        t = td["t"]
        return td.set("t", t.replace(obs=t.obs + td["z"][:, None])) * 2

    _one_frame(f, lambda: (TensorDict(t=make_transition(), z=torch.randn(8), batch_size=[8]),))


def test_compiled_no_recompile_across_batch_sizes_with_dynamic():
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(
        lambda t: (t * 2)[1:].replace(action=t.action[1:] + 1),
        backend=cnt,
        fullgraph=True,
        dynamic=True,
    )
    for b in (4, 6, 8):
        t = make_transition(b)
        assert_close(cfn(t), (t * 2)[1:].replace(action=t.action[1:] + 1))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("uses_static", [False, True])
def test_compiled_new_static_value_gives_the_eager_result(uses_static):
    """A static value the graph does not read is copied onto the result at run time (no
    recompile); one the graph reads is guarded on (one recompile per new value)."""

    def f(t):
        return t.replace(obs=t.obs * t.discount) if uses_static else t + 1

    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(f, backend=cnt, fullgraph=True)
    t = make_transition()
    assert_close(cfn(t), f(t))
    t1 = t.replace(obs=torch.randn(8, 3))
    assert_close(cfn(t1), f(t1))
    assert cnt.frame_count == 1
    t2 = t.replace(discount=0.5)
    out = cfn(t2)
    assert out.discount == 0.5
    assert_close(out, f(t2))
    assert cnt.frame_count == (2 if uses_static else 1)


def test_errors_raise_the_same_under_compile():
    # fullgraph=True: dynamo reports the user error it traced as Unsupported, message kept
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"field 'obs' has shape \(3,\)"):
        torch.compile(
            lambda x: Transition(x, x[:2], batch_size=[2]), backend="eager", fullgraph=True
        )(torch.zeros(3))


@pytest.mark.slow
def test_inductor_compiled_construction_and_ops():
    def f(obs, action):
        t = Transition(obs, action, batch_size=[obs.shape[0]])
        t = t.replace(obs=torch.tanh(t.obs) * t.discount)
        return (t + 1).sum(dim=0)

    cfn = torch.compile(f, backend="inductor", fullgraph=True)
    obs, action = torch.randn(6, 3), torch.randn(6)
    assert_close(cfn(obs, action), f(obs, action))


# ------------------------------------------------------------------------------ pytree & co
def test_pytree_keys_roundtrip_and_serialized_type_name():
    o = make_outer()
    pairs, spec = pytree.tree_flatten_with_path(o)
    paths = [
        tuple(k.name if isinstance(k, pytree.GetAttrKey) else k.key for k in p) for p, _ in pairs
    ]
    assert paths == [("a",), ("inner", "c"), ("inner", "d"), ("td", "e")]
    assert isinstance(pairs[0][0][0], pytree.GetAttrKey)
    assert_close(pytree.tree_unflatten([v for _, v in pairs], spec), o)
    restored = pytree.treespec_loads(pytree.treespec_dumps(spec))
    assert restored == spec
    assert pytree.SUPPORTED_SERIALIZED_TYPES[Outer].serialized_type_name == f"{__name__}.Outer"

    @tensorclass(serialized_type_name="tests.Named")
    class Named:
        x: torch.Tensor

    assert pytree.SUPPORTED_SERIALIZED_TYPES[Named].serialized_type_name == "tests.Named"


def test_optree_paths_and_map():
    o = make_outer()
    paths = optree.tree_paths(o, namespace=tdfunc.OPTREE_NAMESPACE)
    assert paths == [("a",), ("inner", "c"), ("inner", "d"), ("td", "e")]
    out = optree.tree_map(lambda x: x * 0, o, namespace=tdfunc.OPTREE_NAMESPACE)
    assert type(out) is Outer
    assert type(out.inner) is Inner
    assert out.name == "outer"
    assert_close(out, o * 0)


def test_vmap_in_and_out():
    t = make_transition()
    out = torch.vmap(lambda s: s.replace(obs=s.obs * s.action))(t)
    assert type(out) is Transition
    assert out.batch_size == torch.Size([8])
    assert torch.allclose(out.obs, t.obs * t.action[:, None])
    seen = []
    torch.vmap(lambda s: seen.append(s.batch_size) or s.obs.sum())(t)
    assert seen == [torch.Size([])]
    o = make_outer()
    r = torch.vmap(torch.vmap(lambda s: s + 1))(o)
    assert_close(r, o + 1)


def test_export_and_save_load_roundtrip():
    class M(torch.nn.Module):
        def forward(self, t: Transition) -> Transition:
            return t.replace(obs=t.obs * t.discount + t.action[:, None])

    t = make_transition()
    ep = torch.export.export(M(), (t,))
    assert_close(ep.module()(t), M()(t))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    t2 = make_transition()
    assert_close(loaded.module()(t2), M()(t2))
    # a dynamic batch: one spec per data field, in field order (None fields are not children)
    b = torch.export.Dim("b")
    ep_dyn = torch.export.export(M(), (t,), dynamic_shapes=([{0: b}, {0: b}],))
    t5 = make_transition(5)
    assert_close(ep_dyn.module()(t5), M()(t5))


def test_assert_close_with_tensorclasses():
    t = make_transition()
    assert_close(t, t.clone())
    with pytest.raises(AssertionError, match="static fields differ"):
        assert_close(t, t.replace(discount=0.1))
    with pytest.raises(AssertionError, match="key 'obs'"):
        assert_close(t, t.replace(obs=t.obs + 1))
    with pytest.raises(AssertionError, match="type"):
        assert_close(t, t.to_tensordict())


def test_pickle_copy_and_torch_load_weights_only():
    o = make_outer()
    assert_close(pickle.loads(pickle.dumps(o)), o)
    assert_close(copy.deepcopy(o), o)
    assert copy.copy(o).a is o.a
    buf = io.BytesIO()
    torch.save(o, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is Outer
    assert loaded.name == "outer"
    assert_close(loaded, o)


def test_elementwise_comparisons_give_bool_tensorclass():
    t = make_transition()
    eq = t == t.replace(obs=torch.zeros(8, 3))
    assert type(eq) is Transition
    assert eq.obs.dtype == torch.bool
    assert bool(eq.action.all())
    assert not bool(eq.obs.all())
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(t == t)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), min_size=0, max_size=3),
    feat=st.lists(st.integers(1, 3), max_size=2),
    with_info=st.booleans(),
    discount=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_property_roundtrips_and_ops_never_change_input(batch, feat, with_info, discount, seed):
    g = torch.Generator().manual_seed(seed)
    b = tuple(batch)
    info = (
        TensorDict(r=torch.randn((*b, 2), generator=g), batch_size=(*b, 2)) if with_info else None
    )
    t = Transition(
        torch.randn(b + tuple(feat), generator=g),
        torch.randn(b, generator=g),
        info,
        discount,
        batch_size=b,
    )
    before = copy.deepcopy(t)
    leaves, spec = pytree.tree_flatten(t)
    assert len(leaves) == 2 + with_info
    assert_close(pytree.tree_unflatten(leaves, spec), t)
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec
    o_leaves, o_spec = optree.tree_flatten(t, namespace=tdfunc.OPTREE_NAMESPACE)
    assert_close(optree.tree_unflatten(o_spec, o_leaves), t)
    outs = [t + 1, t.clone(), t.apply(torch.neg), t.unsqueeze(0), tdfunc.stack([t, t])]
    if b:
        outs += [t[0], t.reshape(-1), *t.unbind(0)]
    for out in outs:
        assert type(out) is Transition
        assert out.discount == t.discount
        assert (out.info is None) == (info is None)
    assert_close(t, before)


def test_is_tensorclass():
    assert is_tensorclass(Transition)
    assert is_tensorclass(make_transition())
    assert not is_tensorclass(TensorDict())
    assert not is_tensorclass(int)


def test_type_hints_see_the_fields():
    hints = typing.get_type_hints(Transition)
    assert hints["obs"] is torch.Tensor
    assert hints["discount"] is float


def test_a_field_may_take_the_name_of_a_lifted_torch_method() -> None:
    """``max``, ``sign``, ``exp``... are methods installed from the lifted-op table; a field of
    that name shadows the method on its class (as a field shadows a method of a dataclass),
    and the torch function still lifts over the instance. Core names stay reserved."""

    @tensorclass
    class Stats:
        max: torch.Tensor
        sign: torch.Tensor
        obs: torch.Tensor

    s = Stats(max=torch.ones(3, 2), sign=torch.zeros(3), obs=torch.randn(3, 4), batch_size=[3])
    assert s.max.shape == (3, 2)
    assert torch.equal(s.sign, torch.zeros(3))
    m = torch.max(s, 0)
    assert_close(m.values.obs, s.obs.max(0).values)
    assert torch.equal(m.values.max, torch.ones(2))
    assert m.values.batch_size == ()
    assert torch.equal(torch.exp(s).sign, torch.ones(3))

    counter = CompileCounterWithBackend("eager")
    f = torch.compile(lambda s: torch.exp(s).sign + s.max.sum(-1), fullgraph=True, backend=counter)
    assert torch.equal(f(s), torch.full((3,), 3.0))
    assert counter.frame_count == 1
    with pytest.raises(TypeError, match="the tensorclass attribute"):

        @tensorclass
        class Bad:
            batch_size: torch.Tensor
