"""``TensorDict``: an immutable container of tensors under string keys, with shared batch dims."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import optree
import torch
from torch import Tensor

from . import _errors as E
from . import _inplace, _migration
from . import _nontensor as nontensor
from . import _ops as ops
from ._base import Container
from ._compat import pytree
from ._keys import MISSING, as_path, fmt_key, get_path, is_key, missing_message, set_path
from ._tree import KeyPath, as_batch_size, is_node, register

KeyLike = str | tuple[str, ...]


def _check_prefix(path: KeyPath, shape: torch.Size, batch_size: torch.Size, nested: bool) -> None:
    if not ops.starts_with_batch(shape, batch_size, path):
        msg = E.NESTED_SHAPE if nested else E.LEAF_SHAPE
        raise ValueError(
            msg.format(key=fmt_key(path), shape=tuple(shape), batch_size=tuple(batch_size))
        )


def convert_value(
    path: KeyPath, value: Any, batch_size: torch.Size, device: torch.device | None
) -> Any:
    """Turn a user value into a validated child (tensor or node) for ``batch_size``."""
    if isinstance(value, Tensor):
        if device is not None and value.device != device:
            value = value.to(device)
        if batch_size and not ops.starts_with_batch(value.shape, batch_size, path):
            _check_prefix(path, value.shape, batch_size, False)  # raises, naming the key
        return value
    if is_node(value):
        if device is not None and value._device != device:
            value = ops.to(value, device)
        _check_prefix(path, value._batch_size, batch_size, True)
        return value
    if isinstance(value, Mapping):
        return TensorDict._build(value, batch_size, device, path)
    if isinstance(value, (bool, int, float, complex)):
        t = torch.tensor(value, device=device)
        _check_prefix(path, t.shape, batch_size, False)
        return t
    if hasattr(value, "__array__") and hasattr(value, "dtype"):
        t = torch.as_tensor(value, device=device)
        _check_prefix(path, t.shape, batch_size, False)
        return t
    if isinstance(value, (list, tuple)) and nontensor.list_is_numeric(value):
        t = torch.tensor(value, device=device)  # numbers: a tensor (as tensordict)
        _check_prefix(path, t.shape, batch_size, False)
        return t
    if isinstance(value, (list, tuple)) or nontensor.is_nontensor_candidate(value):
        return nontensor.from_user(path, value, batch_size)
    raise TypeError(
        E.BAD_VALUE.format(key=fmt_key(path), typ=type(value).__name__, cls="TensorDict")
    )


def _cloned(value: Any) -> Any:
    """``value`` with every tensor cloned (tensors, containers, nested mappings)."""
    if isinstance(value, Tensor):
        return value.clone()
    if is_node(value):
        return ops.clone(value)
    if isinstance(value, Mapping):
        return {k: _cloned(v) for k, v in value.items()}
    return value


class _TensorDictType(type):
    """The class of ``TensorDict``: a class attribute that does not exist (a tensordict
    classmethod such as ``TensorDict.from_module``) raises an ``AttributeError`` naming its
    tdfunc spelling. ``__getattr__`` is reached only when the normal lookup fails, so an
    attribute that exists costs nothing."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):  # protocol probes (copy, pickle, typing): the plain error
            raise AttributeError(_migration.NO_CLASS_ATTRIBUTE.format(cls=cls.__name__, name=name))
        raise _migration.attribute_error(cls, name, on_class=True)


class TensorDict(Container, metaclass=_TensorDictType):
    """An immutable container from string keys to tensors (or nested containers) whose leading
    ``batch_size`` dims are shared by every leaf.

    Every operation returns a new ``TensorDict``; the input is never changed. It is a pytree
    node (``torch.utils._pytree`` and optree), so ``torch.compile``, ``torch.vmap`` and
    ``torch.func`` see through it.

    Immutable means the container: its keys, nesting, batch size, device and which tensor is
    under which key never change. The tensors are ordinary tensors, shared and not copied
    (results share the leaves they did not compute): a tensor method that writes in place,
    ``td["a"].add_(1)``, still changes the value every container holding that tensor sees.
    ``clone()`` gives tensors of its own. It is not a ``collections.abc.Mapping``: like a
    tensor, ``len()`` and iteration follow the first batch dim; :meth:`to_state_dict` is the
    plain ``dict`` for PyTorch APIs that take one.

    Args:
        source: a mapping of key -> value (tensor, number, numpy array, dict, TensorDict or
            tensorclass). Nested dicts become nested TensorDicts with the same batch size.
        batch_size: the leading dims shared by every leaf (checked once, here); the second
            positional argument, as in tensordict: ``TensorDict(d, [4])``.
        device: if given, every leaf is moved to it (the third positional argument).
        names: tensordict's dim names: not supported, a ``TypeError`` unless ``None``.
        non_blocking: tensordict's option for the device move; accepted (the values do not
            depend on it).
        lock: tensordict's option; accepted: every container is immutable (locked) here.
        **kwargs: more key -> value pairs (a key named like one of the arguments above goes
            in ``source``).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict({"obs": torch.zeros(4, 3), "next": {"r": torch.ones(4)}},
        ...                        batch_size=[4])
        >>> td["next", "r"].shape, td.batch_size
        (torch.Size([4]), torch.Size([4]))
        >>> td2 = td.set("done", torch.zeros(4, dtype=torch.bool))
        >>> "done" in td, "done" in td2
        (False, True)
    """

    # weak references let an eager cache recognise a container it returned (the optimizer
    # step's plan, tdfunc.optim._plan) without keeping it alive
    __slots__ = ("__weakref__", "_data")
    _data: dict[str, Any]
    _tdf_dict_layout = True

    def __init__(
        self,
        source: Mapping[str, Any] | None = None,
        /,
        batch_size: Sequence[int] | int | torch.Size = (),
        device: torch.device | str | None = None,
        names: Sequence[str | None] | None = None,
        non_blocking: bool | None = None,
        lock: bool = False,
        **kwargs: Any,
    ) -> None:
        if names is not None:
            raise TypeError(_migration.NO_DIM_NAMES.format(names=names))
        bs = as_batch_size(batch_size)
        dev = None if device is None else torch.device(device)
        if source is not None and not isinstance(source, Mapping):
            raise TypeError(
                f"TensorDict source must be a mapping (dict or TensorDict), got {type(source).__name__}"
            )
        data: dict[str, Any] = {}
        items: Iterable[tuple[Any, Any]] = () if source is None else source.items()
        for k, v in items:
            if not isinstance(k, str):
                raise TypeError(E.BAD_KEY.format(key=k, typ=type(k).__name__))
            data[k] = convert_value((k,), v, bs, dev)
        for k, v in kwargs.items():
            data[k] = convert_value((k,), v, bs, dev)
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_batch_size", bs)
        object.__setattr__(self, "_device", dev)

    # ------------------------------------------------------------------ construction
    @classmethod
    def _new(
        cls, data: dict[str, Any], batch_size: torch.Size, device: torch.device | None
    ) -> TensorDict:
        """Trusted constructor: no conversion, no checks (for ops that keep the invariants)."""
        self = object.__new__(cls)
        object.__setattr__(self, "_data", data)
        object.__setattr__(self, "_batch_size", batch_size)
        object.__setattr__(self, "_device", device)
        return self

    @classmethod
    def _build(
        cls,
        mapping: Mapping[str, Any],
        batch_size: torch.Size,
        device: torch.device | None,
        prefix: KeyPath,
    ) -> TensorDict:
        data: dict[str, Any] = {}
        for k, v in mapping.items():
            if not isinstance(k, str):
                raise TypeError(E.BAD_KEY.format(key=k, typ=type(k).__name__))
            data[k] = convert_value((*prefix, k), v, batch_size, device)
        return cls._new(data, batch_size, device)

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any],
        *,
        batch_size: Sequence[int] | None = None,
        batch_dims: int | None = None,
        device: torch.device | str | None = None,
    ) -> TensorDict:
        """Build from a (nested) dict.

        ``batch_size`` wins if given; else ``batch_dims`` takes that many leading dims of the
        first leaf; else the batch size is ``()``.

        Example:
            >>> import torch, tdfunc
            >>> tdfunc.TensorDict.from_dict({"a": torch.zeros(2, 3)}, batch_dims=1).batch_size
            torch.Size([2])
        """
        if batch_dims is not None:
            if isinstance(batch_dims, bool) or not isinstance(batch_dims, int):
                raise TypeError(E.BATCH_DIMS.format(value=batch_dims))
            if batch_dims < 0:
                raise ValueError(E.BATCH_DIMS.format(value=batch_dims))
        if batch_size is None and batch_dims is not None:
            first = _first_leaf(d)
            if first is None:
                raise ValueError("from_dict(batch_dims=...) needs at least one tensor leaf")
            if first.ndim < batch_dims:
                raise ValueError(
                    f"batch_dims={batch_dims} exceeds the ndim of the first leaf {tuple(first.shape)}"
                )
            batch_size = first.shape[:batch_dims]
        return cls(d, batch_size=() if batch_size is None else batch_size, device=device)

    # ------------------------------------------------------------------ node protocol
    def _tdf_keys(self) -> tuple[str, ...]:
        return tuple(self._data)

    def _tdf_children(self) -> tuple[Any, ...]:
        return tuple(self._data.values())

    def _tdf_rebuild(
        self, children: Sequence[Any], batch_size: torch.Size, device: torch.device | None
    ) -> TensorDict:
        return TensorDict._new(dict(zip(self._data, children)), batch_size, device)

    def _tdf_from_data(
        self, data: dict[str, Any], batch_size: torch.Size, device: torch.device | None
    ) -> TensorDict:
        """Trusted: the rebuild of a dict layout (``Node._tdf_dict_layout``), ``data`` the new
        children by key. (Not ``_new`` itself: a classmethod reached through two containers
        of one class costs a Python guard per compiled call.)"""
        return TensorDict._new(data, batch_size, device)

    def _tdf_get(self, key: str, default: Any) -> Any:
        return self._data.get(key, default)

    def _tdf_set(self, key: str, value: Any) -> TensorDict:
        data = dict(self._data)
        data[key] = convert_value((key,), value, self._batch_size, self._device)
        return TensorDict._new(data, self._batch_size, self._device)

    def _tdf_with_items(self, items: Sequence[tuple[str, Any]]) -> TensorDict:
        return TensorDict._new(dict(items), self._batch_size, self._device)

    def _tdf_new_child(self, key: str) -> TensorDict:
        return TensorDict._new({}, self._batch_size, self._device)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):  # fast path: one dict lookup
            v = self._data.get(key, MISSING)
            if v is MISSING:
                raise KeyError(missing_message(self, (key,), 0))
            return v.value if isinstance(v, nontensor.NonTensor) else v
        if is_key(key):
            v = get_path(self, key)
            return v.value if isinstance(v, nontensor.NonTensor) else v
        return ops.index(self, key)

    def keys(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[Any]:
        """Keys: strings at the top level, tuples for nested keys when ``include_nested`` (a
        nested TensorDict after its own keys, as in tensordict); ``sort`` orders them by
        their names joined with ``"."`` (tensordict's ``sort=True``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> list(td.keys()), list(td.keys(include_nested=True, leaves_only=True))
            (['a', 'n'], ['a', ('n', 'b')])
        """
        if not include_nested and not leaves_only and not sort:
            return list(self._data)
        return [k for k, _ in self.items(include_nested, leaves_only, sort=sort)]

    def values(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[Any]:
        """Values in the order of :meth:`keys`.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> [v.shape for v in td.values(include_nested=True, leaves_only=True)]
            [torch.Size([2]), torch.Size([2])]
        """
        if not include_nested and not leaves_only and not sort:
            return list(self._data.values())
        return [v for _, v in self.items(include_nested, leaves_only, sort=sort)]

    def items(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[tuple[Any, Any]]:
        """``(key, value)`` pairs in the order of :meth:`keys`: strings at the top level,
        tuples below it.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> [k for k, _ in td.items(include_nested=True, leaves_only=True)]
            ['a', ('n', 'b')]
        """
        if not include_nested and not leaves_only and not sort:
            return list(self._data.items())
        return super().items(include_nested, leaves_only, sort=sort)

    # ------------------------------------------------------------------ functional updates
    def set(self, key: KeyLike, value: Any, *, inplace: bool = False) -> TensorDict:
        """A new TensorDict with ``value`` at ``key`` (tuple keys create nested levels).

        Unlike tensordict's ``set``, ``td`` itself is left as it was: keep the result
        (``td = td.set(key, value)``). ``inplace=True`` raises :class:`tdfunc.InPlaceError`.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> td.set(("n", "c"), torch.ones(2))["n", "c"]
            tensor([1., 1.])
        """
        if inplace:
            raise _inplace.inplace_option_error(TensorDict, "set")
        if isinstance(key, str):  # fast path: one top-level key
            return self._tdf_set(key, value)
        return set_path(self, as_path(key), value)

    def update(
        self,
        other: Mapping[str, Any] | TensorDict | None = None,
        /,
        *,
        inplace: bool = False,
        clone: bool = False,
        non_blocking: bool = False,
        **kwargs: Any,
    ) -> TensorDict:
        """A new TensorDict with the entries of ``other`` (nested mappings merged recursively).

        Keyword arguments are more entries, except tensordict's options: ``clone=True``
        clones the new values, ``non_blocking`` is accepted (the values do not depend on it),
        ``inplace=True`` raises :class:`tdfunc.InPlaceError` (``td`` itself is never
        changed: keep the result, ``td = td.update(other)``), and ``keys_to_update``,
        ``is_leaf``, ``update_batch_size`` and ``ignore_lock`` raise a ``TypeError`` naming
        the tdfunc spelling (a key of one of these names goes in ``other``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> list(td.update({"n": {"c": torch.ones(2)}}).keys(True, True))
            ['a', ('n', 'b'), ('n', 'c')]
        """
        if inplace:
            raise _inplace.inplace_option_error(TensorDict, "update")
        for name in kwargs:  # usually none: the entries come in ``other``
            if name in _inplace.UPDATE_OPTIONS:
                raise _inplace.option_error(TensorDict, "update", name)
        if clone:
            other, kwargs = _cloned(other), {k: _cloned(v) for k, v in kwargs.items()}
        out: TensorDict = self
        pairs: list[tuple[Any, Any]] = []
        if other is not None:
            if isinstance(other, TensorDict):
                pairs.extend(other._data.items())
            elif isinstance(other, Mapping):
                pairs.extend(other.items())
            else:
                raise TypeError(
                    f"update expects a mapping or a TensorDict, got {type(other).__name__}"
                )
        bs, dev = self._batch_size, self._device
        # values of a TensorDict with the same batch size (and a compatible device) are
        # already valid children here: no need to check them again
        trusted = (
            len(pairs)
            if isinstance(other, TensorDict)
            and ops.known_equal(other._batch_size, bs)
            and (dev is None or other._device == dev)
            else 0
        )
        pairs.extend(kwargs.items())
        data = dict(out._data)  # one copy for all top-level keys
        for i, (k, v) in enumerate(pairs):
            if isinstance(k, str):
                cur = data.get(k)
                if isinstance(cur, TensorDict) and isinstance(v, (Mapping, TensorDict)):
                    v = cur.update(v)
                data[k] = v if i < trusted else convert_value((k,), v, bs, dev)
                continue
            out = TensorDict._new(data, bs, dev)
            path = as_path(k)
            cur = get_path(out, path, None)
            if isinstance(cur, TensorDict) and isinstance(v, (Mapping, TensorDict)):
                v = cur.update(v)
            out = set_path(out, path, v)
            data = dict(out._data)
        return TensorDict._new(data, bs, dev)

    def replace(self, **kwargs: Any) -> TensorDict:
        """A new TensorDict with existing top-level keys replaced (``KeyError`` for new keys).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> td.replace(a=torch.ones(2))["a"]
            tensor([1., 1.])
        """
        data = dict(self._data)
        for k, v in kwargs.items():
            if k not in data:
                raise KeyError(
                    missing_message(self, (k,), 0) + "; use td.set(key, value) to add a key"
                )
            data[k] = convert_value((k,), v, self._batch_size, self._device)
        return TensorDict._new(data, self._batch_size, self._device)

    def flatten_keys(
        self, separator: str = ".", inplace: bool = False, *, sep: str | None = None
    ) -> TensorDict:
        """Nested TensorDicts become flat keys joined by ``separator`` (``("a", "b")`` ->
        ``"a.b"``); ``sep`` is another name for it. ``inplace=True`` (tensordict's option)
        raises :class:`tdfunc.InPlaceError`.

        Tensorclass values are kept whole. Two paths that give the same flat name (``"a.b"``
        next to ``("a", "b")``) raise ``ValueError`` naming both: no value is dropped.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a={"b": torch.zeros(1)}, c=torch.ones(1))
            >>> td.flatten_keys().keys()
            ['a.b', 'c']
        """
        if inplace:
            raise _inplace.inplace_option_error(TensorDict, "flatten_keys")
        data: dict[str, Any] = {}
        origin: dict[str, KeyPath] = {}
        _flatten_into(self, (), separator if sep is None else sep, data, origin)
        return TensorDict._new(data, self._batch_size, self._device)

    def unflatten_keys(
        self, separator: str = ".", inplace: bool = False, *, sep: str | None = None
    ) -> TensorDict:
        """Split flat keys at ``separator`` into nested TensorDicts: ``"a.b"`` ->
        ``("a", "b")``; ``sep`` is another name for it. ``inplace=True`` (tensordict's option)
        raises :class:`tdfunc.InPlaceError`.

        The inverse of :meth:`flatten_keys` for keys and values. Nested levels are created
        with this TensorDict's batch size: extra batch dims that nested nodes had before
        ``flatten_keys`` are not recorded in flat keys, so they are not restored.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict({"a.b": torch.zeros(1)})
            >>> td.unflatten_keys()["a", "b"].shape
            torch.Size([1])
        """
        if inplace:
            raise _inplace.inplace_option_error(TensorDict, "unflatten_keys")
        separator = separator if sep is None else sep
        out = TensorDict._new({}, self._batch_size, self._device)
        for k, v in self._data.items():
            out = set_path(out, tuple(k.split(separator)), v)
        return out

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict of tensors (nested TensorDicts become dicts).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(2), n={"b": torch.zeros(2)}, batch_size=[2])
            >>> d = td.to_dict()
            >>> type(d["n"]).__name__, d["n"]["b"].shape
            ('dict', torch.Size([2]))
        """
        return {k: (v.to_dict() if isinstance(v, TensorDict) else v) for k, v in self._data.items()}

    # ------------------------------------------------------------------ pickling / copy
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_tensordict, (self._data, self._batch_size, self._device))

    def __copy__(self) -> TensorDict:
        return TensorDict._new(dict(self._data), self._batch_size, self._device)

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorDict:
        import copy

        return TensorDict._new(copy.deepcopy(self._data, memo), self._batch_size, self._device)

    # ------------------------------------------------------------------ repr
    def __repr__(self) -> str:
        return self._tdf_repr(0)


def _rebuild_tensordict(
    data: dict[str, Any], batch_size: torch.Size, device: torch.device | None
) -> TensorDict:
    """Unpickling entry point (allow-listed for ``torch.load(weights_only=True)``)."""
    return TensorDict._new(dict(data), torch.Size(batch_size), device)


def _first_leaf(d: Any) -> Tensor | None:
    items = d.items() if isinstance(d, Mapping) else ()
    for _, v in items:
        if isinstance(v, Tensor):
            return v
        if isinstance(v, Mapping):
            r = _first_leaf(v)
            if r is not None:
                return r
        if is_node(v):
            ls = ops.leaves(v)
            if ls:
                return ls[0]
    return None


def _flatten_into(
    node: TensorDict, prefix: KeyPath, sep: str, out: dict[str, Any], origin: dict[str, KeyPath]
) -> None:
    for k, v in node._data.items():
        path = (*prefix, k)
        if isinstance(v, TensorDict):
            _flatten_into(v, path, sep, out, origin)
            continue
        ops.put_flat(out, origin, path, v, sep, "flatten_keys")


def _from_context(
    keys: Sequence[str],
    children: Sequence[Any],
    batch_size: torch.Size,
    device: torch.device | None,
    static: Any,
) -> TensorDict:
    return TensorDict._new(dict(zip(keys, children)), batch_size, device)


register(TensorDict, _from_context, "tdfunc.TensorDict", pytree.MappingKey, optree.MappingEntry)
# torch.load(weights_only=True) (used by torch.export.load for example inputs) may rebuild
# TensorDicts: the rebuild function only re-assembles already-unpickled tensors.
torch.serialization.add_safe_globals([TensorDict, _rebuild_tensordict])


def __dir__() -> list[str]:
    return []  # nothing public of its own (see __all__), not the names it imported


#: nothing public of its own: the class's public home is the package (``tdfunc.TensorDict``)
__all__: list[str] = []
