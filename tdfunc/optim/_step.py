"""``optim.step``: one whole optimizer step, ``(params, state) -> (new params, new state)``,
on torch's fused kernels where torch has one.

``opt.update`` + ``apply_updates`` make about ten ``torch._foreach_*`` passes over every
leaf. torch ships one fused kernel per optimizer (``torch._fused_adamw_``, ``_fused_adam_``,
``_fused_sgd_``, ``_fused_adagrad_``) that reads each element once, but writes the params and
the state in place. :func:`step` runs it eagerly on private copies (pure: the inputs are left
as they were) or, with ``donate=True``, on the given buffers themselves (the inputs are then
consumed). A compiled graph cannot hold these kernels: under ``torch.compile`` Dynamo traces
the twin below, ``update`` + ``apply_updates``, which inductor fuses into one loop of its own
(:func:`tdfunc.compile` with ``donate=`` makes it write in place). Where no fused kernel fits
(batch dims, ``torch.vmap``, per-member hyperparameters, other optimizers, mixed dtypes or
devices) the eager step is ``update`` + ``apply_updates`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _donate
from .._twins import traced_as
from . import _errors as E
from ._core import GradientTransformation, apply_updates, check_container

#: ``fused(grads, state, params, donate) -> (params, state)`` or None (no kernel fits)
Fused = Callable[[Any, Any, Any, bool], "tuple[Any, Any] | None"]

_WHAT = "optim.step"
_NAMES = ("grads", "state", "params")
#: what a use of a donated state or params container says (formatted once, not per step)
_CONSUMED = {arg: E.DONATED_TO_STEP.format(arg=arg) for arg in ("state", "params")}


def fused_of(opt: GradientTransformation) -> Fused | None:
    """The fused step registered on ``opt.update`` (None: none)."""
    return getattr(opt.update, "fused", None)


def step(
    opt: GradientTransformation, grads: Any, state: Any, params: Any, *, donate: bool = False
) -> tuple[Any, Any]:
    """One optimizer step: the new params and the new state.

    The same values as ``updates, state = opt.update(grads, state, params)`` followed by
    ``params = apply_updates(params, updates)`` (to the rounding of torch's fused kernels),
    faster: eagerly, :func:`adam`, :func:`adamw`, :func:`sgd` and :func:`adagrad` (alone or
    last in a :func:`chain`) run torch's fused kernel, one pass over each leaf, on private
    copies of the params and the state. Under ``torch.compile`` this traces as ``update`` +
    ``apply_updates`` (inductor fuses those itself). Like ``torch.optim``'s ``step``, it
    records nothing for autograd (the results do not require grad); to differentiate through
    an update, use ``update`` and ``apply_updates``.

    ``donate=True`` (eager only) says the caller will not use ``params`` and ``state`` again:
    the kernel then writes into their buffers (no copy, no new memory, as ``torch.optim``),
    the returned containers hold those same tensors, and ``params`` and ``state`` (and every
    container nested in them) are consumed: using them raises :class:`tdfunc.DonatedError`.
    Tensors taken out of them before are the caller's responsibility. Refused before
    anything is written, as by :func:`tdfunc.compile`: memory-mapped leaves and memory shared
    between params, state and grads (leaves that require grad, such as the parameters of
    :func:`tdfunc.from_module`, are written without autograd, as ``torch.optim`` does). In
    a compiled function, donate the arguments of the whole step with
    ``tdfunc.compile(fn, donate=...)`` instead. A donated loop that hands each step the
    containers the previous one returned is checked in full once; later steps check only
    that nothing changed since (the same state object and param tensors, no write to any
    of them, plain grads that share no memory with them) and run the kernel at once.

    Args:
        opt: the optimizer.
        grads: the gradients (the params' structure).
        state: the optimizer state (``opt.init(params)``).
        params: the parameters.
        donate: write into ``params`` and ``state`` and consume them.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.adamw(lr=0.1)
        >>> params = tdfunc.TensorDict(w=torch.ones(2))
        >>> state = opt.init(params)
        >>> new_params, new_state = optim.step(opt, params, state, params)
        >>> [round(x, 4) for x in new_params["w"].tolist()], params["w"].tolist()
        ([0.899, 0.899], [1.0, 1.0])
        >>> grads, w = new_params.clone(), new_params["w"]
        >>> p2, s2 = optim.step(opt, grads, new_state, new_params, donate=True)
        >>> p2["w"] is w   # written in place: new_params and new_state are consumed
        True
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(E.NOT_A_TRANSFORMATION.format(what=_WHAT, typ=type(opt).__name__))
    fused = fused_of(opt)
    out = None
    if donate and fused is not None and hasattr(fused, "planned"):
        # a training loop hands back what the last step returned: then the checks below
        # were done on these very tensors (tdfunc.optim._plan)
        for x in (grads, state, params):
            _donate.check_not_consumed(x)
        with torch.no_grad():
            out = fused.planned(grads, state, params)
    if out is None:
        out = _full_step(opt, fused, grads, state, params, donate)
    if donate:
        _donate.consume(state, _CONSUMED["state"])
        _donate.consume(params, _CONSUMED["params"])
    return out


def _full_step(
    opt: GradientTransformation,
    fused: Fused | None,
    grads: Any,
    state: Any,
    params: Any,
    donate: bool,
) -> tuple[Any, Any]:
    """:func:`step` with every check: the fused kernel where it fits, else ``update`` +
    ``apply_updates`` (donated: written into the donated buffers)."""
    check_container(grads, _WHAT)
    check_container(params, _WHAT)
    donors: list[Tensor] = []
    if donate:
        checked = _donate.check_donated(
            (grads, state, params), {}, (1, 2), _WHAT, grad_ok=True, names=_NAMES
        )
        # in the order of the outputs (params, then state): each output takes its own buffer
        donors = [t for i, t in checked if i == 2] + [t for i, t in checked if i == 1]
    with torch.no_grad():
        out = fused(grads, state, params, donate) if fused is not None else None
        if out is None:
            updates, new_state = opt.update(grads, state, params)
            out = (apply_updates(params, updates), new_state)
            if donate:
                out = _donate.store_outputs(out, donors)
        elif donate:
            remember = getattr(fused, "remember", None)
            if remember is not None:
                remember(grads, *out)
    return out


@traced_as(step)
def _traced_step(
    opt: GradientTransformation, grads: Any, state: Any, params: Any, *, donate: bool = False
) -> tuple[Any, Any]:
    if donate:
        raise TypeError(E.DONATE_TRACED)
    with torch.no_grad():
        updates, new_state = opt.update(grads, state, params)
        return apply_updates(params, updates), new_state
