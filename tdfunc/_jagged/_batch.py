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

from .. import _ops as ops
from .._keys import as_path, fmt_key, get_path
from .._nontensor import NonTensor
from .._raising import refuse_if
from .._tree import is_node, leaves_and_nontensors, leaves_with_paths, map_leaves
from ._layout import JaggedOpError, is_jagged, row_spans, usable

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


#: the sides ``to_padded`` pads and truncates on
SIDES = ("right", "left")
PAD_SIDE = "{fn}: {name} must be 'right' or 'left', got {got!r}"
PAD_POSITIVE = "{fn}: {name} must be a positive int, got {got!r}"
PAD_TOO_LONG = (
    "to_padded: key {key} has a row longer than length={length}; pass max_length= to "
    "truncate the rows (truncation_side= says which end is cut)"
)
PAD_NEEDS_KEYS = (
    "collate_jagged: {name}= gives fixed shapes only if every batch pads the same leaves: name "
    "the variable-length leaves with keys= (a batch whose rows happen to have one length "
    "would otherwise stack them unpadded)"
)
PAD_NEEDS_PAD = (
    "collate_jagged: {name}= pads or truncates the batch: pass pad=True with it "
    "(pad=False returns the jagged batch as it is)"
)


def _positive(fn: str, name: str, v: Any) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise ValueError(PAD_POSITIVE.format(fn=fn, name=name, got=v))


def _side(fn: str, name: str, v: Any) -> None:
    if v not in SIDES:
        raise ValueError(PAD_SIDE.format(fn=fn, name=name, got=v))


def to_padded(
    node: Any,
    value: float = 0.0,
    mask_key: Any = "masks",
    *,
    length: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
    truncation_side: str = "right",
    padding_side: str = "right",
) -> Any:
    """``node`` with every jagged leaf padded with ``value`` to one width, and under
    ``mask_key`` a ``TensorDict`` of the masks (``True`` at data), one per padded leaf, under
    the leaf's own key. The batch size does not change.

    The width is the longest row's (after truncation), or ``length`` when given (a fixed
    shape: one compiled graph for every batch), rounded up to a multiple of
    ``pad_to_multiple_of`` when given (a handful of shapes). ``max_length`` truncates longer
    rows, keeping their first entries (``truncation_side="right"``) or their last
    (``"left"``). The data sits at the start of each row and the padding after it
    (``padding_side="right"``) or the padding first (``"left"``, as decoder-only language
    models generate). The options of Hugging Face's tokenizers, by name:
    ``padding="max_length"`` is ``length=``, ``pad_to_multiple_of=`` and
    ``truncation=True, max_length=`` are the same here.

    Args:
        node: a container whose jagged leaves have their ragged dim at dim 1.
        value: the padding value.
        mask_key: where the masks go (a key that must not be taken).
        length: the fixed width; a row longer than it (after ``max_length``) raises
            ``ValueError`` naming the key, when the values are read (compiled: when the
            program runs).
        pad_to_multiple_of: round the width up to a multiple of it.
        max_length: truncate rows longer than it.
        truncation_side: ``"right"`` or ``"left"``: the end of a row that is cut.
        padding_side: ``"right"`` or ``"left"``: where the padding goes.

    Raises:
        KeyError: ``mask_key`` is taken.
        ValueError: an option out of range, or a row longer than ``length``.
        JaggedOpError: a jagged leaf that a transform maps over its batch dim or
            differentiates (torch has no rule), or whose ragged dim is not dim 1.

    Example:
        >>> import torch, tdfunc
        >>> eps = [tdfunc.TensorDict(obs=torch.ones(n, 3), batch_size=[n]) for n in (4, 2)]
        >>> padded = tdfunc.to_padded(tdfunc.as_jagged(eps), 0.0)
        >>> padded["obs"].shape, padded["masks", "obs"].sum(1).tolist()
        (torch.Size([2, 4, 3]), [4, 2])
        >>> text = tdfunc.as_jagged([tdfunc.TensorDict(tok=torch.arange(1, n + 1)) for n in (5, 2)])
        >>> tdfunc.to_padded(text, 0, length=4, max_length=4, truncation_side="left",
        ...                  padding_side="left")["tok"].tolist()
        [[2, 3, 4, 5], [0, 0, 1, 2]]
        >>> tdfunc.to_padded(text, 0, pad_to_multiple_of=4)["tok"].shape
        torch.Size([2, 8])
    """
    fn = "to_padded"
    _positive(fn, "length", length)
    _positive(fn, "pad_to_multiple_of", pad_to_multiple_of)
    _positive(fn, "max_length", max_length)
    _side(fn, "truncation_side", truncation_side)
    _side(fn, "padding_side", padding_side)
    plain = (
        length is None
        and pad_to_multiple_of is None
        and max_length is None
        and padding_side == "right"
    )
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
            if plain and base.lengths() is None:
                dense = x.to_padded_tensor(value)
                out.append(dense)
                masks[path] = _mask(base, dense.shape[1])
                continue
            dense, mask = _fit(
                x,
                base,
                value,
                fmt_key(path),
                length,
                pad_to_multiple_of,
                max_length,
                truncation_side == "left",
                padding_side == "left",
            )
            out.append(dense)
            masks[path] = mask
        else:
            out.append(x)
    result = map_leaves(node, out)
    from ..tensordict import TensorDict

    mask_td = TensorDict(batch_size=node._batch_size, device=node._device)
    for path, m in masks.items():
        mask_td = mask_td.set(path, m)
    return result.set(mask_path, mask_td)


def _mask(x: Any, width: int) -> Tensor:
    """``True`` at the data of each row of jagged tensor ``x``, ``(rows, width)``."""
    lens = row_spans(x)[1]
    return torch.arange(width, device=lens.device) < lens.unsqueeze(1)


def _fit(
    x: Any,
    base: Any,
    value: float,
    key: str,
    length: int | None,
    multiple: int | None,
    max_length: int | None,
    cut_left: bool,
    pad_left: bool,
) -> tuple[Tensor, Tensor]:
    """Jagged leaf ``x`` (``base``: the tensor under its transform wrappers) as rows of the
    asked width: each output position reads the entry it shows, or ``value``. Without holes
    (no ``lengths``) the entries come from ``x`` padded on the right to its longest row
    ``L`` (torch's ``to_padded_tensor``) and the shapes from ``L`` and the options only (no
    value read back: one compiled graph per output width, none per input length when
    ``length`` is given); with holes (rows made by ``torch.nested.narrow``, which
    ``to_padded_tensor`` refuses) from its values, the longest row read back."""
    spans, lens = row_spans(base)
    holes = base.lengths() is not None
    rows = lens.shape[0]
    if holes:
        source = x.values()
        longest = int(lens.max()) if rows else 0
        starts = spans.unsqueeze(1)
        along = 0
    else:
        source = x.to_padded_tensor(value)
        longest = source.shape[1]
        starts = torch.zeros_like(spans).unsqueeze(1)
        along = 1
    kept = lens if max_length is None else lens.clamp(max=max_length)
    widest = longest if max_length is None else torch.sym_min(longest, max_length)
    width = widest if length is None else length
    if multiple is not None:
        width = -(-width // multiple) * multiple
    if length is not None:
        refuse_if(kept > length, ValueError, PAD_TOO_LONG.format(key=key, length=length))
    first = lens - kept if cut_left else torch.zeros_like(lens)  # first entry kept
    lead = (width - kept) if pad_left else torch.zeros_like(kept)  # padding before the data
    pos = torch.arange(width, device=lens.device)
    rel = pos - lead.unsqueeze(1)  # the position within the kept data
    mask = (rel >= 0) & (rel < kept.unsqueeze(1))
    pad_at = source.shape[along]  # the index of the padding entry appended below
    src = torch.where(mask, starts + first.unsqueeze(1) + rel, pad_at)
    trail = source.shape[along + 1 :]
    if holes:
        padded = torch.cat([source, source.new_full((1, *trail), value)], 0)
        return padded[src], mask
    padded = torch.cat([source, source.new_full((rows, 1, *trail), value)], 1)
    src = src.reshape(rows, width, *([1] * len(trail))).expand(rows, width, *trail)
    return padded.gather(1, src), mask


def from_padded(node: Any, mask_key: Any = "masks") -> Any:
    """The inverse of :func:`to_padded`: every leaf named in the masks under ``mask_key`` made
    jagged again (the rows' data where its mask is ``True``, in order: padding on either
    side), the masks removed.

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
    batch: Sequence[Any],
    *,
    pad: bool = False,
    value: float = 0.0,
    mask_key: Any = "masks",
    keys: Sequence[Any] | None = None,
    length: int | None = None,
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
    truncation_side: str = "right",
    padding_side: str = "right",
) -> Any:
    """A DataLoader ``collate_fn`` for variable-length samples: :func:`as_jagged` of the
    samples, or with ``pad=True`` :func:`to_padded` of it (dense leaves and their masks), with
    :func:`to_padded`'s options: a fixed ``length`` or a ``pad_to_multiple_of`` give a
    compiled step one shape or a handful (with :class:`tdfunc.LengthGroupedSampler`, batches
    of similar lengths pad little), ``max_length`` truncates. ``keys`` names the leaves that
    are jagged in every batch (:func:`as_jagged`), even one whose rows happen to have one
    length; ``length`` and ``pad_to_multiple_of`` need it (a leaf stacked unpadded would
    give that batch another shape). The options need ``pad=True`` (``ValueError``
    otherwise).

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
        >>> fixed = functools.partial(
        ...     tdfunc.collate_jagged, pad=True, keys=["tok"], length=4, max_length=4
        ... )
        >>> [b["tok"].shape[1] for b in DataLoader(data, batch_size=2, collate_fn=fixed)]
        [4, 4]
    """
    if not pad:
        options = {
            "length": length,
            "pad_to_multiple_of": pad_to_multiple_of,
            "max_length": max_length,
            "truncation_side": None if truncation_side == "right" else truncation_side,
            "padding_side": None if padding_side == "right" else padding_side,
        }
        for name, v in options.items():
            if v is not None:
                raise ValueError(PAD_NEEDS_PAD.format(name=name))
    elif keys is None:
        for name, v in (("length", length), ("pad_to_multiple_of", pad_to_multiple_of)):
            if v is not None:
                raise ValueError(PAD_NEEDS_KEYS.format(name=name))
    out = as_jagged(batch, keys)
    if not pad:
        return out
    return to_padded(
        out,
        value,
        mask_key,
        length=length,
        pad_to_multiple_of=pad_to_multiple_of,
        max_length=max_length,
        truncation_side=truncation_side,
        padding_side=padding_side,
    )
