"""``@tensorclass``: frozen, typed dataclasses whose tensor fields share a batch size.

A tensorclass is a :class:`tdfunc.Container` like :class:`tdfunc.TensorDict`: every shared
operation (indexing, reshape, arithmetic, ``apply``, ``to``, reductions, ``tdfunc.stack`` /
``tdfunc.cat``...) works on it and returns an instance of the same class. Its fields live in
``__slots__`` (a fixed attribute layout that ``torch.compile`` guards on cheaply), and it is a
real frozen dataclass: ``dataclasses.fields`` and ``dataclasses.replace`` work.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, dataclass_transform, overload

import optree
import torch

from .. import _errors as E
from .. import _inplace
from .. import _ops as ops
from .._base import LIFTED_METHODS, Container
from .._compat import pytree
from .._keys import as_path, get_path, is_key, missing_message, set_path
from .._tree import as_batch_size, describe_child, is_node, register
from ..tensordict import TensorDict
from . import _codegen as G
from . import _fields as F

__all__ = ["is_tensorclass", "tensorclass"]

_T = TypeVar("_T", bound=type)
_I = TypeVar("_I")
_INITVAR = dataclasses._FIELD_INITVAR  # type: ignore[attr-defined]


@dataclasses.dataclass
class _InitOnly:
    """Source of the ``batch_size`` / ``device`` init-only pseudo-fields.

    Every tensorclass lists them in ``__dataclass_fields__`` as keyword-only ``InitVar``s with
    a default, so :func:`dataclasses.fields` does not show them while
    :func:`dataclasses.replace` passes the instance's ``batch_size`` and ``device`` on.
    """

    batch_size: dataclasses.InitVar[Any] = dataclasses.field(default=(), kw_only=True)
    device: dataclasses.InitVar[Any] = dataclasses.field(default=None, kw_only=True)


_PSEUDO_FIELDS: dict[str, dataclasses.Field] = dict(_InitOnly.__dataclass_fields__)


class _TensorClass(Container):
    """Base of every ``@tensorclass`` type: the methods that do not depend on the fields."""

    __slots__ = ()

    # filled in per class by @tensorclass
    _tdf_fields: tuple[str, ...] = ()
    _tdf_child_names: tuple[str, ...] = ()
    _tdf_static_names: tuple[str, ...] = ()
    _tdf_specs: Mapping[str, F.ChildSpec | None] = types.MappingProxyType({})
    # set on every tensorclass by dataclasses.dataclass (typing only: no value here)
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    if TYPE_CHECKING:
        # every tensorclass gets a generated ``__init__`` taking its fields, batch_size, device
        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

    def _tdf_keys(self) -> tuple[str, ...]:
        return self._tdf_child_names

    def _tdf_get(self, key: str, default: Any) -> Any:
        if key in self._tdf_fields:
            return getattr(self, key)
        return default

    def _tdf_set(self, key: str, value: Any) -> Any:
        if key not in self._tdf_fields:
            raise KeyError(missing_message(self, (key,), 0))
        return self.replace(**{key: value})

    def _tdf_with_items(self, items: Sequence[tuple[str, Any]]) -> Any:
        # ``None`` fields are not entries: leaving one out keeps it None
        given = dict(items)
        names = self._tdf_child_names
        lost = [n for n in names if n not in given and getattr(self, n) is not None]
        if lost or len(given) != sum(n in given for n in names):
            raise TypeError(
                E.FIXED_FIELDS.format(
                    op="key op", cls=type(self).__name__, fields=list(names), names=list(given)
                )
            )
        children = [given.get(n) for n in names]
        return self._tdf_rebuild(children, self._batch_size, self._device)

    def _tdf_new_child(self, key: str) -> Any:
        spec = self._tdf_specs.get(key)
        if spec is not None and spec.mapping:
            return TensorDict._new({}, self._batch_size, self._device)
        raise TypeError(
            E.NOT_A_SUBTREE.format(cls=type(self).__name__, name=key, typ="None", rest="...")
        )

    # ------------------------------------------------------------------ frozen
    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(
            E.FROZEN.format(cls=type(self).__name__, what="assign to", name=name)
        )

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(
            E.FROZEN.format(cls=type(self).__name__, what="delete", name=name)
        )

    # pickling (also ``copy`` and ``torch.save`` / ``torch.export.save``): NEWOBJ + BUILD, so
    # ``torch.load(weights_only=True)`` only needs the class itself allow-listed
    def __getstate__(self) -> tuple[Any, ...]:
        return (tuple(getattr(self, n) for n in self._tdf_fields), self._batch_size, self._device)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        values, batch_size, device = state
        for name, value in zip(self._tdf_fields, values):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_batch_size", batch_size)
        object.__setattr__(self, "_device", device)

    # ------------------------------------------------------------------ reading
    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            if key in self._tdf_fields:
                return getattr(self, key)
            raise KeyError(missing_message(self, (key,), 0))
        if is_key(key):
            return get_path(self, key)
        return ops.index(self, key)

    # ------------------------------------------------------------------ functional updates
    def replace(self, **changes: Any) -> Any:  # pragma: no cover - generated per class
        """A new instance with some fields changed (generated for each class).

        Example:
            >>> import torch, tdfunc
            >>> @tdfunc.tensorclass
            ... class P:
            ...     x: torch.Tensor
            ...     y: torch.Tensor
            >>> p = P(torch.zeros(2), torch.zeros(2), batch_size=[2])
            >>> q = p.replace(y=torch.ones(2))
            >>> q.y.tolist(), p.y.tolist(), q.x is p.x
            ([1.0, 1.0], [0.0, 0.0], True)
        """
        raise NotImplementedError

    def set(self, key: str | tuple[str, ...], value: Any, *, inplace: bool = False) -> Any:
        """A new instance with ``value`` at ``key``: a field name, or a tuple path whose first
        element is a field holding a nested container.

        Example:
            >>> import torch, tdfunc
            >>> @tdfunc.tensorclass
            ... class P:
            ...     x: torch.Tensor
            ...     extra: tdfunc.TensorDict | None = None
            >>> p = P(torch.zeros(2), batch_size=[2]).set(("extra", "y"), torch.ones(2))
            >>> p.extra["y"].tolist()
            [1.0, 1.0]
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "set")
        return set_path(self, as_path(key), value)

    # ------------------------------------------------------------------ conversion
    def to_tensordict(self) -> TensorDict:
        """A :class:`TensorDict` of the data fields (nested tensorclasses converted too).

        ``None`` fields and static fields are left out; :meth:`from_tensordict` restores them.

        Example:
            >>> import torch, tdfunc
            >>> @tdfunc.tensorclass
            ... class P:
            ...     x: torch.Tensor
            ...     scale: float = 1.0
            >>> P(torch.zeros(2), batch_size=[2]).to_tensordict().keys()
            ['x']
        """
        return _as_tensordict(self)

    def flatten_keys(
        self, separator: str = ".", inplace: bool = False, *, sep: str | None = None
    ) -> TensorDict:
        """A flat :class:`TensorDict` of the data fields:
        ``self.to_tensordict().flatten_keys(separator)`` (``sep``: another name for it).

        Example:
            >>> import torch, tdfunc
            >>> @tdfunc.tensorclass
            ... class P:
            ...     x: torch.Tensor
            ...     extra: tdfunc.TensorDict | None = None
            >>> P(torch.zeros(2), extra={"y": torch.ones(2)}, batch_size=[2]).flatten_keys().keys()
            ['x', 'extra.y']
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "flatten_keys")
        return _as_tensordict(self).flatten_keys(separator if sep is None else sep)

    @classmethod
    def from_tensordict(cls: type[_C], td: Any, /, **static: Any) -> _C:
        """Build an instance from a TensorDict whose keys are (some of) the data fields.

        Static fields take ``static`` or their defaults; missing optional fields take their
        defaults. Nested TensorDicts become the tensorclass their field is annotated with.
        This is a user construction: checks and ``__post_init__`` run.

        Example:
            >>> import torch, tdfunc
            >>> @tdfunc.tensorclass
            ... class P:
            ...     x: torch.Tensor
            >>> td = tdfunc.TensorDict(x=torch.zeros(3), batch_size=[3])
            >>> P.from_tensordict(td).batch_size
            torch.Size([3])
        """
        if not is_node(td):
            raise TypeError(
                f"{cls.__name__}.from_tensordict expects a TensorDict, got {type(td).__name__}"
            )
        names = cls._tdf_child_names
        kwargs: dict[str, Any] = {}
        for k, v in zip(td._tdf_keys(), td._tdf_children()):
            if k not in names:
                raise KeyError(
                    E.UNKNOWN_FIELD.format(
                        cls=cls.__name__, where=".from_tensordict()", name=k, fields=list(names)
                    )
                )
            spec = cls._tdf_specs[k]
            target = _single_tensorclass(spec)
            if target is not None and v is not None and not isinstance(v, target):
                v = target.from_tensordict(v)
            kwargs[k] = v
        return cls(**kwargs, **static, batch_size=td._batch_size, device=td._device)

    # ------------------------------------------------------------------ repr
    def __repr__(self) -> str:
        return _tc_repr(self, 0)

    def _tdf_repr(self, indent: int) -> str:
        return _tc_repr(self, indent)


_C = TypeVar("_C", bound=_TensorClass)


def _single_tensorclass(spec: F.ChildSpec | None) -> type[_TensorClass] | None:
    if spec is None or spec.tensor or spec.mapping or len(spec.nodes) != 1:
        return None
    t = spec.nodes[0]
    return t if issubclass(t, _TensorClass) else None


def _as_tensordict(node: Any) -> TensorDict:
    data: dict[str, Any] = {}
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if v is not None:
            data[k] = _as_tensordict(v) if is_node(v) else v
    return TensorDict._new(data, node._batch_size, node._device)


def _tc_repr(node: _TensorClass, indent: int) -> str:
    pad = "    " * (indent + 1)
    lines = [f"{type(node).__name__}("]
    shown = {f.name for f in dataclasses.fields(node) if f.repr}
    for name in node._tdf_fields:
        if name in shown:
            lines.append(f"{pad}{name}={describe_child(getattr(node, name, None), indent)},")
    dev = None if node._device is None else str(node._device)
    lines.append(f"{pad}batch_size={tuple(node._batch_size)}, device={dev})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the decorator
#: the attributes a field may not take: every name of the class but the lifted torch methods
#: (``exp``, ``max``, ``sign``...), which a field of that name shadows on its class
_RESERVED = (frozenset(n for n in dir(_TensorClass) if not n.startswith("__")) - LIFTED_METHODS) | {
    "replace"
}


def _check_names(cls: type) -> None:
    for name in inspect.get_annotations(cls):
        if name in _RESERVED:
            owner = next(c for c in _TensorClass.__mro__ if name in c.__dict__)
            what = f"the tensorclass attribute {owner.__name__}.{name}"
        elif name.startswith(("__", "_tdf")):
            what = "a name reserved for the implementation (leading '__' or '_tdf')"
        else:
            continue
        raise TypeError(E.RESERVED_NAME.format(cls=cls.__name__, name=name, what=what))


def _fix_class_cells(ns: Mapping[str, Any], old: type, new: type) -> None:
    """Point the ``__class__`` cell of methods (zero-argument ``super()``) at the new class."""
    for value in ns.values():
        fns: list[Any] = [value]
        if isinstance(value, (classmethod, staticmethod)):
            fns = [value.__func__]
        elif isinstance(value, property):
            fns = [value.fget, value.fset, value.fdel]
        for fn in fns:
            code = getattr(fn, "__code__", None)
            if code is None or fn.__closure__ is None:
                continue
            for var, cell in zip(code.co_freevars, fn.__closure__):
                if var == "__class__" and cell.cell_contents is old:
                    cell.cell_contents = new


def _signature(fields: Sequence[dataclasses.Field]) -> inspect.Signature:
    params = []
    for f in fields:
        if not f.init:
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else G.FACTORY
            if f.default_factory is not dataclasses.MISSING
            else inspect.Parameter.empty
        )
        kind = (
            inspect.Parameter.KEYWORD_ONLY if f.kw_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=f.type))
    params.sort(key=lambda p: p.kind)
    params += [
        inspect.Parameter("batch_size", inspect.Parameter.KEYWORD_ONLY, default=()),
        inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return inspect.Signature(
        [self_param, *params], return_annotation=None, __validate_parameters__=False
    )


def _classify(
    cls: type, fields: Sequence[dataclasses.Field], localns: Mapping[str, Any]
) -> tuple[dict[str, F.ChildSpec | None], dict[str, str]]:
    """The kind of every field (a :class:`ChildSpec`, or None when static) and its annotation.

    Inherited fields keep their parent's kind unless the class annotates them again.
    """
    own = set(inspect.get_annotations(cls))
    inherited: dict[str, Any] = {}
    inherited_anns: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):  # each class's own table (tensorclasses have one)
        inherited.update(vars(base).get("_tdf_specs", {}))
        inherited_anns.update(vars(base).get("_tdf_anns", {}))
    specs: dict[str, F.ChildSpec | None] = {}
    anns: dict[str, str] = {}
    body = {**localns, **cls.__dict__}
    for f in fields:
        if f.name in own or f.name not in inherited:
            tp = F.resolve(cls.__name__, f.name, f.type, cls.__module__, body)
            specs[f.name] = F.classify(cls.__name__, f.name, tp, f.default is None)
            anns[f.name] = F.type_name(tp, cls.__name__)
        else:
            specs[f.name] = inherited[f.name]
            anns[f.name] = inherited_anns[f.name]
    return specs, anns


def _slotted(dc: type, names: tuple[str, ...]) -> type:
    """A new class with ``dc``'s body, its fields as ``__slots__`` and :class:`_TensorClass`
    (hence :class:`Container`) among its bases."""
    dropped = ("__dict__", "__weakref__", "__setattr__", "__delattr__")  # frozen via _TensorClass
    ns = {k: v for k, v in dc.__dict__.items() if k not in names and k not in dropped}
    inherited_slots = {s for b in dc.__mro__[1:] for s in getattr(b, "__slots__", ())}
    ns["__slots__"] = tuple(n for n in names if n not in inherited_slots)
    ns["__dataclass_fields__"] = {**dc.__dataclass_fields__, **_PSEUDO_FIELDS}  # type: ignore[attr-defined]
    bases = tuple(b for b in dc.__bases__ if b is not object)
    if not any(issubclass(b, _TensorClass) for b in bases):
        bases = (*bases, _TensorClass)
    new = type(dc)(dc.__name__, bases, ns)
    _fix_class_cells(ns, dc, new)
    return new


def _build(cls: type, serialized_type_name: str | None, localns: Mapping[str, Any]) -> type:
    if not isinstance(cls, type):
        raise TypeError(f"@tensorclass decorates a class, got {type(cls).__name__}")
    if "__slots__" in cls.__dict__:
        raise TypeError(
            f"@tensorclass {cls.__name__}: do not define __slots__; the fields become slots"
        )
    if any(issubclass(b, Container) and not issubclass(b, _TensorClass) for b in cls.__bases__):
        raise TypeError(f"@tensorclass {cls.__name__}: cannot inherit from TensorDict")
    _check_names(cls)
    # a real frozen dataclass: fields, defaults, default_factory, kw_only, InitVar, ClassVar
    dc: type[Any] = dataclasses.dataclass(cls, init=False, repr=False, eq=False, frozen=True)
    fields = dataclasses.fields(dc)
    all_fields: dict[str, dataclasses.Field[Any]] = dc.__dataclass_fields__
    user_initvars = [
        f
        for f in all_fields.values()
        if f._field_type is _INITVAR and f.name not in _PSEUDO_FIELDS  # type: ignore[attr-defined]
    ]
    specs, anns = _classify(cls, fields, localns)
    names = tuple(f.name for f in fields)
    new = _slotted(dc, names)
    specs = {  # a self-reference (``next: Chain | None``) now names the class itself
        k: s
        if s is None
        else s._replace(nodes=tuple(new if n is F.SelfRef else n for n in s.nodes))
        for k, s in specs.items()
    }
    plan = G.Plan(
        new,
        fields,
        user_initvars,
        list(all_fields),
        specs,
        anns,
        post_init=hasattr(new, "__post_init__"),
    )
    gen = G.generate(plan)
    attrs: dict[str, Any] = {
        "_tdf_fields": names,
        "_tdf_child_names": tuple(plan.children),
        "_tdf_static_names": tuple(plan.statics),
        "_tdf_specs": types.MappingProxyType(specs),
        "_tdf_anns": types.MappingProxyType(anns),
        "_tdf_rebuild": gen["_tdf_rebuild"],
        "_tdf_children": gen["_tdf_children"],
        "_tdf_static": gen["_tdf_static"],
    }
    if "__init__" not in cls.__dict__:  # like dataclasses, a hand-written __init__ is kept
        order = list(all_fields)
        init = gen["__init__"]
        init.__signature__ = _signature(  # type: ignore[attr-defined]
            sorted([*fields, *user_initvars], key=lambda f: order.index(f.name))
        )
        attrs["__init__"] = init
    replace = cls.__dict__.get("replace", gen["replace"])  # a hand-written replace is kept
    attrs["replace"] = replace
    attrs["__replace__"] = replace  # copy.replace (Python 3.13)
    for key, value in attrs.items():
        setattr(new, key, value)
    type_name = serialized_type_name or f"{new.__module__}.{new.__qualname__}"
    register(new, gen["__tdf_unflatten__"], type_name, pytree.GetAttrKey, optree.GetAttrEntry)
    # instances rebuild from plain state (no code runs): safe for torch.load(weights_only=True)
    torch.serialization.add_safe_globals([new])
    return new


@overload
def tensorclass(cls: _T, /) -> _T: ...
@overload
def tensorclass(*, serialized_type_name: str | None = None) -> Callable[[_T], _T]: ...


@dataclass_transform(
    eq_default=False, frozen_default=True, field_specifiers=(dataclasses.field, dataclasses.Field)
)
def tensorclass(cls: type | None = None, /, *, serialized_type_name: str | None = None) -> Any:
    """Turn an annotated class into a frozen dataclass of tensors sharing a batch size.

    * Fields annotated ``torch.Tensor`` are leaves; fields annotated ``TensorDict`` or a
      tensorclass are nested containers (subtrees); either may be ``None`` when annotated
      ``X | None`` (or defaulting to ``None``): a ``None`` field stays in the structure and is
      never seen by ``tree_map`` / ``vmap``. Any other annotation makes a *static* field:
      hashable metadata that is part of the pytree structure (changing it changes the structure).
    * The constructor takes the fields positionally or by keyword, plus keyword-only
      ``batch_size`` (default ``()``) and ``device``; each tensor is checked against the
      batch size. ``__post_init__`` runs after a user construction (the constructor,
      ``dataclasses.replace``, ``from_tensordict``), not after operations (``t[0]``,
      ``t + 1``, ``t.replace(...)``, pytree unflatten...) whose results are built through a
      trusted path from already-checked values. Inside ``__post_init__`` set fields with
      ``object.__setattr__(self, name, value)``, as in any frozen dataclass.
    * Frozen: assigning a field raises :class:`dataclasses.FrozenInstanceError`; use
      ``t.replace(name=value)`` or ``dataclasses.replace(t, name=value)``.
    * Every :class:`tdfunc.Container` operation works and keeps the class; comparisons are
      elementwise. Subclasses add fields and must be decorated too.
    * Registered with ``torch.utils._pytree`` (``GetAttrKey`` key paths, serialized type name
      ``module.qualname`` unless ``serialized_type_name`` is given, so ``torch.export``
      programs can be saved and loaded) and with optree (namespace ``"tdfunc"``).

    Args:
        cls: the class to decorate.
        serialized_type_name: the name under which exported programs record the class.

    Example:
        >>> import dataclasses, torch, tdfunc
        >>> @tdfunc.tensorclass
        ... class Transition:
        ...     obs: torch.Tensor
        ...     action: torch.Tensor
        ...     info: tdfunc.TensorDict | None = None
        ...     discount: float = 0.99
        >>> t = Transition(torch.zeros(32, 4), torch.ones(32), batch_size=[32])
        >>> t[:8].batch_size, type(t + 1).__name__
        (torch.Size([8]), 'Transition')
        >>> t2 = t.replace(obs=torch.ones(32, 4))
        >>> [f.name for f in dataclasses.fields(Transition)]
        ['obs', 'action', 'info', 'discount']
        >>> dataclasses.replace(t, discount=0.5).batch_size
        torch.Size([32])
    """
    localns = sys._getframe(1).f_locals
    if cls is None:
        return lambda c: _build(c, serialized_type_name, localns)
    return _build(cls, serialized_type_name, localns)


def is_tensorclass(obj: Any) -> bool:
    """True for a ``@tensorclass`` type or an instance of one.

    Example:
        >>> import torch, tdfunc
        >>> @tdfunc.tensorclass
        ... class P:
        ...     x: torch.Tensor
        >>> tdfunc.is_tensorclass(P), tdfunc.is_tensorclass(P(torch.zeros(()))), tdfunc.is_tensorclass(1)
        (True, True, False)
    """
    return isinstance(obj, _TensorClass) or (
        isinstance(obj, type) and issubclass(obj, _TensorClass) and obj is not _TensorClass
    )


def restore(
    cls: type[_I],
    fields: Mapping[str, Any],
    batch_size: Sequence[int] | torch.Size,
    device: torch.device | str | None,
) -> _I:
    """An instance of the tensorclass ``cls`` holding exactly the saved ``fields``.

    What a load (:func:`tdfunc.load`, :func:`tdfunc.load_safetensors`) uses to rebuild a
    tensorclass: every field is checked like the constructor checks it (batch-size prefix,
    device, optional / static kinds), but neither a hand-written ``__init__`` nor
    ``__post_init__`` runs, so a ``__post_init__`` that changes values (normalising, adding
    an offset, deriving a field) is not applied a second time: the loaded instance equals the
    saved one. ``InitVar`` pseudo-fields are not stored and are not passed.

    Args:
        cls: a ``@tensorclass`` type.
        fields: a value for every field of ``cls`` (data and static), by name.
        batch_size: the instance's batch size.
        device: the instance's device, or ``None``.

    Raises:
        TypeError: a field is missing or unknown, or a value is of the wrong kind.
        ValueError: a data field does not start with ``batch_size``.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc._tensorclass import restore
        >>> @tdfunc.tensorclass
        ... class Scaled:
        ...     x: torch.Tensor
        ...     def __post_init__(self):
        ...         object.__setattr__(self, "x", self.x * 10)
        >>> s = Scaled(torch.ones(2), batch_size=[2])
        >>> s.x.tolist(), restore(Scaled, {"x": s.x}, [2], None).x.tolist()
        ([10.0, 10.0], [10.0, 10.0])
    """
    tc: Any = cls
    if not is_tensorclass(tc):
        raise TypeError(f"restore expects a @tensorclass type, got {tc!r}")
    names = tc._tdf_fields
    for name in fields:
        if name not in names:
            G._unknown(tc, " (restore)", {name: fields[name]})
    bs = as_batch_size(batch_size)
    dev = G._as_device(device)
    new = object.__new__(tc)
    for name in names:
        if name not in fields:
            G._missing(tc, name)
        spec = tc._tdf_specs[name]
        value = fields[name]
        if spec is None:
            value = F.static_value(tc, name, value, tc._tdf_anns[name])
        else:
            value = F.child_value(tc, name, value, bs, dev, spec)
        object.__setattr__(new, name, value)
    object.__setattr__(new, "_batch_size", bs)
    object.__setattr__(new, "_device", dev)
    return new
