"""Has a tensor been written? Read from torch, eagerly and under ``torch.compile``.

Two records that torch keeps, combined in one number per tensor by :func:`write_marks`:

* the version counter, which the dispatcher bumps on every in-place write to the tensor or to
  any of its views, including writes inside C++ ops (``F.embedding(..., max_norm=...)``),
  foreach ops and ``nn.init``; under ``torch.vmap`` / ``torch.func.grad``, the counter of the
  tensor under the functorch wrappers (a batched wrapper's own counter does not move);
* whether a copy-on-write clone still shares its memory: torch copies the memory the first
  time a kernel asks to write it. This also sees the writes that ops do without declaring them
  in their schema, so without a version bump: the running statistics of batch and instance
  norm (eagerly, also under ``torch.vmap``), and ``t.data = v``.

Under ``torch.compile`` Dynamo turns ``t._version`` into an unbacked symbolic integer, so
"did it change" would be a data-dependent branch. The counter of the fake tensor Dynamo traces
with is exact, though: it is bumped by every in-place op traced. :func:`write_marks` is therefore
registered with ``torch._dynamo.substitute_in_graph``, and Dynamo traces a custom op
(``tdfunc::versions``) instead, whose fake implementation reports each fake tensor's version as
the static length of an empty ``meta`` tensor: a constant while tracing, no guard, no graph
break. The op's results are never used, so a compiled graph does no work for it.

This module imports ``torch._dynamo`` (about a second), so it is imported on first use, from
inside :func:`tdfunc.functional_call` (also when Dynamo traces that call: the import itself
runs for real, before the call to :func:`write_marks` is traced).
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch import Tensor

from ..memmap._tensor import MemoryMappedTensor
from ._state import private_copy

_LIB = torch.library.Library("tdfunc", "FRAGMENT")
_LIB.define("versions(Tensor[] tensors) -> Tensor[]")


def _base(t: Tensor) -> Tensor:
    """The tensor under ``t``'s functorch wrappers (``t`` itself outside any transform)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _mark(t: Tensor) -> int:
    base = _base(t)
    return 2 * base._version + (0 if torch._C._is_cow_tensor(base) else 1)  # type: ignore[attr-defined]


def _as_lengths(tensors: list[Tensor]) -> list[Tensor]:
    return [torch.empty((_mark(t),), device="meta") for t in tensors]


_LIB.impl("versions", _as_lengths, "CompositeExplicitAutograd")
torch.library.register_fake("tdfunc::versions", lib=_LIB)(_as_lengths)


@torch.library.register_vmap("tdfunc::versions", lib=_LIB)
def _versions_vmap(
    info: object, in_dims: object, tensors: list[Tensor]
) -> tuple[list[Tensor], list[None]]:
    return _as_lengths(tensors), [None] * len(tensors)


def write_marks(tensors: list[Tensor]) -> list[int]:
    """A number per tensor that changes whenever the tensor's data is written.

    Twice the version counter, plus one once the tensor does not share copy-on-write memory
    (any more). Compare the marks taken before and after a call.

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> before = write_marks([t])
        >>> _ = t[1:].add_(1)  # a write through a view
        >>> write_marks([t]) != before
        True
    """
    return [_mark(t) for t in tensors]


@torch._dynamo.substitute_in_graph(private_copy)
def _traced_private_copy(t: Tensor) -> Tensor:
    # Dynamo cannot look under functorch wrappers; a compiled graph is functional anyway
    # (every copy is a clone there), so only what is cheapest to trace matters here
    if torch._C._functorch.is_batchedtensor(t) or isinstance(t, MemoryMappedTensor):
        return t.clone()
    return torch.ops.aten._lazy_clone(t)


@torch._dynamo.substitute_in_graph(write_marks)
def _traced_write_marks(tensors: list[Tensor]) -> list[int]:
    return [o.shape[0] for o in torch.ops.tdfunc.versions(tensors)]


__all__ = ["write_marks"]
