"""Explicit writes into a writable store: :func:`write_at`.

A container is a value: ``td[index] = value`` raises :class:`tdfunc.InPlaceError`, and
``td.at[index].set(value)`` returns a new, in-memory container. A store loaded with
``tdfunc.load(path, mode="r+")`` (or made by :func:`tdfunc.memmap_like`) is different: its
leaves are read-write mappings of one file, and writing rows into that file is the point
(filling a dataset chunk by chunk, a replay buffer on disk). :func:`write_at` is that write,
spelled as a call that says so: every leaf of the store gets the value's leaf at the same key,
written in place through the mapping, so the file and every process mapping it see it.

Everything is checked before the first byte is written (a refused call leaves the file as
it was): each leaf is a memory-mapped leaf of mode ``"r+"`` (``PermissionError`` for a
read-only one, naming the key and the file), the value has the store's keys (``KeyError``
naming the key) and each of its leaves the shape of the store's rows at that index
(``ValueError`` naming the key). Compiled (``torch.compile(fullgraph=True)``, every backend)
the writes are ``index_put_`` calls on the mapped leaves, which reach the file as they do
eagerly; the checks are on shapes and types only, so they cost nothing at run time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._jagged._layout import is_jagged
from .._keys import ABSENT, KeyPath, child, fmt_key
from .._nontensor import NonTensor
from .._ops._indexing import normalize_index
from .._tree import Node, is_node, leaves
from . import _errors as E
from ._memory_mapped_tensor import MemoryMappedTensor
from ._op_rules import _mapped

#: the number kinds a value may be instead of a container (written into every leaf)
_NUMBERS = (bool, int, float)


def _rank(dtype: torch.dtype) -> int:
    """bool < integers < floating < complex: a cast down this order loses the kind."""
    if dtype.is_complex:
        return 3
    if dtype.is_floating_point:
        return 2
    return 0 if dtype == torch.bool else 1


def _casts(src: torch.dtype, dst: torch.dtype) -> bool:
    """``src`` casts to ``dst`` within its kind or up (``torch.can_cast``'s rule, written on
    the dtypes' kinds so that Dynamo traces it)."""
    return _rank(src) <= _rank(dst)


def _where(path: KeyPath) -> str:
    return "<root>" if not path else fmt_key(path)


def check_writable(path: KeyPath, leaf: Tensor, what: str) -> None:
    """The store's leaf at ``path`` can take a write that reaches its file: a memory-mapped
    leaf of mode ``"r+"`` (``PermissionError`` for ``"r"``, naming the key and the file)."""
    if not isinstance(leaf, MemoryMappedTensor):
        why = E.WRITE_JAGGED if is_jagged(leaf) else ""
        raise TypeError(E.WRITE_NOT_MAPPED.format(what=what, key=fmt_key(path), why=why))
    if leaf.mode == "r":
        raise PermissionError(
            E.WRITE_READ_ONLY.format(what=what, key=fmt_key(path), filename=leaf.filename)
        )
    if leaf.mode == "c":
        raise ValueError(
            E.WRITE_PRIVATE.format(what=what, key=fmt_key(path), filename=leaf.filename)
        )


def _kind(x: Any) -> str:
    if isinstance(x, Tensor):
        return "tensor"
    if isinstance(x, NonTensor):
        return "non-tensor value"
    if x is None:
        return "None field"
    return "container" if is_node(x) else type(x).__name__


def pair_leaves(
    node: Node, value: Any, what: str, arg: str, writable: bool
) -> list[tuple[KeyPath, Tensor, Any]]:
    """``(path, leaf of node, leaf of value)`` for every tensor leaf of ``node``, in the order
    of its leaves, the value's looked up by key (a number ``value`` stands for every leaf).
    A structural difference raises, naming the key: ``KeyError`` for a key missing on either
    side or a leaf facing a container, ``TypeError`` for a non-tensor value that differs.
    ``writable``: each leaf of ``node`` must also take a write into its file
    (:func:`check_writable`). ``what`` names the call, ``arg`` the value in messages.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.zeros(2), n={"y": torch.zeros(2)})
        >>> [p for p, _, _ in pair_leaves(a, a, "f", "value", False)]
        [('x',), ('n', 'y')]
    """
    out: list[tuple[KeyPath, Tensor, Any]] = []
    _pairs(node, value, (), out, what, arg, writable)
    return out


def _pairs(
    node: Node,
    value: Any,
    prefix: KeyPath,
    out: list[tuple[KeyPath, Tensor, Any]],
    what: str,
    arg: str,
    writable: bool,
) -> None:
    keys = node._tdf_keys()
    container = is_node(value)
    for k, v in zip(keys, node._tdf_children()):
        path = (*prefix, k)
        w = child(value, k, ABSENT) if container else value
        if w is ABSENT:
            raise KeyError(
                E.WRITE_MISSING_KEY.format(
                    what=what, arg=arg, key=fmt_key(path), where=_where(prefix)
                )
            )
        if isinstance(v, Tensor):
            if writable:
                check_writable(path, v, what)
            if not isinstance(w, (Tensor, *_NUMBERS)):
                raise KeyError(
                    E.WRITE_NOT_A_LEAF.format(
                        what=what, arg=arg, key=fmt_key(path), got=_kind(w), want="tensor"
                    )
                )
            out.append((path, v, w))
        elif isinstance(v, Node):
            if container and not is_node(w):
                raise KeyError(
                    E.WRITE_NOT_A_LEAF.format(
                        what=what, arg=arg, key=fmt_key(path), got=_kind(w), want="container"
                    )
                )
            _pairs(v, w, path, out, what, arg, writable)
        elif isinstance(v, NonTensor):
            if container and not (isinstance(w, NonTensor) and w.value == v.value):
                raise TypeError(E.WRITE_NONTENSOR.format(what=what, arg=arg, key=fmt_key(path)))
        elif v is None and container and w is not None:
            raise KeyError(
                E.WRITE_NOT_A_LEAF.format(
                    what=what, arg=arg, key=fmt_key(path), got=_kind(w), want="None field"
                )
            )
    if container:
        known = set(keys)
        for k in value._tdf_keys():
            if k not in known:
                raise KeyError(
                    E.WRITE_EXTRA_KEY.format(what=what, arg=arg, key=fmt_key((*prefix, k)))
                )


def check_rows(
    pairs: list[tuple[KeyPath, Tensor, Any]], nb: int, batch: torch.Size, what: str, arg: str
) -> None:
    """Each value leaf of ``pairs`` has shape ``batch`` + its store leaf's shape after the
    first ``nb`` (batch) dims (``ValueError`` naming the key) and a dtype that casts to the
    stored one within its kind or up (``TypeError`` naming the key)."""
    for path, leaf, v in pairs:
        if not isinstance(v, Tensor):
            continue
        feat = leaf.shape[nb:]
        want = batch + feat
        if v.shape != want:
            raise ValueError(
                E.WRITE_SHAPE.format(
                    what=what,
                    arg=arg,
                    key=fmt_key(path),
                    got=tuple(v.shape),
                    want=tuple(want),
                    batch=tuple(batch),
                    feat=tuple(feat),
                )
            )
        if not _casts(v.dtype, leaf.dtype):
            raise TypeError(
                E.WRITE_DTYPE.format(
                    what=what, arg=arg, key=fmt_key(path), got=v.dtype, want=leaf.dtype
                )
            )


def writable_file(node: Any) -> str | None:
    """The file of the first read-write memory-mapped leaf of ``node`` (``None``: none), for
    the error of ``td[index] = value``, which then names :func:`write_at`.

    Example:
        >>> import torch, tdfunc
        >>> print(writable_file(tdfunc.TensorDict(a=torch.zeros(2))))
        None
    """
    for leaf in leaves(node):
        if isinstance(leaf, MemoryMappedTensor) and leaf.mode == "r+":
            return leaf.filename
    return None


# Trusted writes for callers that checked the store once (:func:`check_writable`, and
# :func:`check_rows` for the value) and then write a few times: straight into the mapped
# memory, without a leaf's per-op checks. The leaf's version counter moves as it does for a
# write through the leaf; a leaf being traced (no real mapped memory) takes the checked way.
def write_rows(leaf: Tensor, first: int, value: Any) -> None:
    """``value`` (rows of ``leaf``, cast to its dtype) into rows ``first ..`` of ``leaf``,
    a checked read-write leaf: one copy through the mapping.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> path = os.path.join(tempfile.mkdtemp(), "data")
        >>> store = tdfunc.memmap_like(tdfunc.TensorDict(x=torch.zeros(4), batch_size=[4]), path)
        >>> write_rows(store["x"], 1, torch.tensor([1, 2]))
        >>> tdfunc.load(path)["x"].tolist()
        [0.0, 1.0, 2.0, 0.0]
    """
    t = _mapped(leaf)
    n = value.shape[0] if isinstance(value, Tensor) else 1
    if t is None:
        leaf[first : first + n] = value
        return
    t[first : first + n] = value
    torch.autograd.graph.increment_version(leaf)


def read_scalar(leaf: Tensor) -> int:
    """The value of the one-element integer ``leaf`` (read from the mapping)."""
    t = _mapped(leaf)
    return int(leaf if t is None else t)


def write_scalar(leaf: Tensor, value: int) -> None:
    """``value`` into the one-element ``leaf``, a checked read-write leaf (one aligned store
    of its dtype, as ``leaf.fill_(value)``)."""
    t = _mapped(leaf)
    if t is None:
        leaf.fill_(value)
        return
    t.fill_(value)
    torch.autograd.graph.increment_version(leaf)


def write_at(store: Any, index: Any, value: Any) -> None:
    """Write ``value`` into the file of the writable store ``store`` at batch ``index``, in
    place: the explicit store write (``td[index] = value`` on a container is refused, and
    ``td.at[index].set(value)`` returns a new in-memory container, leaving the file as it was).

    ``store`` is a container loaded with ``tdfunc.load(path, mode="r+")`` or made by
    :func:`tdfunc.memmap_like` (or a part of one: ``store["next"]``,
    ``store.select("obs", "reward")``); each of its leaves gets the value's leaf at the same
    key written at ``index``, through the shared mapping: the file, and every process that maps
    it, see the rows at once. Nothing is written unless every check passes. Works eagerly and
    inside ``torch.compile(fullgraph=True)`` (every backend: the writes are ``index_put_``
    calls on the mapped leaves). Writes survive the writing process being killed; a crash of
    the machine itself may lose the last ones (the operating system writes them back later).

    Args:
        store: a container whose leaves are memory-mapped read-write (mode ``"r+"``).
        index: an index over the batch dims, as in ``store[index]``: an int, a slice, a
            long tensor or list of rows, a bool mask, or a tuple of these.
        value: a container with the store's keys, whose batch size is the shape that
            ``store[index]`` would have and whose leaves have the store's leaf shapes
            after the batch dims (a row, or a batch of rows); or a number, written into
            every leaf. Leaves are cast to the stored dtypes (a cast that loses the kind,
            float into int, is refused).

    Raises:
        PermissionError: a leaf is a read-only mapping (mode ``"r"``), naming the key and
            the file.
        TypeError: ``store`` is not a container, a leaf is an in-memory tensor (not
            memory-mapped), a value leaf does not cast safely, or a non-tensor value differs.
        ValueError: a copy-on-write leaf (mode ``"c"``), whose writes never reach the file;
            a batch size or a leaf shape that does not fit the rows at ``index``, naming
            the key.
        KeyError: the value lacks a key of the store, or has one the store does not.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> path = os.path.join(tempfile.mkdtemp(), "data")
        >>> spec = tdfunc.TensorDict(x=torch.zeros(4, 2), y=torch.zeros(4), batch_size=[4])
        >>> store = tdfunc.memmap_like(spec, path)                  # mode="r+"
        >>> rows = tdfunc.TensorDict(x=torch.ones(2, 2), y=torch.ones(2), batch_size=[2])
        >>> tdfunc.write_at(store, torch.tensor([1, 3]), rows)
        >>> tdfunc.load(path)["y"].tolist()                         # in the file
        [0.0, 1.0, 0.0, 1.0]
        >>> tdfunc.write_at(store, 0, 5.0)                          # a number: every leaf
        >>> tdfunc.load(path)["x"][0].tolist()
        [5.0, 5.0]
    """
    if not is_node(store):
        raise TypeError(E.WRITE_NOT_A_CONTAINER.format(typ=type(store).__name__))
    if not (is_node(value) or isinstance(value, _NUMBERS)) and not (
        isinstance(value, Tensor) and value.ndim == 0
    ):
        raise TypeError(E.WRITE_BAD_VALUE.format(typ=type(value).__name__))
    pairs = pair_leaves(store, value, "write_at", "value", True)
    bs = store._batch_size
    parts = normalize_index(index, bs)
    key = parts[0] if len(parts) == 1 else parts
    # the batch shape store[index] has: the index applied to a stand-in of the batch (no
    # store data is read; a view for ints and slices, a gather of the index's size else)
    batch = torch.empty((), dtype=torch.uint8).expand(bs)[key].shape
    if is_node(value) and value._batch_size != batch:
        raise ValueError(
            E.WRITE_BATCH.format(
                got=tuple(value._batch_size), index=index, want=tuple(batch), batch=tuple(bs)
            )
        )
    if isinstance(value, Tensor):  # a 0-d tensor: every leaf
        pairs = [(p, leaf, value.expand(batch + leaf.shape[len(bs) :])) for p, leaf, _ in pairs]
    check_rows(pairs, len(bs), batch, "write_at", "value")
    for _, leaf, v in pairs:
        leaf[key] = v.to(device=leaf.device, dtype=leaf.dtype) if isinstance(v, Tensor) else v


__all__ = [
    "check_rows",
    "check_writable",
    "pair_leaves",
    "read_scalar",
    "writable_file",
    "write_at",
    "write_rows",
    "write_scalar",
]
