"""Combining and splitting containers along batch dims: ``stack`` and ``cat`` (operands of
one structure, leaf shapes checked), and ``unbind``, ``split`` and ``chunk``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .. import _nontensor as nontensor
from .._jagged._layout import cat as jagged_cat
from .._jagged._layout import has_jagged, is_jagged
from .._jagged._layout import refuse as refuse_jagged
from .._jagged._layout import split as jagged_split
from .._keys import fmt_key
from .._nontensor import NonTensor
from .._tree import leaves, leaves_and_nontensors, leaves_with_paths, map_leaves
from ._shape import _probe
from ._structure import _needs_a_batch_dim, match_structure, norm_dim


def _same_structure(nodes: Sequence[Any], op: str) -> list[Any]:
    first = nodes[0]
    return [first, *(match_structure(first, n, op) for n in nodes[1:])]


def _check_leaf_shapes(
    nodes: Sequence[Any], columns: Sequence[list[Tensor]], op: str, skip_dim: int | None
) -> None:
    """Every leaf of element i has the shape of element 0's leaf (except along ``skip_dim``).

    ``columns[i]`` are the leaves of ``nodes[i]``; key paths are only built for the error.
    """
    ref = [x.shape for x in columns[0]]
    for i, ls in enumerate(columns[1:], start=1):
        for j, (sa, b) in enumerate(zip(ref, ls)):
            sb = b.shape
            ok = sa == sb  # the common case; cat then compares all dims but skip_dim
            if not ok and skip_dim == 0 and is_jagged(b) and is_jagged(columns[0][j]):
                ok = len(sa) == len(sb) and sa[2:] == sb[2:]  # the ragged dim may differ
            if not ok and skip_dim is not None:
                ok = (
                    len(sa) == len(sb)
                    and sa[:skip_dim] == sb[:skip_dim]
                    and sa[skip_dim + 1 :] == sb[skip_dim + 1 :]
                )
            if not ok:
                path = leaves_with_paths(nodes[0])[j][0]
                raise ValueError(
                    f"cannot {op} containers: key {fmt_key(path)} has shape {tuple(sb)} in "
                    f"element {i}, expected {tuple(sa)}"
                )


def stack(nodes: Sequence[Any], dim: int = 0) -> Any:
    """Stack containers of identical structure and batch size along a new batch dim.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(3, 2), batch_size=[3])
        >>> tdfunc.stack([td, td], dim=1).batch_size
        torch.Size([3, 2])
    """
    nodes = list(nodes)
    if not nodes:
        raise ValueError("stack expects a non-empty sequence")
    first = nodes[0]
    bs = first._batch_size
    d = norm_dim(dim, len(bs) + 1, bs)
    nodes = _same_structure(nodes, "stack")
    for i, n in enumerate(nodes):
        if n._batch_size != bs:
            raise ValueError(
                E.STACK_SHAPE.format(
                    op="stack", index=i, got=tuple(n._batch_size), expected=tuple(bs)
                )
            )
    split = [leaves_and_nontensors(n) for n in nodes]
    columns = [ls for ls, _ in split]
    refuse_jagged(first, "stack", ": a jagged leaf has one batch dim (cat them)", columns[0])
    _check_leaf_shapes(nodes, columns, "stack", None)
    out = [torch.stack(c, d) for c in zip(*columns)]
    new_bs = bs[:d] + torch.Size([len(nodes)]) + bs[d:]
    nts = None
    if split[0][1]:
        nts = nontensor.combine([n for _, n in split], lambda ix: torch.stack(ix, d), True, d)
    return map_leaves(first, out, new_bs, nts=nts)


def cat(nodes: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate containers of identical structure along an existing batch dim.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2, 3), batch_size=[2])
        >>> tdfunc.cat([td, td]).batch_size
        torch.Size([4])
    """
    nodes = list(nodes)
    if not nodes:
        raise ValueError("cat expects a non-empty sequence")
    first = nodes[0]
    bs = first._batch_size
    d = norm_dim(dim, len(bs), bs)
    nodes = _same_structure(nodes, "cat")
    for i, n in enumerate(nodes):
        nb = n._batch_size
        if len(nb) != len(bs) or any(a != b for j, (a, b) in enumerate(zip(nb, bs)) if j != d):
            raise ValueError(
                E.STACK_SHAPE.format(op="cat", index=i, got=tuple(nb), expected=tuple(bs))
            )
    split = [leaves_and_nontensors(n) for n in nodes]
    columns = [ls for ls, _ in split]
    _check_leaf_shapes(nodes, columns, "cat", d)
    jagged = has_jagged(columns[0])
    out = [
        jagged_cat(c, first, j) if jagged and is_jagged(c[0]) else torch.cat(c, d)
        for j, c in enumerate(zip(*columns))
    ]
    new_bs = bs[:d] + torch.Size([sum(n._batch_size[d] for n in nodes)]) + bs[d + 1 :]
    nts = None
    if split[0][1]:
        nts = nontensor.combine([n for _, n in split], lambda ix: torch.cat(ix, d), False, d)
    return map_leaves(first, out, new_bs, nts=nts)


def _split_results(
    node: Any,
    pieces_per_leaf: Sequence[Sequence[Tensor]],
    shapes: Sequence[torch.Size],
    nt_pieces: Sequence[Sequence[NonTensor]] = (),
) -> tuple[Any, ...]:
    """One container per piece; ``nt_pieces[j][p]``: piece ``p`` of non-tensor leaf ``j``."""
    out = []
    n_pieces = len(shapes)
    for p in range(n_pieces):
        nts = [pl[p] for pl in nt_pieces] if nt_pieces else None
        out.append(map_leaves(node, [pl[p] for pl in pieces_per_leaf], shapes[p], nts=nts))
    return tuple(out)


def _nt_pieces(
    node: Any,
    fn: Callable[[Tensor], Sequence[Tensor]],
    d: int,
    first_dim: Sequence[int | slice],
) -> list[list[NonTensor]]:
    """The pieces of the non-tensor leaves of ``node`` under the split function ``fn``
    (``first_dim``: the same pieces as ints / slices, used when ``d`` is the first dim)."""
    _, nts = leaves_and_nontensors(node)
    if not nts:
        return []
    return nontensor.map_batch_multi(nts, fn, first_dim if d == 0 else None)


def _slices(sizes: Sequence[int]) -> list[slice]:
    """Consecutive slices of the given sizes."""
    out, start = [], 0
    for s in sizes:
        out.append(slice(start, start + s))
        start += s
    return out


def unbind(node: Any, dim: int = 0) -> tuple[Any, ...]:
    """Split along a batch dim into a tuple of containers without that dim.

    Example:
        >>> import torch, tdfunc
        >>> parts = tdfunc.TensorDict(a=torch.zeros(2, 3), batch_size=[2, 3]).unbind(1)
        >>> len(parts), parts[0].batch_size
        (3, torch.Size([2]))
    """
    bs = node._batch_size
    d = norm_dim(dim, len(bs), bs)
    ls = leaves(node)
    new_bs = bs[:d] + bs[d + 1 :]
    pieces = [x.unbind(d) for x in ls]
    return _split_results(
        node, pieces, [new_bs] * bs[d], _nt_pieces(node, lambda x: x.unbind(d), d, range(bs[d]))
    )


def split(node: Any, split_size: int | Sequence[int], dim: int = 0) -> tuple[Any, ...]:
    """Split along a batch dim into chunks of ``split_size`` (or the given sizes).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(5), batch_size=[5])
        >>> [p.batch_size[0] for p in td.split([2, 3])]
        [2, 3]
    """
    bs = node._batch_size
    _needs_a_batch_dim(bs, "split")
    d = norm_dim(dim, len(bs), bs)
    probe, _ = _probe(node)
    # torch.split's annotation says list[int]; it takes any sequence of ints
    sizes = [p.shape[d] for p in torch.split(probe, split_size, d)]  # type: ignore[arg-type]
    # the probe validated split_size; split_with_sizes skips re-deriving the sizes per leaf
    ls = leaves(node)
    jagged = has_jagged(ls)
    pieces = [
        jagged_split(x, sizes, node, j) if jagged and is_jagged(x) else x.split_with_sizes(sizes, d)
        for j, x in enumerate(ls)
    ]
    shapes = [bs[:d] + torch.Size([s]) + bs[d + 1 :] for s in sizes]
    return _split_results(
        node,
        pieces,
        shapes,
        _nt_pieces(node, lambda x: x.split_with_sizes(sizes, d), d, _slices(sizes)),
    )


def chunk(node: Any, chunks: int, dim: int = 0) -> tuple[Any, ...]:
    """Split along a batch dim into ``chunks`` pieces (as ``torch.chunk``)."""
    bs = node._batch_size
    _needs_a_batch_dim(bs, "chunk")
    d = norm_dim(dim, len(bs), bs)
    probe, _ = _probe(node)
    sizes = [p.shape[d] for p in torch.chunk(probe, chunks, d)]
    pieces = [torch.chunk(x, chunks, d) for x in leaves(node)]
    shapes = [bs[:d] + torch.Size([s]) + bs[d + 1 :] for s in sizes]
    return _split_results(
        node,
        pieces,
        shapes,
        _nt_pieces(node, lambda x: x.split_with_sizes(sizes, d), d, _slices(sizes)),
    )
