"""Calling a module on given tensors without writing them, and finding out what it wrote.

:func:`call_with_state` puts a *private copy* of each given tensor into the module's parameter
and buffer slots (see :func:`private_copy`), calls
the module, reads what happened from torch itself, and puts the module's own tensors back,
whatever the call did (also when it raised). What happened is read in two ways, one rule in
every mode (eager, ``torch.compile``, ``torch.vmap``, ``torch.func.grad``, export):

* **writes**: each copy's write mark, before and after the call
  (:func:`~tdfunc.nn._versions.write_marks`): its version counter, which the dispatcher bumps
  on every in-place write to the tensor or any view of it, inside C++ ops, foreach ops and
  ``nn.init`` included; the storage of a buffer's copy (``buf.data = v``); whether a
  parameter's copy-on-write memory was copied (a write through ``p.data``, confirmed by
  value). Torch kernels that write without recording it at all (norm statistics, fused
  fake-quantize) are listed in :func:`_undeclared_write`;
* **rebinding** (``self.count = self.count + 1``: the slot holds another tensor) and
  **state created** while the module runs (a buffer registered, a ``None`` buffer assigned):
  the module's slot dictionaries after the call, compared with a snapshot taken before it.

No tensor subclass is wrapped around anything and nothing is patched: the module sees plain
tensors, and its output is whatever it returns.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from operator import is_
from typing import Any

import torch
from torch import Tensor, nn

from .._compat import (
    NormBase,
    add_batch_dim,
    get_unwrapped,
    is_alias_of,
    is_batchedtensor,
    lazy_clone,
    maybe_get_bdim,
    maybe_get_level,
)
from .._compat import is_functorch_wrapped_tensor as _is_wrapped
from .._jagged._layout import under_wrappers
from ..memmap._tensor import MemoryMappedTensor
from ._versions import record_unrecorded_writes, unwrapped, write_marks

_NORM_STATISTICS = ("running_mean", "running_var")
_FusedFakeQuantize = torch.ao.quantization.FusedMovingAvgObsFakeQuantize
_FUSED_FQ_STATE = ("scale", "zero_point")
_OBSERVED_RANGE = ("min_val", "max_val")


def _cow_or_copy(t: Tensor, buffer: bool) -> Tensor:
    if buffer or isinstance(t, MemoryMappedTensor):
        return t.clone()
    return lazy_clone(t)


def _no_cow_below(t: Tensor) -> bool:
    """A vmap level or a memory-mapped tensor under ``t``'s wrappers: no copy-on-write."""
    base, mapped, _ = under_wrappers(t)
    return mapped or isinstance(base, MemoryMappedTensor)


def private_copy(t: Tensor, buffer: bool = False) -> Tensor:
    """A tensor with the value of ``t`` that can be written without writing ``t``.

    Parameters get a copy-on-write clone (nothing is copied unless one of the two is written;
    under ``torch.vmap`` levels, of the tensor under the batched wrappers, wrapped again).
    Buffers (``buffer=True``) and memory-mapped leaves get a copy: torch's copy-on-write cannot
    grow a tensor (``resize_``, which observers do to their buffers) and needs memory torch
    allocated; buffers are small state. Where a ``torch.func.grad`` level and a ``torch.vmap``
    level meet (either one outside) the copy is a plain clone (copy-on-write has no batching
    rule).

    Example:
        >>> import torch
        >>> t = torch.zeros(3)
        >>> c = private_copy(t)
        >>> _ = c.add_(1)
        >>> t.tolist(), c.tolist()
        ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    """
    if not _is_wrapped(t):
        return _cow_or_copy(t, buffer)
    levels: list[tuple[int, int]] = []
    base = t
    while _is_wrapped(base):
        if not is_batchedtensor(base):
            # a differentiated tensor: the copy must stay differentiable; a buffer gets a
            # copy (as outside the transform: copy-on-write cannot grow); copy-on-write has
            # no batching rule (a vmap level above this one, or below it) and needs memory
            # torch allocated
            return t.clone() if buffer or levels or _no_cow_below(base) else lazy_clone(t)
        levels.append((maybe_get_bdim(base), maybe_get_level(base)))
        base = get_unwrapped(base)
    out = _cow_or_copy(base, buffer)
    for bdim, level in reversed(levels):
        out = add_batch_dim(out, bdim, level)
    return out


class _CopiesOnWrite(torch.autograd.Function):
    """Copy-on-write clones of tensors that require grad, made as one autograd node.

    The copies are what :func:`private_copy` gives a plain parameter (``aten._lazy_clone``),
    and, like the clone recorded by autograd, not leaves (a module may write them in place
    with grad enabled) and not views; the gradient of each copy goes to its tensor as it is.
    One node with N outputs instead of N clone nodes: the engine runs one node in the
    backward pass, and the forward makes one call (measured on torch 2.13 CPU, 48 tensors:
    about 1.5 us less per tensor and step, forward and backward together).
    """

    @staticmethod
    def forward(ctx: Any, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused copy passes None on, not zeros
        return tuple([lazy_clone(t) for t in tensors])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return grads


#: the types :func:`private_copies` copies in one node: a plain tensor (a ``detach()``, as
#: the leaves ``tdfunc.value_and_grad`` differentiates, or a computed tensor) or a parameter
_PLAIN = (Tensor, nn.Parameter)


def private_copies(tensors: list[Tensor], buffers: list[bool]) -> list[Tensor]:
    """:func:`private_copy` of each tensor (``buffers``: whether each one is a buffer).

    With grad enabled, the parameters that are plain strided tensors requiring grad, outside
    any ``torch.func`` transform (the leaves :func:`tdfunc.value_and_grad` differentiates,
    a module's own parameters, anything computed from them) are copied together as one
    autograd node (:class:`_CopiesOnWrite`): the same copies, one backward node for all.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> [c.tolist() for c in private_copies([t, t], [False, True])]
        [[0.0, 0.0], [0.0, 0.0]]
        >>> w = torch.ones(2, requires_grad=True).view_as(torch.ones(2))
        >>> a, b = private_copies([w, w * 2], [False, False])
        >>> a.grad_fn is b.grad_fn, a.tolist(), b.tolist()
        (True, [1.0, 1.0], [2.0, 2.0])
    """
    if torch.is_grad_enabled():
        together = [i for i, (t, b) in enumerate(zip(tensors, buffers)) if _together(t, b)]
        if len(together) > 1:
            out: list[Tensor] = list(tensors)
            for i, c in zip(together, _CopiesOnWrite.apply(*[tensors[i] for i in together])):
                out[i] = c
            for i in set(range(len(tensors))).difference(together):
                out[i] = private_copy(tensors[i], buffers[i])
            return out
    return [
        private_copy(t, b)
        if b or _is_wrapped(t) or isinstance(t, MemoryMappedTensor)
        else lazy_clone(t)
        for t, b in zip(tensors, buffers)
    ]


def _together(t: Tensor, buffer: bool) -> bool:
    """A parameter :func:`private_copies` copies in the one node: a plain strided tensor
    that requires grad, outside any ``torch.func`` transform (what :func:`private_copy`
    copies with ``aten._lazy_clone``)."""
    return (
        not buffer
        and t.requires_grad
        and type(t) in _PLAIN
        and t.layout == torch.strided
        and not _is_wrapped(t)
    )


Slot = tuple[nn.Module, str]


class _Snapshot:
    """Every distinct submodule of a module, with what is needed to see state created in it."""

    __slots__ = (
        "any_none",
        "by_id",
        "fused",
        "fused_observers",
        "modules",
        "norms",
        "prefixes",
        "sizes",
    )

    def __init__(self) -> None:
        #: (first dotted prefix, module, number of parameter slots, of buffer slots, names of
        #: the slots holding None) per distinct submodule, in walk order (the root first)
        self.modules: list[tuple[str, nn.Module, int, int, tuple[str, ...]]] = []
        #: id of each submodule -> its first dotted prefix
        self.prefixes: dict[int, str] = {}
        #: id of each tensor held in more than one slot -> those slots (with tie_weights)
        self.by_id: dict[int, list[Slot]] = {}
        #: ids of the observers of fused fake-quantize modules (see :func:`_undeclared_write`)
        self.fused_observers: set[int] = set()
        #: the batch/instance norm modules (they write without recording it in training mode)
        self.norms: list[nn.Module] = []
        #: a fused fake-quantize module takes part (it always writes without recording it)
        self.fused = False
        #: the lengths of the ``_parameters`` and ``_buffers`` of each module of ``modules``,
        #: in that order; whether a slot held None
        self.sizes: list[int] = []
        self.any_none = False

    @classmethod
    def walk(cls, module: nn.Module, tie_weights: bool) -> _Snapshot:
        """Walk ``module``: every distinct submodule once, under its first name."""
        self = cls()
        prefixes, modules = self.prefixes, self.modules
        ids: set[int] = set()
        count = 0
        todo: list[tuple[str, nn.Module]] = [("", module)]
        while todo:
            prefix, m = todo.pop()
            if id(m) in prefixes:
                continue
            prefixes[id(m)] = prefix
            params, buffers = m._parameters, m._buffers
            nones: tuple[str, ...] = ()
            for d in (params, buffers):
                for name, t in d.items():
                    if t is None:
                        nones += (name,)
                    else:
                        ids.add(id(t))
                        count += 1
            modules.append((prefix, m, len(params), len(buffers), nones))
            self.sizes += (len(params), len(buffers))
            self.any_none = self.any_none or bool(nones)
            if isinstance(m, NormBase):
                self.norms.append(m)
            elif isinstance(m, _FusedFakeQuantize):
                self.fused = True
                self.fused_observers.add(id(m.activation_post_process))
            subs = m._modules
            if subs:
                # reversed: popped in definition order (the first name of a shared submodule)
                for name, sub in reversed(subs.items()):
                    if sub is not None:
                        todo.append((prefix + name + ".", sub))
        if tie_weights and len(ids) != count:  # a tensor in two slots: list them
            for _, m, _, _, _ in modules:
                for d in (m._parameters, m._buffers):
                    for name, t in d.items():
                        if t is not None:
                            self.by_id.setdefault(id(t), []).append((m, name))
        return self

    def writers(self) -> bool:
        """A module whose kernels write without recording it takes part (read now: norms
        write their statistics in training mode only)."""
        return self.fused or any(m.training and m.track_running_stats for m in self.norms)

    def name_of(self, slot: Slot) -> str:
        """A dotted name of ``slot`` (through the first name of its module)."""
        return self.prefixes[id(slot[0])] + slot[1]

    def added(self) -> list[tuple[str, nn.Module, dict[str, Any], str]]:
        """The slots added (appended: dicts keep insertion order) or filled since the walk."""
        out: list[tuple[str, nn.Module, dict[str, Any], str]] = []
        if not self.any_none and self.sizes == [
            len(d) for _, m, _, _, _ in self.modules for d in (m._parameters, m._buffers)
        ]:
            return out  # no slot more than at the walk, none to fill
        for prefix, m, n_params, n_buffers, nones in self.modules:
            p, b = m._parameters, m._buffers
            if len(p) > n_params:
                out += [(prefix, m, p, k) for k in list(p)[n_params:]]
            if len(b) > n_buffers:
                out += [(prefix, m, b, k) for k in list(b)[n_buffers:]]
            for k in nones:
                for d in (m._parameters, m._buffers):
                    if d.get(k) is not None:
                        out.append((prefix, m, d, k))
        return out

    def created(self, added: list[tuple[str, nn.Module, dict[str, Any], str]]) -> dict[str, Tensor]:
        """Persistent parameters/buffers that hold a tensor now and held none before
        (``added``: :meth:`added` now)."""
        return {
            prefix + k: d[k]
            for prefix, m, d, k in added
            if d[k] is not None and (d is m._parameters or k not in m._non_persistent_buffers_set)
        }

    def restore_created(self, added: list[tuple[str, nn.Module, dict[str, Any], str]]) -> None:
        """Take back what the call added: slots created or filled while it ran (``added``:
        :meth:`added` now)."""
        for _, m, d, k in added:
            if k in self._nones_of(m):
                d[k] = None
            else:
                del d[k]
                m._non_persistent_buffers_set.discard(k)

    def _nones_of(self, m: nn.Module) -> tuple[str, ...]:
        for _, mod, _, _, nones in self.modules:
            if mod is m:
                return nones
        return ()


class _Swapped:
    """The context manager of :func:`swapped` (a class: cheaper to enter than a generator)."""

    __slots__ = ("saved", "swap", "targets")

    def __init__(self, swap: dict[str, Tensor], targets: list[tuple[dict[str, Any], str]]) -> None:
        self.swap, self.targets = swap, targets
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        saved = self.saved
        for (d, attr), t in zip(self.targets, self.swap.values()):
            saved.append(d[attr])
            d[attr] = t

    def __exit__(self, *exc: object) -> None:
        swap, targets, saved = self.swap, self.targets, self.saved
        for name, (d, attr) in zip(swap, targets):
            swap[name] = d[attr]
        for (d, attr), old in zip(reversed(targets), reversed(saved)):
            d[attr] = old


def swapped(
    module: nn.Module, swap: dict[str, Tensor], targets: list[tuple[dict[str, Any], str]]
) -> AbstractContextManager[None]:
    """Put ``swap``'s tensors into ``targets`` (one per dotted name) while the block runs.

    ``targets`` gives, per name of ``swap``, the slot dictionary (a module's ``_parameters``
    or ``_buffers``) and the attribute name. The module's own tensors are put back afterwards
    (last in, first out), whatever happens, and ``swap`` then holds what each slot held at the
    end of the block (a rebound tensor). Under ``torch.compile`` this is torch's own
    reparametrisation (see ``_twins``), which Dynamo knows, also inside ``scan``/``while_loop``
    bodies.

    Example:
        >>> import torch
        >>> lin = torch.nn.Linear(2, 2)
        >>> own, new = lin.weight, {"weight": torch.zeros(2, 2)}
        >>> with swapped(lin, new, [(lin._parameters, "weight")]):
        ...     lin(torch.ones(1, 2)).tolist() == [lin.bias.tolist()]
        True
        >>> lin.weight is own
        True
    """
    return _Swapped(swap, targets)


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
        if name in _NORM_STATISTICS and isinstance(m, NormBase):
            if m.training and m.track_running_stats:
                return True
        elif (name in _FUSED_FQ_STATE and isinstance(m, _FusedFakeQuantize)) or (
            name in _OBSERVED_RANGE and id(m) in fused_observers
        ):
            return True
    return False


def _same_mark(m0: tuple[int, int, bool], m1: tuple[int, int, bool]) -> bool:
    """Whether two write marks say "not written". A storage identity of 0 is unknown (the
    traced reader's marks carry none): a graph break can put the mark taken before the call
    in a traced frame and the one after it in an eager frame, so storages are compared only
    when both marks have one (the caller confirms such a mixed pair by value)."""
    return m0[0] == m1[0] and m0[2] == m1[2] and (not m0[1] or not m1[1] or m0[1] == m1[1])


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal values, compared under the functorch wrappers (``torch.equal`` has no batching
    rule): a copy-on-write clone whose memory was copied without being written."""
    return torch.equal(unwrapped(a), unwrapped(b))


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are one tensor: the same object, or aliases with the same geometry (as
    ``state_dict()`` gives for tied weights: one detached alias per name)."""
    return a is b or (
        is_alias_of(a, b)
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.dtype == b.dtype
    )


class Prepared:
    """Where each given tensor goes: what :func:`call_with_state` needs besides the tensors.

    Built from the module's slots for one set of names (:meth:`build`); ``tdfunc.nn._plan``
    keeps it between calls (without holding the module) and validates it on every use.
    """

    __slots__ = (
        "is_buffer",
        "names",
        "slots",
        "snapshot",
        "swap_names",
        "swap_src",
        "swap_to",
        "tied",
        "where",
    )

    def __init__(
        self,
        snapshot: _Snapshot,
        names: list[str],
        slots: list[Slot],
        is_buffer: list[bool],
        where: list[list[tuple[str, Slot]] | None],
        swap: tuple[list[str], list[tuple[dict[str, Any], str]], list[int]],
    ) -> None:
        self.snapshot = snapshot
        #: the given names, in the order of the tensors, and the slot each one names
        self.names, self.slots, self.is_buffer = names, slots, is_buffer
        #: per name, every ``(dotted name, slot)`` it fills when that is more than its own
        #: slot (tied weights, submodules reachable under two names); None otherwise
        self.where = where
        #: the slots filled, by one dotted name each: the slot dictionary (``_parameters`` or
        #: ``_buffers`` of its module) and attribute of each, and the index of the tensor put
        #: there
        self.swap_names, self.swap_to, self.swap_src = swap
        #: some name fills more than its own slot (``swap_src`` is not ``0, 1, 2...``)
        self.tied = where.count(None) != len(where)

    @classmethod
    def build(
        cls,
        module: nn.Module,
        names: list[str],
        slots: dict[str, Slot],
        tie_weights: bool,
        extra: dict[str, list[Slot]] | None = None,
    ) -> Prepared:
        """Walk ``module`` and resolve every name's slots (``slots``: name -> its own slot).

        Args:
            module: the module to call.
            names: the given names, in the order of the tensors.
            slots: dotted name -> ``(owner module, attribute name)`` of that name's slot.
            tie_weights: every other slot holding the same module tensor as a named slot gets
                the same copy (tied weights, submodules reachable under two names).
            extra: name -> more slots its tensor fills (meta slots of a declared tie).
        """
        snapshot = _Snapshot.walk(module, tie_weights)
        by_id = snapshot.by_id
        own: list[Slot] = []
        is_buffer: list[bool] = []
        where: list[list[tuple[str, Slot]] | None] = []
        swap_names: list[str] = []
        swap_to: list[tuple[dict[str, Any], str]] = []
        swap_src: list[int] = []
        for i, name in enumerate(names):
            slot = slots[name]
            m, attr = slot
            params = m._parameters
            buffer = attr not in params
            own.append(slot)
            is_buffer.append(buffer)
            tied = by_id.get(id((m._buffers if buffer else params)[attr])) if by_id else None
            more = extra.get(name) if extra else None
            if (tied is not None and len(tied) > 1) or more:
                mine = tied if tied is not None and len(tied) > 1 else [slot]
                targets = [(snapshot.name_of(s), s) for s in [*mine, *(more or ())]]
                where.append(targets)
                for dotted, (sm, sa) in targets:
                    swap_names.append(dotted)
                    swap_to.append((sm._parameters if sa in sm._parameters else sm._buffers, sa))
                    swap_src.append(i)
            else:
                where.append(None)
                swap_names.append(name)
                swap_to.append((m._buffers if buffer else params, attr))
                swap_src.append(i)
        return cls(snapshot, names, own, is_buffer, where, (swap_names, swap_to, swap_src))


def call_with_state(
    module: nn.Module,
    prepared: Prepared,
    tensors: list[Tensor],
    args: Any,
    kwargs: dict[str, Any] | None,
) -> tuple[Any, dict[str, Tensor], dict[str, Tensor]]:
    """Call ``module`` with private copies of ``tensors`` in its slots; report its writes.

    Args:
        module: the module to call.
        prepared: where each tensor goes (:meth:`Prepared.build`, for the module as it is now).
        tensors: the tensors to use, one per name of ``prepared`` (never written).
        args: positional arguments (a non-tuple value is the only one).
        kwargs: keyword arguments.

    Returns:
        ``(output, written, created)``: the module's output; for each name whose tensor the
        module wrote in place or rebound, the tensor holding the new value; and the persistent
        parameters/buffers the module created while it ran, by dotted name. The module is left exactly as it was (its own tensor objects back in every
        slot, created ones removed).
    """
    snapshot = prepared.snapshot
    writers = snapshot.writers()
    is_buffer = prepared.is_buffer
    copies = private_copies(tensors, is_buffer)
    placed = [copies[i] for i in prepared.swap_src] if prepared.tied else copies
    swap = dict(zip(prepared.swap_names, placed))
    before = write_marks(copies, is_buffer)
    if not isinstance(args, tuple):
        args = (args,)
    try:
        with swapped(module, swap, prepared.swap_to):
            out = module(*args, **(kwargs or {}))
        record_unrecorded_writes()
        after = write_marks(copies, is_buffer)
        written: dict[str, Tensor] = {}
        # all marks the same, each copy still in its one slot: nothing written (else per name)
        same = (
            before == after
            and not (writers or prepared.tied)
            and all(map(is_, swap.values(), placed))
        )
        for name, slot, targets, t, c, m0, m1 in (
            zip(prepared.names, prepared.slots, prepared.where, tensors, copies, before, after)
            if not same
            else ()
        ):
            if m0 == m1 and targets is None and not writers and swap[name] is c:
                continue  # the same mark, the same tensor in its one slot: nothing written
            where = targets or [(name, slot)]
            for dotted, _ in where:
                now = swap[dotted]
                if now is not c and isinstance(now, Tensor):
                    written[name] = now
                    break
            else:
                unchanged = _same_mark(m0, m1)
                if unchanged and m1[1] and not m0[1]:
                    # the mark before the call was read in a traced frame (no storage), the
                    # one after it eagerly: a rebinding (buf.data = v) shows in the values
                    unchanged = _same_values(c, t)
                if unchanged:
                    if writers and _undeclared_write(
                        [s for _, s in where], snapshot.fused_observers
                    ):
                        written[name] = c
                elif (
                    m1[0] != m0[0]
                    or (m0[1] and m1[1] and m1[1] != m0[1])
                    # the copy-on-write memory was copied: written if the values differ
                    or (not m1[2] and not _same_values(c, t))
                    or (
                        writers
                        and _undeclared_write([s for _, s in where], snapshot.fused_observers)
                    )
                ):
                    written[name] = c
    finally:
        added = snapshot.added()
        created = snapshot.created(added)
        snapshot.restore_created(added)
    return out, written, created


__all__ = ["Prepared", "call_with_state", "private_copy", "same_tensor"]
