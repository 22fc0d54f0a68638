"""Parameters as containers, side by side: ``tdfunc.nn`` against tensordict's ``to_module`` way
and raw ``torch.func`` on plain dicts.

Model: the MLP 3 -> 64 -> 64 -> 4 (ReLU) of the reference measurements, seeded, so every
contender computes with the same weights and the harness can check that they return the same
leaves. Workloads (each in eager and compiled mode, ``fullgraph=True``):

* ``fcall_forward``: the MLP called with a parameter container in place of its own weights, on
  a ``[64, 3]`` batch.
* ``fcall_forward_backward``: ``torch.func.grad`` of the mean squared error w.r.t. the
  parameters (forward + backward), returning the gradients in the parameters' container.

The ensemble, per-sample gradient and training-step workloads are end-to-end workloads in
``test_bench_workloads.py`` (with a hand-written floor).

Contenders:

* ``tdfunc``: :func:`tdfunc.from_module` TensorDicts and :func:`tdfunc.functional_call` (no
  module state is touched).
* ``tensordict``: ``TensorDict.from_module`` and
  ``with params.to_module(module, preserve_module_state=False): module(x)`` (the form that
  compiles under ``torch.func.grad``; it swaps the module's attributes for the call).
* ``torch_func``: raw ``torch.func.functional_call`` on a flat ``dict`` of tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tdfunc

CATEGORY = "nn"
CONTENDERS_HERE = ("tdfunc", "tensordict", "torch_func")


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
        return tdfunc.from_module(model).named_apply(lambda k, t: flat[".".join(k)])
    if contender == "tensordict":
        td = _tensordict().TensorDict.from_module(model)
        return td.detach().clone().flatten_keys(".").update(flat).unflatten_keys(".")
    return flat


def _caller(contender: str, model: nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """``(params, x) -> model(x)`` with ``params`` in place of the model's weights."""
    if contender == "tdfunc":

        def call(p: Any, x: torch.Tensor) -> torch.Tensor:
            return tdfunc.functional_call(model, p, (x,))

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


# ----------------------------------------------------------------------------- workloads
WORKLOADS = {
    "fcall_forward": "MLP 3-64-64-4 called with swapped-in parameters on a [64, 3] batch",
    "fcall_forward_backward": "torch.func.grad of the MSE w.r.t. the parameters ([64, 3] batch)",
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
        fn = torch.func.grad(_loss(call))

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
        state: Any = tdfunc.from_module(model).detach()

        def run(s: Any, x: torch.Tensor) -> Any:
            return tdfunc.functional_call(model, s, (x,), return_state=True)

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
