"""Checks and helpers shared by every op over nodes: batch-dim normalisation, the one
structure check of ops that combine containers (:func:`match_structure`: leaves pair by key), the
batch-size invariant of results (:func:`check_batch_invariant`), batch-size comparisons that
stay traceable under ``torch.compile`` (:func:`starts_with_batch`, :func:`known_equal`), and
flat names of key paths (:func:`to_state_dict`, :func:`put_flat`).

The base of :mod:`tdfunc._ops`: it imports no other module of the package.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .._compat import check
from .._keys import KeyPath, fmt_key
from .._nontensor import NONTENSOR_ALONG_BATCH, NonTensor
from .._tree import Node, is_node, leaves_with_paths, same_structure
from .._tree import match_structure as _match


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


def _needs_a_batch_dim(batch_size: torch.Size, op: str) -> None:
    if not batch_size:
        raise RuntimeError(E.NEEDS_A_BATCH_DIM.format(op=op))


# --------------------------------------------------------------------------------------
# checks: operands share a structure; results keep the batch-size invariant
# --------------------------------------------------------------------------------------
def match_structure(a: Any, b: Any, what: str) -> Any:
    """The one structure check of every op that combines containers: ``b`` paired with ``a``
    by key (``b`` itself, or ``b`` in ``a``'s key order when only the order differs), so
    leaves meet by key and the result keeps the first operand's order.

    Raises :class:`~tdfunc._errors.KeysDifferError` when the key sets differ (naming the
    missing and extra paths) and :class:`~tdfunc._errors.NodeTypesDifferError` when only
    node types or static fields differ; both are :class:`~tdfunc._errors.StructureError`
    (a ``ValueError``).

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.zeros(1), y=torch.ones(1))
        >>> b = tdfunc.TensorDict(y=torch.ones(1), x=torch.zeros(1))
        >>> list(match_structure(a, b, "add").keys())
        ['x', 'y']
    """
    if same_structure(a, b):
        return b
    m = _match(a, b)
    if m is not None:
        return m
    ka, kb = _key_set(a, ()), _key_set(b, ())
    sa, sb = set(ka), set(kb)
    missing = [k[0] if len(k) == 1 else k for k in ka if k not in sb]
    extra = [k[0] if len(k) == 1 else k for k in kb if k not in sa]
    if missing or extra:
        raise E.KeysDifferError(E.STRUCTURE.format(what=what, missing=missing, extra=extra))
    raise E.NodeTypesDifferError(
        E.STRUCTURE_TYPES.format(what=what, a=_type_tree(a), b=_type_tree(b))
    )


def match_operands(
    args: Sequence[Any], kwargs: dict[str, Any], what: str
) -> tuple[tuple[Any, ...], dict[str, Any], list[Any]]:
    """``args`` and ``kwargs`` with every container after the first paired with the first by
    key (:func:`match_structure`), and the containers among them (positional first): the
    operands of a torch function called leaf by leaf.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.zeros(1), y=torch.ones(1))
        >>> b = tdfunc.TensorDict(y=torch.ones(1), x=torch.zeros(1))
        >>> args, _, nodes = match_operands((a, b), {}, "add")
        >>> list(args[1].keys()), len(nodes)
        (['x', 'y'], 2)
    """
    nodes = [a for a in args if is_node(a)]
    if kwargs:
        nodes += [v for v in kwargs.values() if is_node(v)]
    if len(nodes) < 2:
        return tuple(args), kwargs, nodes
    ref = nodes[0]
    pairs = [(n, match_structure(ref, n, what)) for n in nodes[1:]]
    if all(m is n for n, m in pairs):
        return tuple(args), kwargs, nodes

    def sub(x: Any) -> Any:
        if is_node(x):
            for n, m in pairs:
                if x is n:
                    return m
        return x

    new_kwargs = {k: sub(v) for k, v in kwargs.items()}
    return tuple(sub(a) for a in args), new_kwargs, [ref, *(m for _, m in pairs)]


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
        elif isinstance(v, Node):
            _check_node(v, it, batch_size + v._batch_size[old_bd:], path, what)


def _per_sample_path(node: Any, prefix: KeyPath) -> tuple[KeyPath, Any] | None:
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if isinstance(v, NonTensor) and v.shape is not None:
            return (*prefix, k), v
        if isinstance(v, Node):
            found = _per_sample_path(v, (*prefix, k))
            if found is not None:
                return found
    return None


def refuse_per_sample(node: Any, nts: Sequence[tuple[torch.Size, NonTensor]], op: str) -> None:
    """``TypeError`` naming the key when ``node`` holds a per-sample non-tensor value (``nts``:
    its non-tensor leaves, as ``leaves_and_nontensors`` gives them) and ``op`` works along a
    batch dim by the leaves' values (a scan, ``sort``, ``flip``...): the values cannot follow.

    Example:
        >>> import torch, tdfunc
        >>> refuse_per_sample(tdfunc.TensorDict(a=torch.zeros(2), t="x", batch_size=[2]), [], "flip")
    """
    if not any(nt.shape is not None for _, nt in nts):
        return
    found = _per_sample_path(node, ())
    assert found is not None
    raise TypeError(NONTENSOR_ALONG_BATCH.format(key=fmt_key(found[0]), op=op))
