"""Compile counts and first-call times of a compiled training step over variable-length text,
route by route, each in a fresh process with the compile caches off.

The step: a small ``transformers`` GPT-2 (2 layers, 64 wide) as parameters in a container,
``torch.func.grad_and_value`` of its language-model loss through ``tdfunc.functional_call``
and ``tdfunc.optim.step`` (AdamW), compiled whole by ``torch.compile`` (inductor,
``fullgraph=True``). The data: 96 token sequences of random lengths 8-96 (seed 0), batches
of 8, one epoch (12 steps). The routes:

* ``longest``: ``collate_jagged(pad=True)``: each batch padded to its longest row;
* ``multiple``: :class:`tdfunc.LengthGroupedSampler` batches and ``pad_to_multiple_of=16``;
* ``fixed``: ``collate_jagged(pad=True, length=96)``: one shape;
* ``jagged``: the jagged batch into the step, padded inside it (``to_padded``,
  ``pad_to_multiple_of=16``) before the gradient.

Run: ``python -m compile_benchmarks.varlen_routes`` (a few minutes: four processes, each
compiling the step), or ``... ROUTE`` for one route in this process. Prints a Markdown table.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from typing import Any

ROUTES = ("longest", "multiple", "fixed", "jagged")


def run_route(route: str) -> dict[str, Any]:
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    import tdfunc

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_positions=128, n_embd=64, n_layer=2, n_head=4)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    model = GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 97, (96,), generator=gen).tolist()
    data = [tdfunc.TensorDict(tok=torch.randint(0, 128, (n,), generator=gen)) for n in lengths]
    if route == "longest":
        loader = DataLoader(
            data, batch_size=8, collate_fn=functools.partial(tdfunc.collate_jagged, pad=True)
        )
    elif route == "multiple":
        sampler = tdfunc.LengthGroupedSampler(lengths, batch_size=8, group_size=4)
        pad16 = functools.partial(
            tdfunc.collate_jagged, pad=True, keys=["tok"], pad_to_multiple_of=16
        )
        loader = DataLoader(data, batch_sampler=sampler, collate_fn=pad16)
    elif route == "fixed":
        loader = DataLoader(
            data,
            batch_size=8,
            collate_fn=functools.partial(tdfunc.collate_jagged, pad=True, keys=["tok"], length=96),
        )
    else:
        loader = DataLoader(
            data, batch_size=8, collate_fn=functools.partial(tdfunc.collate_jagged, keys=["tok"])
        )

    def loss_fn(params: Any, batch: Any) -> Any:
        if route == "jagged":
            batch = tdfunc.to_padded(batch, 0, pad_to_multiple_of=16)
        tok, mask = batch["tok"], batch["masks", "tok"]
        labels = torch.where(mask, tok, -100)
        logits = tdfunc.functional_call(
            model, params, (tok,), {"attention_mask": mask.long()}
        ).logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )

    opt = tdfunc.optim.adamw(lr=1e-3)

    def step(params: Any, state: Any, batch: Any) -> Any:
        grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
        params, state = tdfunc.optim.step(opt, grads, state, params)
        return params, state, loss

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    params = tdfunc.from_module(model).detach().clone()
    state = opt.init(params)
    times, frames, shapes = [], [], []
    for batch in loader:
        t0 = time.perf_counter()
        params, state, loss = compiled(params, state, batch)
        times.append(time.perf_counter() - t0)
        frames.append(counter.frame_count)
        shapes.append(tuple(batch["tok"].shape) if not batch["tok"].is_nested else "jagged")
    compile_calls = [i for i, f in enumerate(frames) if f > (frames[i - 1] if i else 0)]
    steady = sorted(t for i, t in enumerate(times) if i not in compile_calls)
    return {
        "route": route,
        "compiles": counter.frame_count,
        "first_call_s": times[0],
        "compile_calls_s": [times[i] for i in compile_calls],
        "steady_ms": 1e3 * steady[len(steady) // 2] if steady else None,
        "epoch_s": sum(times),
        "widths": sorted({s[1] for s in shapes if s != "jagged"}),
        "loss": float(loss),
    }


def main(argv: list[str]) -> None:
    if argv:
        print(json.dumps(run_route(argv[0])))
        return
    env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", OMP_NUM_THREADS="1")
    rows = []
    for route in ROUTES:
        done = subprocess.run(
            [sys.executable, "-m", "compile_benchmarks.varlen_routes", route],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if done.returncode:
            rows.append({"route": route, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"varlen routes, {time.strftime('%Y-%m-%d')}, torch {__import__('torch').__version__}")
    print(
        "| route | compiles | first call (s) | each compiling call (s) | steady step (ms) | epoch (s) | widths |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['route']} | error: {r['error']} |")
            continue
        each = ", ".join(f"{t:.1f}" for t in r["compile_calls_s"])
        print(
            f"| {r['route']} | {r['compiles']} | {r['first_call_s']:.1f} | {each} | "
            f"{r['steady_ms']:.1f} | {r['epoch_s']:.1f} | {r['widths'] or 'jagged'} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
