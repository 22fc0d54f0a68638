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

Inside a ``torch.func`` transform (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``torch.vmap``),
compiled or not, a leaf is a plain ``Tensor`` wrapping the leaf of the level below: its
``is_nested``, ``layout`` and type are the wrapper's. What a leaf is (jagged, memory-mapped)
is asked of the tensor under its wrappers (:func:`under_wrappers`, :func:`leaf_kind`), and a
jagged leaf's offsets and lengths are read there, so every op gives the value it gives
outside the transform. Where torch itself has no rule, the op raises :class:`JaggedOpError`
naming the key: a jagged leaf that a ``torch.func`` grad level differentiates (torch defines
no backward through a jagged tensor under ``torch.func``; plain ``torch.autograd`` does), and
a jagged leaf that ``torch.vmap`` maps over its batch dim (each call sees one row, whose size
torch does not give) in an op that needs its rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import (
    functorch_level,
    functorch_transforms_active,
    get_unwrapped,
    is_batchedtensor,
    is_functorch_wrapped_tensor,
    unwrap_batched,
    unwrap_for_grad,
)
from .._errors import JaggedOpError as JaggedOpError
from .._tree import Node, leaves_with_paths
from .._twins import traced_as

JAGGED_OP = (
    "key {key}: {op} is not defined by torch on the batch dim of a jagged (torch.nested) "
    "leaf{detail}; exclude the key, or convert it with tdfunc.to_padded first"
)


JAGGED_ROWS_OP = (
    "key {key}: {op} of a jagged (torch.nested) leaf that torch.vmap maps over its batch dim: "
    "each call sees one row, whose size torch does not give; map another argument "
    "(in_dims=None for the container), or convert the leaf with tdfunc.to_padded first"
)
JAGGED_DIFF_OP = (
    "key {key}: {op} of a jagged (torch.nested) leaf that a torch.func transform "
    "differentiates (grad, vjp, jacrev: the leaf is, or was computed from, a differentiated "
    "input): torch defines no backward through a jagged tensor under torch.func; keep the "
    "leaf out of the differentiated inputs and pad it (tdfunc.to_padded) before it meets "
    "them, or take the gradient with tdfunc.value_and_grad outside torch.compile "
    "(torch.autograd differentiates jagged tensors)"
)

#: :func:`leaf_kind`: not a jagged leaf (a dense tensor, or not a tensor)
DENSE = 0
#: :func:`leaf_kind`: a jagged leaf (under no wrapper, or under wrappers that neither map nor
#: differentiate it: a ``torch.func.grad`` argument outside ``argnums``, a ``jvp`` level)
JAGGED = 1
#: :func:`leaf_kind`: a row of a jagged leaf (``torch.vmap`` maps the leaf's batch dim)
JAGGED_ROWS = 2
#: :func:`leaf_kind`: a jagged leaf that a ``torch.func`` grad level differentiates
JAGGED_DIFF = 3


def under_wrappers(x: Tensor) -> tuple[Tensor, bool, bool]:
    """The tensor under ``x``'s functorch wrappers, whether a ``torch.vmap`` level maps it, and
    whether a ``torch.func`` grad level differentiates it (its wrapper there requires grad).

    Inside ``torch.func.grad``, ``vjp``, ``jvp``, ``jacrev`` or ``torch.vmap`` a container's
    leaf is a plain ``Tensor`` wrapping the leaf of the level below (one wrapper per level):
    its ``is_nested``, ``layout`` and type are the wrapper's, not the leaf's. Every question
    about what a leaf is (jagged, memory-mapped) is asked of the tensor returned here. Dynamo
    traces a twin that unwraps the active levels one by one (the same tensor; Dynamo 2.13
    reports ``requires_grad=False`` for a differentiated *input* of ``torch.func.grad``, so
    compiled, only a tensor computed from one counts as differentiated).

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> def seen(w, x):
        ...     base, mapped, differentiated = under_wrappers(x)
        ...     print(x.is_nested, base.is_nested, mapped, differentiated)
        ...     return w.sum()
        >>> _ = torch.func.grad(seen)(torch.ones(()), nt)
        False True False False
    """
    mapped = differentiated = False
    while is_functorch_wrapped_tensor(x):
        if is_batchedtensor(x):
            mapped = True
        elif x.requires_grad:
            differentiated = True
        x = get_unwrapped(x)
    return x, mapped, differentiated


@traced_as(under_wrappers)
def _under_wrappers_traced(x: Tensor) -> tuple[Tensor, bool, bool]:
    # Dynamo traces neither is_functorch_wrapped_tensor nor get_unwrapped: every active level
    # is unwrapped, innermost first (a tensor without a wrapper of that level comes back
    # as it is, the same object)
    mapped = differentiated = False
    level = functorch_level()
    while level > 0:
        if is_batchedtensor(x):
            y = unwrap_batched(x, level)[0]
            mapped = mapped or y is not x
        else:
            y = unwrap_for_grad(x, level)
            differentiated = differentiated or (y is not x and x.requires_grad)
        x = y
        level -= 1
    return x, mapped, differentiated


def jagged_base(x: Any) -> Any:
    """The jagged tensor under leaf ``x``'s transform wrappers (``x`` itself outside every
    transform): its offsets, lengths and ragged dim are the leaf's.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> torch.func.grad(lambda w, x: w * jagged_base(x).offsets()[-1])(torch.ones(()), nt)
        tensor(5.)
    """
    return under_wrappers(x)[0]


def layout_of(x: Tensor) -> torch.layout:
    """The layout of leaf ``x``, asked under its transform wrappers (a jagged leaf's wrapper
    inside ``torch.func.grad`` says ``torch.strided``).

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> torch.func.grad(lambda w, x: w * (layout_of(x) == torch.jagged))(torch.ones(()), nt)
        tensor(1.)
    """
    return under_wrappers(x)[0].layout


def leaf_kind(x: Any) -> int:
    """What leaf ``x`` is, asked under its transform wrappers: :data:`DENSE`, :data:`JAGGED`,
    :data:`JAGGED_ROWS` (``torch.vmap`` maps its batch dim) or :data:`JAGGED_DIFF` (a
    ``torch.func`` grad level differentiates it). The same answer eagerly and compiled,
    outside and inside every transform.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> leaf_kind(nt) == JAGGED, leaf_kind(torch.ones(2)) == DENSE
        (True, True)
        >>> torch.func.grad(lambda w, x: w * (leaf_kind(x) == JAGGED))(torch.ones(()), nt)
        tensor(1.)
    """
    if not isinstance(x, Tensor):
        return DENSE
    base, mapped, differentiated = under_wrappers(x)
    if not (base.is_nested and base.layout == torch.jagged):
        return DENSE
    return JAGGED_ROWS if mapped else JAGGED_DIFF if differentiated else JAGGED


def is_jagged(x: Any) -> bool:
    """True for a jagged leaf (``torch.nested``, ``layout=torch.jagged``), whatever
    ``torch.func`` / ``torch.vmap`` wrappers hold it (:func:`leaf_kind` is not :data:`DENSE`).

    Example:
        >>> import torch
        >>> is_jagged(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged))
        True
    """
    return leaf_kind(x) != DENSE


def _key_of(node: Any, i: int) -> str:
    if node is None:
        return "<a jagged tensor>"
    path = leaves_with_paths(node)[i][0]
    return repr(path[0]) if len(path) == 1 else repr(path)


def error(node: Any, i: int, op: str, detail: str = "") -> JaggedOpError:
    """The :class:`JaggedOpError` for leaf ``i`` (in :func:`tdfunc._tree.leaves` order)."""
    return JaggedOpError(JAGGED_OP.format(key=_key_of(node, i), op=op, detail=detail))


def usable(x: Any, node: Any, i: int, op: str) -> Any:
    """The jagged tensor under jagged leaf ``i``'s wrappers (:func:`jagged_base`), for an op
    that reads its rows; :class:`JaggedOpError` naming the key where the active transform
    leaves torch no rule for ``op``: the leaf is mapped by ``torch.vmap`` over its batch dim,
    or differentiated by a ``torch.func`` grad level.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> usable(nt, None, 0, "cat") is nt
        True
        >>> try:  # differentiated by torch.func.grad
        ...     torch.func.grad(lambda x: usable(x, None, 0, "cat").values().sum())(nt)
        ... except JaggedOpError as e:
        ...     print(str(e)[:50])
        key <a jagged tensor>: cat of a jagged (torch.nest
    """
    base, mapped, differentiated = under_wrappers(x)
    if mapped:
        raise JaggedOpError(JAGGED_ROWS_OP.format(key=_key_of(node, i), op=op))
    if differentiated:
        raise JaggedOpError(JAGGED_DIFF_OP.format(key=_key_of(node, i), op=op))
    return base


def first_jagged(node: Node) -> int | None:
    """The position of the first jagged leaf of ``node`` (``None`` when it has none)."""
    from .._tree import leaves

    for i, x in enumerate(leaves(node)):
        if is_jagged(x):
            return i
    return None


#: ``x.is_nested`` read without a Python attribute lookup per leaf (eager only: Dynamo
#: does not trace an ``attrgetter``; it traces :func:`_has_jagged_traced`)
_IS_NESTED = operator.attrgetter("is_nested")


def has_jagged(ls: Sequence[Tensor]) -> bool:
    """True when one of the tensors ``ls`` is a jagged leaf (:func:`is_jagged`: asked under
    its transform wrappers). Outside every transform one C-level pass over ``is_nested``
    answers for the common case, no jagged leaf.

    Example:
        >>> import torch
        >>> has_jagged([torch.zeros(2)])
        False
    """
    if functorch_transforms_active():
        return any(map(is_jagged, ls))
    return any(map(_IS_NESTED, ls)) and any(map(is_jagged, ls))


@traced_as(has_jagged)
def _has_jagged_traced(ls: Sequence[Tensor]) -> bool:
    if functorch_transforms_active():
        return any(is_jagged(x) for x in ls)
    return any(x.is_nested for x in ls) and any(is_jagged(x) for x in ls)


def refuse(node: Node, op: str, detail: str = "", ls: Sequence[Tensor] | None = None) -> None:
    """Raise :class:`JaggedOpError` for ``op`` when ``node`` holds a jagged leaf (``ls``: its
    leaves, when the caller has them: no second walk)."""
    if ls is not None and not has_jagged(ls):
        return
    i = first_jagged(node)
    if i is not None:
        raise error(node, i, op, detail)


def row_spans(x: Any) -> tuple[Tensor, Tensor]:
    """The start and the length of every row of a jagged tensor (read under its wrappers).

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> [t.tolist() for t in row_spans(nt)]
        [[0, 2], [2, 3]]
    """
    b = jagged_base(x)
    off = b.offsets()
    lengths = b.lengths()
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
    starts, lens = row_spans(x)
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
    dim raises :class:`JaggedOpError`, as does a leaf a transform maps or differentiates."""
    usable(x, node, i, "a batch op")
    idx = fn(torch.arange(x.shape[0]))
    if idx.ndim == 0:
        return fn(x)
    check_ragged_dim(x, node, i, "a batch op")
    if idx.ndim == 1:
        return take_rows(x, idx)
    raise error(
        node, i, "a batch op", f" (it gives batch shape {tuple(idx.shape)}; a jagged leaf has one)"
    )


def check_ragged_dim(x: Any, node: Any, i: int, op: str) -> Any:
    """:class:`JaggedOpError` unless the ragged dim of jagged leaf ``i`` is dim 1 (right after
    the batch dim: the layout whose rows the functions here gather) and the active transform
    leaves torch a rule (:func:`usable`); the jagged tensor under the leaf's wrappers."""
    base = usable(x, node, i, op)
    if base._ragged_idx != 1:
        raise error(
            node, i, op, f" with its ragged dim at dim {base._ragged_idx} (tdfunc needs dim 1)"
        )
    return base


def cat(xs: Sequence[Any], node: Any = None, i: int = 0) -> Tensor:
    """Jagged tensors joined along the batch dim (values and offsets concatenated); ``node``
    and ``i`` (the first container and the leaf's position) name the key in an error.

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.arange(2.), torch.arange(3.)], layout=torch.jagged)
        >>> [len(r) for r in cat([nt, nt]).unbind()]
        [2, 3, 2, 3]
    """
    bases = [check_ragged_dim(x, node, i, "cat") for x in xs]
    xs = [
        x if b.lengths() is None else take_rows(x, torch.arange(x.shape[0]))
        for x, b in zip(xs, bases)
    ]
    values = torch.cat([x.values() for x in xs])
    parts = [jagged_base(xs[0]).offsets()]
    end = parts[0][-1:]
    for x in xs[1:]:
        off = jagged_base(x).offsets()
        parts.append(off[1:] + end)
        end = parts[-1][-1:] if off.numel() > 1 else end
    return torch.nested.nested_tensor_from_jagged(values, torch.cat(parts))


def align(m: Tensor, lead: int, leaf: Any, node: Any = None, i: int = 0) -> Tensor:
    """A tensor ``m`` whose ``lead`` leading dims name batch positions (a batch mask, a
    per-row weight) as a jagged tensor of ``leaf``'s rows (each row's value repeated over the
    row and its feature dims), so that torch's jagged kernels take it beside ``leaf``
    (``node`` and ``i``, the container and the leaf's position, name the key in an error).

    Example:
        >>> import torch
        >>> nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
        >>> align(torch.tensor([True, False]), 1, nt).values().tolist()
        [True, True, False, False, False]
    """
    if lead == 0 or m.ndim == 0:
        return m
    base = usable(leaf, node, i, "a batch-shaped operand (a mask, where)")
    if base.lengths() is not None:
        raise JaggedOpError(
            "a batch-shaped tensor next to a jagged leaf with holes (lengths): compact the leaf "
            "first (tdfunc.as_jagged, or index it with its rows)"
        )
    v = base.values()
    _, lens = row_spans(base)
    rows = m.repeat_interleave(lens.to(m.device), dim=0, output_size=v.shape[0])
    rows = rows.reshape(rows.shape + (1,) * (v.ndim - rows.ndim)).expand(v.shape)
    return torch.nested.nested_tensor_from_jagged(rows, base.offsets())


def call_aligned(
    func: Callable[..., Any],
    leaf: Tensor,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    pos: int,
    views: Sequence[tuple[int, int]],
    kviews: Sequence[tuple[str, int]],
    node: Any = None,
    at: int = 0,
) -> Any:
    """``func`` on a jagged ``leaf`` (at position ``pos`` of ``args``) with the batch-aligned
    tensors (``views``: positions, ``kviews``: keywords, each with its batch ndim) made jagged
    tensors of its rows (:func:`align`; ``node`` and ``at`` name the key in an error)."""
    a = list(args)
    for i, lead in views:
        a[i] = align(args[i], lead, leaf, node, at)
    kw = {**kwargs}
    for k, lead in kviews:
        kw[k] = align(kwargs[k], lead, leaf, node, at)
    a[pos] = leaf
    return func(*a, **kw)


#: the index dtypes a stored jagged leaf's offsets and lengths may have
_INDEX_DTYPES = (torch.int64, torch.int32)


def jagged_problem(
    values: Tensor, offsets: Tensor, lengths: Tensor | None, batch_size: Sequence[int]
) -> str | None:
    """What is wrong with the parts of a jagged tensor read from a file or a peer (``None``
    when nothing is): checked before torch builds the tensor from them, and by a save before
    it writes one.

    The parts are one of the layouts torch builds, and nothing else. Without lengths
    (``nested_tensor``, ``as_nested_tensor``, rows gathered by tdfunc) the offsets split the
    values whole: they start at 0, never decrease and end at the values' length. With
    lengths (a tensor with holes: ``torch.nested.narrow``, or offsets and lengths given
    together to ``nested_tensor_from_jagged``) row ``i`` is ``values[offsets[i]:][:lengths[i]]``
    and lies in its slot, before ``offsets[i + 1]``; the offsets never decrease and stay
    within the values, but may start after 0 and end before the last value (``narrow``).
    Offsets and lengths are 1-D int64 or int32 (``narrow`` keeps the dtype of the lengths it
    is given: the two may differ).

    Example:
        >>> import torch
        >>> jagged_problem(torch.zeros(5), torch.tensor([0, 2, 1]), None, [2])
        'offsets decrease'
        >>> jagged_problem(torch.zeros(5), torch.tensor([1, 2, 5]), None, [2])
        'offsets run 1..5: without lengths they start at 0 and end at 5 (the value rows)'
        >>> jagged_problem(torch.zeros(5), torch.tensor([1, 2, 5]), torch.tensor([1, 3]), [2])
    """
    if offsets.ndim != 1 or offsets.dtype not in _INDEX_DTYPES:
        return f"offsets must be 1-D int64 or int32, got {offsets.dtype} {tuple(offsets.shape)}"
    if values.ndim < 1:
        return "values must have at least one dim"
    if len(batch_size) != 1 or offsets.numel() != batch_size[0] + 1:
        return f"{offsets.numel()} offsets do not match batch_size {tuple(batch_size)}"
    o = offsets.as_subclass(Tensor).long()
    n = values.shape[0]
    if bool((o[1:] < o[:-1]).any()):
        return "offsets decrease"
    first, last = int(o[0]), int(o[-1])
    if first < 0 or last > n:
        return f"offsets {first}..{last} are not within the {n} value rows"
    if lengths is None:
        if first != 0 or last != n:
            return (
                f"offsets run {first}..{last}: without lengths they start at 0 and end at "
                f"{n} (the value rows)"
            )
        return None
    if lengths.ndim != 1 or lengths.dtype not in _INDEX_DTYPES or lengths.numel() != batch_size[0]:
        return (
            f"lengths must be 1-D int64 or int32 with one entry per row, got {lengths.dtype} "
            f"{tuple(lengths.shape)}"
        )
    ln = lengths.as_subclass(Tensor).long()
    if bool((ln < 0).any()):
        return "a length is negative"
    if bool((o[:-1] + ln > o[1:]).any()):
        return "a row (offset + length) runs past the next row's offset"
    return None


def from_read_parts(
    values: Tensor,
    offsets: Tensor,
    lengths: Tensor | None,
    batch_size: Sequence[int],
    refuse: Callable[[str], Exception],
) -> Tensor:
    """The jagged tensor of parts read from a file, on memory of its own (the parts may be
    memory-mapped views of the file), once :func:`jagged_problem` found nothing wrong with
    them; otherwise ``refuse(problem)`` is raised (the reader's typed error, naming the key)
    and torch never sees the parts.

    Example:
        >>> import torch
        >>> x = from_read_parts(torch.arange(3.0), torch.tensor([0, 1, 3]), None, [2], ValueError)
        >>> [r.tolist() for r in x.unbind()]
        [[0.0], [1.0, 2.0]]
        >>> from_read_parts(torch.arange(3.0), torch.tensor([1, 2, 3]), None, [2], ValueError)
        Traceback (most recent call last):
        ...
        ValueError: offsets run 1..3: without lengths they start at 0 and end at 3 (the value rows)
    """
    problem = jagged_problem(values, offsets, lengths, batch_size)
    if problem is not None:
        raise refuse(problem)
    return torch.nested.nested_tensor_from_jagged(
        values.as_subclass(Tensor).clone(),
        offsets.as_subclass(Tensor).clone(),
        None if lengths is None else lengths.as_subclass(Tensor).clone(),
    )


def jagged_parts(x: Any, node: Any = None, i: int = 0, op: str = "consolidate") -> list[Tensor]:
    """The tensors a jagged tensor is made of: values, offsets and (when present) lengths
    (``node`` and ``i`` name the key where the active transform leaves torch no rule)."""
    base = usable(x, node, i, op)
    lengths = base.lengths()
    return [x.values(), base.offsets()] + ([] if lengths is None else [lengths])


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
