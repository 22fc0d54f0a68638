"""Parameters as containers, side by side: ``tdfunc.nn`` against tensordict's ``to_module`` way
and raw ``torch.func`` on plain dicts.

Model: the MLP 3 -> 64 -> 64 -> 4 (ReLU) of the reference measurements, seeded, so every
contender computes with the same weights and the harness can check that they return the same
leaves. Workloads (each in eager and compiled mode, ``fullgraph=True``):

* ``fcall_forward``: the MLP called with a parameter container in place of its own weights, on
  a ``[64, 3]`` batch.
* ``fcall_forward_backward``: ``torch.func.grad`` of the mean squared error w.r.t. the
  parameters (forward + backward), returning the gradients in the parameters' container.
* ``vmap_ensemble``: 8 members with stacked parameters (batch ``[8]``), ``torch.vmap`` over the
  members on one shared ``[256, 3]`` input, no gradients.
* ``per_sample_grads``: ``torch.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))`` over a
  batch of 64 examples: one gradient container per example.

Contenders:

* ``tdfunc``: :func:`tdfunc.nn.from_module` / :func:`tdfunc.nn.stack_modules` TensorDicts and
  :func:`tdfunc.nn.functional_call` (no module state is touched).
* ``tensordict``: ``TensorDict.from_module`` / ``TensorDict.from_modules(as_module=True)`` and
  ``with params.to_module(module, preserve_module_state=False): module(x)`` (the form that
  compiles under ``torch.func.grad``; it swaps the module's attributes for the call).
* ``torch_func``: raw ``torch.func.functional_call`` on a flat ``dict`` of tensors, and
  ``torch.func.stack_module_state`` for the ensemble.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tdfunc.nn as tnn

CATEGORY = "nn"
CONTENDERS_HERE = ("tdfunc", "tensordict", "torch_func")
MEMBERS = 8


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _tensordict() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed")


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, generator=g), torch.randn(n, 4, generator=g)


def _new_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Seeded replacement weights (the same for every contender)."""
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in model.state_dict().items()}


def _params(contender: str, model: nn.Module) -> Any:
    """The model's parameters with new values, as the contender's container."""
    flat = _new_values(model)
    if contender == "tdfunc":
        return tnn.from_module(model).named_apply(lambda k, t: flat[".".join(k)])
    if contender == "tensordict":
        td = _tensordict().TensorDict.from_module(model)
        return td.detach().clone().flatten_keys(".").update(flat).unflatten_keys(".")
    return flat


def _caller(contender: str, model: nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``(params, x) -> model(x)`` with ``params`` in place of the model's weights."""
    if contender == "tdfunc":

        def call(p: Any, x: torch.Tensor) -> torch.Tensor:
            return tnn.functional_call(model, p, (x,))

    elif contender == "tensordict":

        def call(p: Any, x: torch.Tensor) -> torch.Tensor:
            with p.to_module(model, preserve_module_state=False):
                return model(x)

    else:

        def call(p: Any, x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, p, (x,))

    return call


def _loss(call: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((call(p, x) - y) ** 2).mean()

    return loss


def _per_example_loss(call: Callable[[Any, torch.Tensor], torch.Tensor]) -> Callable[..., Any]:
    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((call(p, x.unsqueeze(0)) - y.unsqueeze(0)) ** 2).mean()

    return loss


# ----------------------------------------------------------------------------- workloads
WORKLOADS = {
    "fcall_forward": "MLP 3-64-64-4 called with swapped-in parameters on a [64, 3] batch",
    "fcall_forward_backward": "torch.func.grad of the MSE w.r.t. the parameters ([64, 3] batch)",
    "per_sample_grads": "vmap(grad(loss), in_dims=(None, 0, 0)) over 64 examples",
}


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_functional_call(
    measure: Callable[..., Any], workload: str, mode: str, contender: str
) -> None:
    """Functional calls of one MLP: see WORKLOADS[workload] and the module docstring."""
    if contender == "tensordict":
        _tensordict()
    model = mlp()
    params = _params(contender, model)
    call = _caller(contender, model)
    if workload == "fcall_forward":
        fn: Callable[..., Any] = call

        def make_args(n: int) -> tuple[Any, ...]:
            return params, _data(n)[0]

    else:
        if workload == "fcall_forward_backward":
            fn = torch.func.grad(_loss(call))
        else:
            fn = torch.vmap(torch.func.grad(_per_example_loss(call)), in_dims=(None, 0, 0))

        def make_args(n: int) -> tuple[Any, ...]:
            return (params, *_data(n))

    def run(*args: Any) -> Any:
        return fn(*args)

    measure(
        run,
        *make_args(64),
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=make_args,
        doc=WORKLOADS[workload],
    )


def _ensemble(contender: str) -> tuple[Callable[..., Any], Any]:
    members = [mlp(seed=i) for i in range(MEMBERS)]
    base = copy.deepcopy(members[0]).to("meta")  # structure only
    if contender == "tdfunc":
        stacked: Any = tnn.stack_modules(members).detach()
    elif contender == "tensordict":
        stacked = _tensordict().TensorDict.from_modules(*members, as_module=True).detach()
    else:
        ps, bs = torch.func.stack_module_state(members)
        stacked = {k: v.detach() for k, v in {**ps, **bs}.items()}
    call = _caller(contender, base)
    return torch.vmap(call, in_dims=(0, None)), stacked


@pytest.mark.bench_representative
@pytest.mark.parametrize("contender", CONTENDERS_HERE)
def test_vmap_ensemble(measure: Callable[..., Any], mode: str, contender: str) -> None:
    """vmap ensemble: 8 stacked MLPs 3-64-64-4 on one shared [256, 3] input, no gradients."""
    if contender == "tensordict":
        _tensordict()
    ensemble, stacked = _ensemble(contender)

    def run(p: Any, x: torch.Tensor) -> torch.Tensor:
        return ensemble(p, x)

    def make_args(n: int) -> tuple[Any, ...]:
        return stacked, _data(n)[0]

    measure(
        run,
        *make_args(256),
        workload="vmap_ensemble",
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=make_args,
        members=MEMBERS,
    )


# ----------------------------------------------------------------------------- module state
def resnet_style(seed: int = 0) -> nn.Module:
    """Two residual conv + batch-norm blocks and a linear head, in training mode."""

    class Block(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(h)))

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        Block(16),
        Block(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).train()


@pytest.mark.parametrize("contender", ["tdfunc", "torch_func"])
def test_train_mode_forward(measure: Callable[..., Any], mode: str, contender: str) -> None:
    """ResNet-style forward in train mode ([8, 3, 16, 16]): output and new batch-norm state.

    ``tdfunc``: ``functional_call(..., return_state=True)`` (the state is never written; only
    the running statistics come back as new tensors). ``torch_func``: plain
    ``torch.func.functional_call`` on a dict, which updates the statistics in place in it.
    """
    model = resnet_style()
    if contender == "tdfunc":
        state: Any = tnn.from_module(model).detach()

        def run(s: Any, x: torch.Tensor) -> Any:
            return tnn.functional_call(model, s, (x,), return_state=True)

    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def run(s: Any, x: torch.Tensor) -> Any:
            return torch.func.functional_call(model, s, (x,)), s

    def make_args(n: int) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(n)
        return state, torch.randn(n, 3, 16, 16, generator=g)

    measure(
        run,
        *make_args(8),
        workload="train_mode_forward",
        mode=mode,
        contender=contender,
        category=CATEGORY,
        doc="ResNet-style conv+BN net in train mode: output and updated running statistics",
    )
