"""The plan of a donated step: what :func:`tdfunc.optim.step` checked on one donated fused
step, kept so that the next step, handed the very containers it returned, skips the checks.

A training loop calls ``params, state = optim.step(opt, grads, state, params, donate=True)``
with the same parameters and state every time: the same tensors (a donated step writes in
place), rebuilt into new containers. The full checks (the donation rules over every leaf,
the state's entries and shapes, which leaves a fused kernel takes) cost more than the kernel
on a small model. So each optimizer keeps one :class:`Plan`: a weak reference to the state
it returned (an immutable container: the same object has the same structure and leaves),
weak references to the params container it returned and to its leaves, the params'
structure (:func:`spec`: types, keys, static fields), a fingerprint of every leaf (version
counter and data address) and the storages they use. A step whose state is that object and
whose params are that container (or another one holding those leaves in that structure),
all untouched since (an in-place write, ``set_`` or ``.data =`` changes a fingerprint), and
whose grads have the params' structure (one walk of the grads checks it and collects their
leaves) and are plain tensors of the params' dtypes, shapes and devices sharing no storage
with them, runs the kernel at once. Anything else takes the full path, which raises the typed errors or falls
back; a plan is recorded only after a full donated step passed every check and ran the
fused kernel on plain tensors.

This is boundary code of the eager step (``optim.step`` traces as ``update`` +
``apply_updates`` under ``torch.compile``), like ``functional_call``'s plan: validated on
every call, so it never changes what a step does, only how much checking it repeats. The
weak references keep nothing alive: a plan whose containers died can never match.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import _compat as C
from .._tree import leaves

_PLAIN = (Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
#: a ``None`` child in a :func:`spec` (a tensor child is ``None`` itself)
_NONE = 1
#: ``Tensor`` for every ``isinstance`` of a ``map`` (never exhausted)
_ALWAYS_TENSOR = itertools.repeat(Tensor)


def fingerprint(ls: list[Tensor]) -> tuple[list[int], list[int]]:
    """The version counters and the data addresses of the tensors: an in-place write,
    ``set_`` or a ``.data =`` assignment changes one of them.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> before = fingerprint([t])
        >>> _ = t.add_(1)
        >>> fingerprint([t]) == before
        False
    """
    # maps of C attribute readers: no Python frame per tensor (the hot path of a step)
    return list(map(_VERSION, ls)), list(map(Tensor.data_ptr, ls))


_VERSION = operator.attrgetter("_version")
#: what a grad must share with its param (a fused kernel takes one dtype, shape and device)
_KIND = operator.attrgetter("dtype", "shape", "device")
_LAYOUT = operator.attrgetter("layout")


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


def spec(node: Any) -> tuple[Any, ...]:
    """The structure of a node, as :func:`walk` checks it: its type, keys and static fields,
    and per child ``None`` (a tensor), :data:`_NONE` (``None``) or the child node's spec.

    Example:
        >>> import torch, tdfunc
        >>> spec(tdfunc.TensorDict(w=torch.zeros(2), sub={"b": torch.zeros(1)}))[1]
        ('w', 'sub')
    """
    keys, children = node._tdf_keys(), node._tdf_children()
    kinds = tuple(
        None if isinstance(v, Tensor) else _NONE if v is None else spec(v) for v in children
    )
    flat = all(k is None for k in kinds)
    return type(node), keys, node._tdf_static(), None if flat else kinds


def walk(node: Any, sp: tuple[Any, ...], out: list[Tensor]) -> bool:
    """Append the leaves of ``node`` to ``out`` in :func:`tdfunc._tree.leaves` order; False
    (``out`` then holds a part of them) when the structure is not ``sp``: one walk that
    checks the structure and collects the leaves.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(w=torch.zeros(2), sub={"b": torch.zeros(1)})
        >>> out = []
        >>> walk(td, spec(td), out), len(out), walk(td.exclude("w"), spec(td), [])
        (True, 2, False)
    """
    typ, keys, static, kinds = sp
    if type(node) is not typ:
        return False
    if node._tdf_dict_layout:
        d = node._data
        if tuple(d) != keys:
            return False
        vals: Any = d.values()
    else:
        if node._tdf_keys() != keys:
            return False
        vals = node._tdf_children()
    if static and node._tdf_static() != static:
        return False
    if kinds is None:  # every child a tensor
        vals = list(vals)
        if not all(map(isinstance, vals, _ALWAYS_TENSOR)):
            return False
        out.extend(vals)
        return True
    for v, k in zip(vals, kinds):
        if k is None:
            if not isinstance(v, Tensor):
                return False
            out.append(v)
        elif k is _NONE:
            if v is not None:
                return False
        elif not walk(v, k, out):
            return False
    return True


class Plan(NamedTuple):
    """What a donated fused step checked (see the module docstring)."""

    spec: tuple[Any, ...]  # the params' structure (the grads must have it)
    container: weakref.ref[Any]  # the params container the step returned
    params: list[weakref.ref[Tensor]]
    state: weakref.ref[Any]
    prints: tuple[list[int], list[int]]
    storages: frozenset[int]
    count_at: int  # where the step count is among the state's leaves (-1: none)


def record(params: Any, state: Any, count: Tensor | None) -> Plan | None:
    """The plan of the containers a donated fused step returned (None: leaves that are not
    plain tensors, such as DTensors, which the fast path does not take).

    Example:
        >>> import torch, tdfunc
        >>> p = tdfunc.TensorDict(w=torch.zeros(2))
        >>> s = tdfunc.TensorDict(m=torch.zeros(2), step=torch.zeros((), dtype=torch.int64))
        >>> record(p, s, s["step"]).count_at
        1
    """
    lp, ls = leaves(params), leaves(state)
    if not all(type(x) in _PLAIN for x in lp) or not all(type(x) in _PLAIN for x in ls):
        return None
    count_at = next((i for i, x in enumerate(ls) if x is count), -1)
    both = lp + ls
    return Plan(
        spec(params),
        weakref.ref(params),
        [weakref.ref(x) for x in lp],
        weakref.ref(state),
        fingerprint(both),
        frozenset(map(_storage_ptr, both)),
        count_at,
    )


def holds(plan: Plan, state: Any) -> bool:
    """Whether ``state`` is the very state container the plan's step returned."""
    return plan.state() is state


def params_leaves(plan: Plan, params: Any) -> list[Tensor] | None:
    """The leaves of ``params`` when they are the plan's tensors in the plan's structure
    (None otherwise): the container the plan's step returned holds them (an immutable
    container: the same object, the same leaves); another one is walked and compared."""
    if plan.container() is params:
        return [r() for r in plan.params]  # type: ignore[misc]  # alive: params holds them
    lp: list[Tensor] = []
    if not walk(params, plan.spec, lp) or len(lp) != len(plan.params):
        return None
    for x, r in zip(lp, plan.params):
        if x is not r():
            return None
    return lp


def matches(plan: Plan, lg: list[Tensor], lp: list[Tensor], ls: list[Tensor]) -> bool:
    """Whether a step over these leaves (the grads', in the plan's structure; the plan's
    params and state) may skip the checks: no leaf of the params or the state was touched,
    and each grad is a plain tensor of its param's dtype, shape and device that shares no
    storage with the params or the state."""
    if fingerprint(lp + ls) != plan.prints:
        return False
    # each check one map over the grads (C readers, no Python frame per leaf)
    return (
        all(map(_PLAIN_TYPES.__contains__, map(type, lg)))
        and list(map(_KIND, lg)) == list(map(_KIND, lp))
        and all(map(torch.strided.__eq__, map(_LAYOUT, lg)))
        and not any(map(C.is_batchedtensor, lg))
        and plan.storages.isdisjoint(map(_storage_ptr, lg))
    )


def after(
    plan: Plan, lp: list[Tensor], ls: list[Tensor], old_count: Tensor, params: Any, state: Any
) -> Plan:
    """The plan of the containers a planned step returned: the same params' leaves (written
    in place) and the same state leaves but the step count, now ``ls[plan.count_at]``."""
    storages = plan.storages
    if plan.count_at >= 0:
        new = ls[plan.count_at].untyped_storage().data_ptr()
        storages = (storages - {old_count.untyped_storage().data_ptr()}) | {new}
    return plan._replace(
        container=weakref.ref(params),
        state=weakref.ref(state),
        prints=fingerprint(lp + ls),
        storages=storages,
    )
