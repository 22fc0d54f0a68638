"""Key-routed modules, side by side: ``tdfunc.nn`` against ``tensordict.nn`` and a plain module.

The workloads are those of tensordict's own suite (``benchmarks/compile/tensordict_nn_test.py``):
a module adding one, a wrapped MLP, MLP forward + backward, and the same three as a sequence of
key-routed modules. Contenders:

* ``tdfunc``: :class:`tdfunc.nn.TensorDictModule` / :class:`tdfunc.nn.TensorDictSequential`
  (each call returns a new TensorDict; the sequences use ``selected_out_keys`` to drop the
  intermediate ``"hidden"`` entry).
* ``tensordict``: ``tensordict.nn.TensorDictModule`` / ``TensorDictSequential`` exactly as in
  its suite (writes into its input; the sequences copy the input first and delete
  ``"hidden"`` last).
* ``floor``: the same ``nn.Module`` called on the tensor itself (no container at all).

All contenders share the same weights (seeded), so the harness can check that the TensorDict
contenders return the same leaves; the floor returns only the module output (``compare=False``).
The forward + backward workloads compile the forward only (``fullgraph=True``) and run the
backward eagerly, as tensordict's suite does, so they are timed here by hand.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tdfunc import TensorDict
from tdfunc.nn import TensorDictModule, TensorDictSequential

CATEGORY = "keyrouted"
CONTENDERS_HERE = ("tdfunc", "tensordict", "floor")
OUT = ("c", "d")


class AddOne(nn.Module):
    """``x + 1`` as a module (the floor of the add workloads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def mlp(depth: int = 2, num_cells: int = 32, feature_dim: int = 3) -> nn.Sequential:
    """The MLP of tensordict's suite: Linear+ReLU, ``depth`` x (Linear+ReLU), Linear to 4."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(feature_dim, num_cells),
        nn.ReLU(),
        *[nn.Sequential(nn.Linear(num_cells, num_cells), nn.ReLU()) for _ in range(depth)],
        nn.Linear(num_cells, 4),
    )


def _tensordict() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed")


# ----------------------------------------------------------------------------- inputs
def _td(contender: str, a: torch.Tensor) -> Any:
    if contender == "tdfunc":
        return TensorDict(a=a)
    if contender == "tensordict":
        return _tensordict().TensorDict({"a": a})
    return a


def _input(workload: str, n: int = 32) -> torch.Tensor:
    return (
        torch.zeros(())
        if workload.endswith("add")
        else torch.randn(n, 3, generator=torch.Generator().manual_seed(n))
    )


# ----------------------------------------------------------------------------- modules
def _layers(workload: str, net: nn.Sequential | None) -> list[Callable[..., Any]]:
    return [add_one, add_one] if net is None else list(net)


def _sequence(contender: str, layers: list[Callable[..., Any]]) -> Callable[[Any], Any]:
    """Each layer as a key-routed module: ``a -> hidden -> ... -> hidden -> ("c", "d")``."""
    last = len(layers) - 1
    keys = [
        ("a" if i == 0 else "hidden", OUT if i == last else "hidden") for i in range(len(layers))
    ]
    if contender == "tdfunc":
        mods = [TensorDictModule(m, [i], [o]) for m, (i, o) in zip(layers, keys)]
        return TensorDictSequential(*mods, selected_out_keys=[OUT])
    tdn = pytest.importorskip("tensordict.nn")

    def delhidden(td: Any) -> Any:
        del td["hidden"]
        return td

    mods = [tdn.TensorDictModule(m, in_keys=[i], out_keys=[o]) for m, (i, o) in zip(layers, keys)]
    return tdn.TensorDictSequential(lambda td: td.copy(), *mods, delhidden)


def build_module(workload: str, contender: str, net: nn.Sequential | None) -> Callable[[Any], Any]:
    """The callable of one contender: a key-routed module, a sequence, or the plain module."""
    if contender == "floor":
        if net is None:
            return AddOne() if workload.startswith("mod") else nn.Sequential(AddOne(), AddOne())
        return net
    if workload.startswith("seq"):
        return _sequence(contender, _layers(workload, net))
    body: Callable[..., Any] = add_one if net is None else net
    if contender == "tdfunc":
        return TensorDictModule(body, in_keys=["a"], out_keys=[OUT])
    tdn = pytest.importorskip("tensordict.nn")
    return tdn.TensorDictModule(body, in_keys=["a"], out_keys=[OUT])


# ----------------------------------------------------------------------------- forward
FORWARD = {
    "mod_add": "TensorDictModule(x + 1) on a scalar entry, written under ('c', 'd')",
    "mod_wrap": "TensorDictModule(MLP depth 2, 32 cells) on a [32, 3] entry",
    "seq_add": "a sequence of two key-routed x + 1 modules (a -> hidden -> ('c', 'd'))",
    "seq_wrap": "each layer of the depth-2 MLP as a key-routed module, in a sequence",
}


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
@pytest.mark.parametrize("workload", list(FORWARD))
def test_keyrouted_forward(
    measure: Callable[..., Any], workload: str, mode: str, contender: str
) -> None:
    """Key-routed forward (tensordict's nn workloads): see FORWARD[workload]."""
    if contender == "tensordict":
        _tensordict()
    net = None if workload.endswith("add") else mlp()
    module = build_module(workload, contender, net)

    def call(x: Any) -> Any:
        return module(x)

    make_args = None
    if not workload.endswith("add"):

        def make_args(n: int) -> tuple[Any, ...]:
            return (_td(contender, _input(workload, n)),)

    measure(
        call,
        _td(contender, _input(workload)),
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=make_args,
        compare=contender != "floor",
        doc=FORWARD[workload],
    )


# ----------------------------------------------------------------------------- forward + backward
BACKWARD = {
    "mod_wrap_and_backward": "TensorDictModule(MLP depth 5, 1024 cells): forward, then mean().backward()",
    "seq_wrap_and_backward": "the depth-5, 1024-cell MLP layer by layer as a sequence: forward + backward",
}

_COMPILED: dict[tuple[str, str, str], tuple[Callable[..., Any], nn.Module, dict[str, Any]]] = {}


def _graph_counter() -> tuple[Callable[..., Any], list[int]]:
    graphs = [0]

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs[0] += 1
        return gm.forward

    return backend, graphs


def _prepare_backward(workload: str, mode: str, contender: str, cells: int, quick: bool) -> Any:
    key = (workload, mode, contender)
    if key in _COMPILED:
        return _COMPILED[key]
    net = copy.deepcopy(mlp(depth=5, num_cells=cells))
    module = build_module(workload, contender, net)
    info: dict[str, Any] = {}
    if mode == "compiled":
        if quick:
            backend, graphs = _graph_counter()
            module = torch.compile(module, fullgraph=True, backend=backend)
            info["backend"] = "eager"
        else:
            module = torch.compile(module, fullgraph=True)
            info["backend"] = "inductor"
    x = _input(workload)
    t0 = time.perf_counter()
    module(_td(contender, x))
    if mode == "compiled":
        info["compile_s"] = time.perf_counter() - t0
        info["graph_breaks"] = 0  # fullgraph=True: a break would have raised
        if quick:
            info["graphs"] = graphs[0]
    _COMPILED[key] = (module, net, info)
    return _COMPILED[key]


@pytest.mark.parametrize("contender", CONTENDERS_HERE)
@pytest.mark.parametrize("workload", list(BACKWARD))
def test_keyrouted_forward_backward(
    benchmark: Any,
    bench_quick: bool,
    bench_size: Callable[[Any, Any], Any],
    workload: str,
    mode: str,
    contender: str,
) -> None:
    """MLP forward (eager or compiled, fullgraph) + eager backward: see BACKWARD[workload]."""
    if contender == "tensordict":
        _tensordict()
    cells = bench_size(1024, 64)
    module, net, info = _prepare_backward(workload, mode, contender, cells, bench_quick)
    x = _input(workload)
    arg = _td(contender, x)

    if contender == "floor":

        def step(a: Any) -> Any:
            out = module(a)
            out.mean().backward()
            return out
    else:

        def step(a: Any) -> Any:
            out = module(a)
            out[OUT].mean().backward()
            return out[OUT]

    net.zero_grad(set_to_none=True)
    expected = net(x)
    got = step(arg)
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-4, atol=1e-5)
    benchmark.extra_info.update(
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        quick=bench_quick,
        doc=BACKWARD[workload],
        cells=cells,
        **info,
    )
    benchmark(step, arg)
