"""Pure functions over nodes (TensorDict and tensorclass): shape, combination, transforms,
arithmetic and reductions. Each takes nodes and returns new nodes; inputs are never changed.

Every function is written once against the node protocol of :mod:`tdfunc._tree`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _errors as E
from ._compat import check, foreach_add, foreach_div, foreach_mul, foreach_sub, is_batchedtensor
from ._keys import KeyPath, fmt_key
from ._tree import Node, is_node, leaves, leaves_with_paths, map_leaves, same_structure

_is_batched = is_batchedtensor


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------
def norm_dim(dim: int, ndim: int, batch_size: Any = None) -> int:
    """Normalise a batch dim in ``[-ndim, ndim)``; ``IndexError`` otherwise."""
    if not -ndim <= dim < ndim:
        raise IndexError(
            E.BATCH_DIM_RANGE.format(
                dim=dim,
                batch_size=tuple(batch_size) if batch_size is not None else "?",
                batch_dims=ndim,
            )
        )
    return dim + ndim if dim < 0 else dim


def _probe(node: Any) -> tuple[Tensor, int]:
    """A tensor whose leading dims are the node's batch dims, and its feature ndim.

    The first leaf when there is one (no extra work), else a meta tensor of the batch shape.
    """
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            return v, v.ndim - len(node._batch_size)
        if v is not None:
            t, _ = _probe(v)
            return t, t.ndim - len(node._batch_size)
    return torch.empty(node._batch_size, device="meta"), 0


def _batch_of(result: Tensor, feat: int) -> torch.Size:
    return result.shape[: result.ndim - feat]


def _map_shape(node: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Apply a batch-dims-only shape function to every leaf; derive the new batch size."""
    ls = leaves(node)
    if ls:
        out = [fn(x) for x in ls]
        first = ls[0]
        # feature ndim of the first leaf, relative to the root's batch dims
        feat = first.ndim - len(node._batch_size)
        return map_leaves(node, out, _batch_of(out[0], feat))
    meta = fn(torch.empty(node._batch_size, device="meta"))
    return map_leaves(node, [], meta.shape)


def _same_structure(nodes: Sequence[Any], op: str) -> None:
    for n in nodes[1:]:
        check_same_structure(nodes[0], n, op)


# --------------------------------------------------------------------------------------
# checks: operands share a structure; results keep the batch-size invariant
# --------------------------------------------------------------------------------------
def check_same_structure(a: Any, b: Any, what: str) -> None:
    """The one structure check of every op that combines containers.

    Raises :class:`~tdfunc._errors.KeysDifferError` when the key sets differ (naming the
    missing and extra paths) and :class:`~tdfunc._errors.NodeTypesDifferError` when only
    node types or static fields differ; both are :class:`~tdfunc._errors.StructureError`
    (a ``ValueError``).
    """
    if same_structure(a, b):
        return
    ka, kb = _key_set(a, ()), _key_set(b, ())
    sa, sb = set(ka), set(kb)
    missing = [k[0] if len(k) == 1 else k for k in ka if k not in sb]
    extra = [k[0] if len(k) == 1 else k for k in kb if k not in sa]
    if missing or extra:
        raise E.KeysDifferError(E.STRUCTURE.format(what=what, missing=missing, extra=extra))
    raise E.NodeTypesDifferError(
        E.STRUCTURE_TYPES.format(what=what, a=_type_tree(a), b=_type_tree(b))
    )


def _key_set(node: Node, prefix: KeyPath) -> list[KeyPath]:
    out: list[KeyPath] = []
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        out.append((*prefix, k))
        if isinstance(v, Node):
            out.extend(_key_set(v, (*prefix, k)))
    return out


def _type_tree(node: Node) -> str:
    inner = [
        f"{k}: {_type_tree(v)}"
        if isinstance(v, Node)
        else f"{k}: {'None' if v is None else 'leaf'}"
        for k, v in zip(node._tdf_keys(), node._tdf_children())
    ]
    static = node._tdf_static()
    extra = f", static={dict(static)}" if static else ""
    return f"{type(node).__name__}({', '.join(inner)}{extra})"


def starts_with_batch(
    shape: Sequence[Any], batch_size: Sequence[Any], where: str | KeyPath
) -> bool:
    """Whether ``shape`` starts with ``batch_size``: the check of a user's value against a
    batch size (constructors, ``set``, ``update``).

    In eager mode the sizes are ints and this is a plain comparison. Under ``torch.compile`` a
    size may be known only when the program runs (an unbacked size: the batch size after a
    boolean-mask index, ``nonzero``...). Such a pair cannot be compared while tracing, so
    it is taken as equal and the compiled program checks it when it runs (``torch._check``:
    a run-time assertion naming ``where``: a field name, or a key path); a pair known to
    differ still returns ``False``.

    Example:
        >>> import torch
        >>> starts_with_batch(torch.Size([4, 2]), torch.Size([4]), ("x",))
        True
        >>> starts_with_batch(torch.Size([3]), torch.Size([4]), ("x",))
        False
    """
    if len(shape) < len(batch_size):
        return False
    for s, b in zip(shape, batch_size):
        if (s == b) is not True:  # a different or a symbolic size
            return _starts_with_batch_symbolic(shape, batch_size, where)
    return True


def _starts_with_batch_symbolic(
    shape: Sequence[Any], batch_size: Sequence[Any], where: str | KeyPath
) -> bool:
    for s, b in zip(shape, batch_size):
        eq = s == b
        if eq is True:
            continue
        if eq is False:
            return False
        # symbolic sizes: only while tracing, when sympy is loaded anyway
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        if statically_known_true(s != b):
            return False
        label = where if isinstance(where, str) else f"key {fmt_key(where)}"
        msg = E.RUNTIME_BATCH_CHECK.format(where=label)
        check(eq, lambda msg=msg: msg)  # a message closing over constants only
    return True


def known_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two sizes are equal, for a shortcut that may skip per-value checks: a plain
    comparison in eager mode; while ``torch.compile`` traces, a pair of sizes known only when
    the program runs counts as not known to be equal (no data-dependent guard).

    Example:
        >>> import torch
        >>> known_equal(torch.Size([4]), (4,)), known_equal(torch.Size([4]), (3,))
        (True, False)
    """
    if len(a) != len(b):
        return False
    for s, t in zip(a, b):
        eq = s == t
        if eq is True:
            continue
        if eq is False:
            return False
        # symbolic sizes: only while tracing, when sympy is loaded anyway
        from torch.fx.experimental.symbolic_shapes import guard_or_false

        if not guard_or_false(eq):
            return False
    return True


def to_state_dict(node: Node, sep: str = ".") -> dict[str, Tensor]:
    """Every tensor leaf under a flat name: the key path joined by ``sep`` (through nested
    TensorDicts and tensorclasses alike; ``None`` fields are skipped). Two paths that give the
    same name raise ``ValueError`` naming both: no leaf is dropped.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict({"0": {"weight": torch.ones(2)}, "bias": torch.zeros(())})
        >>> sorted(to_state_dict(td))
        ['0.weight', 'bias']
    """
    out: dict[str, Tensor] = {}
    origin: dict[str, KeyPath] = {}
    for path, leaf in leaves_with_paths(node):
        put_flat(out, origin, path, leaf, sep, "to_state_dict")
    return out


def put_flat(
    out: dict[str, Any], origin: dict[str, KeyPath], path: KeyPath, value: Any, sep: str, what: str
) -> None:
    """``out[sep.join(path)] = value``; ``ValueError`` naming both paths if two paths join to
    one name (``origin`` remembers the path of each name)."""
    name = sep.join(path)
    if name in out:
        raise ValueError(
            E.FLATTEN_COLLISION.format(
                what=what, a=fmt_key(origin[name]), b=fmt_key(path), name=name, sep=sep
            )
        )
    out[name] = value
    origin[name] = path


def check_batch_invariant(
    node: Node, new_leaves: Sequence[Any], batch_size: torch.Size, what: str
) -> None:
    """Check that ``map_leaves(node, new_leaves, batch_size)`` would be a valid container.

    Every leaf must be a tensor whose shape starts with the batch size of the node that holds
    it in the result: ``batch_size`` for the root, ``batch_size`` + the node's extra dims for
    nested nodes. ``TypeError`` / ``ValueError`` naming the key path otherwise.
    """
    bd = len(batch_size)
    for x in new_leaves:  # fast pass over the root batch size
        if not isinstance(x, Tensor) or (bd and x.shape[:bd] != batch_size):
            break
    else:
        if not _has_extra_dims(node):
            return
    it = iter(new_leaves)
    _check_node(node, it, batch_size, (), what)


def _has_extra_dims(node: Node) -> bool:
    bd = len(node._batch_size)
    for v in node._tdf_children():
        if isinstance(v, Node) and (len(v._batch_size) > bd or _has_extra_dims(v)):
            return True
    return False


def _check_node(
    node: Node, it: Iterator[Any], batch_size: torch.Size, prefix: KeyPath, what: str
) -> None:
    old_bd, bd = len(node._batch_size), len(batch_size)
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        path = (*prefix, k)
        if isinstance(v, Tensor):
            x = next(it)
            if not isinstance(x, Tensor):
                raise TypeError(
                    E.NOT_A_TENSOR.format(what=what, key=fmt_key(path), typ=type(x).__name__)
                )
            if x.shape[:bd] != batch_size:
                raise ValueError(
                    E.LEAF_SHAPE.format(
                        key=fmt_key(path), shape=tuple(x.shape), batch_size=tuple(batch_size)
                    )
                    + f" (after {what})"
                )
        elif v is not None:
            _check_node(v, it, batch_size + v._batch_size[old_bd:], path, what)


# --------------------------------------------------------------------------------------
# indexing
# --------------------------------------------------------------------------------------
def _index_parts(idx: Any) -> tuple[Any, ...]:
    if not isinstance(idx, tuple):
        idx = (idx,)
    out = []
    for i in idx:
        if isinstance(i, list):
            # an empty list selects nothing (a long index, as torch reads it)
            i = torch.tensor(i) if i else torch.zeros(0, dtype=torch.long)
        out.append(i)
    return tuple(out)


def _dims_used(i: Any) -> int:
    if i is None or i is Ellipsis or isinstance(i, bool):
        return 0
    if isinstance(i, Tensor) and i.dtype == torch.bool:
        return i.ndim
    return 1


def normalize_index(idx: Any, batch_size: torch.Size) -> tuple[Any, ...]:
    """Expand ``Ellipsis`` over the batch dims only and check the index fits them."""
    parts = _index_parts(idx)
    bd = len(batch_size)
    used = sum(_dims_used(i) for i in parts)
    if used > bd:
        raise IndexError(
            E.TOO_MANY_INDICES.format(
                batch_size=tuple(batch_size), batch_dims=bd, index=idx, used=used
            )
        )
    n_ell = sum(1 for i in parts if i is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_ell == 1:
        pos = next(p for p, i in enumerate(parts) if i is Ellipsis)
        fill = (slice(None),) * (bd - used)
        parts = parts[:pos] + fill + parts[pos + 1 :]
    return parts


_ROW_DTYPES = (torch.int64, torch.int32)


def _is_row_gather(idx: Any, node: Any) -> bool:
    """``idx`` is a 1-D integer tensor (not vmapped) picking rows of the first batch dim."""
    return (
        isinstance(idx, Tensor)
        and idx.ndim == 1
        and idx.dtype in _ROW_DTYPES
        and len(node._batch_size) > 0
        and not _is_batched(idx)
    )


def index(node: Any, idx: Any) -> Any:
    """``node[idx]`` over the batch dims: int, slice, None, Ellipsis, bool mask, long tensor,
    list, and tuples of these.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3, 2), batch_size=[4, 3])
        >>> td[1:3, 0].batch_size
        torch.Size([2])
    """
    key: Any
    if isinstance(idx, (int, slice)) and not isinstance(idx, bool) and node._batch_size:
        key = idx  # fast path: one int or slice on the first batch dim
    elif _is_row_gather(idx, node):
        # rows of the first batch dim (a replay sample): ``index_select`` is several times
        # faster than advanced indexing on CPU; negative rows are wrapped first, so the
        # values and the error type (IndexError out of range) are those of ``x[idx]``
        pos = torch.where(idx < 0, idx + node._batch_size[0], idx)
        return _map_shape(
            node, lambda x: x.index_select(0, pos) if x.device == pos.device else x[idx]
        )
    else:
        parts = normalize_index(idx, node._batch_size)
        key = parts[0] if len(parts) == 1 else parts  # x[i] is cheaper than x[(i,)]
    return _map_shape(node, lambda x: x[key])


def index_update(node: Any, idx: Any, value: Any, op: str = "set") -> Any:
    """Out-of-place ``node[idx] = value`` (``op="set"``) or ``+= value`` (``op="add"``).

    ``"add"`` accumulates repeated indices like JAX's ``x.at[idx].add(v)``
    (``index_add``): ``at[[0, 0]].add(1)`` adds 2 to row 0. ``"set"`` with repeated
    indices keeps one of the written values (which one is unspecified, as in JAX).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(3), batch_size=[3])
        >>> td.at[[0, 0, 2]].add(1.0)["a"].tolist()
        [2.0, 0.0, 1.0]
    """
    parts = normalize_index(idx, node._batch_size)
    ls = leaves(node)
    if is_node(value):
        check_same_structure(node, value, "at[...].set")
        vs: Sequence[Any] = leaves(value)
    else:
        value = as_operand(value)
        vs = [value] * len(ls)
    if op == "set":
        out = []
        for x, v in zip(ls, vs):
            y = x.clone()
            # the value takes the leaf's dtype (as JAX's at[].set; index_put under vmap needs it)
            y[parts] = torch.as_tensor(v, dtype=x.dtype, device=x.device)
            out.append(y)
        return map_leaves(node, out)
    bs = node._batch_size
    # flat batch positions selected by the index, repeats included
    sel = torch.arange(math.prod(bs), device=ls[0].device if ls else None).reshape(bs)[parts]
    pos = sel.reshape(-1)
    out = []
    for x, v in zip(ls, vs):
        feat = x.shape[len(bs) :]
        src = torch.as_tensor(v, dtype=x.dtype, device=x.device).broadcast_to(sel.shape + feat)
        flat = x.reshape(-1, *feat).index_add(0, pos, src.reshape(-1, *feat))
        out.append(flat.reshape(x.shape))
    return map_leaves(node, out)


class AtIndexer:
    """``td.at[idx]``: out-of-place indexed updates, like JAX's ``x.at[idx].set(v)``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(3), batch_size=[3])
        >>> td.at[1].set(5.0)["a"].tolist(), td["a"].tolist()
        ([0.0, 5.0, 0.0], [0.0, 0.0, 0.0])
    """

    __slots__ = ("_node",)

    def __init__(self, node: Any) -> None:
        self._node = node

    def __getitem__(self, idx: Any) -> _AtRef:
        return _AtRef(self._node, idx)


class _AtRef:
    __slots__ = ("_idx", "_node")

    def __init__(self, node: Any, idx: Any) -> None:
        self._node = node
        self._idx = idx

    def set(self, value: Any) -> Any:
        """A new container with ``value`` written at the index."""
        return index_update(self._node, self._idx, value, "set")

    def add(self, value: Any) -> Any:
        """A new container with ``value`` added at the index."""
        return index_update(self._node, self._idx, value, "add")

    def get(self) -> Any:
        """Same as ``node[idx]``."""
        return index(self._node, self._idx)


# --------------------------------------------------------------------------------------
# shape ops (batch dims only)
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# combination
# --------------------------------------------------------------------------------------
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
    _same_structure(nodes, "stack")
    for i, n in enumerate(nodes):
        if n._batch_size != bs:
            raise ValueError(
                E.STACK_SHAPE.format(
                    op="stack", index=i, got=tuple(n._batch_size), expected=tuple(bs)
                )
            )
    columns = [leaves(n) for n in nodes]
    _check_leaf_shapes(nodes, columns, "stack", None)
    out = [torch.stack(c, d) for c in zip(*columns)]
    new_bs = bs[:d] + torch.Size([len(nodes)]) + bs[d:]
    return map_leaves(first, out, new_bs)


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
    _same_structure(nodes, "cat")
    for i, n in enumerate(nodes):
        nb = n._batch_size
        if len(nb) != len(bs) or any(a != b for j, (a, b) in enumerate(zip(nb, bs)) if j != d):
            raise ValueError(
                E.STACK_SHAPE.format(op="cat", index=i, got=tuple(nb), expected=tuple(bs))
            )
    columns = [leaves(n) for n in nodes]
    _check_leaf_shapes(nodes, columns, "cat", d)
    out = [torch.cat(c, d) for c in zip(*columns)]
    new_bs = bs[:d] + torch.Size([sum(n._batch_size[d] for n in nodes)]) + bs[d + 1 :]
    return map_leaves(first, out, new_bs)


def _split_results(
    node: Any, pieces_per_leaf: Sequence[Sequence[Tensor]], shapes: Sequence[torch.Size]
) -> tuple[Any, ...]:
    out = []
    n_pieces = len(shapes)
    for p in range(n_pieces):
        out.append(map_leaves(node, [pl[p] for pl in pieces_per_leaf], shapes[p]))
    return tuple(out)


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
    return _split_results(node, pieces, [new_bs] * bs[d])


def _needs_a_batch_dim(batch_size: torch.Size, op: str) -> None:
    if not batch_size:
        raise RuntimeError(E.NEEDS_A_BATCH_DIM.format(op=op))


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
    pieces = [x.split_with_sizes(sizes, d) for x in leaves(node)]
    shapes = [bs[:d] + torch.Size([s]) + bs[d + 1 :] for s in sizes]
    return _split_results(node, pieces, shapes)


def chunk(node: Any, chunks: int, dim: int = 0) -> tuple[Any, ...]:
    """Split along a batch dim into ``chunks`` pieces (as ``torch.chunk``)."""
    bs = node._batch_size
    _needs_a_batch_dim(bs, "chunk")
    d = norm_dim(dim, len(bs), bs)
    probe, _ = _probe(node)
    sizes = [p.shape[d] for p in torch.chunk(probe, chunks, d)]
    pieces = [torch.chunk(x, chunks, d) for x in leaves(node)]
    shapes = [bs[:d] + torch.Size([s]) + bs[d + 1 :] for s in sizes]
    return _split_results(node, pieces, shapes)


# --------------------------------------------------------------------------------------
# transforms
# --------------------------------------------------------------------------------------
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
    for o in others:
        check_same_structure(node, o, "apply")
    ls = leaves(node)
    if others:
        cols = [leaves(o) for o in others]
        out = [fn(x, *ys) for x, *ys in zip(ls, *cols)]
    else:
        out = [fn(x) for x in ls]
    bs = node._batch_size if batch_size is None else torch.Size(batch_size)
    check_batch_invariant(node, out, bs, "apply")
    return map_leaves(node, out, bs)


def named_apply(node: Any, fn: Callable[[KeyPath, Tensor], Tensor]) -> Any:
    """``fn(key_path, leaf)`` on every leaf; ``key_path`` is a tuple of strings."""
    pairs = leaves_with_paths(node)
    out = [fn(p, x) for p, x in pairs]
    check_batch_invariant(node, out, node._batch_size, "named_apply")
    return map_leaves(node, out)


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
    parts: list[Tensor] = []
    offsets: list[int] = []
    off = 0
    for x in ls:
        b = x.contiguous().reshape(-1).view(torch.uint8)
        n = x.numel() * x.element_size()
        offsets.append(off)
        parts.append(b)
        pad = (-n) % _ALIGN
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=x.device))
        off += n + pad
    buf = torch.cat(parts)
    out = []
    for x, o in zip(ls, offsets):
        n = x.numel() * x.element_size()
        out.append(buf[o : o + n].view(x.dtype).view(x.shape))
    return map_leaves(node, out)


# --------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------
_FOREACH: dict[Callable[..., Any], Callable[..., Any]] = {
    operator.add: foreach_add,
    operator.sub: foreach_sub,
    operator.mul: foreach_mul,
    operator.truediv: foreach_div,
}

#: ``number op leaf == leaf op number`` for these (same values, same type promotion)
_COMMUTATIVE = (operator.add, operator.mul)


def as_operand(x: Any) -> Any:
    if isinstance(x, (Tensor, int, float, bool, complex)) or is_node(x):
        return x
    if hasattr(x, "__array__"):
        return torch.as_tensor(x)
    return x


def _can_foreach(ls: list[Tensor]) -> bool:
    """One ``torch._foreach_*`` call is valid: leaves are not vmapped (foreach has no batching
    rule) and, when autograd records, share one dtype (foreach autograd rejects mixed lists
    such as a float leaf that requires grad next to an integer leaf)."""
    if not ls or any(map(_is_batched, ls)):
        return False
    if torch.is_grad_enabled() and any(x.requires_grad for x in ls):
        d = ls[0].dtype
        return all(x.dtype == d for x in ls)
    return True


def binary(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    """Elementwise ``op(a, b)`` where one or both operands are nodes of the same structure.

    Numbers and same-shaped TensorDict pairs use one ``torch._foreach_*`` call for
    ``+ - * /`` (per-leaf ops inside ``torch.vmap``, where foreach has no batching rule).

    Example:
        >>> import operator, torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2))
        >>> tdfunc._ops.binary(operator.mul, td, 3)["a"].tolist()
        [3.0, 3.0]
    """
    if is_node(a) and is_node(b):
        check_same_structure(a, b, f"{getattr(op, '__name__', op)}")
        la, lb = leaves(a), leaves(b)
        f = _FOREACH.get(op)
        if (
            f is not None
            and _can_foreach(la)
            and _can_foreach(lb)
            and all(x.shape == y.shape for x, y in zip(la, lb))
        ):
            return map_leaves(a, f(la, lb))
        return map_leaves(a, [op(x, y) for x, y in zip(la, lb)])
    if is_node(a):
        ls = leaves(a)
        f = _FOREACH.get(op)
        if (
            f is not None
            and isinstance(b, (int, float))
            and not isinstance(b, bool)
            and _can_foreach(ls)
        ):
            return map_leaves(a, f(ls, b))
        out = [op(x, b) for x in ls]
        if isinstance(b, Tensor) and b.ndim > 0:
            check_batch_invariant(a, out, a._batch_size, getattr(op, "__name__", "op"))
        return map_leaves(a, out)
    ls = leaves(b)
    if (
        op in _COMMUTATIVE
        and isinstance(a, (int, float))
        and not isinstance(a, bool)
        and _can_foreach(ls)
    ):
        # ``lr * grads``: a number times (plus) every leaf is one foreach call
        return map_leaves(b, _FOREACH[op](ls, a))
    out = [op(a, x) for x in ls]
    if isinstance(a, Tensor) and a.ndim > 0:
        check_batch_invariant(b, out, b._batch_size, getattr(op, "__name__", "op"))
    return map_leaves(b, out)


def unary(op: Callable[[Tensor], Tensor], node: Any) -> Any:
    """Elementwise ``op`` on every leaf."""
    return map_leaves(node, [op(x) for x in leaves(node)])


def elementwise(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Call a torch elementwise function with node arguments replaced by their leaves."""
    nodes = [a for a in args if is_node(a)]
    ref = nodes[0]
    for n in nodes[1:]:
        check_same_structure(ref, n, getattr(func, "__name__", "op"))
    cols = [leaves(a) if is_node(a) else None for a in args]
    n_leaves = len(next(c for c in cols if c is not None))
    out = []
    for i in range(n_leaves):
        call_args = [c[i] if c is not None else a for a, c in zip(args, cols)]
        out.append(func(*call_args, **kwargs))
    check_batch_invariant(ref, out, ref._batch_size, getattr(func, "__name__", "op"))
    return map_leaves(ref, out)


# --------------------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------------------
def _dims_arg(dim: Any, bs: torch.Size) -> tuple[int, ...]:
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = tuple(sorted({norm_dim(d, len(bs), bs) for d in dims}))
    return out


def reduce(node: Any, name: str, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    """Reduce every leaf with ``torch.<name>``.

    With ``dim=None`` each leaf is reduced whole (the result has ``batch_size=()``, 0-d leaves);
    with ``dim`` (an int or a tuple of batch dims) only those batch dims are reduced.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(4, 3), batch_size=[4])
        >>> td.sum(dim=0)["a"].tolist(), td.sum()["a"].item()
        ([4.0, 4.0, 4.0], 12.0)
    """
    fn = getattr(torch, name)
    ls = leaves(node)
    if dim is None:
        out = [fn(x, **kwargs) for x in ls]
        return map_leaves(node, out, torch.Size(()), keep_extra=False)
    bs = node._batch_size
    dims = _dims_arg(dim, bs)
    if name == "prod":
        out = []
        for x in ls:
            for d in reversed(dims):
                x = torch.prod(x, d, keepdim=keepdim, **kwargs)
            out.append(x)
    else:
        out = [fn(x, dims, keepdim=keepdim, **kwargs) for x in ls]
    if keepdim:
        new_bs = torch.Size([1 if i in dims else s for i, s in enumerate(bs)])
    else:
        new_bs = torch.Size([s for i, s in enumerate(bs) if i not in dims])
    return map_leaves(node, out, new_bs)


def all_(node: Any, dim: Any = None) -> Any:
    """0-d bool tensor: every element of every leaf is true (or a node reduced over ``dim``)."""
    if dim is not None:
        return reduce(node, "all", dim)
    ls = leaves(node)
    if not ls:
        return torch.tensor(True)
    return torch.stack([x.all() for x in ls]).all()


def any_(node: Any, dim: Any = None) -> Any:
    """0-d bool tensor: some element of some leaf is true (or a node reduced over ``dim``)."""
    if dim is not None:
        return reduce(node, "any", dim)
    ls = leaves(node)
    if not ls:
        return torch.tensor(False)
    return torch.stack([x.any() for x in ls]).any()


__all__ = [
    "AtIndexer",
    "all_",
    "any_",
    "apply",
    "binary",
    "cat",
    "chunk",
    "clone",
    "consolidate",
    "contiguous",
    "detach",
    "elementwise",
    "empty_like",
    "expand",
    "flatten",
    "full_like",
    "index",
    "index_update",
    "named_apply",
    "ones_like",
    "permute",
    "reduce",
    "reshape",
    "split",
    "squeeze",
    "stack",
    "to",
    "transpose",
    "unary",
    "unbind",
    "unflatten",
    "unsqueeze",
    "view",
    "zeros_like",
]
