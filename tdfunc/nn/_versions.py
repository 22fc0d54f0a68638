"""Has a tensor been written? Read from torch, eagerly and under ``torch.compile``.

:func:`write_marks` gives one number per tensor that changes when the tensor is written:

* its version counter, which the dispatcher bumps on every in-place write to the tensor or to
  any of its views, including writes inside C++ ops (``F.embedding(..., max_norm=...)``),
  foreach ops and ``nn.init``; under ``torch.vmap`` / ``torch.func.grad``, the counter of the
  tensor under the functorch wrappers (a batched wrapper's own counter does not move);
* for the tensors asked (buffers), the identity of its storage too, which changes when
  ``t.data = v`` swaps the memory under the tensor (torch records no version for that);
* whether a copy-on-write clone still shares its memory (a write through ``t.data``, whose
  version counter is another one, copies it).

Under ``torch.compile`` Dynamo turns ``t._version`` into an unbacked symbolic integer, so
"did it change" would be a data-dependent branch. The counter of the fake tensor Dynamo traces
with is exact, though: it is bumped by every in-place op traced (in-place foreach ops
excepted: torch's fake kernels skip the bump, which :func:`record_unrecorded_writes` makes up
for while tracing, from the ops' schemas). What Dynamo traces instead of
:func:`write_marks` (registered in ``_twins``) therefore calls a custom op
(``tdfunc::versions``, defined here), whose fake implementation reports each fake tensor's
version as the static length of an empty ``meta`` tensor: a constant while tracing, no guard, no
graph break. The op's results are never used, so a compiled graph does no work for it. (Dynamo
does not trace ``t.data = v`` on a tensor made inside the compiled function: it stops with its
own error, so the traced marks need no storage identity.)

Nothing here imports ``torch._dynamo``: defining a custom op does not.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.fx
from torch import Tensor

from .._compat import OpOverload, OpOverloadPacket, get_unwrapped, is_cow, operator_schemas
from .._compat import is_functorch_wrapped_tensor as _is_wrapped


def unwrapped(t: Tensor) -> Tensor:
    """The tensor under ``t``'s functorch wrappers (``t`` itself outside any transform)."""
    while _is_wrapped(t):
        t = get_unwrapped(t)
    return t


def _lengths(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty((unwrapped(t)._version,), device="meta") for t in tensors]


_LIB = torch.library.Library("tdfunc", "FRAGMENT")
_LIB.define("versions(Tensor[] tensors) -> Tensor[]")
_LIB.impl("versions", _lengths, "CompositeExplicitAutograd")
torch.library.register_fake("tdfunc::versions", lib=_LIB)(_lengths)


@torch.library.register_vmap("tdfunc::versions", lib=_LIB)
def _versions_vmap(
    info: object, in_dims: object, tensors: list[Tensor]
) -> tuple[list[Tensor], list[None]]:
    return _lengths(tensors), [None] * len(tensors)


def write_marks(tensors: list[Tensor], storages: list[bool]) -> list[tuple[int, int, bool]]:
    """A mark per tensor that changes when the tensor is written: compare before and after.

    The mark is ``(version, storage identity, still copy-on-write)``. A copy-on-write clone
    stops being one when a kernel asks to write its memory: writes torch records no version
    for, e.g. through ``t.data`` (a separate version counter), show there. Some kernels ask
    without writing (``torch.lstm`` on CPU), so a caller confirms such a change by value.

    Args:
        tensors: the tensors to mark.
        storages: for each tensor, whether its storage identity is part of the mark (sees
            ``t.data = v``; costs a storage lookup).

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> before = write_marks([t], [True])
        >>> _ = t[1:].add_(1)  # a write through a view
        >>> write_marks([t], [True]) != before
        True
        >>> before = write_marks([t], [True])
        >>> t.data = torch.ones(3)
        >>> write_marks([t], [True]) != before
        True
    """
    out: list[tuple[int, int, bool]] = []
    append = out.append
    for t, s in zip(tensors, storages):
        if _is_wrapped(t):
            t = unwrapped(t)
        append((t._version, t.untyped_storage()._cdata if s else 0, is_cow(t)))
    return out


def record_unrecorded_writes() -> None:
    """Make every write of the call so far show in the version counters: eagerly there is
    nothing to do (every in-place kernel moves the real counter, foreach ones included).

    While Dynamo traces, torch's fake tensors record no version for in-place foreach ops
    (torch 2.13: ``torch._foreach_add_`` leaves its fake operands' versions as they were); the
    traced twin (``_twins``) bumps, at trace time, the version of every tensor a traced op's
    schema marks as written (see :func:`bump_written`), so :func:`write_marks` sees those
    writes too.

    Example:
        >>> record_unrecorded_writes()
    """


def _written_arguments(target: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument an op's schemas mark as written (``Tensor(a!)``),
    for a traced node's target: an ``OpOverload``, a packet, or a ``torch`` builtin."""
    schemas: list[Any]
    if isinstance(target, OpOverload):
        schemas = [target._schema]
    elif isinstance(target, OpOverloadPacket):
        schemas = [getattr(target, o)._schema for o in target.overloads()]
    else:
        name = getattr(target, "__name__", None)
        if not isinstance(name, str) or getattr(torch, name, None) is not target:
            return ()
        schemas = operator_schemas("aten::" + name)
    found: dict[tuple[int, str], None] = {}
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                found[(i, arg.name)] = None
    return tuple(found)


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
#: the mark a traced node gets once :func:`bump_written` has counted its writes
_COUNTED = "tdfunc_writes_counted"


def bump_written(graph: torch.fx.Graph) -> None:
    """Bump the version of each example tensor a node of ``graph`` writes, once per node.

    Compile-time code (run by Dynamo's ``comptime`` from the traced twin of
    :func:`record_unrecorded_writes`, never traced itself): for each ``call_function`` node
    not counted yet, the arguments its op's schema marks as written (torch's own alias
    annotations, no list of names) have their example (fake) tensors' version counters
    bumped: of the tensor under the functorch wrappers, the counter :func:`write_marks`
    reads (under ``torch.func.grad``, ``vjp`` or ``vmap`` the example tensor is a wrapper
    whose own counter is another one). An op whose fake kernel already bumped them is bumped
    twice: a write still shows as a change, and an unwritten tensor is never bumped. The
    table of schemas per target is a cache of static facts about torch's operators.

    Example:
        >>> import torch
        >>> g = torch.fx.Graph()
        >>> bump_written(g)
    """
    for node in graph.nodes:
        if node.op != "call_function" or node.meta.get(_COUNTED):
            continue
        node.meta[_COUNTED] = True
        target = node.target
        cached = isinstance(target, Hashable)
        written = _WRITTEN.get(target) if cached else None
        if written is None:
            written = _written_arguments(target)
            if cached:
                _WRITTEN[target] = written
        for i, name in written:
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(name)
            for n in arg if isinstance(arg, (list, tuple)) else (arg,):
                value = n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None
                if isinstance(value, Tensor):
                    # the counter write_marks reads: under torch.func transforms the example
                    # tensor is a functorch wrapper (its own counter is another one)
                    torch.autograd.graph.increment_version(unwrapped(value))


__all__ = ["bump_written", "record_unrecorded_writes", "unwrapped", "write_marks"]
