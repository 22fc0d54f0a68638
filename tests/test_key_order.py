"""Containers meet by key, not by position (_tree.reorder_like, _ops.match_structure): two
operands with the same keys in another order give the value of the first operand's order,
eager and compiled; only a different key set is an error. ``select`` returns the order asked
for; ``assert_close`` ignores order; a container's own order is the one it was built with."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import snapshot
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as E
from tdfunc import optim


def _vals(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.rand(2, 3, generator=g) + 0.5,
        "y": torch.rand(2, generator=g) + 0.5,
        "p": torch.rand(2, 4, generator=g) + 0.5,
        "q": torch.rand(2, generator=g) + 0.5,
    }


def forward(seed: int = 0) -> tdfunc.TensorDict:
    """Keys x, y, n.p, n.q (built in that order)."""
    v = _vals(seed)
    n = tdfunc.TensorDict(p=v["p"], q=v["q"], batch_size=[2])
    return tdfunc.TensorDict(x=v["x"], y=v["y"], n=n, batch_size=[2])


def backward(seed: int = 1) -> tdfunc.TensorDict:
    """The same keys built in the reverse order at every level."""
    v = _vals(seed)
    n = tdfunc.TensorDict(q=v["q"], p=v["p"], batch_size=[2])
    return tdfunc.TensorDict(n=n, y=v["y"], x=v["x"], batch_size=[2])


ORDER = ["x", "y", ("n", "p"), ("n", "q"), "n"]
MASK = torch.tensor([True, False])

#: operations between two containers: (name, fn(a, b))
BINARY: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", operator.add),
    ("sub", operator.sub),
    ("mul", operator.mul),
    ("truediv", operator.truediv),
    ("pow", operator.pow),
    ("eq", operator.eq),
    ("lt", operator.lt),
    ("ne", operator.ne),
    ("maximum", torch.maximum),
    ("where", lambda a, b: torch.where(MASK, a, b)),
    ("td.where", lambda a, b: a.where(MASK, b)),
    ("lerp", lambda a, b: torch.lerp(a, b, 0.25)),
    ("lerp_tensor_weight", lambda a, b: torch.lerp(a, b, a * 0 + 0.25)),
    ("stack", lambda a, b: tdfunc.stack([a, b])),
    ("stack_dim1", lambda a, b: tdfunc.stack([a, b], 1)),
    ("cat", lambda a, b: tdfunc.cat([a, b])),
    ("apply", lambda a, b: a.apply(lambda x, y: x * 2 + y, b)),
    ("named_apply", lambda a, b: a.named_apply(lambda k, x, y: x - y, b)),
    ("at_set", lambda a, b: a.at[0].set(b[1])),
    ("at_add", lambda a, b: a.at[1].add(b[0])),
    ("atan2", torch.atan2),
    ("clamp", lambda a, b: torch.clamp(a, min=b)),
    ("pad_sequence", lambda a, b: tdfunc.pad_sequence([a, b[:1]])),
    (
        "torch_pad_sequence",
        lambda a, b: torch.nn.utils.rnn.pad_sequence([a, b[:1]], batch_first=True),
    ),
    ("gather", lambda a, b: torch.gather(a, 0, torch.tensor([1, 0])) + b),
]


def _rebuild_like(a: Any, b: Any) -> Any:
    """``b``'s values in ``a``'s key order (what pairing by key must equal)."""
    out = {}
    for k in a.keys():  # noqa: SIM118 (iterating a container walks its batch dim)
        v = b[k]
        out[k] = _rebuild_like(a[k], v) if tdfunc.is_container(v) else v
    return tdfunc.TensorDict(out, batch_size=b.batch_size)


@pytest.mark.parametrize(("name", "fn"), BINARY, ids=[n for n, _ in BINARY])
def test_operands_pair_by_key(name: str, fn: Callable[[Any, Any], Any]) -> None:
    a, b = forward(), backward()
    twin = _rebuild_like(a, b)
    assert twin.keys(include_nested=True) == ORDER
    sa, sb = snapshot(a), snapshot(b)
    got = fn(a, b)
    expected = fn(a, twin)
    tdfunc.testing.assert_close(got, expected)
    assert got.keys(include_nested=True) == ORDER  # the first operand's order
    # the operands are unchanged, and so is their own order
    tdfunc.testing.assert_close(a, sa)
    tdfunc.testing.assert_close(b, sb)
    assert b.keys() == ["n", "y", "x"]
    assert b["n"].keys() == ["q", "p"]


#: torch's own pad_sequence takes a list Dynamo cannot trace with containers in it (whatever
#: their order); the rest compile
COMPILED = [(n, f) for n, f in BINARY if n != "torch_pad_sequence"]


@pytest.mark.parametrize(("name", "fn"), COMPILED, ids=[n for n, _ in COMPILED])
def test_operands_pair_by_key_compiled(name: str, fn: Callable[[Any, Any], Any]) -> None:
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    a, b = forward(), backward()
    got = cfn(a, b)
    tdfunc.testing.assert_close(got, fn(a, _rebuild_like(a, b)))
    assert got.keys(include_nested=True) == ORDER
    assert cnt.frame_count == 1
    # new values, the same orders: no recompile
    a2, b2 = forward(5), backward(6)
    tdfunc.testing.assert_close(cfn(a2, b2), fn(a2, _rebuild_like(a2, b2)))
    assert cnt.frame_count == 1
    # the second operand in the first one's order: one recompile at most (another input
    # structure), then none
    twin = _rebuild_like(a2, b2)
    tdfunc.testing.assert_close(cfn(a2, twin), fn(a2, twin))
    assert cnt.frame_count <= 2
    frames = cnt.frame_count
    tdfunc.testing.assert_close(cfn(a, b), fn(a, _rebuild_like(a, b)))
    tdfunc.testing.assert_close(cfn(a2, twin), fn(a2, twin))
    assert cnt.frame_count == frames


def test_reordered_operand_made_inside_compiled_function() -> None:
    def f(a: Any) -> Any:
        b = tdfunc.TensorDict(n=a["n"] * 2, y=a["y"] + 1, x=a["x"], batch_size=a.batch_size)
        return tdfunc.stack([a, b]).sum(0) - a

    cnt = CompileCounterWithBackend("eager")
    got = torch.compile(f, backend=cnt, fullgraph=True)(forward())
    tdfunc.testing.assert_close(got, f(forward()))
    assert got.keys(include_nested=True) == ORDER
    assert cnt.frame_count == 1


def test_three_operands_and_keyword_operand() -> None:
    a, b = forward(), backward()
    c = tdfunc.TensorDict(y=a["y"], n=a["n"], x=a["x"], batch_size=[2])
    got = torch.addcmul(a, b, c, value=0.5)
    tb = _rebuild_like(a, b)
    tdfunc.testing.assert_close(got, torch.addcmul(a, tb, a, value=0.5))
    assert got.keys(include_nested=True) == ORDER
    got = torch.where(MASK, a, other=b)
    tdfunc.testing.assert_close(got, torch.where(MASK, a, tb))


def test_under_vmap_and_grad() -> None:
    a, b = forward(), backward()
    tb = _rebuild_like(a, b)
    got = torch.vmap(operator.mul)(a, b)
    tdfunc.testing.assert_close(got, a * tb)
    assert got.keys(include_nested=True) == ORDER

    def loss(w: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
        r = a * w + b
        return r["x"].sum() + r["n", "p"].pow(2).sum() + r["y"].sum()

    w = torch.tensor(0.3)
    tdfunc.testing.assert_close(torch.func.grad(loss)(w, a, b), torch.func.grad(loss)(w, a, tb))


def test_different_key_sets_still_raise() -> None:
    a, b = forward(), backward()
    with pytest.raises(E.KeysDifferError, match=r"missing keys \['x'\]"):
        _ = a + b.exclude("x")
    with pytest.raises(E.KeysDifferError, match=r"\('n', 'q'\)"):
        tdfunc.stack([a, b.exclude(("n", "q"))])
    extra = b.set("z", torch.zeros(2))
    with pytest.raises(E.KeysDifferError, match=r"extra keys \['z'\]"):
        tdfunc.cat([a, extra])


def test_tensorclass_with_reordered_nested_container() -> None:
    @tdfunc.tensorclass
    class Pair:
        obs: tdfunc.TensorDict
        r: torch.Tensor

    a = Pair(obs=forward(), r=torch.ones(2), batch_size=[2])
    b = Pair(obs=backward(), r=torch.full((2,), 2.0), batch_size=[2])
    got = a + b
    assert got.obs.keys(include_nested=True) == ORDER
    tdfunc.testing.assert_close(got.obs, a.obs + _rebuild_like(a.obs, b.obs))
    assert torch.equal(got.r, torch.full((2,), 3.0))


# ---------------------------------------------------------------------------- optimizers
def _params() -> tdfunc.TensorDict:
    return forward(3)


def test_optimizer_grads_in_another_order() -> None:
    params = _params()
    grads = backward(4)
    tg = _rebuild_like(params, grads)
    for opt in (optim.adam(1e-2), optim.sgd(0.1, momentum=0.9), optim.adamw(1e-2)):
        state = opt.init(params)
        u1, s1 = opt.update(grads, state, params)
        u2, s2 = opt.update(tg, state, params)
        tdfunc.testing.assert_close(u1, u2)
        tdfunc.testing.assert_close(s1, s2)
        p1, _ = optim.step(opt, grads, state, params)
        p2, _ = optim.step(opt, tg, state, params)
        tdfunc.testing.assert_close(p1, p2)
        assert p1.keys(include_nested=True) == ORDER  # the params keep their order
    tdfunc.testing.assert_close(optim.apply_updates(params, grads), optim.apply_updates(params, tg))
    assert optim.apply_updates(params, grads).keys(include_nested=True) == ORDER


def test_optimizer_state_read_by_key() -> None:
    # a state made for one order, grads and params in another
    params = _params()
    opt = optim.adam(1e-2)
    state = opt.init(params)
    other = _rebuild_like(backward(), params)  # params' values, reversed order
    grads = backward(4)
    u1, _ = opt.update(grads, state, other)
    u2, _ = opt.update(_rebuild_like(params, grads), state, params)
    tdfunc.testing.assert_close(u1, u2)


def test_chained_transforms_with_params_in_another_order() -> None:
    params = _params()
    grads = backward(4)
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adam(1e-2))
    state = opt.init(params)
    u1, _ = opt.update(grads, state, params)
    u2, _ = opt.update(_rebuild_like(params, grads), state, params)
    tdfunc.testing.assert_close(u1, u2)


# ---------------------------------------------------------------------------- select, assert_close
def test_select_returns_the_order_asked_for() -> None:
    td = forward()
    assert td.select("y", "x").keys() == ["y", "x"]
    assert td.select(("n", "q"), "x", ("n", "p")).keys(include_nested=True) == [
        ("n", "q"),
        ("n", "p"),
        "n",
        "x",
    ]
    assert td.keys() == ["x", "y", "n"]  # unchanged
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict(x=torch.zeros(2), y=torch.zeros(2), batch_size=[2])
    assert list(theirs.select("y", "x").keys()) == td.select("y", "x").keys()


def test_select_in_a_compiled_function_keeps_the_asked_order() -> None:
    def f(td: Any) -> Any:
        return td.select("n", "x") * 2

    cnt = CompileCounterWithBackend("eager")
    got = torch.compile(f, backend=cnt, fullgraph=True)(forward())
    assert got.keys() == ["n", "x"]
    tdfunc.testing.assert_close(got, f(forward()))
    assert cnt.frame_count == 1


def test_select_on_a_tensorclass_keeps_its_fields_order() -> None:
    @tdfunc.tensorclass
    class P:
        a: torch.Tensor
        b: torch.Tensor | None = None

    p = P(a=torch.zeros(2), b=torch.ones(2), batch_size=[2])
    s = p.select("b", "a")
    assert torch.equal(s.b, torch.ones(2))
    assert torch.equal(s.a, torch.zeros(2))


def test_assert_close_ignores_order_and_names_real_differences() -> None:
    a, b = forward(), _rebuild_like(forward(), backward(0))
    reordered = tdfunc.TensorDict(n=a["n"], y=a["y"], x=a["x"], batch_size=[2])
    tdfunc.testing.assert_close(a, reordered)
    tdfunc.testing.assert_close(reordered, a)
    with pytest.raises(AssertionError, match=r"keys differ: missing \['x'\], extra \[\]"):
        tdfunc.testing.assert_close(a.exclude("x"), a)
    with pytest.raises(AssertionError, match=r"at key 'y'"):
        tdfunc.testing.assert_close(reordered.set("y", reordered["y"] + 1), a)
    assert b.keys() == a.keys()


def test_reorder_like_returns_the_same_object_when_ordered() -> None:
    from tdfunc._tree import reorder_like

    a = forward()
    b = forward(2)
    assert reorder_like(a, b) is b
    r = reorder_like(a, backward())
    assert r is not None
    assert r.keys(include_nested=True) == ORDER
    assert reorder_like(a, backward().exclude("y")) is None


# ---------------------------------------------------------------------------- control flow
def _carry() -> tdfunc.TensorDict:
    return tdfunc.TensorDict(a=torch.zeros(3), b=torch.ones(3))


def _step(c: Any, x: Any) -> tuple[Any, Any]:
    # the next carry rebuilt with its keys in another order (and so is every y)
    nc = tdfunc.TensorDict(b=c["b"] * 2, a=c["a"] + x["x"])
    return nc, tdfunc.TensorDict(s=nc["a"] + nc["b"], t=nc["b"])


@pytest.mark.parametrize("unroll", [False, True])
def test_scan_carry_rebuilt_in_another_order(unroll: bool) -> None:
    xs = tdfunc.TensorDict(x=torch.arange(12.0).reshape(4, 3), batch_size=[4])
    carry, ys = tdfunc.scan(_step, _carry(), xs, unroll=unroll)
    assert carry.keys() == ["a", "b"]  # init's order
    a, b = torch.zeros(3), torch.ones(3)
    for i in range(4):
        a, b = a + xs["x"][i], b * 2
    assert torch.equal(carry["a"], a)
    assert torch.equal(carry["b"], b)
    assert torch.equal(ys["s"][-1], a + b)


def test_scan_carry_in_another_order_compiled() -> None:
    xs = tdfunc.TensorDict(x=torch.arange(12.0).reshape(4, 3), batch_size=[4])
    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(lambda c, xs: tdfunc.scan(_step, c, xs), backend=cnt, fullgraph=True)
    carry, ys = f(_carry(), xs)
    expected, eys = tdfunc.scan(_step, _carry(), xs, unroll=True)
    tdfunc.testing.assert_close(carry, expected)
    tdfunc.testing.assert_close(ys, eys)
    assert carry.keys() == ["a", "b"]
    assert cnt.frame_count == 1


def test_while_loop_body_in_another_order() -> None:
    def body(i: torch.Tensor, c: Any) -> tuple[torch.Tensor, Any]:
        return i + 1, tdfunc.TensorDict(b=c["b"] * 2, a=c["a"] + 1)

    i, out = tdfunc.while_loop(lambda i, c: i < 3, body, (torch.tensor(0), _carry()))
    assert int(i) == 3
    assert out.keys() == ["a", "b"]
    assert torch.equal(out["a"], torch.full((3,), 3.0))
    assert torch.equal(out["b"], torch.full((3,), 8.0))


def test_checkpoint_like_in_another_order(tmp_path: Any) -> None:
    from tdfunc.distributed import load_checkpoint, save_checkpoint

    td = forward()
    digest = save_checkpoint(str(tmp_path / "ck"), td)
    like = tdfunc.zeros_like(backward())
    out = load_checkpoint(str(tmp_path / "ck"), like=like, digest=digest)
    assert out.keys() == ["n", "y", "x"]  # like's own order
    assert out["n"].keys() == ["q", "p"]
    tdfunc.testing.assert_close(out, td)
    assert torch.equal(like["x"], torch.zeros(2, 3))  # like is not written
