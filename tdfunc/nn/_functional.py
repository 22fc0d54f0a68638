"""Parameters as TensorDicts: :func:`from_module`, :func:`functional_call`, :func:`stack_modules`.

A module's parameters and buffers become an immutable :class:`~tdfunc.TensorDict` nested by
submodule name. :func:`functional_call` runs the module with another TensorDict in their place
(on top of :func:`torch.func.functional_call`, so the module is never rewritten for good), and
:func:`stack_modules` stacks N modules of the same structure into one TensorDict with batch size
``[N]`` for ``torch.vmap`` ensembles. Nothing here patches torch or keeps state between calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._tree import is_node, leaves_with_paths, map_leaves
from ..tensordict import TensorDict
from ._errors import (
    BAD_PARAMS,
    DUPLICATE_KEY,
    MISSING_KEYS,
    SHAPE_MISMATCH,
    STACK_EMPTY,
    STACK_KEYS,
    STACK_SHAPE,
    STATE_WRITTEN,
    UNKNOWN_KEYS,
)
from ._state import call_tracking_writes


# --------------------------------------------------------------------------------------
# from_module
# --------------------------------------------------------------------------------------
def _collect(module: nn.Module, buffers: bool) -> TensorDict:
    data: dict[str, Any] = {}
    for name, p in module._parameters.items():
        if p is not None:
            data[name] = p
    if buffers:
        skip = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None and name not in skip:
                data[name] = b
    for name, sub in module._modules.items():
        if sub is None:
            continue
        child = _collect(sub, buffers)
        if child._data:
            data[name] = child
    return TensorDict._new(data, torch.Size(()), None)


def from_module(module: nn.Module, *, buffers: bool = True) -> TensorDict:
    """The parameters (and persistent buffers) of ``module`` as a TensorDict.

    Entries are nested by submodule name, so ``params.flatten_keys(".")`` has exactly the
    names of ``module.state_dict()`` (parameters only when ``buffers=False``). The leaves are
    the module's own tensors (same objects, no copy); submodules without tensors are left out.
    The batch size is ``()``.

    Args:
        module: any ``nn.Module``.
        buffers: include persistent buffers (e.g. BatchNorm running statistics).

    Example:
        >>> import torch, tdfunc
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> params = tdfunc.from_module(net)
        >>> params["0", "weight"] is net[0].weight
        True
        >>> sorted(params.flatten_keys(".").keys()) == sorted(net.state_dict())
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module expects an nn.Module, got {type(module).__name__}")
    return _collect(module, buffers)


# --------------------------------------------------------------------------------------
# functional_call
# --------------------------------------------------------------------------------------
def _own_tensors(
    module: nn.Module, prefix: str, out: dict[str, Tensor], persistent: set[str]
) -> None:
    """Every parameter and buffer of ``module`` by dotted name (tied names listed twice)."""
    for name, p in module._parameters.items():
        if p is not None:
            out[prefix + name] = p
            persistent.add(prefix + name)
    skip = module._non_persistent_buffers_set
    for name, b in module._buffers.items():
        if b is not None:
            out[prefix + name] = b
            if name not in skip:
                persistent.add(prefix + name)
    for name, sub in module._modules.items():
        if sub is not None:
            _own_tensors(sub, prefix + name + ".", out, persistent)


def _module_tensor(module: nn.Module, name: str) -> Tensor | None:
    """The parameter or buffer ``name`` of ``module`` itself (not of a submodule), or None."""
    t = module._parameters.get(name)
    return module._buffers.get(name) if t is None else t


class _Matched:
    """What walking ``params`` against a module found (one per call)."""

    __slots__ = ("alias", "out", "tied", "unknown")

    def __init__(self, tie_weights: bool) -> None:
        self.out: dict[str, Tensor] = {}
        self.unknown: list[str] = []
        # id of a module tensor -> first name given for it (only when tying weights)
        self.tied: dict[int, str] | None = {} if tie_weights else None
        # a second name of a tied tensor -> the first name (whose tensor the module uses)
        self.alias: dict[str, str] = {}

    def add(self, name: str, v: Tensor, ref: Tensor | None) -> None:
        if ref is None:
            self.unknown.append(name)
            return
        if v.shape != ref.shape:
            raise ValueError(
                SHAPE_MISMATCH.format(key=name, got=tuple(v.shape), expected=tuple(ref.shape))
            )
        if self.tied is not None:
            # a second name of a tied tensor: torch.func fills it from the first one
            first = self.tied.get(id(ref))
            if first is not None:
                self.alias[name] = first
                return
            self.tied[id(ref)] = name
        self.out[name] = v


def _match_node(node: Any, module: nn.Module | None, prefix: str, m: _Matched) -> None:
    """Walk a parameter node and the module side by side: dotted names, shape checks."""
    data = (
        node._data
        if isinstance(node, TensorDict)
        else dict(zip(node._tdf_keys(), node._tdf_children()))
    )
    for k, v in data.items():
        if isinstance(v, Tensor):
            m.add(prefix + k, v, None if module is None else _module_tensor(module, k))
        elif v is not None:
            sub = None if module is None else module._modules.get(k)
            _match_node(v, sub, prefix + k + ".", m)


def _flat_mapping(m: Mapping[str, Any], prefix: str, out: dict[str, Tensor]) -> None:
    for k, v in m.items():
        if isinstance(v, Tensor):
            out[prefix + k] = v
        elif is_node(v):
            for path, leaf in leaves_with_paths(v):
                out[prefix + k + "." + ".".join(path)] = leaf
        elif isinstance(v, Mapping):
            _flat_mapping(v, prefix + k + ".", out)
        else:
            raise TypeError(
                BAD_PARAMS.format(typ=f"a mapping holding {type(v).__name__} at {prefix + k!r}")
            )


def _match_flat(flat: Mapping[str, Tensor], module: nn.Module, m: _Matched) -> None:
    """Resolve dotted names against the module, check shapes."""
    for name, v in flat.items():
        *path, leaf = name.split(".")
        owner: nn.Module | None = module
        for part in path:
            owner = owner._modules.get(part) if owner is not None else None
        m.add(name, v, None if owner is None else _module_tensor(owner, leaf))


def _match(params: Any, module: nn.Module, m: _Matched) -> None:
    if is_node(params):
        _match_node(params, module, "", m)
    elif isinstance(params, Mapping):
        flat: dict[str, Tensor] = {}
        _flat_mapping(params, "", flat)
        _match_flat(flat, module, m)
    elif isinstance(params, (tuple, list)):
        seen: set[str] = set()
        for p in params:
            part = _Matched(False)
            _match(p, module, part)
            for k in [*part.out, *part.unknown]:
                if k in seen:
                    raise ValueError(DUPLICATE_KEY.format(key=k))
                seen.add(k)
            _match_flat(part.out, module, m)
            m.unknown.extend(part.unknown)
    else:
        raise TypeError(BAD_PARAMS.format(typ=type(params).__name__))


def _new_leaf(name: str, leaf: Tensor, written: dict[str, Tensor], alias: dict[str, str]) -> Tensor:
    return written.get(alias.get(name, name), leaf)


def _new_state(state: Any, prefix: str, written: dict[str, Tensor], alias: dict[str, str]) -> Any:
    """``state`` with the written leaves replaced (the same object when none is)."""
    if is_node(state):
        pairs = leaves_with_paths(state)
        new = [_new_leaf(prefix + ".".join(p), t, written, alias) for p, t in pairs]
        if all(a is b for a, b in zip(new, (t for _, t in pairs))):
            return state
        return map_leaves(state, new)
    if isinstance(state, Mapping):
        items: dict[str, Any] = {}
        for k, v in state.items():
            if isinstance(v, Tensor):
                items[k] = _new_leaf(prefix + k, v, written, alias)
            else:
                items[k] = _new_state(v, prefix + k + ".", written, alias)
        if all(items[k] is v for k, v in state.items()):
            return state
        mapping_type: Any = type(state)  # dict, OrderedDict, ...: built from a dict
        return mapping_type(items)
    parts = [_new_state(p, prefix, written, alias) for p in state]
    if all(a is b for a, b in zip(parts, state)):
        return state
    return type(state)(parts)


def _raise_written(module: nn.Module, key: str) -> None:
    *path, name = key.split(".")
    owner = module.get_submodule(".".join(path))
    kind = "parameter" if name in owner._parameters else "buffer"
    raise PermissionError(
        STATE_WRITTEN.format(
            module=repr(".".join(path)) if path else "(the root module)",
            cls=type(owner).__name__,
            kind=kind,
            name=name,
            key=key,
        )
    )


def functional_call(
    module: nn.Module,
    state: Any,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    strict: bool = False,
    tie_weights: bool = True,
    return_state: bool = False,
) -> Any:
    """Call ``module`` with the tensors of ``state`` in place of its own; never write them.

    ``state`` is a TensorDict (as built by :func:`from_module`, or one member of
    :func:`stack_modules` under ``torch.vmap``), a tensorclass, a mapping of tensors (nested, or
    flat with dotted names as in ``state_dict()``), or a tuple of those (e.g.
    ``(params, buffers)``). Key paths joined by ``"."`` name the module's parameters and buffers.
    Every shape is checked against the module's own tensor before any computation. The module
    is left as it was: this runs on :func:`torch.func.functional_call` and works under
    ``torch.vmap``, ``torch.func.grad`` and ``torch.compile(fullgraph=True)``.

    **The tensors of** ``state`` **are never written**, whatever the module does: it runs on
    copy-on-write clones of them (nothing is copied unless it writes). Modules that update
    their state while they run (batch norm in training mode updates its running statistics,
    counters, moving averages, caches) do it on the clones, and

    * ``return_state=True`` returns ``(output, new_state)``: ``new_state`` has the structure
      and type of ``state``; each leaf the module wrote in place or reassigned is a new tensor
      holding the new value, every other leaf is the very same tensor object as in ``state``
      (``state`` itself when nothing was written). Tied names get the same new tensor.
    * ``return_state=False`` (the default) raises ``PermissionError`` naming the module and the
      tensor if the module writes one of the given tensors: the new value would otherwise be
      lost silently. Modules that write nothing (any module in eval mode, most models) are
      unaffected.

    Writes are recognised as torch calls: in-place methods and operators (``add_``,
    ``x += 1``, ``x[i] = v``, ``x.data = v``, also through views of ``x``), ``out=`` arguments,
    ``inplace=True`` activations, the running statistics of batch/instance norm in training,
    and reassigned attributes (``self.count = self.count + 1``). Writes through other aliases
    (e.g. a raw ``data_ptr``) never reach ``state`` either, but are not reported. Tensors not
    in ``state`` (``strict=False``) are the module's own and are updated as in PyTorch.

    Args:
        module: the module to call.
        state: the tensors to use (parameters and/or buffers).
        args: positional arguments of ``module`` (a single non-tuple value is one argument).
        kwargs: keyword arguments of ``module``.
        strict: when False, names absent from ``state`` use the module's own tensors and names
            the module does not have are ignored. When True, both raise ``KeyError`` (missing
            means a parameter or persistent buffer, i.e. a ``state_dict()`` name).
        tie_weights: tensors tied in the module stay tied: the value given under the first of
            their names is used for all of them (see ``torch.func.functional_call``).
        return_state: return ``(output, new_state)`` instead of the output alone.

    Returns:
        Whatever ``module`` returns, or ``(output, new_state)`` when ``return_state=True``.

    Raises:
        ValueError: a tensor's shape differs from the module's (the message names the key and
            both shapes).
        KeyError: ``strict=True`` and keys are unknown or missing (the message lists them).
        PermissionError: ``return_state=False`` and the module wrote one of the given tensors.

    Example:
        >>> import torch, tdfunc
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)).train()
        >>> state = tdfunc.from_module(net)
        >>> y, new = tdfunc.functional_call(net, state, (torch.randn(8, 3),), return_state=True)
        >>> new["1", "num_batches_tracked"].item(), state["1", "num_batches_tracked"].item()
        (1, 0)
        >>> new["0", "weight"] is state["0", "weight"]  # parameters are not copied
        True
        >>> zero = tdfunc.functional_call(net.eval(), state * 0, (torch.ones(1, 3),))
        >>> zero.abs().sum().item()
        0.0
    """
    matched = _Matched(tie_weights)
    _match(state, module, matched)
    flat, unknown = matched.out, matched.unknown
    if strict:
        name = type(module).__name__
        own: dict[str, Tensor] = {}
        persistent: set[str] = set()
        _own_tensors(module, "", own, persistent)
        if unknown:
            raise KeyError(UNKNOWN_KEYS.format(keys=unknown, module=name, known=list(own)))
        tied_given = {n for n in own if id(own[n]) in (matched.tied or {})}
        missing = [k for k in own if k in persistent and k not in flat and k not in tied_given]
        if missing:
            raise KeyError(MISSING_KEYS.format(keys=missing, module=name))
    out, written = call_tracking_writes(module, flat, args, kwargs, tie_weights)
    if not return_state:
        if written:
            _raise_written(module, next(iter(written)))
        return out
    if not written:
        return out, state
    return out, _new_state(state, "", written, matched.alias)


# --------------------------------------------------------------------------------------
# stack_modules
# --------------------------------------------------------------------------------------
def _first_difference(a: list[str], b: list[str]) -> tuple[str, str, str]:
    """First key at which two ordered key lists differ, with what each side has there."""
    for x, y in zip(a, b):
        if x != y:
            return x, repr(x), repr(y)
    if len(a) > len(b):
        return a[len(b)], repr(a[len(b)]), "nothing"
    return b[len(a)], "nothing", repr(b[len(a)])


def stack_modules(modules: Sequence[nn.Module], *, buffers: bool = True) -> TensorDict:
    """Stack the parameters (and buffers) of N modules of identical structure.

    The result is a TensorDict with batch size ``[N]`` (nested as :func:`from_module`) whose
    leaves are fresh leaf tensors: detached from the modules (gradients do not reach them), with
    ``requires_grad`` as the originals, ready for a ``torch.optim`` optimizer. Tensors tied
    inside the modules stay one tensor. Use it with ``torch.vmap`` and :func:`functional_call`
    to run an ensemble in one batched call.

    Args:
        modules: N modules with the same parameter names, shapes and dtypes.
        buffers: include persistent buffers.

    Raises:
        ValueError: the sequence is empty, or a module differs from the first one (the message
            names the first differing key or shape).

    Example:
        >>> import torch, tdfunc
        >>> nets = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> params = tdfunc.stack_modules(nets)
        >>> params.batch_size, params["weight"].shape, params["weight"].is_leaf
        (torch.Size([4]), torch.Size([4, 2, 3]), True)
        >>> call = lambda p, x: tdfunc.functional_call(nets[0], p, (x,))
        >>> torch.vmap(call, in_dims=(0, None))(params, torch.ones(5, 3)).shape
        torch.Size([4, 5, 2])
    """
    modules = list(modules)
    if not modules:
        raise ValueError(STACK_EMPTY)
    tds = [from_module(m, buffers=buffers) for m in modules]
    ref = leaves_with_paths(tds[0])
    ref_keys = [".".join(p) for p, _ in ref]
    columns: list[list[Tensor]] = [[t] for _, t in ref]
    for i, td in enumerate(tds[1:], start=1):
        other = leaves_with_paths(td)
        keys = [".".join(p) for p, _ in other]
        if keys != ref_keys:
            key, expected, got = _first_difference(ref_keys, keys)
            raise ValueError(STACK_KEYS.format(index=i, key=key, expected=expected, got=got))
        for key, (_, a), (_, b), col in zip(ref_keys, ref, other, columns):
            if a.shape != b.shape:
                raise ValueError(
                    STACK_SHAPE.format(
                        index=i, key=key, what="shape", got=tuple(b.shape), expected=tuple(a.shape)
                    )
                )
            if a.dtype != b.dtype:
                raise ValueError(
                    STACK_SHAPE.format(
                        index=i, key=key, what="dtype", got=b.dtype, expected=a.dtype
                    )
                )
            col.append(b)
    # tensors tied inside module 0 (one object under two names) stay one stacked tensor
    done: dict[int, Tensor] = {}
    fresh: list[Tensor] = []
    with torch.no_grad():
        for (_, t0), col in zip(ref, columns):
            s = done.get(id(t0))
            if s is None:
                s = torch.stack([t.detach() for t in col]).requires_grad_(t0.requires_grad)
                done[id(t0)] = s
            fresh.append(s)
    return map_leaves(tds[0], fresh, torch.Size([len(modules)]))


__all__ = ["from_module", "functional_call", "stack_modules"]
