"""End-to-end workloads users run, side by side: tdfunc, tensordict, plain torch.func on dicts
and a hand-written floor.

Every workload is a pure function of its inputs (parameters, data) and returns new values; it
runs eagerly and under ``torch.compile(fullgraph=True)``. Models are seeded, so every contender
computes with the same weights and the harness checks that they return the same leaves.

Workloads:

* ``train_step_mlp`` / ``train_step_conv``: ``torch.func.grad_and_value`` of the MSE /
  cross-entropy through a functional call, then the SGD update as container arithmetic
  (``params - lr * grads``); returns the new parameters and the loss. MLP 3-64-64-4 on a
  ``[64, 3]`` batch; conv net (two 3x3 convs, 8 and 16 channels, pooling, linear head) on
  ``[32, 3, 16, 16]``.
* ``ensemble_forward`` / ``ensemble_forward_backward``: 8 stacked MLPs 3-64-64-4, ``torch.vmap``
  over the members on one shared ``[256, 3]`` input; the second takes ``torch.func.grad`` of the
  ensemble's MSE w.r.t. the stacked parameters.
* ``per_sample_grads``: ``vmap(grad(loss), in_dims=(None, 0, 0))`` of the MLP over 64 examples.
* ``rl_gae_ppo``: a rollout ``[T=128, B=16]`` (``obs``, ``action``, ``reward``, ``done``,
  ``("next", "obs")``, ``log_prob``); values of ``obs`` and ``("next", "obs")`` from the critic
  head, generalised advantage estimation as a reverse scan over T, then ``grad_and_value`` of a
  PPO clipped loss (policy + value + entropy) and the SGD update.

Contenders:

* ``tdfunc``: :func:`tdfunc.from_module` / :func:`tdfunc.stack_modules` parameters,
  :func:`tdfunc.functional_call`, TensorDict arithmetic for the update; the rollout is a
  TensorDict and GAE is :func:`tdfunc.scan` over it.
* ``tensordict``: ``TensorDict.from_module`` / ``from_modules`` and
  ``params.to_module(module, preserve_module_state=False)`` around the call (the form that works
  under ``torch.func`` transforms); the rollout is a tensordict ``TensorDict``; its GAE runs
  torch's ``scan`` over the rollout's tensors (``scan`` does not accept tensordict's class).
* ``torch_func``: ``torch.func.functional_call`` on a flat ``dict`` of tensors
  (``torch.func.stack_module_state`` for the ensemble), a dict comprehension for the update,
  plain tensors and torch's ``scan`` for the rollout.
* ``floor``: the same model written by hand with ``torch.nn.functional`` on a tuple of tensors
  (no module, no functional call) and ``torch._foreach_add`` for the update (not for the RL
  workload, whose plain-tensor version is ``torch_func``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._higher_order_ops.scan import scan as torch_scan

import tdfunc

CATEGORY = "workloads"
CONTENDERS_HERE = ("tdfunc", "tensordict", "torch_func", "floor")
#: Compiled only in the representative workload (``conftest.py``): compiled, the hand-written
#: floor and ``torch_func`` (the compiled target's comparator) trace to the same graph; the
#: floor's eager row is the one that differs.
COMPILED_IF_REPRESENTATIVE = ("floor",)
MEMBERS = 8
LR = 0.05
GAMMA, LAMBDA, CLIP = 0.99, 0.95, 0.2
T, B, OBS, ACTIONS, HIDDEN = 128, 16, 12, 4, 32

Params = Any


def _tensordict() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed")


# ----------------------------------------------------------------------------- models
def mlp(seed: int = 0) -> nn.Sequential:
    """MLP 3 -> 64 -> 64 -> 4 (ReLU), seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def convnet(seed: int = 0) -> nn.Sequential:
    """Two 3x3 convs (8 and 16 channels, the second with stride 2), pooling, linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def policy(seed: int = 0) -> nn.Sequential:
    """Actor-critic MLP OBS -> 32 -> 32 -> ACTIONS + 1 (logits and value)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(OBS, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, ACTIONS + 1),
    )


def mlp_floor(p: tuple[Tensor, ...], x: Tensor) -> Tensor:
    """:func:`mlp` by hand on its parameters in module order."""
    h = torch.relu(F.linear(x, p[0], p[1]))
    h = torch.relu(F.linear(h, p[2], p[3]))
    return F.linear(h, p[4], p[5])


def conv_floor(p: tuple[Tensor, ...], x: Tensor) -> Tensor:
    """:func:`convnet` by hand on its parameters in module order."""
    h = torch.relu(F.conv2d(x, p[0], p[1], padding=1))
    h = torch.relu(F.conv2d(h, p[2], p[3], stride=2, padding=1))
    return F.linear(h.mean((2, 3)), p[4], p[5])


def policy_floor(p: tuple[Tensor, ...], x: Tensor) -> Tensor:
    """:func:`policy` by hand on its parameters in module order."""
    h = torch.tanh(F.linear(x, p[0], p[1]))
    h = torch.tanh(F.linear(h, p[2], p[3]))
    return F.linear(h, p[4], p[5])


FLOORS: dict[str, Callable[[tuple[Tensor, ...], Tensor], Tensor]] = {
    "mlp": mlp_floor,
    "conv": conv_floor,
    "policy": policy_floor,
}
MODELS: dict[str, Callable[[int], nn.Module]] = {"mlp": mlp, "conv": convnet, "policy": policy}


def params_of(contender: str, model: nn.Module) -> Params:
    """The model's parameters (detached copies) as the contender's container."""
    if contender == "tdfunc":
        return tdfunc.from_module(model).detach()
    if contender == "tensordict":
        return _tensordict().TensorDict.from_module(model).detach().clone()
    if contender == "torch_func":
        return {k: v.detach().clone() for k, v in model.named_parameters()}
    return tuple(v.detach().clone() for v in model.parameters())


def caller(contender: str, model: nn.Module, kind: str) -> Callable[[Params, Tensor], Tensor]:
    """``(params, x) -> model(x)`` with ``params`` in place of the model's weights."""
    if contender == "tdfunc":

        def call(p: Params, x: Tensor) -> Tensor:
            return tdfunc.functional_call(model, p, (x,))

    elif contender == "tensordict":

        def call(p: Params, x: Tensor) -> Tensor:
            with p.to_module(model, preserve_module_state=False):
                return model(x)

    elif contender == "torch_func":

        def call(p: Params, x: Tensor) -> Tensor:
            return torch.func.functional_call(model, p, (x,))

    else:
        call = FLOORS[kind]
    return call


def sgd(contender: str, params: Params, grads: Params) -> Params:
    """``params - LR * grads`` in the contender's idiom."""
    if contender in ("tdfunc", "tensordict"):
        return params - LR * grads
    if contender == "torch_func":
        return {k: v - LR * grads[k] for k, v in params.items()}
    return tuple(torch._foreach_add(list(params), list(grads), alpha=-LR))


def _data(
    shape: tuple[int, ...], classes: int | None, out: int, seed: int
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if classes is not None:
        return x, torch.randint(0, classes, (shape[0],), generator=g)
    return x, torch.randn(shape[0], out, generator=g)


# ----------------------------------------------------------------------------- training step
TRAIN = {
    "train_step_mlp": ("mlp", (64, 3)),
    "train_step_conv": ("conv", (32, 3, 16, 16)),
}


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
@pytest.mark.parametrize("workload", list(TRAIN))
def test_train_step(
    measure: Callable[..., Any], bench_quick: bool, workload: str, mode: str, contender: str
) -> None:
    """Training step: grad_and_value of the loss through a functional call, then SGD update."""
    if contender == "tensordict":
        _tensordict()
    kind, shape = TRAIN[workload]
    model = MODELS[kind](0)
    params = params_of(contender, model)
    call = caller(contender, model, kind)
    conv = kind == "conv"

    def loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        out = call(p, x)
        return F.cross_entropy(out, y) if conv else ((out - y) ** 2).mean()

    grad_and_value = torch.func.grad_and_value(loss)

    def step(p: Params, x: Tensor, y: Tensor) -> tuple[Params, Tensor]:
        grads, value = grad_and_value(p, x, y)
        return sgd(contender, p, grads), value

    def make_args(n: int) -> tuple[Any, ...]:
        return (params, *_data((n, *shape[1:]), 10 if conv else None, 4, seed=n))

    measure(
        step,
        *make_args(shape[0]),
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=None if bench_quick else make_args,  # the probe retraces: full runs only
        doc=f"grad_and_value + SGD update, {kind} on {list(shape)}",
    )


# ----------------------------------------------------------------------------- ensembles
def _stacked(contender: str) -> Params:
    members = [mlp(seed=i) for i in range(MEMBERS)]
    if contender == "tdfunc":
        return tdfunc.stack_modules(members).detach()
    if contender == "tensordict":
        return _tensordict().TensorDict.from_modules(*members, as_module=True).detach()
    ps, _ = torch.func.stack_module_state(members)
    if contender == "torch_func":
        return {k: v.detach() for k, v in ps.items()}
    return tuple(v.detach() for v in ps.values())


ENSEMBLE = {
    "ensemble_forward": "vmap over 8 stacked MLPs 3-64-64-4 on one shared [256, 3] input",
    "ensemble_forward_backward": "grad of the MSE of the vmapped 8-MLP ensemble ([256, 3] input)",
}


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
@pytest.mark.parametrize(
    "workload",
    [
        # compiled for every contender even in quick mode (the CI smoke test)
        pytest.param("ensemble_forward", marks=pytest.mark.bench_representative),
        "ensemble_forward_backward",
    ],
)
def test_ensemble(
    measure: Callable[..., Any], bench_quick: bool, workload: str, mode: str, contender: str
) -> None:
    """vmap ensemble of 8 MLPs: forward, or forward + backward (see ENSEMBLE[workload])."""
    if contender == "tensordict":
        _tensordict()
    stacked = _stacked(contender)
    base = copy.deepcopy(mlp()).to("meta")  # structure only
    ensemble = torch.vmap(caller(contender, base, "mlp"), in_dims=(0, None))
    if workload == "ensemble_forward":

        def fn(p: Params, x: Tensor, y: Tensor) -> Any:
            return ensemble(p, x)

    else:

        def loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
            return ((ensemble(p, x) - y) ** 2).mean()

        fn = torch.func.grad(loss)

    def make_args(n: int) -> tuple[Any, ...]:
        return (stacked, *_data((n, 3), None, 4, seed=n))

    measure(
        fn,
        *make_args(256),
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=None if bench_quick else make_args,  # the probe retraces: full runs only
        doc=ENSEMBLE[workload],
        members=MEMBERS,
    )


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
def test_per_sample_grads(
    measure: Callable[..., Any], bench_quick: bool, mode: str, contender: str
) -> None:
    """Per-sample gradients: vmap(grad(loss), in_dims=(None, 0, 0)) of the MLP over 64 examples."""
    if contender == "tensordict":
        _tensordict()
    model = mlp()
    params = params_of(contender, model)
    call = caller(contender, model, "mlp")

    def loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        return ((call(p, x.unsqueeze(0)) - y.unsqueeze(0)) ** 2).mean()

    fn = torch.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))

    def make_args(n: int) -> tuple[Any, ...]:
        return (params, *_data((n, 3), None, 4, seed=n))

    measure(
        fn,
        *make_args(64),
        workload="per_sample_grads",
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=None if bench_quick else make_args,  # the probe retraces: full runs only
    )


# ----------------------------------------------------------------------------- RL update
def rollout_tensors(steps: int = T) -> dict[str, Tensor]:
    """A seeded rollout ``[steps, B]``: observations, actions, rewards, dones, log-probs."""
    g = torch.Generator().manual_seed(steps)
    obs = torch.randn(steps + 1, B, OBS, generator=g)
    return {
        "obs": obs[:-1].clone(),
        "next_obs": obs[1:].clone(),
        "action": torch.randint(0, ACTIONS, (steps, B), generator=g),
        "reward": torch.randn(steps, B, generator=g),
        "done": torch.rand(steps, B, generator=g) < 0.05,
        "log_prob": torch.full((steps, B), -1.4),
    }


def _rollout(contender: str, steps: int = T) -> Any:
    r = rollout_tensors(steps)
    nested = {k: v for k, v in r.items() if k != "next_obs"} | {"next": {"obs": r["next_obs"]}}
    if contender == "tdfunc":
        return tdfunc.TensorDict(nested, batch_size=[steps, B])
    if contender == "tensordict":
        return _tensordict().TensorDict(nested, batch_size=[steps, B])
    return nested


def _gae_step(gae: Tensor, x: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    delta, notdone = x
    gae = delta + GAMMA * LAMBDA * notdone * gae
    return gae, gae.clone()


def _td_gae_step(carry: Any, x: Any) -> tuple[Any, Any]:
    gae = x["delta"] + GAMMA * LAMBDA * x["notdone"] * carry["gae"]
    out = tdfunc.TensorDict(gae=gae, batch_size=gae.shape)
    return out, out


def ppo_terms(out: Tensor, action: Tensor, old_logp: Tensor, adv: Tensor, ret: Tensor) -> Tensor:
    """The PPO clipped loss (policy + 0.5 value - 0.01 entropy) from the network output."""
    logits, value = out[..., :ACTIONS], out[..., ACTIONS]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, action.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old_logp)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return -surrogate.mean() + 0.5 * ((value - ret) ** 2).mean() - 0.01 * entropy.mean()


def rl_update(contender: str, model: nn.Module) -> Callable[[Params, Any], Any]:
    """``(params, rollout) -> (new_params, loss, advantages)`` for one contender."""
    call = caller(contender, model, "policy")

    def values(
        p: Params, obs: Tensor, next_obs: Tensor, done: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        v = call(p, obs)[..., ACTIONS].detach()
        nv = call(p, next_obs)[..., ACTIONS].detach()
        notdone = (~done).to(v.dtype)
        return v, nv, notdone

    if contender == "tdfunc":

        def loss(p: Params, td: Any) -> Tensor:
            out = call(p, td["obs"])
            return ppo_terms(out, td["action"], td["log_prob"], td["advantage"], td["return"])

        def update(p: Params, td: Any) -> Any:
            v, nv, notdone = values(p, td["obs"], td["next", "obs"], td["done"])
            steps = tdfunc.TensorDict(
                delta=td["reward"] + GAMMA * nv * notdone - v,
                notdone=notdone,
                batch_size=td.batch_size,
            )
            init = tdfunc.TensorDict(gae=torch.zeros_like(v[0]), batch_size=v.shape[1:])
            _, adv = tdfunc.scan(_td_gae_step, init, steps, reverse=True)
            td = td.update({"advantage": adv["gae"], "return": adv["gae"] + v})
            grads, value = torch.func.grad_and_value(loss)(p, td)
            return p - LR * grads, value, td["advantage"]

        return update

    if contender == "tensordict":

        def loss(p: Params, td: Any) -> Tensor:
            out = call(p, td["obs"])
            return ppo_terms(out, td["action"], td["log_prob"], td["advantage"], td["return"])

        def update(p: Params, td: Any) -> Any:
            v, nv, notdone = values(p, td["obs"], td["next", "obs"], td["done"])
            delta = td["reward"] + GAMMA * nv * notdone - v
            _, adv = torch_scan(_gae_step, torch.zeros_like(v[0]), (delta, notdone), reverse=True)
            td = td.copy().update({"advantage": adv, "return": adv + v})  # not the input
            grads, value = torch.func.grad_and_value(loss)(p, td)
            return p - LR * grads, value, td["advantage"]

        return update

    def loss_plain(p: Params, d: dict[str, Any]) -> Tensor:
        out = call(p, d["obs"])
        return ppo_terms(out, d["action"], d["log_prob"], d["advantage"], d["return"])

    def update_plain(p: Params, d: dict[str, Any]) -> Any:
        v, nv, notdone = values(p, d["obs"], d["next"]["obs"], d["done"])
        delta = d["reward"] + GAMMA * nv * notdone - v
        _, adv = torch_scan(_gae_step, torch.zeros_like(v[0]), (delta, notdone), reverse=True)
        d = {**d, "advantage": adv, "return": adv + v}
        grads, value = torch.func.grad_and_value(loss_plain)(p, d)
        return sgd(contender, p, grads), value, adv

    return update_plain


@pytest.mark.parametrize("contender", ["tdfunc", "tensordict", "torch_func"])
def test_rl_gae_ppo(measure: Callable[..., Any], mode: str, contender: str) -> None:
    """RL update: GAE as a reverse scan over a [128, 16] rollout, then a PPO loss and SGD step."""
    if contender == "tensordict":
        _tensordict()
    model = policy()
    params = params_of(contender, model)
    update = rl_update(contender, model)
    measure(
        update,
        params,
        _rollout(contender),
        workload="rl_gae_ppo",
        mode=mode,
        contender=contender,
        category=CATEGORY,
        doc="GAE reverse scan over a [T=128, B=16] rollout + PPO clipped loss + SGD update",
    )
