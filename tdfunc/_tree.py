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

import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import EllipsisType
from typing import Any

import optree
import torch
from torch import Tensor

from . import _errors as E
from ._compat import is_batchedtensor, pytree
from ._nontensor import NonTensor
from ._nontensor import from_json as _nontensor_from_json
from ._nontensor import to_json as _nontensor_to_json
from ._twins import traced_as

Key = str | tuple[str, ...]
KeyPath = tuple[str, ...]

#: optree namespace under which nodes are registered: ``optree.tree_map(f, td, namespace="tdfunc")``
OPTREE_NAMESPACE = "tdfunc"


class Node:
    """Base of every node type (``TensorDict`` and tensorclasses): the whole node protocol.

    Every function of tdfunc reaches a node's data only through these methods. The first
    three are required; the others have defaults that fit any node.
    """

    __slots__ = ()
    _batch_size: torch.Size
    _device: torch.device | None
    #: the dict layout (``TensorDict``), part of the protocol: a node that declares it has its
    #: children as the values of its ``_data`` dict, in key order, and rebuilds from a new
    #: such dict with ``_tdf_from_data(data, batch_size, device)``; the rebuild and the leaf
    #: walk read ``_data`` in one comprehension (no children tuple, no ``zip``)
    _tdf_dict_layout: bool = False
    _data: dict[str, Any]  # the dict layout only

    # ---- required
    def _tdf_keys(self) -> tuple[str, ...]:
        """Names of the children, in order (``None`` fields included)."""
        raise NotImplementedError

    def _tdf_children(self) -> tuple[Any, ...]:
        """The children (tensor, node or ``None``), in the order of :meth:`_tdf_keys`."""
        raise NotImplementedError

    def _tdf_rebuild(
        self, children: Sequence[Any], batch_size: torch.Size, device: torch.device | None
    ) -> Any:
        """Trusted: the same type and static fields with new children, batch size and device."""
        raise NotImplementedError

    def _tdf_from_data(
        self, data: dict[str, Any], batch_size: torch.Size, device: torch.device | None
    ) -> Any:
        """The dict layout only (``_tdf_dict_layout``): trusted, the same type around ``data``
        (new children by key), with this batch size and device."""
        raise NotImplementedError

    # ---- with defaults
    def _tdf_get(self, key: str, default: Any) -> Any:
        """The child ``key``, or ``default`` when there is none."""
        for k, v in zip(self._tdf_keys(), self._tdf_children()):
            if k == key:
                return v
        return default

    def _tdf_static(self) -> tuple[tuple[str, Any], ...]:
        """Static (non-tensor) metadata as hashable ``(name, value)`` pairs; part of the structure."""
        return ()

    def _tdf_set(self, key: str, value: Any) -> Any:
        """A new node with the user value ``value`` (converted and checked) at child ``key``."""
        raise NotImplementedError

    def _tdf_with_items(self, items: Sequence[tuple[str, Any]]) -> Any:
        """Trusted: a node of the same kind, batch size and device holding exactly ``items``.

        Key ops (``select``, ``exclude``, ``rename_key``) build their results with it. A node
        with a fixed set of fields refuses a different set of names with ``TypeError``.
        """
        raise NotImplementedError

    def _tdf_new_child(self, key: str) -> Any:
        """The empty node that a path write creates under a missing ``key``."""
        raise NotImplementedError

    def _tdf_repr(self, indent: int) -> str:
        """``repr`` at nesting level ``indent``."""
        pad = "    " * (indent + 1)
        lines = [f"{type(self).__name__}("]
        for k, v in zip(self._tdf_keys(), self._tdf_children()):
            lines.append(f"{pad}{k}: {describe_child(v, indent)},")
        dev = None if self._device is None else str(self._device)
        lines.append(f"{pad}batch_size={tuple(self._batch_size)}, device={dev})")
        return "\n".join(lines)


def describe_child(v: Any, indent: int) -> str:
    """A child in a ``repr``: tensor summary, nested repr or ``repr(v)``."""
    if isinstance(v, Tensor):
        return f"Tensor(shape={tuple(v.shape)}, dtype={v.dtype})"
    if isinstance(v, Node):
        return v._tdf_repr(indent + 1)
    if isinstance(v, NonTensor):
        return repr(v.value) if v.shape is None else f"NonTensor(per_sample, shape={v.shape})"
    return repr(v)


def is_node(x: Any) -> bool:
    """True for a container: a TensorDict or tensorclass instance (``tdfunc.is_container``).

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.is_container(tdfunc.TensorDict(a=torch.zeros(1)))
        True
        >>> tdfunc.is_container(torch.zeros(1))
        False
    """
    return isinstance(x, Node)


def as_batch_size(batch_size: Any) -> torch.Size:
    """A user's ``batch_size`` as a ``torch.Size``: ``None``, an int, or a sequence of ints >= 0.

    ``TypeError`` for anything but ints (``True`` is not a size), ``ValueError`` for a
    negative size.

    Example:
        >>> as_batch_size([2, 3]), as_batch_size(4), as_batch_size(None)
        (torch.Size([2, 3]), torch.Size([4]), torch.Size([]))
    """
    if batch_size is None:
        return torch.Size(())
    if isinstance(batch_size, (int, torch.SymInt)) and not isinstance(batch_size, bool):
        batch_size = (batch_size,)
    elif not isinstance(batch_size, (tuple, list, torch.Size)):
        raise TypeError(E.BATCH_SIZE_TYPE.format(value=batch_size, typ=type(batch_size).__name__))
    for s in batch_size:
        if isinstance(s, bool) or not isinstance(s, (int, torch.SymInt)):
            raise TypeError(E.BATCH_SIZE_TYPE.format(value=batch_size, typ=type(s).__name__))
        if isinstance(s, int) and s < 0:
            raise ValueError(E.BATCH_SIZE_NEGATIVE.format(value=tuple(batch_size)))
    return batch_size if isinstance(batch_size, torch.Size) else torch.Size(batch_size)


# --------------------------------------------------------------------------------------
# leaves and rebuilding
# --------------------------------------------------------------------------------------
def _collect(node: Node, out: list[Tensor]) -> None:
    append = out.append
    for v in node._data.values() if node._tdf_dict_layout else node._tdf_children():
        if isinstance(v, Tensor):
            append(v)
        elif isinstance(v, Node):
            _collect(v, out)


def leaves(node: Node) -> list[Tensor]:
    """All tensor leaves of ``node``, depth first, in key order."""
    out: list[Tensor] = []
    _collect(node, out)
    return out


def _collect_split(node: Node, out: list[Tensor], nts: list[tuple[torch.Size, NonTensor]]) -> None:
    for v in node._data.values() if node._tdf_dict_layout else node._tdf_children():
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, Node):
            _collect_split(v, out, nts)
        elif isinstance(v, NonTensor):
            nts.append((node._batch_size, v))


def leaves_and_nontensors(node: Node) -> tuple[list[Tensor], list[tuple[torch.Size, NonTensor]]]:
    """The tensor leaves of ``node`` (as :func:`leaves`) and its non-tensor leaves, each with
    the batch size of the node holding it, in the order :func:`rebuild` meets them (one walk).

    Example:
        >>> import torch, tdfunc
        >>> ls, nts = leaves_and_nontensors(tdfunc.TensorDict(a=torch.zeros(2), t="x", batch_size=[2]))
        >>> len(ls), nts
        (1, [(torch.Size([2]), NonTensor('x'))])
    """
    out: list[Tensor] = []
    nts: list[tuple[torch.Size, NonTensor]] = []
    _collect_split(node, out, nts)
    return out, nts


def flat_leaves(node: Node) -> list[Tensor] | None:
    """The leaves of a dict-layout node (``TensorDict``) whose children are all tensors,
    else ``None``: one pass in C, where :func:`leaves` and :func:`rebuild` walk the children
    in Python (20 leaves: ~1 us less per op). Pair with :func:`rebuild_flat`. Eager only:
    Dynamo traces a twin that returns ``None`` (the general path, which it traces as cheaply).

    Example:
        >>> import torch, tdfunc
        >>> len(flat_leaves(tdfunc.TensorDict(a=torch.zeros(2), b=torch.ones(2))))
        2
        >>> flat_leaves(tdfunc.TensorDict(n={"a": torch.zeros(2)})) is None
        True
    """
    if not node._tdf_dict_layout:
        return None
    vals = list(node._data.values())
    return vals if all(map(isinstance, vals, _ALWAYS_TENSOR)) else None


@traced_as(flat_leaves)
def _flat_leaves_traced(node: Node) -> list[Tensor] | None:
    return None


#: ``Tensor`` for every ``isinstance`` of :func:`flat_leaves`'s ``map`` (never exhausted)
_ALWAYS_TENSOR = itertools.repeat(Tensor)


def rebuild_flat(node: Node, new_leaves: Iterable[Any]) -> Any:
    """``node`` (whose leaves :func:`flat_leaves` returned) with ``new_leaves`` in their place,
    same batch size and device (trusted).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2))
        >>> rebuild_flat(td, [torch.ones(2)])["a"].tolist()
        [1.0, 1.0]
    """
    return node._tdf_from_data(
        dict(zip(node._data, new_leaves)),
        node._batch_size,
        node._device,
    )


def _collect_paths(node: Node, prefix: KeyPath, out: list[tuple[KeyPath, Tensor]]) -> None:
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if isinstance(v, Tensor):
            out.append(((*prefix, k), v))
        elif isinstance(v, Node):
            _collect_paths(v, (*prefix, k), out)


def leaves_with_paths(node: Node) -> list[tuple[KeyPath, Tensor]]:
    """``(key_path, leaf)`` pairs in the order of :func:`leaves`."""
    out: list[tuple[KeyPath, Tensor]] = []
    _collect_paths(node, (), out)
    return out


def has_leaves(node: Node) -> bool:
    """True when ``node`` or a node below it holds a tensor."""
    for v in node._tdf_children():
        if isinstance(v, Tensor) or (isinstance(v, Node) and has_leaves(v)):
            return True
    return False


def rebuild(
    node: Node,
    it: Iterator[Any],
    batch_size: torch.Size | None,
    device: torch.device | None,
    keep_extra: bool = True,
    nts: Iterator[Any] | None = None,
) -> Any:
    """The one rebuild: ``node``'s structure with new leaves taken from ``it`` (trusted).

    ``batch_size`` is the new batch size of ``node``; ``None`` keeps every node's own (the
    elementwise ops: nothing to recompute). Nested nodes take the parent's new batch size
    followed by their own extra dims (those beyond the parent's) when ``keep_extra``; exactly
    the parent's otherwise (e.g. after a full reduction).

    Non-tensor leaves take the next value of ``nts`` when given (the ops that move batch
    positions, in the order of :func:`leaves_and_nontensors`); without it they stay, and a
    per-sample one must fit its node's new batch size (``TypeError`` naming the key).
    """
    # the elementwise ops (batch_size None) never read a batch size: inside torch.compile
    # that costs no guard on it (type, length, each dim) for any node
    old_bd = 0 if batch_size is None else len(node._batch_size)
    new_bs = node._batch_size if batch_size is None else batch_size
    # one comprehension (the hot path of every op): a tensor takes the next leaf, None stays,
    # a node is rebuilt with its batch size derived as above. A dict layout's items are read
    # as they are (its new dict is the comprehension itself); other nodes pair keys and
    # children
    layout = node._tdf_dict_layout
    data = {
        k: next(it)
        if isinstance(v, Tensor)
        else v
        if v is None
        else rebuild(
            v,
            it,
            None
            if batch_size is None
            else batch_size + v._batch_size[old_bd:]
            if keep_extra
            else batch_size,
            device,
            keep_extra,
            nts,
        )
        if isinstance(v, Node)
        else _nontensor_child(k, v, nts, batch_size is None, new_bs)
        for k, v in (node._data.items() if layout else zip(node._tdf_keys(), node._tdf_children()))
    }
    if layout:
        return node._tdf_from_data(data, new_bs, device)
    return node._tdf_rebuild(list(data.values()), new_bs, device)


def _nontensor_child(
    key: str, v: Any, nts: Iterator[Any] | None, same_batch: bool, new_bs: torch.Size
) -> Any:
    """A non-tensor child in :func:`rebuild`: the next of ``nts``, or ``v`` itself when it
    still fits (elementwise ops; a shared value; a per-sample one of the same batch)."""
    if nts is not None:
        return next(nts)
    if same_batch or not isinstance(v, NonTensor) or v.shape is None or v.shape == tuple(new_bs):
        return v
    from ._nontensor import NONTENSOR_OP

    raise TypeError(
        NONTENSOR_OP.format(
            key=repr(key), op="this operation", got=v.shape, batch_size=tuple(new_bs)
        )
    )


def map_leaves(
    node: Node,
    new_leaves: Sequence[Any],
    batch_size: torch.Size | None = None,
    device: torch.device | EllipsisType | None = ...,
    keep_extra: bool = True,
    nts: Sequence[Any] | None = None,
) -> Any:
    """Same structure as ``node`` with ``new_leaves`` in place of its leaves (trusted);
    ``batch_size=None`` keeps every node's batch size. ``nts``: new non-tensor leaves, in
    the order of :func:`leaves_and_nontensors` (the ops that move batch positions)."""
    if batch_size is None and not keep_extra:
        batch_size = node._batch_size
    return rebuild(
        node,
        iter(new_leaves),
        batch_size,
        node._device if device is ... else device,
        keep_extra,
        None if nts is None else iter(nts),
    )


def with_leaves(node: Node, new_leaves: Iterable[Any]) -> Any:
    """``map_leaves(node, new_leaves)``: the same nodes, batch sizes and device around new
    leaves (trusted; the elementwise ops). No defaults: inside ``torch.compile`` a default
    that a call uses costs a guard on the function's defaults per compiled call.

    Example:
        >>> import torch, tdfunc
        >>> with_leaves(tdfunc.TensorDict(a=torch.zeros(2)), [torch.ones(2)])["a"].tolist()
        [1.0, 1.0]
    """
    return rebuild(node, iter(new_leaves), None, node._device, True)


def shallow_copy(node: Node) -> Any:
    """New nodes (nested ones too) around the same leaves."""
    return with_leaves(node, leaves(node))


def same_structure(a: Any, b: Any) -> bool:
    """True when two nodes have the same types, keys, static fields and nesting.

    Stops at the first difference and skips shared sub-nodes (``a is b``), so the checks of
    binary ops, ``stack`` and ``cat`` cost little in eager mode and little to trace.
    """
    if a is b:
        return True
    if type(a) is not type(b) or a._tdf_keys() != b._tdf_keys():
        return False
    if a._tdf_static() != b._tdf_static():
        return False
    for x, y in zip(a._tdf_children(), b._tdf_children()):
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            continue
        xn, yn = isinstance(x, Node), isinstance(y, Node)
        if xn or yn:
            if not (xn and yn and same_structure(x, y)):
                return False
        elif (x is None) != (y is None) or isinstance(x, NonTensor) != isinstance(y, NonTensor):
            return False
    return True


def reorder_like(ref: Node, node: Node) -> Any | None:
    """``node`` with the key order of ``ref`` at every level, or ``None`` when the two differ
    in more than order (node types, key sets, static fields, nesting).

    The one rule of containers that meet (arithmetic, comparisons, ``where``, ``stack``,
    ``cat``, optimizers): leaves pair by key, never by position, and the result takes the
    first operand's order. ``node`` itself comes back when its order is already ``ref``'s
    (the common case costs one key comparison per node). A container with fixed fields
    (tensorclass) has one order; only dict-layout nodes (``TensorDict``) are reordered.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.zeros(1), y=torch.ones(1))
        >>> b = tdfunc.TensorDict(y=torch.ones(1), x=torch.zeros(1))
        >>> list(reorder_like(a, b).keys())
        ['x', 'y']
        >>> reorder_like(a, tdfunc.TensorDict(x=torch.zeros(1))) is None
        True
    """
    if ref is node:
        return node
    if type(ref) is not type(node):
        return None
    kr, kn = ref._tdf_keys(), node._tdf_keys()
    if kr != kn:
        if len(kr) != len(kn) or set(kr) != set(kn):
            return None
        children = [node._tdf_get(k, None) for k in kr]
    else:
        children = list(node._tdf_children())
    changed = kr != kn
    for i, (x, y) in enumerate(zip(ref._tdf_children(), children)):
        if isinstance(x, Node) and isinstance(y, Node):
            z = reorder_like(x, y)
            if z is None:
                return None
            if z is not y:
                children[i] = z
                changed = True
    if not changed:
        return node
    return node._tdf_with_items(list(zip(kr, children)))


def match_structure(ref: Node, node: Node) -> Any | None:
    """``node`` paired with ``ref`` by key: ``node`` itself when both have the same structure,
    ``node`` in ``ref``'s key order when only the order differs, ``None`` otherwise.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.zeros(1), n={"p": torch.ones(1), "q": torch.ones(1)})
        >>> b = tdfunc.TensorDict(n={"q": torch.ones(1), "p": torch.ones(1)}, x=torch.zeros(1))
        >>> match_structure(a, b).keys(include_nested=True)
        ['x', ('n', 'p'), ('n', 'q'), 'n']
    """
    if same_structure(ref, node):
        return node
    other = reorder_like(ref, node)
    if other is None or other is node or not same_structure(ref, other):
        return None
    return other


# --------------------------------------------------------------------------------------
# pytree registration
# --------------------------------------------------------------------------------------
# For torch's pytree a node and every node below it form ONE pytree node whose children are
# the tensor leaves of the whole container (depth first, key order): torch.func transforms
# flatten and unflatten their arguments about a dozen times per call, and torch's pure-Python
# pytree costs a TreeSpec per node. The nested nodes' structure lives in the context (``subs``).
# Key paths (``tree_flatten_with_path``) still name every level: ``flatten_with_keys`` returns a
# node's own children and torch walks the nested nodes through their own registration. optree
# (C++, cheap per node) keeps one pytree node per container.

#: node class -> (serialized type name, rebuild_from_context); filled by :func:`register`
_CLASSES: dict[type, tuple[str, Callable[..., Any]]] = {}
#: serialized type name -> node class (the last class registered under that name)
_BY_NAME: dict[str, type] = {}


def _token(cls: type) -> Any:
    """A nested node's class inside a context: its serialized name when that name is its
    own (a plain string constant: hashable, JSON, accepted by torch.fx), the class otherwise."""
    name = _CLASSES[cls][0]
    return name if _BY_NAME.get(name) is cls else cls


def _class_of(token: Any) -> type:
    """The node class a context token names (``ValueError`` for an unknown name)."""
    if isinstance(token, str):
        cls = _BY_NAME.get(token)
        if cls is None:
            raise ValueError(E.UNKNOWN_CONTAINER_TYPE.format(name=token))
        return cls
    return token


def _node_context(node: Node, children: Sequence[Any], out: list[Any] | None) -> tuple[tuple, bool]:
    """The context of ``node`` (children ``children``) and whether it holds a tensor.

    ``(keys, batch_dims, child_ndims, device, empty_batch, static, leafless, subs)``:
    ``child_ndims`` holds each child's ndim (batch ndim for nodes; -1 for a ``None`` field, -2
    for another non-tensor child), or the :class:`NonTensor` leaf itself (kept in the
    structure, not among the children); ``leafless`` the positions of node children without tensor leaves (they
    follow the parent's batch size at unflatten); ``empty_batch`` the absolute batch size, kept
    only when no child carries tensors. With ``out`` (torch's deep flatten) the children go to
    ``out``, nested nodes flattened in place, and ``subs`` holds ``(position, class token,
    context)`` of each nested node; without it (optree) ``subs`` is empty and nested nodes are
    children of their own.
    """
    ndims: list[Any] = []
    leafless = []
    subs = []
    has_ref = False
    for i, v in enumerate(children):
        if isinstance(v, Tensor):
            ndims.append(v.ndim)
            has_ref = True
            if out is not None:
                out.append(v)
        elif v is None:
            ndims.append(-1)  # a None field: kept in the structure, not among the children
        elif isinstance(v, NonTensor):
            # a non-tensor leaf: the structure holds it (torch.vmap passes it through)
            ndims.append(v)
        elif isinstance(v, Node):
            ndims.append(len(v._batch_size))
            if out is not None and type(v) in _CLASSES:
                sub, held = _node_context(v, v._tdf_children(), out)
                subs.append((i, _token(type(v)), sub))
            else:  # optree's form, or a class not registered: a child of its own
                held = has_leaves(v)
                if out is not None:
                    out.append(v)
            if held:
                has_ref = True
            else:
                leafless.append(i)
        else:
            ndims.append(-2)  # a non-tensor child (e.g. the ints of a vmap in_dims tree)
            if out is not None:
                out.append(v)
    dev = node._device
    ctx = (
        node._tdf_keys(),
        len(node._batch_size),
        tuple(ndims),
        None if dev is None else str(dev),
        None if has_ref else tuple([int(s) for s in node._batch_size]),
        node._tdf_static(),
        tuple(leafless),
        tuple(subs),
    )
    return ctx, has_ref


def _context(node: Node, children: Sequence[Any]) -> tuple:
    """The one-level context of ``node`` (nested nodes are children; optree's form)."""
    return _node_context(node, children, None)[0]


def flatten(node: Node) -> tuple[list[Any], tuple]:
    """pytree flatten (torch): every leaf of the container, nested nodes in the context."""
    out: list[Any] = []
    ctx, _ = _node_context(node, node._tdf_children(), out)
    return out, ctx


_is_batched = is_batchedtensor


def _first_tensor(node: Node) -> Tensor | None:
    """The first tensor leaf of ``node``, depth first (None when it has none)."""
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            return v
        if isinstance(v, Node):
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _check_vmap_input(leaf: Tensor, batch_dims: int, key: str) -> None:
    """A vmap input lost one dim: it must be a batch dim (``ValueError`` otherwise)."""
    from ._vmap import check_vmapped_dim  # imported on first use: keeps torch._dynamo lazy

    check_vmapped_dim(leaf, batch_dims, key)


def _check_vmap_output(children: Sequence[Any], keys: Sequence[str]) -> None:
    """A transform's output gained a dim: ``JaggedOpError`` for a child that is a nested
    tensor of the strided layout, what ``torch.vmap`` returns for a jagged leaf it mapped
    over its batch dim (rows of different lengths, without sizes: no container holds one)."""
    for k, c in zip(keys, children):
        if isinstance(c, Tensor) and c.is_nested and c.layout != torch.jagged:
            raise E.JaggedOpError(E.JAGGED_VMAP_OUT.format(key=repr(k)))


def _nonneg(n: int) -> int:
    """``max(n, 0)`` without the builtin: non-strict ``torch.export`` replaces ``max`` while
    it traces, and Dynamo (tracing ``tdfunc.cond`` inside such an export, torch 2.15) refuses
    the replacement ("op max not reachable")."""
    return n if n > 0 else 0


def derive_batch_size(children: Sequence[Any], ctx: tuple) -> torch.Size | None:
    """Batch size of a node rebuilt from ``children`` (``None`` fields put back) under ``ctx``.

    Taken from the first child that carries tensors: the change of its ndim since flatten
    tells how many batch dims a transform added or removed. Nodes without tensor leaves
    carry no information and are skipped. Returns None when the children are not tensors
    (e.g. pytree ``in_dims`` trees).
    """
    bd, ndims, leafless = ctx[1], ctx[2], ctx[6]
    for i, (c, nd) in enumerate(zip(children, ndims)):
        if nd == -1 or isinstance(nd, NonTensor) or (leafless and i in leafless):
            continue
        if isinstance(c, Tensor):
            moved = c.ndim - nd
            if not moved:  # the common case: no transform added or removed a batch dim
                return c.shape[:bd]
            new_bd = bd + moved
            if new_bd == bd - 1 and _is_batched(c):
                _check_vmap_input(c, bd, ctx[0][i])
            elif moved > 0:
                _check_vmap_output(children, ctx[0])
            if new_bd <= 0:
                # no batch dim left: the sizes are not read (a jagged leaf that torch.vmap
                # maps over its batch dim, one row per call, has none)
                return torch.Size(())
            return c.shape[:new_bd]
        if isinstance(c, Node):
            new_bd = bd + len(c._batch_size) - nd
            if new_bd == bd - 1:
                first = _first_tensor(c)
                if first is not None and _is_batched(first):
                    _check_vmap_input(first, bd, ctx[0][i])
            return c._batch_size[: _nonneg(new_bd)]
        return None
    empty = ctx[4]
    return torch.Size(empty if empty is not None else ())


def _follow_parent(
    children: list[Any], leafless: Sequence[int], ndims: Sequence[int], bd: int, bs: torch.Size
) -> list[Any]:
    """Node children without tensor leaves take the parent's batch size ``bs`` followed by
    their own extra dims (they cannot tell a transform's batch dims themselves)."""
    for i in leafless:
        c = children[i]
        if not isinstance(c, Node):
            continue
        extra = _nonneg(ndims[i] - bd)
        cb = c._batch_size
        want = bs + cb[len(cb) - extra :] if extra else bs
        if want != cb:
            children[i] = map_leaves(c, [], want)
    return children


def _build(cls_rebuild: Callable[..., Any], full: list[Any], ctx: tuple) -> Any:
    """Derive the batch size of a node whose children ``full`` (``None`` fields in place)
    are built, and rebuild it."""
    bs = derive_batch_size(full, ctx)
    if bs is None:
        bs = torch.Size(())
    elif ctx[6]:
        full = _follow_parent(full, ctx[6], ctx[2], ctx[1], bs)
    dev = ctx[3]
    return cls_rebuild(ctx[0], full, bs, None if dev is None else torch.device(dev), ctx[5])


def _unflatten_deep(cls_rebuild: Callable[..., Any], it: Iterator[Any], ctx: tuple) -> Any:
    """Rebuild a node and the nodes below it (``subs`` of ``ctx``) from the leaves ``it``."""
    ndims, subs = ctx[2], ctx[7]
    full: list[Any] = []
    j = 0
    for i, nd in enumerate(ndims):
        if nd == -1:
            full.append(None)
        elif isinstance(nd, NonTensor):
            full.append(nd)
        elif j < len(subs) and subs[j][0] == i:
            cls = _class_of(subs[j][1])
            full.append(_unflatten_deep(_CLASSES[cls][1], it, subs[j][2]))
            j += 1
        else:
            full.append(next(it))
    return _build(cls_rebuild, full, ctx)


def unflatten_with(cls_rebuild: Callable[..., Any], children: Sequence[Any], ctx: tuple) -> Any:
    """Shared unflatten: put ``None`` fields back, rebuild nested nodes, derive batch size."""
    if len(ctx) > 7 and ctx[7]:
        # torch's unflatten hands exactly the leaves of the spec
        return _unflatten_deep(cls_rebuild, iter(children), ctx)
    ndims = ctx[2]
    if -1 in ndims or any(isinstance(nd, NonTensor) for nd in ndims):
        it = iter(children)
        full: list[Any] = [
            None if nd == -1 else nd if isinstance(nd, NonTensor) else next(it) for nd in ndims
        ]
    else:
        full = list(children)
    return _build(cls_rebuild, full, ctx)


def node_type(name: str) -> type | None:
    """The TensorDict / tensorclass type registered as ``name`` in this process (None when
    there is none): a lookup in the registry, nothing is imported."""
    return _BY_NAME.get(name)


#: the node class a context token names (``ValueError`` for an unknown name)
class_of = _class_of


def nested_type_names(dumped: Any) -> list[str]:
    """The class names of the nested nodes in a JSON-dumped context (outermost first).

    Lets a reader of untrusted metadata check every container type before rebuilding.
    Walks iteratively: any depth is safe. ``ValueError`` when the value is not a context.
    """
    names: list[str] = []
    stack = [dumped]
    while stack:
        obj = stack.pop()
        if not isinstance(obj, list) or len(obj) not in (7, 8):
            raise ValueError(E.BAD_CONTEXT)
        if len(obj) == 8:
            for sub in obj[7]:
                if not (isinstance(sub, list) and len(sub) == 3 and isinstance(sub[1], str)):
                    raise ValueError(E.BAD_CONTEXT)
                names.append(sub[1])
                stack.append(sub[2])
    return names


def _to_dumpable(ctx: tuple) -> Any:
    keys, bd, ndims, dev, empty, static, leafless = ctx[:7]
    subs = ctx[7] if len(ctx) > 7 else ()
    return [
        list(keys),
        bd,
        [_nontensor_to_json(d) if isinstance(d, NonTensor) else d for d in ndims],
        dev,
        None if empty is None else list(empty),
        _static_to_json(static),
        list(leafless),
        [[i, _CLASSES[_class_of(t)][0], _to_dumpable(c)] for i, t, c in subs],
    ]


#: what a context may hold (checked before anything is built from it)
_MAX_CONTEXT_DEPTH = 512
_MAX_BATCH_DIMS = 1024
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,6})?")


def _is_index(x: Any, low: int = 0) -> bool:
    return type(x) is int and x >= low


def _json_scalar_or_tuple(v: Any) -> Any:
    """A static value read back: JSON scalars, lists as tuples (any nesting, iteratively
    bounded by the JSON depth); ``ValueError`` for anything else (objects)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return tuple(_json_scalar_or_tuple(x) for x in v)
    raise ValueError(E.BAD_CONTEXT)


def context_from_json(obj: Any, depth: int = 0) -> tuple:
    """A node's context from its JSON form (torch's ``from_dumpable_context``), checked
    against the allow-list of what :func:`_to_dumpable` writes: unique string keys, int
    batch dims and child ndims, a device string, JSON scalars (and lists of them) as static
    values, in-range positions, nested nodes named by a type registered here. Nothing named
    by the data is imported or looked up (``ValueError`` otherwise)."""
    ok = isinstance(obj, list) and len(obj) in (7, 8) and depth < _MAX_CONTEXT_DEPTH
    if ok:
        keys, bd, ndims, dev, empty, static, leafless = obj[:7]
        subs = obj[7] if len(obj) > 7 else []  # a 7-entry context: nested nodes are children
        n = len(keys) if isinstance(keys, list) else -1
        ok = (
            n >= 0
            and all(isinstance(k, str) for k in keys)
            and len(set(keys)) == n
            and _is_index(bd)
            and bd <= _MAX_BATCH_DIMS
            and isinstance(ndims, list)
            and len(ndims) == n
            and all(_is_index(d, -2) or isinstance(d, dict) for d in ndims)
            and (dev is None or (isinstance(dev, str) and _DEVICE.fullmatch(dev) is not None))
            and (empty is None or (isinstance(empty, list) and len(empty) == bd))
            and all(_is_index(s) for s in empty or ())
            and isinstance(static, list)
            and all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) for f in static)
            and len({f[0] for f in static}) == len(static)
            and isinstance(leafless, list)
            and all(_is_index(i) and i < n for i in leafless)
            and leafless == sorted(set(leafless))
            and isinstance(subs, list)
            and all(isinstance(x, list) and len(x) == 3 for x in subs)
            and all(_is_index(x[0]) and x[0] < n and _is_index(ndims[x[0]]) for x in subs)
            and [x[0] for x in subs] == sorted({x[0] for x in subs})
            and all(isinstance(x[1], str) for x in subs)
        )
    if not ok:
        raise ValueError(E.BAD_CONTEXT)
    return (
        tuple(keys),
        bd,
        tuple(_nontensor_from_json(d) if isinstance(d, dict) else d for d in ndims),
        dev,
        None if empty is None else tuple(empty),
        tuple((k, _json_scalar_or_tuple(v)) for k, v in static),
        tuple(leafless),
        tuple((i, _token(_class_of(name)), context_from_json(c, depth + 1)) for i, name, c in subs),
    )


_from_dumpable = context_from_json


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
    _CLASSES[cls] = (serialized_type_name, rebuild_from_context)
    _BY_NAME[serialized_type_name] = cls

    def _unflatten(children: Any, ctx: tuple) -> Any:
        return unflatten_with(rebuild_from_context, children, ctx)

    def _flatten_with_keys(node: Node) -> tuple[list[tuple[Any, Any]], tuple]:
        # one level (nested nodes are walked through their own registration): key paths
        # name every level, and the leaves come in the order of ``flatten``
        ks, ch = node._tdf_keys(), node._tdf_children()
        pairs = [
            (key_entry(k), v)
            for k, v in zip(ks, ch)
            if v is not None and not isinstance(v, NonTensor)
        ]
        return pairs, _context(node, ch)

    pytree.register_pytree_node(
        cls,
        flatten,
        _unflatten,
        serialized_type_name=serialized_type_name,
        flatten_with_keys_fn=_flatten_with_keys,
        to_dumpable_context=_to_dumpable,
        from_dumpable_context=_from_dumpable,
    )

    # optree's stubs declare node types as Collections; a Node is not one, hence ``Any``.
    def _optree_flatten(node: Any) -> tuple[list[Any], tuple, tuple[str, ...]]:
        ks = node._tdf_keys()
        ch = node._tdf_children()
        kept = [k for k, v in zip(ks, ch) if v is not None and not isinstance(v, NonTensor)]
        return (
            [v for v in ch if v is not None and not isinstance(v, NonTensor)],
            _context(node, ch),
            tuple(kept),
        )

    def _optree_unflatten(ctx: Any, children: Any) -> Any:
        return unflatten_with(rebuild_from_context, children, ctx)

    optree.register_pytree_node(
        cls,
        _optree_flatten,
        _optree_unflatten,
        path_entry_type=optree_entry,
        namespace=OPTREE_NAMESPACE,
    )


def _static_to_json(static: tuple) -> Any:
    return [[k, v] for k, v in static]
