"""torch.func transforms over TensorDicts and tensorclasses: grad, grad_and_value, vjp, jacrev,
jacfwd, per-sample gradients, nested vmap, in_dims / out_dims, chunk_size, randomness, bad in_dims,
training loops (functional and torch.optim), and the compiled forms."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import check_compiled
from torch import nn

from tdfunc import TensorDict, from_module, functional_call, tensorclass
from tdfunc import _errors as E
from tdfunc.testing import assert_close


def make_td(b: int = 4) -> TensorDict:
    return TensorDict(
        {"a": torch.randn(b, 3), "n": {"c": torch.randn(b), "d": torch.randn(b, 2, 2)}},
        batch_size=[b],
    )


def scalar_fn(t: TensorDict) -> torch.Tensor:
    return (t["a"] ** 2).sum() + (t["n", "c"].sin()).sum() + (t["n", "d"] ** 3).sum()


def expected_grad(t: TensorDict) -> TensorDict:
    return TensorDict(
        {"a": 2 * t["a"], "n": {"c": t["n", "c"].cos(), "d": 3 * t["n", "d"] ** 2}},
        batch_size=t.batch_size,
    )


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))


def regression(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, generator=g)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5]])).tanh()
    return x, y


# --------------------------------------------------------------------------------------
# grad / grad_and_value / vjp / jacrev / jacfwd
# --------------------------------------------------------------------------------------
def test_grad_returns_same_structure_and_batch_size():
    td = make_td()
    snap = td.clone()
    g = torch.func.grad(scalar_fn)(td)
    assert isinstance(g, TensorDict)
    assert g.batch_size == td.batch_size
    assert g["n"].batch_size == td["n"].batch_size
    assert_close(g, expected_grad(td))
    assert_close(td, snap)


def test_grad_and_value_and_argnums():
    td, w = make_td(), torch.randn(3)

    def f(t: TensorDict, v: torch.Tensor) -> torch.Tensor:
        return scalar_fn(t) + (t["a"] * v).sum()

    (gt, gw), value = torch.func.grad_and_value(f, argnums=(0, 1))(td, w)
    torch.testing.assert_close(value, f(td, w))
    torch.testing.assert_close(gw, td["a"].sum(0))
    exp = expected_grad(td)
    assert_close(gt, exp.set("a", exp["a"] + w))


def test_grad_with_aux_returns_tensordict_aux():
    td = make_td()
    g, aux = torch.func.grad(lambda t: (scalar_fn(t), t * 2), has_aux=True)(td)
    assert_close(g, expected_grad(td))
    assert_close(aux, td * 2)


def test_vjp_tensordict_in_and_out():
    td = make_td()
    out, vjp_fn = torch.func.vjp(lambda t: t * t, td)
    assert_close(out, td * td)
    cot = td.apply(torch.ones_like)
    (g,) = vjp_fn(cot)
    assert isinstance(g, TensorDict)
    assert g.batch_size == td.batch_size
    assert_close(g, td * 2)


def test_jacrev_and_jacfwd_scalar_output_keep_batch_size():
    td = make_td()
    jr = torch.func.jacrev(scalar_fn)(td)
    jf = torch.func.jacfwd(scalar_fn)(td)
    for j in (jr, jf):
        assert isinstance(j, TensorDict)
        assert j.batch_size == td.batch_size
        assert_close(j, expected_grad(td), atol=1e-5, rtol=1e-5)


def test_jacrev_and_jacfwd_vector_output_prepend_output_dims():
    td = make_td()

    def f(t: TensorDict) -> torch.Tensor:  # [4] output: one per batch element
        return (t["a"] ** 2).sum(-1) + t["n", "c"]

    jr = torch.func.jacrev(f)(td)
    jf = torch.func.jacfwd(f)(td)
    assert jr.batch_size == (4, 4)
    assert jr["n"].batch_size == (4, 4)
    assert jr["a"].shape == (4, 4, 3)
    assert jr["n", "d"].shape == (4, 4, 2, 2)
    eye = torch.eye(4)
    torch.testing.assert_close(jr["a"], eye[:, :, None] * 2 * td["a"][None])
    torch.testing.assert_close(jr["n", "c"], eye)
    torch.testing.assert_close(jr["n", "d"], torch.zeros(4, 4, 2, 2))
    assert_close(jf, jr)


def test_transforms_over_a_tensorclass():
    @tensorclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor
        scale: float = 3.0

    p = Pair(torch.randn(5, 2), torch.randn(5), batch_size=[5])

    def f(q: Pair) -> torch.Tensor:
        return q.scale * (q.x**2).sum() + q.y.exp().sum()

    g = torch.func.grad(f)(p)
    assert type(g) is Pair
    assert g.batch_size == (5,)
    assert g.scale == 3.0
    torch.testing.assert_close(g.x, 6 * p.x)
    torch.testing.assert_close(g.y, p.y.exp())
    (g2, value) = torch.func.grad_and_value(f)(p)
    torch.testing.assert_close(value, f(p))
    assert_close(g2, g)
    _, vjp_fn = torch.func.vjp(lambda q: q * 2, p)
    (gv,) = vjp_fn(p.apply(torch.ones_like))
    assert type(gv) is Pair
    assert torch.equal(gv.x, torch.full((5, 2), 2.0))

    def h(q: Pair) -> torch.Tensor:  # no Python-float factor: jacfwd would promote to float64
        return (q.x**3).sum() + q.y.exp().sum()

    for jac in (torch.func.jacrev, torch.func.jacfwd):
        j = jac(h)(p)
        assert type(j) is Pair
        assert j.batch_size == (5,)
        assert j.scale == 3.0
        torch.testing.assert_close(j.x, 3 * p.x**2)
        torch.testing.assert_close(j.y, p.y.exp())
    out = torch.vmap(lambda q: q.replace(x=q.x * q.y[..., None]))(p)
    assert type(out) is Pair
    assert out.batch_size == (5,)
    torch.testing.assert_close(out.x, p.x * p.y[:, None])


# --------------------------------------------------------------------------------------
# per-sample gradients, vmap options
# --------------------------------------------------------------------------------------
def _loss(model: nn.Module):
    def loss(p: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))
        return ((out - y.unsqueeze(0)) ** 2).mean()

    return loss


def test_per_sample_gradients_batch_size_and_values():
    model = mlp()
    params = from_module(model).detach()
    x, y = regression(6)
    grads = torch.vmap(torch.func.grad(_loss(model)), in_dims=(None, 0, 0))(params, x, y)
    assert isinstance(grads, TensorDict)
    assert grads.batch_size == (6,)
    assert grads["0"].batch_size == (6,)
    assert grads["0", "weight"].shape == (6, 16, 3)
    for i in range(6):
        model.zero_grad()
        ((model(x[i : i + 1]) - y[i : i + 1]) ** 2).mean().backward()
        for k, g in grads.items(True, True):
            torch.testing.assert_close(g[i], model.get_parameter(".".join(k)).grad)


def test_nested_vmap_over_two_batch_dims():
    td = TensorDict({"a": torch.randn(3, 4, 2), "b": {"c": torch.randn(3, 4)}}, batch_size=[3, 4])
    seen = []

    def f(t: TensorDict) -> TensorDict:
        seen.append(t.batch_size)
        return t.set("s", t["a"].sum(-1) * t["b", "c"])

    out = torch.vmap(torch.vmap(f))(td)
    assert seen == [torch.Size([])]
    assert out.batch_size == (3, 4)
    assert out["b"].batch_size == (3, 4)
    torch.testing.assert_close(out["s"], td["a"].sum(-1) * td["b", "c"])
    # the inner vmap over dim 1, the outer over dim 0: a transposed result
    out_t = torch.vmap(torch.vmap(f, in_dims=0), in_dims=1)(td)
    assert out_t.batch_size == (4, 3)
    torch.testing.assert_close(out_t["s"], out["s"].T)


def test_in_dims_and_out_dims_per_argument():
    a = TensorDict({"x": torch.randn(5, 3, 2)}, batch_size=[5, 3])  # mapped over dim 1
    b = TensorDict({"y": torch.randn(3, 2)}, batch_size=[3])  # mapped over dim 0
    w = torch.randn(2)  # not mapped

    def f(s: TensorDict, t: TensorDict, v: torch.Tensor) -> tuple[TensorDict, TensorDict]:
        assert s.batch_size == (5,)
        assert t.batch_size == ()
        return s.set("z", s["x"] * t["y"] + v), t * 2

    out_s, out_t = torch.vmap(f, in_dims=(1, 0, None), out_dims=(1, 0))(a, b, w)
    assert out_s.batch_size == (5, 3)
    assert out_t.batch_size == (3,)
    torch.testing.assert_close(out_s["z"], a["x"] * b["y"][None] + w)
    assert_close(out_t, b * 2)
    # out_dims=1 for a container with one batch dim inside: the mapped dim becomes batch dim 1
    out1, _ = torch.vmap(f, in_dims=(1, 0, None), out_dims=(0, 0))(a, b, w)
    assert out1.batch_size == (3, 5)
    torch.testing.assert_close(out1["z"], out_s["z"].transpose(0, 1))


def test_chunk_size_gives_the_same_result():
    model = mlp()
    params = from_module(model).detach()
    x, y = regression(10)
    psg = torch.func.grad(_loss(model))
    full = torch.vmap(psg, in_dims=(None, 0, 0))(params, x, y)
    chunked = torch.vmap(psg, in_dims=(None, 0, 0), chunk_size=3)(params, x, y)
    assert chunked.batch_size == (10,)
    assert_close(chunked, full)


def test_randomness_modes():
    td = TensorDict({"a": torch.zeros(6, 100)}, batch_size=[6])

    def noisy(t: TensorDict) -> TensorDict:
        # noise per leaf element: a plain tensor next to a container is shaped like the batch
        # (here batch_size=() inside vmap), so the per-leaf spelling
        return t.apply(lambda x: x + torch.rand(100))

    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(noisy)(td)
    diff = torch.vmap(noisy, randomness="different")(td)
    same = torch.vmap(noisy, randomness="same")(td)
    assert diff.batch_size == same.batch_size == (6,)
    assert not torch.equal(diff["a"][0], diff["a"][1])
    assert torch.equal(same["a"][0], same["a"][1])


def test_in_dims_that_are_not_batch_dims_raise_valueerror():
    td = TensorDict({"a": torch.randn(4, 3), "n": {"c": torch.randn(4, 3, 5)}}, batch_size=[4])
    # containers are rebuilt innermost first: the nested one reports its own key
    expected = E.VMAP_DIM.format(dim=1, key="c", batch_dims=1)
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        torch.vmap(lambda t: t * 2, in_dims=1)(td)
    assert str(info.value) == expected
    flat = TensorDict({"a": torch.randn(4, 3), "b": torch.randn(4, 3)}, batch_size=[4])
    expected = E.VMAP_DIM.format(dim=1, key="a", batch_dims=1)
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        torch.vmap(lambda t: t * 2, in_dims=1)(flat)
    assert str(info.value) == expected
    # the mapped dim found through a nested container
    nested = TensorDict(
        {"n": TensorDict({"c": torch.randn(4, 3, 2)}, batch_size=[4, 3])}, batch_size=[4]
    )
    with pytest.raises(ValueError, match=re.escape("maps dim 1 of the leaf at key 'n'")):
        torch.vmap(lambda t: t * 2, in_dims=1)(nested)
    # a container without batch dims cannot be mapped at all
    scalar = TensorDict({"a": torch.randn(4, 3)})
    with pytest.raises(ValueError, match=re.escape("(0 batch dims)")):
        torch.vmap(lambda t: t * 2)(scalar)
    # but any batch dim can: dims 0 and 1 of a [4, 3] container
    ok = TensorDict(
        {"n": TensorDict({"c": torch.randn(4, 3, 2)}, batch_size=[4, 3])}, batch_size=[4, 3]
    )
    assert torch.vmap(lambda t: t * 2, in_dims=1)(ok).batch_size == (3, 4)


def test_bad_in_dims_also_raise_under_compile():
    nested = TensorDict(
        {"n": TensorDict({"c": torch.randn(4, 3, 2)}, batch_size=[4, 3])}, batch_size=[4]
    )
    fn = torch.compile(
        lambda t: torch.vmap(lambda s: s * 2, in_dims=1)(t), backend="eager", fullgraph=True
    )
    # fullgraph=True: dynamo reports the user error it traced as Unsupported, message kept
    with pytest.raises(
        torch._dynamo.exc.Unsupported, match=re.escape("maps dim 1 of the leaf at key 'n'")
    ):
        fn(nested)


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------
def test_functional_sgd_step_trains():
    model = mlp()
    params = from_module(model).detach()
    x, y = regression()

    def loss(p: TensorDict) -> torch.Tensor:
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    first = loss(params)
    for _ in range(60):
        grads = torch.func.grad(loss)(params)
        params = params - 0.1 * grads
    assert isinstance(params, TensorDict)
    assert loss(params) < 0.5 * first
    # the module kept its own weights
    torch.testing.assert_close(loss(from_module(model)), first)


def test_torch_optim_over_tensordict_leaves_trains():
    model = mlp()
    params = from_module(model).detach().apply(lambda t: t.clone().requires_grad_())
    opt = torch.optim.Adam(params.values(include_nested=True, leaves_only=True), lr=0.02)
    x, y = regression()
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = ((functional_call(model, params, (x,)) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------------------
# compiled
# --------------------------------------------------------------------------------------
def test_compiled_grad_over_tensordict():
    check_compiled(torch.func.grad(scalar_fn), lambda: (make_td(),))


def test_compiled_per_sample_gradients():
    model = mlp()
    psg = torch.vmap(torch.func.grad(_loss(model)), in_dims=(None, 0, 0))

    def make():
        x, y = torch.randn(8, 3), torch.randn(8, 1)
        return from_module(model).detach().apply(torch.randn_like), x, y

    check_compiled(psg, make)


def test_compiled_training_step():
    model = mlp()
    x, y = regression()

    def loss(p: TensorDict) -> torch.Tensor:
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    def step(p: TensorDict, lr: torch.Tensor) -> tuple[TensorDict, torch.Tensor]:
        g, value = torch.func.grad_and_value(loss)(p)
        return p - lr * g, value

    cnt = check_compiled(
        step,
        lambda: (from_module(model).detach().apply(torch.randn_like), torch.tensor(0.1)),
        backend="aot_eager",
    )
    compiled = torch.compile(step, backend=cnt, fullgraph=True)
    params, lr = from_module(model).detach(), torch.tensor(0.1)
    first = loss(params)
    for _ in range(40):
        params, _ = compiled(params, lr)
    assert loss(params) < 0.5 * first
    assert cnt.frame_count == 1
