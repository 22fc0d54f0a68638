"""Pure module state: ``functional_call`` never writes the given tensors, and modules that
update their state (batch norm in training mode, counters, in-place parameter writes) give the
new state back with ``return_state=True``, eagerly, compiled and under torch.func transforms."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as nnF
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict, from_module, functional_call, stack_modules
from tdfunc.nn import TensorDictModule
from tdfunc.nn._errors import STATE_WRITTEN


# ----------------------------------------------------------------------------- helpers
def conv_bn(seed: int = 0) -> nn.Sequential:
    """A small conv + batch-norm classifier for [B, 3, 6, 6] images, in training mode."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).train()


def buffers_of(module: nn.Module) -> TensorDict:
    """The module's persistent buffers as a nested TensorDict (copies)."""
    flat = {k: v.detach().clone() for k, v in module.named_buffers()}
    return TensorDict(flat).unflatten_keys(".")


def params_of(module: nn.Module) -> TensorDict:
    return from_module(module, buffers=False).detach().clone()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bitwise_equal(a: TensorDict, b: TensorDict) -> None:
    """Same keys, dtypes and bytes at every leaf."""
    pa = a.flatten_keys(".")
    pb = b.flatten_keys(".")
    assert list(pa.keys()) == list(pb.keys())
    for k in list(pa.keys()):
        assert pa[k].dtype == pb[k].dtype, k
        assert torch.equal(bits(pa[k]), bits(pb[k])), f"leaf {k!r} was written"


def data(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


LR = 0.1


def pure_step(
    net: nn.Module, params: TensorDict, buffers: TensorDict, x: torch.Tensor, y: torch.Tensor
) -> tuple[TensorDict, TensorDict, torch.Tensor]:
    """One SGD step, purely: (new_params, new_buffers, loss); nothing is written."""

    def loss_fn(p: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        out, (_, new_buffers) = functional_call(net, (p, buffers), (x,), return_state=True)
        return nnF.cross_entropy(out, y), new_buffers

    grads, (loss, new_buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(params)
    return params - LR * grads, new_buffers, loss


class Counter(nn.Module):
    """Counts its calls in a buffer, in place (``+=``) or by reassignment."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            self.count += 1
        else:
            self.count = self.count + 1
        return self.lin(x)


class ParamWriter(nn.Module):
    """Writes its parameters in place: a decay of the weight, a clamp through ``.data``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        self.lin.bias.data.clamp_(-0.1, 0.1)
        return self.lin(x)


class Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.total


class Parent(nn.Module):
    """Writes a buffer registered in its child (through a view of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.total[:].add_(x.sum(0))
        return self.child(self.lin(x))


class Tied(nn.Module):
    """Two names for one buffer (``ema`` and ``child.total``); writes it under one name."""

    def __init__(self) -> None:
        super().__init__()
        self.child = Child()
        self.register_buffer("ema", self.child.total)  # the same tensor, registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.5).add_(x.mean(0), alpha=0.5)
        return self.child(x)


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_parity_with_stateful_training(compiled: bool) -> None:
    """20 SGD steps: nn.Module + torch.optim in place vs functional_call + TensorDict algebra."""
    ref = conv_bn()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    net = conv_bn()
    params, buffers = params_of(net), buffers_of(net)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(pure_step, backend=counter, fullgraph=True) if compiled else pure_step
    for i in range(20):
        x, y = data(i)
        opt.zero_grad()
        ref_loss = nnF.cross_entropy(ref(x), y)
        ref_loss.backward()
        opt.step()
        before_p, before_b = params.clone(), buffers.clone()
        new_params, new_buffers, loss = step(net, params, buffers, x, y)
        assert_bitwise_equal(params, before_p)
        assert_bitwise_equal(buffers, before_b)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        tdfunc.testing.assert_close(new_buffers, buffers_of(ref), rtol=1e-5, atol=1e-6)
        tdfunc.testing.assert_close(new_params, params_of(ref), rtol=1e-5, atol=1e-6)
        params, buffers = new_params, new_buffers
        if compiled:
            assert counter.frame_count == 1, f"step {i}: recompiled"
    assert buffers["1", "num_batches_tracked"].item() == 20
    # the module used for the pure calls was never touched
    tdfunc.testing.assert_close(buffers_of(net), buffers_of(conv_bn()))


def test_new_state_replaces_only_written_leaves() -> None:
    net = conv_bn()
    state = from_module(net)
    x, _ = data(0)
    out, new = functional_call(net, state, (x,), return_state=True)
    assert type(new) is TensorDict
    assert new.batch_size == state.batch_size
    assert list(new.flatten_keys(".").keys()) == list(state.flatten_keys(".").keys())
    written = {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    flat_new, flat_old = new.flatten_keys("."), state.flatten_keys(".")
    for k in list(flat_old.keys()):
        assert (flat_new[k] is flat_old[k]) == (k not in written), k
    net.train()
    torch.testing.assert_close(out, net(x))  # the module's own statistics were at their init
    torch.testing.assert_close(new["1", "running_mean"], net[1].running_mean)


def test_eval_mode_writes_nothing() -> None:
    net = conv_bn().eval()
    state = from_module(net)
    x, _ = data(0)
    out, new = functional_call(net, state, (x,), return_state=True)
    assert new is state
    torch.testing.assert_close(functional_call(net, state, (x,)), out)


# ----------------------------------------------------------------------------- return_state=False
def test_write_without_return_state_raises_and_writes_nothing() -> None:
    net = conv_bn()
    state = from_module(net).clone()
    before = state.clone()
    msg = STATE_WRITTEN.format(
        module="'1'", cls="BatchNorm2d", kind="buffer", name="running_mean", key="1.running_mean"
    )
    with pytest.raises(PermissionError, match=re.escape(msg)):
        functional_call(net, state, (data(0)[0],))
    assert_bitwise_equal(state, before)


def test_write_without_return_state_raises_when_compiled() -> None:
    """The same error compiled, with and without fullgraph: the compiled program raises it."""
    net = Counter()
    state = from_module(net)
    msg = re.escape("module (the root module) (Counter) writes the buffer 'count'")
    for fullgraph, error in ((False, PermissionError), (True, PermissionError)):
        torch._dynamo.reset()
        fn = torch.compile(
            lambda s, x: functional_call(net, s, (x,)),
            backend=CompileCounterWithBackend("eager"),
            fullgraph=fullgraph,
        )
        with pytest.raises(error, match=msg):
            fn(state, torch.ones(2, 3))
        assert state["count"].item() == 0
        assert net.count.item() == 0


# ----------------------------------------------------------------------------- kinds of writes
@pytest.mark.parametrize("inplace", [True, False], ids=["in_place", "reassigned"])
def test_counter_buffer(inplace: bool) -> None:
    net = Counter(inplace)
    state = from_module(net)
    x = torch.randn(2, 3)
    out, new = functional_call(net, state, (x,), return_state=True)
    out2, new2 = functional_call(net, new, (x,), return_state=True)
    assert (state["count"].item(), new["count"].item(), new2["count"].item()) == (0, 1, 2)
    assert new["lin", "weight"] is state["lin", "weight"]
    assert net.count.item() == 0
    torch.testing.assert_close(out, out2)


def test_counter_buffer_compiled_no_recompile() -> None:
    net = Counter()
    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(
        lambda s, x: functional_call(net, s, (x,), return_state=True),
        backend=counter,
        fullgraph=True,
    )
    state = from_module(net).detach()  # not the module's own tensors (Dynamo guards on those)
    for i in range(3):
        _, new = fn(state, torch.randn(2, 3))
        assert new["count"].item() == i + 1
        assert state["count"].item() == i
        assert new["lin", "weight"] is state["lin", "weight"]
        state = new
    assert counter.frame_count == 1


def test_parameter_written_in_place() -> None:
    net = ParamWriter()
    with torch.no_grad():
        net.lin.bias.copy_(torch.tensor([1.0, -1.0]))
    state = from_module(net).detach().clone()
    before = state.clone()
    x = torch.randn(4, 3)
    out, new = functional_call(net, state, (x,), return_state=True)
    assert_bitwise_equal(state, before)
    torch.testing.assert_close(new["lin", "weight"], before["lin", "weight"] * 0.5)
    torch.testing.assert_close(new["lin", "bias"], torch.tensor([0.1, -0.1]))
    torch.testing.assert_close(out, x @ new["lin", "weight"].T + new["lin", "bias"])
    with pytest.raises(PermissionError, match="writes the parameter 'weight'"):
        functional_call(net, state, (x,))


def test_buffer_of_a_submodule_written_by_its_parent() -> None:
    net = Parent()
    state = from_module(net)
    x = torch.randn(4, 3)
    out, new = functional_call(net, state, (x,), return_state=True)
    torch.testing.assert_close(new["child", "total"], x.sum(0))
    assert state["child", "total"].abs().sum().item() == 0
    assert new["lin", "weight"] is state["lin", "weight"]
    torch.testing.assert_close(out, net.lin(x) + x.sum(0))


def test_tied_buffer_written_under_one_name() -> None:
    net = Tied()
    state = from_module(net)
    assert list(state.keys(include_nested=True, leaves_only=True)) == ["ema"]  # one leaf per tie
    x = torch.randn(4, 3)
    out, new = functional_call(net, state, (x,), return_state=True)
    torch.testing.assert_close(new["ema"], 0.5 * x.mean(0))
    full = tdfunc.state_dict(net, new)
    assert full["ema"] is full["child.total"] is new["ema"]
    torch.testing.assert_close(out, x + 0.5 * x.mean(0))
    assert state["ema"].abs().sum().item() == 0


def test_flat_mapping_state() -> None:
    net = Counter()
    state = {k: v.detach() for k, v in net.state_dict().items()}
    _, new = functional_call(net, state, (torch.ones(1, 3),), return_state=True)
    assert type(new) is dict
    assert list(new) == list(state)
    assert new["count"].item() == 1
    assert new["lin.weight"] is state["lin.weight"]


# ----------------------------------------------------------------------------- transforms
def small_bn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()


def test_state_unchanged_under_grad_and_vjp() -> None:
    net = small_bn()
    params, buffers = params_of(net), buffers_of(net)
    snap_p, snap_b = params.clone(), buffers.clone()
    x = torch.randn(5, 3)

    def f(p: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        out, (_, nb) = functional_call(net, (p, buffers), (x,), return_state=True)
        return out.pow(2).sum(), nb

    grads, nb = torch.func.grad(f, has_aux=True)(params)
    _out, vjp_fn, nb2 = torch.func.vjp(f, params, has_aux=True)
    (g2,) = vjp_fn(torch.ones(()))
    tdfunc.testing.assert_close(grads, g2)
    tdfunc.testing.assert_close(nb, nb2)
    assert nb["1", "num_batches_tracked"].item() == 1
    assert_bitwise_equal(params, snap_p)
    assert_bitwise_equal(buffers, snap_b)


def test_ensemble_of_batchnorm_nets_under_vmap() -> None:
    """4 batch-norm nets in training mode, vmapped, against 4 separate stateful nets."""
    nets = [small_bn(seed) for seed in range(4)]
    stacked = stack_modules(nets).detach()
    snap = stacked.clone()
    x = torch.randn(4, 6, 3)  # a different batch per member

    def call(s: TensorDict, xi: torch.Tensor) -> tuple[torch.Tensor, TensorDict]:
        return functional_call(nets[0], s, (xi,), return_state=True)

    out, new = torch.vmap(call)(stacked, x)
    assert new.batch_size == torch.Size([4])
    assert_bitwise_equal(stacked, snap)
    refs = [small_bn(seed) for seed in range(4)]
    for i, ref in enumerate(refs):
        torch.testing.assert_close(out[i], ref(x[i]), rtol=1e-5, atol=1e-6)
        tdfunc.testing.assert_close(new[i], from_module(ref).detach(), rtol=1e-5, atol=1e-6)


def test_inside_scan_and_while_loop() -> None:
    net = small_bn()
    params, buffers = params_of(net), buffers_of(net)
    snap = buffers.clone()
    xs = TensorDict(x=torch.randn(3, 5, 3), batch_size=[3])

    def body(b: TensorDict, step: TensorDict) -> tuple[TensorDict, torch.Tensor]:
        out, (_, nb) = functional_call(net, (params, b), (step["x"],), return_state=True)
        return nb, out

    final, ys = tdfunc.scan(body, buffers, xs)
    assert_bitwise_equal(buffers, snap)
    ref = small_bn()
    for i in range(3):
        torch.testing.assert_close(ys[i], ref(xs["x"][i]), rtol=1e-5, atol=1e-6)
    tdfunc.testing.assert_close(final, buffers_of(ref), rtol=1e-5, atol=1e-6)

    x = xs["x"][0]

    def cond_fn(i: torch.Tensor, b: TensorDict) -> torch.Tensor:
        return i < 3

    def loop_body(i: torch.Tensor, b: TensorDict) -> tuple[torch.Tensor, TensorDict]:
        _, (_, nb) = functional_call(net, (params, b), (x,), return_state=True)
        return i + 1, nb

    _, looped = tdfunc.while_loop(cond_fn, loop_body, (torch.tensor(0), buffers))
    assert_bitwise_equal(buffers, snap)
    assert looped["1", "num_batches_tracked"].item() == 3


# ----------------------------------------------------------------------------- key-routed modules
def test_key_routed_module_with_batch_norm() -> None:
    torch.manual_seed(0)
    mod = TensorDictModule(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), in_keys="obs", out_keys="h"
    ).train()
    state = from_module(mod)
    td = TensorDict(obs=torch.randn(6, 3), batch_size=[6])
    out, new = functional_call(mod, state, (td,), return_state=True)
    assert new["module", "1", "num_batches_tracked"].item() == 1
    assert state["module", "1", "num_batches_tracked"].item() == 0
    assert new["module", "0", "weight"] is state["module", "0", "weight"]
    torch.testing.assert_close(out["h"], mod(td)["h"])


def test_inductor_train_step() -> None:
    net = conv_bn()
    params, buffers = params_of(net), buffers_of(net)
    x, y = data(0)
    expected = pure_step(net, params, buffers, x, y)
    snap = buffers.clone()
    got = torch.compile(pure_step, backend="inductor", fullgraph=True)(net, params, buffers, x, y)
    assert_bitwise_equal(buffers, snap)
    tdfunc.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], expected[2], rtol=1e-4, atol=1e-5)
