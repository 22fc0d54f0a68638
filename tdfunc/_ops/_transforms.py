"""Leafwise transforms that keep a container's structure: ``apply`` and ``named_apply``,
``to``, ``clone``, ``detach``, ``contiguous``, the ``*_like`` constructors and
``consolidate`` (every leaf a view into one flat buffer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._jagged._layout import from_jagged_parts, has_jagged, is_jagged, jagged_parts
from .._tree import leaves, leaves_with_paths, map_leaves
from ._structure import check_batch_invariant, match_structure


def apply(
    node: Any, fn: Callable[..., Tensor], *others: Any, batch_size: Sequence[int] | None = None
) -> Any:
    """``fn`` on every leaf (zipped with the leaves of ``others``, of the same structure).

    The result keeps ``node``'s batch size unless ``batch_size`` is given; each result leaf is
    checked against it.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), batch_size=[2])
        >>> td.apply(lambda x, y: x + y, td)["a"].sum().item()
        12.0
        >>> td.apply(lambda x: x.sum(0), batch_size=[])["a"].shape
        torch.Size([3])
    """
    others = tuple(match_structure(node, o, "apply") for o in others)
    ls = leaves(node)
    if others:
        cols = [leaves(o) for o in others]
        out = [fn(x, *ys) for x, *ys in zip(ls, *cols)]
    else:
        out = [fn(x) for x in ls]
    bs = node._batch_size if batch_size is None else torch.Size(batch_size)
    check_batch_invariant(node, out, bs, "apply")
    return map_leaves(node, out, bs)


def named_apply(
    node: Any,
    fn: Callable[..., Tensor],
    *others: Any,
    nested_keys: bool | None = None,
    batch_size: Sequence[int] | None = None,
) -> Any:
    """``fn(key, leaf, *other_leaves)`` on every leaf (zipped with the leaves of ``others``,
    of the same structure).

    ``key`` is, by default, the leaf's key path as a tuple of strings (``("a",)``,
    ``("n", "b")``). ``nested_keys=True`` passes the key as tensordict does with
    ``nested_keys=True`` (a string at the top level, a tuple below it), ``nested_keys=False``
    the leaf's own key only (``"b"`` for ``("n", "b")``: tensordict's default). The result
    keeps ``node``'s batch size unless ``batch_size`` is given; each result leaf is checked.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.zeros(1)})
        >>> seen = []
        >>> _ = td.named_apply(lambda k, x: (seen.append(k), x)[1], nested_keys=True)
        >>> seen
        ['a', ('n', 'b')]
    """
    others = tuple(match_structure(node, o, "named_apply") for o in others)
    pairs = leaves_with_paths(node)
    if nested_keys is None:
        keys: list[Any] = [p for p, _ in pairs]
    elif nested_keys:
        keys = [p[0] if len(p) == 1 else p for p, _ in pairs]
    else:
        keys = [p[-1] for p, _ in pairs]
    if others:
        cols = [leaves(o) for o in others]
        out = [fn(k, x, *ys) for k, (_, x), *ys in zip(keys, pairs, *cols)]
    else:
        out = [fn(k, x) for k, (_, x) in zip(keys, pairs)]
    bs = node._batch_size if batch_size is None else torch.Size(batch_size)
    check_batch_invariant(node, out, bs, "named_apply")
    return map_leaves(node, out, None if batch_size is None else bs)


def _parse_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device, int)):
            device = a
        elif isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
    return (None if device is None else torch.device(device)), dtype


def to(node: Any, *args: Any, **kwargs: Any) -> Any:
    """``leaf.to(*args, **kwargs)`` on every leaf; a device argument sets the result's device.

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.TensorDict(a=torch.zeros(2)).to(torch.float64)["a"].dtype
        torch.float64
    """
    device, _ = _parse_to(args, kwargs)
    out = [x.to(*args, **kwargs) for x in leaves(node)]
    return map_leaves(node, out, None, node._device if device is None else device)


def clone(node: Any) -> Any:
    """A copy with cloned leaves."""
    return map_leaves(node, [x.clone() for x in leaves(node)])


def detach(node: Any) -> Any:
    """Leaves detached from autograd."""
    return map_leaves(node, [x.detach() for x in leaves(node)])


def contiguous(node: Any) -> Any:
    """Contiguous leaves."""
    return map_leaves(node, [x.contiguous() for x in leaves(node)])


def _like(
    node: Any, fn: Callable[..., Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn(leaf, *args, **kwargs)`` on every leaf (``dtype``, ``device``, ``layout``,
    ``requires_grad``, ``memory_format`` are passed on); a ``device`` sets the result's."""
    out = [fn(x, *args, **kwargs) for x in leaves(node)]
    device = kwargs.get("device")
    return map_leaves(node, out, None, node._device if device is None else torch.device(device))


def zeros_like(node: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """Same structure, leaves filled with 0 (keyword arguments as ``torch.zeros_like``).

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.zeros_like(tdfunc.TensorDict(a=torch.ones(2)))["a"].tolist()
        [0.0, 0.0]
    """
    return _like(node, torch.zeros_like, (), {"dtype": dtype, **kwargs})


def ones_like(node: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """Same structure, leaves filled with 1 (keyword arguments as ``torch.ones_like``)."""
    return _like(node, torch.ones_like, (), {"dtype": dtype, **kwargs})


def empty_like(node: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """Same structure, uninitialised leaves (keyword arguments as ``torch.empty_like``)."""
    return _like(node, torch.empty_like, (), {"dtype": dtype, **kwargs})


def full_like(node: Any, fill_value: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """Same structure, leaves filled with ``fill_value`` (keywords as ``torch.full_like``)."""
    return _like(node, torch.full_like, (fill_value,), {"dtype": dtype, **kwargs})


_ALIGN = 16


def consolidate(node: Any) -> Any:
    """A copy whose leaves are views into one flat, 16-byte aligned uint8 buffer.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(3), b=torch.arange(2)).consolidate()
        >>> td["a"].untyped_storage().data_ptr() == td["b"].untyped_storage().data_ptr()
        True
    """
    ls = leaves(node)
    if not ls:
        return node
    # a jagged leaf goes in as its parts (values, offsets, lengths) and is rebuilt around them
    jagged = [is_jagged(x) for x in ls] if has_jagged(ls) else [False] * len(ls)
    pieces = [jagged_parts(x, node, i) if j else [x] for i, (x, j) in enumerate(zip(ls, jagged))]
    flat = [p for ps in pieces for p in ps]
    parts: list[Tensor] = []
    offsets: list[int] = []
    off = 0
    for x in flat:
        b = x.contiguous().reshape(-1).view(torch.uint8)
        n = x.numel() * x.element_size()
        offsets.append(off)
        parts.append(b)
        pad = (-n) % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=x.device))
        off += n + pad
    buf = torch.cat(parts)
    views = iter(
        [
            buf[o : o + x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            for x, o in zip(flat, offsets)
        ]
    )
    out = [
        from_jagged_parts([next(views) for _ in ps]) if j else next(views)
        for j, ps in zip(jagged, pieces)
    ]
    return map_leaves(node, out)
