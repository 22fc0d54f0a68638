"""tdfunc.cond / while_loop / scan over TensorDicts, tensorclasses and pytrees of them, eager and
compiled (fullgraph), pass-through leaves, structure mismatches and bad input."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import check_compiled, compare
from torch._dynamo.testing import CompileCounterWithBackend

from tdfunc import TensorDict, cond, scan, tensorclass, while_loop
from tdfunc import _errors as E
from tdfunc.testing import assert_close


def make_td(b: int = 3) -> TensorDict:
    return TensorDict({"a": torch.randn(b), "n": {"c": torch.randn(b, 2)}}, batch_size=[b])


def compile_counted(fn, backend: str = "eager"):
    cnt = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


# --------------------------------------------------------------------------------------
# cond
# --------------------------------------------------------------------------------------
def branches(p: torch.Tensor, t: TensorDict, w: torch.Tensor) -> dict:
    return cond(
        p,
        lambda t, w: {"td": t.set("a", t["a"] * w), "w": w + 1},  # "n" passes through
        lambda t, w: {"td": t.set("a", t["a"] - w), "w": w - 1},
        (t, w),
    )


def test_cond_tensordict_eager_values():
    t, w = make_td(), torch.tensor(2.0)
    snap = t.clone()
    for pred in (True, False):
        out = branches(torch.tensor(pred), t, w)
        assert isinstance(out["td"], TensorDict)
        assert out["td"].batch_size == (3,)
        exp_a = t["a"] * 2 if pred else t["a"] - 2
        torch.testing.assert_close(out["td"]["a"], exp_a)
        torch.testing.assert_close(out["td"]["n", "c"], t["n", "c"])
        assert out["td"]["n", "c"] is not t["n", "c"]  # a pass-through leaf comes back as a copy
        torch.testing.assert_close(out["w"], w + (1 if pred else -1))
    assert_close(t, snap)


def test_cond_compiled_equals_eager_both_branches_one_frame_no_recompile():
    fn, cnt = compile_counted(branches)
    for pred in (True, False, True):
        t, w = make_td(), torch.randn(())
        compare(fn(torch.tensor(pred), t, w), branches(torch.tensor(pred), t, w))
    assert cnt.frame_count == 1


def test_cond_python_bool_pred_and_plain_tensors():
    t = make_td()
    out = cond(True, lambda t: t * 2, lambda t: t * 3, (t,))
    assert_close(out, t * 2)
    x = torch.randn(4)
    torch.testing.assert_close(cond(x.sum() > 100, torch.sin, torch.cos, (x,)), x.cos())


def test_cond_tensorclass_and_nested_pytrees():
    @tensorclass
    class State:
        pos: torch.Tensor
        vel: torch.Tensor
        dt: float = 0.5

    def fn(p: torch.Tensor, s: State, extra: list) -> tuple:
        return cond(
            p,
            lambda s, e: (s.replace(pos=s.pos + s.dt * s.vel), [e[0] * 2, {"k": e[1]}]),
            lambda s, e: (s * 0, [e[0], {"k": -e[1]}]),
            (s, extra),
        )

    def make():
        s = State(torch.randn(4, 2), torch.randn(4, 2), batch_size=[4])
        return torch.tensor(True), s, [torch.randn(3), make_td()]

    p, s, extra = make()
    out_s, (_e0, ek) = fn(p, s, extra)
    assert type(out_s) is State
    assert out_s.batch_size == (4,)
    assert out_s.dt == 0.5
    torch.testing.assert_close(out_s.pos, s.pos + 0.5 * s.vel)
    assert isinstance(ek["k"], TensorDict)
    compiled, cnt = compile_counted(fn)
    for pred in (True, False):
        args = (torch.tensor(pred), *make()[1:])
        compare(compiled(*args), fn(*args))
    assert cnt.frame_count == 1


def test_cond_branch_structure_mismatch_names_the_keys():
    t = make_td()
    expected = E.COND_BRANCHES.format(missing="['a']", extra="['z']", detail="")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        cond(torch.tensor(True), lambda t: t, lambda t: t.set("z", t["a"]).exclude("a"), (t,))
    # same keys, other batch dims
    with pytest.raises(ValueError, match=re.escape("batch_dims=1), got TensorDict(keys=['a'")):
        cond(
            torch.tensor(True),
            lambda t: t.select("a") * 1,
            lambda t: TensorDict(a=t["a"] * 1),
            (t,),
        )


def test_cond_branch_mismatch_under_compile_is_reported_by_torch():
    t = make_td()
    fn = torch.compile(
        lambda p, t: cond(p, lambda t: t * 1, lambda t: t.exclude("a") * 1, (t,)),
        backend="eager",
        fullgraph=True,
    )
    with pytest.raises(RuntimeError, match="same pytree structure"):
        fn(torch.tensor(True), t)


def test_cond_bad_operands():
    with pytest.raises(TypeError) as info:
        cond(torch.tensor(True), lambda x, n: x, lambda x, n: x, (torch.ones(2), 3))
    assert str(info.value) == E.NOT_TENSOR.format(what="cond operands", typ="int", path="[1]")


# --------------------------------------------------------------------------------------
# while_loop
# --------------------------------------------------------------------------------------
def loop(t: TensorDict) -> tuple[torch.Tensor, TensorDict]:
    def cond_fn(i: torch.Tensor, s: TensorDict) -> torch.Tensor:
        return (i < 5) & (s["a"].abs().sum() < 1e6)

    def body_fn(i: torch.Tensor, s: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        return i + 1, s.set("a", s["a"] * 2 + s["n", "c"].sum(-1))  # "n" passes through

    return while_loop(cond_fn, body_fn, (torch.tensor(0), t))


def test_while_loop_tensordict_values():
    t = make_td()
    snap = t.clone()
    i, out = loop(t)
    assert int(i) == 5
    assert isinstance(out, TensorDict)
    assert out.batch_size == (3,)
    a = t["a"]
    for _ in range(5):
        a = a * 2 + t["n", "c"].sum(-1)
    torch.testing.assert_close(out["a"], a)
    torch.testing.assert_close(out["n", "c"], t["n", "c"])
    assert_close(t, snap)


def test_while_loop_compiled():
    check_compiled(loop, lambda: (make_td(),))


def test_while_loop_tensorclass_carry():
    @tensorclass
    class Particle:
        pos: torch.Tensor
        vel: torch.Tensor
        info: TensorDict | None = None
        dt: float = 0.1

    def fn(p: Particle, steps: torch.Tensor) -> tuple:
        return while_loop(
            lambda k, q: k < steps,
            lambda k, q: (k + 1, q.replace(pos=q.pos + q.dt * q.vel)),
            (torch.tensor(0), p),
        )

    def make():
        return Particle(torch.randn(6, 3), torch.randn(6, 3), batch_size=[6]), torch.tensor(4)

    p, steps = make()
    k, out = fn(p, steps)
    assert int(k) == 4
    assert type(out) is Particle
    assert out.info is None
    torch.testing.assert_close(out.pos, p.pos + 4 * 0.1 * p.vel, rtol=1e-5, atol=1e-5)
    check_compiled(fn, make)


def test_while_loop_body_structure_mismatch_names_the_keys():
    t = make_td()
    with pytest.raises(RuntimeError) as info:
        while_loop(
            lambda i, s: i < 3, lambda i, s: (i + 1, s.exclude(("n", "c"))), (torch.tensor(0), t)
        )
    expected = E.CONTROL_STRUCTURE.format(
        what="while_loop body_fn",
        expected_what="carried_inputs",
        missing="[1]['n']['c']",
        extra="none",
        detail="",
    )
    assert expected in str(info.value)
    fn = torch.compile(
        lambda t: while_loop(
            lambda i, s: i < 3, lambda i, s: (i + 1, s.set("x", s["a"])), (torch.tensor(0), t)
        ),
        backend="eager",
        fullgraph=True,
    )
    # a Python error inside a higher-order op reaches the caller wrapped by Dynamo
    with pytest.raises(
        torch._dynamo.exc.UncapturedHigherOrderOpError, match=re.escape("extra keys: [1]['x']")
    ):
        fn(t)


# --------------------------------------------------------------------------------------
# scan
# --------------------------------------------------------------------------------------
def cumulate(xs: TensorDict) -> tuple[TensorDict, TensorDict]:
    def combine(c: TensorDict, x: TensorDict) -> tuple[TensorDict, TensorDict]:
        new = c + x
        return new, x.set("total", new["r"]).set("prev", c["r"])  # x's leaves pass through

    return scan(combine, xs[0] * 0, xs)


def make_xs(t: int = 5) -> TensorDict:
    return TensorDict({"r": torch.randn(t, 2), "n": {"q": torch.randn(t, 2, 3)}}, batch_size=[t, 2])


def test_scan_tensordict_values_and_batch_sizes():
    xs = make_xs()
    snap = xs.clone()
    final, ys = cumulate(xs)
    assert final.batch_size == (2,)
    assert ys.batch_size == (5, 2)
    assert ys["n"].batch_size == (5, 2)
    torch.testing.assert_close(final["r"], xs["r"].sum(0))
    torch.testing.assert_close(ys["total"], xs["r"].cumsum(0))
    torch.testing.assert_close(ys["prev"][1:], xs["r"].cumsum(0)[:-1])
    torch.testing.assert_close(ys["n", "q"], xs["n", "q"])
    assert_close(xs, snap)


def test_scan_compiled():
    check_compiled(cumulate, lambda: (make_xs(),))


def test_scan_dim_and_reverse():
    xs = make_xs()
    final, ys = scan(lambda c, x: (c + x["r"], x["r"] * 1), torch.zeros(5), xs, dim=1)
    torch.testing.assert_close(final, xs["r"].sum(1))
    torch.testing.assert_close(ys, xs["r"])  # torch puts the scanned dim of ys back at dim
    _, ys_rev = scan(lambda c, x: (c + x["r"], c + x["r"]), torch.zeros(2), xs, reverse=True)
    torch.testing.assert_close(ys_rev, xs["r"].flip(0).cumsum(0).flip(0))


def test_scan_tensorclass_xs_and_carry():
    @tensorclass
    class Step:
        obs: torch.Tensor
        reward: torch.Tensor
        gamma: float = 0.5

    def discounted(steps: Step) -> tuple:
        def combine(ret: torch.Tensor, s: Step) -> tuple:
            new = s.reward + s.gamma * ret
            return new, s.replace(reward=new)

        return scan(combine, torch.zeros(4), steps, reverse=True)

    def make():
        return (Step(torch.randn(6, 4, 2), torch.randn(6, 4), batch_size=[6, 4]),)

    (steps,) = make()
    ret, ys = discounted(steps)
    assert type(ys) is Step
    assert ys.batch_size == (6, 4)
    assert ys.gamma == 0.5
    exp = torch.zeros(4)
    for k in range(5, -1, -1):
        exp = steps.reward[k] + 0.5 * exp
        torch.testing.assert_close(ys.reward[k], exp)
    torch.testing.assert_close(ret, exp)
    check_compiled(discounted, make)


def test_scan_gradients_flow_through_a_tensordict():
    x = torch.randn(5, 3, requires_grad=True)
    xs = TensorDict(x=x, batch_size=[5])
    final, ys = scan(lambda c, t: (c * t["x"], t * 2), torch.ones(3), xs)
    (final.sum() + ys["x"].sum()).backward()
    prod = x.detach().prod(0)
    torch.testing.assert_close(x.grad, prod / x.detach() + 2)


def test_scan_bad_input():
    xs = make_xs()
    expected = E.SCAN_DIM.format(cls="TensorDict", batch_size=(5, 2), dim=2, batch_dims=2)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        scan(lambda c, x: (c, x), torch.zeros(2), xs, dim=2)
    with pytest.raises(RuntimeError, match=re.escape(E.SCAN_PAIR.format(typ="Tensor"))):
        scan(lambda c, x: c + x["r"], torch.zeros(2), xs)
    with pytest.raises(RuntimeError, match=re.escape("missing keys: ['n']")):
        scan(lambda c, x: (c.exclude("n"), x["r"] * 1), xs[0] * 0, xs)
    with pytest.raises(TypeError, match=re.escape("scan init: every leaf must be a tensor")):
        scan(lambda c, x: (c, x), {"a": 1.0}, xs)
