"""Shape ops over the batch dims only (feature dims are kept): ``reshape``, ``view``,
``permute``, ``transpose``, ``squeeze``, ``unsqueeze``, ``flatten``, ``unflatten``,
``expand``, and :func:`_map_shape` / :func:`_probe`, the helpers that apply a batch-dims-only
shape function to every leaf and derive the new batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .. import _nontensor as nontensor
from .._jagged._layout import has_jagged, is_jagged
from .._jagged._layout import map_batch as jagged_map_batch
from .._nontensor import NonTensor
from .._tree import leaves_and_nontensors, map_leaves
from ._structure import _needs_a_batch_dim, norm_dim


def _probe(node: Any) -> tuple[Tensor, int]:
    """A tensor whose leading dims are the node's batch dims, and its feature ndim.

    The first leaf when there is one (no extra work), else a meta tensor of the batch shape.
    """
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            if not is_jagged(v):  # a jagged leaf's shape holds a ragged size: not a probe
                return v, v.ndim - len(node._batch_size)
        elif v is not None and not isinstance(v, NonTensor):
            t, _ = _probe(v)
            return t, t.ndim - len(node._batch_size)
    return torch.empty(node._batch_size, device="meta"), 0


def _batch_of(result: Tensor, feat: int) -> torch.Size:
    return result.shape[: result.ndim - feat]


def _map_shape(
    node: Any,
    fn: Callable[[Tensor], Tensor],
    nt_fn: Callable[[NonTensor], NonTensor] | None = None,
) -> Any:
    """Apply a batch-dims-only shape function to every leaf; derive the new batch size.

    Per-sample non-tensor leaves follow the batch through ``fn`` applied to their positions
    (``nontensor.map_batch``), or through ``nt_fn`` when given (a Python rule of the same op).
    """
    ls, nts = leaves_and_nontensors(node)
    new_nts = None
    if nts:
        new_nts = (
            [nt_fn(nt) for _, nt in nts]
            if nt_fn is not None
            else nontensor.map_batch(nts, fn, ls[0].device if ls else None)
        )
    if ls:
        if has_jagged(ls):
            out = [
                jagged_map_batch(x, fn, node, i) if is_jagged(x) else fn(x)
                for i, x in enumerate(ls)
            ]
        else:
            out = [fn(x) for x in ls]
        first = ls[0]
        # feature ndim of the first leaf, relative to the root's batch dims
        feat = first.ndim - len(node._batch_size)
        return map_leaves(node, out, _batch_of(out[0], feat), nts=new_nts)
    meta = fn(torch.empty(node._batch_size, device="meta"))
    return map_leaves(node, [], meta.shape, nts=new_nts)


def _shape_arg(shape: tuple[Any, ...], op: str) -> tuple[Any, ...]:
    """The shape / dims argument of ``op`` given as ints or one sequence (as torch takes it)."""
    if not shape:
        raise TypeError(E.SHAPE_ARG_MISSING.format(op=op))
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        return tuple(shape[0])
    return tuple(shape)


def _wrap_dim(dim: int, batch_size: torch.Size) -> int:
    """A batch dim as torch wraps a tensor's dim: a 0-d shape accepts 0 and -1."""
    return norm_dim(dim, max(len(batch_size), 1), batch_size)


def _infer_shape(shape: tuple[Any, ...], numel: Any) -> tuple[Any, ...]:
    """The batch shape ``shape`` (one ``-1`` allowed) for ``numel`` elements, with torch's rules
    and error type (``RuntimeError``), so batch shape ops behave like a plain tensor's.

    Only what the leaves cannot check is checked here (in Python, on the static arguments),
    so data-dependent sizes (after a boolean mask) trace like a plain tensor's reshape.
    """
    infer = None
    known = 1
    for i, s in enumerate(shape):
        if s == -1:
            if infer is not None:
                raise RuntimeError(E.RESHAPE_TWO_INFERRED)
            infer = i
        elif s < 0:
            raise RuntimeError(E.RESHAPE_NEGATIVE.format(dim=s))
        else:
            known = known * s
    if infer is None:
        return tuple(shape)  # the size check is the leaves' own reshape (or the probe's)
    if known == 0:
        msg = E.RESHAPE_AMBIGUOUS if numel == 0 else E.RESHAPE_INVALID
        raise RuntimeError(msg.format(shape=list(shape), numel=numel))
    # numel not divisible by ``known``: the leaves' reshape raises torch's own error
    return tuple(numel // known if i == infer else s for i, s in enumerate(shape))


def reshape(node: Any, *shape: Any) -> Any:
    """Reshape the batch dims (``-1`` allowed); feature dims are kept.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3, 2), batch_size=[4, 3])
        >>> td.reshape(-1).batch_size, td.reshape(-1)["a"].shape
        (torch.Size([12]), torch.Size([12, 2]))
    """
    bs = node._batch_size
    bd = len(bs)
    new = _infer_shape(_shape_arg(shape, "reshape"), math.prod(bs))
    return _map_shape(node, lambda x: x.reshape(new + x.shape[bd:]))


def view(node: Any, *shape: Any) -> Any:
    """View the batch dims with a new shape (leaves must be viewable)."""
    bs = node._batch_size
    bd = len(bs)
    new = _infer_shape(_shape_arg(shape, "view"), math.prod(bs))
    return _map_shape(node, lambda x: x.view(new + x.shape[bd:]))


def permute(node: Any, *dims: Any) -> Any:
    """Permute the batch dims.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3, 2), batch_size=[4, 3])
        >>> td.permute(1, 0)["a"].shape
        torch.Size([3, 4, 2])
    """
    bs = node._batch_size
    bd = len(bs)
    dims = _shape_arg(dims, "permute")
    if len(dims) != bd:
        raise RuntimeError(E.PERMUTE_COUNT.format(bd=bd, batch_size=tuple(bs), dims=dims))
    perm = tuple(_wrap_dim(d, bs) for d in dims)
    if sorted(perm) != list(range(bd)):
        raise RuntimeError(E.PERMUTE_REPEATED.format(dims=dims))
    return _map_shape(node, lambda x: x.permute(perm + tuple(range(bd, x.ndim))))


def transpose(node: Any, dim0: int, dim1: int) -> Any:
    """Swap two batch dims."""
    bs = node._batch_size
    d0, d1 = _wrap_dim(dim0, bs), _wrap_dim(dim1, bs)
    if not bs:
        return node  # a 0-d batch: torch's transpose(0, 0) of a 0-d tensor is the tensor
    return _map_shape(node, lambda x: x.transpose(d0, d1))


def squeeze(node: Any, dim: int | Sequence[int] | None = None) -> Any:
    """Remove batch dims of size 1 (all of them, ``dim``, or a tuple of dims)."""
    bs = node._batch_size
    if dim is None:
        dims = tuple(i for i, s in enumerate(bs) if s == 1)
    else:
        asked = dim if isinstance(dim, (tuple, list)) else (dim,)
        wrapped = [_wrap_dim(d, bs) for d in asked]
        dims = tuple(d for d in sorted(set(wrapped)) if bs and bs[d] == 1)
    if not dims:
        return node
    return _map_shape(node, lambda x: x.squeeze(dims))


def unsqueeze(node: Any, dim: int) -> Any:
    """Insert a batch dim of size 1 at ``dim`` (in ``[-bd-1, bd]``)."""
    bs = node._batch_size
    d = norm_dim(dim, len(bs) + 1, bs)
    return _map_shape(node, lambda x: x.unsqueeze(d))


def flatten(node: Any, start_dim: int = 0, end_dim: int = -1) -> Any:
    """Flatten batch dims ``start_dim..end_dim`` into one."""
    bs = node._batch_size
    bd = len(bs)
    s, e = _wrap_dim(start_dim, bs), _wrap_dim(end_dim, bs)
    if s > e:
        raise RuntimeError(E.FLATTEN_ORDER.format(start=start_dim, end=end_dim))
    if bd == 0:
        return unsqueeze(node, 0)  # torch: flattening a 0-d tensor gives one dim
    return _map_shape(node, lambda x: x.flatten(s, e))


def unflatten(node: Any, dim: int, sizes: Sequence[int]) -> Any:
    """Split batch dim ``dim`` into ``sizes``."""
    bs = node._batch_size
    _needs_a_batch_dim(bs, "unflatten")
    d = norm_dim(dim, len(bs), bs)
    sizes = tuple(sizes)
    return _map_shape(node, lambda x: x.unflatten(d, sizes))


def expand(node: Any, *shape: Any) -> Any:
    """Expand the batch dims to ``shape`` (new leading dims allowed, ``-1`` keeps a dim)."""
    bs = node._batch_size
    bd = len(bs)
    new = _shape_arg(shape, "expand")
    if len(new) < bd:
        raise RuntimeError(E.EXPAND_FEWER.format(shape=new, batch_size=tuple(bs)))
    return _map_shape(node, lambda x: x.expand(new + x.shape[bd:]))
