"""Parameters as TensorDicts: from_module, functional_call, stack_modules, vmap ensembles, and
compiled models whose forward takes and returns a TensorDict or tensorclass."""

from __future__ import annotations

import copy
import gc
import re
import subprocess
import sys
import weakref
from typing import Any

import pytest
import torch
from helpers import check_compiled
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict, from_module, functional_call, stack_modules, tensorclass
from tdfunc.nn import _functional as F
from tdfunc.nn import _plan
from tdfunc.testing import assert_close


def mlp(i: int = 3, o: int = 2, hidden: int = 8, seed: int | None = None) -> nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(i, hidden), nn.Tanh(), nn.Linear(hidden, o))


class WithBuffers(nn.Module):
    """Parameters, a persistent and a non-persistent buffer, a param-less child, a None bias."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.full((2,), 2.0))
        self.register_buffer("cache", torch.zeros(5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * self.scale


class Recording(nn.Module):
    """Counts forward calls, to show an error was raised before any computation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def state_snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def assert_module_unchanged(m: nn.Module, before: dict[str, torch.Tensor], objs: dict) -> None:
    after = m.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for k, v in after.items():
        assert v is objs[k], f"{k} was replaced"
        assert torch.equal(v.detach(), before[k]), f"{k} changed value"


# --------------------------------------------------------------------------------------
# from_module
# --------------------------------------------------------------------------------------
def test_from_module_keys_are_state_dict_names_and_leaves_are_the_modules_tensors():
    m = WithBuffers()
    params = from_module(m)
    sd = m.state_dict(keep_vars=True)
    flat = params.flatten_keys(".")
    assert list(flat.keys()) == list(sd)  # same names, same order
    for k, v in flat.items():
        assert v is sd[k]
    assert params.batch_size == ()
    assert params["body"].batch_size == ()
    assert "cache" not in params  # non-persistent buffers are not in the state_dict
    assert "2" not in params["body"]  # ReLU has no tensors
    assert params["body", "0", "weight"] is m.body[0].weight


def test_from_module_parameters_only():
    m = WithBuffers()
    params = from_module(m, buffers=False)
    assert list(params.flatten_keys(".").keys()) == [n for n, _ in m.named_parameters()]


def test_from_module_rejects_non_modules():
    with pytest.raises(TypeError, match=r"expects an nn\.Module"):
        from_module({"w": torch.zeros(2)})


# --------------------------------------------------------------------------------------
# functional_call
# --------------------------------------------------------------------------------------
def test_functional_call_with_own_params_equals_forward_and_leaves_module_alone():
    m = WithBuffers().eval()
    x = torch.randn(6, 3)
    before, objs = state_snapshot(m), dict(m.state_dict(keep_vars=True))
    params = from_module(m)
    expected = m(x)
    torch.testing.assert_close(functional_call(m, params, (x,)), expected)
    # new values give new results, and the module keeps its own tensors
    doubled = params.apply(lambda t: t * 2 if t.is_floating_point() else t)
    out = functional_call(m, doubled, (x,))
    assert not torch.allclose(out, expected)
    assert_module_unchanged(m, before, objs)
    torch.testing.assert_close(m(x), expected)


def test_functional_call_matches_torch_func_with_new_values():
    m = mlp(seed=0)
    params = from_module(m).apply(torch.randn_like)
    x = torch.randn(5, 3)
    ref = torch.func.functional_call(m, dict(params.flatten_keys(".").items()), (x,))
    torch.testing.assert_close(functional_call(m, params, (x,)), ref)
    torch.testing.assert_close(functional_call(m, params, x), ref)  # single non-tuple argument


def test_functional_call_missing_keys_fall_back_to_module_tensors():
    m = mlp(seed=0)
    x = torch.randn(5, 3)
    params = from_module(m)
    zero_first = TensorDict({"0": params["0"] * 0})  # only the first layer
    out = functional_call(m, zero_first, (x,))
    expected = m[2](torch.tanh(torch.zeros(5, 8)))
    torch.testing.assert_close(out, expected)


def test_functional_call_accepts_flat_and_nested_dicts_and_tuples():
    m = WithBuffers().eval()
    x = torch.randn(4, 3)
    params = from_module(m, buffers=False).apply(torch.randn_like)
    buffers = from_module(m).exclude(*from_module(m).keys())  # empty
    expected = functional_call(m, params, (x,))
    flat = dict(params.flatten_keys(".").items())
    torch.testing.assert_close(functional_call(m, flat, (x,)), expected)
    torch.testing.assert_close(functional_call(m, params.to_dict(), (x,)), expected)
    torch.testing.assert_close(functional_call(m, (params, buffers), (x,)), expected)
    bufs = {"scale": torch.full((2,), 3.0)}
    torch.testing.assert_close(functional_call(m, (params, bufs), (x,)), expected * 1.5)


def test_functional_call_kwargs():
    class K(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
            return self.lin(x) * scale

    m = K()
    x = torch.randn(2, 3)
    out = functional_call(m, from_module(m), (x,), {"scale": 3.0})
    torch.testing.assert_close(out, m(x) * 3.0)


def test_functional_call_strict_unknown_keys_raise_keyerror_listing_them():
    m = Recording()
    params = from_module(m).set("bogus", torch.zeros(1)).set(("lin", "extra"), torch.zeros(1))
    with pytest.raises(KeyError) as info:
        functional_call(m, params, (torch.randn(1, 3),), strict=True)
    msg = info.value.args[0]
    assert msg.startswith("functional_call(strict=True): keys ['lin.extra', 'bogus']")
    assert msg == F.UNKNOWN_KEYS.format(
        keys=["lin.extra", "bogus"], module="Recording", known=["lin.weight", "lin.bias"]
    )
    assert m.calls == 0
    # strict=False ignores them
    out = functional_call(m, params, (torch.ones(1, 3),))
    torch.testing.assert_close(out, m.lin(torch.ones(1, 3)))


def test_functional_call_strict_missing_keys_raise_keyerror():
    m = Recording()
    params = from_module(m).exclude(("lin", "bias"))
    with pytest.raises(KeyError) as info:
        functional_call(m, params, (torch.randn(1, 3),), strict=True)
    assert info.value.args[0] == F.MISSING_KEYS.format(keys=["lin.bias"], module="Recording")
    assert m.calls == 0


class Offset(nn.Module):
    """A linear layer plus the sum of a buffer (whose shape the state may change)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("offset", torch.zeros(2))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) + self.offset.sum()


def test_functional_call_shapes_are_the_states():
    """A buffer of another shape than the module's is the state's own and reaches the module
    (as torch.func.functional_call gives it: statistics that grow); a parameter of another
    shape, or a state stacked over modules outside torch.vmap, is refused before any
    computation."""
    m = Offset()
    params = from_module(m).set(("lin", "weight"), torch.zeros(4, 3))
    text = F.PARAM_SHAPE.format(key="lin.weight", got=(4, 3), expected=(2, 3))
    with pytest.raises(ValueError, match=re.escape(text)) as refused:
        functional_call(m, params, (torch.randn(1, 3),))
    assert str(refused.value) == text
    assert m.calls == 0
    grown = from_module(m).set("offset", torch.ones(5)).set(("lin", "bias"), torch.ones(2))
    x = torch.randn(1, 3)
    expected = x @ m.lin.weight.detach().T + 6.0  # a bias of ones and a sum of five ones
    torch.testing.assert_close(functional_call(m, grown, (x,)), expected)
    # a stacked TensorDict outside vmap: refused, naming what was found
    m = Recording()
    stacked = stack_modules([Recording(), Recording()])
    expected = F.STACKED_STATE.format(n=2, key="lin.weight", got=(2, 2, 3), expected=(2, 3))
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        functional_call(m, stacked, (torch.randn(1, 3),))
    assert str(info.value) == expected
    # flat dicts alike
    flat = {"lin.weight": torch.zeros(3, 2, 3), "lin.bias": torch.zeros(3, 2)}
    with pytest.raises(ValueError, match=r"leading dim of size 3 .*key 'lin\.weight'"):
        functional_call(m, flat, (torch.randn(1, 3),))
    assert m.calls == 0


def test_parameter_of_another_shape_is_refused_naming_the_key_and_both_shapes():
    """Whatever the form of the state, the kept plan or the full path, under grad: the
    ValueError names the key, the parameter's shape and the given one; the module never runs."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    good = from_module(m)
    functional_call(m, good, (x,))  # a plan kept for this structure
    bad = good.set(("0", "weight"), torch.zeros(5, 5))
    text = F.PARAM_SHAPE.format(key="0.weight", got=(5, 5), expected=(4, 3))
    forms = {
        "container": bad,
        "flat mapping": bad.flatten_keys(".").to_dict(),
        "nested mapping": {"0": {"weight": torch.zeros(5, 5)}},
        "tuple": (bad.exclude("2"), good.select("2")),
    }
    calls = []
    handle = m.register_forward_pre_hook(lambda *_: calls.append(1))
    for form, state in forms.items():
        for _ in range(2):
            with pytest.raises(ValueError, match=re.escape(text)) as info:
                functional_call(m, state, (x,), return_state=True)
            assert str(info.value) == text, form
    with pytest.raises(ValueError, match=re.escape(text)) as info:
        torch.func.grad(lambda p: functional_call(m, p, (x,)).sum())(bad)
    assert str(info.value) == text
    assert not calls
    handle.remove()
    # the same module with the right shapes afterwards
    torch.testing.assert_close(functional_call(m, good, (x,)), m(x))


def test_functional_call_bad_params_type_and_duplicates():
    m = Recording()
    with pytest.raises(TypeError, match=re.escape(F.BAD_PARAMS.format(typ="int")[:60])):
        functional_call(m, 3, (torch.randn(1, 3),))
    with pytest.raises(TypeError, match="holding str"):
        functional_call(m, {"lin": {"weight": "x"}}, (torch.randn(1, 3),))
    p = from_module(m)
    with pytest.raises(ValueError, match=re.escape(F.DUPLICATE_KEY.format(key="lin.weight"))):
        functional_call(m, (p, p), (torch.randn(1, 3),))


def test_functional_call_under_grad_gives_parameter_gradients():
    m = mlp(seed=0)
    x, y = torch.randn(7, 3), torch.randn(7, 2)
    params = from_module(m)

    def loss(p: TensorDict) -> torch.Tensor:
        return ((functional_call(m, p, (x,)) - y) ** 2).mean()

    grads = torch.func.grad(loss)(params)
    ((m(x) - y) ** 2).mean().backward()
    assert grads.batch_size == params.batch_size
    assert list(grads.keys(True, True)) == list(params.keys(True, True))
    for k, g in grads.items(True, True):
        torch.testing.assert_close(g, params[k].grad)


# --------------------------------------------------------------------------------------
# stack_modules and ensembles
# --------------------------------------------------------------------------------------
def test_stack_modules_fresh_leaves():
    nets = [mlp(seed=i) for i in range(3)]
    nets[0][0].weight.requires_grad_(False)
    params = stack_modules(nets)
    assert params.batch_size == (3,)
    assert params["0"].batch_size == (3,)
    assert list(params.flatten_keys(".").keys()) == list(nets[0].state_dict())
    for k, v in params.flatten_keys(".").items():
        members = [n.state_dict(keep_vars=True)[k] for n in nets]
        torch.testing.assert_close(v, torch.stack(members).detach())
        assert v.is_leaf
        assert v.grad_fn is None
        assert v.requires_grad == members[0].requires_grad
    before = state_snapshot(nets[1])
    with torch.no_grad():
        params["2", "bias"].add_(1.0)  # the stacked leaves do not share memory with the modules
    assert torch.equal(nets[1][2].bias, before["2.bias"])


def test_stack_modules_with_buffers_and_tied_weights():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + self.steps

    nets = [Tied() for _ in range(3)]
    params = stack_modules(nets)
    assert "weight" not in params["b"]  # one leaf per tied tensor, under its first name
    assert params["a", "weight"].shape == (3, 3, 3)
    assert params["steps"].dtype == torch.long
    assert not params["steps"].requires_grad
    x = torch.randn(2, 3)
    out = torch.vmap(lambda p: functional_call(nets[0], p, (x,)))(params)
    torch.testing.assert_close(out, torch.stack([n(x) for n in nets]))


def test_stack_modules_bad_input():
    with pytest.raises(ValueError, match=re.escape(F.STACK_EMPTY)):
        stack_modules([])
    expected = F.STACK_KEYS.format(index=2, key="bias", expected="'bias'", got="nothing")
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        stack_modules([nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(3, 4, bias=False)])
    assert str(info.value) == expected
    expected = F.STACK_SHAPE.format(
        index=1, key="0.weight", what="shape", got=(9, 3), expected=(8, 3)
    )
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        stack_modules([mlp(), mlp(hidden=9)])
    assert str(info.value) == expected
    with pytest.raises(
        ValueError, match=r"at key 'weight': dtype torch\.float64 != torch\.float32"
    ):
        stack_modules([nn.Linear(3, 4), nn.Linear(3, 4).double()])
    with pytest.raises(ValueError, match=r"first differing key '0\.weight'"):
        stack_modules([mlp(), nn.Sequential(nn.Identity(), nn.Linear(3, 8))])


def _ensemble_inputs(n: int = 5):
    nets = [mlp(seed=i) for i in range(n)]
    return nets, torch.randn(6, 3)


def test_vmap_ensemble_equals_loop_and_torch_func_stack_module_state():
    nets, x = _ensemble_inputs()
    params = stack_modules(nets)
    base = copy.deepcopy(nets[0]).to("meta")  # structure only

    def call(p: TensorDict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(base, p, (xb,))

    out = torch.vmap(call, in_dims=(0, None))(params, x)
    assert out.shape == (5, 6, 2)
    loop = torch.stack([n(x) for n in nets])
    torch.testing.assert_close(out, loop)
    ps, bs = torch.func.stack_module_state(nets)
    ref = torch.vmap(
        lambda p, b, xb: torch.func.functional_call(base, (p, b), (xb,)), in_dims=(0, 0, None)
    )(ps, bs, x)
    torch.testing.assert_close(out, ref)
    # one input per member
    xs = torch.randn(5, 6, 3)
    per = torch.vmap(call)(params, xs)
    torch.testing.assert_close(per, torch.stack([n(xi) for n, xi in zip(nets, xs)]))


def test_ensemble_gradients_reach_stacked_leaves_only():
    nets, x = _ensemble_inputs(3)
    params = stack_modules(nets)
    out = torch.vmap(lambda p: functional_call(nets[0], p, (x,)))(params)
    out.pow(2).sum().backward()
    assert all(p.grad is None for n in nets for p in n.parameters())
    for k, v in params.items(True, True):
        assert v.grad is not None, k
        assert v.grad.shape == v.shape, k
    # member 1's gradient equals the gradient of member 1 alone
    nets[1].zero_grad()
    nets[1](x).pow(2).sum().backward()
    torch.testing.assert_close(params["0", "weight"].grad[1], nets[1][0].weight.grad)


# --------------------------------------------------------------------------------------
# compiled: functional_call, ensemble, models taking / returning containers
# --------------------------------------------------------------------------------------
def test_compiled_functional_call_no_graph_break_no_recompile():
    m = mlp(seed=0)

    def fn(p: TensorDict, xb: torch.Tensor) -> torch.Tensor:
        return functional_call(m, p, (xb,))

    check_compiled(fn, lambda: (from_module(m).apply(torch.randn_like), torch.randn(5, 3)))

    # flat dicts of dotted names compile too
    def flat() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        p = from_module(m).apply(torch.randn_like)
        return dict(p.flatten_keys(".").items()), torch.randn(5, 3)

    check_compiled(fn, flat)


def test_compiled_ensemble_forward():
    nets, _ = _ensemble_inputs(4)
    base = nets[0]

    def fn(p: TensorDict, xb: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda q: functional_call(base, q, (xb,)))(p)

    def make():
        return stack_modules([mlp() for _ in range(4)]).detach(), torch.randn(6, 3)

    check_compiled(fn, make)


@pytest.mark.slow
def test_compiled_ensemble_with_inductor_runs_generated_code():
    nets, x = _ensemble_inputs(4)
    params = stack_modules(nets).detach()

    def fn(p: TensorDict, xb: torch.Tensor) -> torch.Tensor:
        return torch.vmap(lambda q: functional_call(nets[0], q, (xb,)))(p)

    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, backend=cnt, fullgraph=True)
    torch.testing.assert_close(compiled(params, x), torch.stack([n(x) for n in nets]))
    params2 = stack_modules([mlp(seed=10 + i) for i in range(4)]).detach()
    torch.testing.assert_close(compiled(params2, x), fn(params2, x))
    assert cnt.frame_count == 1


class TDModel(nn.Module):
    """forward takes and returns a TensorDict."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = mlp(3, 4)
        self.value = nn.Linear(4, 1)

    def forward(self, td: TensorDict) -> TensorDict:
        h = self.enc(td["obs"])
        return td.set("hidden", h).set(("out", "value"), self.value(h).squeeze(-1))


def test_compiled_model_forward_takes_and_returns_a_tensordict():
    model = TDModel()

    def make():
        return (TensorDict({"obs": torch.randn(8, 3), "r": torch.randn(8)}, batch_size=[8]),)

    inp = make()[0]
    snap = inp.clone()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    out = compiled(inp)
    assert cnt.frame_count == 1
    assert out.batch_size == (8,)
    assert out["out"].batch_size == (8,)
    assert_close(out, model(inp))
    assert_close(inp, snap)
    assert "hidden" not in inp
    compiled(make()[0])
    assert cnt.frame_count == 1


def test_compiled_model_forward_takes_and_returns_a_tensorclass():
    @tensorclass
    class Batch:
        obs: torch.Tensor
        pred: torch.Tensor | None = None

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(3, 2)

        def forward(self, b: Batch) -> Batch:
            return b.replace(pred=self.net(b.obs))

    model = M()
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=cnt, fullgraph=True)
    b = Batch(torch.randn(5, 3), batch_size=[5])
    out = compiled(b)
    assert type(out) is Batch
    assert out.pred.shape == (5, 2)
    assert b.pred is None
    assert_close(out, model(b))
    compiled(Batch(torch.randn(5, 3), batch_size=[5]))
    assert cnt.frame_count == 1


def test_functional_call_with_tensorclass_params():
    @tensorclass
    class LinParams:
        weight: torch.Tensor
        bias: torch.Tensor

    m = nn.Linear(3, 2)
    p = LinParams(torch.randn(2, 3), torch.randn(2))
    x = torch.randn(4, 3)
    torch.testing.assert_close(functional_call(m, p, (x,)), x @ p.weight.T + p.bias)
    g = torch.func.grad(lambda q: functional_call(m, q, (x,)).sum())(p)
    assert type(g) is LinParams
    torch.testing.assert_close(g.bias, torch.full((2,), 4.0))


def test_tdfunc_top_level_names_are_the_nn_functions():
    assert tdfunc.from_module is from_module
    assert tdfunc.functional_call is functional_call
    assert tdfunc.stack_modules is stack_modules


# ------------------------------------------------------------------ shared tensors
def _tied_pair() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    m[1].weight = m[0].weight  # tied: one tensor under two names
    return m


@pytest.mark.parametrize(
    "make", [_tied_pair, lambda: nn.Sequential(*[nn.Linear(3, 3)] * 2)], ids=["tied", "reused"]
)
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_tensors_stay_shared(make, compiled):
    """A tensor reachable under two names takes the value given under the first name for both
    (tied weights, a submodule used twice), eagerly and compiled."""
    m = make()
    x = torch.randn(4, 3)
    w0 = torch.zeros(3, 3)
    b0 = m[0].bias.detach().clone()
    b1 = b0 if m[1].bias is m[0].bias else m[1].bias.detach().clone()
    flat = {"0.weight": w0, "0.bias": b0}
    nested: dict = {"0": {"weight": w0, "bias": b0}}
    if b1 is not b0:
        flat["1.bias"] = b1
        nested["1"] = {"bias": b1}
    state = TensorDict.from_dict(nested)
    expected = torch.func.functional_call(m, flat, (x,))  # torch ties the second names
    by_hand = torch.nn.functional.linear(b0.expand(4, 3), w0, b1)
    assert_close(expected, by_hand)  # both layers used the zero weight
    call = lambda s, x: functional_call(m, s, (x,))  # noqa: E731
    if compiled:
        call = torch.compile(call, backend="eager", fullgraph=True)
    assert_close(call(state, x), expected)


def test_unshared_module_matches_torch_func():
    """Without shared tensors the result is torch.func's."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    flat = dict(state.flatten_keys(".").items())
    assert_close(functional_call(m, state, (x,)), torch.func.functional_call(m, flat, (x,)))


# --------------------------------------------------------------------------------------
# Dynamo is loaded by whoever compiles, never by an eager call
# --------------------------------------------------------------------------------------
def _run(code: str, python: str = sys.executable) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (fails on a non-zero exit)."""
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


_IMPORTERS = """
import sys, traceback
import torch
from torch import nn
import tdfunc

importers = []


class Watch:  # who imports torch._dynamo: the files on the stack at that moment
    def find_spec(self, name, path, target=None):
        if name == "torch._dynamo":
            importers.append([f.filename for f in traceback.extract_stack()])
        return None


sys.meta_path.insert(0, Watch())
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
state = tdfunc.from_module(net)
x = torch.randn(5, 3)
"""


def test_eager_calls_do_not_import_dynamo():
    code = (
        _IMPORTERS
        + """
tdfunc.functional_call(net.eval(), state, (x,))
_, new = tdfunc.functional_call(net.train(), state, (x,), return_state=True)
assert new["1", "num_batches_tracked"].item() == 1
# a dict of stacked tensors (the vmap rule of TensorDict inputs is not functional_call's)
stacked = {k: torch.stack([v, v]) for k, v in net.state_dict().items()}
torch.vmap(lambda p: tdfunc.functional_call(net.eval(), p, (x,)), in_dims=(0,))(stacked)
print("torch._dynamo" in sys.modules, importers == [])
"""
    )
    assert _run(code).split() == ["False", "True"]


def test_under_grad_dynamo_is_loaded_by_torch_not_by_tdfunc(tmp_path: Any) -> None:
    """``torch.func.grad`` loads Dynamo itself (its backward pass disables compiled autograd):
    nothing of tdfunc is on the stack when it does. A frame is tdfunc's when its file lies in
    tdfunc's package folder: the interpreter runs from a folder whose path names tdfunc (a
    venv made for tdfunc), so every torch file's path contains the word."""
    venv = tmp_path / "tdfunc-venv"
    venv.symlink_to(sys.prefix, target_is_directory=True)
    python = str(venv / "bin" / "python")
    code = (
        _IMPORTERS
        + """
params = tdfunc.from_module(net, buffers=False)
grad = torch.func.grad(lambda p: tdfunc.functional_call(net.eval(), p, (x,)).sum())(params)
assert grad["0", "weight"].shape == (4, 3)
tdfunc.functional_call(net, state, (x,))  # after Dynamo is loaded: twins registered
import os
files = [f for stack in importers for f in stack]
package = os.path.dirname(os.path.abspath(tdfunc.__file__)) + os.sep
print("torch._dynamo" in sys.modules, len(importers), any(f.startswith(package) for f in files))
print(any("tdfunc-venv" in f for f in files))
"""
    )
    assert _run(code, python).split() == ["True", "1", "False", "True"]


def test_compiled_after_eager_calls_in_a_fresh_process():
    """Eager calls first (plans made, Dynamo not loaded), then compiled calls: one frame, no
    recompile for new values, torch.func's values; writes and created state are still seen."""
    code = """
import sys
import torch
from torch import nn
import tdfunc


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return self.lin(x)


class Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("cache", None)

    def forward(self, x):
        self.cache = x.sum(0)
        return self.lin(x)


torch.manual_seed(0)
net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
counter, grows = Counter(), Grows()
x = torch.randn(5, 3)
state = tdfunc.from_module(net).detach()
c_state = tdfunc.from_module(counter).detach()
g_state = tdfunc.from_module(grows).detach()
tdfunc.functional_call(net, state, (x,))
_, new = tdfunc.functional_call(counter, c_state, (x,), return_state=True)
assert new["count"].item() == 1
_, new = tdfunc.functional_call(grows, g_state, (x,), return_state=True)
assert "cache" in new.keys()
assert "torch._dynamo" not in sys.modules

from torch._dynamo.testing import CompileCounterWithBackend


def compiled(fn):
    cnt = CompileCounterWithBackend("eager")
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


fc, cnt = compiled(lambda s, x: tdfunc.functional_call(net, s, (x,)))
for i in range(2):
    s = state.apply(lambda t: t + i)
    expected = torch.func.functional_call(net, s.flatten_keys(".").to_dict(), (x,))
    torch.testing.assert_close(fc(s, x), expected)
assert cnt.frame_count == 1, cnt.frame_count

fc, cnt = compiled(lambda s, x: tdfunc.functional_call(counter, s, (x,), return_state=True))
s = c_state
for i in range(2):
    _, s = fc(s, torch.randn(5, 3))
    assert s["count"].item() == i + 1
assert cnt.frame_count == 1, cnt.frame_count
assert counter.count.item() == 0 and c_state["count"].item() == 0

fc, _ = compiled(lambda s, x: tdfunc.functional_call(counter, s, (x,)))
try:
    fc(c_state, x)
except Exception as e:
    assert "writes the buffer 'count'" in str(e), e
else:
    raise AssertionError("a compiled write without return_state=True went unseen")

fc, cnt = compiled(lambda s, x: tdfunc.functional_call(grows, s, (x,), return_state=True))
_, new = fc(g_state, x)
torch.testing.assert_close(new["cache"], x.sum(0))
assert grows.cache is None and cnt.frame_count == 1
tdfunc.functional_call(net, state, (x,))  # eager again, after compiling
print("ok")
"""
    assert _run(code).split() == ["ok"]


# --------------------------------------------------------------------------------------
# the slot plan kept between calls: every change to the module is seen by the next call
# --------------------------------------------------------------------------------------
def _objs(m: nn.Module) -> dict[str, torch.Tensor]:
    return dict(m.state_dict(keep_vars=True))


def _reference(m: nn.Module, state: TensorDict, x: torch.Tensor) -> torch.Tensor:
    return torch.func.functional_call(m, dict(state.flatten_keys(".").items()), (x,))


def _planned(m: nn.Module, state: object) -> bool:
    """Whether the next call with ``state`` finds a valid plan (the fast path)."""
    live, _ = _plan.lookup(m, state, False, True)
    return live is not None


def test_plan_is_used_and_matches_the_full_path():
    torch.manual_seed(0)
    m = mlp()
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    assert not _planned(m, state)
    first = functional_call(m, state, (x,))
    assert _planned(m, state)
    assert_close(functional_call(m, state * 3, (x,)), _reference(m, state * 3, x))
    assert_close(first, _reference(m, state, x))


def test_plan_checks_every_given_shape():
    """A state of the planned structure with a tensor of another shape: the plan is not taken
    and the full path refuses the parameter, naming it (with and without a tie, and with a key
    the module does not have: the plan's two ways of reading the leaves)."""
    torch.manual_seed(0)
    x = torch.randn(5, 3)
    m = mlp()
    state = from_module(m) * 2
    functional_call(m, state, (x,))
    assert _planned(m, state)
    before, objs = state_snapshot(m), _objs(m)
    for key in (("0", "weight"), ("2", "bias")):
        bad = state.set(key, torch.zeros(7))
        assert not _planned(m, bad)
        text = F.PARAM_SHAPE.format(key=".".join(key), got=(7,), expected=tuple(state[key].shape))
        with pytest.raises(ValueError, match=re.escape(text)):
            functional_call(m, bad, (x,))
    extra = {**dict(state.flatten_keys(".").items()), "not.a.key": torch.zeros(1)}
    functional_call(m, extra, (x,))
    assert _planned(m, extra)
    with pytest.raises(ValueError, match=r"key '2\.weight' is a parameter of shape \(2, 8\)"):
        functional_call(m, {**extra, "2.weight": torch.zeros(2, 2)}, (x,))
    assert_close(functional_call(m, extra, (x,)), _reference(m, state, x))
    assert_module_unchanged(m, before, objs)
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    both = dict(tied.state_dict())  # both names of the tied weight: one tensor
    functional_call(tied, both, (x,))
    assert _planned(tied, both)
    with pytest.raises(ValueError, match=r"key '1\.bias' is a parameter of shape \(3,\)"):
        functional_call(tied, {**both, "1.bias": torch.zeros(4)}, (x,))
    with pytest.raises(ValueError, match="tied weights"):
        functional_call(tied, {**both, "1.weight": torch.zeros(3, 3)}, (x,))


def test_plan_sees_a_new_parameter():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y * self.gain if "gain" in self._parameters else y

    torch.manual_seed(0)
    m = Scaled()
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    functional_call(m, state, (x,))
    m.register_parameter("gain", nn.Parameter(torch.full((2,), 3.0)))
    before, objs = state_snapshot(m), _objs(m)
    # not a parameter created by the call: no PermissionError
    assert_close(functional_call(m, state, (x,)), _reference(m, state, x))
    with pytest.raises(KeyError, match="gain"):
        functional_call(m, state, (x,), strict=True)
    assert_module_unchanged(m, before, objs)


def test_plan_sees_a_replaced_submodule():
    torch.manual_seed(0)
    m = mlp()
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    functional_call(m, state, (x,))
    old = m[0]  # alive: the plan must see the replacement, not a dead reference
    m[0] = nn.Linear(3, 8)  # a new object, the same names and shapes
    before, objs = state_snapshot(m), _objs(m)
    assert_close(functional_call(m, state, (x,)), _reference(m, state, x))
    assert_module_unchanged(m, before, objs)
    m[2] = nn.Linear(8, 4)  # another shape: the state's parameter is refused
    text = F.PARAM_SHAPE.format(key="2.weight", got=(2, 8), expected=(4, 8))
    with pytest.raises(ValueError, match=re.escape(text)):
        functional_call(m, state, (x,))
    assert m[2].weight.shape == (4, 8)
    assert old.weight.shape == (8, 3)


def test_plan_sees_a_deleted_buffer():
    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("shift", torch.ones(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            shift = self._buffers.get("shift")
            return self.lin(x) + (0 if shift is None else shift)

    torch.manual_seed(0)
    m = Shifted()
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    functional_call(m, state, (x,))
    del m.shift
    before, objs = state_snapshot(m), _objs(m)
    # the given shift is an unknown key now (ignored), so the output has no shift
    expected = torch.func.functional_call(m.lin, dict(state["lin"].items()), (x,))
    assert_close(functional_call(m, state, (x,)), expected)
    assert_module_unchanged(m, before, objs)


def test_plan_sees_weights_tied_and_untied():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(5, 4)
    untied = {k: v * 2 for k, v in m.state_dict().items()}  # two different weights
    functional_call(m, untied, (x,))
    m[1].weight = m[0].weight  # tied now: one tensor under two names
    before, objs = state_snapshot(m), _objs(m)
    with pytest.raises(ValueError, match="tied weights"):
        functional_call(m, untied, (x,))
    same = {**untied, "1.weight": untied["0.weight"]}
    assert_close(functional_call(m, same, (x,)), torch.func.functional_call(m, same, (x,)))
    # one leaf for the tie (from_module): it fills both slots
    state = from_module(m) * 3
    assert sorted(state.flatten_keys(".").keys()) == ["0.bias", "0.weight", "1.bias"]
    expected = torch.func.functional_call(
        m, {**state.flatten_keys(".").to_dict(), "1.weight": state["0", "weight"]}, (x,)
    )
    assert_close(functional_call(m, state, (x,)), expected)
    assert_module_unchanged(m, before, objs)
    # untied again: the tied leaf fills its own slot only, the other one is the module's
    m[1].weight = nn.Parameter(torch.randn(4, 4))
    before, objs = state_snapshot(m), _objs(m)
    assert_close(functional_call(m, state, (x,)), _reference(m, state, x))
    assert_module_unchanged(m, before, objs)


def test_plan_sees_a_parameter_replaced_in_place():
    torch.manual_seed(0)
    m = mlp()
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    functional_call(m, state, (x,))
    m[0].weight = nn.Parameter(torch.randn(8, 3))  # another Parameter object, same shape
    before, objs = state_snapshot(m), _objs(m)
    assert_close(functional_call(m, state, (x,)), _reference(m, state, x))
    assert_module_unchanged(m, before, objs)
    m[0].weight = nn.Parameter(torch.randn(6, 3))  # another shape: the state's is refused
    text = F.PARAM_SHAPE.format(key="0.weight", got=(8, 3), expected=(6, 3))
    with pytest.raises(ValueError, match=re.escape(text)):
        functional_call(m, state, (x,))
    # a parameter turned into a plain attribute: the given tensor is an unknown key
    m[0].weight = nn.Parameter(torch.randn(8, 3))
    functional_call(m, state, (x,))
    del m[0].bias
    m[0].bias = torch.zeros(8)
    before, objs = state_snapshot(m), _objs(m)
    expected = torch.func.functional_call(
        m, {k: v for k, v in state.flatten_keys(".").items() if k != "0.bias"}, (x,)
    )
    assert_close(functional_call(m, state, (x,)), expected)
    assert_module_unchanged(m, before, objs)
    assert torch.equal(m[0].bias, torch.zeros(8))


def test_plan_sees_slots_added_to_a_module_that_had_none():
    """A module with no parameters, buffers or submodules (an activation) is checked too."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    state = from_module(m) * 2
    x = torch.randn(5, 3)
    functional_call(m, state, (x,))
    assert _planned(m, state)
    m[1].register_buffer("unused", torch.zeros(1))
    assert not _planned(m, state)
    with pytest.raises(KeyError, match=r"1\.unused"):
        functional_call(m, state, (x,), strict=True)
    del m[1].unused
    m[1].add_module("inner", nn.Linear(1, 1))
    assert not _planned(m, state)
    with pytest.raises(KeyError, match=r"1\.inner\.weight"):
        functional_call(m, state, (x,), strict=True)
    assert_close(functional_call(m, state, (x,)), _reference(m, state, x))


def test_state_created_in_a_slot_dictionary_replaced_during_the_call():
    """A module that replaces its ``_parameters`` dict while it runs and adds a parameter:
    the created parameter is seen (the check reads the module's dictionaries after the call)."""

    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self._parameters = {**self._parameters, "extra": nn.Parameter(torch.ones(1))}
            return self.lin(x)

    m = Grows()
    state = from_module(m)
    x = torch.randn(4, 3)
    for _ in range(2):  # the full path, then the plan
        with pytest.raises(PermissionError, match="extra"):
            functional_call(m, state, (x,))
        m._parameters = {}  # the module as it was (its dictionary was replaced, not restored)


def test_plan_per_state_structure():
    """Calls alternating between states of different structures for one module."""
    torch.manual_seed(0)
    m = WithBuffers().eval()
    x = torch.randn(5, 3)
    full = from_module(m) * 2
    flat = dict(full.flatten_keys(".").items())
    params = from_module(m, buffers=False) * 2
    buffers = {k: v for k, v in flat.items() if k not in dict(params.flatten_keys(".").items())}
    nested = {"body": {"0": {"weight": flat["body.0.weight"]}}}
    expected_full = torch.func.functional_call(m, flat, (x,))
    expected_part = torch.func.functional_call(m, {"body.0.weight": flat["body.0.weight"]}, (x,))
    before, objs = state_snapshot(m), _objs(m)
    for _ in range(2):
        for state, expected in (
            (full, expected_full),
            (flat, expected_full),
            ((params, buffers), expected_full),
            (nested, expected_part),
            ({"body.0.weight": flat["body.0.weight"]}, expected_part),
        ):
            assert_close(functional_call(m, state, (x,)), expected)
            assert _planned(m, state)
    assert_module_unchanged(m, before, objs)


def test_plan_does_not_keep_the_module_alive():
    m = WithBuffers()
    functional_call(m.eval(), from_module(m), (torch.randn(5, 3),))
    assert m in _plan._PLANS
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None


def test_compiled_call_after_eager_calls_takes_no_plan():
    """Eager calls keep a plan; a compiled call of the same module is one frame, and new values
    do not recompile (Dynamo sees no plan: its lookup is replaced by a twin that finds none)."""
    torch.manual_seed(0)
    m = mlp()
    x = torch.randn(5, 3)
    functional_call(m, from_module(m) * 2, (x,))
    assert _planned(m, from_module(m))
    counter = CompileCounterWithBackend("eager")
    fn = torch.compile(lambda s, xb: functional_call(m, s, (xb,)), backend=counter, fullgraph=True)
    for scale in (2.0, 3.0, 4.0):
        state = from_module(m).detach() * scale
        assert_close(fn(state, x), _reference(m, state, x))
    assert counter.frame_count == 1
    assert_close(functional_call(m, from_module(m) * 5, (x,)), _reference(m, from_module(m) * 5, x))


def test_grad_over_vmap_ensemble_copies_without_a_batching_fallback() -> None:
    # torch.func.grad outside torch.vmap: the private copy of a parameter sits under a vmap
    # level above a grad level; copy-on-write has no batching rule there (torch warns of a
    # slow fallback), so the copy must be a plain clone
    import warnings

    torch.manual_seed(0)
    base = torch.nn.Linear(3, 2)
    members = [torch.nn.Linear(3, 2) for _ in range(4)]
    stacked = tdfunc.stack([tdfunc.from_module(m).detach() for m in members])
    x = torch.randn(5, 3)

    def loss(p: Any, call: Any) -> torch.Tensor:
        return torch.vmap(lambda q: call(base, q, (x,)), in_dims=0)(p).pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = torch.func.grad(loss)(stacked, tdfunc.functional_call)
    flat = dict(stacked.flatten_keys(".").items())
    want = torch.func.grad(loss)(flat, torch.func.functional_call)
    for k, v in want.items():
        torch.testing.assert_close(got.flatten_keys(".")[k], v)
