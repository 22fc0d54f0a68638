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
with is exact, though: it is bumped by every in-place op traced. :func:`write_marks` is therefore
registered with ``torch._dynamo.substitute_in_graph``, and Dynamo traces a custom op
(``tdfunc::versions``) instead, whose fake implementation reports each fake tensor's version as
the static length of an empty ``meta`` tensor: a constant while tracing, no guard, no graph
break. The op's results are never used, so a compiled graph does no work for it. (Dynamo does
not trace ``t.data = v`` on a tensor made inside the compiled function: it stops with its own
error, so the traced marks need no storage identity.)

This module imports ``torch._dynamo`` (about a second), so it is imported on first use, from
inside :func:`tdfunc.functional_call` (also when Dynamo traces that call: the import itself
runs for real, before the call to :func:`write_marks` is traced).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor

from .._compat import is_cow, reparametrize_module
from ._state import Slot, _is_wrapped, private_copy, swapped, unwrapped


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
    out = []
    for t, s in zip(tensors, storages):
        if _is_wrapped(t):
            t = unwrapped(t)
        out.append((t._version, t.untyped_storage()._cdata if s else 0, is_cow(t)))
    return out


@torch.compiler.substitute_in_graph(write_marks)
def _traced_write_marks(tensors: list[Tensor], storages: list[bool]) -> list[tuple[int, int, bool]]:
    # fake tensors have no copy-on-write memory and no storage to swap (see above)
    return [(o.shape[0], 0, False) for o in torch.ops.tdfunc.versions(tensors)]


def unverified(is_buffer: list[bool]) -> list[bool]:
    """For each tensor, whether an unchanged :func:`write_marks` may hide a write: never
    eagerly (every in-place kernel moves the real version counter, foreach ones included).

    Example:
        >>> unverified([True, False])
        [False, False]
    """
    return [False] * len(is_buffer)


@torch.compiler.substitute_in_graph(unverified)
def _traced_unverified(is_buffer: list[bool]) -> list[bool]:
    # fake tensors record no version for in-place foreach ops (torch 2.13-2.15: a buffer
    # updated with torch._foreach_lerp_ keeps its version while Dynamo traces): a buffer's
    # unchanged mark proves nothing there; the caller checks its values instead
    return list(is_buffer)


@torch.compiler.substitute_in_graph(private_copy)
def _traced_private_copy(t: Tensor, buffer: bool = False) -> Tensor:
    # A compiled graph is functional: a copy is a clone there, whatever it is eagerly, and
    # inductor removes the clones nothing writes (``aten._lazy_clone`` would stay an op call)
    return t.clone()


@torch.compiler.substitute_in_graph(swapped)  # type: ignore[arg-type]
def _traced_swapped(
    module: torch.nn.Module, swap: dict[str, Tensor], slots: list[Slot]
) -> AbstractContextManager[None]:
    # torch's reparametrisation: Dynamo lets it mutate the module inside higher-order ops
    return reparametrize_module(module, swap, stack_weights=True)


__all__ = ["unverified", "write_marks"]
