"""Jagged leaves: ``torch.nested`` tensors with ``layout=torch.jagged`` as leaves of a container.

A jagged leaf has one batch dim (dim 0: the container's ``batch_size`` is ``(B,)`` where it
sits) and its ragged dim right after it. Elementwise ops run on it leaf by leaf (torch has no
``_foreach_*`` kernels for it: see ``_ops._math._can_foreach``). What torch does not define on
the batch dim of a jagged tensor, tdfunc writes here over its values and offsets:

* rows of the batch (a slice, an index tensor, a mask: the op's own per-leaf function is
  applied to ``arange(B)`` and the rows it returns are gathered), ``cat`` along the batch,
  ``split`` along it;
* everything else that would act on the batch dim alone (a reduction, a scan, ``sort``,
  ``flip``, a batch reshape to more than one dim, ``stack``) raises :class:`JaggedOpError`
  naming the key and the operation.

Gathering rows reads the row lengths back (``repeat_interleave`` with an output size read
from the offsets): eager work, a graph break inside ``torch.compile``. An int index and every
elementwise op compile to one graph.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._tree import Node, leaves_with_paths
from ._twins import traced_as

JAGGED_OP = (
    "key {key}: {op} is not defined by torch on the batch dim of a jagged (torch.nested) "
    "leaf{detail}; exclude the key, or convert it with tdfunc.to_padded first"
)


class JaggedOpError(TypeError):
    """An operation that torch does not define on a jagged leaf (``torch.nested``,
    ``layout=torch.jagged``): the message names the key and the operation. A ``TypeError``.

    Example:
        >>> import tdfunc
        >>> issubclass(tdfunc.JaggedOpError, TypeError)
        True
    """


def is_jagged(x: Any) -> bool:
    """True for a ``torch.nested`` tensor of the jagged layout.

    Example:
        >>> import torch
        >>> is_jagged(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged))
        True
    """
    return isinstance(x, Tensor) and x.is_nested and x.layout == torch.jagged


def _key_of(node: Any, i: int) -> str:
    if node is None:
        return "<a jagged tensor>"
    path = leaves_with_paths(node)[i][0]
    return repr(path[0]) if len(path) == 1 else repr(path)


def error(node: Any, i: int, op: str, detail: str = "") -> JaggedOpError:
    """The :class:`JaggedOpError` for leaf ``i`` (in :func:`tdfunc._tree.leaves` order)."""
    return JaggedOpError(JAGGED_OP.format(key=_key_of(node, i), op=op, detail=detail))


def first_jagged(node: Node) -> int | None:
    """The position of the first jagged leaf of ``node`` (``None`` when it has none)."""
    from ._tree import leaves

    for i, x in enumerate(leaves(node)):
        if x.is_nested:
            return i
    return None


#: ``x.is_nested`` read without a Python attribute lookup per leaf (eager only: Dynamo
#: does not trace an ``attrgetter``; it traces :func:`_has_jagged_traced`)
_IS_NESTED = operator.attrgetter("is_nested")


def has_jagged(ls: Sequence[Tensor]) -> bool:
    """True when one of the tensors ``ls`` is a ``torch.nested`` tensor (one C-level pass).

    Example:
        >>> import torch
        >>> has_jagged([torch.zeros(2)])
        False
    """
    return any(map(_IS_NESTED, ls))


@traced_as(has_jagged)
def _has_jagged_traced(ls: Sequence[Tensor]) -> bool:
    return any(x.is_nested for x in ls)


def refuse(node: Node, op: str, detail: str = "", ls: Sequence[Tensor] | None = None) -> None:
    """Raise :class:`JaggedOpError` for ``op`` when ``node`` holds a jagged leaf (``ls``: its
    leaves, when the caller has them: no second walk)."""
    if ls is not None and not has_jagged(ls):
        return
    i = first_jagged(node)
    if i is not None:
        raise error(node, i, op, detail)


def _lengths(x: Any) -> tuple[Tensor, Tensor]:
    """The start and the length of every row of a jagged tensor."""
    off = x.offsets()
    lengths = x.lengths()
    if lengths is None:
        return off[:-1], off[1:] - off[:-1]
    return off[:-1], lengths


def take_rows(x: Any, rows: Tensor) -> Tensor:
    """The rows ``rows`` (1-D, non-negative) of a jagged tensor, as a new jagged tensor.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.arange(2.), torch.arange(3.)], layout=torch.jagged)
        >>> [r.tolist() for r in take_rows(nt, torch.tensor([1, 0, 1])).unbind()]
        [[0.0, 1.0, 2.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
    """
    starts, lens = _lengths(x)
    rows = rows.to(starts.device)
    starts, lens = starts[rows], lens[rows]
    offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
    total = int(offsets[-1])
    pos = torch.repeat_interleave(starts - offsets[:-1], lens, output_size=total)
    pos = pos + torch.arange(total, device=pos.device, dtype=pos.dtype)
    return torch.nested.nested_tensor_from_jagged(x.values()[pos], offsets)


def map_batch(x: Tensor, fn: Callable[[Tensor], Tensor], node: Any, i: int) -> Tensor:
    """A batch-dims-only function ``fn`` (indexing, a batch shape op) on jagged leaf ``i``:
    an int index is torch's own; rows are gathered; anything that leaves other than one batch
    dim raises :class:`JaggedOpError`."""
    idx = fn(torch.arange(x.shape[0]))
    if idx.ndim == 0:
        return fn(x)
    check_ragged_dim(x, node, i, "a batch op")
    if idx.ndim == 1:
        return take_rows(x, idx)
    raise error(
        node, i, "a batch op", f" (it gives batch shape {tuple(idx.shape)}; a jagged leaf has one)"
    )


def check_ragged_dim(x: Any, node: Any, i: int, op: str) -> None:
    """:class:`JaggedOpError` unless the ragged dim of jagged leaf ``i`` is dim 1 (right after
    the batch dim: the layout whose rows the functions here gather)."""
    if x._ragged_idx != 1:
        raise error(
            node, i, op, f" with its ragged dim at dim {x._ragged_idx} (tdfunc needs dim 1)"
        )


def cat(xs: Sequence[Any], node: Any = None, i: int = 0) -> Tensor:
    """Jagged tensors joined along the batch dim (values and offsets concatenated); ``node``
    and ``i`` (the first container and the leaf's position) name the key in an error.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.arange(2.), torch.arange(3.)], layout=torch.jagged)
        >>> [len(r) for r in cat([nt, nt]).unbind()]
        [2, 3, 2, 3]
    """
    for x in xs:
        check_ragged_dim(x, node, i, "cat")
    xs = [x if x.lengths() is None else take_rows(x, torch.arange(x.shape[0])) for x in xs]
    values = torch.cat([x.values() for x in xs])
    parts = [xs[0].offsets()]
    end = parts[0][-1:]
    for x in xs[1:]:
        off = x.offsets()
        parts.append(off[1:] + end)
        end = parts[-1][-1:] if off.numel() > 1 else end
    return torch.nested.nested_tensor_from_jagged(values, torch.cat(parts))


def align(m: Tensor, lead: int, leaf: Any) -> Tensor:
    """A tensor ``m`` whose ``lead`` leading dims name batch positions (a batch mask, a
    per-row weight) as a jagged tensor of ``leaf``'s rows (each row's value repeated over the
    row and its feature dims), so that torch's jagged kernels take it beside ``leaf``.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> align(torch.tensor([True, False]), 1, nt).values().tolist()
        [True, True, False, False, False]
    """
    if lead == 0 or m.ndim == 0:
        return m
    if leaf.lengths() is not None:
        raise JaggedOpError(
            "a batch-shaped tensor next to a jagged leaf with holes (lengths): compact the leaf "
            "first (tdfunc.as_jagged, or index it with its rows)"
        )
    v = leaf.values()
    _, lens = _lengths(leaf)
    rows = m.repeat_interleave(lens.to(m.device), dim=0, output_size=v.shape[0])
    rows = rows.reshape(rows.shape + (1,) * (v.ndim - rows.ndim)).expand(v.shape)
    return torch.nested.nested_tensor_from_jagged(rows, leaf.offsets())


def call_aligned(
    func: Callable[..., Any],
    leaf: Tensor,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    pos: int,
    views: Sequence[tuple[int, int]],
    kviews: Sequence[tuple[str, int]],
) -> Any:
    """``func`` on a jagged ``leaf`` (at position ``pos`` of ``args``) with the batch-aligned
    tensors (``views``: positions, ``kviews``: keywords, each with its batch ndim) made jagged
    tensors of its rows (:func:`align`)."""
    a = list(args)
    for i, lead in views:
        a[i] = align(args[i], lead, leaf)
    kw = {**kwargs}
    for k, lead in kviews:
        kw[k] = align(kwargs[k], lead, leaf)
    a[pos] = leaf
    return func(*a, **kw)


def jagged_problem(
    values: Tensor, offsets: Tensor, lengths: Tensor | None, batch_size: Sequence[int]
) -> str | None:
    """What is wrong with the parts of a jagged tensor read from a file or a peer (``None``
    when nothing is): checked before torch builds the tensor from them.

    Example:
        >>> import torch
        >>> jagged_problem(torch.zeros(5), torch.tensor([0, 2, 1]), None, [2])
        'offsets decrease'
    """
    if offsets.ndim != 1 or offsets.dtype not in (torch.int64, torch.int32):
        return f"offsets must be 1-D int64 or int32, got {offsets.dtype} {tuple(offsets.shape)}"
    if values.ndim < 1:
        return "values must have at least one dim"
    if len(batch_size) != 1 or offsets.numel() != batch_size[0] + 1:
        return f"{offsets.numel()} offsets do not match batch_size {tuple(batch_size)}"
    o = offsets.as_subclass(Tensor).long()
    n = values.shape[0]
    if bool((o[1:] < o[:-1]).any()):
        return "offsets decrease"
    if int(o[0]) < 0 or int(o[-1]) > n:
        return f"offsets {int(o[0])}..{int(o[-1])} are not within the {n} value rows"
    if lengths is not None:
        if lengths.ndim != 1 or lengths.dtype != offsets.dtype or lengths.numel() != batch_size[0]:
            return f"lengths must be 1-D {offsets.dtype} with one entry per row"
        ln = lengths.as_subclass(Tensor).long()
        if bool((ln < 0).any()) or bool((o[:-1] + ln > n).any()):
            return "a row (offset + length) runs outside the values"
    return None


def from_read_parts(values: Tensor, offsets: Tensor, lengths: Tensor | None) -> Tensor:
    """The jagged tensor of parts read from a file (checked by :func:`jagged_problem`
    first), on memory of its own (the parts may be memory-mapped views of the file)."""
    return torch.nested.nested_tensor_from_jagged(
        values.as_subclass(Tensor).clone(),
        offsets.as_subclass(Tensor).clone(),
        None if lengths is None else lengths.as_subclass(Tensor).clone(),
    )


def jagged_parts(x: Any) -> list[Tensor]:
    """The tensors a jagged tensor is made of: values, offsets and (when present) lengths."""
    lengths = x.lengths()
    return [x.values(), x.offsets()] + ([] if lengths is None else [lengths])


def from_jagged_parts(parts: Sequence[Tensor]) -> Tensor:
    """The jagged tensor of :func:`jagged_parts`' tensors."""
    lengths = parts[2] if len(parts) > 2 else None
    return torch.nested.nested_tensor_from_jagged(parts[0], parts[1], lengths)


def split(x: Any, sizes: Sequence[int], node: Any = None, i: int = 0) -> list[Tensor]:
    """A jagged tensor split along the batch dim into pieces of ``sizes`` rows (``node`` and
    ``i`` name the key in an error)."""
    check_ragged_dim(x, node, i, "split")
    out, start = [], 0
    for s in sizes:
        out.append(take_rows(x, torch.arange(start, start + s)))
        start += s
    return out
