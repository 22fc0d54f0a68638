"""The compile-by-blocks training step against torch's regional recipe, in paired rounds, and
where its time goes, part by part.

``python -m compile_benchmarks.blocks_step MODEL`` (``MODEL``: a number N of the residual
blocks of ``_regions_step``, or ``gpt2``: the 2-layer GPT-2 of ``test_bench_optim``) builds,
in one process on one thread, with inductor:

* ``tdfunc``: the training-loop guide's by-blocks step: the block class's ``forward``
  compiled, ``tdfunc.value_and_grad`` over ``tdfunc.functional_call`` of the model, then
  ``optim.step(adamw, ..., donate=True)``; an independent second copy for the A/A control;
* ``regional``: torch's recipe on a copy of the same model: each block ``.compile()``,
  ``loss.backward()``, ``torch.optim.AdamW(fused=True)`` (``zero_grad`` after the step).

It checks that one step of each gives the same loss and parameters, then measures the whole
step in paired rounds (``compile_benchmarks/paired.py``: median of per-round ratios, the
order alternating, the A/A control) and each part against its torch twin:

* ``value_and_grad``: ``tdfunc.value_and_grad`` of the loss against ``torch.func.
  functional_call`` of the same model on a dict of leaves that require grad +
  ``torch.autograd.grad`` (what ``value_and_grad`` does, without its checks and containers);
* ``functional_call``: the forward alone (no grad) against ``torch.func.functional_call``;
* ``optim.step``: ``optim.step(..., donate=True)`` against the bare ``torch._fused_adamw_``
  call on the same lists (a loop that feeds its buffers back).

Each part's overhead is ``(tdfunc µs - twin µs) / parameters``; ``the rest`` is the step's
overhead over regional less the parts'. Also the whole step eagerly (``eager step``: the
same step over the model with no block compiled, against ``torch.func.functional_call`` +
``torch.autograd.grad`` + the bare fused kernel). :func:`measure` returns the rows;
``test_bench_compile_regions.py`` records them as benchmark rows.

Example:
    >>> sorted(PARTS)
    ['functional_call', 'optim.step', 'value_and_grad']
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tdfunc
from compile_benchmarks.paired import paired
from tdfunc import optim

#: the parts measured against their torch twin (see the module docstring)
PARTS = ("value_and_grad", "functional_call", "optim.step")
#: the whole step eagerly (no block compiled) against the same with torch.func and the fused
#: kernel (not a part of the compiled step: left out of *the rest*)
EAGER = "eager step"
LR = 1e-3


class _Bench:
    """One model's contenders: the tdfunc step (two copies), the regional step, the parts."""

    def __init__(self, which: str, backend: str = "inductor") -> None:
        torch.set_num_threads(1)
        if which == "gpt2":
            from compile_benchmarks.test_bench_optim import gpt2, lm_loss

            model = gpt2()
            self.x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
            self.y = self.x

            def out_of(y: Any) -> Tensor:
                return y.logits

            def loss_of(out: Tensor, y: Tensor) -> Tensor:
                return lm_loss(out, y)

            def blocks_of(m: nn.Module) -> list[nn.Module]:
                h: Any = m.transformer
                return list(h.h)
        else:
            from compile_benchmarks._regions_step import Block

            torch.manual_seed(0)
            model = nn.Sequential(*[Block() for _ in range(int(which))])
            self.x, self.y = torch.randn(32, 64), torch.randn(32, 64)

            def out_of(y: Any) -> Tensor:
                return y

            def loss_of(out: Tensor, y: Tensor) -> Tensor:
                return F.mse_loss(out, y)

            def blocks_of(m: nn.Module) -> list[nn.Module]:
                return list(m.children())

        ref = copy.deepcopy(model)
        self.plain = copy.deepcopy(model)  # nothing compiled: the eager step
        # tdfunc: the block class's forward compiled (a subclass, so that the regional copy
        # keeps the plain class)
        cls = type(blocks_of(model)[0])
        forward = torch.compile(cls.forward, backend=backend)
        compiled = type(f"Compiled{cls.__name__}", (cls,), {"forward": forward})
        for b in blocks_of(model):
            b.__class__ = compiled
        for b in blocks_of(ref):
            b.compile(backend=backend)
        self.model, self.ref = model, ref
        self.out_of, self.loss_of = out_of, loss_of
        self.opt = optim.adamw(lr=torch.tensor(LR))
        self.params = tdfunc.from_module(model, buffers=False).detach().clone()
        self.n = len(tdfunc.TensorDict.values(self.params, True, True))

        def loss_fn(p: Any, x: Tensor, y: Tensor) -> Tensor:
            return loss_of(out_of(tdfunc.functional_call(model, p, (x,))), y)

        self.vg = tdfunc.value_and_grad(loss_fn)
        self.topt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(LR), fused=True)

    def tdfunc_step(self) -> Callable[[], Tensor]:
        """A training loop of the by-blocks step on its own copy of the parameters."""
        p = self.params.clone()
        st = [p, self.opt.init(p)]
        vg, opt, x, y = self.vg, self.opt, self.x, self.y

        def call() -> Tensor:
            loss, g = vg(st[0], x, y)
            st[0], st[1] = optim.step(opt, g, st[1], st[0], donate=True)
            return loss

        call.state = st  # type: ignore[attr-defined]
        return call

    def regional_step(self) -> Callable[[], Tensor]:
        ref, topt, x, y = self.ref, self.topt, self.x, self.y

        def call() -> Tensor:
            loss = self.loss_of(self.out_of(ref(x)), y)
            loss.backward()
            topt.step()
            topt.zero_grad()
            return loss

        return call

    def check(self) -> None:
        """One step of each: the same loss and the same new parameters."""
        a, b = self.tdfunc_step(), self.regional_step()
        la, lb = a(), b()
        torch.testing.assert_close(la, lb.detach(), rtol=1e-5, atol=1e-6)
        got = a.state[0]  # type: ignore[attr-defined]
        for k, v in self.ref.named_parameters():
            torch.testing.assert_close(got[tuple(k.split("."))], v.detach(), rtol=1e-5, atol=1e-6)
        # the regional copy goes on from its own state: reset nothing (its loop is independent)

    def parts(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        """``part -> (tdfunc, its torch twin)`` (see the module docstring)."""
        model, x, y = self.model, self.x, self.y
        p = self.params.clone()
        names = [".".join(k) for k in p.keys(True, True)]
        leaves = [p[tuple(n.split("."))] for n in names]
        flat = dict(zip(names, leaves))
        vg = self.vg

        def tf_vg() -> Any:
            inputs = [t.detach().requires_grad_() for t in leaves]
            d = dict(zip(names, inputs))
            out = torch.func.functional_call(model, d, (x,))
            loss = self.loss_of(self.out_of(out), y)
            return loss.detach(), torch.autograd.grad(loss, inputs)

        def td_fc() -> Any:
            with torch.no_grad():
                return tdfunc.functional_call(model, p, (x,))

        def tf_fc() -> Any:
            with torch.no_grad():
                return torch.func.functional_call(model, flat, (x,))

        # the optimizer step: the same gradients every step, the buffers fed back
        g = vg(p, x, y)[1]
        opt = self.opt
        st = [p.clone(), opt.init(p)]

        def td_opt() -> None:
            st[0], st[1] = optim.step(opt, g, st[1], st[0], donate=True)

        ps = [t.clone() for t in leaves]
        gs = [g[tuple(n.split("."))] for n in names]
        m1, m2 = [torch.zeros_like(t) for t in ps], [torch.zeros_like(t) for t in ps]
        count = [torch.zeros((), dtype=torch.float64)]

        def tf_opt() -> None:
            count[0] = count[0] + 1
            torch._fused_adamw_(
                ps, gs, m1, m2, [], [count[0]] * len(ps), lr=LR, beta1=0.9, beta2=0.999,
                weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip

        # the eager step: value_and_grad over functional_call of the plain model + the
        # donated optim.step, against torch.func.functional_call + autograd.grad + the kernel
        plain = self.plain

        def plain_loss(q: Any, x: Tensor, y: Tensor) -> Tensor:
            return self.loss_of(self.out_of(tdfunc.functional_call(plain, q, (x,))), y)

        vg_plain = tdfunc.value_and_grad(plain_loss)
        est = [p.clone(), opt.init(p)]

        def td_eager() -> None:
            _, g = vg_plain(est[0], x, y)
            est[0], est[1] = optim.step(opt, g, est[1], est[0], donate=True)

        eps = [t.clone() for t in leaves]
        e1, e2 = [torch.zeros_like(t) for t in eps], [torch.zeros_like(t) for t in eps]
        ecount = [torch.zeros((), dtype=torch.float64)]

        def tf_eager() -> None:
            inputs = [t.detach().requires_grad_() for t in eps]
            out = torch.func.functional_call(plain, dict(zip(names, inputs)), (x,))
            grads = list(torch.autograd.grad(self.loss_of(self.out_of(out), y), inputs))
            ecount[0] = ecount[0] + 1
            torch._fused_adamw_(
                eps, grads, e1, e2, [], [ecount[0]] * len(eps), lr=LR, beta1=0.9, beta2=0.999,
                weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip

        return {
            "value_and_grad": (lambda: vg(p, x, y), tf_vg),
            "functional_call": (td_fc, tf_fc),
            "optim.step": (td_opt, tf_opt),
            EAGER: (td_eager, tf_eager),
        }


def measure(which: str, rounds: int = 15, calls: int = 20) -> dict[str, Any]:
    """The step's paired ratio to regional, its A/A control, and each part against its twin,
    with µs per parameter (see the module docstring)."""
    bench = _Bench(which)
    bench.check()
    step, step2, reg = bench.tdfunc_step(), bench.tdfunc_step(), bench.regional_step()
    row = paired(step, reg, rounds, calls)
    aa = paired(step, step2, rounds, calls)
    out: dict[str, Any] = {"model": which, "params": bench.n, "step": row, "aa": aa}
    parts_over = 0.0
    for name, (a, b) in bench.parts().items():
        r = paired(a, b, rounds, calls)
        r["us_per_param"] = (r["a_us"] - r["b_us"]) / bench.n
        out[name] = r
        if name in ("value_and_grad", "optim.step"):  # functional_call: inside the first
            parts_over += r["a_us"] - r["b_us"]
    out["step_us_per_param"] = (row["a_us"] - row["b_us"]) / bench.n
    out["rest_us_per_param"] = out["step_us_per_param"] - parts_over / bench.n
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="+", help="number of blocks, or gpt2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    print("| model | part | tdfunc µs | twin µs | ratio [min-max] | µs/param over twin |")
    print("|---|---|---|---|---|---|")
    for which in args.model:
        r = measure(which, args.rounds, args.calls)
        n = r["params"]
        s, aa = r["step"], r["aa"]
        print(
            f"| {which} ({n} params) | step / regional | {s['a_us']:,.0f} | {s['b_us']:,.0f} | "
            f"{s['ratio']:.3f} [{s['ratio_min']:.2f}-{s['ratio_max']:.2f}] | "
            f"{r['step_us_per_param']:.2f} |"
        )
        print(f"| | A/A | | | {aa['ratio']:.3f} [{aa['ratio_min']:.2f}-{aa['ratio_max']:.2f}] | |")
        for name in (*PARTS, EAGER):
            p = r[name]
            print(
                f"| | {name} | {p['a_us']:,.0f} | {p['b_us']:,.0f} | {p['ratio']:.3f} "
                f"[{p['ratio_min']:.2f}-{p['ratio_max']:.2f}] | {p['us_per_param']:.2f} |"
            )
        print(f"| | the rest | | | | {r['rest_us_per_param']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
