"""Field kinds of a ``@tensorclass``: how an annotation is classified and how a value is checked.

A field is either a *child* (annotated with ``torch.Tensor``, ``TensorDict``, a tensorclass or
a union of those, optionally ``| None``) or *static* (any other annotation: hashable metadata
that is part of the pytree structure). The checks below run on user construction and in
``replace``; operations rebuild instances through a trusted path that skips them.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .. import _errors as E
from .. import _ops as ops
from .._tree import Node, is_node
from ..tensordict import TensorDict

# ------------------------------------------------------------------------------ messages


class ChildSpec(typing.NamedTuple):
    """How a child field is checked: which kinds of value it accepts."""

    tensor: bool  # accepts a torch.Tensor
    nodes: tuple[type, ...]  # accepted node types (TensorDict, tensorclasses, Container)
    mapping: bool  # a plain mapping is turned into a TensorDict
    optional: bool  # None is allowed
    ann: str  # the annotation, for messages


class SelfRef:
    """Stands for the class being defined in its own annotations (``next: "Node | None"``)."""


def type_name(tp: Any, self_name: str = "Self") -> str:
    """A short readable name for an annotation (``torch.Tensor | None``)."""
    members = _members(tp)
    if len(members) > 1:
        return " | ".join(type_name(m, self_name) for m in members)
    if tp is type(None) or tp is None:
        return "None"
    if tp is SelfRef:
        return self_name
    if isinstance(tp, type):
        return "torch.Tensor" if tp is Tensor else tp.__qualname__
    return repr(tp).replace("typing.", "")


def resolve(cls_name: str, name: str, ann: Any, module: str, localns: Mapping[str, Any]) -> Any:
    """Evaluate a string annotation in the class's module, class body and defining scope.

    The class's own name stands for the class being defined.
    """
    if not isinstance(ann, str):
        return ann
    mod = sys.modules.get(module)
    globalns = dict(vars(mod)) if mod is not None else {}
    ns = {**localns, cls_name: SelfRef}
    try:
        return eval(ann, globalns, ns)  # annotations are code written by the user
    except Exception as err:  # any failure: report which field, at class definition
        raise TypeError(
            E.UNRESOLVED_ANNOTATION.format(cls=cls_name, ann=ann, name=name, err=err)
        ) from None


def _members(tp: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _members(typing.get_args(tp)[0])
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        out: list[Any] = []
        for a in typing.get_args(tp):
            out.extend(_members(a))
        return tuple(out)
    return (tp,)


def classify(cls_name: str, name: str, tp: Any, default_is_none: bool) -> ChildSpec | None:
    """A :class:`ChildSpec` for a data field, or None for a static field.

    ``tp`` is a resolved annotation. Tensor / node members make a child field; ``None`` in a
    union (or a ``None`` default) makes it optional; any other annotation is static.
    """

    members = _members(tp)
    tensor = False
    nodes: list[type] = []
    other = False
    optional = default_is_none
    for m in members:
        if m is type(None) or m is None:
            optional = True
        elif m is SelfRef:
            nodes.append(SelfRef)  # replaced by the class once it exists
        elif isinstance(m, type) and issubclass(m, Tensor):
            tensor = True
        elif isinstance(m, type) and issubclass(m, Node):
            nodes.append(m)
        else:
            other = True
    if not tensor and not nodes:
        return None
    if other:
        raise TypeError(
            E.MIXED_ANNOTATION.format(cls=cls_name, name=name, ann=type_name(tp, cls_name))
        )
    # a plain mapping becomes a TensorDict where the annotation accepts one
    mapping = any(n is not SelfRef and issubclass(TensorDict, n) for n in nodes)
    return ChildSpec(tensor, tuple(nodes), mapping, optional, type_name(tp, cls_name))


# ------------------------------------------------------------------------------ checks
def _expected(spec: ChildSpec) -> str:
    parts = (["a tensor"] if spec.tensor else []) + [f"a {n.__name__}" for n in spec.nodes]
    if spec.mapping:
        parts.append("a dict")
    if spec.optional:
        parts.append("None")
    return " or ".join(parts)


def _check_prefix(cls: type, name: str, shape: torch.Size, batch_size: torch.Size) -> None:
    """``ValueError`` naming the field when ``shape`` does not start with ``batch_size``."""
    if not ops.starts_with_batch(shape, batch_size, name):
        raise ValueError(
            E.FIELD_SHAPE.format(
                cls=cls.__name__, name=name, shape=tuple(shape), batch_size=tuple(batch_size)
            )
        )


def child_value(
    cls: type,
    name: str,
    value: Any,
    batch_size: torch.Size,
    device: torch.device | None,
    spec: ChildSpec,
) -> Any:
    """Check (and if needed move or convert) the value of a data field."""
    if spec.tensor and isinstance(value, Tensor):
        if device is not None and value.device != device:
            value = value.to(device)
        _check_prefix(cls, name, value.shape, batch_size)
        return value
    if value is None:
        if spec.optional:
            return None
        raise TypeError(E.NONE_NOT_ALLOWED.format(cls=cls.__name__, name=name, ann=spec.ann))
    if spec.nodes and isinstance(value, spec.nodes):
        node = typing.cast(Node, value)  # spec.nodes holds node types once the class exists
        if device is not None and node._device != device:
            node = ops.to(node, device)
        _check_prefix(cls, name, node._batch_size, batch_size)
        return node
    if spec.mapping and isinstance(value, Mapping) and not is_node(value):
        return TensorDict._build(value, batch_size, device, (name,))
    raise TypeError(
        E.NOT_A_CHILD.format(
            cls=cls.__name__,
            name=name,
            ann=spec.ann,
            expected=_expected(spec),
            typ=type(value).__name__,
        )
    )


def _hashable(value: Any) -> bool:
    if isinstance(
        value, (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, type)
    ):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(_hashable(v) for v in value)
    return getattr(type(value), "__hash__", None) is not None


def static_value(cls: type, name: str, value: Any, ann: str) -> Any:
    """Check the value of a static field: not data, and hashable."""
    if isinstance(value, Tensor) or is_node(value):
        raise TypeError(
            E.STATIC_GOT_TENSOR.format(
                cls=cls.__name__, name=name, ann=ann, typ=type(value).__name__
            )
        )
    if not _hashable(value):
        raise TypeError(
            E.STATIC_UNHASHABLE.format(cls=cls.__name__, name=name, typ=type(value).__name__)
        )
    return value
