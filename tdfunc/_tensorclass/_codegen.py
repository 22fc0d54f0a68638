"""Per-class generated methods of a ``@tensorclass``.

Like :mod:`dataclasses`, the constructor and the hot-path methods are generated as plain
Python source for each class: no loops over fields, no ``**kwargs`` dict walks, no
``getattr`` by name. ``torch.compile`` traces them like hand-written code, and eager calls
cost one function call per field check.

All names the generated code uses start with ``__tdf_``, and field names may not start
with ``__``, so a field can never shadow a helper.

The source of each class is registered in :mod:`linecache` under a file name of its own
(``<tensorclass module.Qualname>``, with a ``-N`` suffix when that name is taken), as attrs
does: tracebacks, ``pdb`` and :func:`inspect.getsource` show the generated lines.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _errors as E
from .._tree import as_batch_size
from . import _fields as F


class _MarkerMeta(type):
    def __repr__(cls) -> str:
        return cls._label  # type: ignore[attr-defined]


# Sentinels are classes: ``torch.compile`` can hold a class as a constant, not an instance.
class REQUIRED(metaclass=_MarkerMeta):
    """Default of a required parameter (the generated code raises a clear error)."""

    _label = "<required>"


class FACTORY(metaclass=_MarkerMeta):
    """Default of a parameter whose field has a ``default_factory``."""

    _label = "<factory>"


class TENSOR_DEFAULT(metaclass=_MarkerMeta):
    """Default of a parameter whose default is a tensor: the body reads the tensor from the
    generated function's globals (``torch.compile`` cannot hold a tensor found only in a
    function's defaults)."""

    _label = "<tensor default>"


class KEEP(metaclass=_MarkerMeta):
    """Default of a ``replace`` parameter: keep the current value."""

    _label = "<unchanged>"


def _as_device(device: Any) -> torch.device | None:
    return None if device is None else torch.device(device)


def _missing(cls: type[Any], name: str) -> None:
    raise TypeError(
        E.MISSING_FIELD.format(cls=cls.__name__, name=name, fields=list(cls._tdf_fields))
    )


def _unknown(cls: type[Any], where: str, kwargs: dict[str, Any]) -> None:
    raise TypeError(
        E.UNKNOWN_FIELD.format(
            cls=cls.__name__, where=where, name=next(iter(kwargs)), fields=list(cls._tdf_fields)
        )
    )


def _too_many(cls: type[Any], n: int, names: Sequence[str], extra: tuple[Any, ...]) -> None:
    raise TypeError(
        E.TOO_MANY_POSITIONAL.format(cls=cls.__name__, n=n, names=tuple(names), got=n + len(extra))
    )


class Plan:
    """Everything the generator needs to know about a class's fields."""

    def __init__(
        self,
        cls: type,
        fields: Sequence[dataclasses.Field],
        initvars: Sequence[dataclasses.Field],
        order: Sequence[str],
        specs: dict[str, F.ChildSpec | None],
        anns: dict[str, str],
        post_init: bool,
    ) -> None:
        self.cls = cls
        self.fields = list(fields)
        self.initvars = list(initvars)
        self.order = {name: i for i, name in enumerate(order)}
        self.specs = specs
        self.anns = anns
        self.post_init = post_init
        self.children = [f.name for f in fields if specs[f.name] is not None]
        self.statics = [f.name for f in fields if specs[f.name] is None]


def _value_expr(plan: Plan, name: str, var: str, bs: str, dev: str) -> str:
    """Source of the checked value of field ``name`` held in variable ``var``."""
    if plan.specs[name] is not None:
        return f"__tdf_child__(__tdf_cls__, {name!r}, {var}, {bs}, {dev}, __tdf_spec_{name}__)"
    return f"__tdf_static__(__tdf_cls__, {name!r}, {var}, __tdf_ann_{name}__)"


def _init_source(plan: Plan) -> str:
    """``__init__``: positional or keyword fields; ``batch_size`` / ``device`` keyword-only."""
    in_order = sorted([*plan.fields, *plan.initvars], key=lambda f: plan.order[f.name])
    params = [f for f in in_order if f.init]
    positional = [f for f in params if not f.kw_only]
    kw_only = [f for f in params if f.kw_only]

    def param(f: dataclasses.Field) -> str:
        if isinstance(f.default, torch.Tensor):
            return f"{f.name}=__tdf_TENSOR_DEFAULT__"
        if f.default is not dataclasses.MISSING:
            return f"{f.name}=__tdf_default_{f.name}__"
        if f.default_factory is not dataclasses.MISSING:
            return f"{f.name}=__tdf_FACTORY__"
        return f"{f.name}=__tdf_REQUIRED__"

    sig = [
        "__tdf_self__",
        *[param(f) for f in positional],
        "*__tdf_extra__",
        *[param(f) for f in kw_only],
        "batch_size=()",
        "device=None",
        "**__tdf_unknown__",
    ]
    names = [f.name for f in positional]
    lines = [
        f"def __init__({', '.join(sig)}):",
        "    if __tdf_extra__:",
        f"        __tdf_too_many__(__tdf_cls__, {len(names)}, {names!r}, __tdf_extra__)",
        "    if __tdf_unknown__:",
        "        __tdf_unknown_fn__(__tdf_cls__, '()', __tdf_unknown__)",
        "    __tdf_bs__ = __tdf_as_size__(batch_size)",
        "    __tdf_dev__ = __tdf_as_device__(device)",
    ]
    for f in params:
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            lines += [
                f"    if {f.name} is __tdf_REQUIRED__:",
                f"        __tdf_missing__(__tdf_cls__, {f.name!r})",
            ]
        elif f.default_factory is not dataclasses.MISSING:
            lines += [
                f"    if {f.name} is __tdf_FACTORY__:",
                f"        {f.name} = __tdf_factory_{f.name}__()",
            ]
        elif isinstance(f.default, torch.Tensor):
            lines += [
                f"    if {f.name} is __tdf_TENSOR_DEFAULT__:",
                f"        {f.name} = __tdf_default_{f.name}__",
            ]
    for f in plan.fields:
        if f.init:
            var = f.name
        elif f.default is not dataclasses.MISSING:
            var = f"__tdf_default_{f.name}__"
        elif f.default_factory is not dataclasses.MISSING:
            var = f"__tdf_factory_{f.name}__()"
        else:
            continue  # init=False without a default: __post_init__ sets it
        value = _value_expr(plan, f.name, var, "__tdf_bs__", "__tdf_dev__")
        lines.append(f"    __tdf_object__.__setattr__(__tdf_self__, {f.name!r}, {value})")
    lines += [
        "    __tdf_object__.__setattr__(__tdf_self__, '_batch_size', __tdf_bs__)",
        "    __tdf_object__.__setattr__(__tdf_self__, '_device', __tdf_dev__)",
    ]
    if plan.post_init:
        args = ", ".join(f.name for f in plan.initvars)
        lines.append(f"    __tdf_self__.__post_init__({args})")
    return "\n".join(lines)


def _trusted_build_source(
    plan: Plan, signature: str, static_value: Callable[[int, str], str]
) -> str:
    """A trusted constructor: new object, children unpacked from ``children``, static fields
    from ``static_value(i, name)``, then batch size and device (no checks, no __post_init__)."""
    lines = [f"def {signature}:", "    __tdf_new__ = __tdf_object__.__new__(__tdf_cls__)"]
    if plan.children:
        targets = "".join(f"__tdf_c{i}__, " for i in range(len(plan.children)))
        lines.append(f"    {targets}= children")
    for i, name in enumerate(plan.children):
        lines.append(f"    __tdf_object__.__setattr__(__tdf_new__, {name!r}, __tdf_c{i}__)")
    for i, name in enumerate(plan.statics):
        lines.append(
            f"    __tdf_object__.__setattr__(__tdf_new__, {name!r}, {static_value(i, name)})"
        )
    lines += [
        "    __tdf_object__.__setattr__(__tdf_new__, '_batch_size', batch_size)",
        "    __tdf_object__.__setattr__(__tdf_new__, '_device', device)",
        "    return __tdf_new__",
    ]
    return "\n".join(lines)


def _rebuild_source(plan: Plan) -> str:
    """``_tdf_rebuild``: trusted, same static fields, new children (no checks, no __post_init__)."""
    return _trusted_build_source(
        plan,
        "_tdf_rebuild(__tdf_self__, children, batch_size, device)",
        lambda i, name: f"__tdf_self__.{name}",
    )


def _unflatten_source(plan: Plan) -> str:
    """Rebuild from a pytree context: children (``None`` fields restored) and static values."""
    return _trusted_build_source(
        plan,
        "__tdf_unflatten__(keys, children, batch_size, device, static)",
        lambda i, name: f"static[{i}][1]",
    )


_REPLACE_DOC = (
    "A new instance with the given fields changed, checked like the constructor; "
    "batch_size and device are kept and __post_init__ is not re-run."
)


def _replace_source(plan: Plan) -> str:
    """``replace(**changes)``: checked like the constructor; ``__post_init__`` is not re-run."""
    sig = [
        "__tdf_self__",
        "*",
        *[f"{f.name}=__tdf_KEEP__" for f in plan.fields],
        "**__tdf_unknown__",
    ]
    lines = [
        f"def replace({', '.join(sig)}):",
        f"    {_REPLACE_DOC!r}",
        "    if __tdf_unknown__:",
        "        __tdf_unknown_fn__(__tdf_cls__, '.replace()', __tdf_unknown__)",
        "    __tdf_bs__ = __tdf_self__._batch_size",
        "    __tdf_dev__ = __tdf_self__._device",
        "    __tdf_new__ = __tdf_object__.__new__(__tdf_cls__)",
    ]
    for f in plan.fields:
        value = _value_expr(plan, f.name, f.name, "__tdf_bs__", "__tdf_dev__")
        lines += [
            f"    if {f.name} is __tdf_KEEP__:",
            f"        __tdf_object__.__setattr__(__tdf_new__, {f.name!r}, __tdf_self__.{f.name})",
            "    else:",
            f"        __tdf_object__.__setattr__(__tdf_new__, {f.name!r}, {value})",
        ]
    lines += [
        "    __tdf_object__.__setattr__(__tdf_new__, '_batch_size', __tdf_bs__)",
        "    __tdf_object__.__setattr__(__tdf_new__, '_device', __tdf_dev__)",
        "    return __tdf_new__",
    ]
    return "\n".join(lines)


def _tuple_expr(items: Sequence[str]) -> str:
    if not items:
        return "()"
    return "(" + ", ".join(items) + ",)"


# Suffixes for generated file names already taken (classes of the same qualified name, e.g.
# defined in a function called twice). ``next`` on a count is atomic under the GIL.
_suffixes = itertools.count(2)


def _register_source(base: str, source: str) -> str:
    """Put ``source`` in :mod:`linecache` under a new file name derived from ``base``.

    The entry has no modification time, so ``linecache.checkcache`` keeps it; it lives as long
    as the process, like the class whose code it describes.
    """
    filename = f"<{base}>"
    lines = source.splitlines(keepends=True)
    entry = (len(source), None, lines, filename)
    # setdefault: a name another thread registered in between is never overwritten
    while linecache.cache.setdefault(filename, entry) is not entry:
        filename = f"<{base}-{next(_suffixes)}>"
        entry = (len(source), None, lines, filename)
    return filename


def generate(plan: Plan) -> dict[str, Callable[..., Any]]:
    """Source, compile and return the generated functions for ``plan.cls``."""
    cls = plan.cls
    ns: dict[str, Any] = {
        "__tdf_cls__": cls,
        # ``object`` itself, not its methods: Dynamo treats an alias of ``object.__setattr__``
        # as a plain ``setattr`` that would call the class's frozen ``__setattr__``
        "__tdf_object__": object,
        "__tdf_child__": F.child_value,
        "__tdf_static__": F.static_value,
        "__tdf_as_size__": as_batch_size,
        "__tdf_as_device__": _as_device,
        "__tdf_missing__": _missing,
        "__tdf_unknown_fn__": _unknown,
        "__tdf_too_many__": _too_many,
        "__tdf_REQUIRED__": REQUIRED,
        "__tdf_FACTORY__": FACTORY,
        "__tdf_TENSOR_DEFAULT__": TENSOR_DEFAULT,
        "__tdf_KEEP__": KEEP,
    }
    for f in [*plan.fields, *plan.initvars]:
        if f.default is not dataclasses.MISSING:
            ns[f"__tdf_default_{f.name}__"] = f.default
        if f.default_factory is not dataclasses.MISSING:
            ns[f"__tdf_factory_{f.name}__"] = f.default_factory
    for f in plan.fields:
        ns[f"__tdf_spec_{f.name}__"] = plan.specs[f.name]
        ns[f"__tdf_ann_{f.name}__"] = plan.anns[f.name]
    children = _tuple_expr([f"__tdf_self__.{n}" for n in plan.children])
    statics = _tuple_expr([f"({n!r}, __tdf_self__.{n})" for n in plan.statics])
    sources = [
        _init_source(plan),
        _rebuild_source(plan),
        _unflatten_source(plan),
        _replace_source(plan),
        f"def _tdf_children(__tdf_self__):\n    return {children}",
        f"def _tdf_static(__tdf_self__):\n    return {statics}",
    ]
    source = "\n\n".join(sources) + "\n"
    filename = _register_source(f"tensorclass {cls.__module__}.{cls.__qualname__}", source)
    # the source is generated above from field names only (checked identifiers)
    exec(compile(source, filename, "exec"), ns)
    out = {
        name: ns[name]
        for name in (
            "__init__",
            "_tdf_rebuild",
            "__tdf_unflatten__",
            "replace",
            "_tdf_children",
            "_tdf_static",
        )
    }
    for name, fn in out.items():
        fn.__qualname__ = f"{cls.__qualname__}.{name}"
        fn.__module__ = cls.__module__
    return out
