"""Parameters as TensorDicts: :func:`from_module`, :func:`functional_call`, :func:`stack_modules`.

A module's parameters and buffers become an immutable :class:`~tdfunc.TensorDict` nested by
submodule name. :func:`functional_call` runs the module with another TensorDict in their place
(on top of :func:`torch.func.functional_call`, so the module is never rewritten for good), and
:func:`stack_modules` stacks N modules of the same structure into one TensorDict with batch size
``[N]`` for ``torch.vmap`` ensembles. Nothing here patches torch; the one thing kept between
calls is :func:`functional_call`'s slot plan, validated on every use (``_plan``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import index
from typing import Any

import torch
from torch import Tensor, nn

from .._raising import refuse
from .._tree import is_node, leaves_with_paths, map_leaves
from ..tensordict import TensorDict
from . import _twins  # noqa: F401  (registers what Dynamo traces instead of the eager readers)
from ._errors import (
    BAD_PARAMS,
    DUPLICATE_KEY,
    META_MISSING,
    MISSING_KEYS,
    PARAM_SHAPE,
    SHAPE_MISMATCH,
    STACK_EMPTY,
    STACK_KEYS,
    STACK_SHAPE,
    STACKED_STATE,
    STATE_CREATED,
    STATE_NO_ROOM,
    STATE_WRITTEN,
    TIED_TWICE,
    UNKNOWN_KEYS,
)
from ._plan import lookup, remember
from ._state import Prepared, Slot, call_with_state, same_tensor


# --------------------------------------------------------------------------------------
# from_module
# --------------------------------------------------------------------------------------
def _collect(module: nn.Module, buffers: bool, seen: set[int]) -> TensorDict:
    data: dict[str, Any] = {}
    for name, p in module._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            data[name] = p
    if buffers:
        skip = module._non_persistent_buffers_set
        for name, b in module._buffers.items():
            if b is not None and name not in skip and id(b) not in seen:
                seen.add(id(b))
                data[name] = b
    for name, sub in module._modules.items():
        if sub is None:
            continue
        child = _collect(sub, buffers, seen)
        if child._data:
            data[name] = child
    return TensorDict._new(data, torch.Size(()), None)


def from_module(module: nn.Module, *, buffers: bool = True) -> TensorDict:
    """The parameters (and persistent buffers) of ``module`` as a TensorDict.

    Entries are nested by submodule name, so ``params.flatten_keys(".")`` has exactly the
    names of ``module.state_dict()`` (parameters only when ``buffers=False``), except that a
    tensor reachable under several names (tied weights, a submodule used twice) is one leaf,
    under its first name, as in ``module.named_parameters()``: gradients, updates, ``detach``,
    ``clone``, ``save`` keep one value per tie, and :func:`functional_call` puts it in every
    slot that holds it. :func:`state_dict` gives every name back (for ``load_state_dict`` or a
    safetensors file for other tools). The leaves are the module's own tensors (same objects,
    no copy); submodules without tensors of their own are left out. The batch size is ``()``.

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
        >>> tied = torch.nn.Sequential(net[0], net[0])  # one Linear under two names
        >>> sorted(tdfunc.from_module(tied).flatten_keys(".").keys())
        ['0.bias', '0.weight']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module expects an nn.Module, got {type(module).__name__}")
    return _collect(module, buffers, set())


def state_dict(module: nn.Module, state: Any = None) -> dict[str, Tensor]:
    """``module.state_dict()``'s names with the tensors of ``state``: every name, ties included.

    The inverse of the one-leaf-per-tie rule of :func:`from_module`: each name that
    ``module.state_dict()`` has maps to the tensor ``state`` gives for it or for the tensor it
    is tied to (the same object under both names; on a meta copy, whose ties are gone, the
    tie the module declares, as :func:`functional_call` fills it), and to the module's own
    tensor for names ``state`` does not give. Ready for ``module.load_state_dict(...)`` and for
    ``tdfunc.save_safetensors`` when another tool (e.g. transformers) expects every name.

    Args:
        module: the module whose names to use.
        state: a container or mapping of tensors as :func:`functional_call` accepts (``None``:
            the module's own tensors).

    Returns:
        A flat ``dict`` from dotted name to tensor, in ``module.state_dict()`` order.

    Raises:
        ValueError: ``state`` is stacked over modules (as :func:`functional_call` refuses it).

    Example:
        >>> import torch, tdfunc
        >>> lin = torch.nn.Linear(2, 2)
        >>> net = torch.nn.Sequential(lin, lin)
        >>> params = tdfunc.from_module(net) * 0
        >>> sd = tdfunc.state_dict(net, params)
        >>> sorted(sd), sd["1.weight"] is sd["0.weight"]
        (['0.bias', '0.weight', '1.bias', '1.weight'], True)
        >>> net.load_state_dict(sd)
        <All keys matched successfully>
    """
    matched = _Matched(tie_weights=True)
    if state is not None:
        _match(state, module, matched)
        matched.check_stacked()
        _meta_slots(module, matched, True, refuse=False)
    given: dict[int, Tensor] = {}
    for name, v in matched.out.items():
        owner, attr = matched.slots[name]
        given[id(_module_tensor(owner, attr))] = v
        for slot in matched.extra.get(name, ()):  # a meta tensor of a declared tie
            given[id(_module_tensor(*slot))] = v
    out: dict[str, Tensor] = {}
    for name, own in module.state_dict(keep_vars=True).items():
        out[name] = given.get(id(own), own)
    return out


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

    __slots__ = (
        "alias",
        "extra",
        "leading",
        "misfits",
        "out",
        "slots",
        "stacked",
        "tied",
        "unknown",
    )

    def __init__(self, tie_weights: bool) -> None:
        self.out: dict[str, Tensor] = {}
        self.slots: dict[str, tuple[nn.Module, str]] = {}
        self.unknown: list[str] = []
        # id of a module tensor -> first name given for it (only when tying weights)
        self.tied: dict[int, str] | None = {} if tie_weights else None
        # a second name of a tied tensor -> the first name (whose tensor the module uses)
        self.alias: dict[str, str] = {}
        # a given name -> the meta slots its tensor also fills by a declared tie (_meta_slots)
        self.extra: dict[str, list[Slot]] = {}
        # the leading dim of each given tensor that is its module tensor's shape with one dim
        # in front (None for any other tensor), and the first such tensor (see check_stacked)
        self.leading: set[int | None] = set()
        self.stacked: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
        # each given parameter whose shape is not the module's: its name, the tensor given
        # and the parameter's shape (see check_parameters)
        self.misfits: list[tuple[str, Tensor, torch.Size]] = []

    def add(self, name: str, v: Tensor, owner: nn.Module | None, attr: str) -> None:
        ref = None if owner is None else _module_tensor(owner, attr)
        if ref is None or owner is None:
            self.unknown.append(name)
            return
        # a buffer's shape is the state's (observers grow their buffers), a parameter's is the
        # module's; a state stacked over modules is refused, once every tensor is seen
        # (check_stacked, then check_parameters). Under torch.vmap a shape is one call's.
        shape = v.shape
        if shape == ref.shape:
            self.leading.add(None)
        else:
            if len(shape) == ref.dim() + 1 and shape[1:] == ref.shape:
                self.leading.add(shape[0])
                if self.stacked is None:
                    self.stacked = (name, tuple(shape), tuple(ref.shape))
            else:
                self.leading.add(None)
            if attr in owner._parameters:
                self.misfits.append((name, v, ref.shape))
        if self.tied is not None:
            # a second name of a tied tensor: the tensor given under the first one fills every
            # slot; the same tensor again is fine, another one would be silently ignored
            first = self.tied.get(id(ref))
            if first is not None:
                if not same_tensor(v, self.out[first]):
                    raise ValueError(TIED_TWICE.format(key=name, first=first))
                self.alias[name] = first
                return
            self.tied[id(ref)] = name
        self.out[name] = v
        self.slots[name] = (owner, attr)

    def check_stacked(self) -> None:
        """Refuse a state stacked over modules: every given tensor is its module tensor's
        shape with one leading dim, the same for all (``stack_modules``' layout), outside
        ``torch.vmap`` (under it the leaves have the module's shapes)."""
        if self.stacked is not None and len(self.leading) == 1:
            key, got, expected = self.stacked
            raise ValueError(STACKED_STATE.format(n=got[0], key=key, got=got, expected=expected))

    def check_parameters(self) -> None:
        """Refuse a parameter given with another shape than the module's, before the module
        runs (:func:`~tdfunc._raising.refuse`: traced, the compiled program raises it when it
        runs, and the trace goes on with a tensor of the parameter's shape in its place)."""
        if not self.misfits:
            return
        key, v, expected = self.misfits[0]
        # plain ints: a traced shape may be symbolic, and the message is a constant of the
        # program (operator.index specializes a symbolic size on this path only)
        got = tuple(map(index, v.shape))
        refuse(ValueError, PARAM_SHAPE.format(key=key, got=got, expected=tuple(expected)))
        for name, v, expected in self.misfits:
            if name in self.out:
                self.out[name] = v.new_zeros(expected)


def _match_node(node: Any, module: nn.Module | None, prefix: str, m: _Matched) -> None:
    """Walk a parameter node and the module side by side: dotted names, shape checks."""
    data = (
        node._data
        if isinstance(node, TensorDict)
        else dict(zip(node._tdf_keys(), node._tdf_children()))
    )
    for k, v in data.items():
        if isinstance(v, Tensor):
            m.add(prefix + k, v, module, k)
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
        m.add(name, v, owner, leaf)


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


def _written_message(module: nn.Module, key: str) -> str:
    *path, name = key.split(".")
    owner = module.get_submodule(".".join(path))
    kind = "parameter" if name in owner._parameters else "buffer"
    return STATE_WRITTEN.format(
        module=repr(".".join(path)) if path else "(the root module)",
        cls=type(owner).__name__,
        kind=kind,
        name=name,
        key=key,
    )


def _declared_ties(module: nn.Module) -> dict[str, str]:
    """The ties ``module`` and its submodules declare, as dotted ``{target: source}`` names.

    Read, per submodule, from transformers' conventions: ``all_tied_weights_keys`` (transformers
    5: expanded names, empty when the config does not tie), else ``_tied_weights_keys`` as a
    mapping of names (only when a ``config`` says ``tie_word_embeddings`` or there is no
    config), else a list ``_tied_weights_keys`` with ``get_output_embeddings()`` tied to
    ``get_input_embeddings()`` when ``config.tie_word_embeddings`` (transformers 4).
    """
    out: dict[str, str] = {}
    for prefix, m in module.named_modules():
        config = getattr(m, "config", None)
        tie = config is None or bool(getattr(config, "tie_word_embeddings", False))
        ties = getattr(m, "all_tied_weights_keys", None)
        if not isinstance(ties, Mapping):
            ties = getattr(m, "_tied_weights_keys", None)
            if not tie:
                ties = None
            elif not isinstance(ties, Mapping):
                ties = _embedding_tie(m) if ties and config is not None else None
        for target, source in (ties or {}).items():
            if isinstance(target, str) and isinstance(source, str):
                out[prefix + "." + target if prefix else target] = (
                    prefix + "." + source if prefix else source
                )
    return out


def _embedding_tie(m: nn.Module) -> dict[str, str] | None:
    """``{output embedding weight: input embedding weight}`` by the module's getters."""
    get_out = getattr(m, "get_output_embeddings", None)
    get_in = getattr(m, "get_input_embeddings", None)
    if not (callable(get_out) and callable(get_in)):
        return None
    out_emb, in_emb = get_out(), get_in()
    names = {id(sub): name for name, sub in m.named_modules()}
    if id(out_emb) not in names or id(in_emb) not in names:
        return None
    return {names[id(out_emb)] + ".weight": names[id(in_emb)] + ".weight"}


def _meta_slots(module: nn.Module, m: _Matched, tie_weights: bool, refuse: bool = True) -> None:
    """Find the slots the state does not fill; fill its meta ones by a declared tie or raise.

    A meta tensor has a shape and no values: a call reading one computes on garbage (torch's
    CPU kernels read whatever memory there is). ``copy.deepcopy(model).to("meta")`` gives
    each slot its own meta Parameter, so the tie of two names is gone from the copy, and a
    state with one leaf per tie lacks the second name. The module's declared ties
    (:func:`_declared_ties`) give it back: the tensor given for any name of a declared tie
    fills the meta slots of the others (``m.extra``). Any other meta slot is a ``KeyError``
    (with ``refuse``; else it is left to the caller).
    """
    given_slots = {(id(o), a) for o, a in m.slots.values()}
    given_ids: dict[int, str] = {}
    if tie_weights:
        for name, (o, a) in m.slots.items():
            given_ids[id(_module_tensor(o, a))] = name
    meta: list[tuple[str, nn.Module, str, Tensor]] = []
    todo: list[tuple[str, nn.Module]] = [("", module)]
    seen: set[int] = set()
    while todo:  # every distinct submodule once, under its first name
        prefix, sub = todo.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        for d in (sub._parameters, sub._buffers):
            for attr, t in d.items():
                # the given slots first: a traced call (Dynamo, export) reads no attribute of a
                # tensor it does not use, so it does not make it an input of the graph
                if t is None or (id(sub), attr) in given_slots or id(t) in given_ids:
                    continue
                if t.is_meta:
                    meta.append((prefix + attr, sub, attr, t))
        todo += [(prefix + k + ".", c) for k, c in reversed(sub._modules.items()) if c is not None]
    if not meta:
        return
    linked: dict[str, set[str]] = {}
    for target, source in (_declared_ties(module) if tie_weights else {}).items():
        linked.setdefault(target, set()).add(source)
        linked.setdefault(source, set()).add(target)
    provider: dict[int, str] = {}  # id of a meta tensor -> the given name that fills it
    for dotted, _, _, t in meta:
        names, reached = [dotted], {dotted}
        while names and id(t) not in provider:
            for other in linked.get(names.pop(), ()):
                if other in reached:
                    continue
                reached.add(other)
                names.append(other)
                *path, attr = other.split(".")
                owner: nn.Module | None = module
                for part in path:
                    owner = owner._modules.get(part) if owner is not None else None
                ref = None if owner is None else _module_tensor(owner, attr)
                if ref is not None and id(ref) in given_ids:
                    provider[id(t)] = given_ids[id(ref)]
                    break
    missing: list[str] = []
    for dotted, sub, attr, t in meta:
        found = provider.get(id(t))
        if found is None:
            missing.append(dotted)
            continue
        v = m.out[found]
        if v.shape != t.shape:
            raise ValueError(
                SHAPE_MISMATCH.format(key=dotted, got=tuple(v.shape), expected=tuple(t.shape))
            )
        m.extra.setdefault(found, []).append((sub, attr))
    if missing and refuse:
        raise KeyError(META_MISSING.format(keys=missing, module=type(module).__name__))


def _full_match(module: nn.Module, state: Any, strict: bool, tie_weights: bool) -> _Matched:
    """Walk ``state`` against ``module``: names, slots, shapes, ties; ``strict``'s checks;
    meta slots the state does not fill (:func:`_meta_slots`)."""
    matched = _Matched(tie_weights)
    _match(state, module, matched)
    matched.check_stacked()
    matched.check_parameters()
    _meta_slots(module, matched, tie_weights)
    if strict:
        flat, unknown = matched.out, matched.unknown
        name = type(module).__name__
        own: dict[str, Tensor] = {}
        persistent: set[str] = set()
        _own_tensors(module, "", own, persistent)
        if unknown:
            raise KeyError(UNKNOWN_KEYS.format(keys=unknown, module=name, known=list(own)))
        declared = {id(_module_tensor(*s)) for slots in matched.extra.values() for s in slots}
        tied_given = {
            n for n in own if id(own[n]) in (matched.tied or {}) or id(own[n]) in declared
        }
        missing = [k for k in own if k in persistent and k not in flat and k not in tied_given]
        if missing:
            raise KeyError(MISSING_KEYS.format(keys=missing, module=name))
    return matched


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
    A buffer's shape is the state's: a buffer whose shape differs from the module's own
    (statistics that grow, as a quantization observer's do at its first call) is put into
    the slot as it is, as ``torch.func.functional_call`` does. A parameter's shape is the
    module's: one of another shape is a ``ValueError`` naming its key and both shapes, before
    the module runs (under ``torch.vmap`` the shape of one call is compared, so an ensemble
    of :func:`stack_modules` runs). A state *stacked over modules* (every tensor the module's
    shape with one leading dim of the same size, as :func:`stack_modules` makes) is refused
    before any computation outside ``torch.vmap``.
    Works under
    ``torch.vmap``, ``torch.func.grad``, ``torch.compile(fullgraph=True)`` and
    ``torch.export`` (strict and non-strict).

    **The tensors of** ``state`` **are never written and the module is left as it was.** The
    module runs on private copies of the given tensors put into its parameter and buffer slots
    (copy-on-write clones of parameters, copied only if the module writes them; copies of
    buffers, which are small state), and after the call, also
    when it raised, every slot holds the module's own tensor object again. Modules that update
    their state while they run (batch norm in training mode, counters, moving averages,
    observers, caches) do it on the copies, and

    * ``return_state=True`` returns ``(output, new_state)``: ``new_state`` has the structure
      and type of ``state``; each leaf the module wrote in place or reassigned is a new tensor
      holding the new value, every other leaf is the very same tensor object as in ``state``
      (``state`` itself when nothing was written). Persistent parameters or buffers the module
      *created* while it ran (registered, or a ``None`` buffer assigned) are added under their
      dotted names (nested keys of a TensorDict). Tied names get the same new tensor.
    * ``return_state=False`` (the default) raises ``PermissionError`` naming the module and the
      tensor if the module writes or creates state: the new value would otherwise be lost
      silently. Modules that write nothing (any module in eval mode, most models) are
      unaffected.

    Writes are read from torch, not guessed: the version counter of each copy, which the
    dispatcher bumps on every in-place write to the tensor or any of its views (``add_``,
    ``x[i] = v``, ``out=``, ``inplace=True``, writes inside C++ ops such as
    ``F.embedding(..., max_norm=...)``, foreach ops, ``nn.init``), the storage of each buffer
    (``x.data = v``) and the module's slots after the call (rebinding,
    ``self.count = self.count + 1``; state created). Under ``torch.compile`` the versions are
    known while tracing: no graph break, no run-time cost. Two kinds of torch kernels write
    without recording it, and their tensors are counted as written whenever their module takes
    part in the call: the running statistics of batch/instance norm modules in training mode,
    and the state of ``FusedMovingAvgObsFakeQuantize``. Under ``torch.compile`` torch's fake
    tensors record no version for in-place foreach ops (``torch._foreach_add_`` ...); the
    traced call counts, at trace time, every tensor a traced op's schema marks as written
    (under ``torch.func`` transforms too), so those writes are seen too; a tensor a schema
    marks as written that the kernel leaves as it was (``torch._fused_adagrad_``'s steps on
    CPU) then comes back as a new tensor of the same value. Torch's fused optimizer kernels
    (``torch._fused_adam_`` ...) record no version when they run eagerly: their writes to
    buffers are seen only in a compiled program. So compiled as eagerly, a tensor the module
    did not write comes back as the caller's own tensor object (no copy in the compiled
    program), and the ``PermissionError`` of ``return_state=False`` is raised by the compiled
    program itself when it runs, with its type and message (with or without ``fullgraph``). Dynamo does not trace
    ``x.data = v`` on a copy
    (``fullgraph=True`` stops with its error); inside
    ``torch.func`` transforms torch refuses ``x.data = v`` with its own error. Tensors not in
    ``state`` (``strict=False``) are the module's own and are used and updated as in PyTorch;
    non-persistent buffers the module creates are dropped with the rest of the call's changes
    to the module.

    Tied weights: with ``tie_weights=True`` the tensor given for any name of a tied tensor goes
    into every slot that holds it (:func:`from_module` gives one leaf per tied tensor); giving
    two different tensors for two names of one tensor is a ``ValueError``.

    Meta tensors (shapes, no values) are never computed on: a slot of ``module`` holding a meta
    tensor that ``state`` does not fill is filled by a tie the module declares (transformers'
    tied weights keys, or its output embedding tied to its input embedding) from the tensor
    given for another name of the tie, or else is a ``KeyError`` naming it, whatever
    ``strict`` says. So a structure-only copy ``copy.deepcopy(model).to("meta")``, whose slots
    each get their own meta tensor (the ties are gone), runs a state with one leaf per tie.

    Args:
        module: the module to call.
        state: the tensors to use (parameters and/or buffers).
        args: positional arguments of ``module`` (a single non-tuple value is one argument).
        kwargs: keyword arguments of ``module``.
        strict: when False, names absent from ``state`` use the module's own tensors and names
            the module does not have are ignored. When True, both raise ``KeyError`` (missing
            means a parameter or persistent buffer, i.e. a ``state_dict()`` name).
        tie_weights: tensors tied in the module stay tied: the tensor given for one of their
            names is used in every slot that holds them.
        return_state: return ``(output, new_state)`` instead of the output alone.

    Returns:
        Whatever ``module`` returns, or ``(output, new_state)`` when ``return_state=True``.

    Raises:
        ValueError: a parameter of another shape than the module's (the message names the
            key and both shapes; raised by the compiled program itself when compiled), a
            state stacked over modules outside ``torch.vmap`` (the message names the leading
            dim and a key with both shapes), or two tensors are given for the names of one
            tied tensor.
        KeyError: ``strict=True`` and keys are unknown or missing (the message lists them),
            or module tensors on the meta device that nothing given fills.
        PermissionError: ``return_state=False`` and the module wrote one of the given tensors
            or created a parameter or buffer.

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
    live, key = lookup(module, state, strict, tie_weights)
    if live is not None:
        prepared, tensors, alias = live.prepared, live.tensors, live.alias
    else:
        matched = _full_match(module, state, strict, tie_weights)
        flat, alias = matched.out, matched.alias
        prepared = Prepared.build(module, list(flat), matched.slots, tie_weights, matched.extra)
        tensors = list(flat.values())
        remember(module, key, state, prepared, alias)
    out, written, created = call_with_state(module, prepared, tensors, args, kwargs)
    if not return_state:
        # found after the module ran: a compiled program raises it when it runs (refuse)
        if written:
            refuse(PermissionError, _written_message(module, next(iter(written))))
        elif created:
            refuse(
                PermissionError,
                STATE_CREATED.format(key=next(iter(created)), cls=type(module).__name__),
            )
        return out
    new = state if not written else _new_state(state, "", written, alias)
    for name, value in created.items():
        new = _with_created(new, name, value)
    return out, new


def _with_created(state: Any, key: str, value: Tensor) -> Any:
    """``state`` with a tensor the module created while it ran, under its dotted name."""
    if isinstance(state, TensorDict):
        return state.set(tuple(key.split(".")), value)
    if isinstance(state, Mapping):
        mapping_type: Any = type(state)
        return mapping_type({**state, key: value})
    if isinstance(state, (tuple, list)) and state:
        return type(state)([*state[:-1], _with_created(state[-1], key, value)])
    raise TypeError(STATE_NO_ROOM.format(key=key, typ=type(state).__name__))


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


__all__ = ["from_module", "functional_call", "stack_modules", "state_dict"]
