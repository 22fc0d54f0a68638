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
with is exact, though: it is bumped by every in-place op traced. What Dynamo traces instead of
:func:`write_marks` (registered in ``_twins``) therefore calls a custom op
(``tdfunc::versions``, defined here), whose fake implementation reports each fake tensor's
version as the static length of an empty ``meta`` tensor: a constant while tracing, no guard, no
graph break. The op's results are never used, so a compiled graph does no work for it. (Dynamo
does not trace ``t.data = v`` on a tensor made inside the compiled function: it stops with its
own error, so the traced marks need no storage identity.)

Nothing here imports ``torch._dynamo``: defining a custom op does not.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._compat import get_unwrapped, is_cow
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


def unverified(is_buffer: list[bool]) -> list[bool]:
    """For each tensor, whether an unchanged :func:`write_marks` may hide a write: never
    eagerly (every in-place kernel moves the real version counter, foreach ones included).

    Example:
        >>> unverified([True, False])
        [False, False]
    """
    return [False] * len(is_buffer)


__all__ = ["unverified", "unwrapped", "write_marks"]
