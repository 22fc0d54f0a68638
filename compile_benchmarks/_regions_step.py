"""One training step (AdamW) of a model of identical blocks, run in a fresh process by
``test_bench_compile_regions.py``: ``python -m compile_benchmarks._regions_step KIND MODEL``
(``MODEL``: a number N of residual blocks LayerNorm -> Linear 64->256 -> GELU -> Linear
256->64 on a batch of 32, ``gpt2``: the 2-layer GPT-2 of ``test_bench_optim``, or ``gpt2-N``:
a GPT-2 of N layers, 128 wide, on 16 sequences of 55 tokens) prints the
first call's wall and CPU time, the median step time, Dynamo's graph count and the guards
of each compiled frame (``guards``: Dynamo checks a frame's guards on every call of it, so a
step of compiled blocks checks the block frame's once per block) as one JSON line.

Kinds: ``joint`` (today's tdfunc step: functional_call + torch.func.grad_and_value +
optim.step, one graph, donated), ``compiled_model`` (``torch.compile(model)`` +
``loss.backward()`` + fused AdamW), ``regional`` (torch's recipe: each block
``.compile()``), ``scan_joint`` (tdfunc: one compiled, donated graph: ``stack_modules`` +
``tdfunc.scan`` over the blocks, gradients by ``tdfunc.value_and_grad`` inside
``tdfunc.compile``, the optimizer in the graph; blocks only), ``vg_blockc`` (tdfunc: :func:`tdfunc.value_and_grad` over functional_call
with the block class's forward compiled, donated ``optim.step``), ``vg_scan`` (tdfunc:
``stack_modules`` + ``tdfunc.scan`` in a compiled loss; blocks only), ``vg`` (tdfunc: the
whole loss compiled).
"""

from __future__ import annotations

import json
import logging
import re
import resource
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import tdfunc
from tdfunc import optim


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class _GuardLog(logging.Handler):
    """Counts the guards of each frame Dynamo compiles (its ``guards`` log)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        n = len(re.findall(r"\+- [A-Z_]+:", record.getMessage()))
        if n:  # the log's other records (headers) hold none
            self.frames.append(n)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(kind: str, which: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    if which == "gpt2" or which.startswith("gpt2-"):
        from transformers.models.gpt2 import modeling_gpt2

        from compile_benchmarks.test_bench_optim import gpt2, lm_loss

        block_cls: type[nn.Module] = modeling_gpt2.GPT2Block
        if which == "gpt2":
            model = gpt2()
            x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        else:  # gpt2-N: N layers, 128 wide, a batch of 16 x 55 tokens
            model = gpt2(n_layer=int(which[5:]), n_embd=128, n_head=4, vocab=256, positions=64)
            x = torch.randint(0, 256, (16, 55), generator=torch.Generator().manual_seed(0))
        blocks = list(model.transformer.h)
        y = x

        def run(call: Any, m: Any, p: Any, x: torch.Tensor) -> torch.Tensor:
            return (m(x) if p is None else call(m, p, (x,))).logits

        def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return lm_loss(out, y)
    else:
        block_cls = Block
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(int(which))])
        blocks = list(model)
        x, y = torch.randn(32, 64), torch.randn(32, 64)

        def run(call: Any, m: Any, p: Any, x: torch.Tensor) -> torch.Tensor:
            return m(x) if p is None else call(m, p, (x,))

        def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return ((out - y) ** 2).mean()

    lr = torch.tensor(1e-3)
    opt = optim.adamw(lr=lr)

    def loss_fn(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_of(run(tdfunc.functional_call, model, p, x), y)

    def stacked_loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss over stacked blocks: ``tdfunc.scan`` runs the first block's code with each
        block's parameters."""

        def body(h: torch.Tensor, pi: Any) -> Any:
            return tdfunc.functional_call(blocks[0], pi, (h,)), ()

        h, _ = tdfunc.scan(body, x, p)
        return loss_of(h, y)

    if kind in ("joint", "scan_joint"):  # one compiled, donated graph: gradients and update
        if kind == "joint":
            p = tdfunc.from_module(model, buffers=False).detach().clone()

            def grads(p: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
                g, loss = torch.func.grad_and_value(loss_fn)(p, x, y)
                return loss, g
        else:
            p = tdfunc.stack_modules(blocks, buffers=False).detach().clone()
            grads = tdfunc.value_and_grad(stacked_loss)

        def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
            loss, g = grads(p, x, y)
            p, s = optim.step(opt, g, s, p)
            return p, s, loss

        fn = tdfunc.compile(step, donate=(0, 1), fullgraph=True)
        st = [p, opt.init(p)]

        def call() -> torch.Tensor:
            st[0], st[1], loss = fn(st[0], st[1], x, y)
            return loss
    elif kind in ("compiled_model", "regional"):
        if kind == "compiled_model":
            m: Any = torch.compile(model)
        else:
            for b in blocks:
                b.compile()
            m = model
        topt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

        def call() -> torch.Tensor:
            loss = loss_of(run(None, m, None, x), y)
            loss.backward()
            topt.step()
            topt.zero_grad()
            return loss
    else:
        if kind == "vg_scan":
            p = tdfunc.stack_modules(blocks, buffers=False).detach()
            vg = tdfunc.value_and_grad(torch.compile(stacked_loss, fullgraph=True))
        else:
            p = tdfunc.from_module(model, buffers=False).detach().clone()
            if kind == "vg_blockc":
                block_cls.forward = torch.compile(block_cls.forward)  # type: ignore[method-assign]
                vg = tdfunc.value_and_grad(loss_fn)
            else:
                vg = tdfunc.value_and_grad(torch.compile(loss_fn, fullgraph=True))
        st = [p, opt.init(p)]

        def call() -> torch.Tensor:
            loss, g = vg(st[0], x, y)
            st[0], st[1] = optim.step(opt, g, st[1], st[0], donate=True)
            return loss

    guard_log = _GuardLog()
    torch._logging.set_logs(guards=True)
    logging.getLogger("torch._dynamo.guards.__guards").addHandler(guard_log)
    k0 = _children_cpu()
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss0 = call()
    first = time.perf_counter() - t0
    cpu = time.process_time() - c0 + _children_cpu() - k0
    times = []
    for _ in range(30):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    times.sort()
    from torch._dynamo.utils import counters

    return {
        "kind": kind,
        "model": which,
        "first_s": first,
        "cpu_s": cpu,
        "step_ms": times[len(times) // 2] * 1e3,
        "loss0": float(loss0),
        "frames": counters["stats"]["unique_graphs"],
        "guards": guard_log.frames,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
