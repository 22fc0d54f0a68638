"""Lifted torch functions on containers, side by side: tdfunc, tensordict and a per-leaf loop
over a dict of the same leaves (``dict_loop``: ``{k: f(v) for k, v in d.items()}``, the code a
user writes by hand; nested data is the flat dict of its leaves by path). The compiled paired
rows of nested data also run against ``dict_tree``: the same loop over the nested dicts as
they are (a recursive comprehension, 11 dicts rebuilt, as tdfunc rebuilds 11 containers).

Four operations, flat (20 leaves ``[n, 8]``) and nested (a 10-deep chain of 11 leaves
``[n, 8]``), eager and compiled:

- ``exp``: a unary op with a ``torch._foreach_*`` twin (``td.exp()``: one foreach call);
- ``where``: ``torch.where(mask, td, 0)`` with a batch-shaped mask ``[n]`` (aligned with the
  batch dim, expanded over the feature dim; the loop writes ``mask[:, None]``);
- ``sum0``: a reduction over the batch dim (``td.sum(0)``);
- ``cumsum0``: a scan over the batch dim (``td.cumsum(0)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import tdfunc
from compile_benchmarks import available_modes

CATEGORY = "lifted"
CONTENDERS = ("tdfunc", "tensordict", "dict_loop")
#: Not compiled in ``test_lifted_op`` (``conftest.py``): the compiled rows against the loop
#: are ``test_lifted_paired``'s, in paired rounds with the A/A control (the report gives no
#: ratio against ``dict_loop`` from ``test_lifted_op``).
COMPILED_IF_REPRESENTATIVE = ("dict_loop",)
N = 64
FEAT = 8
DEPTH = 10


def _flat(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {f"k{i}": torch.randn(n, FEAT, generator=g) for i in range(20)}


def _nested(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n + 1)
    node: dict[str, Any] = {"x": torch.randn(n, FEAT, generator=g)}
    for _ in range(DEPTH):
        node = {"x": torch.randn(n, FEAT, generator=g), "n": node}
    return node


def _paths(src: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in src.items():
        if isinstance(v, dict):
            out.update(_paths(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _container(contender: str, src: dict[str, Any], n: int) -> Any:
    if contender == "tdfunc":
        return tdfunc.TensorDict(src, batch_size=[n])
    if contender == "tensordict":
        tensordict = pytest.importorskip("tensordict")
        return tensordict.TensorDict(src, batch_size=[n])
    return _paths(src)


def _mask(n: int) -> torch.Tensor:
    return torch.arange(n) % 3 != 0


OPS: dict[str, dict[str, Callable[..., Any]]] = {
    "exp": {
        "tdfunc": lambda td: td.exp(),
        "tensordict": lambda td: td.exp(),
        "dict_loop": lambda d: {k: v.exp() for k, v in d.items()},
    },
    "where": {
        "tdfunc": lambda td, m: torch.where(m, td, 0.0),
        "tensordict": lambda td, m: torch.where(m, td, 0.0),
        "dict_loop": lambda d, m: {k: torch.where(m[:, None], v, 0.0) for k, v in d.items()},
    },
    "sum0": {
        "tdfunc": lambda td: td.sum(0),
        "tensordict": lambda td: td.sum(0),
        "dict_loop": lambda d: {k: v.sum(0) for k, v in d.items()},
    },
    "cumsum0": {
        "tdfunc": lambda td: td.cumsum(0),
        "tensordict": lambda td: td.cumsum(0),
        "dict_loop": lambda d: {k: v.cumsum(0) for k, v in d.items()},
    },
}
SHAPES = {"flat": _flat, "nested": _nested}


def _tree(f: Callable[..., Any], d: dict[str, Any], *rest: Any) -> dict[str, Any]:
    """``f`` on every leaf of nested dicts, the nesting kept (the hand-written tree loop)."""
    return {k: _tree(f, v, *rest) if isinstance(v, dict) else f(v, *rest) for k, v in d.items()}


#: the nested-dict loop of each op (paired compiled rows of nested data)
TREE_OPS: dict[str, Callable[..., Any]] = {
    "exp": lambda d: _tree(torch.exp, d),
    "where": lambda d, m: _tree(lambda v, m: torch.where(m[:, None], v, 0.0), d, m),
    "sum0": lambda d: _tree(lambda v: v.sum(0), d),
    "cumsum0": lambda d: _tree(lambda v: v.cumsum(0), d),
}


def _args(op: str, shape: str, contender: str, n: int) -> tuple[Any, ...]:
    c = _container(contender, SHAPES[shape](n), n)
    return (c, _mask(n)) if op == "where" else (c,)


def _params() -> list[Any]:
    return [
        pytest.param(op, shape, mode, c, id=f"{op}_{shape}-{mode}-{c}")
        for op in OPS
        for shape in SHAPES
        for mode in available_modes()
        for c in CONTENDERS
        if not (op == "cumsum0" and c == "tensordict")  # tensordict 0.15 has no cumsum
    ]


@pytest.mark.parametrize(("op", "shape", "mode", "contender"), _params())
def test_lifted_op(
    measure: Callable[..., Any], op: str, shape: str, mode: str, contender: str
) -> None:
    """A lifted torch function (see the module docstring) on one contender's container."""
    measure(
        OPS[op][contender],
        *_args(op, shape, contender, N),
        workload=f"{op}_{shape}",
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=lambda n: _args(op, shape, contender, n),
    )


#: the targets of the issue, as paired rows: eager against tensordict, compiled against the
#: per-leaf dict loop (tensordict 0.15 has no cumsum: that row runs against the loop eagerly too)
PAIRED_TARGET = {"eager": ("tensordict", 0.8), "compiled": ("dict_loop", 1.05)}


@pytest.mark.parametrize(
    ("op", "shape", "tree"),
    [
        (op, shape, tree)
        for op in OPS
        for shape in SHAPES
        for tree in (False, True)
        if not (tree and shape == "flat")
    ],
    ids=lambda v: {True: "dict_tree", False: ""}.get(v, v) if isinstance(v, bool) else v,
)
def test_lifted_paired(
    benchmark: Any, bench_quick: bool, mode: str, op: str, shape: str, tree: bool
) -> None:
    """tdfunc against the target's contender in paired rounds, with the A/A control (see
    ``compile_benchmarks/paired.py``); the same values from both sides first. ``tree``: the
    compiled nested rows against the loop over the nested dicts (compiled only)."""
    from compile_benchmarks.paired import report

    torch.set_num_threads(1)
    if tree and mode == "eager":
        pytest.skip("the nested-dict loop is a compiled contender")
    against, target = PAIRED_TARGET["eager" if mode == "eager" else "compiled"]
    if op == "cumsum0" and against == "tensordict":
        against, target = "dict_loop", None
    a_args = _args(op, shape, "tdfunc", N)
    if tree:
        against = "dict_tree"
        src = SHAPES[shape](N)
        b_args = (src, _mask(N)) if op == "where" else (src,)
        fb = TREE_OPS[op]
    else:
        b_args = _args(op, shape, against, N)
        fb = OPS[op][against]
    fa = OPS[op]["tdfunc"]

    def fa2(*x: Any) -> Any:  # the A/A copy: the same call through its own code object
        return OPS[op]["tdfunc"](*x)

    if mode != "eager":
        backend = "eager" if bench_quick else "inductor"
        fa, fa2, fb = (torch.compile(f, backend=backend, fullgraph=True) for f in (fa, fa2, fb))
    got, want = fa(*a_args), fb(*b_args)
    flat = dict(got.flatten_keys(".").items())
    want = dict(
        _paths(want) if against in ("dict_loop", "dict_tree") else want.flatten_keys(".").items()
    )
    assert flat.keys() == want.keys()
    for k, v in flat.items():
        torch.testing.assert_close(v, want[k])
    rounds, calls = (3, 2) if bench_quick else (21, 200)
    report(
        benchmark,
        category=CATEGORY,
        workload=f"{op}_{shape}",
        mode=mode,
        against=against,
        a=lambda: fa(*a_args),
        a2=lambda: fa2(*a_args),
        b=lambda: fb(*b_args),
        rounds=rounds,
        calls=calls,
        target=target,
    )
