"""Conversion between tdfunc containers and the ``tensordict`` package's (optional extra).

Both directions share the tensors: no leaf is copied (except that a ``device=`` given to the
target may move them). What does not carry over:

* dim ``names`` of a ``tensordict.TensorDict`` are dropped (tdfunc has no dim names);
* lazy stacks (``LazyStackedTensorDict``) and other tensordict views (sub-tensordicts,
  ``td.expand`` results...) are *materialised*: their values are read as tensordict returns
  them, which stacks or indexes into new tensors. A lazy stack whose members do not share
  every key (tensordict would drop the others), or hold tensors of different shapes, dtypes
  or devices under a key, is refused with ``ValueError`` naming the key: no key is dropped;
* a tensordict non-tensor value becomes a non-tensor leaf of a :class:`tdfunc.TensorDict`
  (``NonTensorData``: shared, ``NonTensorStack``: per sample) and back; with a target
  tensorclass it becomes a static field of it, or is an error.

Memory-mapped leaves of either side stay memory-mapped: the leaf object itself is passed on
(a ``tensordict.MemoryMappedTensor`` or a :class:`tdfunc.MemoryMappedTensor` is a tensor).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch
from torch import Tensor

from .. import _nontensor as nontensor
from .._keys import fmt_key
from .._nontensor import NonTensor
from .._tree import KeyPath, is_node
from ..tensordict import TensorDict
from . import _errors as E


def _td_module() -> Any:
    try:
        import tensordict
    except ImportError as e:  # the optional extra is missing
        raise ImportError(E.NEED_TENSORDICT) from e
    return tensordict


def _is_tdfunc_tensorclass_type(cls: Any) -> bool:
    from .._tensorclass import is_tensorclass

    return isinstance(cls, type) and is_tensorclass(cls)


# --------------------------------------------------------------------------------------
# tensordict -> tdfunc
# --------------------------------------------------------------------------------------
def _source_items(tdm: Any, obj: Any, path: KeyPath) -> list[tuple[str, Any]]:
    tc = tdm.is_tensorclass(obj)
    keys = [f.name for f in dataclasses.fields(obj)] if tc else list(obj.keys())
    items = []
    for k in keys:
        try:  # a view or stack computes the value here; tensordict's errors get our key
            items.append((k, getattr(obj, k) if tc else obj.get(k)))
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(E.CANNOT_READ.format(key=fmt_key((*path, k)), reason=e)) from e
    return items


def _member_value(m: Any, k: str) -> Any:
    return getattr(m, k) if dataclasses.is_dataclass(m) else m.get(k)


def _check_stack(tdm: Any, obj: Any, path: KeyPath) -> None:
    """Refuse a lazy stack that tensordict would read with keys dropped (it keeps only the
    keys every member has) or could not stack (shapes, dtypes or devices that differ)."""
    members = list(obj.tensordicts)
    for m in members:
        if isinstance(m, tdm.LazyStackedTensorDict):
            _check_stack(tdm, m, path)
    where = fmt_key(path) if path else "<root>"
    count: dict[str, int] = {}
    for m in members:
        for k in list(m.keys()):
            count[k] = count.get(k, 0) + 1
    for k, have in count.items():
        if have != len(members):
            raise ValueError(
                E.LAZY_STACK_KEYS.format(
                    where=where, key=fmt_key((*path, k)), have=have, total=len(members)
                )
            )
    for k in count:
        values = [_member_value(m, k) for m in members]
        is_tensor = [isinstance(v, Tensor) for v in values]
        what = ""
        if any(is_tensor) and not all(is_tensor):
            what = "a tensor in some members and not in others"
        elif all(is_tensor):
            for attr in ("shape", "dtype", "device"):
                seen = list(dict.fromkeys(getattr(v, attr) for v in values))
                if len(seen) > 1:
                    what = f"tensors of different {attr}s ({', '.join(map(str, seen))})"
                    break
        if what:
            raise ValueError(
                E.LAZY_STACK_VALUES.format(where=where, what=what, key=fmt_key((*path, k)))
            )


def _nontensor_in(tdm: Any, v: Any) -> NonTensor:
    """A tensordict non-tensor value as a non-tensor leaf (a stack: per sample)."""
    if isinstance(v, tdm.NonTensorStack):
        return NonTensor.per_sample(v.tolist(), tuple(v.batch_size))
    return NonTensor(v.data if isinstance(v, tdm.NonTensorData) else v)


def _convert_in(
    tdm: Any, obj: Any, path: KeyPath, as_leaves: bool = False
) -> tuple[TensorDict, dict[str, Any]]:
    """A tdfunc TensorDict of ``obj``'s tensors and nested collections, and its non-tensor
    values (``None`` values are left out: the target's defaults apply). With ``as_leaves``
    the non-tensor values are non-tensor leaves of the TensorDict instead, at every depth."""
    inner = obj._tensordict if tdm.is_tensorclass(obj) else obj  # a tensorclass's own data
    if isinstance(inner, tdm.LazyStackedTensorDict):
        _check_stack(tdm, inner, path)
    data: dict[str, Any] = {}
    static: dict[str, Any] = {}
    for k, v in _source_items(tdm, obj, path):
        if v is None:
            continue
        if isinstance(v, Tensor):
            data[k] = v
        elif as_leaves and (tdm.is_non_tensor(v) or not tdm.is_tensor_collection(v)):
            data[k] = _nontensor_in(tdm, v) if tdm.is_non_tensor(v) else NonTensor(v)
        elif tdm.is_non_tensor(v):
            static[k] = v.data if isinstance(v, tdm.NonTensorData) else v.tolist()
        elif tdm.is_tensor_collection(v):
            sub, sub_static = _convert_in(tdm, v, (*path, k), as_leaves)
            if sub_static:
                name = next(iter(sub_static))
                raise TypeError(
                    E.NON_TENSOR_VALUE.format(
                        key=fmt_key((*path, k, name)), typ=type(sub_static[name]).__name__
                    )
                )
            data[k] = sub
        else:
            static[k] = v
    bs = torch.Size(obj.batch_size)
    dev = obj.device
    return TensorDict(data, batch_size=bs, device=dev), static


def from_tensordict(obj: Any, cls: type | None = None, *, copy: bool = False) -> Any:
    """A tdfunc container holding the same tensors as a ``tensordict`` object (no copy), or,
    with ``copy=True``, copies of them.

    ``obj`` is a ``tensordict.TensorDict`` (or any ``TensorDictBase``: lazy stacks and views
    are materialised, see the module notes) or a tensordict ``@tensorclass`` instance. The
    result is a :class:`tdfunc.TensorDict` with the same nesting, batch size and device, or an
    instance of the tdfunc tensorclass ``cls``: its data fields take the tensors, its static
    fields the non-tensor values, and nested fields become the tensorclasses they are
    annotated with. Dim names are dropped.

    Args:
        obj: the tensordict object.
        cls: a tdfunc ``@tensorclass`` type to build (a TensorDict when None).
        copy: copy every tensor (memory-mapped ones into memory). Without a copy, tdfunc and
            tensordict share the tensors: an in-place write on either side (tensordict's
            ``td["a"].add_(1)``, ``set_``, ``update_``...) changes the tdfunc value too. A
            tdfunc container is immutable, its tensors are not.

    Raises:
        ImportError: the ``tensordict`` package is not installed.
        TypeError: ``obj`` is not a tensordict object, ``cls`` is not a tdfunc tensorclass,
            or a non-tensor value has no static field to go to.
        ValueError: a lazy stack whose members differ in keys, or in the shapes, dtypes or
            devices under a key; tensordict failed to read a value (both name the key).

    Example:
        >>> import pytest, torch, tdfunc
        >>> tensordict = pytest.importorskip("tensordict")  # the optional extra
        >>> src = tensordict.TensorDict(a=torch.zeros(4, 2), n={"b": torch.ones(4)}, batch_size=[4])
        >>> td = tdfunc.from_tensordict(src)
        >>> td["n", "b"] is src["n", "b"], td.batch_size
        (True, torch.Size([4]))
    """
    tdm = _td_module()
    if not (tdm.is_tensorclass(obj) or isinstance(obj, tdm.TensorDictBase)) or isinstance(
        obj, type
    ):
        raise TypeError(E.NOT_A_TENSORDICT_INPUT.format(typ=type(obj).__name__))
    if cls is not None and not _is_tdfunc_tensorclass_type(cls):
        raise TypeError(
            E.NOT_A_TENSORCLASS.format(what="from_tensordict(cls=...)", cls=cls, kind="tdfunc")
        )
    td, static = _convert_in(tdm, obj, (), cls is None)
    if copy:
        td = td.clone()
    if cls is None:
        if static:
            name = next(iter(static))
            raise TypeError(
                E.NON_TENSOR_VALUE.format(key=fmt_key((name,)), typ=type(static[name]).__name__)
            )
        return td
    unknown = [k for k in static if k not in cls._tdf_static_names]  # type: ignore[attr-defined]
    if unknown:
        raise TypeError(
            E.NON_TENSOR_VALUE.format(
                key=fmt_key((unknown[0],)), typ=type(static[unknown[0]]).__name__
            )
        )
    return cls.from_tensordict(td, **static)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# tdfunc -> tensordict
# --------------------------------------------------------------------------------------
def _field_types(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable annotations: nested fields become TensorDicts
        return {}


def _convert_out(tdm: Any, node: Any, target: type | None) -> Any:
    hints = _field_types(target) if target is not None else {}
    kwargs: dict[str, Any] = {}
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if v is None:
            continue
        if is_node(v):
            sub = hints.get(k)
            sub_target = sub if isinstance(sub, type) and tdm.is_tensorclass(sub) else None
            v = _convert_out(tdm, v, sub_target)
        elif isinstance(v, NonTensor):
            v = (
                tdm.NonTensorData(data=v.value, batch_size=node._batch_size)
                if v.shape is None
                else tdm.NonTensorStack.from_list(nontensor.to_list(v, v.shape))
            )
        kwargs[k] = v
    bs = torch.Size(node._batch_size)
    if target is None:
        return tdm.TensorDict(kwargs, batch_size=bs, device=node._device)
    kwargs.update(dict(node._tdf_static()))
    return target(**kwargs, batch_size=bs, device=node._device)


def to_tensordict(x: Any, cls: type | None = None) -> Any:
    """A ``tensordict`` object holding the same tensors as a tdfunc container (no copy).

    A :class:`tdfunc.TensorDict` (or a tensorclass, when ``cls`` is None) gives a
    ``tensordict.TensorDict`` with the same nesting, batch size and device (a tensorclass's
    static and ``None`` fields are left out). With ``cls``, a tensordict ``@tensorclass``
    type, the result is an instance of it: data and static fields by name; nested containers
    become the tensordict tensorclasses their fields are annotated with, else TensorDicts.

    The first call in a process imports ``tensordict``, which registers its pytree nodes and
    replaces functions of ``torch.vmap``'s internals: a function compiled before that and
    traced through ``torch.vmap``, ``torch.func`` or torch's pytree (:func:`tdfunc.cond`,
    :func:`tdfunc.scan`...) compiles once more on its next call. ``import tensordict``
    before the first compile avoids it (tdfunc does not import it for you: that would patch
    ``torch.vmap`` in every process that has it installed).

    Args:
        x: the tdfunc container.
        cls: a tensordict ``@tensorclass`` type to build (a ``tensordict.TensorDict`` when None).

    Raises:
        ImportError: the ``tensordict`` package is not installed.
        TypeError: ``x`` is not a tdfunc container or ``cls`` not a tensordict tensorclass.

    Example:
        >>> import pytest, torch, tdfunc
        >>> _ = pytest.importorskip("tensordict")  # the optional extra
        >>> td = tdfunc.TensorDict(a=torch.zeros(3, 2), batch_size=[3])
        >>> out = tdfunc.to_tensordict(td)
        >>> type(out).__module__.split(".")[0], out["a"] is td["a"], tuple(out.batch_size)
        ('tensordict', True, (3,))
    """
    tdm = _td_module()
    if not is_node(x):
        raise TypeError(E.NOT_A_TDFUNC_INPUT.format(typ=type(x).__name__))
    if cls is not None and not (isinstance(cls, type) and tdm.is_tensorclass(cls)):
        raise TypeError(
            E.NOT_A_TENSORCLASS.format(what="to_tensordict(cls=...)", cls=cls, kind="tensordict")
        )
    if cls is None and not isinstance(x, TensorDict):
        x = x.to_tensordict()  # the data fields, nested tensorclasses too
    return _convert_out(tdm, x, cls)


__all__ = ["from_tensordict", "to_tensordict"]
