"""Compile counts and cache behaviour of a compiled step over variable-length data, plain
``torch.compile`` against ``tdfunc.compile`` (docs/guides/datasets.md, "Compiled steps over
variable-length data").

Run: ``OMP_NUM_THREADS=1 python compile_benchmarks/boundary_counts.py``. Prints, per route:

* jagged: the compiles over an epoch of 20 batches (8 sequences of 1..64 steps, 16
  features), counted with the eager backend, then with inductor in a fresh process on an
  empty cache (first-call seconds, compiles, FX graph / AOTAutograd cache counters), and in a
  second process on that cache;
* per-sample text: the compiles over 100 calls with new strings each, in a step that
  indexes, stacks, splits and concatenates the batch without reading the text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc

COMPILERS = {"torch.compile": torch.compile, "tdfunc.compile": tdfunc.compile}


def epoch(seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(20):
        lengths = torch.randint(1, 65, (8,), generator=g).tolist()
        rows = [torch.randn(n, 16, generator=g) for n in lengths]
        tokens = torch.nested.nested_tensor(rows, layout=torch.jagged)
        out.append(tdfunc.TensorDict(tokens=tokens, y=torch.randn(8, generator=g), batch_size=[8]))
    return out


def jagged_step(w: Any, b: Any) -> tuple[Any, torch.Tensor]:
    h = torch.tanh(b["tokens"] * w["scale"] + w["bias"])
    return b.set("tokens", h), (h.values() ** 2).mean() + b["y"].mean()


def text_step(td: Any, perm: torch.Tensor) -> tuple[Any, ...]:
    a, b = td[perm].split([3, 5])
    return tdfunc.stack([td, td[perm]], 1), tdfunc.cat([b, a]), td[2:6] * 2


def params() -> Any:
    return tdfunc.TensorDict(scale=torch.linspace(0.5, 1.5, 16), bias=torch.zeros(16))


def counts() -> None:
    w = params()
    batches = epoch()
    for name, comp in COMPILERS.items():
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("eager")
        f = comp(jagged_step, backend=cnt)
        for b in batches:
            f(w, b)
        print(f"jagged epoch, {name}: {cnt.frame_count} compiles (eager backend)")
    g = torch.Generator().manual_seed(0)
    for name, comp in COMPILERS.items():
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("eager")
        f = comp(text_step, backend=cnt)
        for call in range(100):
            td = tdfunc.TensorDict(
                x=torch.randn(8, 2, generator=g),
                text=[f"call {call} row {i}" for i in range(8)],
                batch_size=[8],
            )
            f(td, torch.randperm(8, generator=g))
        print(f"per-sample text, 100 calls, {name}: {cnt.frame_count} compiles (eager backend)")


def child(name: str) -> None:
    """One process: the epoch with inductor, on the cache directory of the environment."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    f = COMPILERS[name](jagged_step, backend="inductor")
    w = params()
    t0 = time.perf_counter()
    first = 0.0
    for i, b in enumerate(epoch()):
        f(w, b)
        if i == 0:
            first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    keep = ("fxgraph_cache_hit", "fxgraph_cache_miss", "autograd_cache_hit")
    keep += ("autograd_cache_miss", "autograd_cache_bypass")
    found = {**counters["inductor"], **counters["aot_autograd"]}
    print(
        json.dumps(
            {
                "first_call_s": round(first, 2),
                "epoch_s": round(total, 2),
                "compiles": counters["stats"]["unique_graphs"],
                **{k: found[k] for k in keep if k in found},
            }
        )
    )


def caches() -> None:
    for name in COMPILERS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            for run in ("cold cache", "second process"):
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", name],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                pickle_failed = "Failed to pickle cache key" in proc.stderr
                stats = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"jagged epoch, inductor, {name}, {run}: {stats}", end="")
                print(" (torch: 'Failed to pickle cache key')" if pickle_failed else "")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    else:
        counts()
        caches()
