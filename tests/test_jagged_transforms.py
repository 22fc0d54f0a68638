"""Jagged leaves under every ``torch.func`` transform.

Inside ``torch.func.grad`` / ``vjp`` / ``jvp`` / ``jacrev`` / ``jacfwd`` / ``torch.vmap`` and
``tdfunc.value_and_grad``, eagerly and compiled, each jagged op of the library gives the value
it gives outside every transform, and gradients equal those of the same loss computed on plain
padded tensors. Where torch itself has no rule for a transform (a jagged tensor that
``torch.func`` differentiates, a jagged leaf mapped over its batch dim, forward mode under
``torch.compile``), the op raises ``JaggedOpError`` naming the key, or torch's own error stands
and the bare jagged tensor is shown to raise it too. The input container is never changed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import JaggedOpError, TensorDict
from tdfunc._jagged import _layout as R

LENS = (5, 9, 3)
MASK = torch.tensor([True, False, True])


def make(seed: int = 0, lens: tuple[int, ...] = LENS) -> Any:
    """A batch of ``len(lens)`` samples: two jagged leaves (``tok`` 1-D rows, ``feat`` rows of
    2 features) and a stacked one (``lab``)."""
    g = torch.Generator().manual_seed(seed)
    return tdfunc.as_jagged(
        [
            TensorDict(
                tok=torch.randn(n, generator=g),
                feat=torch.randn(n, 2, generator=g),
                lab=torch.randn((), generator=g),
            )
            for n in lens
        ]
    )


#: every jagged op of the library, as a function of the batch (a container with jagged
#: leaves comes out; the loss pads it)
OPS: dict[str, Callable[[Any], Any]] = {
    "to_padded": lambda jb: jb,
    "from_padded": lambda jb: tdfunc.from_padded(tdfunc.to_padded(jb, 0.0)),
    "pointwise": lambda jb: torch.sin(jb) * 2 + 1,
    "index_rows": lambda jb: jb[torch.tensor([2, 0])],
    "index_slice": lambda jb: jb[1:],
    "index_mask": lambda jb: jb[MASK],
    "index_int": lambda jb: jb[1],
    "cat": lambda jb: tdfunc.cat([jb, jb * 2]),
    "split": lambda jb: tdfunc.cat(list(jb.split([1, 2]))[::-1]),
    "where": lambda jb: torch.where(MASK, jb, jb * 0.5),
    "consolidate": lambda jb: jb.consolidate(),
}


def padded(td: Any) -> tuple[torch.Tensor, ...]:
    """The leaves of ``td`` padded (``to_padded``), masks included, in key order."""
    p = tdfunc.to_padded(td, 0.0)
    return tuple(p.get(k) for k in p.keys(include_nested=True, leaves_only=True))


def loss_of(op: str) -> Callable[[torch.Tensor, Any], tuple[torch.Tensor, tuple[Any, ...]]]:
    """``w * (sum of op(jb)'s padded leaves)`` and, as aux, those padded leaves."""

    def loss(w: torch.Tensor, jb: Any) -> tuple[torch.Tensor, tuple[Any, ...]]:
        out = padded(OPS[op](jb))
        return sum((x * w).sum() for x in out if x.is_floating_point()), out

    return loss


def reference(op: str, jb: Any) -> tuple[torch.Tensor, tuple[Any, ...], torch.Tensor]:
    """Outside every transform: the loss, the padded leaves, and the gradient of the same loss
    computed on the padded leaves as plain tensors."""
    value, out = loss_of(op)(torch.tensor(1.0), jb)
    plain = [x.detach().clone() for x in out if x.is_floating_point()]
    w = torch.tensor(1.0, requires_grad=True)
    (g,) = torch.autograd.grad(sum((x * w).sum() for x in plain), w)
    return value.detach(), out, g


# each transform of the loss: (w, jb) -> (value or None, gradient, aux); jb is an argument
# the transform does not differentiate (or, for jvp and vjp, a closure)
def _grad(f, w, jb):
    g, aux = torch.func.grad(f, has_aux=True)(w, jb)
    return None, g, aux


def _vjp(f, w, jb):
    value, fn, aux = torch.func.vjp(lambda w: f(w, jb), w, has_aux=True)
    (g,) = fn(torch.ones_like(value))
    return value, g, aux


def _jvp(f, w, jb):
    value, tangent, aux = torch.func.jvp(
        lambda w: f(w, jb), (w,), (torch.ones_like(w),), has_aux=True
    )
    return value, tangent, aux


def _jacrev(f, w, jb):
    g, aux = torch.func.jacrev(f, has_aux=True)(w, jb)
    return None, g, aux


def _jacfwd(f, w, jb):
    g, aux = torch.func.jacfwd(f, has_aux=True)(w, jb)
    return None, g, aux


def _vmap(f, w, jb):
    # vmap over the weight beside the batch (in_dims=None: the batch is not mapped)
    values, aux = torch.vmap(f, in_dims=(0, None))(torch.stack([w, 2 * w]), jb)
    return values[0], None, tuple(a[0] for a in aux)


def _vmap_of_grad(f, w, jb):
    g, aux = torch.vmap(torch.func.grad(f, has_aux=True), in_dims=(0, None))(
        torch.stack([w, 2 * w]), jb
    )
    return None, g[0], tuple(a[0] for a in aux)


def _grad_of_vmap(f, w, jb):
    def total(w, jb):
        values, aux = torch.vmap(f, in_dims=(0, None))(torch.stack([w, w]), jb)
        return values.mean(), tuple(a[0] for a in aux)

    g, aux = torch.func.grad(total, has_aux=True)(w, jb)
    return None, g, aux


def _value_and_grad(f, w, jb):
    (value, aux), g = tdfunc.value_and_grad(f, has_aux=True)(w, jb)
    return value, g, aux


TRANSFORMS = {
    "grad": _grad,
    "vjp": _vjp,
    "jvp": _jvp,
    "jacrev": _jacrev,
    "jacfwd": _jacfwd,
    "vmap": _vmap,
    "vmap_of_grad": _vmap_of_grad,
    "grad_of_vmap": _grad_of_vmap,
    "value_and_grad": _value_and_grad,
}
#: compiled with fullgraph=True: forward mode (jvp, jacfwd) over a padded jagged tensor and an
#: int index of one are refused by torch itself on the bare jagged tensor
#: (test_compiled_what_torch_refuses_on_the_bare_jagged_tensor)
COMPILED = ["grad", "vjp", "jacrev", "vmap", "vmap_of_grad", "grad_of_vmap", "value_and_grad"]
COMPILED_OPS = [op for op in OPS if op != "index_int"]
#: the compiled matrix: every op under two compiled transforms and every transform over at
#: least two ops in ``make test``; all pairs with TDFUNC_JAGGED_ALL=1 (``make fuzz``)
COMPILED_PAIRS = (
    [(op, t) for op in COMPILED_OPS for t in COMPILED]
    if os.environ.get("TDFUNC_JAGGED_ALL") == "1"
    else [
        (op, COMPILED[(i + k) % len(COMPILED)]) for i, op in enumerate(COMPILED_OPS) for k in (0, 3)
    ]
)


def snapshot(td: Any) -> list[tuple[Any, ...]]:
    """Every leaf of ``td``: the object, and copies of its values and offsets."""
    out = []
    for x in td.leaves():
        if x.is_nested:
            out.append((x, x.values().clone(), x.offsets().clone()))
        else:
            out.append((x, x.clone(), None))
    return out


def assert_unchanged(td: Any, before: list[tuple[Any, ...]]) -> None:
    for (x, values, offsets), y in zip(before, td.leaves(), strict=True):
        assert x is y
        if offsets is None:
            assert torch.equal(y, values)
        else:
            assert torch.equal(y.values(), values)
            assert torch.equal(y.offsets(), offsets)


def check(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    value, g, aux = got
    want_value, want_aux, want_g = want
    if value is not None:
        torch.testing.assert_close(value, want_value)
    if g is not None:
        torch.testing.assert_close(g, want_g)
    assert len(aux) == len(want_aux)
    for a, b in zip(aux, want_aux, strict=True):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b.detach())


# ------------------------------------------------------------------ the helper


def test_to_padded_under_grad_pads_the_leaf():
    jb = make()

    def loss(w, jb):
        pb = tdfunc.to_padded(jb, 0.0)
        return (pb["tok"] * w).sum(), pb

    g, pb = torch.func.grad(loss, has_aux=True)(torch.ones(()), jb)
    want = tdfunc.to_padded(jb, 0.0)
    assert pb["tok"].shape == (3, max(LENS))
    assert pb["masks", "tok"].sum(1).tolist() == list(LENS)
    torch.testing.assert_close(pb["tok"], want["tok"])
    torch.testing.assert_close(g, want["tok"].sum())


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_leaf_kind_is_asked_under_its_wrappers():
    nt = make()["tok"]
    dense = torch.ones(3)
    seen: dict[str, Any] = {}

    def record(name):
        def f(w, x):
            seen[name] = (R.leaf_kind(x), R.layout_of(x), R.jagged_base(x) is nt)
            return w.sum()

        return f

    torch.func.grad(record("grad"))(torch.ones(()), nt)
    torch.func.grad(lambda w, x: torch.func.grad(record("grad2"))(w, x))(torch.ones(()), nt)
    torch.func.jacfwd(record("jacfwd"))(torch.ones(()), nt)
    torch.vmap(record("vmap"), in_dims=(0, None))(torch.ones(2), nt)
    record("outside")(torch.ones(()), nt)
    for name in ("grad", "grad2", "jacfwd", "vmap", "outside"):
        assert seen[name] == (R.JAGGED, torch.jagged, True), name
    assert R.leaf_kind(dense) == R.DENSE
    assert R.leaf_kind("text") == R.DENSE

    def differentiated(x):
        seen["diff"] = R.leaf_kind(x)
        return x.values().sum() * 0

    with pytest.raises(NotImplementedError):  # torch: no backward of values() under grad
        torch.func.grad(differentiated)(nt)
    assert seen["diff"] == R.JAGGED_DIFF

    def rows(x):
        seen["rows"] = R.leaf_kind(x)
        return x.sum(0)

    torch.vmap(rows)(nt)
    assert seen["rows"] == R.JAGGED_ROWS


@pytest.mark.parametrize("transform", ["plain", "grad", "vmap", "grad_of_vmap"])
def test_the_helper_compiles_without_a_graph_break(transform):
    def kind(w, x):
        return w * (R.leaf_kind(x) == R.JAGGED) + R.jagged_base(x).offsets()[-1]

    fn = {
        "plain": kind,
        "grad": lambda w, x: torch.func.grad(kind)(w, x),
        "vmap": lambda w, x: torch.vmap(kind, in_dims=(0, None))(w.expand(2), x),
        "grad_of_vmap": lambda w, x: torch.func.grad(
            lambda w, x: torch.vmap(kind, in_dims=(0, None))(w.expand(2), x).sum()
        )(w, x),
    }[transform]
    torch._dynamo.reset()
    cc = CompileCounterWithBackend("eager")
    f = torch.compile(fn, backend=cc, fullgraph=True)
    for seed in (0, 1):
        x = make(seed)["tok"]
        torch.testing.assert_close(f(torch.ones(()), x), fn(torch.ones(()), x))
    assert cc.frame_count == 1


# ------------------------------------------------------------------ each op x each transform


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("op", list(OPS))
def test_op_under_transform_gives_the_value_outside(op, transform):
    jb = make()
    want = reference(op, jb)
    before = snapshot(jb)
    check(TRANSFORMS[transform](loss_of(op), torch.tensor(1.0), jb), want)
    assert_unchanged(jb, before)


@pytest.mark.parametrize(("op", "transform"), COMPILED_PAIRS)
def test_op_under_compiled_transform_one_frame_no_recompile(op, transform):
    loss = loss_of(op)
    run = TRANSFORMS[transform]
    torch._dynamo.reset()
    cc = CompileCounterWithBackend("eager")
    f = torch.compile(lambda w, jb: run(loss, w, jb), backend=cc, fullgraph=True)
    for seed in (0, 1):  # new values, same structure and lengths: no recompile
        jb = make(seed)
        before = snapshot(jb)
        check(f(torch.tensor(1.0), jb), reference(op, jb))
        assert_unchanged(jb, before)
    assert cc.frame_count == 1


# ------------------------------------------------------------------ what torch refuses


def test_torch_has_no_backward_through_a_jagged_tensor_under_torch_func():
    nt = make()["tok"]
    # the bare jagged tensor: forward runs, the backward raises
    _, fn = torch.func.vjp(lambda x: x.to_padded_tensor(0.0).sum(), nt)
    with pytest.raises(NotImplementedError):
        fn(torch.ones(()))
    with pytest.raises((NotImplementedError, RuntimeError)):
        torch.func.grad(lambda w: (nt * w).to_padded_tensor(0.0).sum())(torch.ones(()))
    # plain autograd has the rule
    w = torch.ones((), requires_grad=True)
    (g,) = torch.autograd.grad((nt * w).to_padded_tensor(0.0).sum(), w)
    torch.testing.assert_close(g, nt.values().sum())


def _diff_message(op: str) -> str:
    return re.escape(R.JAGGED_DIFF_OP.format(key="'tok'", op=op)[:90])


@pytest.mark.parametrize("op", list(OPS))
def test_a_jagged_leaf_differentiated_by_torch_func_names_the_key(op):
    jb = make()
    before = snapshot(jb)
    loss = loss_of(op)
    first = {f"index_{k}": "a batch op" for k in ("rows", "slice", "mask", "int")}
    first.update(cat="cat", split="split", consolidate="consolidate")
    first["where"] = "a batch-shaped operand (a mask, where)"
    msg = _diff_message(first.get(op, "to_padded"))
    # vjp differentiates every primal, the batch too; grad with argnums naming the batch
    with pytest.raises(JaggedOpError, match=msg):
        torch.func.vjp(loss, torch.ones(()), jb, has_aux=True)
    with pytest.raises(JaggedOpError, match=msg):
        torch.func.grad(loss, argnums=1, has_aux=True)(torch.ones(()), jb)
    assert_unchanged(jb, before)


def test_value_and_grad_differentiates_a_jagged_leaf_eagerly():
    # torch.autograd has the backward torch.func lacks: the gradient is a jagged tensor
    jb = make()
    before = snapshot(jb)
    value, g = tdfunc.value_and_grad(lambda jb: (tdfunc.to_padded(jb, 0.0)["tok"] ** 2).sum())(jb)
    torch.testing.assert_close(value, (jb["tok"].values() ** 2).sum())
    assert g["tok"].is_nested
    torch.testing.assert_close(g["tok"].values(), 2 * jb["tok"].values())
    torch.testing.assert_close(g["tok"].offsets(), jb["tok"].offsets())
    assert_unchanged(jb, before)


def test_a_jagged_leaf_computed_from_a_differentiated_input_names_the_key():
    jb = make()

    def loss(w, jb):
        return tdfunc.to_padded(jb * w, 0.0)["tok"].sum()

    msg = _diff_message("to_padded")
    with pytest.raises(JaggedOpError, match=msg):
        torch.func.grad(loss)(torch.ones(()), jb)
    # the same loss padded first differentiates
    g = torch.func.grad(lambda w, jb: (tdfunc.to_padded(jb, 0.0)["tok"] * w).sum())(
        torch.ones(()), jb
    )
    torch.testing.assert_close(g, jb["tok"].values().sum())
    # compiled (fullgraph): Dynamo reports the error as Unsupported with the message
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Observed exception"):
        torch.compile(lambda w, jb: torch.func.grad(loss)(w, jb), backend="eager", fullgraph=True)(
            torch.ones(()), jb
        )
    # tdfunc.value_and_grad differentiates through torch.autograd, which has the rule
    value, g = tdfunc.value_and_grad(loss)(torch.ones(()), jb)
    torch.testing.assert_close(g, jb["tok"].values().sum())
    torch.testing.assert_close(value, jb["tok"].values().sum())


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("op", ["to_padded", "index_rows", "consolidate", "pointwise", "where"])
def test_vmap_over_the_jagged_batch_dim_names_the_key(op):
    jb = make()
    before = snapshot(jb)

    def per_row(td):  # one row per call: batch size ()
        if op == "where":
            return torch.where(td["lab"] > 0, td, td * 0.5)
        if op == "index_rows":
            return td[None]
        return OPS[op](td) if op != "to_padded" else tdfunc.to_padded(td, 0.0)

    with pytest.raises(JaggedOpError, match=r"key '(tok|feat)': .*torch\.vmap"):
        torch.vmap(per_row)(jb)
    # what torch does define on the rows: a row reduced to one shape
    got = torch.vmap(lambda td: td["tok"].sum(0) * td["lab"])(jb)
    want = torch.stack([r.sum() * lab for r, lab in zip(jb["tok"].unbind(), jb["lab"])])
    torch.testing.assert_close(torch.stack(got.unbind()), want)
    assert_unchanged(jb, before)


def _fwd(transform: str, pad: Callable[[Any], torch.Tensor]) -> Callable[..., Any]:
    """``transform`` (jvp or jacfwd) of ``w * sum(pad(x))`` over a weight, ``x`` not mapped."""
    if transform == "jvp":
        return lambda w, x: torch.func.jvp(lambda w: (pad(x) * w).sum(), (w,), (torch.ones(()),))
    return lambda w, x: torch.func.jacfwd(lambda w, x: (pad(x) * w).sum())(w, x)


@pytest.mark.parametrize(
    ("transform", "op"), [("jvp", "to_padded"), ("jacfwd", "to_padded"), ("grad", "index_int")]
)
def test_compiled_what_torch_refuses_on_the_bare_jagged_tensor(transform, op):
    # torch 2.13 compiles neither forward mode over to_padded_tensor of a jagged tensor (its
    # max_seqlen is specialized) nor an int index of one (an unbacked row length), with or
    # without a transform: the bare program fails, and so does the container's, with
    # torch's error; tdfunc adds no rule of its own
    jb = make()
    nt = jb["feat"]
    if op == "to_padded":
        bare = _fwd(transform, lambda x: x.to_padded_tensor(0.0))
    else:
        bare = lambda w, x: torch.func.grad(lambda w, x: (x[1] * w).sum())(w, x)  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(Exception) as torch_error:  # noqa: PT011 (torch's error type varies)
        torch.compile(bare, backend="eager", fullgraph=True)(torch.ones(()), nt)
    loss = loss_of(op)
    torch._dynamo.reset()
    with pytest.raises(type(torch_error.value)):
        torch.compile(
            lambda w, jb: TRANSFORMS[transform](loss, w, jb), backend="eager", fullgraph=True
        )(torch.ones(()), jb)
