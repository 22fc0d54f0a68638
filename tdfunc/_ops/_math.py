"""Elementwise arithmetic: ``binary`` / ``unary`` / ``elementwise`` (with one
``torch._foreach_*`` call where valid) and ``as_operand``. Reductions live with the other ops
over batch dims in :mod:`._batchdim`.

The rule for a plain tensor operand next to a container lives here too
(:func:`check_plain_operand`, :func:`batch_view`), shared by the operators and the pointwise
family (:func:`tdfunc._ops._pointwise.lift`): a plain tensor is shaped like the batch. It
must broadcast to the batch size (its dims line up with the *last* batch dims, each of size
1 or that dim's size), and it is expanded over each leaf's feature dims. Python numbers and
0-d tensors are scalars and go to every leaf as they are.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .._compat import (
    foreach_add,
    foreach_div,
    foreach_mul,
    foreach_sub,
    functorch_transforms_active,
    is_batchedtensor,
)
from .._jagged._layout import has_jagged
from .._tree import is_node, leaves, with_leaves
from .._twins import traced_as
from ._structure import check_batch_invariant, match_operands, match_structure

_is_batched = is_batchedtensor
#: not ``torch.is_grad_enabled()`` in traced code: a caller's frame that reaches ``torch``
#: through its own globals would make Dynamo check that both are one module with a Python
#: guard on every compiled call (a function reached two ways costs no such guard)
_is_grad_enabled = torch.is_grad_enabled
_requires_grad = operator.attrgetter("requires_grad")


# --------------------------------------------------------------------------------------
# a plain tensor operand: shaped like the batch
# --------------------------------------------------------------------------------------
#: the operators' symbols, for the per-leaf spelling an error suggests
_SYMBOLS: dict[Any, str] = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.floordiv: "//",
    operator.mod: "%",
    operator.pow: "**",
    operator.and_: "&",
    operator.or_: "|",
    operator.xor: "^",
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}


def fits_batch(shape: Sequence[int], batch_size: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``batch_size`` without growing it: at most
    as many dims as the batch, lined up with its last dims, each of size 1 or that dim's.

    Example:
        >>> fits_batch((3,), (2, 3)), fits_batch((2, 1), (2, 3)), fits_batch((2,), (2, 3))
        (True, True, False)
    """
    n, bd = len(shape), len(batch_size)
    if n > bd:
        return False
    return all(d == 1 or d == b for d, b in zip(shape, batch_size[bd - n :]))


def check_plain_operand(w: Tensor, batch_size: torch.Size, op: Any, spelling: str) -> None:
    """``ValueError`` unless the plain tensor ``w`` fits the batch (:func:`fits_batch`);
    ``spelling`` is the per-leaf call the message suggests (``x * w``).

    Example:
        >>> import torch
        >>> check_plain_operand(torch.ones(3), torch.Size([2, 3]), "mul", "x * w")
        >>> check_plain_operand(torch.ones(2), torch.Size([2, 3]), "mul", "x * w")
        Traceback (most recent call last):
        ...
        ValueError: mul: a plain tensor of shape (2,) next to a container must broadcast to ...
    """
    if not fits_batch(w.shape, batch_size):
        raise ValueError(
            E.PLAIN_OPERAND.format(
                op=op if isinstance(op, str) else getattr(op, "__name__", str(op)),
                shape=tuple(w.shape),
                batch_size=tuple(batch_size),
                spelling=spelling,
            )
        )


def op_spelling(op: Any, swapped: bool) -> str:
    """How a per-leaf call of ``op`` with the plain tensor ``w`` reads (error path only)."""
    sym = _SYMBOLS.get(op)
    if sym is not None:
        return f"w {sym} x" if swapped else f"x {sym} w"
    name = getattr(op, "__name__", str(op))
    return f"torch.{name}(w, x)" if swapped else f"torch.{name}(x, w)"


def batch_view(w: Tensor, batch_ndim: int, leaf_ndim: int) -> Tensor:
    """``w`` (a tensor that fits the batch) as a view with one trailing 1 per feature dim of a
    leaf of ``leaf_ndim`` dims: torch's broadcasting then lines its dims up with the batch
    dims and expands it over the feature dims.

    Example:
        >>> import torch
        >>> batch_view(torch.ones(3), 2, 4).shape  # batch (2, 3), leaf (2, 3, 5, 6)
        torch.Size([3, 1, 1])
    """
    return w.reshape(w.shape + (1,) * (leaf_ndim - batch_ndim))


def _is_plain(v: Any) -> bool:
    """A plain tensor with dims (0-d tensors are scalars)."""
    return isinstance(v, Tensor) and v.ndim > 0


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
    below, which reads the same facts leaf by leaf. A jagged leaf (``torch.nested``, asked
    under its transform wrappers: ``_jagged._layout.has_jagged``) has no foreach kernels: the leaves
    of its container go one by one."""
    if not ls or (functorch_transforms_active() and any(map(_is_batched, ls))):
        return False
    if has_jagged(ls):
        return False
    if _is_grad_enabled() and any(map(_requires_grad, ls)):
        d = ls[0].dtype
        return all(x.dtype == d for x in ls)
    return True


@traced_as(_can_foreach)
def _can_foreach_traced(ls: list[Tensor]) -> bool:
    if not ls or any(map(_is_batched, ls)) or has_jagged(ls):
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
        b = match_structure(a, b, f"{getattr(op, '__name__', op)}")
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
        if _is_plain(b):  # shaped like the batch
            return with_leaves(a, _with_plain(op, ls, b, a._batch_size, False))
        return with_leaves(a, [op(x, b) for x in ls])
    ls = leaves(b)
    if (
        op in _COMMUTATIVE
        and isinstance(a, (int, float))
        and not isinstance(a, bool)
        and _can_foreach(ls)
    ):
        # ``lr * grads``: a number times (plus) every leaf is one foreach call
        return with_leaves(b, _FOREACH[op](ls, a))
    if _is_plain(a):
        return with_leaves(b, _with_plain(op, ls, a, b._batch_size, True))
    return with_leaves(b, [op(a, x) for x in ls])


def _with_plain(
    op: Callable[[Any, Any], Any], ls: list[Tensor], w: Tensor, bs: torch.Size, swapped: bool
) -> list[Any]:
    """``op(leaf, w)`` (``op(w, leaf)`` when ``swapped``) for every leaf, ``w`` a plain tensor
    shaped like the batch: checked once, viewed once per leaf rank."""
    if not fits_batch(w.shape, bs):
        check_plain_operand(w, bs, op, op_spelling(op, swapped))
    bd = len(bs)
    views: dict[int, Tensor] = {}
    out = []
    for x in ls:
        v = views.get(x.ndim)
        if v is None:
            v = views[x.ndim] = batch_view(w, bd, x.ndim)
        out.append(op(v, x) if swapped else op(x, v))
    return out


def unary(op: Callable[[Tensor], Tensor], node: Any) -> Any:
    """Elementwise ``op`` on every leaf."""
    return with_leaves(node, [op(x) for x in leaves(node)])


def elementwise(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Call a torch elementwise function with node arguments replaced by their leaves; a plain
    tensor argument is shaped like the batch (:func:`check_plain_operand`, :func:`batch_view`).

    Example:
        >>> import operator, torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), batch_size=[2])
        >>> elementwise(operator.mul, (td, torch.tensor([1.0, 2.0])), {})["a"].tolist()
        [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    """
    args, kwargs, nodes = match_operands(args, kwargs, getattr(func, "__name__", "op"))
    ref = nodes[0]
    bs = ref._batch_size
    plain = [i for i, a in enumerate(args) if _is_plain(a)]
    kplain = [k for k, v in kwargs.items() if _is_plain(v)] if kwargs else []
    for i in plain:
        if not fits_batch(args[i].shape, bs):
            w_first = not any(is_node(a) for a in args[:i])
            check_plain_operand(args[i], bs, func, op_spelling(func, w_first))
    for k in kplain:
        if not fits_batch(kwargs[k].shape, bs):
            name = getattr(func, "__name__", "f")
            check_plain_operand(kwargs[k], bs, func, f"torch.{name}(x, {k}=w)")
    cols = [leaves(a) if is_node(a) else None for a in args]
    kcols = {k: leaves(v) for k, v in kwargs.items() if is_node(v)} if kwargs else {}
    ls = leaves(ref)
    bd = len(bs)
    out = []
    for j, x in enumerate(ls):
        call_args = [c[j] if c is not None else a for a, c in zip(args, cols)]
        for i in plain:
            call_args[i] = batch_view(args[i], bd, x.ndim)
        kw = kwargs
        if kcols or kplain:
            kw = {k: (kcols[k][j] if k in kcols else v) for k, v in kwargs.items()}
            for k in kplain:
                kw[k] = batch_view(kwargs[k], bd, x.ndim)
        out.append(func(*call_args, **kw))
    if len(nodes) > 1:  # containers of one structure but other batch sizes may broadcast
        check_batch_invariant(ref, out, bs, getattr(func, "__name__", "op"))
    return with_leaves(ref, out)
