"""Which of the tensors handed to a module did the module write?

:func:`call_tracking_writes` runs a module on *copy-on-write* clones of the given tensors (so
the caller's tensors are never written, whatever the module does) and reports which clones
the module wrote. A write is found in two ways, both plain Python that ``torch.compile``
traces into the graph with no break (the tracking costs nothing at run time there):

* the module rebinds an attribute (``self.count = self.count + 1``): ``torch.func``'s
  reparametrisation hands the new tensor back in the dict of tensors it was given;
* the module writes a tensor in place: the clones are a small ``__torch_function__``
  subclass, so every torch call that involves one is seen, and a call that writes it (or a
  view of it) marks it: an in-place method or function (``add_``, ``x += 1``, ``x[i] = v``, ``.data = v``),
  an ``out=`` argument, an ``inplace=True`` activation or dropout, and the running statistics
  of the batch/instance norm functions in training mode.

Why not the tensors' version counters: under ``torch.compile`` a version is an unbacked
symbolic integer, so "has it changed" is a data-dependent branch (a graph break), while the
torch calls themselves are known when tracing. Why not a ``TorchFunctionMode``: entering a
mode mutates the global mode stack, which ``scan``/``while_loop`` bodies reject. One rule, the
same eagerly and compiled.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import get_overridable_functions

from ..memmap._tensor import MemoryMappedTensor

#: in-place dunder methods (``x += y`` calls ``__iadd__``; ``x[i] = v`` calls ``__setitem__``)
_INPLACE_DUNDERS = (
    "__iadd__",
    "__isub__",
    "__imul__",
    "__itruediv__",
    "__ifloordiv__",
    "__imod__",
    "__ipow__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
    "__imatmul__",
    "__setitem__",
)

#: functions whose result shares memory with their first argument: a write to the result is a
#: write to the argument.
_VIEW_NAMES = (
    "__getitem__",
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "select",
    "narrow",
    "t",
    "transpose",
    "swapaxes",
    "swapdims",
    "permute",
    "movedim",
    "expand",
    "expand_as",
    "squeeze",
    "unsqueeze",
    "flatten",
    "unflatten",
    "diagonal",
    "as_strided",
    "detach",
    "unfold",
    "view_as_real",
    "view_as_complex",
    "split",
    "chunk",
    "unbind",
    "tensor_split",
)

# Write rules, by function: what the call writes.
_FIRST = 0  # the first argument (``self`` of a method)
_INPLACE_FLAG = 1  # the first argument when the ``inplace`` flag (position p) is true
_NORM_STATS = 2  # running mean / var (positions a, b) when the flag (position p) is true


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _build_rules() -> tuple[dict[Any, tuple[Any, ...]], frozenset[Any]]:
    """The write rules and the view functions, computed once from torch's own function lists."""
    rules: dict[Any, tuple[Any, ...]] = {}
    views: set[Any] = set()
    for fns in get_overridable_functions().values():
        for fn in fns:
            name = getattr(fn, "__name__", "")
            if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
                rules[fn] = (_FIRST,)
            elif name in _VIEW_NAMES:
                views.add(fn)
    # ``t.data = v`` replaces the data of ``t``; ``t.data`` is an alias of ``t``
    # (torch's stubs declare ``Tensor.data`` a plain attribute; it is a descriptor)
    rules[torch.Tensor.data.__set__] = (_FIRST,)  # type: ignore[attr-defined]
    views.add(torch.Tensor.data.__get__)  # type: ignore[attr-defined]
    for fn in get_overridable_functions()[F]:
        sig = _signature(fn)
        if sig is not None and "inplace" in sig.parameters:
            rules[fn] = (_INPLACE_FLAG, list(sig.parameters).index("inplace"), "inplace", False)
    # running statistics: (rule, mean position, var position, flag position, flag name, default)
    rules[F.batch_norm] = (_NORM_STATS, 1, 2, 5, "training", False)
    rules[F.instance_norm] = (_NORM_STATS, 1, 2, 5, "use_input_stats", True)
    for name in (
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "cudnn_batch_norm",
        "miopen_batch_norm",
    ):
        norm_fn = getattr(torch, name, None)
        if norm_fn is not None:
            rules[norm_fn] = (_NORM_STATS, 3, 4, 5, "training", False)
    rules[torch.instance_norm] = (_NORM_STATS, 3, 4, 5, "use_input_stats", True)
    return rules, frozenset(views)


_RULES, _VIEWS = _build_rules()


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str, default: Any) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _mark(t: Any) -> None:
    if isinstance(t, _Watched):
        getattr(t, "_watch_root", t)._watch_written = True


class _Watched(Tensor):
    """A clone handed to the module: torch calls that write it (or a view of it) mark it.

    Only calls that involve a watched tensor reach :meth:`__torch_function__`; they run as
    plain torch calls and return plain tensors, except views of a watched tensor, which stay
    watched (a write through ``x[0]``, ``x.view(-1)`` or ``x.data`` is a write to ``x``).
    The mark is an attribute of the clone, created during the call, so nothing outside the
    call is mutated (``torch.compile`` accepts this inside ``scan``/``while_loop`` bodies).
    """

    _watch_written: bool  # set on a clone: the module wrote it
    _watch_root: _Watched  # set on a view: the watched tensor it aliases

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        rule = _RULES.get(func)
        if rule is not None:
            kind = rule[0]
            if kind == _FIRST:
                _mark(args[0] if args else kwargs.get("input", kwargs.get("self")))
            elif kind == _INPLACE_FLAG:
                if _arg(args, kwargs, rule[1], rule[2], rule[3]):
                    _mark(args[0] if args else kwargs.get("input"))
            elif _arg(args, kwargs, rule[3], rule[4], rule[5]):
                _mark(_arg(args, kwargs, rule[1], "running_mean", None))
                _mark(_arg(args, kwargs, rule[2], "running_var", None))
        out_arg = kwargs.get("out")
        if out_arg is not None:
            for o in out_arg if isinstance(out_arg, (tuple, list)) else (out_arg,):
                _mark(o)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in _VIEWS and args and isinstance(args[0], _Watched):
            root = getattr(args[0], "_watch_root", args[0])
            if isinstance(result, (tuple, list)):
                return type(result)(_watch_view(r, root) for r in result)
            return _watch_view(result, root)
        return result


def _watch_view(view: Tensor, root: _Watched) -> _Watched:
    w = view.as_subclass(_Watched)
    w._watch_root = root
    return w


def _plain(t: Tensor) -> Tensor:
    """A plain tensor holding the value of ``t`` (an alias of a watched tensor, or ``t``)."""
    if isinstance(t, _Watched):
        with torch._C.DisableTorchFunctionSubclass():
            return t.view_as(t)
    return t


def lazy_clone(t: Tensor) -> Tensor:
    """A copy-on-write clone: no data is copied until one of the two tensors is written.

    Memory-mapped leaves are copied: torch's copy-on-write needs memory that torch allocated,
    and a module may write any tensor it is given (the file is never written; to call a
    memory-mapped state many times, materialise it once with ``state.clone()``). Inside
    ``torch.vmap`` the leaves are copied too: ``_lazy_clone`` has no batching rule, and its
    per-member fallback costs far more than one batched copy of an ensemble's parameters.
    """
    if isinstance(t, MemoryMappedTensor) or torch._C._functorch.is_batchedtensor(t):
        return t.clone()
    return torch.ops.aten._lazy_clone(t)


def has_shared_tensors(module: nn.Module) -> bool:
    """True when one tensor is reachable under two names of ``module`` (tied weights, or a
    submodule used twice): the only case where ``tie_weights`` changes what torch.func does.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> has_shared_tensors(torch.nn.Sequential(lin, torch.nn.Linear(2, 2)))
        False
        >>> has_shared_tensors(torch.nn.Sequential(lin, lin))
        True
    """
    seen: set[int] = set()
    todo = [module]
    while todo:
        m = todo.pop()
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                if id(t) in seen:
                    return True
                seen.add(id(t))
        todo.extend(sub for sub in m._modules.values() if sub is not None)
    return False


def call_tracking_writes(
    module: nn.Module,
    tensors: dict[str, Tensor],
    args: Any,
    kwargs: dict[str, Any] | None,
    tie_weights: bool,
) -> tuple[Any, dict[str, Tensor]]:
    """Call ``module`` with copy-on-write clones of ``tensors``; return what it wrote.

    Returns:
        ``(output, written)``: the module's output and, for each name whose tensor the module
        wrote in place or rebound, a plain tensor holding the new value (in call order). The
        tensors of ``tensors`` are never written.
    """
    clones: list[_Watched] = []
    for t in tensors.values():
        c = lazy_clone(t).as_subclass(_Watched)
        c._watch_written = False  # an instance attribute (Dynamo traces no class default)
        clones.append(c)
    given: dict[str, Tensor] = dict(zip(tensors, clones))
    # ``tie_weights=True`` makes torch walk every submodule's named tensors at every call;
    # a module without shared tensors gets the same result without it
    tie = tie_weights and has_shared_tensors(module)
    out = torch.func.functional_call(module, given, args, kwargs, tie_weights=tie)
    written: dict[str, Tensor] = {}
    # ``given`` now holds what the module rebound (torch.func writes it back there)
    for (name, now), clone in zip(given.items(), clones):
        if clone._watch_written or now is not clone:
            written[name] = _plain(now)
    return out, written


__all__ = ["call_tracking_writes", "has_shared_tensors", "lazy_clone"]
