"""The optimizers of ``torch.optim`` as pure transformations: same options, defaults and
formulas (bias corrections computed in float64 from the step count, as torch does with
Python floats), one ``torch._foreach_*`` call per op in eager mode.

Each returns *updates* (the change of the params, ``-lr * direction``): apply them with
:func:`tdfunc.optim.apply_updates`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import _compat as C
from . import _errors as E
from ._core import (
    DECAY_PICKS,
    GradientTransformation,
    Hyper,
    Lists,
    Mask,
    add_at,
    add_at_,
    build,
    check_hyper,
    is_zero,
)
from ._fused import run_groups, steps_tensor


def _direction(
    L: Lists,
    g: list[Tensor],
    p: list[Tensor] | None,
    wd: Any,
    maximize: bool,
    picks: list[int] | None = None,
) -> list[Tensor]:
    """``-g`` when maximizing, plus ``wd * p`` (L2 weight decay, as torch.optim) on the
    leaves ``picks`` (all when None)."""
    if maximize:
        g = L.neg(g)
    if not is_zero(wd):
        assert p is not None
        g = add_at(L, g, p, wd, picks)
    return g


def _neg(v: Any) -> Any:
    return -v


def _log(beta: float) -> float:
    # log(0) for beta == 0: exp(t * -inf) is 0, as 0.0 ** t is for t >= 1
    return math.log(beta) if beta > 0 else -math.inf


def sgd(
    lr: Hyper = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: Hyper = 0.0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (same options and defaults).

    ``lr`` and ``weight_decay`` may be numbers, tensors (kept in the state: change them with
    :func:`set_hyperparams` without recompiling; shape ``[N]`` gives each of N ensemble
    members its own; ``update`` reads the state's value, see :data:`Hyper`) or schedules of
    the step count. ``mask`` (every optimizer with a
    ``weight_decay``) selects the leaves the decay applies to, as in :func:`adamw`. The state holds ``step`` and, with
    momentum, ``momentum_buffer`` (the first step copies the gradient, as torch does).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.sgd(lr=0.1, momentum=0.9)
        >>> p = tdfunc.TensorDict(w=torch.ones(2))
        >>> s = opt.init(p)
        >>> u, s = opt.update(p, s, p)
        >>> u["w"].tolist(), int(s["sgd", "step"])
        ([-0.10000000149011612, -0.10000000149011612], 1)
    """
    what = "sgd"
    check_hyper(what, "lr", lr)
    check_hyper(what, "momentum", momentum)
    check_hyper(what, "weight_decay", weight_decay)
    check_hyper(what, "dampening", dampening)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(E.NESTEROV)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Tensor,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        d = _direction(L, g, p, h["weight_decay"], maximize, h[DECAY_PICKS])
        new: dict[str, Any] = {}
        if momentum != 0:
            buf = L.mul(bufs["momentum_buffer"], momentum)
            # torch copies the gradient at the first step: the buffer is zero then, so
            # momentum * 0 + 1 * d is that copy; later steps add (1 - dampening) * d
            c: Any = 1.0
            if dampening != 0:
                one = torch.ones_like(count, dtype=torch.float64)
                c = torch.where(count == 0, one, one * (1.0 - dampening))
            L.add_(buf, d, alpha=c)
            new["momentum_buffer"] = buf
            d = L.add(d, buf, alpha=momentum) if nesterov else buf
        return L.mul(d, _neg(h["lr"])), new

    def fused(
        lr_: float,
        wd: float,
        out: list[Tensor],
        g: list[Tensor],
        new: dict[str, list[Tensor]],
        count: Tensor,
        picks: list[int] | None,
    ) -> None:
        first = bool(count == 0)

        def run(ls: list[list[Tensor]], decay: float) -> None:
            C.fused_sgd_(*ls, weight_decay=decay, momentum=momentum, lr=lr_,
                              dampening=dampening, nesterov=nesterov, maximize=maximize,
                              is_first_step=first)  # fmt: skip

        run_groups(run, [out, g, new.get("momentum_buffer", [])], wd, picks)

    buffers = {"momentum_buffer": 0.0} if momentum != 0 else {}
    hypers = {"lr": lr, "weight_decay": weight_decay}
    return build(
        "sgd", buffers, hypers, not is_zero(weight_decay), math, decay_mask=mask, fused=fused
    )


def _adam(
    tag: str,
    lr: Hyper,
    betas: tuple[float, float],
    eps: float,
    weight_decay: Hyper,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    mask: Mask | None,
) -> GradientTransformation:
    check_hyper(tag, "lr", lr)
    check_hyper(tag, "eps", eps)
    check_hyper(tag, "beta1", betas[0], 0.0, 1.0)
    check_hyper(tag, "beta2", betas[1], 0.0, 1.0)
    check_hyper(tag, "weight_decay", weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Tensor,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        lr_, wd = h["lr"], h["weight_decay"]
        d = _direction(L, g, p, 0.0 if decoupled else wd, maximize, h[DECAY_PICKS])
        m = L.lerp(bufs["exp_avg"], d, 1.0 - b1)
        v = L.mul(bufs["exp_avg_sq"], b2)
        L.addcmul_(v, d, d, 1.0 - b2)
        t = (count + 1).to(torch.float64)
        # 1 - beta ** t written as 1 - exp(t * log(beta)): inductor computes this form once
        # per step before the loops, where it recomputes ``pow`` for every vector of floats
        bc1, bc2 = 1.0 - torch.exp(t * _log(b1)), 1.0 - torch.exp(t * _log(b2))
        step_size = lr_ / bc1
        new: dict[str, Any] = {"exp_avg": m, "exp_avg_sq": v}
        if amsgrad:
            vmax = L.maximum(bufs["max_exp_avg_sq"], v)
            new["max_exp_avg_sq"] = vmax
            denom = L.sqrt(vmax)
        else:
            denom = L.sqrt(v)
        L.div_(denom, bc2.sqrt())
        L.add_scalar_(denom, eps)
        upd = L.div_list(m, denom)
        L.mul_(upd, _neg(step_size))
        if decoupled and not is_zero(wd):
            assert p is not None
            add_at_(L, upd, p, _neg(lr_ * wd), h[DECAY_PICKS])
        return upd, new

    def fused(
        lr_: float,
        wd: float,
        out: list[Tensor],
        g: list[Tensor],
        new: dict[str, list[Tensor]],
        count: Tensor,
        picks: list[int] | None,
    ) -> None:
        kernel = C.fused_adamw_ if decoupled else C.fused_adam_
        lists = [out, g, new["exp_avg"], new["exp_avg_sq"]]
        lists += [new["max_exp_avg_sq"] if amsgrad else [], steps_tensor(count, len(out))]

        def run(ls: list[list[Tensor]], decay: float) -> None:
            kernel(*ls, lr=lr_, beta1=b1, beta2=b2, weight_decay=decay, eps=eps,
                   amsgrad=amsgrad, maximize=maximize)  # fmt: skip

        run_groups(run, lists, wd, picks)

    buffers = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    if amsgrad:
        buffers["max_exp_avg_sq"] = 0.0
    hypers = {"lr": lr, "weight_decay": weight_decay}
    return build(
        tag, buffers, hypers, not is_zero(weight_decay), math, decay_mask=mask, fused=fused
    )


def adam(
    lr: Hyper = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Hyper = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` (L2 ``weight_decay`` added to the gradient).

    State: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with ``amsgrad``), ``step``,
    and ``lr`` / ``weight_decay`` when given as tensors. See :func:`sgd` for hyperparameters.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.adam(lr=0.1)
        >>> p = tdfunc.TensorDict(w=torch.ones(2))
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()], sorted(s["adam"].keys())
        ([-0.1, -0.1], ['exp_avg', 'exp_avg_sq', 'step'])
    """
    return _adam("adam", lr, betas, eps, weight_decay, amsgrad, maximize, False, mask)


def adamw(
    lr: Hyper = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: Hyper = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """AdamW, as ``torch.optim.AdamW``: decoupled weight decay ``-lr * weight_decay * p``.

    ``mask`` selects the leaves that get the decay (optax's meaning; the others get the Adam
    step only): a key pattern (``"*.weight"``), a list of patterns, a callable
    ``(key_path, leaf) -> bool`` or a container of booleans. The usual setup, no decay on
    biases and norms: ``mask=lambda path, p: p.ndim >= 2``. A pattern that matches no leaf, or
    a mask that selects none, raises ``KeyError`` naming the pattern and the nearest key (at
    ``init`` already). One state, one step count, whatever the mask.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.adamw(lr=0.1, weight_decay=0.5)
        >>> p = tdfunc.TensorDict(w=torch.ones(2))
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.15, -0.15]
        >>> p = tdfunc.TensorDict(w=torch.ones(2, 2), bias=torch.ones(2))
        >>> opt = optim.adamw(lr=0.1, weight_decay=0.5, mask=lambda path, x: x.ndim >= 2)
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> round(u["w"][0, 0].item(), 4), round(u["bias"][0].item(), 4)
        (-0.15, -0.1)
    """
    return _adam("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, True, mask)


def rmsprop(
    lr: Hyper = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: Hyper = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """RMSprop, as ``torch.optim.RMSprop`` (``centered``, ``momentum``).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.rmsprop(lr=0.01, centered=True, momentum=0.9)
        >>> sorted(opt.init(tdfunc.TensorDict(w=torch.ones(2)))["rmsprop"].keys())
        ['grad_avg', 'momentum_buffer', 'square_avg', 'step']
    """
    what = "rmsprop"
    check_hyper(what, "lr", lr)
    check_hyper(what, "eps", eps)
    check_hyper(what, "alpha", alpha)
    check_hyper(what, "momentum", momentum)
    check_hyper(what, "weight_decay", weight_decay)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Tensor,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        d = _direction(L, g, p, h["weight_decay"], maximize, h[DECAY_PICKS])
        sq = L.mul(bufs["square_avg"], alpha)
        L.addcmul_(sq, d, d, 1.0 - alpha)
        new: dict[str, Any] = {"square_avg": sq}
        if centered:
            ga = L.lerp(bufs["grad_avg"], d, 1.0 - alpha)
            new["grad_avg"] = ga
            avg = L.sqrt(L.addcmul(sq, ga, ga, -1.0))
        else:
            avg = L.sqrt(sq)
        L.add_scalar_(avg, eps)
        if momentum > 0:
            buf = L.mul(bufs["momentum_buffer"], momentum)
            L.addcdiv_(buf, d, avg, 1.0)
            new["momentum_buffer"] = buf
            return L.mul(buf, _neg(h["lr"])), new
        upd = L.div_list(d, avg)
        return L.mul_(upd, _neg(h["lr"])), new

    buffers = {"square_avg": 0.0}
    if momentum > 0:
        buffers["momentum_buffer"] = 0.0
    if centered:
        buffers["grad_avg"] = 0.0
    hypers = {"lr": lr, "weight_decay": weight_decay}
    return build("rmsprop", buffers, hypers, not is_zero(weight_decay), math, decay_mask=mask)


def adagrad(
    lr: Hyper = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: Hyper = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Adagrad, as ``torch.optim.Adagrad`` (``lr_decay``, ``initial_accumulator_value``).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.adagrad(lr=0.5)
        >>> p = tdfunc.TensorDict(w=torch.ones(2))
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()], s["adagrad", "sum"]["w"].tolist()
        ([-0.5, -0.5], [1.0, 1.0])
    """
    what = "adagrad"
    check_hyper(what, "lr", lr)
    check_hyper(what, "lr_decay", lr_decay)
    check_hyper(what, "weight_decay", weight_decay)
    check_hyper(what, "initial_accumulator_value", initial_accumulator_value)
    check_hyper(what, "eps", eps)

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Tensor,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        d = _direction(L, g, p, h["weight_decay"], maximize, h[DECAY_PICKS])
        acc = L.addcmul(bufs["sum"], d, d, 1.0)
        std = L.sqrt(acc)
        L.add_scalar_(std, eps)
        clr = h["lr"]
        if lr_decay != 0:
            clr = clr / (1.0 + count.to(torch.float64) * lr_decay)
        upd = L.div_list(d, std)
        return L.mul_(upd, _neg(clr)), {"sum": acc}

    def fused(
        lr_: float,
        wd: float,
        out: list[Tensor],
        g: list[Tensor],
        new: dict[str, list[Tensor]],
        count: Tensor,
        picks: list[int] | None,
    ) -> None:

        def run(ls: list[list[Tensor]], decay: float) -> None:
            C.fused_adagrad_(*ls, lr=lr_, lr_decay=lr_decay, weight_decay=decay, eps=eps,
                                  maximize=maximize)  # fmt: skip

        run_groups(run, [out, g, new["sum"], steps_tensor(count, len(out))], wd, picks)

    hypers = {"lr": lr, "weight_decay": weight_decay}
    buffers = {"sum": float(initial_accumulator_value)}
    return build(
        "adagrad", buffers, hypers, not is_zero(weight_decay), math, decay_mask=mask, fused=fused
    )


def lion(
    lr: Hyper = 1e-4,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: Hyper = 0.0,
    *,
    maximize: bool = False,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), which
    ``torch.optim`` does not ship: the update is the sign of an interpolation of the momentum
    and the gradient, with decoupled weight decay:
    ``p -= lr * (sign(b1 * m + (1 - b1) * g) + weight_decay * p)``, then
    ``m = b2 * m + (1 - b2) * g``. One momentum buffer (half of Adam's state); use a learning
    rate 3-10x smaller than AdamW's.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.lion(lr=0.1)
        >>> p = tdfunc.TensorDict(w=torch.tensor([1.0, -2.0]))
        >>> u, s = opt.update(p, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()], sorted(s["lion"].keys())
        ([-0.1, 0.1], ['exp_avg', 'step'])
    """
    what = "lion"
    check_hyper(what, "lr", lr)
    check_hyper(what, "beta1", betas[0], 0.0, 1.0)
    check_hyper(what, "beta2", betas[1], 0.0, 1.0)
    check_hyper(what, "weight_decay", weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])

    def math(
        L: Lists,
        g: list[Tensor],
        p: list[Tensor] | None,
        bufs: dict[str, list[Tensor]],
        count: Tensor,
        h: dict[str, Any],
    ) -> tuple[list[Tensor], dict[str, Any]]:
        d = _direction(L, g, None, 0.0, maximize)
        m = bufs["exp_avg"]
        upd = L.sign(L.lerp(m, d, 1.0 - b1))
        if not is_zero(h["weight_decay"]):
            assert p is not None
            add_at_(L, upd, p, h["weight_decay"], h[DECAY_PICKS])
        return L.mul_(upd, _neg(h["lr"])), {"exp_avg": L.lerp(m, d, 1.0 - b2)}

    hypers = {"lr": lr, "weight_decay": weight_decay}
    return build("lion", {"exp_avg": 0.0}, hypers, not is_zero(weight_decay), math, decay_mask=mask)
