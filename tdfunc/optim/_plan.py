"""The plan of a donated step: what :func:`tdfunc.optim.step` checked on one donated fused
step, kept so that the next step, handed the very containers it returned, skips the checks.

A training loop calls ``params, state = optim.step(opt, grads, state, params, donate=True)``
with the same parameters and state every time: the same tensors (a donated step writes in
place), rebuilt into new containers. The full checks (the donation rules over every leaf,
the state's entries and shapes, which leaves a fused kernel takes) cost more than the kernel
on a small model. So each optimizer keeps one :class:`Plan`: a weak reference to the state
it returned (an immutable container: the same object has the same structure and leaves),
weak references to the params' leaves with their names, a fingerprint of every leaf
(version counter and data address) and the storages they use. A step whose state is that
object and whose params hold those leaves under those names, all untouched since (an
in-place write, ``set_`` or ``.data =`` changes a fingerprint), and whose grads are plain
tensors of the params' dtypes, shapes and devices sharing no storage with them, runs the
kernel at once. Anything else takes the full path, which raises the typed errors or falls
back; a plan is recorded only after a full donated step passed every check and ran the
fused kernel on plain tensors.

This is boundary code of the eager step (``optim.step`` traces as ``update`` +
``apply_updates`` under ``torch.compile``), like ``functional_call``'s plan: validated on
every call, so it never changes what a step does, only how much checking it repeats. The
weak references keep nothing alive: a plan whose containers died can never match.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _compat as C
from .._tree import leaves

_PLAIN = (Tensor, torch.nn.Parameter)


def fingerprint(ls: list[Tensor]) -> list[tuple[int, int]]:
    """``(version counter, data address)`` of each tensor: an in-place write, ``set_`` or a
    ``.data =`` assignment changes one of them.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> before = fingerprint([t])
        >>> _ = t.add_(1)
        >>> fingerprint([t]) == before
        False
    """
    return [(x._version, x.data_ptr()) for x in ls]


class Plan(NamedTuple):
    """What a donated fused step checked (see the module docstring)."""

    names: list[str]
    params: list[weakref.ref[Tensor]]
    state: weakref.ref[Any]
    prints: list[tuple[int, int]]
    storages: frozenset[int]
    count_at: int  # where the step count is among the state's leaves (-1: none)


def record(names: list[str], params: Any, state: Any, count: Tensor | None) -> Plan | None:
    """The plan of the containers a donated fused step returned (None: leaves that are not
    plain tensors, such as DTensors, which the fast path does not take).

    Example:
        >>> import torch, tdfunc
        >>> p = tdfunc.TensorDict(w=torch.zeros(2))
        >>> s = tdfunc.TensorDict(m=torch.zeros(2), step=torch.zeros((), dtype=torch.int64))
        >>> record(["w"], p, s, s["step"]).count_at
        1
    """
    lp, ls = leaves(params), leaves(state)
    if not all(type(x) in _PLAIN for x in lp) or not all(type(x) in _PLAIN for x in ls):
        return None
    count_at = next((i for i, x in enumerate(ls) if x is count), -1)
    both = lp + ls
    return Plan(
        names,
        [weakref.ref(x) for x in lp],
        weakref.ref(state),
        fingerprint(both),
        frozenset(x.untyped_storage().data_ptr() for x in both),
        count_at,
    )


def holds(plan: Plan, state: Any) -> bool:
    """Whether ``state`` is the very state container the plan's step returned."""
    return plan.state() is state


def matches(
    plan: Plan, names: list[str], lg: list[Tensor], lp: list[Tensor], ls: list[Tensor]
) -> bool:
    """Whether a step over these leaves (of the plan's state) may skip the checks: the
    params' leaves are the plan's tensors under the same names, no leaf was touched, and
    each grad is a plain tensor of its param's dtype, shape and device that shares no
    storage with the params or the state."""
    if names != plan.names or len(lp) != len(plan.params):
        return False
    for x, r in zip(lp, plan.params):
        if x is not r():
            return False
    if fingerprint(lp + ls) != plan.prints:
        return False
    storages, batched, strided = plan.storages, C.is_batchedtensor, torch.strided
    for g, p in zip(lg, lp):
        if (
            type(g) not in _PLAIN
            or g.dtype != p.dtype
            or g.shape != p.shape
            or g.device != p.device
            or g.layout != strided
            or batched(g)
            or g.untyped_storage().data_ptr() in storages
        ):
            return False
    return True


def after(plan: Plan, lp: list[Tensor], ls: list[Tensor], old_count: Tensor, state: Any) -> Plan:
    """The plan of the containers a planned step returned: the same params' leaves (written
    in place) and the same state leaves but the step count, now ``ls[plan.count_at]``."""
    storages = plan.storages
    if plan.count_at >= 0:
        new = ls[plan.count_at].untyped_storage().data_ptr()
        storages = (storages - {old_count.untyped_storage().data_ptr()}) | {new}
    return Plan(
        plan.names, plan.params, weakref.ref(state), fingerprint(lp + ls), storages, plan.count_at
    )
