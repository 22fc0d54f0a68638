"""tensordict's everyday conveniences, as pure functions over nodes.

``common_dtype``, ``tolist``, ``numpy``, ``is_empty``, ``empty``, ``filter_empty``, the
``new_*`` constructors, ``get_at``, ``split_keys``, ``rename_keys``, ``pop`` and
``sorted_keys``. Each is written once against the node protocol (keys through
:mod:`tdfunc._keys`, results through the one rebuild), so a ``TensorDict`` and every
tensorclass share it; the methods of :class:`tdfunc.Container` are one-line sugar over them.

Differences from tensordict, on purpose: nothing writes into its input. ``pop`` returns the
value *and* the container without it (tensordict's ``pop`` deletes the key from the
container it is called on); ``empty`` and ``filter_empty`` return new containers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .. import _inplace
from .._keys import (
    ABSENT,
    MISSING,
    Key,
    as_path,
    exclude,
    get_path,
    rename_key,
    select,
    set_path,
    walk,
)
from .._nontensor import NonTensor
from .._tree import KeyPath, Node, has_leaves, leaves, map_leaves
from ._indexing import index
from ._shape import _shape_arg
from ._structure import match_structure


# ------------------------------------------------------------------------------ reading
def common_dtype(node: Any) -> torch.dtype | None:
    """The dtype every leaf has, or ``None`` when leaves differ or there is none.

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.TensorDict(a=torch.zeros(2), b=torch.ones(1)).dtype
        torch.float32
        >>> print(tdfunc.TensorDict(a=torch.zeros(2), i=torch.arange(2)).dtype)
        None
    """
    ls = leaves(node)
    if not ls:
        return None
    dtype = ls[0].dtype
    for x in ls:
        if x.dtype != dtype:
            return None
    return dtype


def _entries(node: Any) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in zip(node._tdf_keys(), node._tdf_children()) if v is not None]


def _as_dicts(node: Any, leaf: Any) -> dict[str, Any]:
    return {
        k: _as_dicts(v, leaf)
        if isinstance(v, Node)
        else v.value
        if isinstance(v, NonTensor)
        else leaf(v)
        for k, v in _entries(node)
    }


def tolist(node: Any, *, convert_tensors: bool = False) -> Any:
    """Nested Python lists over the batch dims whose elements are plain ``dict`` s (as
    tensordict's ``tolist``): a container with ``batch_size=()`` gives one dict.

    The leaves stay tensors (each the element of its batch index); ``convert_tensors=True``
    turns them into Python numbers / lists too. Eager only: it builds Python objects from
    tensor values, which ``torch.compile`` cannot keep in a graph.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.arange(2), n={"b": torch.ones(2, 1)}, batch_size=[2])
        >>> td.tolist(convert_tensors=True)
        [{'a': 0, 'n': {'b': [1.0]}}, {'a': 1, 'n': {'b': [1.0]}}]
    """
    leaf = (lambda x: x.tolist()) if convert_tensors else (lambda x: x)
    return _tolist(node, len(node._batch_size), leaf)


def _tolist(node: Any, bd: int, leaf: Any) -> Any:
    if bd == 0:
        return _as_dicts(node, leaf)
    return [_tolist(index(node, i), bd - 1, leaf) for i in range(node._batch_size[0])]


def numpy(node: Any) -> dict[str, Any]:
    """A nested ``dict`` of numpy arrays (``leaf.numpy()``: CPU leaves without grad), as
    tensordict's ``numpy``. Eager only (numpy arrays are not graph values).

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.ones(1)}).numpy()
        {'a': array([0., 0.], dtype=float32), 'n': {'b': array([1.], dtype=float32)}}
    """
    return _as_dicts(node, lambda x: x.numpy())


def is_empty(node: Any) -> bool:
    """True when the container holds no tensor leaf at any depth (nested containers without
    leaves do not count), as tensordict's ``is_empty``.

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.TensorDict(n={}).is_empty(), tdfunc.TensorDict(a=torch.zeros(1)).is_empty()
        (True, False)
    """
    return not has_leaves(node)


def sorted_keys(node: Any) -> list[str]:
    """The top-level keys, sorted (``None`` fields of a tensorclass skipped).

    Example:
        >>> import torch, tdfunc
        >>> tdfunc.TensorDict(b=torch.zeros(1), a=torch.zeros(1)).sorted_keys
        ['a', 'b']
    """
    return sorted(k for k, _ in _entries(node))


def get_at(node: Any, key: Key, index: Any, default: Any = MISSING) -> Any:
    """``node[key][index]``: one entry, indexed; ``default`` (when given) for a missing key.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.arange(4), batch_size=[4])
        >>> td.get_at("a", slice(1, 3)).tolist(), td.get_at("zz", 0, default=-1)
        ([1, 2], -1)
    """
    v = get_path(node, as_path(key), ABSENT if default is not MISSING else MISSING)
    if v is ABSENT:
        return default
    return v[index]


# ------------------------------------------------------------------------------ structure
def empty(node: Any, recurse: bool = False) -> Any:
    """A container of the same type, batch size and device without any leaf.

    ``recurse=True`` keeps the nested containers (emptied), as tensordict's
    ``empty(recurse=True)``. A tensorclass cannot lose its fields: ``TypeError``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2])
        >>> td.empty().keys(), td.empty(recurse=True).keys(include_nested=True)
        ([], ['n'])
    """
    if not recurse:
        return node._tdf_with_items([])
    return node._tdf_with_items(
        [(k, empty(v, True)) for k, v in _entries(node) if isinstance(v, Node)]
    )


def filter_empty(node: Any) -> Any:
    """The container without its nested containers that hold no leaf (at any depth): the
    pure form of tensordict's ``filter_empty_``. The root is kept even when empty.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"e": {}})
        >>> td.filter_empty().keys()
        ['a']
    """
    items: list[tuple[str, Any]] = []
    changed = False
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if isinstance(v, Node):
            if not has_leaves(v):
                changed = True
                continue
            nv = filter_empty(v)
            changed = changed or nv is not v
            v = nv
        items.append((k, v))
    return node._tdf_with_items(items) if changed else node


def pop(node: Any, key: Key, default: Any = MISSING) -> tuple[Any, Any]:
    """``(value, container without key)``: the pure form of tensordict's ``pop``.

    tensordict's ``td.pop(key)`` deletes the key from ``td`` and returns the value; here the
    container is a value, so the container without the key is *returned* and the input is
    left as it was: write ``value, td = td.popped(key)`` (``td.pop`` raises ``InPlaceError``
    naming it). A missing key gives
    ``(default, container)`` when ``default`` is given, else ``KeyError``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
        >>> value, rest = td.popped("a")
        >>> value.tolist(), rest.keys(), td.keys()
        ([0.0], ['b'], ['a', 'b'])
    """
    path = as_path(key)
    v = get_path(node, path, ABSENT if default is not MISSING else MISSING)
    if v is ABSENT:
        return default, node
    return v, exclude(node, [path])


#: a key set of ``split_keys``: keys, a mapping ``old -> new`` (renamed in the output), or a
#: predicate ``fn(path, leaf) -> bool`` over the leaves no earlier set took
KeySet = Sequence[Key] | Mapping[Key, Key] | Callable[[KeyPath, Any], bool]


def split_keys(
    node: Any,
    *key_sets: KeySet,
    inplace: bool = False,
    default: Any = MISSING,
    strict: bool = True,
    reproduce_struct: bool = False,
) -> tuple[Any, ...]:
    """One container per key set, then one with the rest (``N + 1`` for ``N`` sets), as
    tensordict's ``split_keys``; the input is left as it was.

    The sets are taken in order, each from what the earlier ones left (a key two sets name
    goes to the first). A set is a list of keys, a mapping ``{old: new}`` (the entry is
    renamed in its output), or a predicate ``fn(path, leaf) -> bool`` called on every leaf
    left (``path`` a tuple of str; test metadata, not values). A missing key raises
    ``KeyError`` when ``strict``; with ``strict=False`` it is skipped, or its output gets
    ``default`` (when given and not ``None``; it is validated as any value set at that key).
    Nested containers the split leaves without a leaf are dropped from the rest, unless
    ``reproduce_struct=True``: then every output keeps the whole tree of nested containers
    of the input, empty where it holds nothing. ``inplace=True`` has no pure meaning
    (nothing writes into a container) and raises :class:`tdfunc.InPlaceError` naming the
    pure spelling: ``*parts, td = td.split_keys(...)``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1), c=torch.ones(1))
        >>> [p.keys() for p in td.split_keys(["a"], {"c": "z"})]
        [['a'], ['z'], ['b']]
        >>> picked, rest = td.split_keys(["a", "x"], strict=False, default=torch.ones(1))
        >>> picked["x"].tolist(), rest.keys()
        ([1.0], ['b', 'c'])
    """
    if inplace:
        raise _inplace.inplace_option_error(type(node), "split_keys")
    fill = MISSING if strict or default is None else default
    skeleton = empty(node, True) if reproduce_struct else None
    rest = node
    parts = []
    for ks in key_sets:
        if callable(ks) and not isinstance(ks, Iterable):
            pairs = [(p, p) for p, v in walk(rest, leaves_only=True) if ks(p, v)]
        elif isinstance(ks, Mapping):
            pairs = [(as_path(o), as_path(n)) for o, n in ks.items()]
        else:
            pairs = [(as_path(k), as_path(k)) for k in ks]
        olds = [o for o, _ in pairs]
        kept = [o for o, n in pairs if o == n]
        if not strict:  # a missing nested key must not leave its (empty) parent in the part
            kept = [o for o in kept if get_path(rest, o, ABSENT) is not ABSENT]
        part = select(rest, kept, strict)
        for o, n in pairs:
            v = get_path(rest, o, MISSING if strict else ABSENT)  # strict: KeyError naming o
            if v is ABSENT:
                v = fill  # MISSING: skipped
            if v is not MISSING and (o != n or v is fill):
                part = set_path(part, n, v)  # renamed (only n's ancestors) or the default
        parts.append(part if skeleton is None else _overlay(skeleton, part))
        rest = exclude(rest, olds)
    return (*parts, rest if reproduce_struct else filter_empty(rest))


def _overlay(skeleton: Any, part: Any) -> Any:
    """``part`` with every nested container of ``skeleton`` it lacks (``skeleton`` holds no
    leaf): the tree of ``skeleton`` first, in its order, then ``part``'s other entries."""
    own = dict(_entries(part))
    items = []
    for k, s in _entries(skeleton):
        v = own.pop(k, ABSENT)
        if v is ABSENT:
            items.append((k, s))
        else:
            items.append((k, _overlay(s, v) if isinstance(v, Node) and isinstance(s, Node) else v))
    return part._tdf_with_items([*items, *own.items()])


def rename_keys(node: Any, mapping: Mapping[Key, Key], *, strict: bool = True) -> Any:
    """Every ``old -> new`` of ``mapping`` at once (swaps allowed: ``{"a": "b", "b": "a"}``).

    ``KeyError`` for a missing ``old`` when ``strict`` (skipped otherwise), or for a ``new``
    that exists and is not renamed away: a rename never drops a value. Renames within one
    parent keep the entries' positions when no new key is also an old one.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
        >>> td.rename_keys({"a": "b", "b": "a"})["a"].tolist()
        [1.0]
    """
    pairs = [(as_path(o), as_path(n)) for o, n in mapping.items()]
    if not strict:
        pairs = [(o, n) for o, n in pairs if get_path(node, o, ABSENT) is not ABSENT]
    olds = {o for o, _ in pairs}
    if not any(n in olds for _, n in pairs):
        for o, n in pairs:
            node = rename_key(node, o, n)
        return node
    values = [(n, get_path(node, o)) for o, n in pairs]
    out = exclude(node, list(olds))
    for n, _ in values:
        if get_path(out, n, ABSENT) is not ABSENT:
            raise KeyError(E.RENAME_EXISTS.format(new=n[0] if len(n) == 1 else n))
    for n, v in values:
        out = set_path(out, n, v)
    return out


# ------------------------------------------------------------------------------ new_*
def _new(node: Any, size: tuple[Any, ...], make: Any, device: Any) -> Any:
    bs = torch.Size(size)
    bd = len(node._batch_size)
    out = [make(x, (*bs, *x.shape[bd:])) for x in leaves(node)]
    return map_leaves(node, out, bs, node._device if device is None else torch.device(device))


def new_zeros(
    node: Any,
    *size: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Any:
    """Same keys, batch size ``size``, leaves of zeros: each leaf keeps its feature dims and
    its dtype (unless ``dtype`` is given), as tensordict's ``new_zeros``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), batch_size=[2])
        >>> z = td.new_zeros(4, 5)
        >>> z.batch_size, z["a"].shape
        (torch.Size([4, 5]), torch.Size([4, 5, 3]))
    """
    return _new(
        node,
        _shape_arg(size, "new_zeros"),
        lambda x, s: x.new_zeros(s, dtype=dtype, device=device, requires_grad=requires_grad),
        device,
    )


def new_ones(
    node: Any,
    *size: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Any:
    """As :func:`new_zeros`, filled with ones."""
    return _new(
        node,
        _shape_arg(size, "new_ones"),
        lambda x, s: x.new_ones(s, dtype=dtype, device=device, requires_grad=requires_grad),
        device,
    )


def new_empty(
    node: Any,
    *size: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Any:
    """As :func:`new_zeros`, uninitialised."""
    return _new(
        node,
        _shape_arg(size, "new_empty"),
        lambda x, s: x.new_empty(s, dtype=dtype, device=device, requires_grad=requires_grad),
        device,
    )


def new_full(
    node: Any,
    size: Sequence[int],
    fill_value: Any,
    *,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Any:
    """As :func:`new_zeros`, filled with ``fill_value``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(i=torch.zeros(2, dtype=torch.int64), batch_size=[2])
        >>> td.new_full((3,), 7)["i"].tolist()
        [7, 7, 7]
    """
    return _new(
        node,
        tuple(size),
        lambda x, s: x.new_full(
            s, fill_value, dtype=dtype, device=device, requires_grad=requires_grad
        ),
        device,
    )


def new_tensor(
    node: Any,
    data: Any,
    *,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
) -> Any:
    """Same keys, every leaf a copy of ``data`` with that leaf's dtype (unless ``dtype``).

    ``data`` is a tensor, a number, a nested list or an array: the result's batch size is its
    shape. A container ``data`` of the same structure gives each leaf the copy of ``data``'s
    leaf at the same key, with ``data``'s batch size.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(i=torch.zeros(1, dtype=torch.int64), batch_size=[1])
        >>> td.new_tensor([1.5, 2.5])["i"].tolist()
        [1, 2]
    """

    def make(x: Tensor, value: Any) -> Tensor:
        if not isinstance(value, Tensor):
            return x.new_tensor(value, dtype=dtype, device=device, requires_grad=requires_grad)
        d = x.device if device is None else device
        y = value.detach().to(dtype=x.dtype if dtype is None else dtype, device=d, copy=True)
        return y.requires_grad_() if requires_grad else y

    dev = node._device if device is None else torch.device(device)
    if isinstance(data, Node):
        data = match_structure(node, data, "new_tensor")
        out = [make(x, y) for x, y in zip(leaves(node), leaves(data))]
        return map_leaves(data, out, None, dev)
    out = [make(x, data) for x in leaves(node)]
    bs = out[0].shape if out else torch.Size(torch.as_tensor(data).shape)
    return map_leaves(node, out, bs, dev, keep_extra=False)


__all__ = [
    "common_dtype",
    "empty",
    "filter_empty",
    "get_at",
    "is_empty",
    "new_empty",
    "new_full",
    "new_ones",
    "new_tensor",
    "new_zeros",
    "numpy",
    "pop",
    "rename_keys",
    "sorted_keys",
    "split_keys",
    "tolist",
]
