"""Donation: "I will not use these inputs again", so their memory holds the outputs.

A pure step returns new parameters and a new optimizer state; compiled, that means fresh
buffers for every leaf on every step (and, above 32 MB, page faults to map them). Donating the
inputs lets the step write its outputs into the memory of the inputs it was given, as
``torch.optim`` does in place and as JAX does with ``donate_argnums``, while the function
itself stays pure:

* :func:`compile` wraps a function: after it computes its outputs, each output leaf is copied
  into a donated input leaf of the same shape, dtype, device and layout (the first unused one,
  in flatten order) and that input tensor is returned in its place. Compiled, the copy is an
  input mutation of the graph: inductor writes the results straight into the donated buffers
  (no new allocation, no extra pass). Eagerly (``disable=True``) the same rule runs as written
  (one copy per leaf): the same values, the same memory, the same checks.
* a donated container is *consumed*: every later use of it, or of a container nested in it,
  raises :class:`DonatedError` naming the call that consumed it. Tensors taken out of it
  before the call are the caller's responsibility: they now hold that call's outputs.

The checks run eagerly around the call, never inside a traced graph (boundary code, like the
slot plan of :func:`tdfunc.functional_call`).
"""

from __future__ import annotations

import functools
import logging
import re
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _errors as E
from ._compat import compiled_graphs, is_traceable_wrapper_subclass, pytree, trace_autograd
from ._jagged import _boundary as boundary
from ._jagged._boundary import Plan
from ._jagged._layout import layout_of, under_wrappers
from ._keys import fmt_key
from ._tree import KeyPath, Node, is_node, leaves, leaves_with_paths


class DonatedError(RuntimeError):
    """A container was used after it was donated: its buffers hold a later call's outputs."""


DonatedError.__module__ = "tdfunc"  # shown as tdfunc.DonatedError, where it is exported


class _Consumed:
    """Marker base of the consumed variant of each container class (see :func:`consume`)."""

    __slots__ = ()


def _refuse(self: Any, name: str) -> Any:
    if name == "__class__":
        return object.__getattribute__(self, name)
    # the message was stored in the batch size slot (every container has one)
    raise DonatedError(object.__getattribute__(self, "_batch_size"))


def _consumed_repr(self: Any) -> str:
    cls = type(self).__mro__[2].__name__
    return f"<donated {cls}: {object.__getattribute__(self, '_batch_size')}>"


_CONSUMED_CLASSES: dict[type, type] = {}


def _consumed_class(cls: type) -> type:
    """The consumed variant of a container class: same layout, every attribute raises."""
    out = _CONSUMED_CLASSES.get(cls)
    if out is None:
        ns = {"__slots__": (), "__getattribute__": _refuse, "__repr__": _consumed_repr}
        out = type(f"Donated{cls.__name__}", (_Consumed, cls), ns)
        _CONSUMED_CLASSES[cls] = out
    return out


def _nodes(node: Any, out: list[Any]) -> list[Any]:
    out.append(node)
    for v in node._data.values() if node._tdf_dict_layout else node._tdf_children():
        if isinstance(v, Node):
            _nodes(v, out)
    return out


def consume(node: Any, message: str) -> None:
    """Mark ``node`` and every container nested in it as consumed: any later use raises
    :class:`DonatedError` with ``message``. The tensors themselves are not touched.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), b={"c": torch.ones(1)})
        >>> inner = td["b"]
        >>> consume(td, "td was donated to step() (call 1)")
        >>> inner["c"]
        Traceback (most recent call last):
        ...
        tdfunc.DonatedError: td was donated to step() (call 1)
    """
    for n in _nodes(node, []):
        object.__setattr__(n, "__class__", _consumed_class(type(n)))
        object.__setattr__(n, "_batch_size", message)


def is_consumed(x: Any) -> bool:
    """True for a container that was donated (consumed).

    Example:
        >>> import torch, tdfunc
        >>> is_consumed(tdfunc.TensorDict(a=torch.zeros(1)))
        False
    """
    return isinstance(x, _Consumed)


def check_not_consumed(x: Any) -> None:
    """:class:`DonatedError` when ``x`` is a consumed container."""
    if isinstance(x, _Consumed):
        raise DonatedError(object.__getattribute__(x, "_batch_size"))


# --------------------------------------------------------------------------------------
# the rules on donated leaves
# --------------------------------------------------------------------------------------
def _extent(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage ``t`` may touch: ``[start, end)``."""
    size = t.element_size()
    start = int(t.storage_offset()) * size
    if t.numel() == 0:
        return start, start
    span = sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride()))
    return start, start + (span + 1) * size


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one storage may touch a common byte."""
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    return a0 < b1 and b0 < a1


_PLAIN = (Tensor, torch.nn.Parameter)


def _memory(t: Tensor) -> list[Tensor]:
    """The tensors that hold ``t``'s memory: ``t`` itself, or for a wrapper subclass with no
    storage of its own (a DTensor: its local shard) the tensors inside it."""
    if type(t) in _PLAIN or not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]  # DTensor also lists its (opaque) mesh
    return [m for x in inner if isinstance(x, Tensor) for m in _memory(x)]


def _kind(t: Tensor) -> tuple[Any, ...]:
    """What an output must share with a donated tensor to be written into it: dtype, device,
    layout and ndim; for a DTensor also its mesh and placements (a copy between placements
    would redistribute, and the output would come back with the donor's layout)."""
    key: tuple[Any, ...] = (t.dtype, t.device, layout_of(t), t.dim())
    if is_traceable_wrapper_subclass(t):
        key += (type(t), getattr(t, "device_mesh", None), getattr(t, "placements", None))
    return key


def check_donated(
    args: Sequence[Any],
    kwargs: dict[str, Any],
    donate: tuple[int, ...],
    what: str,
    grad_ok: bool = False,
    names: Sequence[str] = (),
) -> list[tuple[int, Tensor]]:
    """The donated leaves ``(argument, tensor)``, after the rules: donated arguments are
    containers not consumed yet; no memory-mapped leaf, no leaf that requires grad, no two
    donated leaves that overlap in memory, no donated leaf whose memory is also passed
    un-donated. Raises a typed error naming the argument and the key otherwise. ``grad_ok``
    admits leaves that require grad (for writers that run under ``no_grad``); ``names`` names
    the positional arguments in messages (default: "argument i")."""

    def at(arg: int | str, t: Tensor, nth: int = 0) -> str:
        # key paths are looked up only to name a leaf in an error (``nth``: the same tensor
        # under a second key)
        x = args[arg] if isinstance(arg, int) else kwargs[arg]
        found = [p for p, v in _paths(x) if v is t]
        path = found[min(nth, len(found) - 1)] if found else ()
        where = names[arg] if isinstance(arg, int) and arg < len(names) else f"argument {arg!r}"
        return f"{where}, key {'.'.join(path)!r}" if path else where

    for a in args:
        check_not_consumed(a)
    for a in kwargs.values():
        check_not_consumed(a)
    out: list[tuple[int, Tensor]] = []
    for i in donate:
        if i >= len(args):
            raise TypeError(E.DONATE_MISSING.format(what=what, arg=i, n=len(args)))
        x = args[i]
        if not is_node(x):
            raise TypeError(E.DONATE_NOT_CONTAINER.format(what=what, arg=i, typ=type(x).__name__))
        for t in leaves(x):
            base = under_wrappers(t)[0]  # a memory-mapped leaf under torch.func wrappers too
            if type(base) is not Tensor:
                from .memmap._tensor import MemoryMappedTensor

                if isinstance(base, MemoryMappedTensor):
                    mode = base.mode
                    if mode == "c":
                        raise ValueError(E.DONATE_MEMMAP_PRIVATE.format(what=what, at=at(i, t)))
                    err = PermissionError if mode == "r" else ValueError
                    raise err(E.DONATE_MEMMAP.format(what=what, at=at(i, t), mode=mode))
            if t.requires_grad and not grad_ok:
                raise ValueError(E.DONATE_REQUIRES_GRAD.format(what=what, at=at(i, t)))
            out.append((i, t))
    # overlaps: extents are compared only between leaves that share a storage (rare)
    # (argument, leaf, memory tensor): a DTensor's memory is its local shard
    by_storage: dict[int, list[tuple[int, Tensor, Tensor]]] = {}
    for i, t in out:
        for m in (t,) if type(t) in _PLAIN else _memory(t):
            key = m.untyped_storage().data_ptr()
            group = by_storage.get(key)
            if group is None:  # the common case: a storage of its own
                by_storage[key] = [(i, t, m)]
                continue
            for k, other, om in group:
                if _overlap(m, om):
                    second = 1 if other is t and k == i else 0
                    raise ValueError(
                        E.DONATE_ALIAS.format(what=what, a=at(k, other), b=at(i, t, second))
                    )
            group.append((i, t, m))
    passed: list[tuple[int | str, Any]] = [
        (j, a) for j, a in enumerate(args) if j not in donate and not _no_tensor(a)
    ]
    passed += [(k, a) for k, a in kwargs.items() if not _no_tensor(a)]
    for name, a in passed:
        for t in _tensor_leaves(a):
            for m in (t,) if type(t) in _PLAIN else _memory(t):
                for k, other, om in by_storage.get(m.untyped_storage().data_ptr(), ()):
                    if _overlap(m, om):
                        raise ValueError(
                            E.DONATE_ALSO_PASSED.format(what=what, a=at(k, other), b=at(name, t))
                        )
    return out


def _no_tensor(x: Any) -> bool:
    """A Python scalar, string or None: nothing to look into."""
    return x is None or isinstance(x, (bool, int, float, complex, str))


def _tensor_leaves(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if is_node(x):
        return leaves(x)
    return [v for v in pytree.tree_leaves(x) if isinstance(v, Tensor)]


def _paths(x: Any) -> list[tuple[KeyPath, Tensor]]:
    """``(key path, tensor)`` of every tensor in ``x`` (to name a leaf in an error)."""
    if isinstance(x, Tensor):
        return [((), x)]
    if is_node(x):
        return leaves_with_paths(x)
    pairs, _ = pytree.tree_flatten_with_path(x)
    return [(tuple(str(k) for k in p), v) for p, v in pairs if isinstance(v, Tensor)]


# --------------------------------------------------------------------------------------
# the traced part: outputs into donated buffers
# --------------------------------------------------------------------------------------
def store_outputs(out: Any, donors: list[Tensor]) -> Any:
    """``out`` with each tensor leaf written into a donated tensor of the same shape,
    dtype, device and layout (the first unused one, in order), which takes its place.

    An output that *is* a donated tensor keeps it (nothing to copy); an output that is a
    view is returned as a copy of its own (its base may be a donated buffer that another
    output overwrites); outputs with no matching donor stay as they are.

    Example:
        >>> import torch
        >>> a = torch.zeros(2)
        >>> (r,) = store_outputs((torch.ones(2),), [a])
        >>> r is a, a.tolist()
        (True, [1.0, 1.0])
    """
    flat, spec = pytree.tree_flatten(out)
    # tensors hash by identity: one lookup per output, also while Dynamo traces (the matching
    # runs once per trace, so it must stay linear in the number of leaves)
    position = {d: k for k, d in enumerate(donors)}
    used = [False] * len(donors)
    new: list[Any] = []
    for o in flat:  # before any write: pass-through outputs keep their buffer, views a copy
        if isinstance(o, Tensor):
            k = position.get(o)
            if k is not None:
                used[k] = True
            elif o._base is not None:
                o = o.clone()
        new.append(o)
    # free donors by kind, in order; the first with the output's shape takes it
    free: dict[Any, list[int]] = {}
    for k, d in enumerate(donors):
        if not used[k]:
            free.setdefault(_kind(d), []).append(k)
    for j, o in enumerate(new):
        if not isinstance(o, Tensor) or position.get(o) is not None:
            continue
        bucket = free.get(_kind(o))
        if not bucket:
            continue
        for i, k in enumerate(bucket):
            d = donors[k]
            if d.shape == o.shape:
                d.copy_(o)
                new[j] = d
                del bucket[i]
                break
    return pytree.tree_unflatten(new, spec)


def _traced_call(name: str, donate: tuple[int, ...], fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function :func:`compile` hands to ``torch.compile``: the arguments as ``fn`` is
    given them (the jagged leaves that crossed as parts built again,
    :func:`tdfunc._jagged._boundary.inside`), the call, and the outputs written into the
    donated leaves.

    A function with a code object of its own (named after ``fn``): Dynamo keeps compiled
    graphs, and counts recompiles against its limit, per code object, and it compiles a
    ``functools.partial`` through one shared wrapper; were every compiled function one code
    object, the ninth compiled in a process would meet torch's recompile limit (8) and run
    eagerly."""

    def call(plan: Plan, parts: Sequence[Tensor], /, *args: Any, **kw: Any) -> Any:
        args, kw = boundary.inside(plan, parts, args, kw)
        out = fn(*args, **kw)
        if not donate:
            return out
        donors = [t for i in donate for t in leaves(args[i])]
        return store_outputs(out, donors)

    # Dynamo also keys what it learnt about dynamic dims by the code's file, line and name:
    # one name per function and donation, as one function compiled twice by torch.compile
    module = getattr(fn, "__module__", None) or ""
    suffix = f", donate={donate}" if donate else ""
    code = call.__code__.replace(
        co_name=re.sub(r"\W+", "_", f"tdfunc_compile_{module}.{name}{suffix}"),
        co_qualname=f"tdfunc.compile({name}{suffix})",
    )
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _warn_memmap_leaves(args: Sequence[Any], what: str) -> None:
    """Warn (on a first call) about a container argument with memory-mapped leaves: a loaded
    state passed to a compiled step makes the next step, with plain tensors, compile again."""
    from .memmap._tensor import MemoryMappedTensor

    for i, a in enumerate(args):
        if not is_node(a):
            continue
        for path, t in leaves_with_paths(a):
            if isinstance(under_wrappers(t)[0], MemoryMappedTensor):
                warnings.warn(
                    E.COMPILE_MEMMAP_LEAVES.format(what=what, arg=i, key=fmt_key(path)),
                    UserWarning,
                    stacklevel=3,
                )
                return


#: where :func:`compile` says that a call compiled again, or that a first call was slow
LOG = logging.getLogger("tdfunc.compile")
#: a first call that compiles for longer than this (seconds) is logged
SLOW_COMPILE_S = 60.0


class CompileLog:
    """Counts the calls of one compiled function and logs (warning, logger
    ``tdfunc.compile``) a call after the first that compiled graphs (a recompile) and a first
    call that compiled for more than :data:`SLOW_COMPILE_S`. Boundary code: reads Dynamo's
    graph count before and after the call (under a microsecond)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.calls = 0

    def run(self, compiled: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``compiled`` (a compiled :func:`_traced_call`) called on ``args`` and
        ``kwargs`` as they cross the boundary (:mod:`tdfunc._jagged._boundary`); the outputs
        with the per-sample values that crossed as row ids back as values."""
        crossing = boundary.enter(args, kwargs)
        before = compiled_graphs()
        t0 = time.perf_counter()
        with trace_autograd():
            if crossing is None:
                out = compiled((), (), *args, **kwargs)
            else:
                out = compiled(crossing.plan, crossing.parts, *crossing.args, **crossing.kwargs)
        self.calls += 1
        graphs = compiled_graphs() - before
        if graphs:
            sec = time.perf_counter() - t0
            if self.calls > 1:
                LOG.warning(
                    E.COMPILE_RECOMPILED.format(
                        what=self.what, call=self.calls, graphs=graphs, seconds=sec
                    )
                )
            elif sec > SLOW_COMPILE_S:
                LOG.warning(E.COMPILE_SLOW.format(what=self.what, seconds=sec, graphs=graphs))
        return boundary.leave(out, crossing)


class Donating:
    """The callable :func:`compile` returns (see there)."""

    def __init__(
        self, fn: Callable[..., Any], donate: tuple[int, ...], kwargs: dict[str, Any]
    ) -> None:
        self.donate = donate
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        self.calls = 0
        self.compiled = torch.compile(_traced_call(self.name, donate, fn), **kwargs)
        self.log = CompileLog(f"tdfunc.compile({self.name})")
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        what = f"tdfunc.compile({self.name})"
        check_donated(args, kwargs, self.donate, what)
        if not self.calls:
            _warn_memmap_leaves(args, what)
        out = self.log.run(self.compiled, args, kwargs)
        self.calls += 1
        for i in self.donate:
            consume(
                args[i],
                E.DONATED.format(arg=i, what=what, call=self.calls),
            )
        return out


def compile(  # tdfunc.compile, as torch.compile
    fn: Callable[..., Any] | None = None,
    /,
    *,
    donate: int | Sequence[int] = (),
    **kwargs: Any,
) -> Any:
    """``torch.compile(fn, **kwargs)`` that writes the outputs into donated inputs.

    ``donate`` names the positional arguments (containers) the caller will not use again.
    Each output leaf is written into a donated leaf with the same shape, dtype, device and
    layout (the first unused one, in flatten order; JAX's ``donate_argnums`` rule), which
    is returned in its place; other outputs are new tensors as usual. Compiled, inductor then
    stores the results straight into the donated memory (no allocation per step); the values
    are exactly those of the undonated call. After the call every donated container (and
    every container nested in it) is consumed: using it raises :class:`DonatedError` naming
    this call. Tensors taken out of a donated container before the call now hold the
    outputs: they are the caller's responsibility.

    Refused (typed errors naming the argument and key): a donated argument that is not a
    container or was consumed already; a memory-mapped leaf (``PermissionError`` when
    read-only; ``ValueError`` for mode ``"r+"``, whose writes would go to the file, and for
    copy-on-write mode ``"c"``, where donating saves nothing over ``.clone()``); a leaf that
    requires grad; two donated leaves that overlap in memory; a donated leaf whose memory
    is also passed in an argument not donated. A first call whose other arguments hold
    memory-mapped leaves (a state from :func:`tdfunc.load`) warns: Dynamo guards on the leaf
    type, so the next call, with the plain tensors the step returns, would compile again
    (pass ``.clone()`` instead). ``disable=True`` runs eagerly with the same rules and
    results. Without ``donate`` this is ``torch.compile`` (a module is returned as
    ``torch.compile`` returns it; a function is wrapped for the log below).

    Gradients inside: every call runs with Dynamo tracing ``torch.autograd.grad``
    (``torch._dynamo.config.trace_autograd_ops``, put back after the call), so a step that
    takes them with :func:`tdfunc.value_and_grad` is one graph, as with ``torch.func``.

    Variable-length data crosses in a form that compiles once (containers passed as
    arguments, positionally or by keyword; measurements in the datasets guide, "Compiled
    steps over variable-length data"): a jagged leaf as its values (ragged dim marked
    dynamic), offsets and lengths, built again inside, so an epoch of new lengths compiles
    once and torch's FX graph and AOTAutograd caches keep the compile; a per-sample
    non-tensor value (text per row) as row ids into a table kept outside the graph, moved by
    indexing, ``stack``, ``cat`` and ``split`` like a tensor leaf and looked up after the
    call, so new values never compile again. Reading such a value inside raises
    ``TypeError`` naming the key (read it outside, or use ``torch.compile``, which
    specialises on it). A module is compiled by ``torch.compile`` alone, without this boundary.

    Never silent about compile time: a call after the first that compiled again (a guard
    failed) and a first call that compiled for more than a minute log a warning on the
    ``tdfunc.compile`` logger saying why, with torch's ``TORCH_LOGS`` setting that shows
    more.

    Args:
        fn: the function (or use ``@tdfunc.compile(donate=...)`` as a decorator).
        donate: a position or positions of ``fn``'s arguments.
        **kwargs: passed to ``torch.compile`` (``fullgraph``, ``backend``, ``mode``,
            ``dynamic``, ``disable``...).

    Example:
        >>> import torch, tdfunc
        >>> def step(params, lr):
        ...     return params.apply(lambda p: p - lr * p)
        >>> step = tdfunc.compile(step, donate=0, backend="eager", fullgraph=True)
        >>> p = tdfunc.TensorDict(w=torch.ones(3))
        >>> w = p["w"]
        >>> p2 = step(p, 0.5)
        >>> p2["w"] is w, w.tolist()
        (True, [0.5, 0.5, 0.5])
        >>> p["w"]
        Traceback (most recent call last):
        ...
        tdfunc.DonatedError: argument 0 was donated to tdfunc.compile(step) (call 1): its buffers now hold that call's outputs; use the values it returned

        Per-sample text moves with the rows, and new text does not compile again:

        >>> pick = tdfunc.compile(lambda td, i: td[i], backend="eager", fullgraph=True)
        >>> td = tdfunc.TensorDict(x=torch.ones(3), text=["a", "b", "c"], batch_size=[3])
        >>> pick(td, torch.tensor([2, 0]))["text"]
        ('c', 'a')
    """
    if fn is None:
        return functools.partial(compile, donate=donate, **kwargs)
    if isinstance(donate, int) or not isinstance(donate, Sequence) or isinstance(donate, str):
        donate = (donate,)  # one position; checked below
    idx = tuple(donate)
    for i in idx:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise TypeError(E.DONATE_INDEX.format(value=i))
    if len(set(idx)) != len(idx):
        raise ValueError(E.DONATE_REPEATED.format(value=idx))
    if not idx:
        if isinstance(fn, torch.nn.Module) or not callable(fn):
            return torch.compile(fn, **kwargs)
        name = getattr(fn, "__qualname__", None) or repr(fn)
        compiled = torch.compile(_traced_call(name, (), fn), **kwargs)
        log = CompileLog(f"tdfunc.compile({name})")

        @functools.wraps(fn)
        def logged(*args: Any, **kw: Any) -> Any:
            return log.run(compiled, args, kw)

        return logged
    return Donating(fn, tuple(sorted(idx)), kwargs)
