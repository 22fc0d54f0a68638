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


def _cow_or_copy(t: Tensor) -> Tensor:
    if isinstance(t, MemoryMappedTensor) or t.numel() == 0:
        return t.clone()
    return torch.ops.aten._lazy_clone(t)


def private_copy(t: Tensor) -> Tensor:
    """A tensor with the value of ``t`` that can be written without writing ``t``.

    A copy-on-write clone (nothing is copied unless one of the two is written; under
    ``torch.vmap`` levels, of the tensor under the batched wrappers, wrapped again), except
    where torch's copy-on-write cannot be used, where it is a copy: memory-mapped leaves (it
    needs memory torch allocated), empty tensors (torch's copy-on-write fails when a module
    grows one with ``resize_``, as observers do; copying nothing costs nothing) and tensors
    under a ``torch.func.grad`` level (the copy must stay differentiable, and ``_lazy_clone``
    has no batching rule).

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> c = private_copy(t)
        >>> _ = c.add_(1)
        >>> t.tolist(), c.tolist()
        ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    """
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        return _cow_or_copy(t)
    levels: list[tuple[int, int]] = []
    base = t
    while torch._C._functorch.is_functorch_wrapped_tensor(base):
        if not torch._C._functorch.is_batchedtensor(base):
            return t.clone()
        levels.append(
            (torch._C._functorch.maybe_get_bdim(base), torch._C._functorch.maybe_get_level(base))
        )
        base = torch._C._functorch.get_unwrapped(base)
    out = _cow_or_copy(base)
    for bdim, level in reversed(levels):
        out = torch._C._functorch._add_batch_dim(out, bdim, level)
    return out


Slot = tuple[nn.Module, str]


@dataclass
class _Snapshot:
    """Every distinct submodule of a module with the contents of its slot dictionaries."""

    modules: list[tuple[str, nn.Module, dict[str, Tensor | None], dict[str, Tensor | None]]]

    @staticmethod
    def take(module: nn.Module) -> _Snapshot:
        out: list[tuple[str, nn.Module, dict[str, Tensor | None], dict[str, Tensor | None]]] = []
        seen: set[int] = set()

        def walk(m: nn.Module, prefix: str) -> None:
            if id(m) in seen:
                return
            seen.add(id(m))
            out.append((prefix, m, dict(m._parameters), dict(m._buffers)))
            for name, sub in m._modules.items():
                if sub is not None:
                    walk(sub, prefix + name + ".")

        walk(module, "")
        return _Snapshot(out)

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


def _norm_statistic(where: list[Slot]) -> bool:
    """A running statistic that a batch/instance norm module in training mode updates.

    torch's norm kernels write their running statistics without declaring it in their schema,
    so no version counter moves (and under ``torch.compile`` nothing else shows it either):
    these are counted as written whenever the module runs in training mode with running
    statistics, in every mode alike.
    """
    for m, name in where:
        if (
            name in _NORM_STATISTICS
            and isinstance(m, _NormBase)
            and m.training
            and m.track_running_stats
        ):
            return True
    return False


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
        c = private_copy(t)
        copies.append(c)
        own = _slot_dict(slot)[slot[1]]
        tied = by_id.get(id(own)) if own is not None else None
        where = [(snapshot.name_of(s), s) for s in tied] if tied else [(name, slot)]
        targets.append(where)
        for dotted, _ in where:
            swap[dotted] = c
    before = write_marks(copies)
    if not isinstance(args, tuple):
        args = (args,)
    try:
        # torch's own reparametrisation: put back in the slots (last in, first out) whatever
        # happens, and known to torch.compile (also inside scan/while_loop bodies); ``swap``
        # then holds what each slot held at the end of the call
        with _reparametrize_module(module, swap, stack_weights=True):
            out = module(*args, **(kwargs or {}))
        after = write_marks(copies)
        written: dict[str, Tensor] = {}
        for (name, c), where, m0, m1 in zip(zip(tensors, copies), targets, before, after):
            for dotted, _ in where:
                now = swap[dotted]
                if now is not c and isinstance(now, Tensor):
                    written[name] = now
                    break
            else:
                if m1 != m0 or _norm_statistic([s for _, s in where]):
                    written[name] = c
        created = snapshot.created()
    finally:
        snapshot.restore_created()
    return out, written, created


__all__ = ["call_with_state", "private_copy"]
