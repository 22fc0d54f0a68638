"""The private copies :func:`tdfunc.functional_call` puts into a module's slots under
:func:`tdfunc.value_and_grad`: made as one autograd node, and still private.

A module that writes its parameters (in place with grad enabled, through ``.data``, with a
foreach op, under ``no_grad``), eagerly or with its ``forward`` compiled, leaves the caller's
tensors bit for bit as they were; ``return_state=False`` raises the same ``PermissionError``,
and ``return_state=True`` gives the same new state and the same gradients as a reference
built from torch alone (``torch.func.functional_call`` on clones of the differentiated
leaves).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tdfunc
from tdfunc.nn._errors import STATE_WRITTEN

WRITES = ("add_", "data", "foreach", "no_grad")


class Writer(nn.Module):
    """A Linear whose forward first writes its own parameters, one way or another."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.lin.weight
        if self.how == "add_":
            w.add_(1.0)
        elif self.how == "data":
            w.data.mul_(2.0)
        elif self.how == "foreach":
            torch._foreach_add_([self.lin.weight, self.lin.bias], 1.0)
        else:
            with torch.no_grad():
                w.add_(1.0)
        return self.lin(x).square().sum()


def _writer(how: str, compiled: bool) -> Writer:
    torch.manual_seed(0)
    m = Writer(how)
    if compiled:
        m.forward = torch.compile(m.forward, backend="aot_eager")  # type: ignore[method-assign]
    return m


def _reference(m: nn.Module, state: tdfunc.TensorDict, x: torch.Tensor) -> tuple:
    """Torch alone: the module on clones of leaves that require grad; the gradients with
    respect to those leaves and the values the module left in the clones."""
    names = [".".join(k) for k in state.keys(True, True)]
    leaves = [state[tuple(n.split("."))].detach().requires_grad_() for n in names]
    clones = {n: t.clone() for n, t in zip(names, leaves)}
    out = torch.func.functional_call(m, clones, (x,))
    grads = torch.autograd.grad(out, leaves)
    return out.detach(), dict(zip(names, grads)), {n: c.detach() for n, c in clones.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", WRITES)
def test_writes_never_reach_the_callers_tensors(how: str, compiled: bool) -> None:
    torch._dynamo.reset()
    m = _writer(how, compiled)
    state = tdfunc.from_module(m).detach().clone()
    before = [t.clone() for t in state.values(True, True)]
    x = torch.ones(2, 3)

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return tdfunc.functional_call(m, p, (x,))

    with pytest.raises(PermissionError) as err:
        tdfunc.value_and_grad(loss)(state)
    assert str(err.value) == STATE_WRITTEN.format(
        module="'lin'", cls="Linear", kind="parameter", name="weight", key="lin.weight"
    )
    for a, b in zip(state.values(True, True), before):
        assert torch.equal(a, b)
    assert all(p is not None for p in m.parameters())  # the module's own tensors are back


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", WRITES)
def test_written_state_and_gradients_as_torch(how: str, compiled: bool) -> None:
    torch._dynamo.reset()
    m = _writer(how, compiled)
    state = tdfunc.from_module(m).detach().clone()
    before = [t.clone() for t in state.values(True, True)]
    own = [p.detach().clone() for p in m.parameters()]
    x = torch.ones(2, 3)

    def loss(p: tdfunc.TensorDict) -> tuple:
        out, new = tdfunc.functional_call(m, p, (x,), return_state=True)
        return out, new

    (value, new), grads = tdfunc.value_and_grad(loss, has_aux=True)(state)
    ref_m = _writer(how, False)
    ref_value, ref_grads, ref_new = _reference(ref_m, state, x)
    torch.testing.assert_close(value, ref_value)
    for k in ("lin.weight", "lin.bias"):
        key = tuple(k.split("."))
        torch.testing.assert_close(grads[key], ref_grads[k])
        torch.testing.assert_close(new[key], ref_new[k])
    for a, b in zip(state.values(True, True), before):
        assert torch.equal(a, b)  # the caller's tensors: bit for bit
    for a, b in zip(m.parameters(), own):
        assert torch.equal(a, b)  # and the module's own


def test_the_copies_are_one_backward_node() -> None:
    """Under value_and_grad the module sees copies that are not leaves (it may write them),
    all made by one autograd node, never the differentiated leaves themselves."""
    seen: list[torch.Tensor] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.extend([self.a.weight, self.a.bias, self.b.weight, self.b.bias])
            return self.b(self.a(x)).sum()

    m = Probe()
    state = tdfunc.from_module(m).detach()
    leaves = list(state.values(True, True))

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return tdfunc.functional_call(m, p, (torch.ones(1, 2),))

    tdfunc.value_and_grad(loss)(state)
    assert len(seen) == 4
    assert all(t.grad_fn is not None for t in seen)
    assert len({id(t.grad_fn) for t in seen}) == 1
    assert not any(t is leaf for t in seen for leaf in leaves)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled blocks"])
def test_blocks_step_same_values_as_torch_func(compiled: bool) -> None:
    """The by-blocks step's loss and gradients are torch.func's (eager, on dicts)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)])
    plain = copy.deepcopy(model)
    if compiled:
        for b in model:
            b.forward = torch.compile(b.forward, backend="aot_eager")
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    params = tdfunc.from_module(model, buffers=False).detach().clone()

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return F.mse_loss(tdfunc.functional_call(model, p, (x,)), y)

    value, grads = tdfunc.value_and_grad(loss)(params)
    flat = {".".join(k): v for k, v in params.items(True, True)}

    def ref(d: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(plain, d, (x,)), y)

    ref_grads, ref_value = torch.func.grad_and_value(ref)(flat)
    torch.testing.assert_close(value, ref_value)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[tuple(k.split("."))], g)


def test_backward_through_functional_call_of_own_parameters() -> None:
    """``loss.backward()`` through functional_call of a module's own parameters (leaves that
    require grad): the gradients accumulate into their ``.grad``, as torch's module call."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref = copy.deepcopy(m)
    x = torch.randn(5, 3)
    tdfunc.functional_call(m, tdfunc.from_module(m), (x,)).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)
