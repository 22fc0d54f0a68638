"""Variable-length data: containers of samples of different lengths as one batch with jagged
leaves (:func:`as_jagged`), jagged leaves as padded ones with a mask (:func:`to_padded`) and
back (:func:`from_padded`), and a DataLoader collate that does either (:func:`collate_jagged`).

A *variable-length sample* is a container whose tensor leaves may differ from one sample to
the next in their first dim (a sequence of tokens, an episode of steps): batch size ``()``, or
``(T,)`` with ``T`` the sample's length. Batching N of them gives a container of batch size
``(N,)``: a leaf whose first dim differs between the samples becomes a jagged tensor
(``torch.nested``, ``layout=torch.jagged``, its ragged dim right after the batch dim), a leaf
of one shape in every sample is stacked, and non-tensor values become per-sample values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import _ops as ops
from ._keys import as_path, fmt_key, get_path
from ._nontensor import NonTensor
from ._ragged import JaggedOpError, is_jagged, usable
from ._tree import is_node, leaves_and_nontensors, leaves_with_paths, map_leaves

AS_JAGGED_EMPTY = "as_jagged needs at least one container"
AS_JAGGED_BATCH = (
    "as_jagged: sample {index} has batch_size {got}; samples have batch_size () or (length,)"
)
AS_JAGGED_SHAPE = (
    "as_jagged: key {key} has shape {got} in sample {index} and {want} in sample 0: only the "
    "first dim may differ between samples"
)
AS_JAGGED_SCALAR = (
    "as_jagged: key {key} is 0-d in the samples: it has no dim to vary; leave it out of keys="
)
MASK_KEY_TAKEN = "to_padded: the mask key {key} is already an entry of the container"


def as_jagged(samples: Sequence[Any], keys: Sequence[Any] | None = None) -> Any:
    """One batch of ``len(samples)`` from containers whose leaves differ in their first dim.

    Each leaf whose first dim differs between the samples (or every leaf named in ``keys``)
    becomes a jagged leaf of the batch; the other leaves are stacked; non-tensor values become
    per-sample values. The samples have the same keys and nesting, and ``batch_size`` ``()``
    or ``(length,)`` (an episode: its steps are the ragged dim of the batch).

    Args:
        samples: the containers.
        keys: the leaves to make jagged even where every sample has the same length (a batch
            whose structure does not depend on its lengths: one compiled graph for all).

    Returns:
        A container of ``samples[0]``'s type with ``batch_size=(len(samples),)``.

    Raises:
        ValueError: no samples, a batch size other than ``()`` / ``(length,)``, different
            structures, or leaves that differ in a dim other than the first (naming the key).

    Example:
        >>> import torch, tdfunc
        >>> eps = [tdfunc.TensorDict(obs=torch.zeros(n, 3), batch_size=[n]) for n in (4, 2)]
        >>> batch = tdfunc.as_jagged(eps)
        >>> batch.batch_size, batch["obs"].is_nested, [len(o) for o in batch["obs"].unbind()]
        (torch.Size([2]), True, [4, 2])
    """
    samples = list(samples)
    if not samples:
        raise ValueError(AS_JAGGED_EMPTY)
    first = samples[0]
    for i, s in enumerate(samples):
        if len(s._batch_size) > 1:
            raise ValueError(AS_JAGGED_BATCH.format(index=i, got=tuple(s._batch_size)))
        if i:
            samples[i] = ops.match_structure(first, s, "as_jagged")
    paths = [p for p, _ in leaves_with_paths(first)]
    forced = {as_path(k) for k in keys or ()}
    split = [leaves_and_nontensors(s) for s in samples]
    out = []
    for j, path in enumerate(paths):
        col = [ls[j] for ls, _ in split]
        ref = col[0].shape
        for i, x in enumerate(col[1:], start=1):
            if x.shape[1:] != ref[1:] or x.ndim != len(ref):
                raise ValueError(
                    AS_JAGGED_SHAPE.format(
                        key=fmt_key(path), got=tuple(x.shape), index=i, want=tuple(ref)
                    )
                )
        ragged = path in forced or any(x.shape[0] != ref[0] for x in col[1:] if x.ndim)
        if ragged and not ref:
            raise ValueError(AS_JAGGED_SCALAR.format(key=fmt_key(path)))
        out.append(
            torch.nested.as_nested_tensor(col, layout=torch.jagged) if ragged else torch.stack(col)
        )
    nts = [
        NonTensor.per_sample([nt.value for _, nt in column])
        for column in zip(*[n for _, n in split])
    ]
    batch = torch.Size([len(samples)])
    # the samples' own batch dim (their length) is the ragged dim, not a batch dim
    return map_leaves(first, out, batch, first._device, False, nts)


def to_padded(node: Any, value: float = 0.0, mask_key: Any = "masks") -> Any:
    """``node`` with every jagged leaf padded to its longest row with ``value``, and under
    ``mask_key`` a ``TensorDict`` of the masks (``True`` at data), one per padded leaf, under
    the leaf's own key. The batch size does not change.

    Example:
        >>> import torch, tdfunc
        >>> eps = [tdfunc.TensorDict(obs=torch.ones(n, 3), batch_size=[n]) for n in (4, 2)]
        >>> padded = tdfunc.to_padded(tdfunc.as_jagged(eps), 0.0)
        >>> padded["obs"].shape, padded["masks", "obs"].sum(1).tolist()
        (torch.Size([2, 4, 3]), [4, 2])
    """
    mask_path = as_path(mask_key)
    if get_path(node, mask_path, None) is not None:
        raise KeyError(MASK_KEY_TAKEN.format(key=fmt_key(mask_path)))
    pairs = leaves_with_paths(node)
    out = []
    masks: dict[Any, Tensor] = {}
    x: Any
    for i, (path, x) in enumerate(pairs):
        if is_jagged(x):
            # offsets and ragged dim read under the leaf's transform wrappers; a leaf that a
            # transform maps or differentiates has no to_padded in torch: JaggedOpError
            base = usable(x, node, i, "to_padded")
            if base._ragged_idx != 1:
                raise JaggedOpError(
                    f"key {fmt_key(path)}: to_padded needs the ragged dim at dim 1, "
                    f"got {base._ragged_idx}"
                )
            dense = x.to_padded_tensor(value)
            out.append(dense)
            masks[path] = _mask(base, dense.shape[1])
        else:
            out.append(x)
    result = map_leaves(node, out)
    from .tensordict import TensorDict

    mask_td = TensorDict(batch_size=node._batch_size, device=node._device)
    for path, m in masks.items():
        mask_td = mask_td.set(path, m)
    return result.set(mask_path, mask_td)


def _mask(x: Any, width: int) -> Tensor:
    """``True`` at the data of each row of jagged tensor ``x`` (not under transform
    wrappers: :func:`tdfunc._ragged.jagged_base`), ``(rows, width)``."""
    off = x.offsets()
    lengths = x.lengths()
    lens = off[1:] - off[:-1] if lengths is None else lengths
    return torch.arange(width, device=off.device) < lens.unsqueeze(1)


def from_padded(node: Any, mask_key: Any = "masks") -> Any:
    """The inverse of :func:`to_padded`: every leaf named in the masks under ``mask_key`` made
    jagged again (the rows' data where its mask is ``True``, which must come first in each
    row), the masks removed.

    Example:
        >>> import torch, tdfunc
        >>> eps = [tdfunc.TensorDict(obs=torch.ones(n, 3), batch_size=[n]) for n in (4, 2)]
        >>> back = tdfunc.from_padded(tdfunc.to_padded(tdfunc.as_jagged(eps)))
        >>> back.keys(), [len(o) for o in back["obs"].unbind()]
        (['obs'], [4, 2])
    """
    mask_path = as_path(mask_key)
    masks = node.get(mask_path)
    if not is_node(masks):
        raise KeyError(f"from_padded: no masks under {fmt_key(mask_path)}")
    rest = node.exclude(mask_path)
    for path, m in leaves_with_paths(masks):
        x = rest.get(path)
        lens = m.sum(1)
        offsets = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        rest = rest.set(path, torch.nested.nested_tensor_from_jagged(x[m], offsets))
    return rest


def collate_jagged(
    batch: Sequence[Any], *, pad: bool = False, value: float = 0.0, mask_key: Any = "masks"
) -> Any:
    """A DataLoader ``collate_fn`` for variable-length samples: :func:`as_jagged` of the
    samples, or with ``pad=True`` :func:`to_padded` of it (dense leaves and their masks).

    Example:
        >>> import functools, torch, tdfunc
        >>> from torch.utils.data import DataLoader
        >>> data = [tdfunc.TensorDict(tok=torch.arange(n)) for n in (3, 1, 2, 5)]
        >>> batches = list(DataLoader(data, batch_size=2, collate_fn=tdfunc.collate_jagged))
        >>> [b["tok"].offsets().tolist() for b in batches]
        [[0, 3, 4], [0, 2, 7]]
        >>> padded = functools.partial(tdfunc.collate_jagged, pad=True, value=-1)
        >>> next(iter(DataLoader(data, batch_size=2, collate_fn=padded)))["tok"].tolist()
        [[0, 1, 2], [0, -1, -1]]
    """
    out = as_jagged(batch)
    return to_padded(out, value, mask_key) if pad else out
