"""tensordict's top-level ``pad`` and ``pad_sequence``, with its signatures and results.

- :func:`pad` pads the batch dims of one container, the sizes given from the *first* batch
  dim on (``(dim0_before, dim0_after, dim1_before, ...)``, where ``torch.nn.functional.pad``
  and ``F.pad(td, ...)`` start from the last): the constant padding of
  :func:`tdfunc._ops._batchdim.pad` with the pairs reordered.
- :func:`pad_sequence` pads containers of one structure to a common size along ``pad_dim``
  of every entry and stacks them along a new first batch dim, with the masks of the valid
  positions when asked (``return_mask``).

Nothing is written to the inputs: ``inplace=True`` and ``out=`` raise typed errors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .._keys import as_path, fmt_key, set_path, walk
from .._tree import leaves, map_leaves
from ._batchdim import pad as _pad_last_first
from ._structure import check_batch_invariant, match_structure


def pad(
    tensordict: Any,
    pad_size: Sequence[int],
    value: float = 0.0,
    inplace: bool = False,
    safe: bool = True,
) -> Any:
    """Pad the batch dims of a container with a constant, as tensordict's ``pad``.

    Args:
        tensordict: the container (a ``TensorDict`` or a tensorclass instance).
        pad_size: the padding before and after each batch dim, from the first one on:
            ``(dim0_before, dim0_after, dim1_before, dim1_after, ...)``; an even number of
            sizes, at most two per batch dim (the dims it leaves out are not padded).
            Negative sizes crop, as in ``torch.nn.functional.pad``.
        value: the value of the padded elements.
        inplace: must be ``False``: a container is never written to (rebind the name,
            ``td = tdfunc.pad(td, ...)``).
        safe: accepted for tensordict's signature; the checks always run before any leaf
            is padded, and nothing is written.

    Returns:
        A new container of the same type, its batch dims padded (each leaf's feature dims
        are kept); nested containers keep their own extra batch dims.

    Raises:
        ValueError: ``pad_size`` has an odd length or more than two sizes per batch dim
            (tensordict raises ``RuntimeError``).
        tdfunc.InPlaceError: ``inplace=True``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(3, 4, 1), batch_size=[3, 4])
        >>> out = tdfunc.pad(td, [0, 1, 0, 2])
        >>> out.batch_size, out["a"].shape
        (torch.Size([4, 6]), torch.Size([4, 6, 1]))
    """
    del safe
    if inplace:
        raise E.InPlaceError(
            E.INPLACE.format(
                cls=type(tensordict).__name__,
                name="pad(inplace=True)",
                hint="td = tdfunc.pad(td, pad_size, value)",
            )
        )
    bs = tensordict._batch_size
    bd = len(bs)
    sizes = tuple(pad_size)
    if len(sizes) % 2 or len(sizes) > 2 * bd:
        raise ValueError(E.PAD_SIZE.format(pad_size=list(sizes), batch_size=tuple(bs)))
    n = len(sizes) // 2
    # torch's order: the last dim first, (before, after) each; dims past pad_size: none
    last_first: list[int] = []
    for d in range(bd - 1, -1, -1):
        last_first += [sizes[2 * d], sizes[2 * d + 1]] if d < n else [0, 0]
    return _pad_last_first(tensordict, last_first, "constant", value)


def pad_sequence(
    list_of_tensordicts: Sequence[Any],
    pad_dim: int = 0,
    padding_value: float | Mapping[Any, float] = 0.0,
    out: Any = None,
    return_mask: bool | str | tuple[str, ...] = False,
    padding_side: str = "right",
) -> Any:
    """Pad containers of one structure to a common size along one dim and stack them, as
    tensordict's ``pad_sequence``.

    Every entry is padded along ``pad_dim`` to the largest size among the inputs, then the
    inputs are stacked along a new first batch dim.

    Args:
        list_of_tensordicts: the containers (same keys and nesting; the entries' shapes
            equal in every dim but ``pad_dim``).
        pad_dim: the dim of each entry to pad, counted from its first dim (batch dims
            included); a batch dim pads the batch size of the result too. A negative
            ``pad_dim`` counts from each entry's last dim.
        padding_value: the value of the padded elements, or a mapping from keys (``"a"``,
            ``("n", "b")``) to values; the entries it does not name are padded with ``0``.
        out: must be ``None``: a container is never written to.
        return_mask: ``True`` adds a ``"masks"`` entry; a key (``"m"``, ``("m", "k")``) puts
            it there. It is a ``TensorDict`` with the structure of the leaves, each ``True``
            at the positions of data: of the result's batch size when ``pad_dim`` is a batch
            dim, else the result's batch size followed by the padded length.
        padding_side: ``"right"`` pads after the data, ``"left"`` before it.

    Returns:
        A container of the inputs' type with ``batch_size=[len(list_of_tensordicts),
        *batch_size]`` (the padded batch dim at its longest).

    Raises:
        ValueError: no containers, a ``padding_side`` other than ``"left"``/``"right"``,
            entries whose shapes differ in a dim other than ``pad_dim``, or a negative
            ``pad_dim`` that lands on batch dims of some entries and feature dims of
            others while an entry is longer than the first sample's batch.
        KeyError: a key of a ``padding_value`` mapping names no entry.
        IndexError: ``pad_dim`` is out of range for an entry.
        TypeError: ``out=`` given, or ``return_mask`` with tensorclass inputs.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.ones(2, 3), batch_size=[2])
        >>> b = tdfunc.TensorDict(x=torch.ones(4, 3), batch_size=[4])
        >>> out = tdfunc.pad_sequence([a, b], return_mask=True)
        >>> out.batch_size, out["masks", "x"].sum(-1).tolist()
        (torch.Size([2, 4]), [2, 4])
    """
    if out is not None:
        raise TypeError(E.PAD_SEQUENCE_OUT)
    nodes = list(list_of_tensordicts)
    if not nodes:
        raise ValueError(E.PAD_SEQUENCE_EMPTY)
    if padding_side not in ("left", "right"):
        raise ValueError(E.PAD_SEQUENCE_SIDE.format(side=padding_side))
    first = nodes[0]
    masks_at: tuple[str, ...] | None = None
    if return_mask is True:
        masks_at = ("masks",)
    elif return_mask is not False:
        masks_at = as_path(return_mask)
    if masks_at is not None and not getattr(type(first), "_tdf_dict_layout", False):
        raise TypeError(E.PAD_SEQUENCE_MASK_CLASS.format(cls=type(first).__name__))
    nodes = [first, *(match_structure(first, n, "pad_sequence") for n in nodes[1:])]
    paths = []
    for path, v in walk(first, leaves_only=True):
        if not isinstance(v, Tensor):
            raise TypeError(E.PAD_SEQUENCE_LEAF.format(key=fmt_key(path), typ=type(v).__name__))
        paths.append(path)
    values: dict[tuple[str, ...], float] = {}
    if isinstance(padding_value, Mapping):
        values = {as_path(k): v for k, v in padding_value.items()}
        missing = [k for k in values if k not in set(paths)]
        if missing:
            raise KeyError(
                E.PAD_SEQUENCE_VALUES.format(
                    missing=", ".join(fmt_key(k) for k in missing),
                    keys=", ".join(fmt_key(p) for p in paths),
                )
            )
        padding_value = 0.0
    bs = first._batch_size
    bd = len(bs)
    columns = list(zip(*[leaves(n) for n in nodes]))
    on_batch: set[int] = set()
    on_feature = False
    longer = None
    padded: list[Tensor] = []
    masks: list[tuple[tuple[str, ...], Tensor]] = []
    for path, ts in zip(paths, columns):
        pos = _position(pad_dim, ts, path)
        if pos < bd:
            on_batch.add(pos)
            for t in ts:
                if t.shape[pos] > bs[pos]:
                    longer = (path, pos)
        else:
            on_feature = True
        fill = values.get(path, padding_value)
        padded.append(_pad_stack(list(ts), pos, fill, padding_side))
        if masks_at is not None:
            ones = [
                torch.ones(
                    (*n._batch_size, *((t.shape[pos],) if pos >= bd else ())),
                    dtype=torch.bool,
                    device=t.device,
                )
                for n, t in zip(nodes, ts)
            ]
            masks.append((path, _pad_stack(ones, min(pos, bd), False, padding_side)))
    new_bs = [len(nodes), *bs]
    if on_batch and (len(on_batch) > 1 or on_feature):
        if pad_dim < 0 and longer is not None:
            raise ValueError(
                E.PAD_SEQUENCE_SPLIT_DIM.format(
                    pad_dim=pad_dim,
                    dims=sorted(on_batch),
                    feature=" and on feature dims of others" if on_feature else "",
                    key=fmt_key(longer[0]),
                    dim=longer[1],
                )
            )
    elif on_batch:
        (d,) = on_batch
        new_bs[1 + d] = padded[0].shape[1 + d]
    elif not paths and bd and -bd <= pad_dim < bd:  # no leaves: the longest batch
        d = pad_dim % bd
        new_bs[1 + d] = max(n._batch_size[d] for n in nodes)
    size = torch.Size(new_bs)
    check_batch_invariant(first, padded, size, "pad_sequence")
    result = map_leaves(first, padded, size)
    if masks_at is None:
        return result
    tree: dict[str, Any] = {}
    for path, mask in masks:
        level = tree
        for k in path[:-1]:
            level = level.setdefault(k, {})
        level[path[-1]] = mask
    return set_path(result, masks_at, type(first)(tree, batch_size=size))


def _position(pad_dim: int, ts: Sequence[Tensor], path: tuple[str, ...]) -> int:
    """``pad_dim`` as a dim of the entries ``ts`` (one per container), whose other dims must
    agree."""
    ref = ts[0]
    nd = ref.ndim
    pos = pad_dim if pad_dim >= 0 else nd + pad_dim
    if not 0 <= pos < nd:
        raise IndexError(
            E.PAD_SEQUENCE_DIM.format(pad_dim=pad_dim, key=fmt_key(path), shape=tuple(ref.shape))
        )
    for t in ts[1:]:
        if t.ndim != nd or any(
            a != b for i, (a, b) in enumerate(zip(t.shape, ref.shape)) if i != pos
        ):
            raise ValueError(
                E.PAD_SEQUENCE_SHAPES.format(
                    key=fmt_key(path),
                    shapes=[tuple(x.shape) for x in ts],
                    pad_dim=pad_dim,
                    dim=pos,
                )
            )
    return pos


def _pad_stack(ts: list[Tensor], pos: int, fill: Any, side: str) -> Tensor:
    """The tensors ``ts`` padded along ``pos`` to the longest and stacked along a new dim 0."""
    moved = [t.transpose(0, pos) for t in ts]
    out = torch.nn.utils.rnn.pad_sequence(
        moved, batch_first=True, padding_value=fill, padding_side=side
    )
    return out.transpose(1, pos + 1)
