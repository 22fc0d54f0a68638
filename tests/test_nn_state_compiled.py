"""Module state through ``functional_call(..., return_state=True)`` where it used to trip:
state whose shapes change between steps (quantization observers), unwritten state under
``torch.compile`` (the caller's own tensors, no copy), and typed errors under compile."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.ao.quantization import FakeQuantize, PerChannelMinMaxObserver
from torch.nn.utils import parametrizations

from tdfunc import TensorDict, from_module, functional_call, stack_modules
from tdfunc.nn._errors import PARAM_SHAPE, STACKED_STATE, STATE_CREATED, STATE_WRITTEN


# ----------------------------------------------------------------------------- state that grows
def per_channel_observer() -> nn.Module:
    return PerChannelMinMaxObserver(ch_axis=0)


def per_channel_fake_quantize() -> nn.Module:
    return FakeQuantize(
        observer=PerChannelMinMaxObserver,
        quant_min=-128,
        quant_max=127,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )


def _inputs(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=g) * (i + 1) for i in range(steps)]


def _stateful(module: nn.Module, xs: list[torch.Tensor]) -> list[tuple[Any, dict[str, Any]]]:
    """Each step's output and state, of a copy of ``module`` run the ordinary way."""
    ref = copy.deepcopy(module)
    out = []
    for x in xs:
        y = ref(x)
        out.append((y, {k: v.clone() for k, v in from_module(ref).flatten_keys(".").items()}))
    return out


@pytest.mark.parametrize("make", [per_channel_observer, per_channel_fake_quantize])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_state_whose_shape_changes_runs_ten_steps(
    make: Callable[[], nn.Module], compiled: bool
) -> None:
    """The statistics start empty ((0,), or (1,) for the fake-quantize scale) and take one
    value per channel at the first call: the state's shapes are the state's. Compiled means
    without ``fullgraph`` (torch breaks the graph in the observers itself): one recompile when
    the shapes change, none afterwards."""
    torch.manual_seed(0)
    module = make()
    xs = _inputs(10)
    expected = _stateful(module, xs)
    own = {k: (v, v.clone()) for k, v in from_module(module).flatten_keys(".").items()}
    state = from_module(module).detach().clone()
    shapes0 = {k: tuple(v.shape) for k, v in state.flatten_keys(".").items()}
    cnt = CompileCounterWithBackend("eager")

    def step(s: TensorDict, x: torch.Tensor) -> tuple[Any, TensorDict]:
        return functional_call(module, s, (x,), return_state=True)

    fn = torch.compile(step, backend=cnt) if compiled else step
    frames = []
    for x, (ref_out, ref_state) in zip(xs, expected):
        before = state.clone()
        out, new = fn(state, x)
        torch.testing.assert_close(out, ref_out)
        got = dict(new.flatten_keys(".").items())
        assert sorted(got) == sorted(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(got[k], v, msg=k)
        # the given state is not written
        for k, v in before.flatten_keys(".").items():
            assert torch.equal(state.flatten_keys(".")[k], v), k
        state = new
        frames.append(cnt.frame_count)
    shapes = {k: tuple(v.shape) for k, v in state.flatten_keys(".").items()}
    assert shapes != shapes0  # the statistics took one value per channel
    assert shapes["activation_post_process.min_val" if "scale" in shapes else "min_val"] == (4,)
    # the module kept its own tensors, with their values
    for k, (t, v) in own.items():
        assert from_module(module).flatten_keys(".")[k] is t
        assert torch.equal(t, v)
    if compiled:
        assert frames[1] > frames[0]  # the shapes changed: a recompile
        assert frames[-1] == frames[1]  # none afterwards


def test_state_whose_shape_changes_under_grad() -> None:
    """Under torch.func.grad the state's tensors are functorch wrappers: a buffer's private
    copy is still a copy (torch's copy-on-write clone breaks when ``resize_`` grows it)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), per_channel_observer())
    params = from_module(module, buffers=False).detach().clone()
    buffers = from_module(module).exclude("0")
    x = _inputs(1)[0]
    ref = copy.deepcopy(module)
    ref(x).sum().backward()

    def loss(p: TensorDict, b: TensorDict) -> tuple[torch.Tensor, Any]:
        out, new = functional_call(module, (p, b), (x,), return_state=True)
        return out.sum(), new[1]

    grads, new = torch.func.grad(loss, has_aux=True)(params, buffers)
    torch.testing.assert_close(grads["0", "weight"], ref[0].weight.grad)
    torch.testing.assert_close(new["1", "min_val"], ref[1].min_val)
    torch.testing.assert_close(new["1", "max_val"], ref[1].max_val)
    assert buffers["1", "min_val"].shape == (0,)  # the given state is not written


def test_stacked_state_outside_vmap_names_what_it_found() -> None:
    nets = [nn.Linear(3, 2) for _ in range(4)]
    stacked = stack_modules(nets)
    text = STACKED_STATE.format(n=4, key="weight", got=(4, 2, 3), expected=(2, 3))
    with pytest.raises(ValueError, match="stacked over 4 modules") as info:
        functional_call(nets[0], stacked, (torch.ones(5, 3),))
    assert str(info.value) == text
    # through torch.vmap, one member per call
    out = torch.vmap(lambda s, x: functional_call(nets[0], s, (x,)), in_dims=(0, None))(
        stacked, torch.ones(5, 3)
    )
    assert out.shape == (4, 5, 2)
    # a parameter of another shape is refused, naming it; so are several
    state = from_module(nets[0]).set("bias", torch.zeros(4))
    text = PARAM_SHAPE.format(key="bias", got=(4,), expected=(2,))
    with pytest.raises(ValueError, match=re.escape(text)) as refused:
        functional_call(nets[0], state, (torch.ones(5, 3),))
    assert str(refused.value) == text
    grown = from_module(nets[0]).set("weight", torch.zeros(5, 3)).set("bias", torch.zeros(5))
    text = PARAM_SHAPE.format(key="weight", got=(5, 3), expected=(2, 3))
    with pytest.raises(ValueError, match=re.escape(text)) as refused:
        functional_call(nets[0], grown, (torch.ones(2, 3),))
    assert str(refused.value) == text


def test_state_with_its_own_shapes_takes_the_kept_plan() -> None:
    """The slot plan kept between calls takes a state whose shapes are its own (the observer's
    grown statistics) once the full path accepted them; a stacked state of the same structure
    still goes to the full path, which refuses it."""
    from tdfunc.nn import _plan

    module = per_channel_observer()
    x = torch.randn(4, 8)
    fresh = from_module(module).detach().clone()
    _, state = functional_call(module, fresh, (x,), return_state=True)
    _, state = functional_call(module, state, (x,), return_state=True)  # plans these shapes
    assert state["min_val"].shape == (4,)
    assert module.min_val.shape == (0,)
    live, _ = _plan.lookup(module, state, False, True)
    assert live is not None
    assert live.tensors[list(state.keys()).index("min_val")] is state["min_val"]
    _, again = functional_call(module, state, (x,), return_state=True)
    torch.testing.assert_close(again["min_val"], state["min_val"])
    stacked = fresh.apply(lambda t: torch.stack([t, t]), batch_size=[2])
    assert _plan.lookup(module, stacked, False, True)[0] is None
    with pytest.raises(ValueError, match="stacked over 2 modules"):
        functional_call(module, stacked, (x,))


# ----------------------------------------------------------------------------- unwritten state
class SliceOut(nn.Module):
    """Returns a view of its buffer (``through_view=True``: computes from one)."""

    def __init__(self, through_view: bool = False) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(12.0).reshape(4, 3))
        self.through_view = through_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table[1:3]
        return rows + x[:2] if self.through_view else rows


class ReadsFlags(nn.Module):
    """Reads its parameter's ``requires_grad`` flag, sets its buffer's (writes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.requires_grad_(False)
        y = self.lin(x)
        return y * self.scale if self.lin.weight.requires_grad else y


UNWRITTEN: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "batchnorm_eval": (lambda: nn.BatchNorm1d(3).eval(), lambda: torch.randn(5, 3)),
    "instancenorm_stats_eval": (
        lambda: nn.InstanceNorm1d(3, track_running_stats=True).eval(),
        lambda: torch.randn(2, 3, 5),
    ),
    "spectral_norm_eval": (
        lambda: parametrizations.spectral_norm(nn.Linear(3, 3)).eval(),
        lambda: torch.randn(5, 3),
    ),
    "orthogonal_eval": (
        lambda: parametrizations.orthogonal(nn.Linear(3, 3)).eval(),
        lambda: torch.randn(5, 3),
    ),
    "buffer_returned_as_view": (SliceOut, lambda: torch.randn(5, 3)),
    "buffer_read_through_view": (lambda: SliceOut(True), lambda: torch.randn(5, 3)),
    "requires_grad_flags": (ReadsFlags, lambda: torch.randn(5, 3)),
}


def _unwritten_setup(kind: str) -> tuple[nn.Module, Callable[[], torch.Tensor], TensorDict]:
    make, make_x = UNWRITTEN[kind]
    torch.manual_seed(0)
    module = make()
    state = from_module(module).detach().clone()
    # parameters as a training loop holds them: leaves that require grad
    params = {k for k, _ in module.named_parameters()}
    flat = {k: v.requires_grad_(k in params) for k, v in state.flatten_keys(".").items()}
    return module, make_x, TensorDict(flat).unflatten_keys(".")


@pytest.mark.parametrize(
    ("kind", "backend"),
    [(k, "aot_eager") for k in sorted(UNWRITTEN)]
    + [(k, "eager") for k in ("batchnorm_eval", "buffer_returned_as_view")],
)
def test_unwritten_state_is_the_callers_own_under_compile(kind: str, backend: str) -> None:
    """``fullgraph=True``: the new state is the given container, every leaf the caller's own
    tensor (as eagerly); 1 frame, no recompile on new values."""
    module, make_x, state = _unwritten_setup(kind)
    cnt = CompileCounterWithBackend(backend)
    fn = torch.compile(
        lambda s, x: functional_call(module, s, (x,), return_state=True),
        backend=cnt,
        fullgraph=True,
    )
    for _ in range(3):
        x = make_x()
        out, new = fn(state, x)
        eager_out, eager_new = functional_call(module, state, (x,), return_state=True)
        assert eager_new is state
        torch.testing.assert_close(out, eager_out)
        mine = dict(new.flatten_keys(".").items())
        given = dict(state.flatten_keys(".").items())
        for k in given:
            assert mine[k] is given[k], k
        assert new is state
    assert cnt.frame_count == 1


@pytest.mark.slow
def test_unwritten_state_costs_no_copy_kernel_with_inductor() -> None:
    """Inductor's code for an eval-mode batch norm, an eval-mode spectral norm and a module
    reading its buffer through a view holds no copy kernel: unwritten buffers are read where
    they are. (An output that *is* a view of a buffer is a view of the module's private copy,
    eagerly and compiled, so inductor makes that copy: the state still comes back as given.)"""
    from torch._inductor.utils import run_and_get_code

    for kind in ("batchnorm_eval", "spectral_norm_eval", "buffer_read_through_view"):
        module, make_x, state = _unwritten_setup(kind)
        torch._dynamo.reset()
        fn = torch.compile(
            lambda s, x, m=module: functional_call(m, s, (x,), return_state=True),
            backend="inductor",
            fullgraph=True,
        )
        x = make_x()
        (out, new), codes = run_and_get_code(fn, state, x)
        assert new is state
        torch.testing.assert_close(out, functional_call(module, state, (x,)))
        code = "\n".join(codes)
        assert not re.search(r"clone|copy", code), (kind, code)


# ----------------------------------------------------------------------------- typed errors
class ForeachEMA(nn.Module):
    """Moving averages of its input in two buffers, written by one in-place foreach op."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(3))
        self.register_buffer("b", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._foreach_mul_([self.a, self.b], 0.75)
        torch._foreach_add_([self.a, self.b], [x.mean(0) / 4, x.mean(0) / 4])
        return x * 2


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return x + 1


class Grows(nn.Module):
    """Creates a buffer at its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.detach().sum(0)
        return x + 1


def _written(cls: str, name: str) -> str:
    return STATE_WRITTEN.format(
        module="(the root module)", cls=cls, kind="buffer", name=name, key=name
    )


REFUSALS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "foreach_write": (ForeachEMA, _written("ForeachEMA", "a")),
    "in_place_write": (Counter, _written("Counter", "count")),
    "created": (Grows, STATE_CREATED.format(key="seen", cls="Grows")),
}


@pytest.mark.parametrize(
    ("kind", "backend", "fullgraph"),
    [(k, "aot_eager", f) for k in sorted(REFUSALS) for f in (True, False)]
    + [("foreach_write", "eager", True)],
)
def test_refusal_keeps_its_type_and_message_under_compile(
    kind: str, backend: str, fullgraph: bool
) -> None:
    """What the module did (a write, state created) with ``return_state=False``: eager's
    PermissionError, type and message, raised by the compiled program itself, and nothing
    written; the same module with ``return_state=True`` compiles to one frame."""
    make, text = REFUSALS[kind]
    module = make()
    state = from_module(module).detach().clone()
    before = {k: v.clone() for k, v in state.items()}
    x = torch.randn(4, 3)
    with pytest.raises(PermissionError) as eager:
        functional_call(module, state, (x,))
    assert str(eager.value) == text
    cnt = CompileCounterWithBackend(backend)
    fn = torch.compile(
        lambda s, x: functional_call(module, s, (x,)), backend=cnt, fullgraph=fullgraph
    )
    for _ in range(2):
        with pytest.raises(PermissionError) as compiled:
            fn(state, torch.randn(4, 3))
        assert type(compiled.value) is PermissionError
        assert str(compiled.value) == text
    assert cnt.frame_count == 1  # the program raises; no graph break, no recompile
    for k, v in before.items():
        assert torch.equal(state[k], v)
    assert all(from_module(module)[k].abs().sum() == v.abs().sum() for k, v in before.items())
    if not fullgraph:
        return
    # with return_state=True the same module gives its new state, compiled as eagerly
    stepped = torch.compile(
        lambda s, x: functional_call(module, s, (x,), return_state=True),
        backend=backend,
        fullgraph=True,
    )
    _, new = stepped(state, x)
    _, eager_new = functional_call(module, state, (x,), return_state=True)
    got, expected = dict(new.items()), dict(eager_new.items())
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v)


# ----------------------------------------------------------------------------- parameter shapes
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        self.register_buffer("offset", torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.offset.sum()


@pytest.mark.parametrize(
    ("backend", "fullgraph"), [("eager", True), ("eager", False), ("aot_eager", True)]
)
def test_parameter_of_another_shape_is_refused_when_compiled(backend: str, fullgraph: bool) -> None:
    """Eager's ValueError, type and message, raised by the compiled program itself (one
    frame, no recompile for new values), also under a compiled torch.func.grad; a buffer of
    another shape still reaches the module."""
    torch.manual_seed(0)
    module = Net()
    x = torch.randn(2, 3)
    state = from_module(module).detach().clone()
    bad = state.set(("body", "0", "weight"), torch.zeros(5, 5))
    text = PARAM_SHAPE.format(key="body.0.weight", got=(5, 5), expected=(4, 3))
    cnt = CompileCounterWithBackend(backend)
    fn = torch.compile(
        lambda s, x: functional_call(module, s, (x,)), backend=cnt, fullgraph=fullgraph
    )
    for value in (0.0, 1.0):
        with pytest.raises(ValueError, match=re.escape(text)) as refused:
            fn(bad.set(("body", "0", "weight"), torch.full((5, 5), value)), x)
        assert type(refused.value) is ValueError
        assert str(refused.value) == text
    assert cnt.frame_count == 1

    def loss(p: TensorDict, b: TensorDict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(module, (p, b), (x,)).sum()

    params, buffers = bad.exclude("offset"), bad.select("offset")
    grad = torch.compile(torch.func.grad(loss), backend=backend, fullgraph=fullgraph)
    with pytest.raises(ValueError, match=re.escape(text)) as refused:
        grad(params, buffers, x)
    assert str(refused.value) == text
    # a buffer of another shape is the state's own (compiled as eagerly)
    grown = state.set("offset", torch.ones(5))
    torch.testing.assert_close(fn(grown, x), functional_call(module, grown, (x,)))
    torch.testing.assert_close(fn(grown, x), module.body(x) + 5.0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ensemble_parameters_are_checked_per_call(compiled: bool) -> None:
    """Under torch.vmap each call sees one member's parameters: an ensemble of stacked
    modules runs; a stacked parameter whose per-call shape is not the module's is refused
    with the per-call shapes."""
    torch.manual_seed(0)
    nets = [Net() for _ in range(3)]
    stacked = stack_modules(nets)
    x = torch.randn(2, 3)
    fn = torch.vmap(lambda s, x: functional_call(nets[0], s, (x,)), in_dims=(0, None))
    if compiled:
        fn = torch.compile(fn, backend="eager", fullgraph=True)
    out = fn(stacked, x)
    for i, net in enumerate(nets):
        torch.testing.assert_close(out[i], net(x))
    bad = stacked.set(("body", "2", "weight"), torch.zeros(3, 4, 2))
    text = PARAM_SHAPE.format(key="body.2.weight", got=(4, 2), expected=(2, 4))
    with pytest.raises(ValueError, match=re.escape(text)) as refused:
        fn(bad, x)
    assert str(refused.value) == text
