"""The single definition of structure: nodes, leaves, key paths and pytree registration.

A *node* is an instance of :class:`Node` (``TensorDict`` or a ``@tensorclass``). A node
has named children (tensors, nested nodes or ``None``) and a ``batch_size`` shared by every
child as its leading dims. Everything else in tdfunc is written against the four primitives
below, so TensorDict and tensorclass share one code path:

* ``node._tdf_keys()``       -> tuple of child names
* ``node._tdf_children()``   -> tuple of child values, same order
* ``node._tdf_rebuild(children, batch_size, device)`` -> same type and static metadata
* ``node._batch_size`` / ``node._device``

Pytree context (``torch.utils._pytree`` and optree) is a small hashable tuple holding only
structure: ``(keys, batch_dims, child_ndims, device, empty_batch, static)``. No absolute size is kept
when the node has children: ``batch_size`` is re-derived from the leaves at unflatten. The
difference between a child's ndim at unflatten and at flatten tells how many batch dims a
transform (``torch.vmap``) added or removed, so vmap works with no patching of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as pytree
from torch import Tensor

Key = str | tuple[str, ...]
KeyPath = tuple[str, ...]

#: optree namespace under which nodes are registered: ``optree.tree_map(f, td, namespace="tdfunc")``
OPTREE_NAMESPACE = "tdfunc"


class Node:
    """Marker base of every node type: TensorDict and tensorclasses (internal protocol)."""

    __slots__ = ()

    # The protocol. Subclasses implement these.
    def _tdf_keys(self) -> tuple[str, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _tdf_children(self) -> tuple[Any, ...]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _tdf_rebuild(
        self, children: Sequence[Any], batch_size: torch.Size, device: torch.device | None
    ) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def is_node(x: Any) -> bool:
    """True for a TensorDict or tensorclass instance."""
    return isinstance(x, Node)


# --------------------------------------------------------------------------------------
# leaves and rebuilding
# --------------------------------------------------------------------------------------
def _collect(node: Node, out: list[Tensor]) -> None:
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            out.append(v)
        elif v is not None:
            _collect(v, out)


def leaves(node: Node) -> list[Tensor]:
    """All tensor leaves of ``node``, depth first, in key order."""
    out: list[Tensor] = []
    _collect(node, out)
    return out


def _collect_paths(node: Node, prefix: KeyPath, out: list[tuple[KeyPath, Tensor]]) -> None:
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if isinstance(v, Tensor):
            out.append((prefix + (k,), v))
        elif v is not None:
            _collect_paths(v, prefix + (k,), out)


def leaves_with_paths(node: Node) -> list[tuple[KeyPath, Tensor]]:
    """``(key_path, leaf)`` pairs in the order of :func:`leaves`."""
    out: list[tuple[KeyPath, Tensor]] = []
    _collect_paths(node, (), out)
    return out


def rebuild(
    node: Node,
    it: Iterator[Tensor],
    batch_size: torch.Size,
    device: torch.device | None = ...,  # type: ignore[assignment]
) -> Any:
    """Rebuild ``node``'s structure with new leaves taken from ``it`` (trusted, no checks).

    ``batch_size`` is the new batch size of ``node``. Nested nodes keep their extra batch
    dims (those beyond the parent's) and take the parent's new leading dims.
    """
    if device is ...:
        device = node._device
    old_bd = len(node._batch_size)
    children = []
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            children.append(next(it))
        elif v is None:
            children.append(None)
        else:
            children.append(rebuild(v, it, batch_size + v._batch_size[old_bd:], device))
    return node._tdf_rebuild(children, batch_size, device)


def map_leaves(
    node: Node,
    new_leaves: Sequence[Tensor],
    batch_size: torch.Size | None = None,
    device: torch.device | None = ...,  # type: ignore[assignment]
) -> Any:
    """Same structure as ``node`` with ``new_leaves`` in place of its leaves."""
    return rebuild(
        node, iter(new_leaves), node._batch_size if batch_size is None else batch_size, device
    )


def same_structure(a: Any, b: Any) -> bool:
    """True when two nodes have the same types, keys, static fields and nesting.

    Stops at the first difference and skips shared sub-nodes (``a is b``), so the checks of
    binary ops, ``stack`` and ``cat`` cost little in eager mode and little to trace.
    """
    if a is b:
        return True
    if type(a) is not type(b) or a._tdf_keys() != b._tdf_keys():
        return False
    static = getattr(a, "_tdf_static", None)
    if static is not None and static() != b._tdf_static():
        return False
    for x, y in zip(a._tdf_children(), b._tdf_children()):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            continue
        xn, yn = is_node(x), is_node(y)
        if xn or yn:
            if not (xn and yn and same_structure(x, y)):
                return False
        elif (x is None) != (y is None):
            return False
    return True


def key_set(node: Node, prefix: KeyPath = ()) -> list[KeyPath]:
    """Every key path (leaves, None fields and nodes) in order."""
    out: list[KeyPath] = []
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        out.append(prefix + (k,))
        if is_node(v):
            out.extend(key_set(v, prefix + (k,)))
    return out


def describe_difference(a: Any, b: Any) -> tuple[list[Any], list[Any]]:
    """Missing (in ``b``, present in ``a``) and extra (in ``b``, absent in ``a``) key paths."""
    ka = key_set(a)
    kb = key_set(b)
    sa, sb = set(ka), set(kb)
    missing = [k[0] if len(k) == 1 else k for k in ka if k not in sb]
    extra = [k[0] if len(k) == 1 else k for k in kb if k not in sa]
    return missing, extra


def fmt_key(path: KeyPath) -> str:
    """Human-readable key path: ``'a'`` or ``('a', 'b')``."""
    return repr(path[0]) if len(path) == 1 else repr(path)


# --------------------------------------------------------------------------------------
# pytree registration
# --------------------------------------------------------------------------------------
def _context(node: Node) -> tuple:
    ndims = []
    has_ref = False
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            ndims.append(v.ndim)
            has_ref = True
        elif v is None:
            ndims.append(-1)  # a None field: kept in the structure, not among the children
        elif isinstance(v, Node):
            ndims.append(len(v._batch_size))
            has_ref = True
        else:
            ndims.append(-2)  # a non-tensor child (e.g. the ints of a vmap in_dims tree)
    dev = node._device
    static_fn = getattr(node, "_tdf_static", None)
    # absolute sizes only when no child can carry them (an empty node)
    return (
        node._tdf_keys(),
        len(node._batch_size),
        tuple(ndims),
        None if dev is None else str(dev),
        None if has_ref else tuple([int(s) for s in node._batch_size]),
        () if static_fn is None else static_fn(),
    )


def flatten(node: Node) -> tuple[list[Any], tuple]:
    """pytree flatten: children (``None`` fields stay in the structure, not the children)."""
    children = [v for v in node._tdf_children() if v is not None]
    return children, _context(node)


_is_batched = torch._C._functorch.is_batchedtensor


def _first_tensor(node: Node) -> Tensor | None:
    """The first tensor leaf of ``node`` (None when its children are not tensors)."""
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            return v
        if is_node(v):
            return _first_tensor(v)
        if v is not None:
            return None
    return None


def _check_vmap_input(leaf: Tensor, batch_dims: int, key: str) -> None:
    """A vmap input lost one dim: it must be a batch dim (``ValueError`` otherwise)."""
    from ._vmap import check_vmapped_dim  # imported on first use: keeps torch._dynamo lazy

    check_vmapped_dim(leaf, batch_dims, key)


def derive_batch_size(children: Sequence[Any], ctx: tuple) -> torch.Size | None:
    """Batch size of a node rebuilt from ``children`` under context ``ctx``.

    Returns None when the children are not tensors (e.g. pytree ``in_dims`` trees).
    """
    keys, bd, ndims, _dev, empty, _static = ctx
    it = iter(children)
    for i, nd in enumerate(ndims):
        if nd == -1:
            continue
        c = next(it)
        if isinstance(c, Tensor):
            new_bd = bd + c.ndim - nd
            if new_bd == bd - 1 and _is_batched(c):
                _check_vmap_input(c, bd, keys[i])
            return c.shape[: max(new_bd, 0)]
        if is_node(c):
            new_bd = bd + len(c._batch_size) - nd
            if new_bd == bd - 1:
                first = _first_tensor(c)
                if first is not None and _is_batched(first):
                    _check_vmap_input(first, bd, keys[i])
            return c._batch_size[: max(new_bd, 0)]
        return None
    return torch.Size(empty if empty is not None else ())


def unflatten_with(cls_rebuild: Callable[..., Any], children: Sequence[Any], ctx: tuple) -> Any:
    """Shared unflatten: put ``None`` fields back, derive batch size, rebuild."""
    keys, bd, ndims, dev, empty, static = ctx
    if -1 in ndims:
        it = iter(children)
        full: Sequence[Any] = [None if nd == -1 else next(it) for nd in ndims]
    else:
        full = children
    bs = derive_batch_size(children, ctx)
    device = None if dev is None else torch.device(dev)
    return cls_rebuild(keys, full, torch.Size(()) if bs is None else bs, device, static)


def register(
    cls: type,
    rebuild_from_context: Callable[..., Any],
    serialized_type_name: str,
    key_entry: Callable[[str], Any],
    optree_entry: type,
) -> None:
    """Register a node class with torch's pytree and optree.

    ``rebuild_from_context(keys, children, batch_size, device, static)`` builds an instance.
    """

    def _unflatten(children: Any, ctx: tuple) -> Any:
        return unflatten_with(rebuild_from_context, list(children), ctx)

    def _flatten_with_keys(node: Node) -> tuple[list[tuple[Any, Any]], tuple]:
        ks = node._tdf_keys()
        pairs = [(key_entry(k), v) for k, v in zip(ks, node._tdf_children()) if v is not None]
        return pairs, _context(node)

    def _to_dumpable(ctx: tuple) -> Any:
        keys, bd, ndims, dev, empty, static = ctx
        return [
            list(keys),
            bd,
            list(ndims),
            dev,
            None if empty is None else list(empty),
            _static_to_json(static),
        ]

    def _from_dumpable(obj: Any) -> tuple:
        keys, bd, ndims, dev, empty, static = obj
        return (
            tuple(keys),
            int(bd),
            tuple(ndims),
            dev,
            None if empty is None else tuple(empty),
            _static_from_json(static),
        )

    pytree.register_pytree_node(
        cls,
        flatten,
        _unflatten,
        serialized_type_name=serialized_type_name,
        flatten_with_keys_fn=_flatten_with_keys,
        to_dumpable_context=_to_dumpable,
        from_dumpable_context=_from_dumpable,
    )

    def _optree_flatten(node: Node) -> tuple[list[Any], tuple, tuple[str, ...]]:
        ks = node._tdf_keys()
        ch = node._tdf_children()
        kept = [k for k, v in zip(ks, ch) if v is not None]
        return [v for v in ch if v is not None], _context(node), tuple(kept)

    def _optree_unflatten(ctx: tuple, children: Any) -> Any:
        return unflatten_with(rebuild_from_context, list(children), ctx)

    optree.register_pytree_node(
        cls,
        _optree_flatten,
        _optree_unflatten,
        path_entry_type=optree_entry,
        namespace=OPTREE_NAMESPACE,
    )


def _static_to_json(static: tuple) -> Any:
    return [[k, v] for k, v in static]


def _static_from_json(obj: Any) -> tuple:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in obj)
