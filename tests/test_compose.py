"""Programs, not calls: container methods on containers made inside the compiled function,
chained, on TensorDict and tensorclass, under compiled vmap and compiled grad; gradients with
``tdfunc.value_and_grad`` inside a plain ``torch.compile`` as inside ``tdfunc.compile``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import check_compiled, compare
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict

#: methods that leave the tensor world (host values, I/O): not part of a compiled program
_HOST = frozenset(
    {"numpy", "tolist", "to_dict", "to_state_dict", "items", "keys", "values", "leaves"}
)
_HOST |= {"dim", "numel", "size", "is_empty", "split_keys"}


def _make() -> TensorDict:
    return TensorDict({"a": torch.rand(4, 3), "b": {"c": torch.rand(4)}}, batch_size=[4])


def no_argument_methods() -> list[str]:
    """Every public container method that runs without arguments on :func:`_make`'s
    container and returns tensors (read from the class, so a new method is included)."""
    td = _make()
    out = []
    for name in sorted(dir(TensorDict)):
        if name.startswith("_") or name in _HOST:
            continue
        attr = inspect.getattr_static(TensorDict, name)
        if isinstance(attr, (property, classmethod, staticmethod)) or not callable(attr):
            continue
        try:
            getattr(td, name)()
        except Exception:  # needs arguments, or not defined on these leaves
            continue
        out.append(name)
    return out


METHODS = no_argument_methods()

#: the two ways a program makes a container inside the compiled function
MAKERS: dict[str, Callable[[Any], Any]] = {
    "add": lambda t: t + 0,
    "apply": lambda t: t.apply(torch.abs),
}


def _program(maker: str, name: str) -> Callable[[Any], Any]:
    make = MAKERS[maker]
    return lambda t: getattr(make(t), name)()


def test_the_method_list_is_the_class() -> None:
    """The list the next test compiles is not short by accident: every lifted unary method
    and every cast is in it."""
    assert len(METHODS) >= 110
    assert {"exp", "log", "sqrt", "sigmoid", "tanh", "sin", "floor", "round", "relu"} <= set(
        METHODS
    )
    assert {"float", "double", "half", "bool", "long", "isnan", "isfinite"} <= set(METHODS)


def test_every_no_argument_method_compiles_on_a_container_made_inside() -> None:
    """All two-op programs ``maker(t).m()`` in one compiled function (one trace; a failure
    is then narrowed to the programs that fail, each named)."""
    programs = [(mk, m) for mk in MAKERS for m in METHODS]
    fns = [_program(mk, m) for mk, m in programs]

    def every(t: Any) -> list[Any]:
        return [f(t) for f in fns]

    td = _make()
    cnt = CompileCounterWithBackend("eager")
    try:
        got = torch.compile(every, backend=cnt, fullgraph=True)(td)
    except Exception:
        failing = []
        for (mk, m), f in zip(programs, fns):
            torch._dynamo.reset()
            try:
                torch.compile(f, backend="eager", fullgraph=True)(td)
            except Exception as e:
                failing.append(f"{mk}.{m}: {type(e).__name__}: {str(e).splitlines()[0]}")
        pytest.fail(f"{len(failing)} of {len(programs)} programs fail:\n" + "\n".join(failing))
    assert cnt.frame_count == 1
    for (mk, m), f, g in zip(programs, fns, got):
        want = f(td)
        try:
            assert type(g) is type(want)
            assert torch.utils._pytree.tree_structure(g) == torch.utils._pytree.tree_structure(want)
            torch.testing.assert_close(
                torch.utils._pytree.tree_leaves(g),
                torch.utils._pytree.tree_leaves(want),
                equal_nan=True,
            )
        except AssertionError as e:
            raise AssertionError(f"{mk}.{m}: compiled differs from eager: {e}") from e
    torch.compile(every, backend=cnt, fullgraph=True)(_make())
    assert cnt.frame_count == 1, "recompiled on new values"


MASK = torch.tensor([True, False, True, False])

#: the programs a new user writes first (each passes eagerly and each method alone)
FIRST_PROGRAMS: dict[str, Callable[[Any], Any]] = {
    "add_clamp": lambda t: (t + 1).clamp(-0.5, 0.5),
    "select_exp": lambda t: t.select("a").exp(),
    "sigmoid_log": lambda t: t.sigmoid().log(),
    "apply_sqrt": lambda t: t.apply(torch.abs).sqrt(),
    "where_exp": lambda t: torch.where(MASK, t, 0.0).exp(),
    "select_float": lambda t: t.select("a").float(),
    "chain_of_six": lambda t: (t * 2).abs().sqrt().clamp(0, 1).exclude("b").sum(0),
}


@pytest.mark.parametrize("name", list(FIRST_PROGRAMS))
def test_first_programs_compile_fullgraph(name: str) -> None:
    td = _make()
    before = td.clone()
    check_compiled(FIRST_PROGRAMS[name], lambda: (_make(),))
    FIRST_PROGRAMS[name](td)
    tdfunc.testing.assert_close(td, before, atol=0, rtol=0)


@tdfunc.tensorclass
class Step:
    obs: torch.Tensor
    rew: torch.Tensor


def _step() -> Step:
    return Step(obs=torch.rand(4, 3), rew=torch.rand(4), batch_size=[4])


@pytest.mark.parametrize(
    "fn",
    [
        lambda s: (s + 1).clamp(0, 1),
        lambda s: s.replace(rew=s.rew * 2).sigmoid(),
        lambda s: s.apply(torch.neg).exp().float(),
    ],
    ids=["add_clamp", "replace_sigmoid", "apply_exp_float"],
)
def test_tensorclass_programs_compile_fullgraph(fn: Callable[[Any], Any]) -> None:
    cnt = check_compiled(fn, lambda: (_step(),))
    assert cnt.frame_count == 1
    assert type(fn(_step())) is Step


def test_compiled_vmap_of_a_method_chain() -> None:
    fn = torch.vmap(lambda t: t.exp().clamp(0, 1.5).sqrt())
    cnt = check_compiled(fn, lambda: (_make(),))
    assert cnt.frame_count == 1
    out = fn(_make())
    assert out.batch_size == torch.Size([4])


def test_compiled_grad_of_a_method_chain() -> None:
    def loss(t: TensorDict) -> torch.Tensor:
        u = t.exp().clamp(0, 2)
        return u["a"].sum() + u["b", "c"].sum()

    grad = torch.func.grad(loss)
    check_compiled(grad, lambda: (_make(),))
    td = _make()
    g = grad(td)
    expected = td.exp() * (td.exp() <= 2)
    tdfunc.testing.assert_close(g, expected.apply(lambda x: x.to(torch.float32)))


# --------------------------------------------------------------------------------------
# value_and_grad under any compile
# --------------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _loss(model: torch.nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
        return tdfunc.functional_call(model, p, (x,)).pow(2).mean()

    return loss


COMPILERS: dict[str, Callable[..., Any]] = {
    "torch.compile": lambda f, cnt: torch.compile(f, backend=cnt, fullgraph=True),
    "tdfunc.compile": lambda f, cnt: tdfunc.compile(f, backend=cnt, fullgraph=True),
}


@pytest.mark.parametrize("compiler", list(COMPILERS))
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "from_module"])
def test_value_and_grad_inside_any_compile(compiler: str, detach: bool) -> None:
    """One graph, torch.func's values, parameters with or without ``.detach()``, the updated
    parameters returned (they require grad when the parameters did), nothing written."""
    model = _model()
    loss = _loss(model)

    def step(p: Any, x: torch.Tensor) -> tuple[torch.Tensor, Any, Any]:
        v, g = tdfunc.value_and_grad(loss)(p, x)
        return v, g, p - 0.1 * g

    p = tdfunc.from_module(model)
    if detach:
        p = p.detach()
    before = p.detach().clone()
    x = torch.randn(6, 3)
    rg, rv = torch.func.grad_and_value(loss)(p.detach(), x)
    cnt = CompileCounterWithBackend("eager")
    f = COMPILERS[compiler](step, cnt)
    v, g, p1 = f(p, x)
    assert cnt.frame_count == 1
    torch.testing.assert_close(v, rv, atol=1e-6, rtol=0)
    tdfunc.testing.assert_close(g, rg, atol=1e-6, rtol=0)
    tdfunc.testing.assert_close(p1.detach(), (p - 0.1 * rg).detach(), atol=1e-6, rtol=0)
    assert not v.requires_grad
    assert all(t.requires_grad is not detach for t in p1.leaves())
    tdfunc.testing.assert_close(p.detach(), before, atol=0, rtol=0)
    assert all(t.grad is None for t in model.parameters())
    f(p, x * 2)
    assert cnt.frame_count == 1, "recompiled on new values"


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_value_and_grad_inside_any_compile_aux_and_argnums(compiler: str) -> None:
    def fn(a: Any, b: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return (a["w"] * b).sum() + (b**2).sum(), {"s": a["w"].sum()}

    def step(a: Any, b: torch.Tensor) -> Any:
        return tdfunc.value_and_grad(fn, argnums=(0, 1), has_aux=True)(a, b)

    a = TensorDict(w=torch.rand(3), u=torch.rand(2))
    b = torch.rand(3)
    cnt = CompileCounterWithBackend("eager")
    (v, aux), (ga, gb) = COMPILERS[compiler](step, cnt)(a, b)
    (ev, eaux), (ega, egb) = step(a, b)
    assert cnt.frame_count == 1
    compare((v, aux["s"], gb), (ev, eaux["s"], egb))
    tdfunc.testing.assert_close(ga, ega)
    assert ga["u"].eq(0).all()  # an unused leaf: zeros


def test_value_and_grad_errors_keep_their_type_inside_torch_compile() -> None:
    p = tdfunc.TensorDict(w=torch.ones(2))
    f = torch.compile(lambda p: tdfunc.value_and_grad(lambda q: q["w"] * 2)(p), backend="eager")
    with pytest.raises(TypeError, match="scalar"):
        f(p)
