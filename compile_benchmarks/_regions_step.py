"""One training step of N identical residual blocks, run in a fresh process by
``test_bench_compile_regions.py``: ``python -m compile_benchmarks._regions_step KIND N``
prints the first call's wall and CPU time, the median step time and Dynamo's graph count
as one JSON line.

Kinds: ``joint`` (today's tdfunc step: functional_call + torch.func.grad_and_value +
optim.step, one graph, donated), ``compiled_model`` (``torch.compile(model)`` +
``loss.backward()`` + fused AdamW), ``regional`` (each block ``.compile()``),
``vg_blockc`` (tdfunc: ``value_and_grad`` over functional_call with the block's forward
compiled, donated ``optim.step``), ``vg_scan`` (tdfunc: ``stack_modules`` + ``tdfunc.scan``
in a compiled loss, ``value_and_grad``), ``vg`` (tdfunc: the whole loss compiled,
``value_and_grad``).
"""

# ruff: noqa
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
import tdfunc
from tdfunc import optim
from torch.utils import _pytree as pytree

torch.set_num_threads(1)
kind, n = sys.argv[1], int(sys.argv[2])


class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.ln = nn.LayerNorm(64)
        s.fc1 = nn.Linear(64, 256)
        s.fc2 = nn.Linear(256, 64)

    def forward(s, x):
        return x + s.fc2(F.gelu(s.fc1(s.ln(x))))


if kind == "vg_ncr":
    Block.forward = torch.compiler.nested_compile_region(Block.forward)
if kind == "vg_blockc":
    Block.forward = torch.compile(Block.forward)
torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(n)])
x, y = torch.randn(32, 64), torch.randn(32, 64)


def mse(o, y):
    return ((o - y) ** 2).mean()


def value_and_grad(fn):
    def w(p, *a):
        leaves, spec = pytree.tree_flatten(p)
        ins = [t.detach().requires_grad_() for t in leaves]
        with torch.enable_grad():
            loss = fn(pytree.tree_unflatten(ins, spec), *a)
        g = torch.autograd.grad(loss, ins)
        return loss.detach(), pytree.tree_unflatten(list(g), spec)

    return w


if kind == "joint":
    opt = optim.adamw(lr=torch.tensor(1e-3))

    def loss_fn(p, x, y):
        return mse(tdfunc.functional_call(model, p, (x,)), y)

    def step(p, s, x, y):
        g, loss = torch.func.grad_and_value(loss_fn)(p, x, y)
        p, s = optim.step(opt, g, s, p)
        return p, s, loss

    fn = tdfunc.compile(step, donate=(0, 1), fullgraph=True)
    p = tdfunc.from_module(model, buffers=False).detach().clone()
    st = [p, opt.init(p)]

    def call():
        st[0], st[1], l = fn(st[0], st[1], x, y)
        return l
elif kind in ("compiled_model", "regional"):
    if kind == "compiled_model":
        m = torch.compile(model)
    else:
        for b in model:
            b.compile()
        m = model
    topt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)

    def call():
        loss = mse(m(x), y)
        loss.backward()
        topt.step()
        topt.zero_grad()
        return loss
elif kind.startswith("vg"):
    opt = optim.adamw(lr=torch.tensor(1e-3))
    if kind == "vg_scan":
        blocks = tdfunc.stack_modules(list(model), buffers=False).detach()
        b0 = model[0]

        def loss_fn(p, x, y):
            def body(h, pi):
                return tdfunc.functional_call(b0, pi, (h,)), ()

            h, _ = tdfunc.scan(body, x, p)
            return mse(h, y)

        p = blocks.clone()
    else:

        def loss_fn(p, x, y):
            return mse(tdfunc.functional_call(model, p, (x,)), y)

        p = tdfunc.from_module(model, buffers=False).detach().clone()
    if kind != "vg_blockc":
        loss_fn = torch.compile(loss_fn, fullgraph=True)
    vg = value_and_grad(loss_fn)
    st = [p, opt.init(p)]

    def call():
        l, g = vg(st[0], x, y)
        st[0], st[1] = optim.step(opt, g, st[1], st[0], donate=True)
        return l


import resource


def _children():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


k0 = _children()
c0 = time.process_time()
t0 = time.perf_counter()
l0 = call()
first = time.perf_counter() - t0
cpu = time.process_time() - c0 + _children() - k0
ts = []
for _ in range(30):
    t = time.perf_counter()
    call()
    ts.append(time.perf_counter() - t)
ts.sort()
from torch._dynamo.utils import counters

print(
    json.dumps(
        {
            "kind": kind,
            "n": n,
            "first_s": first,
            "cpu_s": cpu,
            "step_ms": ts[len(ts) // 2] * 1e3,
            "loss0": float(l0),
            "frames": counters["stats"]["unique_graphs"],
        }
    )
)
