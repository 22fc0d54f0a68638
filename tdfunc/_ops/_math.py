"""Elementwise arithmetic: ``binary`` / ``unary`` / ``elementwise`` (with one
``torch._foreach_*`` call where valid) and ``as_operand``. Reductions live with the other ops
over batch dims in :mod:`._batchdim`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import (
    foreach_add,
    foreach_div,
    foreach_mul,
    foreach_sub,
    functorch_transforms_active,
    is_batchedtensor,
)
from .._tree import is_node, leaves, with_leaves
from .._twins import traced_as
from ._structure import check_batch_invariant, check_same_structure

_is_batched = is_batchedtensor
#: not ``torch.is_grad_enabled()`` in traced code: a caller's frame that reaches ``torch``
#: through its own globals would make Dynamo check that both are one module with a Python
#: guard on every compiled call (a function reached two ways costs no such guard)
_is_grad_enabled = torch.is_grad_enabled
_requires_grad = operator.attrgetter("requires_grad")


# --------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------
_FOREACH: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.add: foreach_add,
    operator.sub: foreach_sub,
    operator.mul: foreach_mul,
    operator.truediv: foreach_div,
}

#: ``number op leaf == leaf op number`` for these (same values, same type promotion)
_COMMUTATIVE = (operator.add, operator.mul)


def as_operand(x: Any) -> Any:
    if isinstance(x, (Tensor, int, float, bool, complex)) or is_node(x):
        return x
    if hasattr(x, "__array__"):
        return torch.as_tensor(x)
    return x


def _can_foreach(ls: list[Tensor]) -> bool:
    """One ``torch._foreach_*`` call is valid: leaves are not vmapped (foreach has no batching
    rule) and, when autograd records, share one dtype (foreach autograd rejects mixed lists
    such as a float leaf that requires grad next to an integer leaf).

    Eagerly no leaf is checked for vmap while no functorch transform is active, and the
    attributes are read through C getters (20 leaves: 2.4 -> 0.9 us); Dynamo traces the twin
    below, which reads the same facts leaf by leaf."""
    if not ls or (functorch_transforms_active() and any(map(_is_batched, ls))):
        return False
    if _is_grad_enabled() and any(map(_requires_grad, ls)):
        d = ls[0].dtype
        return all(x.dtype == d for x in ls)
    return True


@traced_as(_can_foreach)
def _can_foreach_traced(ls: list[Tensor]) -> bool:
    if not ls or any(map(_is_batched, ls)):
        return False
    if _is_grad_enabled() and any(x.requires_grad for x in ls):
        d = ls[0].dtype
        return all(x.dtype == d for x in ls)
    return True


def binary(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """Elementwise ``op(a, b)`` where one or both operands are nodes of the same structure.

    Numbers and same-shaped TensorDict pairs use one ``torch._foreach_*`` call for
    ``+ - * /`` (per-leaf ops inside ``torch.vmap``, where foreach has no batching rule).

    Example:
        >>> import operator, torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2))
        >>> tdfunc._ops.binary(operator.mul, td, 3)["a"].tolist()
        [3.0, 3.0]
    """
    if is_node(a) and is_node(b):
        check_same_structure(a, b, f"{getattr(op, '__name__', op)}")
        la, lb = leaves(a), leaves(b)
        f = _FOREACH.get(op)
        if (
            f is not None
            and _can_foreach(la)
            and _can_foreach(lb)
            and all(x.shape == y.shape for x, y in zip(la, lb))
        ):
            return with_leaves(a, f(la, lb))
        return with_leaves(a, [op(x, y) for x, y in zip(la, lb)])
    if is_node(a):
        ls = leaves(a)
        f = _FOREACH.get(op)
        if (
            f is not None
            and isinstance(b, (int, float))
            and not isinstance(b, bool)
            and _can_foreach(ls)
        ):
            return with_leaves(a, f(ls, b))
        out = [op(x, b) for x in ls]
        if isinstance(b, Tensor) and b.ndim > 0:
            check_batch_invariant(a, out, a._batch_size, getattr(op, "__name__", "op"))
        return with_leaves(a, out)
    ls = leaves(b)
    if (
        op in _COMMUTATIVE
        and isinstance(a, (int, float))
        and not isinstance(a, bool)
        and _can_foreach(ls)
    ):
        # ``lr * grads``: a number times (plus) every leaf is one foreach call
        return with_leaves(b, _FOREACH[op](ls, a))
    out = [op(a, x) for x in ls]
    if isinstance(a, Tensor) and a.ndim > 0:
        check_batch_invariant(b, out, b._batch_size, getattr(op, "__name__", "op"))
    return with_leaves(b, out)


def unary(op: Callable[[Tensor], Tensor], node: Any) -> Any:
    """Elementwise ``op`` on every leaf."""
    return with_leaves(node, [op(x) for x in leaves(node)])


def elementwise(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Call a torch elementwise function with node arguments replaced by their leaves."""
    nodes = [a for a in args if is_node(a)]
    ref = nodes[0]
    for n in nodes[1:]:
        check_same_structure(ref, n, getattr(func, "__name__", "op"))
    cols = [leaves(a) if is_node(a) else None for a in args]
    n_leaves = len(next(c for c in cols if c is not None))
    out = []
    for i in range(n_leaves):
        call_args = [c[i] if c is not None else a for a, c in zip(args, cols)]
        out.append(func(*call_args, **kwargs))
    check_batch_invariant(ref, out, ref._batch_size, getattr(func, "__name__", "op"))
    return with_leaves(ref, out)
