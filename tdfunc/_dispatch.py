"""Where ``Container.__torch_function__`` sends a torch function: the tables it reads.

Three routes, looked up in this order: a function with a container method of its own or a
rule of the lifted-op table (:data:`_HANDLERS`, keyed by name, then by the function), a
higher-order op that takes any pytree (:data:`_PYTREE_PASSTHROUGH`), a ``Tensor`` operator
method that Dynamo hands over for ``t - td`` (:data:`_DUNDER`, :data:`_DUNDER_ALIASED`);
anything else goes to ``_ops._lift.dispatch`` (a rule, or a ``TypeError`` saying why not).
Built once at import; read-only afterwards.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import _ops as ops
from ._ops import _lift
from ._ops._lift import run_rule as _run_rule


def _split(tensor: Any, split_size_or_sections: Any, dim: int = 0) -> Any:
    return ops.split(tensor, split_size_or_sections, dim)


#: torch functions with a container method of their own; each takes its arguments under
#: torch's own names (``torch.zeros_like(input=td)``, ``torch.split(tensor=td, ...)``)
_TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.stack: lambda tensors, dim=0: ops.stack(tensors, dim),
    torch.cat: lambda tensors, dim=0: ops.cat(tensors, dim),
    torch.concat: lambda tensors, dim=0: ops.cat(tensors, dim),
    torch.concatenate: lambda tensors, axis=0: ops.cat(tensors, axis),
    torch.unbind: lambda input, dim=0: ops.unbind(input, dim),
    torch.split: _split,
    torch.chunk: lambda input, chunks, dim=0: ops.chunk(input, chunks, dim),
    torch.clone: lambda input, **kw: ops.clone(input),
    torch.zeros_like: lambda input, *a, **kw: ops.zeros_like(input, *a, **kw),
    torch.ones_like: lambda input, *a, **kw: ops.ones_like(input, *a, **kw),
    torch.empty_like: lambda input, *a, **kw: ops.empty_like(input, *a, **kw),
    torch.full_like: lambda input, *a, **kw: ops.full_like(input, *a, **kw),
    torch.reshape: lambda input, shape: ops.reshape(input, shape),
    torch.permute: lambda input, dims: ops.permute(input, dims),
    torch.transpose: lambda input, dim0, dim1: ops.transpose(input, dim0, dim1),
    torch.squeeze: lambda input, dim=None: ops.squeeze(input, dim),
    torch.unsqueeze: lambda input, dim: ops.unsqueeze(input, dim),
    torch.flatten: lambda input, start_dim=0, end_dim=-1: ops.flatten(input, start_dim, end_dim),
    # reductions (torch.sum ... torch.all) are rules of the lifted-op table (_ops/_batchdim.py)
}

#: torch functions that accept arbitrary pytrees (higher-order ops such as
#: ``torch.compiler.nested_compile_region``): called as they are.
_PYTREE_PASSTHROUGH = frozenset({"invoke_subgraph_placeholder", "invoke_subgraph"})

#: Tensor's operator methods as the operators they implement, and whether the arguments
#: come reversed (``Tensor.__rsub__(t, td)`` is ``td - t``). Dynamo hands a container's
#: ``__torch_function__`` these methods for ``td - t`` inside a compiled function; calling
#: the operator instead of the method is the same computation on every torch.
_BINARY_OPERATORS: dict[str, Callable[..., Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "div": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
}
_DUNDER: dict[str, tuple[Callable[..., Any], bool]] = {
    **{f"__{n}__": (op, False) for n, op in _BINARY_OPERATORS.items()},
    **{f"__r{n}__": (op, True) for n, op in _BINARY_OPERATORS.items()},
    "__neg__": (operator.neg, False),
    "__abs__": (operator.abs, False),
    "__invert__": (operator.invert, False),
}
#: ``Tensor``'s operator methods whose ``__name__`` is not their own (``Tensor.__pow__`` wraps
#: ``TensorBase.pow``: its name is ``pow``); Dynamo hands them to ``__torch_function__`` for
#: ``tensor ** td``
_DUNDER_ALIASED: tuple[tuple[Any, tuple[Callable[..., Any], bool]], ...] = tuple(
    (getattr(Tensor, name), v)
    for name, v in _DUNDER.items()
    if getattr(getattr(Tensor, name, None), "__name__", name) != name
)


def _lifted(func: Callable[..., Any], rule: Callable[..., Any]) -> Callable[..., Any]:
    def handler(*args: Any, **kwargs: Any) -> Any:
        if kwargs:  # out= / inplace= checked there
            return _run_rule(func, rule, args, kwargs)
        return rule(*args)

    return handler


def _by_name_or_alias(func: Any) -> bool:
    """Whether ``__torch_function__`` handles ``func`` before the op table (its name, or its
    identity, makes it a pass-through function or an operator)."""
    name = getattr(func, "__name__", "")
    return (
        name in _PYTREE_PASSTHROUGH
        or name in _DUNDER
        or name == "wrapped"
        or any(func is f for f, _ in _DUNDER_ALIASED)
    )


#: what ``__torch_function__`` looks up first: the functions with a container method of
#: their own, then every function of the lifted-op table that it would reach the table for
#: (the same rule ``_lift.dispatch`` finds, looked up once here). One dict *hit* per call:
#: inside ``torch.compile`` a hit is guarded by its key alone, where the misses of the
#: former chain of lookups (``_TORCH_FUNCTIONS``, then the batch-dim rules before the
#: pointwise ones) were guarded by every key of each dict: ~150 guards per call
_HANDLERS_BY_FUNCTION: dict[Any, Callable[..., Any]] = {
    **{f: _lifted(f, r) for f, r in _lift.TABLE.items() if not _by_name_or_alias(f)},
    **_TORCH_FUNCTIONS,
}

#: the same handlers keyed by the function's ``__name__`` first, then by the function (a
#: name has one to a few functions: ``torch.sum``, ``Tensor.sum``, ``torch.masked.sum``).
#: Inside ``torch.compile`` a hit in a dict keyed by strings is guarded by a lookup of that
#: key; a dict keyed by function objects is guarded by the entry's *position*, and Dynamo
#: walks the dict up to it on every call (``torch.sum`` sat at position 334: ~1 us a call)
_HANDLERS: dict[str, dict[Any, Callable[..., Any]]] = {}
for _f, _impl in _HANDLERS_BY_FUNCTION.items():
    _HANDLERS.setdefault(getattr(_f, "__name__", ""), {})[_f] = _impl
del _f, _impl
_NO_HANDLER: dict[Any, Callable[..., Any]] = {}
