"""Calling a module on given tensors without writing them, and finding out what it wrote.

:func:`call_with_state` puts a *private copy* of each given tensor into the module's parameter
and buffer slots (a copy-on-write clone: no data is copied unless the module writes it), calls
the module, reads what happened from torch itself, and puts the module's own tensors back,
whatever the call did (also when it raised). What happened is read in two ways, one rule in
every mode (eager, ``torch.compile``, ``torch.vmap``, ``torch.func.grad``, export):

* **writes**: each copy's write mark, before and after the call
  (:func:`~tdfunc.nn._versions.write_marks`): its version counter, which the dispatcher bumps
  on every in-place write to the tensor or any view of it, inside C++ ops, foreach ops and
  ``nn.init`` included, and whether the copy-on-write memory was copied (writes that ops do
  without a version bump: batch norm's running statistics, ``buf.data = v``);
* **rebinding** (``self.count = self.count + 1``: the slot holds another tensor) and
  **state created** while the module runs (a
  buffer registered, a ``None`` buffer assigned): the module's slot dictionaries after the call,
  compared with a snapshot taken before it.

No tensor subclass is wrapped around anything and nothing is patched: the module sees plain
tensors, and its output is whatever it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from ..memmap._tensor import MemoryMappedTensor

_NormBase = nn.modules.batchnorm._NormBase
_NORM_STATISTICS = ("running_mean", "running_var")
_FusedFakeQuantize = torch.ao.quantization.FusedMovingAvgObsFakeQuantize
_FUSED_FQ_STATE = ("scale", "zero_point")
_OBSERVED_RANGE = ("min_val", "max_val")


def _cow_or_copy(t: Tensor, buffer: bool) -> Tensor:
    if buffer or isinstance(t, MemoryMappedTensor):
        return t.clone()
    return torch.ops.aten._lazy_clone(t)


def _no_cow_below(t: Tensor) -> bool:
    """A vmap level or a memory-mapped tensor under ``t``'s wrappers: no copy-on-write."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        if torch._C._functorch.is_batchedtensor(t):
            return True
        t = torch._C._functorch.get_unwrapped(t)
    return isinstance(t, MemoryMappedTensor)


def private_copy(t: Tensor, buffer: bool = False) -> Tensor:
    """A tensor with the value of ``t`` that can be written without writing ``t``.

    Parameters get a copy-on-write clone (nothing is copied unless one of the two is written;
    under ``torch.vmap`` levels, of the tensor under the batched wrappers, wrapped again).
    Buffers (``buffer=True``) and memory-mapped leaves get a copy: torch's copy-on-write cannot
    grow a tensor (``resize_``, which observers do to their buffers) and needs memory torch
    allocated; buffers are small state. Under a ``torch.func.grad`` level above a ``torch.vmap``
    level the copy is a plain clone (copy-on-write has no batching rule).

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> c = private_copy(t)
        >>> _ = c.add_(1)
        >>> t.tolist(), c.tolist()
        ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    """
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return _cow_or_copy(t, buffer)
    levels: list[tuple[int, int]] = []
    base = t
    while torch._C._functorch.is_functorch_wrapped_tensor(base):
        if not torch._C._functorch.is_batchedtensor(base):
            # a differentiated tensor: the copy must stay differentiable; copy-on-write has
            # no batching rule and needs memory torch allocated
            return t.clone() if _no_cow_below(base) else torch.ops.aten._lazy_clone(t)
        levels.append(
            (torch._C._functorch.maybe_get_bdim(base), torch._C._functorch.maybe_get_level(base))
        )
        base = torch._C._functorch.get_unwrapped(base)
    out = _cow_or_copy(base, buffer)
    for bdim, level in reversed(levels):
        out = torch._C._functorch._add_batch_dim(out, bdim, level)
    return out


Slot = tuple[nn.Module, str]


@dataclass
class _Snapshot:
    """Every distinct submodule of a module with the contents of its slot dictionaries."""

    modules: list[tuple[str, nn.Module, dict[str, Tensor | None], dict[str, Tensor | None]]]
    #: ids of the observers of fused fake-quantize modules (see :func:`_undeclared_write`)
    fused_observers: set[int]

    @staticmethod
    def take(module: nn.Module) -> _Snapshot:
        out: list[tuple[str, nn.Module, dict[str, Tensor | None], dict[str, Tensor | None]]] = []
        seen: set[int] = set()
        fused: set[int] = set()

        def walk(m: nn.Module, prefix: str) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            if isinstance(m, _FusedFakeQuantize):
                fused.add(id(m.activation_post_process))
            out.append((prefix, m, dict(m._parameters), dict(m._buffers)))
            for name, sub in m._modules.items():
                if sub is not None:
                    walk(sub, prefix + name + ".")

        walk(module, "")
        return _Snapshot(out, fused)

    def name_of(self, slot: Slot) -> str:
        """A dotted name of ``slot`` (through the first name of its module)."""
        m, attr = slot
        for prefix, mod, _, _ in self.modules:
            if mod is m:
                return prefix + attr
        raise KeyError(attr)

    def slots_by_tensor(self) -> dict[int, list[Slot]]:
        """id of each tensor -> every slot holding it (more than one: tied)."""
        by_id: dict[int, list[Slot]] = {}
        for _, m, params, buffers in self.modules:
            for d in (params, buffers):
                for name, t in d.items():
                    if t is not None:
                        by_id.setdefault(id(t), []).append((m, name))
        return by_id

    def created(self) -> dict[str, Tensor]:
        """Persistent parameters/buffers that hold a tensor now and held none before."""
        new: dict[str, Tensor] = {}
        for prefix, m, params, buffers in self.modules:
            for d, before in ((m._parameters, params), (m._buffers, buffers)):
                if len(d) == len(before) and all(before[k] is not None for k in before):
                    continue
                skip = m._non_persistent_buffers_set if d is m._buffers else ()
                for name, t in d.items():
                    if t is not None and before.get(name) is None and name not in skip:
                        new[prefix + name] = t
        return new

    def restore_created(self) -> None:
        """Take back what the call added: slots created or filled while it ran."""
        for _, m, params, buffers in self.modules:
            for d, before in ((m._parameters, params), (m._buffers, buffers)):
                for name in [k for k in d if k not in before]:
                    del d[name]
                    m._non_persistent_buffers_set.discard(name)
                for name, t in before.items():
                    if t is None and d.get(name) is not None:
                        d[name] = None


def _undeclared_write(where: list[Slot], fused_observers: set[int]) -> bool:
    """A tensor that a torch op writes without declaring it (so without a version bump).

    Two kinds of torch kernels write tensors their schema does not mark as written, so no
    version counter moves (and under ``torch.compile`` nothing else shows it either): batch and
    instance norm update their running statistics, and the fused moving-average fake-quantize
    op its scale, zero point and observed range. These tensors are counted as written whenever
    their module takes part in the call (norms: in training mode with running statistics), in
    every mode alike.
    """
    for m, name in where:
        if name in _NORM_STATISTICS and isinstance(m, _NormBase):
            if m.training and m.track_running_stats:
                return True
        elif (name in _FUSED_FQ_STATE and isinstance(m, _FusedFakeQuantize)) or (
            name in _OBSERVED_RANGE and id(m) in fused_observers
        ):
            return True
    return False


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal values, compared under the functorch wrappers (``torch.equal`` has no batching
    rule): a copy-on-write clone whose memory was copied without being written."""
    while torch._C._functorch.is_functorch_wrapped_tensor(a):
        a = torch._C._functorch.get_unwrapped(a)
    while torch._C._functorch.is_functorch_wrapped_tensor(b):
        b = torch._C._functorch.get_unwrapped(b)
    return torch.equal(a, b)


def _slot_dict(slot: Slot) -> dict[str, Any]:
    m, name = slot
    return m._parameters if name in m._parameters else m._buffers


def call_with_state(
    module: nn.Module,
    tensors: dict[str, Tensor],
    slots: dict[str, Slot],
    args: Any,
    kwargs: dict[str, Any] | None,
    tie_weights: bool,
) -> tuple[Any, dict[str, Tensor], dict[str, Tensor]]:
    """Call ``module`` with private copies of ``tensors`` in its slots; report its writes.

    Args:
        module: the module to call.
        tensors: dotted name -> the tensor to use (never written).
        slots: dotted name -> ``(owner module, attribute name)`` of that name's slot.
        args: positional arguments (a non-tuple value is the only one).
        kwargs: keyword arguments.
        tie_weights: every other slot holding the same module tensor as a named slot gets the
            same copy (tied weights, submodules reachable under two names).

    Returns:
        ``(output, written, created)``: the module's output; for each name whose tensor the
        module wrote in place or rebound, the tensor holding the new value; and the persistent
        parameters/buffers the module created while it ran, by dotted name. The module is left
        exactly as it was (its own tensor objects back in every slot, created ones removed).
    """
    from ._versions import write_marks  # imports torch._dynamo: on first use only

    snapshot = _Snapshot.take(module)
    by_id = snapshot.slots_by_tensor() if tie_weights else {}
    copies: list[Tensor] = []
    # the slots each given name fills, by a dotted name torch's reparametrisation resolves
    targets: list[list[tuple[str, Slot]]] = []
    swap: dict[str, Tensor] = {}
    for name, t in tensors.items():
        slot = slots[name]
        d = _slot_dict(slot)
        own = d[slot[1]]
        c = private_copy(t, d is slot[0]._buffers)
        copies.append(c)
        tied = by_id.get(id(own)) if own is not None else None
        where = [(snapshot.name_of(s), s) for s in tied] if tied else [(name, slot)]
        targets.append(where)
        for dotted, _ in where:
            swap[dotted] = c
    is_buffer = [slots[n][1] in slots[n][0]._buffers for n in tensors]
    before = write_marks(copies, is_buffer)
    if not isinstance(args, tuple):
        args = (args,)
    try:
        # torch's own reparametrisation: put back in the slots (last in, first out) whatever
        # happens, and known to torch.compile (also inside scan/while_loop bodies); ``swap``
        # then holds what each slot held at the end of the call
        with _reparametrize_module(module, swap, stack_weights=True):
            out = module(*args, **(kwargs or {}))
        after = write_marks(copies, is_buffer)
        written: dict[str, Tensor] = {}
        for (name, c), where, m0, m1 in zip(zip(tensors, copies), targets, before, after):
            for dotted, _ in where:
                now = swap[dotted]
                if now is not c and isinstance(now, Tensor):
                    written[name] = now
                    break
            else:
                if (
                    m1[:2] != m0[:2]
                    or (m0[2] and not m1[2] and not _same_values(c, tensors[name]))
                    or _undeclared_write([s for _, s in where], snapshot.fused_observers)
                ):
                    written[name] = c
        created = snapshot.created()
    finally:
        snapshot.restore_created()
    return out, written, created


__all__ = ["call_with_state", "private_copy"]
