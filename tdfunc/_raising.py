"""Typed errors that a compiled program raises when it runs, with their type and message.

An exception raised by Python code while Dynamo traces it stops the trace: without
``fullgraph`` Dynamo runs that frame eagerly (the caller sees the exception as it is), with
``fullgraph=True`` it reports ``torch._dynamo.exc.Unsupported``, the exception only in its
message and cause. An error found *after* the work it is about, on a path that can carry on,
need not stop the trace: :func:`refuse` raises it eagerly, and traced it puts a call to the
custom op ``tdfunc::refuse`` into the graph (kept by every backend: it is declared to have side
effects), whose kernel raises the same exception, type and message, when the compiled program
runs. A check torch runs as a graph op (``torch._assert_async``) raises ``RuntimeError``
instead, which is why a typed error is never raised that way.
"""

from __future__ import annotations

import torch
import torch.fx

from ._compat import undo_compiled_grad_hooks_switch
from ._twins import traced_as

#: the exception types :func:`refuse` carries through a compiled program, by name
_TYPES: dict[str, type[Exception]] = {
    t.__name__: t for t in (PermissionError, KeyError, ValueError, TypeError, IndexError)
}

_LIB = torch.library.Library("tdfunc", "FRAGMENT")
_LIB.define("refuse(str kind, str message) -> ()")
_LIB.define("refuse_if(Tensor cond, str kind, str message) -> ()")


def _refuse_kernel(kind: str, message: str) -> None:
    undo_compiled_grad_hooks_switch()  # the program is left by this exception
    raise _TYPES[kind](message)


def _refuse_fake(kind: str, message: str) -> None:
    return None


def _refuse_if_kernel(cond: torch.Tensor, kind: str, message: str) -> None:
    if bool(cond.any()):
        undo_compiled_grad_hooks_switch()
        raise _TYPES[kind](message)


def _refuse_if_fake(cond: torch.Tensor, kind: str, message: str) -> None:
    return None


_LIB.impl("refuse", _refuse_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("tdfunc::refuse", lib=_LIB)(_refuse_fake)
torch.fx.node.has_side_effect(torch.ops.tdfunc.refuse.default)
_LIB.impl("refuse_if", _refuse_if_kernel, "CompositeExplicitAutograd")
torch.library.register_fake("tdfunc::refuse_if", lib=_LIB)(_refuse_if_fake)
torch.fx.node.has_side_effect(torch.ops.tdfunc.refuse_if.default)


def refuse(error: type[Exception], message: str) -> None:
    """Raise ``error(message)``: at once eagerly; traced, when the compiled program runs.

    The caller's code after the call must be right to run when it returns (it does while
    Dynamo traces); the program then raises where the eager call raised, with the same type
    and message. ``error`` is one of ``PermissionError``, ``KeyError``, ``ValueError``,
    ``TypeError``, ``IndexError``.

    Example:
        >>> try:
        ...     refuse(PermissionError, "read-only")
        ... except PermissionError as e:
        ...     print(e)
        read-only
    """
    raise error(message)


@traced_as(refuse)
def _traced_refuse(error: type[Exception], message: str) -> None:
    torch.ops.tdfunc.refuse(error.__name__, message)


def refuse_if(cond: torch.Tensor, error: type[Exception], message: str) -> None:
    """Raise ``error(message)`` when the boolean tensor ``cond`` holds a ``True``: a check of
    values (an empty buffer, an index out of range) that a compiled program runs as a graph
    op, with the type and message it has eagerly (one code path: the op runs in both).

    ``error`` is one of the types :func:`refuse` takes. Reading ``cond`` waits for the
    values (a device synchronisation on an accelerator).

    Example:
        >>> import torch
        >>> refuse_if(torch.tensor(False), ValueError, "never raised")
        >>> try:
        ...     refuse_if(torch.tensor([False, True]), IndexError, "row 7 is out of range")
        ... except IndexError as e:
        ...     print(e)
        row 7 is out of range
    """
    torch.ops.tdfunc.refuse_if(cond, error.__name__, message)


__all__ = ["refuse", "refuse_if"]
