"""What an ATen op or a torch function does to leaves, read from the ATen schemas alone.

* :func:`_op_info`: per ATen overload, the arguments it writes and which results are views of
  (or are) an argument; ``__torch_dispatch__`` refuses writes and rewraps views from it.
* :func:`_kind`: per torch function, whether a call is a pure read that
  ``__torch_function__`` runs directly on the mapped tensors (no Python dispatch), a metadata
  property, or a call that goes the checked way; :func:`_mapped` gives the mapped tensor.

Nothing here knows the leaf class. The design is in ``_tensor.py`` ("Reads without
``__torch_dispatch__``").
"""

from __future__ import annotations

import functools
from types import BuiltinFunctionType, MethodDescriptorType, WrapperDescriptorType
from typing import Any

import torch
from torch import Tensor

from .._compat import (
    OpOverloadPacket,
    TensorBase,
    is_functional_tensor,
    is_functorch_wrapped_tensor,
)

# --------------------------------------------------------------------------------------
# schema analysis (one entry per ATen overload, computed once)
# --------------------------------------------------------------------------------------
_PLAIN, _VIEW, _WRITE = 0, 1, 2


@functools.cache
def _op_info(func: Any) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, int, str], ...]]:
    """``(written args, returns)`` of an ATen overload, from its schema's alias annotations.

    Written args: ``(position, name)`` of each argument annotated ``(a!)``. Returns:
    ``(kind, source position, source name)`` with kind plain / view of an argument / the
    written argument itself.
    """
    schema = func._schema
    writes = []
    alias_of: list[tuple[frozenset[str], int, str]] = []
    wild: tuple[int, str] | None = None
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None:
            continue
        alias_of.append((frozenset(info.before_set), i, a.name))
        if wild is None and "*" in info.after_set:
            wild = (i, a.name)
        if info.is_write:
            writes.append((i, a.name))
    rets = []
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            rets.append((_PLAIN, -1, ""))
            continue
        sets = frozenset(info.before_set)
        # ``Tensor(a)[]`` returns (unbind, split, chunk...) do not expose their alias set:
        # the source is the argument annotated ``Tensor(a -> *)``
        src = next(((i, n) for s, i, n in alias_of if s & sets), None) if sets else wild
        if src is None:
            rets.append((_PLAIN, -1, ""))
        else:
            rets.append((_WRITE if info.is_write else _VIEW, src[0], src[1]))
    return tuple(writes), tuple(rets)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(name)


# --------------------------------------------------------------------------------------
# reads without __torch_dispatch__
# --------------------------------------------------------------------------------------
#: Python operators whose name is not an ATen op name, and the ATen op each one calls (none of
#: them writes its operands; ``x[i]`` reads, ``x[i] = v`` is ``__setitem__``, not listed)
_OPERATORS = {
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "rsub",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__floordiv__": "floor_divide",
    "__rfloordiv__": "floor_divide",
    "__mod__": "remainder",
    "__rmod__": "remainder",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__neg__": "neg",
    "__pos__": "positive",
    "__abs__": "abs",
    "__invert__": "bitwise_not",
    "__eq__": "eq",
    "__ne__": "ne",
    "__lt__": "lt",
    "__le__": "le",
    "__gt__": "gt",
    "__ge__": "ge",
    "__getitem__": "index",
}
#: metadata properties, answered from the mapped tensor (the same sizes, strides, dtype and
#: device as the leaf); ``_version``, ``grad``, ``requires_grad``... stay the leaf's own
_METADATA = frozenset(
    {
        *("shape", "dtype", "device", "ndim", "layout", "is_cpu", "is_cuda", "is_meta"),
        *("size", "stride", "dim", "numel", "storage_offset", "is_contiguous", "element_size"),
    }
)
_BUILTINS = (BuiltinFunctionType, MethodDescriptorType, WrapperDescriptorType)
#: how a call is run: on the mapped tensors (``_READ``), or through ``__torch_dispatch__``
#: with its per-op schema check (``_CHECKED``); a metadata property: ``_META``
_CHECKED, _READ, _META = 0, 1, 2
#: per torch function: ``(how, names of out= arguments)``
_KINDS: dict[Any, tuple[int, frozenset[str]]] = {}


def _kind(func: Any) -> tuple[int, frozenset[str]]:
    """How to run ``func`` on leaves. A C binding of an ATen op none of whose overloads
    writes an input is a read, unless the call passes an ``out=`` argument (the schemas say
    which arguments are outputs). Python functions (``torch.nn.init.normal_``,
    ``torch.nn.functional.relu(x, inplace=True)``...) and names that are not ATen ops
    (``__setitem__``, ``__iadd__``...) are checked op by op in ``__torch_dispatch__``."""
    kind = _KINDS.get(func)
    if kind is not None:
        return kind
    kind = (_CHECKED, frozenset())
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None) if name == "__get__" else func
    if getattr(owner, "__objclass__", None) is TensorBase and (
        getattr(owner, "__name__", "") in _METADATA
    ):
        kind = (_META, frozenset())
    elif isinstance(func, _BUILTINS):
        name = _OPERATORS.get(name, name)
        packet = None if name.startswith("__") else getattr(torch.ops.aten, name, None)
        if isinstance(packet, OpOverloadPacket):
            schemas = [getattr(packet, o)._schema for o in packet.overloads()]
            args = [a for s in schemas for a in s.arguments]
            if not any(
                a.alias_info is not None and a.alias_info.is_write and not a.is_out for a in args
            ):
                kind = (_READ, frozenset({"out", *(a.name for a in args if a.is_out)}))
    _KINDS[func] = kind
    return kind


def _mapped(x: Any) -> Tensor | None:
    """The plain tensor over real mapped memory behind leaf ``x`` (``None`` for a fake or
    functional tensor made while ``torch.compile`` traces: such calls go the checked way)."""
    t = x._inner
    if type(t) is not Tensor or is_functional_tensor(t) or is_functorch_wrapped_tensor(t):
        return None
    return t
