"""Key paths: the one home of key normalisation, formatting, child lookup and path walks.

A *key* is a string (one level) or a non-empty tuple of strings (a path through nested
containers). Every module of tdfunc that takes a key goes through :func:`as_path`, looks up
children with :func:`child` / :func:`get_path` and enumerates paths with :func:`walk`, so a
key means the same thing in every op, in tensorclasses, storage, ``nn`` and ``distributed``.

Example:
    >>> import torch, tdfunc
    >>> from tdfunc._keys import as_path, get_path, walk
    >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2])
    >>> as_path("a"), as_path(("n", "b"))
    (('a',), ('n', 'b'))
    >>> get_path(td, ("n", "b")).tolist()
    [1.0, 1.0]
    >>> [p for p, _ in walk(td, leaves_only=True)]
    [('a',), ('n', 'b')]
"""

from __future__ import annotations

from typing import Any

from . import _errors as E
from ._tree import KeyPath, Node

Key = str | tuple[str, ...]

#: sentinel: "no default given" for lookups that raise ``KeyError`` on a missing key
MISSING: Any = object()
#: sentinel default for probing whether a path exists (``get_path(n, p, ABSENT) is ABSENT``)
ABSENT: Any = object()


def is_key(key: Any) -> bool:
    """True for a string or a non-empty tuple of strings.

    Example:
        >>> is_key("a"), is_key(("a", "b")), is_key(()), is_key(0)
        (True, True, False, False)
    """
    return isinstance(key, str) or (
        isinstance(key, tuple) and len(key) > 0 and all(isinstance(k, str) for k in key)
    )


def as_path(key: Any) -> KeyPath:
    """The key as a tuple path; ``TypeError`` naming the key for anything else.

    Example:
        >>> as_path("a"), as_path(("a", "b"))
        (('a',), ('a', 'b'))
    """
    if isinstance(key, str):
        return (key,)
    if is_key(key):
        return key
    raise TypeError(E.BAD_KEY.format(key=key, typ=type(key).__name__))


def fmt_key(path: KeyPath) -> str:
    """Human-readable key path: ``'a'`` or ``('a', 'b')``.

    Example:
        >>> print(fmt_key(("a",)), fmt_key(("a", "b")))
        'a' ('a', 'b')
    """
    return repr(path[0]) if len(path) == 1 else repr(path)


def child(node: Any, key: str, default: Any = MISSING) -> Any:
    """The direct child ``key`` of ``node`` (``default`` when missing; ``KeyError`` if none given).

    Example:
        >>> import torch, tdfunc
        >>> child(tdfunc.TensorDict(a=torch.zeros(1)), "a").shape
        torch.Size([1])
    """
    v = node._tdf_get(key, MISSING)
    if v is MISSING:
        if default is not MISSING:
            return default
        raise KeyError(missing_message(node, (key,), 0))
    return v


def missing_message(node: Any, path: KeyPath, depth: int) -> str:
    """The ``KeyError`` text for ``path[depth]`` missing from ``node`` (``node`` is at ``depth``)."""
    return E.MISSING_KEY.format(
        key=path[0] if len(path) == 1 else path,
        cls=type(node).__name__,
        available=list(node._tdf_keys()),
    )


def get_path(node: Any, path: KeyPath, default: Any = MISSING) -> Any:
    """The value at ``path`` below ``node``.

    A missing key gives ``default``, or ``KeyError`` naming the path when no default is
    given; a path that goes through a tensor (or a ``None`` field) is missing too.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(n={"b": torch.ones(2)}, batch_size=[2])
        >>> get_path(td, ("n", "b")).shape, get_path(td, ("n", "zz"), None)
        (torch.Size([2]), None)
    """
    cur = node
    for i, k in enumerate(path):
        if not isinstance(cur, Node):
            if default is not MISSING:
                return default
            raise KeyError(
                E.NOT_A_NODE.format(key=path[:i], kind=type(cur).__name__, rest=path[i:])
            )
        v = cur._tdf_get(k, MISSING)
        if v is MISSING:
            if default is not MISSING:
                return default
            raise KeyError(missing_message(cur, path, i))
        cur = v
    return cur


def walk(
    node: Any,
    *,
    leaves_only: bool = False,
    include_nested: bool = True,
    prefix: KeyPath = (),
    nodes_last: bool = False,
) -> list[tuple[KeyPath, Any]]:
    """``(path, value)`` for every entry below ``node``, depth first, in key order.

    Nodes come before their children (``nodes_last``: after them, the order of tensordict's
    ``keys(include_nested=True)``, which ``items``/``keys``/``values`` follow); ``None``
    fields are skipped. ``leaves_only`` keeps only non-node values (the same order either
    way); ``include_nested=False`` stays at the top level.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2])
        >>> [p for p, _ in walk(td)], [p for p, _ in walk(td, nodes_last=True)]
        ([('a',), ('n',), ('n', 'b')], [('a',), ('n', 'b'), ('n',)])
    """
    out: list[tuple[KeyPath, Any]] = []
    _walk_into(node, prefix, leaves_only, include_nested, nodes_last, out)
    return out


def _walk_into(
    node: Any,
    prefix: KeyPath,
    leaves_only: bool,
    nested: bool,
    nodes_last: bool,
    out: list[tuple[KeyPath, Any]],
) -> None:
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if v is None:
            continue
        path = (*prefix, k)
        sub = isinstance(v, Node)
        keep = not (leaves_only and sub)
        if keep and not (nodes_last and sub and nested):
            out.append((path, v))
        if nested and sub:
            _walk_into(v, path, leaves_only, nested, nodes_last, out)
            if keep and nodes_last:
                out.append((path, v))


# --------------------------------------------------------------------------------------
# key ops: written once over the node protocol, so they mean the same at every depth and
# through every node type (a tensorclass has fixed fields: it refuses to lose or gain one)
# --------------------------------------------------------------------------------------
def set_path(node: Any, path: KeyPath, value: Any) -> Any:
    """A new ``node`` with ``value`` at ``path``; missing intermediate levels are created.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(batch_size=[2])
        >>> set_path(td, ("n", "x"), torch.ones(2))["n", "x"].tolist()
        [1.0, 1.0]
    """
    k = path[0]
    if len(path) == 1:
        return node._tdf_set(k, value)
    sub = node._tdf_get(k, MISSING)
    if sub is MISSING or sub is None:
        sub = node._tdf_new_child(k)
    elif not isinstance(sub, Node):
        raise TypeError(E.NOT_A_NODE.format(key=(k,), kind=type(sub).__name__, rest=path[1:]))
    return node._tdf_set(k, set_path(sub, path[1:], value))


def _group(paths: Any) -> tuple[set[str], dict[str, list[KeyPath]], list[str]]:
    """The top-level keys asked for whole, the paths below each other key, and the top-level
    keys in the order they were first named."""
    top: set[str] = set()
    nested: dict[str, list[KeyPath]] = {}
    order: dict[str, None] = {}
    for p in paths:
        order.setdefault(p[0], None)
        if len(p) == 1:
            top.add(p[0])
        else:
            nested.setdefault(p[0], []).append(p[1:])
    return top, nested, list(order)


def select(node: Any, paths: Any, strict: bool = True) -> Any:
    """A new ``node`` with only the entries at ``paths``, in the order they were asked for
    (tensordict's order; a nested node keeps the order of the paths below it), ``KeyError``
    for a missing one when ``strict``. A container with fixed fields (tensorclass) keeps
    its fields' order.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.ones(1), "c": torch.ones(1)})
        >>> select(td, [("n", "b")]).keys(include_nested=True)
        [('n', 'b'), 'n']
        >>> list(select(td, [("n",), ("a",)]).keys())
        ['n', 'a']
    """
    top, nested, order = _group(paths)
    keys = node._tdf_keys()
    if strict:
        for k in order:
            if k not in keys:
                raise KeyError(missing_message(node, (k,), 0))
    items = []
    for k in order:
        v = node._tdf_get(k, MISSING)
        if v is MISSING:
            continue
        if k in top:
            items.append((k, v))
        else:
            if not isinstance(v, Node):
                raise KeyError(
                    E.NOT_A_NODE.format(key=(k,), kind=type(v).__name__, rest=nested[k][0])
                )
            items.append((k, select(v, nested[k], strict)))
    if not getattr(type(node), "_tdf_dict_layout", False):  # fixed fields: their own order
        rank = {k: i for i, k in enumerate(keys)}
        items.sort(key=lambda kv: rank[kv[0]])
    return node._tdf_with_items(items)


def exclude(node: Any, paths: Any) -> Any:
    """A new ``node`` without the entries at ``paths`` (missing ones are ignored).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.ones(1)})
        >>> exclude(td, [("n", "b")]).keys(include_nested=True)
        ['a', 'n']
    """
    top, nested, _ = _group(paths)
    items = []
    changed = False
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if k in top:
            changed = True
            continue
        if k in nested and isinstance(v, Node):
            v = exclude(v, nested[k])
            changed = True
        items.append((k, v))
    return node._tdf_with_items(items) if changed else node


def rename_key(node: Any, old: KeyPath, new: KeyPath, overwrite: bool = False) -> Any:
    """A new ``node`` with the entry at ``old`` moved to ``new``.

    ``KeyError`` when ``old`` is missing, or when ``new`` exists and ``overwrite`` is false:
    a rename never drops a value silently. A rename within one parent keeps the entry's
    position; otherwise it equals ``set_path(exclude(node, [old]), new, value)``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
        >>> rename_key(td, ("a",), ("c",)).keys()
        ['c', 'b']
    """
    value = get_path(node, old)
    if old == new:
        return node
    if get_path(node, new, ABSENT) is not ABSENT and not overwrite:
        raise KeyError(E.RENAME_EXISTS.format(new=fmt_key(new)))
    if len(new) > len(old) and new[: len(old)] == old:
        raise KeyError(f"rename_key: cannot move {fmt_key(old)} into itself ({fmt_key(new)})")
    if old[:-1] == new[:-1]:  # same parent: rename in place
        parent = get_path(node, old[:-1]) if len(old) > 1 else node
        o, n = old[-1], new[-1]
        items = [
            (n if k == o else k, v)
            for k, v in zip(parent._tdf_keys(), parent._tdf_children())
            if k != n
        ]
        renamed = parent._tdf_with_items(items)
        return set_path(node, old[:-1], renamed) if len(old) > 1 else renamed
    return set_path(exclude(node, [old]), new, value)
