"""Where the time of the eager MLP training step goes, part by part, side by side.

``python -m compile_benchmarks.parts`` times each part of the ``train_step_mlp`` workload of
``test_bench_workloads.py`` for tdfunc and for the ``torch_func`` contender (a flat dict and
``torch.func``), in one process, one thread, with the process's CPU time as the clock: the two
sides run in alternating chunks and every ratio is the median of the per-chunk ratios (the
machine is noisy; absolute times are not stable). The analysis in ``README.md`` (*eager
torch.func workloads*) quotes this table. The parts:

* ``functional_call``: the forward through ``tdfunc.functional_call`` vs
  ``torch.func.functional_call``;
* ``write tracker``: ``tdfunc.functional_call`` (copy-on-write copies, writes read from
  torch) vs ``torch.func.functional_call``, both on the same flat dict with
  ``tie_weights=False``;
* ``grad_and_value``, the ``SGD update`` and the pytree ``tree_flatten`` / ``tree_unflatten``
  of the parameters.

Example:
    >>> from compile_benchmarks.parts import side_by_side
    >>> row = side_by_side(lambda: sum(range(50)), lambda: sum(range(50)), n=10, chunks=3)
    >>> sorted(row)
    ['a_us', 'b_us', 'max', 'min', 'ratio']
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

import tdfunc
from compile_benchmarks.test_bench_workloads import caller, mlp, params_of, sgd


def _chunk(fn: Callable[[], Any], n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n * 1e6


def side_by_side(
    a: Callable[[], Any], b: Callable[[], Any], *, n: int, chunks: int = 9
) -> dict[str, float]:
    """Median µs per call of ``a`` and ``b`` (alternating chunks of ``n`` calls) and the median,
    min and max of the per-chunk ratios ``a / b``."""
    for _ in range(max(n // 10, 3)):
        a()
        b()
    rows = [(_chunk(a, n), _chunk(b, n)) for _ in range(chunks)]
    ratios = [x / y for x, y in rows]
    return {
        "a_us": statistics.median(x for x, _ in rows),
        "b_us": statistics.median(y for _, y in rows),
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
    }


def parts() -> dict[str, tuple[Callable[[], Any], Callable[[], Any], int]]:
    """The parts of the MLP training step: ``name -> (tdfunc, torch_func, calls per chunk)``."""
    x, y = torch.randn(64, 3), torch.randn(64, 4)
    model = mlp()
    params = {c: params_of(c, model) for c in ("tdfunc", "torch_func")}
    call = {c: caller(c, model, "mlp") for c in params}
    gv = {c: torch.func.grad_and_value(lambda p, c=c: F.mse_loss(call[c](p, x), y)) for c in params}
    grads = {c: gv[c](params[c])[0] for c in params}
    flat = params["torch_func"]
    td_leaves, td_spec = pytree.tree_flatten(params["tdfunc"])
    d_leaves, d_spec = pytree.tree_flatten(flat)
    return {
        "functional_call (forward)": (
            lambda: call["tdfunc"](params["tdfunc"], x),
            lambda: call["torch_func"](flat, x),
            200,
        ),
        "write tracker (same dict, tie_weights=False)": (
            lambda: tdfunc.functional_call(model, flat, (x,), tie_weights=False),
            lambda: torch.func.functional_call(model, flat, (x,), tie_weights=False),
            200,
        ),
        "grad_and_value of the loss": (
            lambda: gv["tdfunc"](params["tdfunc"]),
            lambda: gv["torch_func"](flat),
            100,
        ),
        "SGD update params - lr * grads": (
            lambda: sgd("tdfunc", params["tdfunc"], grads["tdfunc"]),
            lambda: sgd("torch_func", flat, grads["torch_func"]),
            1000,
        ),
        "tree_flatten of the parameters": (
            lambda: pytree.tree_flatten(params["tdfunc"]),
            lambda: pytree.tree_flatten(flat),
            2000,
        ),
        "tree_unflatten of the parameters": (
            lambda: pytree.tree_unflatten(td_leaves, td_spec),
            lambda: pytree.tree_unflatten(d_leaves, d_spec),
            2000,
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=9, help="alternating chunks per part")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| part | tdfunc µs | torch.func / dict µs | ratio [min-max] |")
    print("|---|---|---|---|")
    for name, (a, b, n) in parts().items():
        r = side_by_side(a, b, n=n, chunks=args.chunks)
        print(
            f"| {name} | {r['a_us']:,.1f} | {r['b_us']:,.1f} | "
            f"{r['ratio']:.2f} [{r['min']:.2f}-{r['max']:.2f}] |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
