"""Indexing over the batch dims: ``node[idx]`` (:func:`index`), out-of-place indexed
updates (:func:`index_update`) and the JAX-style ``td.at[idx].set/add/get`` accessor
(:class:`AtIndexer`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .. import _nontensor as nontensor
from .._compat import is_batchedtensor
from .._tree import is_node, leaves, map_leaves
from ._math import as_operand
from ._shape import _map_shape
from ._structure import match_structure

_is_batched = is_batchedtensor


def _index_parts(idx: Any) -> tuple[Any, ...]:
    if not isinstance(idx, tuple):
        idx = (idx,)
    out = []
    for i in idx:
        if isinstance(i, list):
            # an empty list selects nothing (a long index, as torch reads it)
            i = torch.tensor(i) if i else torch.zeros(0, dtype=torch.long)
        out.append(i)
    return tuple(out)


def _dims_used(i: Any) -> int:
    if i is None or i is Ellipsis or isinstance(i, bool):
        return 0
    if isinstance(i, Tensor) and i.dtype == torch.bool:
        return i.ndim
    return 1


def normalize_index(idx: Any, batch_size: torch.Size) -> tuple[Any, ...]:
    """Expand ``Ellipsis`` over the batch dims only and check the index fits them."""
    parts = _index_parts(idx)
    bd = len(batch_size)
    used = sum(_dims_used(i) for i in parts)
    if used > bd:
        raise IndexError(
            E.TOO_MANY_INDICES.format(
                batch_size=tuple(batch_size), batch_dims=bd, index=idx, used=used
            )
        )
    n_ell = sum(1 for i in parts if i is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_ell == 1:
        pos = next(p for p, i in enumerate(parts) if i is Ellipsis)
        fill = (slice(None),) * (bd - used)
        parts = parts[:pos] + fill + parts[pos + 1 :]
    return parts


_ROW_DTYPES = (torch.int64, torch.int32)


def _is_row_gather(idx: Any, node: Any) -> bool:
    """``idx`` is a 1-D integer tensor (not vmapped) picking rows of the first batch dim."""
    return (
        isinstance(idx, Tensor)
        and idx.ndim == 1
        and idx.dtype in _ROW_DTYPES
        and len(node._batch_size) > 0
        and not _is_batched(idx)
    )


def index(node: Any, idx: Any) -> Any:
    """``node[idx]`` over the batch dims: int, slice, None, Ellipsis, bool mask, long tensor,
    list, and tuples of these.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3, 2), batch_size=[4, 3])
        >>> td[1:3, 0].batch_size
        torch.Size([2])
    """
    key: Any
    if isinstance(idx, (int, slice)) and not isinstance(idx, bool) and node._batch_size:
        key = idx  # fast path: one int or slice on the first batch dim
    elif _is_row_gather(idx, node):
        # rows of the first batch dim (a replay sample): ``index_select`` is several times
        # faster than advanced indexing on CPU; negative rows are wrapped first, so the
        # values and the error type (IndexError out of range) are those of ``x[idx]``
        pos = torch.where(idx < 0, idx + node._batch_size[0], idx)
        return _map_shape(
            node, lambda x: x.index_select(0, pos) if x.device == pos.device else x[idx]
        )
    else:
        parts = normalize_index(idx, node._batch_size)
        key = parts[0] if len(parts) == 1 else parts  # x[i] is cheaper than x[(i,)]
    if isinstance(key, (int, slice)) and not isinstance(key, bool):
        # non-tensor leaves: indexed in Python (no graph break)
        return _map_shape(node, lambda x: x[key], lambda nt: nontensor.getitem(nt, key))
    return _map_shape(node, lambda x: x[key])


def index_update(node: Any, idx: Any, value: Any, op: str = "set") -> Any:
    """Out-of-place ``node[idx] = value`` (``op="set"``) or ``+= value`` (``op="add"``).

    ``"add"`` accumulates repeated indices like JAX's ``x.at[idx].add(v)``
    (``index_add``): ``at[[0, 0]].add(1)`` adds 2 to row 0. ``"set"`` with repeated
    indices keeps one of the written values (which one is unspecified, as in JAX).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(3), batch_size=[3])
        >>> td.at[[0, 0, 2]].add(1.0)["a"].tolist()
        [2.0, 0.0, 1.0]
    """
    parts = normalize_index(idx, node._batch_size)
    ls = leaves(node)
    if is_node(value):
        value = match_structure(node, value, "at[...].set")
        vs: Sequence[Any] = leaves(value)
    else:
        value = as_operand(value)
        vs = [value] * len(ls)
    if op == "set":
        out = []
        for x, v in zip(ls, vs):
            y = x.clone()
            # the value takes the leaf's dtype (as JAX's at[].set; index_put under vmap needs it)
            y[parts] = torch.as_tensor(v, dtype=x.dtype, device=x.device)
            out.append(y)
        return map_leaves(node, out)
    bs = node._batch_size
    # flat batch positions selected by the index, repeats included
    sel = torch.arange(math.prod(bs), device=ls[0].device if ls else None).reshape(bs)[parts]
    pos = sel.reshape(-1)
    out = []
    for x, v in zip(ls, vs):
        feat = x.shape[len(bs) :]
        src = torch.as_tensor(v, dtype=x.dtype, device=x.device).broadcast_to(sel.shape + feat)
        flat = x.reshape(-1, *feat).index_add(0, pos, src.reshape(-1, *feat))
        out.append(flat.reshape(x.shape))
    return map_leaves(node, out)


class AtIndexer:
    """``td.at[idx]``: out-of-place indexed updates, like JAX's ``x.at[idx].set(v)``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(3), batch_size=[3])
        >>> td.at[1].set(5.0)["a"].tolist(), td["a"].tolist()
        ([0.0, 5.0, 0.0], [0.0, 0.0, 0.0])
    """

    __slots__ = ("_node",)

    def __init__(self, node: Any) -> None:
        self._node = node

    def __getitem__(self, idx: Any) -> _AtRef:
        return _AtRef(self._node, idx)


class _AtRef:
    __slots__ = ("_idx", "_node")

    def __init__(self, node: Any, idx: Any) -> None:
        self._node = node
        self._idx = idx

    def set(self, value: Any) -> Any:
        """A new container with ``value`` written at the index."""
        return index_update(self._node, self._idx, value, "set")

    def add(self, value: Any) -> Any:
        """A new container with ``value`` added at the index."""
        return index_update(self._node, self._idx, value, "add")

    def get(self) -> Any:
        """Same as ``node[idx]``."""
        return index(self._node, self._idx)
