"""A zoo of stateful modules: ``functional_call`` against the same module run statefully.

Each kind is run through ``tdfunc.functional_call(..., return_state=True)`` and compared with
a deep copy of the module called the ordinary (stateful) way: the output, the new state (every
tensor the stateful module holds afterwards, created ones included), that the given state was
not written (values and version counters) and that the module was left exactly as it was (the
same tensor objects under every name, with their values and versions), eagerly, compiled
(eager / aot_eager, with and without ``fullgraph``; a few with inductor), as a ``torch.vmap``
ensemble and under ``torch.func.grad``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.utils import parametrizations, parametrize

import tdfunc

# ----------------------------------------------------------------------------- module kinds


class InitBuffer(nn.Module):
    """``nn.init`` on a buffer (an in-place write inside torch's init code)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("noise", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nn.init.constant_(self.noise, 0.5)
        return x + self.noise


class ForeachWrite(nn.Module):
    """``torch._foreach_lerp_`` over two buffers (one call writing a list)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(3))
        self.register_buffer("b", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._foreach_lerp_([self.a, self.b], [x.mean(0), x.mean(0)], 0.25)
        return x * 2


class ViewWrite(nn.Module):
    """Writes through views the old tracker did not list (``.T``, ``diagonal``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("m", torch.zeros(3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.m.T[0] += x.sum(0)
        self.m.diagonal().add_(1)
        return x @ self.m


class TensorOperandWrites(nn.Module):
    """In-place writes with a tensor operand: ``copy_``, ``add_``, ``lerp_``, ``[:] =``."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("a", "b", "c", "d"):
            self.register_buffer(name, torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(0)
        self.a.copy_(m)
        self.b.add_(m)
        self.c.lerp_(m, 0.5)
        self.d[:] = m
        return x + self.a


class Rebind(nn.Module):
    """Rebinds a buffer (``self.count = self.count + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * 2


class SetData(nn.Module):
    """``buf.data = v``: a rebinding torch records no version for."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.data = x.mean(0)
        return x + 1


class GrowsState(nn.Module):
    """Creates state while it runs: a buffer registered on the first call, a None filled."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = x.detach().sum(0)
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.ones(1))
        return self.lin(x)


class SharedChild(nn.Module):
    """One submodule under two names (``self.b = self.a``), batch norm in training."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.BatchNorm1d(3)
        self.b = self.a
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.lin(self.a(x)))


class TiedHead(nn.Module):
    """A tied output head (as GPT-2's ``lm_head.weight`` is the token embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(idx)))


class HookWrites(nn.Module):
    """A forward pre-hook that counts calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_forward_pre_hook(_count_call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _count_call(m: nn.Module, args: Any) -> None:
    m.calls.add_(1)


class RingBuffer(nn.Module):
    """Keeps the last inputs in a ring; the position is read as a Python int (a graph break)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ring", torch.zeros(4, 3))
        self.register_buffer("pos", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        i = int(self.pos.item())
        self.ring[i % 4] = x.mean(0)
        self.pos += 1
        return x + self.ring.sum(0)


class SliceOut(nn.Module):
    """Returns a slice of a buffer (the output must be a plain tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(12.0).reshape(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[1:3]


class NoGradToggle(nn.Module):
    """``requires_grad_(False)`` on a buffer writes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.b.requires_grad_(False)
        return x * self.b


class Custom(nn.Module):
    """A custom parametrization: a symmetric matrix."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).T


def _spectral() -> nn.Module:
    return parametrizations.spectral_norm(nn.Linear(3, 3))


def _weight_norm() -> nn.Module:
    return parametrizations.weight_norm(nn.Linear(3, 3))


def _orthogonal() -> nn.Module:
    return parametrizations.orthogonal(nn.Linear(3, 3))


def _custom_param() -> nn.Module:
    lin = nn.Linear(3, 3)
    parametrize.register_parametrization(lin, "weight", Custom())
    return lin


def _obs(obs: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), obs)


X3 = lambda: torch.randn(5, 3)  # noqa: E731
IDX = lambda: torch.tensor([[1, 2, 3, 6], [0, 5, 2, 4]])  # noqa: E731
SEQ = lambda: torch.randn(5, 2, 3)  # noqa: E731

# name -> (make module, make input, training mode)
KINDS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], bool]] = {
    "batchnorm": (lambda: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), X3, True),
    "batchnorm_eval": (lambda: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), X3, False),
    "batchnorm_cumulative": (lambda: nn.BatchNorm1d(3, momentum=None), X3, True),
    "instancenorm_stats": (
        lambda: nn.InstanceNorm1d(3, track_running_stats=True),
        lambda: torch.randn(2, 3, 5),
        True,
    ),
    "layernorm_groupnorm": (lambda: nn.Sequential(nn.LayerNorm(3), nn.GroupNorm(1, 3)), X3, True),
    "embedding_max_norm": (lambda: nn.Embedding(7, 3, max_norm=1.0), IDX, True),
    "embeddingbag_max_norm": (lambda: nn.EmbeddingBag(7, 3, max_norm=1.0), IDX, True),
    "spectral_norm": (_spectral, X3, True),
    "weight_norm": (_weight_norm, X3, True),
    "orthogonal": (_orthogonal, X3, True),
    "custom_parametrization": (_custom_param, X3, True),
    "rnn": (lambda: nn.RNN(3, 4), SEQ, True),
    "lstm": (lambda: nn.LSTM(3, 4), SEQ, True),
    "gru": (lambda: nn.GRU(3, 4), SEQ, True),
    "multihead_attention": (
        lambda: _First(nn.MultiheadAttention(3, 1, batch_first=True)),
        lambda: torch.randn(2, 4, 3),
        True,
    ),
    "transformer_layer": (
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
        lambda: torch.randn(2, 5, 4),
        True,
    ),
    "minmax_observer": (lambda: _obs(tq.MinMaxObserver()), X3, True),
    "moving_avg_observer": (lambda: _obs(tq.MovingAverageMinMaxObserver()), X3, True),
    "per_channel_observer": (lambda: _obs(tq.PerChannelMinMaxObserver(ch_axis=1)), X3, True),
    "histogram_observer": (lambda: _obs(tq.HistogramObserver(bins=16)), X3, True),
    "fake_quantize": (lambda: _obs(tq.FakeQuantize()), X3, True),
    "per_channel_fake_quantize": (
        lambda: _obs(
            tq.FakeQuantize(
                observer=tq.PerChannelMinMaxObserver,
                quant_min=-128,
                quant_max=127,
                dtype=torch.qint8,
                qscheme=torch.per_channel_symmetric,
                ch_axis=1,
            )
        ),
        X3,
        True,
    ),
    "fused_fake_quantize": (lambda: _obs(tq.FusedMovingAvgObsFakeQuantize()), X3, True),
    "nn_init": (InitBuffer, X3, True),
    "foreach": (ForeachWrite, X3, True),
    "view_writes": (ViewWrite, X3, True),
    "tensor_operand_writes": (TensorOperandWrites, X3, True),
    "rebind": (Rebind, X3, True),
    "set_data": (SetData, X3, True),
    "creates_state": (GrowsState, X3, True),
    "shared_submodule": (SharedChild, X3, True),
    "reused_in_sequential": (
        lambda: (lambda bn: nn.Sequential(bn, nn.Linear(3, 3), bn))(nn.BatchNorm1d(3)),
        X3,
        True,
    ),
    "tied_head": (TiedHead, IDX, True),
    "hook_writes": (HookWrites, X3, True),
    "ring_buffer": (RingBuffer, X3, True),
    "slice_out": (SliceOut, X3, True),
    "requires_grad_toggle": (NoGradToggle, X3, True),
}


class _First(nn.Module):
    """Self-attention returning the attention output only."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x)[0]


# ----------------------------------------------------------------------------- checks


def _module_record(m: nn.Module) -> list[tuple[str, torch.Tensor, int, torch.Tensor]]:
    named = [
        *m.named_parameters(remove_duplicate=False),
        *m.named_buffers(remove_duplicate=False),
    ]
    return [(n, t, t._version, t.detach().clone()) for n, t in named]


def assert_module_untouched(m: nn.Module, record: list[Any]) -> None:
    now = _module_record(m)
    assert [n for n, *_ in now] == [n for n, *_ in record], "the module's names changed"
    for (name, t, v, value), (_, t2, _, _) in zip(record, now):
        assert t2 is t, f"{name}: the module holds another tensor object after the call"
        assert t._version == v, f"{name}: the module's tensor was written"
        assert torch.equal(t.detach(), value), f"{name}: the module's tensor changed value"


def _state_record(state: tdfunc.TensorDict) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
    return [(t, t._version, t.detach().clone()) for t in state.leaves()]


def assert_state_untouched(state: tdfunc.TensorDict, record: list[Any]) -> None:
    for (t, v, value), t2 in zip(record, state.leaves()):
        assert t2 is t
        assert t._version == v, "a tensor of the given state was written"
        assert torch.equal(t.detach(), value), "a tensor of the given state changed value"


def _stateful(m: nn.Module, x: torch.Tensor) -> tuple[Any, tdfunc.TensorDict]:
    ref = copy.deepcopy(m)
    out = ref(x)
    return out, tdfunc.from_module(ref)


def _setup(kind: str) -> tuple[nn.Module, torch.Tensor, tdfunc.TensorDict]:
    make, make_x, training = KINDS[kind]
    torch.manual_seed(0)
    m = make().train(training)
    return m, make_x(), tdfunc.from_module(m)


def _call(m: nn.Module) -> Callable[[tdfunc.TensorDict, torch.Tensor], Any]:
    return lambda s, x: tdfunc.functional_call(m, s, (x,), return_state=True)


def _compare(out: Any, new: tdfunc.TensorDict, ref_out: Any, ref_state: tdfunc.TensorDict) -> None:
    got, expected = dict(new.flatten_keys(".").items()), dict(ref_state.flatten_keys(".").items())
    assert sorted(got) == sorted(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    for leaf in new.leaves():
        assert type(leaf) in (torch.Tensor, nn.Parameter), type(leaf)


WRITERS = [k for k in KINDS if k not in ("batchnorm_eval", "layernorm_groupnorm", "slice_out")]
WRITERS = [k for k in WRITERS if k not in ("requires_grad_toggle", "rnn", "lstm", "gru")]
WRITERS = [k for k in WRITERS if "attention" not in k and "transformer" not in k]
WRITERS = [k for k in WRITERS if k not in ("weight_norm", "orthogonal", "custom_parametrization")]
WRITERS = [k for k in WRITERS if k != "tied_head"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_eager_matches_stateful(kind: str) -> None:
    m, x, state = _setup(kind)
    ref_out, ref_state = _stateful(m, x)
    mrec, srec = _module_record(m), _state_record(state)
    out, new = _call(m)(state, x)
    _compare(out, new, ref_out, ref_state)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)
    if kind in WRITERS:
        with pytest.raises(PermissionError):
            tdfunc.functional_call(m, state, (x,))
    else:
        assert new is state  # nothing written: the very same state back
        torch.testing.assert_close(tdfunc.functional_call(m, state, (x,)), ref_out)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)


# kinds that Dynamo traces in one graph (the others break the graph inside the module)
BREAKS = {
    "batchnorm_cumulative",  # float(num_batches_tracked)
    "ring_buffer",  # .item()
    "set_data",  # .data = on a tensor made in the graph
    "creates_state",  # hasattr on a module attribute registered while tracing
    "histogram_observer",
    "per_channel_observer",
    "per_channel_fake_quantize",
    "minmax_observer",
    "moving_avg_observer",
    "fake_quantize",
    "fused_fake_quantize",
    "embeddingbag_max_norm",
    "orthogonal",
    "spectral_norm",
    "rnn",  # Dynamo does not trace RNN modules
    "lstm",
    "gru",
}
ONE_GRAPH = [k for k in KINDS if k not in BREAKS]


@pytest.mark.parametrize("kind", ONE_GRAPH)
def test_compiled_fullgraph_matches_stateful(kind: str) -> None:
    m, x, state = _setup(kind)
    # tensors of their own (the module's own Parameters would be the same objects as the
    # state's: Dynamo then guards on their identity, as on any aliased input)
    state = state.detach().clone()
    ref_out, ref_state = _stateful(m, x)
    mrec, srec = _module_record(m), _state_record(state)
    cnt = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(_call(m), backend=cnt, fullgraph=True)
    out, new = fn(state, x)
    _compare(out, new, ref_out, ref_state)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)
    assert cnt.frame_count == 1
    # new values of the same structure: no recompile
    fn(tdfunc.from_module(copy.deepcopy(m)).detach().clone(), x)
    assert cnt.frame_count == 1
    assert_module_untouched(m, mrec)


def _written_keys(new: tdfunc.TensorDict, state: tdfunc.TensorDict) -> set[str]:
    """The keys whose tensor in ``new`` is not the given one (what the call reports written)."""
    return {".".join(p) for p, v in new.items(True, True) if v is not state[p]}


# observers and fake-quantize modules: compiled (graph breaks inside them), the written
# buffers and the refusal are exactly the eager ones (a mark taken in a traced frame before
# the call and one taken eagerly after it used to disagree on the storage: false writes)
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize(
    "kind",
    ["fake_quantize", "per_channel_fake_quantize", "per_channel_observer", "histogram_observer"],
)
def test_compiled_quantization_state_is_the_eager_state(kind: str, backend: str) -> None:
    m, x, state = _setup(kind)
    eager_out, eager_new = _call(m)(state, x)
    eager_written = _written_keys(eager_new, state)
    assert eager_written  # they do write (observed ranges, scale, zero point)
    with pytest.raises(PermissionError) as eager_refusal:
        tdfunc.functional_call(m, state, (x,))
    cnt = CompileCounterWithBackend(backend)
    fn = torch.compile(_call(m), backend=cnt)
    plain = torch.compile(lambda s, x: tdfunc.functional_call(m, s, (x,)), backend=backend)
    graphs = None
    for _ in range(10):
        out, new = fn(state, x)
        assert _written_keys(new, state) == eager_written
        _compare(out, new, eager_out, eager_new)
        with pytest.raises(PermissionError) as refusal:
            plain(state, x)
        assert str(refusal.value) == str(eager_refusal.value)
        graphs = cnt.frame_count if graphs is None else graphs
        assert cnt.frame_count == graphs  # no recompile after the first step


# a buffer written by an in-place foreach op: fake tensors record no version for it, so the
# traced call counts the writes of the traced ops' schemas: the write is returned or refused,
# never lost, and refused with eager's PermissionError (type and message) in every mode
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_foreach_buffer_write_is_never_lost(backend: str) -> None:
    m, x, state = _setup("foreach")
    ref_out, ref_state = _stateful(m, x)
    with pytest.raises(PermissionError) as eager_refusal:
        tdfunc.functional_call(m, state, (x,))
    cnt = CompileCounterWithBackend(backend)
    fn = torch.compile(_call(m), backend=cnt, fullgraph=True)
    plain = torch.compile(
        lambda s, x: tdfunc.functional_call(m, s, (x,)), fullgraph=True, backend=backend
    )
    srec = _state_record(state)
    for _ in range(10 if backend != "inductor" else 2):
        out, new = fn(state, x)
        _compare(out, new, ref_out, ref_state)
        with pytest.raises(PermissionError, match=r"writes the buffer 'a'") as refusal:
            plain(state, x)
        assert str(refusal.value) == str(eager_refusal.value)
        assert cnt.frame_count == 1
    assert_state_untouched(state, srec)


# every kind with aot_eager; a few with the eager backend too (where the graph-broken code runs
# on real tensors between graphs)
_BREAK_CASES = [(k, "aot_eager") for k in sorted(BREAKS)] + [
    (k, "eager") for k in ("batchnorm_cumulative", "ring_buffer", "set_data", "histogram_observer")
]


@pytest.mark.parametrize(("kind", "backend"), _BREAK_CASES)
def test_compiled_with_graph_breaks_matches_stateful(kind: str, backend: str) -> None:
    m, x, state = _setup(kind)
    ref_out, ref_state = _stateful(m, x)
    mrec, srec = _module_record(m), _state_record(state)
    fn = torch.compile(_call(m), backend=backend)
    out, new = fn(state, x)
    _compare(out, new, ref_out, ref_state)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)
    # the write is reported, not lost, when return_state=False (also after the call above)
    plain = torch.compile(lambda s, x: tdfunc.functional_call(m, s, (x,)), backend=backend)
    if kind in WRITERS:
        with pytest.raises(PermissionError):
            plain(state, x)
    else:
        torch.testing.assert_close(plain(state, x), ref_out)
    assert_module_untouched(m, mrec)


@pytest.mark.parametrize("kind", ["batchnorm", "embedding_max_norm", "tensor_operand_writes"])
def test_inductor_matches_stateful(kind: str) -> None:
    m, x, state = _setup(kind)
    ref_out, ref_state = _stateful(m, x)
    srec = _state_record(state)
    out, new = torch.compile(_call(m), backend="inductor", fullgraph=True)(state, x)
    _compare(out, new, ref_out, ref_state)
    assert_state_untouched(state, srec)


def _without_fallback(capfd: pytest.CaptureFixture[str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, checking that torch printed no per-member ``_lazy_clone`` fallback warning
    (it prints it from C++, on stderr) and raised no such Python warning."""
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    assert "_lazy_clone" not in capfd.readouterr().err
    assert not [w for w in caught if "_lazy_clone" in str(w.message)]
    return out


VMAP_KINDS = [
    "batchnorm",
    "embedding_max_norm",
    "nn_init",
    "view_writes",
    "tensor_operand_writes",
    "rebind",
    "shared_submodule",
    "tied_head",
    "hook_writes",
    "transformer_layer",
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", VMAP_KINDS)
def test_vmap_ensemble_matches_stateful(
    kind: str, compiled: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    m, x, _ = _setup(kind)
    torch.manual_seed(1)
    other = copy.deepcopy(m)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    members = [m, other]
    state = tdfunc.stack_modules(members)
    refs = [_stateful(member, x) for member in members]
    mrec, srec = _module_record(m), _state_record(state)
    fn = torch.vmap(_call(m), in_dims=(0, None))
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out, new = _without_fallback(capfd, fn, state, x)
    for i, (ref_out, ref_state) in enumerate(refs):
        _compare(out[i], new[i], ref_out, ref_state)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


GRAD_KINDS = [
    "batchnorm",
    "embedding_max_norm",
    "spectral_norm",
    "weight_norm",
    "tied_head",
    "shared_submodule",
    "gru",
    "multihead_attention",
    "hook_writes",
]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", GRAD_KINDS)
def test_grad_matches_stateful(
    kind: str, compiled: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    if compiled and kind == "gru":
        pytest.skip("Dynamo does not trace RNN modules (torch._dynamo.config.allow_rnn)")
    m, x, state = _setup(kind)
    ref = copy.deepcopy(m)
    _first(ref(x)).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}  # one name per tied tensor
    params = state.select(*[k for k in state.keys(True, True) if state[k].requires_grad])
    others = state.exclude(*params.keys(True, True))

    def loss(p: tdfunc.TensorDict, x: torch.Tensor) -> tuple[torch.Tensor, tdfunc.TensorDict]:
        out, new = tdfunc.functional_call(m, (p, others), (x,), return_state=True)
        return _first(out).sum(), new

    mrec, srec = _module_record(m), _state_record(state)
    fn = torch.func.grad(loss, has_aux=True)
    if compiled:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    grads, (new_p, new_o) = _without_fallback(capfd, fn, params, x)
    flat = grads.flatten_keys(".")
    assert sorted(flat.keys()) == sorted(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(flat[name], g, rtol=1e-4, atol=1e-5)
    got = {**new_o.flatten_keys(".").to_dict(), **new_p.flatten_keys(".").to_dict()}
    expected = tdfunc.from_module(ref).flatten_keys(".").to_dict()
    assert sorted(got) == sorted(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_state_untouched(state, srec)
    assert_module_untouched(m, mrec)
