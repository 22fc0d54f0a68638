"""Traceable twins: what Dynamo traces in place of an eager-only function, registered with
``torch.compiler.substitute_in_graph`` without importing ``torch._dynamo`` early.

Some boundary functions run differently eagerly and compiled, with the same results: eagerly
:func:`tdfunc.optim.step` runs torch's fused optimizer kernels (which a compiled graph cannot
hold) and :func:`tdfunc.functional_call` reads real version counters; Dynamo traces a twin
that computes the same values with traceable ops. ``substitute_in_graph`` imports
``torch._dynamo`` (about a second, several under load), which an eager-only process (a data
loader worker, a short script) must not pay. So :func:`traced_as` registers a twin at once
when ``torch._dynamo`` is already imported, and otherwise when it gets imported: an import
hook on that one module name runs the registrations right after the module has executed,
before anything can be traced. ``import tdfunc`` never imports ``torch._dynamo``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_DYNAMO = "torch._dynamo"
_PENDING: list[tuple[Callable[..., Any], Callable[..., Any]]] = []


_CONSTANT: list[Callable[..., Any]] = []


def _register_pending() -> None:
    import torch

    while _PENDING:
        original, traced = _PENDING.pop(0)
        torch.compiler.substitute_in_graph(original, skip_signature_check=True)(traced)
    while _CONSTANT:
        torch.compiler.assume_constant_result(_CONSTANT.pop(0))


class _Hook(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``torch._dynamo`` so the pending twins are
    registered once that module has executed."""

    def find_spec(
        self, name: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register_pending()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


_HOOK = _Hook()


def traced_as(original: Callable[..., Any]) -> Callable[[F], F]:
    """Register the decorated function as what Dynamo traces instead of ``original``.

    Registered now when ``torch._dynamo`` is imported, else as soon as it is.

    Example:
        >>> def eager_only(x):
        ...     return x + 1
        >>> @traced_as(eager_only)
        ... def _traced(x):
        ...     return x + 1
    """

    def deco(traced: F) -> F:
        _PENDING.append((original, traced))
        if _DYNAMO in sys.modules:
            _register_pending()
        elif _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
        return traced

    return deco


def constant_when_traced(fn: F) -> F:
    """Mark ``fn`` with ``torch.compiler.assume_constant_result`` (Dynamo calls it while
    tracing and keeps its result as a constant), now when ``torch._dynamo`` is imported,
    else as soon as it is. For pure functions of static objects (an operator's tags).

    Example:
        >>> @constant_when_traced
        ... def tags_of(op):
        ...     return ()
    """
    _CONSTANT.append(fn)
    if _DYNAMO in sys.modules:
        _register_pending()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
    return fn
