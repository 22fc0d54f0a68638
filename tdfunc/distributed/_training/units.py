"""Gathering sharded parameters unit by unit in the eager sharded step (FSDP's schedule).

With ``sharded_step(..., units=[...])`` the eager step does not gather the whole model before
the forward. ``loss_fn`` gets a container whose sharded leaves are *placeholders*
(:class:`Placeholder`): tensors with the full parameter's shape and dtype and no values. The
first torch operation that reads one gathers its whole unit (the leaves under one key prefix:
one all-gather per bucket) and runs on the full values; when the forward moves on to another
unit, the gathered one is let go. Autograd would keep every full parameter alive until the
backward (it saves them, or views of them, for the gradient): a saved-tensor hook stores a
recipe instead (which unit, which view), and the backward gathers the unit again when it
needs it. Each unit's gradients are reduce-scattered as soon as the backward has finished
with the unit (the backward of the gather), so the full gradients of one unit live at a time.

Peak memory per rank is then the shards, the optimizer state, the activations and about one
unit of full parameters and gradients, as with FSDP2's ``fully_shard`` per block. The
bytes moved are FSDP2's too: each unit is gathered twice (forward and backward).

This runs on plain autograd (``torch.autograd.grad``), not ``torch.func.grad``: functorch
refuses saved-tensor hooks. It is the eager schedule; with ``compile=True`` the step compiles
the loss of the shards instead (``step.py``: ``_loss_of_shards``), and AOTAutograd's
partitioner recomputes the gathers in the backward.

Rules the forward must keep, as with FSDP:

* every rank uses the units in the same order (the gathers are collectives);
* it does not write a parameter in place (a placeholder refuses it with a ``TypeError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..._compat import DisableTorchFunctionSubclass, lazy_clone, make_subclass
from ..._keys import KeyPath, fmt_key
from .._common import errors as E

OP = "sharded_step"

#: tensor properties a placeholder answers from its own metadata (no values needed)
_META_PROPS = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "requires_grad",
        "is_leaf",
        "grad_fn",
        "grad",
        "_version",
        "ndim",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "is_mkldnn",
        "itemsize",
        "_base",
        "output_nr",
        "names",
        "_cdata",
    }
)
#: tensor methods a placeholder answers from its own metadata
_META_METHODS = frozenset(
    getattr(Tensor, name)
    for name in (
        "size",
        "dim",
        "ndimension",
        "numel",
        "nelement",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "get_device",
        "untyped_storage",
        "__len__",
    )
)
#: copies: a copy of a placeholder is a placeholder of the same leaf (``functional_call``'s
#: private copies are made before the module runs and must not gather)
_COPIES = frozenset({lazy_clone, torch.clone, Tensor.clone, Tensor.detach, torch.detach})


class Placeholder(Tensor):
    """A sharded parameter in the unit-by-unit step: the full parameter's shape and dtype,
    no values; the first torch operation that reads it gathers its unit (see the module).

    Example:
        >>> import torch
        >>> p = Placeholder.make(torch.Size([2, 3]), torch.float32, torch.device("cpu"), None, 0)
        >>> p.shape, p.dtype
        (torch.Size([2, 3]), torch.float32)
    """

    _units: Any
    _leaf: int

    @staticmethod
    def make(
        shape: torch.Size, dtype: torch.dtype, device: torch.device, units: Any, leaf: int
    ) -> Placeholder:
        """A placeholder of this shape and dtype for leaf ``leaf`` of ``units`` (a
        :class:`UnitGather`): one element of memory, seen with stride 0."""
        base = torch.empty((), dtype=dtype, device=device).expand(shape)
        out: Placeholder = make_subclass(Placeholder, base, False)
        out._units, out._leaf = units, leaf
        return out

    @property
    def _key(self) -> str:
        units = self._units
        return units.keys[self._leaf] if units is not None else str(self._leaf)

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _META_METHODS or _is_meta_property(func):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _COPIES and isinstance(args[0], Placeholder):
            p = args[0]
            with DisableTorchFunctionSubclass():
                shape, dtype, device = p.shape, p.dtype, p.device
            return Placeholder.make(shape, dtype, device, p._units, p._leaf)
        name = getattr(func, "__name__", "")
        written = _first_placeholder([args[0]] if args else [])
        # (``x += y`` arrives as ``add_``; torch turns this TypeError into NotImplemented
        # there, and Python then computes ``x = x + y``: a new tensor, the parameter unwritten)
        if written is not None and name.endswith("_") and not name.endswith("__"):
            raise TypeError(E.STEP_UNIT_WRITE.format(op=OP, key=written._key, fn=name))
        if name in {"__setitem__", "__set__"} and written is not None:
            raise TypeError(E.STEP_UNIT_WRITE.format(op=OP, key=written._key, fn=name))
        out = kwargs.get("out")
        if (
            out is not None
            and _first_placeholder(out if isinstance(out, (list, tuple)) else [out]) is not None
        ):
            raise TypeError(E.STEP_UNIT_WRITE.format(op=OP, key=_placeholder_key(out), fn=name))
        args = [_full(a) for a in args]
        kwargs = {k: _full(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        with DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype
        return f"Placeholder({self._key}, shape={shape}, dtype={dtype})"


def _is_meta_property(func: Any) -> bool:
    """Whether ``func`` is the getter of a tensor property in :data:`_META_PROPS`."""
    if getattr(func, "__name__", None) != "__get__":
        return False
    return getattr(getattr(func, "__self__", None), "__name__", None) in _META_PROPS


def _first_placeholder(xs: Sequence[Any]) -> Placeholder | None:
    for x in xs:
        if isinstance(x, Placeholder):
            return x
    return None


def _placeholder_key(out: Any) -> str:
    xs = out if isinstance(out, (list, tuple)) else [out]
    p = _first_placeholder(xs)
    return p._key if p is not None else "?"


def _full(x: Any) -> Any:
    """``x`` with placeholders (also inside lists and tuples) replaced by their full values."""
    if isinstance(x, Placeholder):
        return x._units.full(x._leaf)
    if isinstance(x, (list, tuple)) and any(isinstance(y, Placeholder) for y in x):
        return type(x)(_full(y) for y in x)
    return x


class _Saved:
    """What a saved-tensor hook keeps for a view of a gathered parameter: its unit, the
    leaf whose storage it views and the view itself (the unit is gathered again to unpack)."""

    __slots__ = ("leaf", "offset", "size", "stride", "unit")

    def __init__(self, unit: int, leaf: int, size: Any, stride: Any, offset: int) -> None:
        self.unit, self.leaf, self.size, self.stride, self.offset = unit, leaf, size, stride, offset


class _GatherUnit(torch.autograd.Function):
    """Forward: the full values of one unit's sharded leaves (all-gathers). Backward: their
    gradients reduced and scattered back to this rank's rows (reduce-scatters). (The
    ``setup_context`` form: torch.func transforms accept it, e.g. a forward under
    ``torch.vmap``.)"""

    generate_vmap_rule = True

    @staticmethod
    def forward(units: UnitGather, unit: int, *local: Tensor) -> tuple[Tensor, ...]:
        return tuple(units.gather(unit))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.units, ctx.unit = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        units: UnitGather = ctx.units
        units.release_backward(ctx.unit)  # the backward is done with this unit's parameters
        return (None, None, *units.scatter(ctx.unit, list(grads)))


class UnitGather:
    """The per-call state of the unit-by-unit step: which unit is gathered now (forward and
    backward), and the saved-tensor hooks.

    Args:
        gather: ``gather(leaves) -> full values`` of sharded leaf positions (collectives).
        scatter: ``scatter(leaves, full grads) -> local grads`` (collectives).
        unit_of: the unit of each leaf (``-1``: not gathered, a replicated leaf).
        local: the local shards, requiring grad (the leaves of the differentiation).
        keys: each leaf's key, for error messages.
        pinned_unit: a unit gathered once on first use and kept until the step ends (autograd
            saves its full values as they are): the leaves under no prefix, as FSDP2 keeps
            the root module's parameters.
    """

    def __init__(
        self,
        gather: Callable[[list[int]], list[Tensor]],
        scatter: Callable[[list[int], list[Tensor]], list[Tensor]],
        unit_of: Sequence[int],
        local: list[Tensor],
        keys: list[str],
        pinned_unit: int | None = None,
    ) -> None:
        self._gather, self._scatter, self.local, self.keys = gather, scatter, local, keys
        self.pinned_unit = pinned_unit
        #: the full values of the pinned unit, by leaf (once gathered), and whether they
        #: were gathered with grad on
        self.pinned: dict[int, Tensor] = {}
        self.pinned_grad = False
        self.unit_of = unit_of
        members: dict[int, list[int]] = {}
        for i, u in enumerate(unit_of):
            if u >= 0:
                members.setdefault(u, []).append(i)
        #: the leaf positions of each unit, in order
        self.members = members
        #: the unit gathered for the forward now, and its full values by leaf
        self.unit: int | None = None
        self.values: dict[int, Tensor] = {}
        self.values_grad = False
        #: storage of each gathered leaf of the current forward unit -> (unit, leaf, offset)
        self.storages: dict[int, tuple[int, int, int]] = {}
        #: the unit gathered again for the backward, and its full values by leaf
        self.back_unit: int | None = None
        self.back: dict[int, Tensor] = {}
        #: how many times units were gathered (forward, backward)
        self.gathers = [0, 0]

    # ----------------------------------------------------------------- forward
    def full(self, leaf: int) -> Tensor:
        """The full value of ``leaf`` for the forward (its unit gathered if it is not)."""
        unit = self.unit_of[leaf]
        # values gathered while grad was off (a part of the forward under no_grad) carry no
        # gradient: gathered again when a use needs one
        grad = torch.is_grad_enabled()
        if unit == self.pinned_unit:  # gathered once, kept for the whole step
            if leaf not in self.pinned or (grad and not self.pinned_grad):
                ix = self.members[unit]
                got = _GatherUnit.apply(self, unit, *[self.local[i] for i in ix])
                self.pinned, self.pinned_grad = dict(zip(ix, got)), grad
                self.gathers[0] += 1
            return self.pinned[leaf]
        if unit != self.unit or (grad and not self.values_grad):
            self.release_forward()
            ix = self.members[unit]
            got = _GatherUnit.apply(self, unit, *[self.local[i] for i in ix])
            self.unit, self.values, self.values_grad = unit, dict(zip(ix, got)), grad
            for i, t in self.values.items():
                self.storages.setdefault(_storage(t), (unit, i, int(t.storage_offset())))
            self.gathers[0] += 1
        return self.values[leaf]

    def release_forward(self) -> None:
        """Let go of the unit gathered for the forward."""
        self.unit, self.values, self.storages = None, {}, {}

    def end_forward(self) -> None:
        """The forward is over: let go of the unit gathered for it and of the pinned one
        (autograd holds what the backward needs of them)."""
        self.release_forward()
        self.pinned = {}

    def gather(self, unit: int) -> list[Tensor]:
        """The full values of ``unit``'s leaves (no autograd)."""
        return self._gather(self.members[unit])

    def scatter(self, unit: int, grads: list[Tensor]) -> list[Tensor]:
        """This rank's rows of the mean gradient of ``unit``'s leaves."""
        return self._scatter(self.members[unit], grads)

    # ----------------------------------------------------------------- saved tensors
    def pack(self, t: Tensor) -> Any:
        """Saved-tensor hook: a view of a gathered parameter becomes a recipe."""
        if type(t) is not Tensor or not self.storages:
            return t
        hit = self.storages.get(_storage(t))
        if hit is None:
            return t
        unit, leaf, base = hit
        return _Saved(unit, leaf, tuple(t.shape), t.stride(), int(t.storage_offset()) - base)

    def unpack(self, saved: Any) -> Tensor:
        """Saved-tensor hook: a recipe becomes the view again, of the unit gathered anew."""
        if not isinstance(saved, _Saved):
            return saved
        if self.back_unit != saved.unit:
            ix = self.members[saved.unit]
            self.back_unit, self.back = saved.unit, dict(zip(ix, self.gather(saved.unit)))
            self.gathers[1] += 1
        base = self.back[saved.leaf]
        return base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)

    def release_backward(self, unit: int | None) -> None:
        """Let go of ``unit`` if it is the one gathered for the backward."""
        if self.back_unit == unit:
            self.back_unit, self.back = None, {}


def _storage(t: Tensor) -> int:
    """An identity of ``t``'s memory (the storage object's address: reading it copies
    nothing, unlike a data pointer of a copy-on-write tensor)."""
    return int(t.untyped_storage()._cdata)


def unit_of_leaves(
    paths: Sequence[KeyPath], sharded: Sequence[bool], units: Sequence[str]
) -> tuple[int, ...]:
    """The unit of each leaf: ``j + 1`` for the longest prefix ``units[j]`` its key starts
    with, ``0`` for a sharded leaf under none (the rest of the model: :data:`REST`), ``-1``
    for a replicated leaf (not gathered).

    Raises:
        KeyError: a prefix that no sharded parameter's key starts with.

    Example:
        >>> unit_of_leaves([("a", "w"), ("b", "w"), ("c",)], [True] * 3, ["a", "b"])
        (1, 2, 0)
    """
    split = [tuple(u.split(".")) for u in units]
    used = [False] * len(units)
    out: list[int] = []
    for path, s in zip(paths, sharded):
        if not s:
            out.append(-1)
            continue
        best, length = -1, -1
        for j, pre in enumerate(split):
            if len(pre) > length and tuple(path[: len(pre)]) == pre:
                best, length = j, len(pre)
        if best >= 0:
            used[best] = True
        out.append(best + 1)
    for u, hit in zip(units, used):
        if not hit:
            raise KeyError(E.STEP_UNIT_MISSING.format(op=OP, unit=u))
    return tuple(out)


#: the unit of the sharded leaves under no prefix of ``units``
REST = 0


def unit_keys(paths: Sequence[KeyPath]) -> list[str]:
    """The printed key of each leaf."""
    return [fmt_key(p) for p in paths]


__all__ = ["REST", "Placeholder", "UnitGather", "unit_keys", "unit_of_leaves"]
