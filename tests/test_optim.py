"""tdfunc.optim: parity with torch.optim (float64 rtol 1e-9, float32 rtol 1e-4; eager and
compiled), purity, compile (one frame, no recompiles across steps or learning-rate changes),
vmap ensembles with per-member hyperparameters, transforms, schedules, bad inputs, storage."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import check_compiled
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import tdfunc
from tdfunc import optim
from tdfunc._donate import is_consumed
from tdfunc.optim import _errors as E


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """One intra-op thread: these tests run many small ops, and with more OpenMP threads than
    free cores each parallel op spin-waits (milliseconds per sqrt on a loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TORCH = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}

#: every optimizer with each of its options (names and defaults as torch.optim)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("sgd", {"lr": 0.1}),
    ("sgd", {"lr": 0.05, "momentum": 0.9}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01}),
    (
        "sgd",
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "maximize": True, "weight_decay": 0.01},
    ),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.05}),
    ("adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True}),
    ("adamw", {"lr": 0.01}),
    ("adamw", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True}),
    ("rmsprop", {"lr": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "alpha": 0.9}),
    ("rmsprop", {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01}),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.5, "maximize": True, "eps": 1e-6}),
    ("adagrad", {"lr": 0.1}),
    (
        "adagrad",
        {
            "lr": 0.1,
            "lr_decay": 0.01,
            "weight_decay": 0.01,
            "initial_accumulator_value": 0.1,
            "eps": 1e-8,
            "maximize": True,
        },
    ),
]
#: one case per optimizer with most of its options (the compiled and float32 runs)
RICH = [CASES[3], CASES[5], CASES[8], CASES[12], CASES[14]]


def case_id(case: tuple[str, dict[str, Any]]) -> str:
    name, kw = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kw.items() if k != "lr")


# --------------------------------------------------------------------------------------
# models and reference runs
# --------------------------------------------------------------------------------------
def mlp(dtype: torch.dtype = torch.float64, seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).to(dtype)


def gpt2(dtype: torch.dtype = torch.float64) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,  # one tensor per name, as torch.optim sees them
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype).eval()


def params_of(model: nn.Module) -> Any:
    return tdfunc.from_module(model, buffers=False).detach().clone()


def flat(td: Any) -> dict[str, torch.Tensor]:
    return dict(td.flatten_keys(".").items())


def random_grads(params: Any, step: int, scale: float = 1.0) -> Any:
    g = torch.Generator().manual_seed(1000 + step)
    return params.apply(lambda p: torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def torch_run(
    params: Any,
    name: str,
    kw: dict[str, Any],
    steps: int,
    grads_at: Callable[[int], Any],
    lr_at: Callable[[int], float | None] = lambda i: None,
) -> dict[str, torch.Tensor]:
    """torch.optim over leaf copies of ``params``, fed the same grads."""
    ps = {k: v.detach().clone().requires_grad_(True) for k, v in flat(params).items()}
    opt = TORCH[name](list(ps.values()), **kw)
    for i in range(steps):
        lr = lr_at(i)
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


def our_run(
    params: Any,
    opt: optim.GradientTransformation,
    steps: int,
    grads_at: Callable[[int], Any],
    step_fn: Callable[..., Any] | None = None,
    state_at: Callable[[int, Any], Any] = lambda i, s: s,
) -> tuple[Any, Any]:
    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    fn = step_fn(step) if step_fn is not None else step
    state = opt.init(params)
    for i in range(steps):
        params, state = fn(params, state_at(i, state), grads_at(i))
    return params, state


def assert_matches(ours: Any, ref: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    got = flat(ours)
    assert list(got) == list(ref)
    for k in ref:
        torch.testing.assert_close(
            got[k], ref[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}"
        )


def make(name: str, kw: dict[str, Any], **over: Any) -> optim.GradientTransformation:
    return getattr(optim, name)(**{**kw, **over})  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------
# parity with torch.optim
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_parity_float64_gpt2_parameters(case: tuple[str, dict[str, Any]]) -> None:
    """100 steps over the parameters of a GPT-2 model (2 layers, 32 wide): rtol 1e-9."""
    name, kw = case
    params = params_of(gpt2())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ref = torch_run(params, name, kw, 100, grads_at)
    ours, state = our_run(params, make(name, kw), 100, grads_at)
    assert_matches(ours, ref, rtol=1e-9, atol=1e-12)
    assert int(state[name, "step"]) == 100


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_parity_float32_mlp(case: tuple[str, dict[str, Any]]) -> None:
    """100 steps in float32 over an MLP: rtol 1e-4 (the rounding order differs)."""
    name, kw = case
    params = params_of(mlp(torch.float32))
    grads_at = lambda i: random_grads(params, i, 0.5)  # noqa: E731
    ref = torch_run(params, name, kw, 100, grads_at)
    ours, _ = our_run(params, make(name, kw), 100, grads_at)
    assert_matches(ours, ref, rtol=1e-4, atol=1e-5)


def test_parity_gpt2_training_float64() -> None:
    """End to end: 100 AdamW steps on a GPT-2 language-model loss, gradients from each side's
    own parameters (torch.func.grad through tdfunc.functional_call vs loss.backward)."""
    model = gpt2()
    ref_model = copy.deepcopy(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (2, 8))

    def loss_fn(p: Any) -> torch.Tensor:
        return tdfunc.functional_call(model, p, (ids,), {"labels": ids}).loss  # type: ignore[no-any-return]

    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    params = params_of(model)
    state = opt.init(params)
    topt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(100):
        grads = torch.func.grad(loss_fn)(params)
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        topt.zero_grad()
        ref_model(ids, labels=ids).loss.backward()
        topt.step()
    ref = {k: v.detach() for k, v in ref_model.named_parameters()}
    got = flat(params)
    for k, v in ref.items():
        # the gradients come from two autograd paths (summation orders differ by an ulp), so
        # entries that cross zero need an absolute tolerance
        torch.testing.assert_close(got[k], v, rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")


def test_parity_mlp_training_sgd_float64() -> None:
    """An MLP trained on a regression loss: SGD with nesterov momentum, 100 steps."""
    model = mlp()
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 3, dtype=torch.float64)

    def loss_fn(p: Any) -> torch.Tensor:
        return ((tdfunc.functional_call(model, p, (x,)) - y) ** 2).mean()

    opt = optim.sgd(lr=0.05, momentum=0.9, nesterov=True)
    params = params_of(model)
    state = opt.init(params)
    topt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    for _ in range(100):
        updates, state = opt.update(torch.func.grad(loss_fn)(params), state, params)
        params = optim.apply_updates(params, updates)
        topt.zero_grad()
        ((ref_model(x) - y) ** 2).mean().backward()
        topt.step()
    assert_matches(params, {k: v.detach() for k, v in ref_model.named_parameters()}, 1e-9, 1e-12)


@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "maximize": True, "betas": (0.8, 0.9)}])
def test_lion_matches_its_formula(kw: dict[str, Any]) -> None:
    """Lion (not in torch.optim) against the paper's update written per tensor, 50 steps,
    eager and compiled."""
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    b1, b2 = kw.get("betas", (0.9, 0.99))
    wd, sign = kw.get("weight_decay", 0.0), -1.0 if kw.get("maximize") else 1.0
    ref = {k: v.clone() for k, v in flat(params).items()}
    m = {k: torch.zeros_like(v) for k, v in ref.items()}
    for i in range(50):
        g = flat(grads_at(i))
        for k in ref:
            d = sign * g[k]
            ref[k] = ref[k] - 0.01 * (torch.sign(b1 * m[k] + (1 - b1) * d) + wd * ref[k])
            m[k] = b2 * m[k] + (1 - b2) * d
    ours, state = our_run(params, optim.lion(lr=0.01, **kw), 50, grads_at)
    assert_matches(ours, ref, rtol=1e-9, atol=1e-12)
    assert state["lion"].keys() == ["exp_avg", "step"]
    cnt = CompileCounterWithBackend("eager")
    comp, _ = our_run(params, optim.lion(lr=0.01, **kw), 50, grads_at, compiled_step(cnt))
    assert cnt.frame_count == 1
    tdfunc.testing.assert_close(comp, ours)


# --------------------------------------------------------------------------------------
# compiled
# --------------------------------------------------------------------------------------
def compiled_step(cnt: CompileCounterWithBackend) -> Callable[..., Any]:
    return lambda step: torch.compile(step, backend=cnt, fullgraph=True)


@pytest.mark.parametrize("case", RICH, ids=case_id)
def test_compiled_parity_and_lr_change_float64(case: tuple[str, dict[str, Any]]) -> None:
    """Compiled (fullgraph): 100 steps equal torch.optim at rtol 1e-9; one frame; the tensor
    learning rate changes at step 50 without recompiling."""
    name, kw = case
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ref = torch_run(params, name, kw, 100, grads_at, lambda i: kw["lr"] / 2 if i == 50 else None)
    opt = make(name, kw, lr=torch.tensor(kw["lr"], dtype=torch.float64))
    cnt = CompileCounterWithBackend("eager")

    def state_at(i: int, s: Any) -> Any:
        return optim.set_hyperparams(s, lr=kw["lr"] / 2) if i == 50 else s

    ours, state = our_run(params, opt, 100, grads_at, compiled_step(cnt), state_at)
    assert cnt.frame_count == 1
    assert_matches(ours, ref, rtol=1e-9, atol=1e-12)
    assert state[name, "lr"].item() == kw["lr"] / 2


@pytest.mark.parametrize("case", [RICH[1], RICH[2]], ids=case_id)
def test_compiled_parity_float32(case: tuple[str, dict[str, Any]]) -> None:
    name, kw = case
    params = params_of(mlp(torch.float32))
    grads_at = lambda i: random_grads(params, i, 0.5)  # noqa: E731
    ref = torch_run(params, name, kw, 100, grads_at)
    cnt = CompileCounterWithBackend("eager")
    ours, _ = our_run(params, make(name, kw), 100, grads_at, compiled_step(cnt))
    assert cnt.frame_count == 1
    assert_matches(ours, ref, rtol=1e-4, atol=1e-5)


def test_compiled_inductor_training_step() -> None:
    """A whole training step (forward, backward, AdamW) with inductor: one graph, the eager
    result, and no recompile when the learning rate changes."""
    model = mlp(torch.float32)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    opt = optim.adamw(lr=torch.tensor(1e-2), weight_decay=0.1)

    def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        def loss_fn(p: Any) -> torch.Tensor:
            return ((tdfunc.functional_call(model, p, (x,)) - y) ** 2).mean()

        u, s = opt.update(torch.func.grad(loss_fn)(p), s, p)
        return optim.apply_updates(p, u), s

    cnt = CompileCounterWithBackend("inductor")
    cstep = torch.compile(step, backend=cnt, fullgraph=True)
    p0 = params_of(model)
    p1, s1 = p0, opt.init(p0)
    p2, s2 = p0, opt.init(p0)
    for i in range(3):
        if i == 2:
            s1, s2 = optim.set_hyperparams(s1, lr=0.5), optim.set_hyperparams(s2, lr=0.5)
        p1, s1 = step(p1, s1, x, y)
        p2, s2 = cstep(p2, s2, x, y)
    assert cnt.frame_count == 1
    tdfunc.testing.assert_close(p2, p1, rtol=1e-5, atol=1e-6)
    tdfunc.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-6)


def test_compiled_schedule_chain_masked_no_recompile() -> None:
    """A chain with clipping, a masked weight decay and a scheduled learning rate compiles to
    one frame; the step count moves through the schedule without recompiling."""
    opt = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.masked(optim.add_decayed_weights(0.1), "*.weight"),
        optim.sgd(lr=optim.warmup_cosine_decay(0.1, warmup_steps=3, decay_steps=8)),
    )
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    eager, s_eager = our_run(params, opt, 10, grads_at)
    cnt = CompileCounterWithBackend("eager")
    comp, s_comp = our_run(params, opt, 10, grads_at, compiled_step(cnt))
    assert cnt.frame_count == 1
    tdfunc.testing.assert_close(comp, eager)
    tdfunc.testing.assert_close(s_comp, s_eager)
    assert int(s_comp["chain", "2", "sgd", "step"]) == 10


COMPILED_TRANSFORMS = {
    "multi_transform": lambda: optim.multi_transform(
        {"a": optim.adagrad(lr=torch.tensor(0.1)), "z": optim.set_to_zero()},
        lambda path, leaf: "a" if leaf.ndim == 2 else "z",
    ),
    "masked_container": lambda: optim.masked(
        optim.rmsprop(centered=True),
        tdfunc.TensorDict(
            {"0": {"weight": True, "bias": False}, "2": {"weight": False, "bias": True}}
        ),
    ),
    "scale": lambda: optim.chain(
        optim.scale(torch.tensor(-0.5)), optim.scale_by_schedule(optim.cosine_decay(1.0, 4))
    ),
}


@pytest.mark.parametrize("name", list(COMPILED_TRANSFORMS))
def test_compiled_transforms(name: str) -> None:
    """update + apply_updates compiled: one frame, the eager result, no recompile on new
    values of the same structure (new grads, the next state)."""
    opt = COMPILED_TRANSFORMS[name]()
    params = params_of(mlp())
    calls = iter(range(100))
    state = opt.init(params)

    def make() -> tuple[Any, ...]:
        i = next(calls)
        return params + i, state, random_grads(params, i)

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s

    check_compiled(step, make)


def test_set_hyperparams_compiled() -> None:
    state = optim.adamw(lr=torch.tensor(0.1)).init(params_of(mlp()))
    check_compiled(
        lambda s, lr: optim.set_hyperparams(s, lr=lr),
        lambda: (state, torch.tensor(float(torch.rand(()))) * 0.1),
    )


# --------------------------------------------------------------------------------------
# purity
# --------------------------------------------------------------------------------------
def versions(x: Any) -> list[int]:
    return [t._version for t in x.values(include_nested=True, leaves_only=True)]


PURITY = [
    *[(n, lambda n=n, kw=kw: make(n, kw)) for n, kw in CASES],
    ("lion", lambda: optim.lion(weight_decay=0.1, maximize=True)),
    (
        "chain",
        lambda: optim.chain(
            optim.clip_by_global_norm(0.1),
            optim.masked(optim.add_decayed_weights(0.1), "*.bias"),
            optim.multi_transform(
                {"a": optim.adam(lr=torch.tensor(0.1)), "z": optim.set_to_zero()},
                {"0.*": "a", "*": "z"},
            ),
            optim.scale_by_schedule(optim.step_decay(1.0, 2)),
        ),
    ),
]


@pytest.mark.parametrize("make_opt", [m for _, m in PURITY], ids=[n for n, _ in PURITY])
def test_update_writes_nothing(make_opt: Callable[[], optim.GradientTransformation]) -> None:
    """params, grads and state keep their values and versions; outputs are new tensors."""
    opt = make_opt()
    params = params_of(mlp())
    state = opt.init(params)
    _, state = opt.update(random_grads(params, 0), state, params)  # buffers are non-zero now
    grads = random_grads(params, 1)
    snaps = [x.clone() for x in (params, grads, state)]
    vers = [versions(x) for x in (params, grads, state)]
    updates, new_state = opt.update(grads, state, params)
    new_params = optim.apply_updates(params, updates)
    for x, snap, ver in zip((params, grads, state), snaps, vers):
        tdfunc.testing.assert_close(x, snap, rtol=0, atol=0)
        assert versions(x) == ver
    inputs = {id(t) for x in (params, grads) for t in x.values(True, True)}
    assert not inputs & {id(t) for t in new_params.values(True, True)}
    assert new_state.batch_size == state.batch_size


# --------------------------------------------------------------------------------------
# eager foreach: one call per op over all leaves
# --------------------------------------------------------------------------------------
class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", RICH, ids=case_id)
def test_eager_uses_one_foreach_call_per_op(case: tuple[str, dict[str, Any]]) -> None:
    """The number of tensor ops of an eager update does not grow with the number of leaves:
    every list op is one torch._foreach_* call (the rest are scalar ops on the step count)."""
    name, kw = case
    counts = []
    for model in (mlp(), nn.Sequential(*(nn.Linear(4, 4) for _ in range(5))).double()):
        params = params_of(model)
        opt = make(name, kw)
        state = opt.init(params)
        grads = random_grads(params, 0)
        with OpLog() as log:
            u, _ = opt.update(grads, state, params)
            optim.apply_updates(params, u)
        counts.append(log.ops)
        assert any(op.startswith("_foreach_") for op in log.ops)
    assert counts[0] == counts[1]


def test_vmap_falls_back_to_per_leaf_ops() -> None:
    """Under torch.vmap (batched leaves, no foreach batching rule) the update runs per leaf and
    gives the same result as the stacked eager update."""
    stacked = tdfunc.stack([params_of(mlp(seed=i)) for i in range(3)])
    opt = optim.adam(lr=0.1)
    state = opt.init(stacked)
    grads = random_grads(stacked, 0)
    u_vmap, s_vmap = torch.vmap(opt.update)(grads, state, stacked)
    u_eager, s_eager = opt.update(grads, state, stacked)
    tdfunc.testing.assert_close(u_vmap, u_eager)
    tdfunc.testing.assert_close(s_vmap, s_eager)
    for i in range(3):
        single = opt.update(grads[i], opt.init(stacked[i]), stacked[i])[0]
        tdfunc.testing.assert_close(u_eager[i], single)


# --------------------------------------------------------------------------------------
# ensembles under vmap, per-member hyperparameters
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "kw", "members"),
    [
        ("adamw", {}, {"lr": [0.1, 0.01, 0.003, 0.001], "weight_decay": [0.0, 0.1, 0.2, 0.5]}),
        ("sgd", {"momentum": 0.9}, {"lr": [0.1, 0.05, 0.01, 0.001], "weight_decay": [0.0] * 4}),
    ],
)
def test_vmap_ensemble_per_member_hyperparameters(
    name: str, kw: dict[str, Any], members: dict[str, list[float]]
) -> None:
    """4 MLPs trained in one compiled vmap step, each with its own lr / weight decay: each
    member's trajectory equals its own torch.optim run (float64, rtol 1e-9)."""
    nets = [mlp(seed=i) for i in range(4)]
    base = copy.deepcopy(nets[0])
    stacked = tdfunc.stack_modules(nets).detach()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    hyper = {k: torch.tensor(v, dtype=torch.float64) for k, v in members.items()}
    opt = make(name, kw, **hyper)

    def member(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
        def loss_fn(p: Any) -> torch.Tensor:
            return ((tdfunc.functional_call(base, p, (x,)) - y) ** 2).mean()

        u, s = opt.update(torch.func.grad(loss_fn)(p), s, p)
        return optim.apply_updates(p, u), s

    cnt = CompileCounterWithBackend("eager")
    step = torch.compile(
        torch.vmap(member, in_dims=(0, 0, None, None)), backend=cnt, fullgraph=True
    )
    params, state = stacked, opt.init(stacked)
    assert state.batch_size == torch.Size([4])
    assert state[name, "lr"].tolist() == members["lr"]
    for _ in range(20):
        params, state = step(params, state, x, y)
    assert cnt.frame_count == 1
    for i, net in enumerate(nets):
        topt = TORCH[name](net.parameters(), **kw, **{k: v[i] for k, v in members.items()})
        for _ in range(20):
            topt.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            topt.step()
        assert_matches(params[i], {k: v.detach() for k, v in net.named_parameters()}, 1e-9, 1e-12)
    # new per-member learning rates: same graph
    lrs = torch.tensor([0.5, 0.4, 0.3, 0.2], dtype=torch.float64)
    state = optim.set_hyperparams(state, lr=lrs)
    params, state = step(params, state, x, y)
    assert cnt.frame_count == 1
    assert state[name, "lr"].tolist() == [0.5, 0.4, 0.3, 0.2]


def test_optimizer_built_inside_a_compiled_step_with_a_tensor_lr() -> None:
    """``optim.adamw(lr=lr, ...)`` built inside a ``fullgraph`` step with ``lr`` a tensor
    argument compiles to one frame (building it reads no tensor value: the tensor's dtype is
    checked, its values are not), and a new ``lr`` does not recompile. ``update`` reads the
    state's learning rate (the constructor's tensor is what ``init`` stores); the step
    passes the new value in with ``set_hyperparams``, and the result is the eager one."""
    params = params_of(mlp())
    grads = random_grads(params, 0)
    state = optim.adamw(lr=torch.tensor(1e-2, dtype=torch.float64)).init(params)

    def step(params: Any, state: Any, grads: Any, lr: torch.Tensor) -> tuple[Any, Any]:
        state = optim.set_hyperparams(state, lr=lr)
        updates, state = optim.adamw(lr=lr, weight_decay=1e-2).update(grads, state, params)
        return optim.apply_updates(params, updates), state

    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=cnt, fullgraph=True)
    for lr in (1e-2, 3e-3, 0.5):
        lr_t = torch.tensor(lr, dtype=torch.float64)
        want_p, want_s = step(params, state, grads, lr_t)
        got_p, got_s = compiled(params, state, grads, lr_t)
        tdfunc.testing.assert_close(got_p, want_p)
        tdfunc.testing.assert_close(got_s, want_s)
        assert got_s["adamw", "lr"].item() == lr
    assert cnt.frame_count == 1
    # a larger lr moves the params further: the new value is the one used
    far, _ = step(params, state, grads, torch.tensor(0.5, dtype=torch.float64))
    near, _ = step(params, state, grads, torch.tensor(1e-3, dtype=torch.float64))
    moved = lambda p: sum(float(v.abs().sum()) for v in flat(p - params).values())  # noqa: E731
    assert moved(far) > 10 * moved(near)


def test_optimizer_built_inside_vmap_over_per_member_lr() -> None:
    """The same step under ``torch.vmap`` over the ensemble members' ``lr`` (a 0-d tensor
    per member inside): one frame, new per-member values without recompiling, each member
    equal to its own unbatched step."""
    params = tdfunc.stack([params_of(mlp(seed=i)) for i in range(3)])
    grads = tdfunc.stack([random_grads(params[i], i) for i in range(3)])
    lr0 = torch.tensor([1e-2, 1e-3, 1e-1], dtype=torch.float64)
    state = optim.adamw(lr=lr0).init(params)

    def member(params: Any, state: Any, grads: Any, lr: torch.Tensor) -> tuple[Any, Any]:
        state = optim.set_hyperparams(state, lr=lr)
        updates, state = optim.adamw(lr=lr, weight_decay=1e-2).update(grads, state, params)
        return optim.apply_updates(params, updates), state

    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(torch.vmap(member), backend=cnt, fullgraph=True)
    for lrs in (lr0, torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64)):
        got_p, got_s = compiled(params, state, grads, lrs)
        assert got_s["adamw", "lr"].tolist() == lrs.tolist()
        for i in range(3):
            want_p, _ = member(params[i], state[i], grads[i], lrs[i])
            tdfunc.testing.assert_close(got_p[i], want_p)
    assert cnt.frame_count == 1


def test_tensor_hyperparameters_are_checked_without_reading_values() -> None:
    """A tensor hyperparameter's dtype is checked when the optimizer is built (``TypeError``);
    its values are not read (that would synchronise with the device and cannot be traced):
    the shape is checked against the params' batch size by ``init``. Python numbers keep
    ``torch.optim``'s range checks."""
    with pytest.raises(TypeError) as e:
        optim.adamw(lr=torch.tensor(1))
    assert "floating point" in str(e.value)

    class NoRead(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            if func in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.is_nonzero.default,
            ):
                raise AssertionError(f"a hyperparameter value was read: {func}")
            return func(*args, **(kwargs or {}))

    with NoRead():
        optim.adamw(lr=torch.tensor(1e-3), betas=(0.9, 0.999), weight_decay=torch.tensor(0.1))
        optim.sgd(lr=torch.tensor([0.1, 0.2]), momentum=0.9)
        optim.add_decayed_weights(torch.tensor([0.1]))
    with pytest.raises(ValueError, match="invalid lr") as e2:
        optim.adamw(lr=-1e-3)
    assert str(e2.value) == E.BAD_HYPER.format(what="adamw", name="lr", value=-1e-3, rule=">= 0.0")


# --------------------------------------------------------------------------------------
# transforms and schedules
# --------------------------------------------------------------------------------------
def test_chain_clip_by_global_norm_matches_torch() -> None:
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i, 3.0)  # noqa: E731
    ps = {k: v.clone().requires_grad_(True) for k, v in flat(params).items()}
    topt = torch.optim.SGD(list(ps.values()), lr=0.1, momentum=0.9)
    for i in range(30):
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm=1.5)
        topt.step()
    opt = optim.chain(optim.clip_by_global_norm(1.5), optim.sgd(lr=0.1, momentum=0.9))
    ours, _ = our_run(params, opt, 30, grads_at)
    assert_matches(ours, {k: v.detach() for k, v in ps.items()}, 1e-9, 1e-12)


def test_clip_by_global_norm_per_member_and_small_grads() -> None:
    g = tdfunc.TensorDict(
        a=torch.tensor([[3.0], [0.3]]), b=torch.tensor([[4.0], [0.4]]), batch_size=[2]
    )
    opt = optim.clip_by_global_norm(1.0)
    u, _ = opt.update(g, opt.init(g))
    # member 0 has norm 5 (clipped to 1), member 1 norm 0.5 (unchanged)
    torch.testing.assert_close(u["a"][:, 0], torch.tensor([0.6, 0.3]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u["b"][:, 0], torch.tensor([0.8, 0.4]), rtol=1e-5, atol=1e-6)
    uv, _ = torch.vmap(opt.update)(g, opt.init(g))
    tdfunc.testing.assert_close(uv, u)


def test_add_decayed_weights_chain_equals_weight_decay_option() -> None:
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    a, _ = our_run(
        params, optim.chain(optim.add_decayed_weights(0.1), optim.adam(lr=0.01)), 20, grads_at
    )
    b, _ = our_run(params, optim.adam(lr=0.01, weight_decay=0.1), 20, grads_at)
    tdfunc.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "mask",
    [
        "*.weight",
        ["0.weight", "2.weight"],
        lambda path, leaf: leaf.ndim == 2,
        tdfunc.TensorDict(
            {"0": {"weight": True, "bias": False}, "2": {"weight": True, "bias": False}}
        ),
    ],
    ids=["pattern", "patterns", "callable", "container"],
)
def test_masked_weight_decay_equals_torch_param_groups(mask: Any) -> None:
    """Weight decay on weights only (masked) = torch.optim.Adam with two parameter groups."""
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ps = {k: v.clone().requires_grad_(True) for k, v in flat(params).items()}
    topt = torch.optim.Adam(
        [
            {"params": [p for k, p in ps.items() if k.endswith("weight")], "weight_decay": 0.2},
            {"params": [p for k, p in ps.items() if k.endswith("bias")], "weight_decay": 0.0},
        ],
        lr=0.01,
    )
    for i in range(30):
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        topt.step()
    opt = optim.chain(optim.masked(optim.add_decayed_weights(0.2), mask), optim.adam(lr=0.01))
    ours, _ = our_run(params, opt, 30, grads_at)
    assert_matches(ours, {k: v.detach() for k, v in ps.items()}, 1e-9, 1e-12)


def test_masked_inner_state_covers_selected_leaves_only() -> None:
    params = params_of(mlp())
    opt = optim.masked(optim.adam(), "*.bias")
    state = opt.init(params)
    assert state["masked", "inner", "adam", "exp_avg"].keys() == ["0.bias", "2.bias"]
    u, _ = opt.update(random_grads(params, 0), state, params)
    g = random_grads(params, 0)
    assert torch.equal(u["0", "weight"], g["0", "weight"])  # passed through
    assert not torch.equal(u["0", "bias"], g["0", "bias"])


def test_multi_transform_equals_torch_param_groups_and_freezes() -> None:
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ps = {k: v.clone().requires_grad_(True) for k, v in flat(params).items()}
    topt = torch.optim.SGD(
        [
            {"params": [ps["0.weight"], ps["0.bias"]], "lr": 0.1, "momentum": 0.9},
            {"params": [ps["2.weight"]], "lr": 0.01},
        ],
    )
    for i in range(20):
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        topt.step()
    opt = optim.multi_transform(
        {
            "fast": optim.sgd(lr=0.1, momentum=0.9),
            "slow": optim.sgd(lr=0.01),
            "frozen": optim.set_to_zero(),
        },
        {"0.*": "fast", "2.weight": "slow", "*": "frozen"},
    )
    ours, state = our_run(params, opt, 20, grads_at)
    assert_matches(ours, {k: v.detach() for k, v in ps.items()}, 1e-9, 1e-12)
    assert torch.equal(ours["2", "bias"], params["2", "bias"])
    assert list(state["multi_transform"].keys()) == ["fast", "slow", "frozen"]
    # a callable labelling gives the same
    opt2 = optim.multi_transform(
        {
            "fast": optim.sgd(lr=0.1, momentum=0.9),
            "slow": optim.sgd(lr=0.01),
            "frozen": optim.set_to_zero(),
        },
        lambda path, leaf: (
            "fast" if path[0] == "0" else "slow" if path[-1] == "weight" else "frozen"
        ),
    )
    ours2, _ = our_run(params, opt2, 20, grads_at)
    tdfunc.testing.assert_close(ours2, ours, rtol=0, atol=0)


def scheduler_lrs(make_sched: Callable[[Any], Any], steps: int, lr: float) -> list[float]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make_sched(opt)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            optim.step_decay(0.1, step_size=7, gamma=0.5),
            lambda o: torch.optim.lr_scheduler.StepLR(o, 7, 0.5),
        ),
        (
            optim.cosine_decay(0.1, decay_steps=20, end_value=0.01),
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20, eta_min=0.01),
        ),
        (
            optim.linear_warmup(0.1, warmup_steps=10, init_value=0.025),
            lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=10),
        ),
    ],
    ids=["step", "cosine", "warmup"],
)
def test_schedules_match_torch_lr_schedulers(ours: optim.Schedule, theirs: Any) -> None:
    ref = scheduler_lrs(theirs, 20, 0.1)
    got = [ours(torch.tensor(i)).item() for i in range(20)]
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


def test_schedule_as_lr_matches_torch_scheduler_trajectory() -> None:
    params = params_of(mlp())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ps = {k: v.clone().requires_grad_(True) for k, v in flat(params).items()}
    topt = torch.optim.SGD(list(ps.values()), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(topt, 5, 0.5)
    for i in range(20):
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        topt.step()
        sched.step()
    opt = optim.sgd(lr=optim.step_decay(0.1, 5, 0.5), momentum=0.9)
    ours, state = our_run(params, opt, 20, grads_at)
    assert_matches(ours, {k: v.detach() for k, v in ps.items()}, 1e-9, 1e-12)
    assert int(state["sgd", "step"]) == 20


def test_join_schedules_and_constant() -> None:
    s = optim.join_schedules([optim.constant(1.0), optim.linear(1.0, 0.0, 2)], boundaries=[3])
    assert [s(torch.tensor(i)).item() for i in range(6)] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    v = torch.vmap(s)(torch.tensor([0, 4, 9]))
    assert v.tolist() == [1.0, 0.5, 0.0]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: optim.join_schedules([optim.constant(1.0)], [3]),
        lambda: optim.join_schedules([optim.constant(1.0)] * 3, [3, 2]),
        lambda: optim.linear(0.0, 1.0, 0),
        lambda: optim.step_decay(1.0, step_size=0),
        lambda: optim.cosine_decay(1.0, decay_steps=-1),
        lambda: optim.warmup_cosine_decay(1.0, warmup_steps=5, decay_steps=5),
    ],
)
def test_bad_schedules(bad: Callable[[], Any]) -> None:
    with pytest.raises(ValueError, match=r"join_schedules|linear|step_decay|cosine_decay|warmup"):
        bad()


def test_scale_and_scale_by_schedule() -> None:
    g = tdfunc.TensorDict(w=torch.ones(2))
    opt = optim.scale(torch.tensor(2.0))
    u, s = opt.update(g, opt.init(g))
    assert u["w"].tolist() == [2.0, 2.0]
    s = optim.set_hyperparams(s, step_size=-1.0)
    assert opt.update(g, s)[0]["w"].tolist() == [-1.0, -1.0]
    with pytest.raises(TypeError) as e:
        optim.scale("fast")  # type: ignore[arg-type]
    assert str(e.value) == E.BAD_SCALE.format(
        what="scale", expected="a number, a tensor or a schedule", value="fast"
    )
    with pytest.raises(TypeError) as e:
        optim.scale_by_schedule(0.1)  # type: ignore[arg-type]
    assert str(e.value) == E.BAD_SCALE.format(
        what="scale_by_schedule", expected="a schedule", value=0.1
    )


# --------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------
def test_integer_leaf_refused_naming_key() -> None:
    params = tdfunc.TensorDict(w=torch.ones(2), bn={"num_batches_tracked": torch.tensor(3)})
    with pytest.raises(TypeError) as e:
        optim.adam().init(params)
    assert str(e.value) == E.NOT_FLOATING.format(
        what="adam.init", key=repr(("bn", "num_batches_tracked")), dtype=torch.int64
    )
    # the documented way around it
    opt = optim.masked(optim.adam(lr=1.0), lambda path, leaf: leaf.is_floating_point())
    u, _ = opt.update(params, opt.init(params), params)
    assert torch.equal(u["bn", "num_batches_tracked"], torch.tensor(3))
    assert u["w"].tolist() == pytest.approx([-1.0, -1.0])


def test_grads_structure_differs_from_params() -> None:
    params = params_of(mlp())
    opt = optim.adam()
    state = opt.init(params)
    grads = random_grads(params, 0).exclude(("2", "bias"))
    with pytest.raises(tdfunc.StructureError, match=r"missing keys \[\('2', 'bias'\)\]"):
        opt.update(grads, state, params)
    with pytest.raises(tdfunc.StructureError, match=r"'2', 'bias'"):
        optim.apply_updates(params, grads)


def test_state_of_another_optimizer() -> None:
    params = params_of(mlp())
    state = optim.sgd().init(params)
    with pytest.raises(optim.OptimStateError) as e:
        optim.adam().update(random_grads(params, 0), state, params)
    assert str(e.value) == E.WRONG_STATE.format(what="adam.update", expected="adam", got=["sgd"])
    assert isinstance(e.value, tdfunc.StructureError)


def test_state_with_other_options() -> None:
    params = params_of(mlp())
    state = optim.adam().init(params)
    with pytest.raises(optim.OptimStateError) as e:
        optim.adam(amsgrad=True).update(random_grads(params, 0), state, params)
    assert str(e.value) == E.STATE_KEYS.format(
        what="adam.update",
        name="adam",
        got=["exp_avg", "exp_avg_sq", "step"],
        expected=["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"],
    )


def test_state_of_other_params() -> None:
    opt = optim.adam()
    params = params_of(mlp())
    other = params_of(
        nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 3)).double()
    )
    with pytest.raises(optim.OptimStateError) as e:
        opt.update(random_grads(params, 0), opt.init(other), params)
    assert str(e.value) == E.STATE_PARAMS.format(
        what="adam.update", entry="exp_avg", missing=[], extra=["3.bias", "3.weight"]
    )
    wider = params_of(mlp(width=8))
    with pytest.raises(optim.OptimStateError) as e:
        opt.update(random_grads(params, 0), opt.init(wider), params)
    assert str(e.value) == E.STATE_SHAPE.format(
        what="adam.update", entry="exp_avg", key=repr("0.weight"), got=(8, 4), expected=(16, 4)
    )
    stacked = tdfunc.stack([params, params])
    with pytest.raises(optim.OptimStateError) as e:
        opt.update(random_grads(params, 0), opt.init(stacked), params)
    assert str(e.value) == E.STATE_BATCH.format(what="adam.update", got=(2,), expected=())


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optim.adam(),
        lambda: optim.adamw(lr=0.1, weight_decay=0.1),
        lambda: optim.sgd(lr=0.1, momentum=0.9),
        lambda: optim.adagrad(),
    ],
)
def test_grads_of_another_dtype_than_the_state(make_opt: Any) -> None:
    """A state buffer of one dtype and grads of another: a typed error naming the key (not
    a torch error from inside an op, and not a state that changes dtype silently)."""
    opt = make_opt()
    params = tdfunc.TensorDict(w=torch.zeros(3), b={"c": torch.zeros(2)})
    state = opt.init(params)
    grads = tdfunc.TensorDict(w=torch.ones(3), b={"c": torch.ones(2, dtype=torch.float64)})
    entry = next(iter(state[next(iter(state.keys()))].keys()))
    for run in (
        lambda: opt.update(grads, state, params),
        lambda: optim.step(opt, grads, state, params),
        lambda: optim.step(opt, grads, state, params, donate=True),
    ):
        with pytest.raises(optim.OptimStateError) as e:
            run()
        assert str(e.value) == E.STATE_DTYPE.format(
            what=f"{opt_tag(state)}.update",
            entry=entry,
            key=repr("b.c"),
            got=torch.float32,
            expected=torch.float64,
        )
    assert not is_consumed(params)
    assert not is_consumed(state)
    assert torch.equal(params["w"], torch.zeros(3))


def opt_tag(state: Any) -> str:
    return next(iter(state.keys()))


def test_leaf_names_that_collide() -> None:
    """Buffers are keyed by "."-joined key paths: two paths with one name are refused."""
    params = tdfunc.TensorDict({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(ValueError, match="both give the leaf name") as e:
        optim.adam().init(params)
    assert str(e.value) == E.NAME_COLLISION.format(
        what="adam.init", a=repr("a.b"), b=repr(("a", "b")), name="a.b"
    )
    assert optim.sgd().init(params)["sgd", "step"].item() == 0  # no buffers, no names


def test_not_containers_and_missing_params() -> None:
    params = params_of(mlp())
    opt = optim.adamw()
    with pytest.raises(TypeError, match="must be a TensorDict or a tensorclass"):
        opt.init({"w": torch.ones(1)})
    with pytest.raises(TypeError, match="must be a TensorDict or a tensorclass"):
        opt.update(random_grads(params, 0), "state", params)
    with pytest.raises(TypeError) as e:
        opt.update(random_grads(params, 0), opt.init(params))
    assert str(e.value) == E.NEEDS_PARAMS.format(what="adamw.update")
    with pytest.raises(TypeError) as e:
        optim.chain(optim.sgd(), "sgd")  # type: ignore[arg-type]
    assert str(e.value) == E.NOT_A_TRANSFORMATION.format(what="chain", typ="str")
    with pytest.raises(TypeError) as e:
        optim.masked("adam", "*")  # type: ignore[arg-type]
    assert str(e.value) == E.NOT_A_TRANSFORMATION.format(what="masked", typ="str")
    with pytest.raises(TypeError) as e:
        optim.multi_transform({"a": 1}, {"*": "a"})  # type: ignore[dict-item]
    assert str(e.value) == E.NOT_A_TRANSFORMATION.format(what="multi_transform['a']", typ="int")


@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (lambda: optim.sgd(lr=-0.1), ValueError),
        (lambda: optim.adam(betas=(1.0, 0.999)), ValueError),
        (lambda: optim.adam(lr="fast"), TypeError),
        (lambda: optim.adam(lr=torch.tensor(1)), TypeError),
        (lambda: optim.rmsprop(momentum=-1.0), ValueError),
        (lambda: optim.adagrad(eps=-1.0), ValueError),
        (lambda: optim.sgd(nesterov=True), ValueError),
        (lambda: optim.sgd(momentum=0.9, dampening=0.1, nesterov=True), ValueError),
        (lambda: optim.clip_by_global_norm(-1.0), ValueError),
        (lambda: optim.add_decayed_weights(-0.1), ValueError),
    ],
)
def test_bad_hyperparameters(bad: Callable[[], Any], exc: type[Exception]) -> None:
    with pytest.raises(exc, match=r"invalid|nesterov"):
        bad()


def test_tensor_hyperparameter_shape_and_set_hyperparams_errors() -> None:
    params = tdfunc.stack([params_of(mlp())] * 3)
    with pytest.raises(ValueError, match="does not broadcast") as e:
        optim.sgd(lr=torch.tensor([0.1, 0.2])).init(params)
    assert str(e.value) == E.HYPER_SHAPE.format(
        what="sgd.init", name="lr", shape=(2,), batch_size=(3,)
    )
    state = optim.sgd(lr=0.1).init(params)
    with pytest.raises(KeyError) as e2:
        optim.set_hyperparams(state, lr=0.2)
    assert e2.value.args[0] == E.NO_HYPER.format(name="lr", found=[])


def test_masks_and_labels_that_do_not_fit() -> None:
    params = params_of(mlp())
    with pytest.raises(KeyError) as e:
        optim.masked(optim.sgd(), tdfunc.TensorDict({"0": {"weight": True}})).init(params)
    assert e.value.args[0] == E.MASK_KEYS.format(what="masked", key=repr(("0", "bias")))
    with pytest.raises(TypeError) as e2:
        optim.masked(optim.sgd(), tdfunc.TensorDict(a=torch.ones(2)))
    assert str(e2.value) == E.MASK_VALUE.format(what="masked", key=repr("a"), value=torch.ones(2))
    with pytest.raises(TypeError) as e4:
        optim.masked(optim.sgd(), 3)
    assert str(e4.value) == E.BAD_MASK.format(what="masked", typ="int")
    with pytest.raises(KeyError) as e3:
        optim.multi_transform({"a": optim.sgd()}, {"0.*": "a"}).init(params)
    assert e3.value.args[0] == E.NO_LABEL.format(
        key=repr(("2", "weight")), label=None, labels=["a"]
    )
    with pytest.raises(TypeError) as e5:
        optim.multi_transform({"a": optim.sgd()}, 3)  # type: ignore[arg-type]
    assert str(e5.value) == E.BAD_LABELS.format(typ="int")


# --------------------------------------------------------------------------------------
# dtypes, tensorclasses, memory maps, DTensor, storage
# --------------------------------------------------------------------------------------
def test_bf16_and_mixed_dtypes_keep_their_dtype() -> None:
    params = tdfunc.TensorDict(
        a=torch.randn(3, dtype=torch.bfloat16),
        b=torch.randn(2),
        c=torch.randn(2, dtype=torch.float64),
    )
    for opt in (optim.adamw(lr=0.1), optim.sgd(lr=0.1, momentum=0.9), optim.rmsprop(centered=True)):
        state = opt.init(params)
        p = params
        for i in range(3):
            u, state = opt.update(random_grads(p, i), state, p)
            p = optim.apply_updates(p, u)
        assert [x.dtype for x in p.values()] == [torch.bfloat16, torch.float32, torch.float64]
        assert [x.dtype for x in u.values()] == [torch.bfloat16, torch.float32, torch.float64]
    # bf16 follows torch.optim's bf16 run to bf16 precision
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ref = torch_run(params, "adamw", {"lr": 0.1}, 3, grads_at)
    ours = flat(our_run(params, optim.adamw(lr=0.1), 3, grads_at)[0])
    torch.testing.assert_close(ours["a"], ref["a"], rtol=1e-2, atol=1e-2)


@tdfunc.tensorclass
class Linear:
    weight: torch.Tensor
    bias: torch.Tensor


def test_tensorclass_params() -> None:
    params = Linear(
        weight=torch.randn(3, 2, dtype=torch.float64), bias=torch.zeros(3, dtype=torch.float64)
    )
    grads_at = lambda i: params.apply(torch.ones_like) * (i + 1)  # noqa: E731
    opt = optim.adam(lr=0.1)
    ours, state = our_run(params, opt, 5, grads_at)
    assert isinstance(ours, Linear)
    assert state["adam", "exp_avg"].keys() == ["weight", "bias"]
    ref = torch_run(
        tdfunc.TensorDict(weight=params.weight, bias=params.bias),
        "adam",
        {"lr": 0.1},
        5,
        lambda i: tdfunc.TensorDict(weight=grads_at(i).weight, bias=grads_at(i).bias),
    )
    torch.testing.assert_close(ours.weight, ref["weight"], rtol=1e-9, atol=1e-12)


def test_memory_mapped_params_are_read_never_written(tmp_path: Any) -> None:
    """Params loaded from a store are read; the new params and state are in memory."""
    params = params_of(mlp())
    tdfunc.save(params, tmp_path / "p")
    mapped = tdfunc.load(tmp_path / "p")
    opt = optim.adamw(lr=0.1)
    state = opt.init(mapped)
    assert not any(isinstance(t, tdfunc.MemoryMappedTensor) for t in state.values(True, True))
    u, state = opt.update(random_grads(params, 0), state, mapped)
    new = optim.apply_updates(mapped, u)
    assert not any(isinstance(t, tdfunc.MemoryMappedTensor) for t in new.values(True, True))
    tdfunc.testing.assert_close(tdfunc.load(tmp_path / "p"), params, rtol=0, atol=0)
    expected = optim.apply_updates(
        params, opt.update(random_grads(params, 0), opt.init(params), params)[0]
    )
    tdfunc.testing.assert_close(new, expected)


@pytest.mark.parametrize("fmt", ["store", "safetensors"])
def test_state_saves_and_loads(tmp_path: Any, fmt: str) -> None:
    """A state saved and loaded back continues exactly like the original."""
    params = params_of(mlp())
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(lr=torch.tensor(0.01), amsgrad=True)
    )
    p, state = our_run(params, opt, 5, lambda i: random_grads(params, i))
    if fmt == "store":
        tdfunc.save(state, tmp_path / "s")
        loaded = tdfunc.load(tmp_path / "s").clone()
    else:
        tdfunc.save_safetensors(state, tmp_path / "s.safetensors")
        loaded = tdfunc.load_safetensors(tmp_path / "s.safetensors").clone()
    tdfunc.testing.assert_close(loaded, state, rtol=0, atol=0)
    assert loaded["chain", "1", "adamw", "step"].dtype == torch.int64
    g = random_grads(params, 5)
    a = opt.update(g, state, p)
    b = opt.update(g, loaded, p)
    tdfunc.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    tdfunc.testing.assert_close(a[1], b[1], rtol=0, atol=0)


def test_empty_params() -> None:
    params = tdfunc.TensorDict()
    for opt in (optim.adam(), optim.chain(optim.clip_by_global_norm(1.0), optim.sgd())):
        u, _ = opt.update(params, opt.init(params), params)
        assert list(u.keys()) == []


def test_dtensor_two_ranks_clip_reduces_across_ranks() -> None:
    """On 2 gloo ranks with sharded leaves, the global norm of clip_by_global_norm covers every
    shard: the result equals the unsharded run on every rank."""
    import _optim_workers as W

    from tdfunc.testing import launch

    results = launch(W.sharded_clip_adamw, 2, timeout=240, pg_timeout=60)
    assert [r["local_rows"] for r in results] == [3, 2]  # bias [5] split unevenly
    for r in results:
        tdfunc.testing.assert_close(
            tdfunc.TensorDict(r["dist"]), tdfunc.TensorDict(r["plain"]), rtol=1e-5, atol=1e-6
        )


def test_dtensor_leaves_one_rank() -> None:
    """Elementwise updates and global-norm clipping on DTensor leaves (a 1-rank gloo group)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        params = params_of(mlp())
        dparams = params.apply(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=0.1))
        grads = random_grads(params, 0, 5.0)
        dgrads = grads.apply(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        u, _ = opt.update(dgrads, opt.init(dparams), dparams)
        new = optim.apply_updates(dparams, u)
        assert all(isinstance(t, DTensor) for t in new.values(True, True))
        assert all(t.placements == (Shard(0),) for t in new.values(True, True))
        expected = optim.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
        tdfunc.testing.assert_close(new.apply(lambda t: t.full_tensor()), expected)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------
# weight decay on some leaves only (mask=)
# --------------------------------------------------------------------------------------
DECAY_CASES = [
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "weight_decay": 0.05}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    ("rmsprop", {"lr": 0.01, "weight_decay": 0.01}),
    ("adagrad", {"lr": 0.1, "weight_decay": 0.01}),
]


def _torch_groups_run(
    params: Any, name: str, kw: dict[str, Any], steps: int, grads_at: Callable[[int], Any]
) -> dict[str, torch.Tensor]:
    """torch.optim with two parameter groups: decay on the matrices, none on the rest."""
    ps = {k: v.detach().clone().requires_grad_(True) for k, v in flat(params).items()}
    decay = [p for p in ps.values() if p.ndim >= 2]
    rest = [p for p in ps.values() if p.ndim < 2]
    opt = TORCH[name]([{"params": decay}, {"params": rest, "weight_decay": 0.0}], **kw)
    for i in range(steps):
        g = flat(grads_at(i))
        for k, p in ps.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: v.detach() for k, v in ps.items()}


@pytest.mark.parametrize("case", DECAY_CASES, ids=case_id)
def test_decay_mask_matches_torch_param_groups(case: tuple[str, dict[str, Any]]) -> None:
    """The most common setup, no decay on biases and norms: one optimizer, one state."""
    name, kw = case
    params = params_of(gpt2())
    grads_at = lambda i: random_grads(params, i)  # noqa: E731
    ref = _torch_groups_run(params, name, kw, 20, grads_at)
    opt = make(name, kw, mask=lambda path, p: p.ndim >= 2)
    before = params.clone()
    ours, state = our_run(params, opt, 20, grads_at)
    assert_matches(ours, ref, rtol=1e-9, atol=1e-12)
    tdfunc.testing.assert_close(params, before, rtol=0, atol=0)  # the input is not modified
    assert int(state[name, "step"]) == 20
    # a pattern list gives the same selection
    names = [k for k, v in flat(params).items() if v.ndim >= 2]
    same, _ = our_run(params, make(name, kw, mask=names), 20, grads_at)
    tdfunc.testing.assert_close(same, ours, rtol=0, atol=0)


def test_adamw_mask_compiled_matches_eager_without_recompile() -> None:
    params = params_of(mlp(torch.float32))
    opt = optim.adamw(lr=0.01, weight_decay=0.1, mask="*.weight")
    grads_at = lambda i: random_grads(params, i, 0.5)  # noqa: E731
    eager, _ = our_run(params, opt, 3, grads_at)
    cnt = CompileCounterWithBackend("aot_eager")
    compiled, _ = our_run(
        params, opt, 3, grads_at, step_fn=lambda f: torch.compile(f, backend=cnt, fullgraph=True)
    )
    tdfunc.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    assert cnt.frame_count == 1


@pytest.mark.parametrize(
    ("make_opt", "what"),
    [
        (lambda: optim.adamw(mask="*.bais"), "adamw.init"),
        (lambda: optim.adamw(mask=["*.weight", "*.bais"]), "adamw.init"),
        (lambda: optim.masked(optim.adamw(), "*.bais"), "masked.init"),
    ],
    ids=["adamw-pattern", "adamw-list", "masked"],
)
def test_a_pattern_that_matches_nothing_is_an_error(
    make_opt: Callable[[], optim.GradientTransformation], what: str
) -> None:
    """A typo used to switch the decay off for the whole model without a word."""
    params = tdfunc.TensorDict(layer={"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    with pytest.raises(KeyError) as e:
        make_opt().init(params)
    assert e.value.args[0] == E.MASK_NO_MATCH.format(
        what=what, pattern="*.bais", nearest="layer.bias"
    )


def test_multi_transform_pattern_that_labels_nothing_is_an_error() -> None:
    """A typo in a label pattern used to send every leaf to the catch-all (often frozen)."""
    params = tdfunc.TensorDict(layer={"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    opts = {"train": optim.sgd(lr=1.0), "frozen": optim.set_to_zero()}
    typo = optim.multi_transform(opts, {"*.bais": "train", "*": "frozen"})
    with pytest.raises(KeyError) as e:
        typo.init(params)
    assert e.value.args[0] == E.MASK_NO_MATCH.format(
        what="multi_transform.init", pattern="*.bais", nearest="layer.bias"
    )
    # a pattern whose every leaf an earlier pattern took is as silent as a typo
    shadowed = optim.multi_transform(opts, {"*": "frozen", "*.bias": "train"})
    with pytest.raises(KeyError) as e:
        shadowed.init(params)
    assert e.value.args[0] == E.LABEL_SHADOWED.format(
        what="multi_transform.init", pattern="*.bias", earlier="*"
    )
    # at update too (grads of another model), and the input is left as it was
    good = optim.multi_transform(opts, {"*.bias": "train", "*": "frozen"})
    state = good.init(params)
    other = tdfunc.TensorDict(head={"weight": torch.ones(2, 2)})
    with pytest.raises(KeyError) as e:
        good.update(other, state, other)
    assert e.value.args[0].startswith("multi_transform.update: the key pattern '*.bias'")
    u, _ = good.update(params, state, params)
    assert u["layer", "bias"].tolist() == [-1.0, -1.0]
    assert u["layer", "weight"].eq(0).all()
    assert params["layer", "bias"].tolist() == [1.0, 1.0]


def test_a_pattern_that_matches_nothing_at_update_is_an_error() -> None:
    params = tdfunc.TensorDict(layer={"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    opt = optim.masked(optim.sgd(lr=0.1), "layer.*")
    state = opt.init(params)
    other = tdfunc.TensorDict(head={"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    with pytest.raises(KeyError) as e:
        opt.update(other, state, other)
    assert e.value.args[0].startswith("masked.update: the key pattern 'layer.*' matches no leaf")


def test_a_mask_that_selects_nothing_is_an_error() -> None:
    params = tdfunc.TensorDict(w=torch.ones(2, 2), b=torch.ones(2))
    with pytest.raises(KeyError) as e:
        optim.adamw(mask=lambda path, p: p.ndim > 5).init(params)
    assert e.value.args[0] == E.MASK_SELECTS_NOTHING.format(what="adamw.init", keys=["w", "b"])
    none = tdfunc.TensorDict(w=torch.tensor(False), b=torch.tensor(False))
    with pytest.raises(KeyError, match="selects no leaf"):
        optim.masked(optim.sgd(lr=0.1), none).init(params)


def test_schedule_times_a_run_time_rate():
    """The recipe for a schedule combined with run-time (or per-member) rate changes: a
    tensor lr in the optimizer, the schedule as a scale of its updates."""
    sched = optim.cosine_decay(1.0, 10)
    params = tdfunc.TensorDict(w=torch.ones(3, dtype=torch.float64))
    grads = tdfunc.TensorDict(w=torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    opt = optim.chain(
        optim.sgd(lr=torch.tensor(0.1, dtype=torch.float64)), optim.scale_by_schedule(sched)
    )
    state = opt.init(params)
    for count in range(5):
        if count == 3:
            state = optim.set_hyperparams(state, lr=0.05)
        lr = 0.1 if count < 3 else 0.05
        updates, state = opt.update(grads, state, params)
        expected = -lr * float(sched(torch.tensor(count))) * grads["w"]
        torch.testing.assert_close(updates["w"], expected, rtol=1e-12, atol=1e-15)
    with pytest.raises(KeyError, match="scale_by_schedule"):
        optim.set_hyperparams(optim.sgd(lr=sched).init(params), lr=0.1)


def test_help_on_hyper_describes_hyperparameters():
    import pydoc

    text = pydoc.render_doc(optim.Hyper, renderer=pydoc.plaintext)
    assert "A hyperparameter of an optimizer" in text
    assert "set_hyperparams" in text
