"""Key-routed modules: tdfunc.nn.TensorDictModule and TensorDictSequential."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from helpers import check_compiled, compare, snapshot
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
import tdfunc.nn
from tdfunc import TensorDict, tensorclass
from tdfunc.nn import TensorDictModule, TensorDictSequential
from tdfunc.nn import _routing as R
from tdfunc.testing import assert_close


def make_td(b: int = 4) -> TensorDict:
    return TensorDict(
        {"obs": torch.randn(b, 3), "state": {"h": torch.randn(b, 5)}, "reward": torch.randn(b)},
        batch_size=[b],
    )


def mlp(i: int = 3, o: int = 2, hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(i, hidden), nn.Tanh(), nn.Linear(hidden, o))


def actor_critic() -> TensorDictSequential:
    return TensorDictSequential(
        TensorDictModule(mlp(3, 8), in_keys="obs", out_keys="hidden"),
        TensorDictModule(nn.Linear(8, 2), in_keys="hidden", out_keys=("actor", "logits")),
        TensorDictModule(nn.Linear(8, 1), in_keys=["hidden"], out_keys=[("critic", "value")]),
    )


class Counting:
    """A callable that counts its calls (to show an error came before the module ran)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def same_input(td, before):
    """The input still has exactly its old structure and values."""
    assert_close(td, before)


# ================================================================== construction / attributes
def test_keys_are_normalised_and_readable():
    m = TensorDictModule(lambda x, y: x, in_keys=["a", ("b",), ("n", "c")], out_keys="y")
    assert m.in_keys == ["a", "b", ("n", "c")]
    assert m.out_keys == ["y"]
    assert m.in_kwargs is None
    m.in_keys.append("zzz")  # a fresh list: the module is unchanged
    assert m.in_keys == ["a", "b", ("n", "c")]
    # a tuple of strings is one nested key, as in tensordict
    assert TensorDictModule(lambda x: x, ("n", "c"), ("o", "p")).in_keys == [("n", "c")]


def test_repr_names_keys_and_module():
    m = TensorDictModule(nn.Linear(3, 2), in_keys="obs", out_keys="act")
    assert "in_keys=['obs'], out_keys=['act']" in repr(m)
    assert "Linear" in repr(m)
    assert "module=<lambda>" in repr(TensorDictModule(lambda x: x, "a", "b"))
    seq = actor_critic()
    assert "in_keys=['obs']" in repr(seq)


@pytest.mark.parametrize(
    ("in_keys", "out_keys", "exc", "msg"),
    [
        ([1], "y", TypeError, R.BAD_KEY.format(what="in_keys", key=1)),
        ("", "y", TypeError, R.BAD_KEY.format(what="in_keys", key="")),
        (["a"], [("a", 2)], TypeError, R.BAD_KEY.format(what="out_keys", key=("a", 2))),
        (5, "y", TypeError, R.BAD_KEYS_ARG.format(what="in_keys", typ="int")),
        ({3: "a"}, "y", TypeError, R.BAD_KWARG.format(name=3)),
        ("a", [], ValueError, R.NO_OUT_KEYS),
        ("a", ["y", "y"], ValueError, R.DUPLICATE_OUT_KEY.format(out_keys=["y", "y"], key="'y'")),
        (
            "a",
            ["y", ("y", "z")],
            ValueError,
            R.NESTED_OUT_KEYS.format(out_keys=["y", ("y", "z")], inner="('y', 'z')", outer="'y'"),
        ),
    ],
)
def test_bad_construction(in_keys, out_keys, exc, msg):
    with pytest.raises(exc, match=re.escape(msg)):
        TensorDictModule(lambda *a: a, in_keys, out_keys)


def test_module_must_be_callable():
    with pytest.raises(TypeError, match=re.escape(R.NOT_CALLABLE.format(typ="int"))):
        TensorDictModule(3, "a", "b")


def test_state_dict_layout_matches_tensordict():
    tdn = pytest.importorskip("tensordict.nn")
    torch.manual_seed(0)
    ours = TensorDictSequential(
        TensorDictModule(nn.Linear(3, 4), ["a"], ["b"]), TensorDictModule(mlp(4, 2), ["b"], ["c"])
    )
    theirs = tdn.TensorDictSequential(
        tdn.TensorDictModule(nn.Linear(3, 4), ["a"], ["b"]),
        tdn.TensorDictModule(mlp(4, 2), ["b"], ["c"]),
    )
    assert list(ours.state_dict()) == list(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())  # checkpoints move across
    x = torch.randn(5, 3)
    got = ours(TensorDict(a=x, batch_size=[5]))["c"]
    import tensordict

    expected = theirs(tensordict.TensorDict({"a": x}, batch_size=[5]))["c"]
    torch.testing.assert_close(got, expected)


# ================================================================== TensorDictModule forward
def test_single_output_returns_new_td_and_keeps_input():
    net = mlp()
    m = TensorDictModule(net, in_keys=["obs"], out_keys=["action"])
    td = make_td()
    before = snapshot(td)
    out = m(td)
    assert out is not td
    assert isinstance(out, TensorDict)
    assert out.keys() == ["obs", "state", "reward", "action"]
    assert out.batch_size == torch.Size([4])
    torch.testing.assert_close(out["action"], net(td["obs"]))
    assert out["obs"] is td["obs"]
    assert out["state"] is td["state"]
    assert "action" not in td
    same_input(td, before)


def test_several_outputs_tuple_or_list_and_nested_keys():
    m = TensorDictModule(
        lambda x, h: [x.sum(-1), h * 2],
        in_keys=["obs", ("state", "h")],
        out_keys=[("stats", "s"), ("state", "h2")],
    )
    td = make_td()
    before = snapshot(td)
    out = m(td)
    torch.testing.assert_close(out["stats", "s"], td["obs"].sum(-1))
    torch.testing.assert_close(out["state", "h2"], td["state", "h"] * 2)
    assert out["state"].keys() == ["h", "h2"]  # the existing nested TensorDict gained a key
    assert out["stats"].batch_size == torch.Size([4])  # new levels take the parent's batch size
    assert td["state"].keys() == ["h"]
    same_input(td, before)


def test_single_output_as_one_tuple():
    out = TensorDictModule(lambda x: (x + 1,), "obs", "y")(make_td())
    torch.testing.assert_close(out["y"], out["obs"] + 1)


def test_mapping_in_keys_pass_keywords():
    def f(*, scale, x):
        return x * scale

    m = TensorDictModule(f, in_keys={"x": "obs", "scale": ("state", "s")}, out_keys="y")
    assert m.in_keys == ["obs", ("state", "s")]
    assert m.in_kwargs == ("x", "scale")
    td = TensorDict(obs=torch.randn(2, 3), state={"s": torch.full((2, 1), 3.0)}, batch_size=[2])
    torch.testing.assert_close(m(td)["y"], td["obs"] * 3)


def test_overwrite_existing_tensor_key_is_pure():
    m = TensorDictModule(lambda x: x * 0, "obs", "obs")
    td = make_td()
    before = snapshot(td)
    out = m(td)
    assert out.keys() == td.keys()  # order kept
    assert torch.equal(out["obs"], torch.zeros(4, 3))
    same_input(td, before)


def test_output_may_be_a_container():
    m = TensorDictModule(
        lambda x: TensorDict(mu=x, sigma=x.exp(), batch_size=x.shape[:1]), "obs", "dist"
    )
    td = make_td()
    out = m(td)
    assert isinstance(out["dist"], TensorDict)
    torch.testing.assert_close(out["dist", "sigma"], td["obs"].exp())
    # a container may replace a container
    out2 = TensorDictModule(lambda h: TensorDict(z=h, batch_size=[4]), ("state", "h"), "state")(td)
    assert out2["state"].keys() == ["z"]


def test_two_batch_dims_and_device():
    td = TensorDict(x=torch.randn(2, 3, 4), batch_size=[2, 3], device="cpu")
    out = TensorDictModule(nn.Linear(4, 5), "x", ("n", "y"))(td)
    assert out["n"].batch_size == torch.Size([2, 3])
    assert out["n", "y"].shape == (2, 3, 5)
    assert out.device == torch.device("cpu")
    assert out["n"].device == torch.device("cpu")


def test_gradients_flow_through_outputs():
    net = nn.Linear(3, 1)
    out = TensorDictModule(net, "obs", "v")(make_td())
    out["v"].sum().backward()
    assert net.weight.grad is not None
    assert net.weight.grad.abs().sum() > 0


def test_hooks_fire_and_reassigned_module_is_used():
    seq = actor_critic()
    seen = []
    seq.module[1].register_forward_hook(lambda mod, args, out: seen.append(sorted(out.keys())))
    seq(make_td())
    assert seen == [["actor", "hidden", "obs", "reward", "state"]]
    m = TensorDictModule(nn.Linear(3, 2), "obs", "y")
    m.module = nn.Identity()
    td = make_td()
    assert torch.equal(m(td)["y"], td["obs"])
    assert list(m.state_dict()) == []


def test_deepcopy_is_independent():
    seq = actor_critic()
    dup = copy.deepcopy(seq)
    with torch.no_grad():
        for p in dup.parameters():
            p.zero_()
    td = make_td()
    assert torch.equal(dup(td)["actor", "logits"], torch.zeros(4, 2))
    assert seq(td)["actor", "logits"].abs().sum() > 0


def test_plain_vmap_over_the_batch():
    seq = actor_critic()
    td = make_td()
    out = torch.vmap(seq)(td)
    assert out.batch_size == torch.Size([4])
    assert_close(out, seq(td), rtol=1e-5, atol=1e-6)


# ================================================================== bad input
def test_missing_in_key_names_key_and_module_before_calling():
    f = Counting(lambda x: x)
    m = TensorDictModule(f, ["obs", ("state", "nope")], "y")
    td = make_td()
    with pytest.raises(KeyError) as ei:
        m(td)
    expected = R.MISSING_IN_KEY.format(
        module=m._name, key="('state', 'nope')", cls="TensorDict", available=[("state", "h")]
    )
    assert ei.value.args[0] == expected
    assert "TensorDictModule(module=Counting" in expected
    assert f.calls == 0
    with pytest.raises(KeyError, match=re.escape("needs key 'missing'")):
        TensorDictModule(f, "missing", "y")(td)


def test_in_key_through_a_leaf():
    m = TensorDictModule(lambda x: x, ("obs", "x"), "y")
    msg = R.IN_KEY_THROUGH_LEAF.format(
        module=m._name, key="('obs', 'x')", prefix="'obs'", kind="Tensor"
    )
    with pytest.raises(KeyError, match=re.escape(msg)):
        m(make_td())


@pytest.mark.parametrize(
    ("fn", "out_keys", "got"),
    [
        (lambda x: (x, x), ["y"], 2),
        (lambda x: x, ["y", "z"], 1),
        (lambda x: (x, x, x), ["y", "z"], 3),
    ],
)
def test_output_count_mismatch(fn, out_keys, got):
    m = TensorDictModule(fn, "obs", out_keys)
    td = make_td()
    before = snapshot(td)
    msg = R.OUTPUT_COUNT.format(module=m._name, got=got, expected=len(out_keys), out_keys=out_keys)
    with pytest.raises(ValueError, match=re.escape(msg)):
        m(td)
    same_input(td, before)


def test_overwriting_a_nested_container_with_a_tensor():
    m = TensorDictModule(lambda x, r: (x, r), ["obs", "reward"], ["y", "state"])
    td = make_td()
    before = snapshot(td)
    msg = R.OVERWRITE_SUBTREE.format(
        module=m._name, kind="TensorDict", key="'state'", typ="Tensor", hint="('state', 'value')"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        m(td)
    same_input(td, before)


def test_writing_below_a_tensor():
    m = TensorDictModule(lambda x: x, "obs", ("reward", "x", "y"))
    msg = R.WRITE_THROUGH_LEAF.format(
        module=m._name, key="('reward', 'x', 'y')", prefix="'reward'", kind="Tensor"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        m(make_td())


@pytest.mark.parametrize(("value", "typ"), [(None, "NoneType"), (3, "int")])
def test_output_of_a_wrong_kind(value, typ):
    m = TensorDictModule(lambda x: value, "obs", ("n", "y"))
    msg = R.OUTPUT_KIND.format(module=m._name, typ=typ, key="('n', 'y')")
    with pytest.raises(TypeError, match=re.escape(msg)):
        m(make_td())


def test_output_without_the_batch_dims():
    m = TensorDictModule(lambda x: x.sum(0), "obs", "y")
    msg = R.OUTPUT_SHAPE.format(module=m._name, key="'y'", shape=(3,), batch_size=(4,))
    with pytest.raises(ValueError, match=re.escape(msg)):
        m(make_td())


def test_input_must_be_a_container():
    m = TensorDictModule(lambda x: x, "obs", "y")
    with pytest.raises(
        TypeError, match=re.escape(R.NOT_A_CONTAINER.format(module=m._name, typ="dict"))
    ):
        m({"obs": torch.zeros(3)})


# ================================================================== tensorclass inputs
@tensorclass
class Step:
    obs: torch.Tensor
    action: torch.Tensor | None = None
    extra: TensorDict | None = None
    discount: float = 0.9


def test_tensorclass_keeps_its_class_and_static_fields():
    net = nn.Linear(3, 2)
    step = Step(torch.randn(4, 3), batch_size=[4])
    out = TensorDictModule(net, "obs", "action")(step)
    assert type(out) is Step
    assert out.discount == 0.9
    torch.testing.assert_close(out.action, net(step.obs))
    assert step.action is None  # input unchanged
    # a static field can be read; a None TensorDict field gets a new nested TensorDict
    out2 = TensorDictModule(lambda x, d: x * d, ["obs", "discount"], ("extra", "y"))(step)
    assert type(out2) is Step
    assert isinstance(out2.extra, TensorDict)
    torch.testing.assert_close(out2.extra["y"], step.obs * 0.9)


def test_tensorclass_out_key_must_be_a_field():
    step = Step(torch.randn(4, 3), batch_size=[4])
    m = TensorDictModule(lambda x: x, "obs", "value")
    msg = R.NOT_A_FIELD.format(
        module=m._name, key="'value'", cls="Step", field="value", fields=["obs", "action", "extra"]
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        m(step)


def test_tensorclass_nested_in_a_tensordict():
    td = TensorDict(step=Step(torch.randn(4, 3), batch_size=[4]), batch_size=[4])
    out = TensorDictModule(nn.Linear(3, 2), ("step", "obs"), ("step", "action"))(td)
    assert type(out["step"]) is Step
    assert out["step", "action"].shape == (4, 2)
    assert td["step"].action is None


def test_tensorclass_compiled_sequential():
    seq = TensorDictSequential(
        TensorDictModule(nn.Linear(3, 2), "obs", "action"),
        TensorDictModule(lambda a, d: a * d, ["action", "discount"], ("extra", "v")),
    )
    check_compiled(seq, lambda: (Step(torch.randn(4, 3), batch_size=[4]),))


# ================================================================== TensorDictSequential
def test_sequential_runs_in_order_and_sees_previous_outputs():
    seq = actor_critic()
    td = make_td()
    before = snapshot(td)
    out = seq(td)
    m0, m1, m2 = seq.module
    hidden = m0.module(td["obs"])
    torch.testing.assert_close(out["hidden"], hidden)
    torch.testing.assert_close(out["actor", "logits"], m1.module(hidden))
    torch.testing.assert_close(out["critic", "value"], m2.module(hidden))
    assert out.keys() == ["obs", "state", "reward", "hidden", "actor", "critic"]
    same_input(td, before)


def test_sequential_keys():
    seq = TensorDictSequential(
        TensorDictModule(lambda a, b: a + b, ["a", ("n", "b")], "c"),
        TensorDictModule(lambda c, a: (c, a), ["c", "a"], [("m", "x"), "d"]),
        TensorDictModule(lambda x, e: x, [("m", "x"), "e"], "a"),  # overwrites an input key
        TensorDictModule(lambda n: n, "m", "f"),  # reads a level a module created
    )
    assert seq.in_keys == ["a", ("n", "b"), "e"]
    assert seq.out_keys == ["c", ("m", "x"), "d", "a", "f"]
    assert seq.selected_out_keys is None


def test_nested_sequential():
    inner = actor_critic()
    outer = TensorDictSequential(
        TensorDictModule(lambda x: x * 2, "raw", "obs"),
        inner,
        TensorDictModule(lambda v: v.squeeze(-1), ("critic", "value"), "v"),
    )
    assert outer.in_keys == ["raw"]
    assert outer.out_keys == ["obs", "hidden", ("actor", "logits"), ("critic", "value"), "v"]
    td = TensorDict(raw=torch.randn(4, 3), batch_size=[4])
    out = outer(td)
    assert_close(
        out.exclude("v"), inner(TensorDict(raw=td["raw"], obs=td["raw"] * 2, batch_size=[4]))
    )


def test_selected_out_keys_return_input_plus_selection():
    seq = TensorDictSequential(
        TensorDictModule(lambda x: x * 0, "obs", "obs"),  # an intermediate overwriting an input
        TensorDictModule(lambda x: x + 1, "obs", ("out", "y")),
        selected_out_keys=[("out", "y")],
    )
    assert seq.out_keys == [("out", "y")]
    assert seq.selected_out_keys == [("out", "y")]
    td = make_td()
    out = seq(td)
    assert out.keys() == ["obs", "state", "reward", "out"]
    assert out["obs"] is td["obs"]  # not selected: the input value stays
    assert torch.equal(out["out", "y"], torch.ones(4, 3))


def test_with_out_keys_returns_a_new_sequence_sharing_modules():
    seq = actor_critic()
    sel = seq.with_out_keys(("actor", "logits"))
    assert sel is not seq
    assert seq.selected_out_keys is None
    assert sel.out_keys == [("actor", "logits")]
    assert all(a is b for a, b in zip(sel.parameters(), seq.parameters()))
    td = make_td()
    out = sel(td)
    assert out.keys() == ["obs", "state", "reward", "actor"]
    torch.testing.assert_close(out["actor", "logits"], seq(td)["actor", "logits"])


def test_selecting_a_key_nothing_writes():
    seq = actor_critic()
    msg = R.NOT_AN_OUT_KEY.format(seq="TensorDictSequential", key="'nope'", out_keys=seq.out_keys)
    with pytest.raises(KeyError, match=re.escape(msg)):
        seq.with_out_keys("nope")


def test_sequential_missing_key_raised_before_any_module_runs():
    first = Counting(lambda x: x)
    seq = TensorDictSequential(
        TensorDictModule(first, "obs", "a"),
        TensorDictModule(lambda a, g: a, ["a", ("goal", "pos")], "b"),
    )
    td = make_td()
    with pytest.raises(KeyError) as ei:
        seq(td)
    expected = R.SEQ_MISSING_IN_KEY.format(
        seq=seq._name,
        key="('goal', 'pos')",
        index=1,
        module=seq.module[1]._name,
        cls="TensorDict",
        available=["obs", "state", "reward"],
    )
    assert ei.value.args[0] == expected
    assert first.calls == 0


def test_sequential_rejects_plain_modules_and_nothing():
    with pytest.raises(TypeError, match=re.escape(R.NOT_KEY_ROUTED.format(index=1, typ="Linear"))):
        TensorDictSequential(TensorDictModule(lambda x: x, "a", "b"), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=re.escape(R.NO_MODULES)):
        TensorDictSequential()


def test_sequential_propagates_module_errors():
    seq = TensorDictSequential(TensorDictModule(lambda x: (x, x), "obs", "a"))
    with pytest.raises(ValueError, match="returned 2 output"):
        seq(make_td())


# ================================================================== compile
def test_module_compiles_fullgraph_without_recompiles():
    m = TensorDictModule(mlp(), in_keys={"input": "obs"}, out_keys=[("n", "a")])
    check_compiled(m, lambda: (make_td(),))


def test_sequential_compiles_fullgraph_with_selection():
    seq = actor_critic().with_out_keys(("critic", "value"), "hidden")
    cnt = check_compiled(seq, lambda: (make_td(),))
    td = make_td()
    before = snapshot(td)
    out = torch.compile(seq, fullgraph=True, backend=cnt)(td)
    assert out.keys() == ["obs", "state", "reward", "critic", "hidden"]
    same_input(td, before)
    assert cnt.frame_count == 1


def test_sequential_compile_zero_graph_breaks_and_backward():
    torch.manual_seed(0)
    seq = actor_critic()
    explanation = torch._dynamo.explain(seq)(make_td())
    assert explanation.graph_count == 1
    assert explanation.graph_break_count == 0
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    cseq = torch.compile(seq, fullgraph=True, backend=cnt)
    td = make_td()

    def loss(out):
        return out["actor", "logits"].sum() + out["critic", "value"].pow(2).sum()

    loss(cseq(td)).backward()
    grads = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    loss(seq(td)).backward()
    for g, p in zip(grads, seq.parameters()):
        torch.testing.assert_close(g, p.grad)
    cseq(make_td())
    assert cnt.frame_count == 1


def test_inductor_compiled_sequential():
    seq = actor_critic()
    cseq = torch.compile(seq, fullgraph=True)
    td = make_td()
    assert_close(cseq(td), seq(td), rtol=1e-4, atol=1e-5)
    td2 = make_td()
    assert_close(cseq(td2), seq(td2), rtol=1e-4, atol=1e-5)


def test_errors_raise_the_same_under_compile():
    m = TensorDictModule(lambda x: (x, x), "obs", "y")
    with pytest.raises(ValueError, match=re.escape("returned 2 output(s)")):
        torch.compile(m, backend="eager")(make_td())


# ================================================================== composition with tdfunc.nn
def test_from_module_gives_all_wrapped_parameters():
    seq = actor_critic()
    params = tdfunc.from_module(seq)
    flat = params.flatten_keys(".")
    assert sorted(flat.keys()) == sorted(seq.state_dict())
    assert params["module", "1", "module", "weight"] is seq.module[1].module.weight


def test_functional_call_swaps_parameters():
    seq = actor_critic()
    params = tdfunc.from_module(seq)
    zeros = params.apply(torch.zeros_like)
    td = make_td()
    out = tdfunc.functional_call(seq, zeros, (td,))
    assert torch.equal(out["actor", "logits"], torch.zeros(4, 2))
    # the module's own parameters are untouched
    assert_close(seq(td), tdfunc.functional_call(seq, params, (td,)))
    assert seq.module[1].module.weight.abs().sum() > 0


def _ensemble(n: int = 3):
    members = [actor_critic() for _ in range(n)]
    params = tdfunc.stack_modules(members)
    base = members[0]

    def call(p, td):
        return tdfunc.functional_call(base, p, (td,))

    return members, params, torch.vmap(call, (0, None))


def test_vmap_ensemble_of_a_sequential():
    members, params, ens = _ensemble()
    assert params.batch_size == torch.Size([3])
    td = make_td()
    out = ens(params, td)
    assert isinstance(out, TensorDict)
    assert out.batch_size == torch.Size([3, 4])
    for i, member in enumerate(members):
        assert_close(out[i], member(td), rtol=1e-5, atol=1e-6)


def test_vmap_ensemble_compiles_fullgraph():
    _, params, ens = _ensemble()
    check_compiled(ens, lambda: (params, make_td()))


@pytest.mark.parametrize("strict", [False, True])
def test_export_sequential_taking_and_returning_a_tensordict(strict):
    seq = actor_critic()
    ep = torch.export.export(seq, (make_td(),), strict=strict)
    td = make_td()
    got = ep.module()(td)
    assert isinstance(got, TensorDict)
    assert_close(got, seq(td))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    compare(loaded.module()(td), seq(td))


# ================================================================== keyword tensors, plain steps,
# nested tuple keys (the call forms of tensordict.nn)
def test_keyword_tensors_return_the_outputs():
    m = TensorDictModule(lambda x, y: (x * y, x + y), in_keys=["x", "y"], out_keys=["z", "w"])
    x, y = torch.randn(3), torch.randn(3)
    z, w = m(x=x, y=y)
    torch.testing.assert_close(z, x * y)
    torch.testing.assert_close(w, x + y)
    one = TensorDictModule(lambda x: x + 1, in_keys=["x"], out_keys=["z"])
    torch.testing.assert_close(one(x=x), x + 1)


def test_keyword_tensors_for_nested_in_keys_use_underscores():
    m = TensorDictModule(lambda h, o: h.sum(-1) + o, [("state", "h"), "obs"], [("out", "v")])
    h, o = torch.randn(5), torch.randn(())
    torch.testing.assert_close(m(state_h=h, obs=o), h.sum(-1) + o)


def test_keyword_call_errors():
    m = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["z"])
    with pytest.raises(TypeError, match=re.escape("unexpected keyword input(s) ['q']")):
        m(x=torch.zeros(1), q=torch.zeros(1))
    with pytest.raises(TypeError, match=re.escape("pass either a TensorDict")):
        m(TensorDict(x=torch.zeros(1)), x=torch.zeros(1))
    with pytest.raises(TypeError, match=re.escape("no input")):
        m()


def test_sequential_keyword_tensors_return_every_out_key():
    seq = TensorDictSequential(
        TensorDictModule(lambda x, y: x + y, in_keys=["x", "y"], out_keys=["z"]),
        TensorDictModule(lambda x, z: z * x, in_keys=["x", "z"], out_keys=["out"]),
    )
    x, y = torch.randn(3), torch.randn(3)
    z, out = seq(x=x, y=y)
    torch.testing.assert_close(out, (x + y) * x)
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(seq, fullgraph=True, backend=cnt)
    compare(compiled(x=x, y=y), (z, out))
    compiled(x=torch.randn(3), y=torch.randn(3))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_keyword_tensors(strict):
    m = TensorDictModule(lambda x, y: x * y, in_keys=["x", "y"], out_keys=["z"])
    x, y = torch.randn(3), torch.randn(3)
    ep = torch.export.export(m, args=(), kwargs={"x": x, "y": y}, strict=strict)
    x2, y2 = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(ep.module()(x=x2, y=y2), x2 * y2)
    seq = TensorDictSequential(
        TensorDictModule(lambda x, y: x * y, in_keys=["x", "y"], out_keys=["z"]),
        TensorDictModule(lambda z, x: z + x, in_keys=["z", "x"], out_keys=["out"]),
    )
    ep = torch.export.export(seq, args=(), kwargs={"x": x, "y": y}, strict=strict)
    torch.testing.assert_close(ep.module()(x=x2, y=y2), seq(x=x2, y=y2))


def test_plain_functions_inside_a_sequential():
    seq = TensorDictSequential(
        lambda td: td.set("copied", td["obs"] * 1),
        TensorDictModule(mlp(3, 8), in_keys="copied", out_keys="hidden"),
        TensorDictModule(nn.Linear(8, 2), in_keys="hidden", out_keys=("c", "d")),
        lambda td: td.exclude("hidden"),
    )
    td = make_td()
    before = snapshot(td)
    out = seq(td)
    assert sorted(out.keys()) == ["c", "copied", "obs", "reward", "state"]
    assert_close(td, before)
    check_compiled(seq, lambda: (make_td(),))
    # a plain function declares no keys: later in keys are checked when they are read
    assert seq.in_keys == []
    assert len(list(seq.parameters())) == 6


def test_plain_function_must_return_a_container():
    seq = TensorDictSequential(lambda td: td["obs"])
    with pytest.raises(TypeError, match=re.escape("step 0 (<lambda>) returned a Tensor")):
        seq(make_td())


def test_nested_tuple_keys_are_unravelled():
    m = TensorDictModule(lambda x: x + 1, in_keys=[(((("a",),),),)], out_keys=[(("c",), "d")])
    assert m.in_keys == ["a"]
    assert m.out_keys == [("c", "d")]
    out = m(TensorDict(a=torch.zeros(2), batch_size=[2]))
    assert out["c", "d"].tolist() == [1.0, 1.0]
    seq = TensorDictSequential(m, TensorDictModule(lambda v: v * 2, [("c", ("d",))], ["e"]))
    assert seq(TensorDict(a=torch.zeros(2)))["e"].tolist() == [2.0, 2.0]
    check_compiled(m, lambda: (TensorDict(a=torch.randn(2), batch_size=[2]),))


# ================================================================== tensordict's in-place names
def test_select_out_keys_is_in_place_in_tensordict_so_it_raises_naming_with_out_keys():
    """tensordict's ``select_out_keys`` changes the module; a discarded result here would be
    a silent no-op, so the name raises InPlaceError naming the pure spelling."""
    seq = actor_critic()
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("seq = seq.with_out_keys('hidden')")):
        seq.select_out_keys("hidden")
    assert seq.selected_out_keys is None  # left as it was
    with pytest.raises(TypeError, match=r"TensorDictSequential\(\*seq.module\)"):
        seq.reset_out_keys()
    m = TensorDictModule(lambda x: (x, x), in_keys="a", out_keys=["b", "c"])
    with pytest.raises(
        tdfunc.InPlaceError, match=re.escape("TensorDictSequential(m).with_out_keys('b')")
    ):
        m.select_out_keys("b")
    with pytest.raises(AttributeError):  # InPlaceError is an AttributeError too
        m.reset_out_keys()
    out = TensorDictSequential(m).with_out_keys("b")(tdfunc.TensorDict(a=torch.ones(2)))
    assert out.keys() == ["a", "b"]


def test_tensordict_select_out_keys_is_in_place_there():
    """The oracle: tensordict's select_out_keys changes the module it is called on."""
    tdnn = pytest.importorskip("tensordict.nn")
    m = tdnn.TensorDictSequential(
        tdnn.TensorDictModule(lambda x: x + 1, in_keys=["a"], out_keys=["b"]),
        tdnn.TensorDictModule(lambda x: x * 2, in_keys=["b"], out_keys=["c"]),
    )
    m.select_out_keys("c")
    assert m.out_keys == ["c"]
    ours = TensorDictSequential(
        TensorDictModule(lambda x: x + 1, in_keys="a", out_keys="b"),
        TensorDictModule(lambda x: x * 2, in_keys="b", out_keys="c"),
    )
    assert ours.with_out_keys("c").out_keys == m.out_keys
