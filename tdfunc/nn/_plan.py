"""The slot plan of :func:`tdfunc.functional_call`, kept between calls and validated on each.

A call's *plan* is everything that depends on the module and on the structure of the given
state, not on the tensors' values: the walk of the module (every distinct submodule, the slots
holding ``None``, the norm and fake-quantize modules), the tie map, which slot each key of the
state names and which keys are second names of a tied tensor. Working it out walks the module
and the state and resolves every dotted name; it is the same work for every call of a training
loop. So the plan is kept, per module and per *(structure of the state, strict, tie_weights)*,
and used again only after a check, on every call, that the module is still the one it was made
for (:meth:`Plan.live`):

* every module of the walk, found again from the module called through the same submodule
  slots, is of the same class, and its ``_parameters``, ``_buffers`` and ``_modules`` hold
  the same names, in the same order, with objects of the same identities (``id``; or
  ``None``) as when the plan was made; its set of non-persistent buffers is the same. This
  sees a parameter or buffer registered, deleted or replaced (by another tensor, another
  ``Parameter`` object or ``None``), a submodule added, removed or replaced, weights tied or
  untied (a slot then holds another object), a parameter turned into a plain attribute (its
  name leaves ``_parameters``);
* every given tensor has the shape of the module tensor it replaces or the shape the tensor
  under its key had when the plan was made (a state whose shapes are its own, as observers'
  grown statistics: the full path accepted those shapes, and a state made of the module's
  shapes and those cannot be stacked over modules, which is all the full path refuses), and
  the tensor given for a second name of a tied tensor is the one given for its first name
  (both depend on the values, not the structure, so they are checked as the full path checks
  them).

When any check fails, the call takes the full path (which raises the right error, if there is
one) and its plan replaces the old one. The copies, the write marks, the created-state check
and everything else that depends on values run on every call, exactly as on the full path.

An identity recorded for an object that has died since may belong to a new object now, and
that does not matter: the objects compared are all alive (a slot holds each), so equal
identities mean the same objects are shared between slots (ties, a submodule under two names)
and the same slots hold ``None``, which is all the plan took from the objects themselves.
Which slots hold meta tensors (filled by a declared tie, or refused: ``_meta_slots`` of
``_functional``) is a property of those objects too: torch refuses to move a tensor object to
or from the meta device in place (``.data =``, ``set_``), so the identities cover it and the
plan checks nothing more per call.

Nothing here holds the module: the cache is a :class:`weakref.WeakKeyDictionary` keyed by the
module, and a plan records identities and names only (it keeps neither a module nor a replaced
tensor alive). This is eager boundary code around the call:
while Dynamo traces :func:`tdfunc.functional_call`, :func:`lookup` is replaced by a twin that
finds nothing (``_twins``), :func:`remember` is given no key and stores nothing, and the
traced call takes the full path (whose result the compiled graph holds as constants).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Mapping
from typing import Any

from torch import Tensor, nn

from .._tree import is_node, leaves_with_paths
from ..tensordict import TensorDict
from ._state import Prepared, Slot, _Snapshot, same_tensor

#: plans kept per module (one per state structure and options); more clears them
_MAX_PLANS = 8
#: module -> {(state structure, strict, tie_weights): plan}
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Plan]] = weakref.WeakKeyDictionary()
#: a ``None`` child in a structure key (a tensor child is its key alone, a node child is the
#: key and the node's own structure key)
_NONE = 1


# --------------------------------------------------------------------------------------
# the structure of a state
# --------------------------------------------------------------------------------------
def _node_structure(
    node: Any, prefix: str, leaves: list[Tensor], names: list[str] | None
) -> Hashable | None:
    """The key of a node's structure, its leaves (and dotted names), in the order of the
    full path's walk (``_match_node``); None for what that walk does not take."""
    if isinstance(node, TensorDict):
        items: Any = node._data.items()
    else:
        items = zip(node._tdf_keys(), node._tdf_children())
    parts: list[Any] = [type(node)]
    for k, v in items:
        if isinstance(v, Tensor):
            leaves.append(v)
            if names is not None:
                names.append(prefix + k)
            parts.append(k)  # a tensor child: its key alone
        elif v is None:
            parts.append((k, _NONE))
        elif is_node(v):
            sub = _node_structure(v, prefix + k + ".", leaves, names)
            if sub is None:
                return None
            parts.append((k, sub))
        else:
            return None
    return tuple(parts)


def _mapping_structure(
    m: Mapping[Any, Any], prefix: str, leaves: list[Tensor], names: list[str] | None
) -> Hashable | None:
    """As :func:`_node_structure`, for a mapping (the full path's ``_flat_mapping``)."""
    parts: list[Any] = [type(m)]
    for k, v in m.items():
        if not isinstance(k, str):
            return None
        if isinstance(v, Tensor):
            leaves.append(v)
            if names is not None:
                names.append(prefix + k)
            parts.append(k)  # a tensor child: its key alone
        elif is_node(v):
            pairs = leaves_with_paths(v)
            leaves.extend(t for _, t in pairs)
            if names is not None:
                names.extend(prefix + k + "." + ".".join(p) for p, _ in pairs)
            sub = _node_structure(v, "", [], None)
            if sub is None:
                return None
            parts.append((k, sub))
        elif isinstance(v, Mapping):
            sub = _mapping_structure(v, prefix + k + ".", leaves, names)
            if sub is None:
                return None
            parts.append((k, sub))
        else:
            return None
    return tuple(parts)


def structure(state: Any, leaves: list[Tensor], names: list[str] | None = None) -> Hashable | None:
    """The hashable structure of ``state`` (None: a state the full path alone handles).

    Appends the leaves of ``state`` to ``leaves`` (and their dotted names to ``names``) in the
    order the full path gives them names.

    Example:
        >>> import torch
        >>> leaves, names = [], []
        >>> key = structure({"w": torch.ones(1), "sub": {"b": torch.ones(1)}}, leaves, names)
        >>> names, hash(key) == hash(structure({"w": 1.0, "sub": {}}, []))
        (['w', 'sub.b'], False)
    """
    if is_node(state):
        return _node_structure(state, "", leaves, names)
    if isinstance(state, Mapping):
        return _mapping_structure(state, "", leaves, names)
    if isinstance(state, (tuple, list)):
        parts: list[Any] = [type(state)]
        for p in state:
            sub = structure(p, leaves, names)
            if sub is None:
                return None
            parts.append(sub)
        return tuple(parts)
    return None


# --------------------------------------------------------------------------------------
# plans
# --------------------------------------------------------------------------------------
def _slots_of(d: dict[str, Any]) -> tuple[list[str], list[int]] | None:
    """What :meth:`Plan.live` compares of one slot dictionary: its names and the identity of
    each object it holds (or of ``None``), in order; None for an empty dictionary."""
    return (list(d), list(map(id, d.values()))) if d else None


class Live:
    """A plan checked against the module and the given tensors: ready for one call."""

    __slots__ = ("alias", "prepared", "tensors")

    def __init__(self, prepared: Prepared, tensors: list[Tensor], alias: dict[str, str]) -> None:
        self.prepared = prepared
        #: the given tensors, one per name of ``prepared``
        self.tensors = tensors
        #: a second name of a tied tensor -> the first name (whose tensor the module uses)
        self.alias = alias


class Plan:
    """The plan of one module for one state structure, holding no module and no tensor.

    Modules are numbered in the order of the walk (the root is 0); a slot is a module number,
    whether it is a buffer slot, and the attribute name.
    """

    __slots__ = (
        "alias",
        "any_none",
        "direct",
        "fused",
        "is_buffer",
        "leaf_of",
        "modules",
        "names",
        "norms",
        "observers",
        "shapes",
        "sizes",
        "slots",
        "swap_names",
        "swap_src",
        "swap_to",
        "untied",
        "walk",
        "where",
    )

    def __init__(
        self,
        prepared: Prepared,
        leaf_names: list[str],
        alias: dict[str, str],
        shapes: list[Any] | None = None,
    ) -> None:
        snapshot = prepared.snapshot
        index = {id(m): i for i, (_, m, _, _, _) in enumerate(snapshot.modules)}

        def at(slot: Slot) -> tuple[int, bool, str]:
            m, attr = slot
            return index[id(m)], attr not in m._parameters, attr

        #: per module of the walk: where the live walk finds it (the number of the module that
        #: holds it under its first name, and that name; -1 and "" for the root), its class,
        #: :func:`_slots_of` its ``_parameters``, ``_buffers`` and ``_modules``, and its
        #: non-persistent buffer names (None: no buffer slot)
        at_prefix = {p: i for i, (p, _, _, _, _) in enumerate(snapshot.modules)}
        self.modules: list[tuple[Any, ...]] = []
        for prefix, m, _, _, _ in snapshot.modules:
            parent, _, name = prefix[:-1].rpartition(".")
            self.modules.append(
                (
                    at_prefix[parent + "." if parent else ""] if prefix else -1,
                    name,
                    type(m),
                    _slots_of(m._parameters),
                    _slots_of(m._buffers),
                    _slots_of(m._modules),
                    frozenset(m._non_persistent_buffers_set) if m._buffers else None,
                )
            )
        #: the snapshot without its modules: (prefix, counts, None slots) per module
        self.walk = [
            (p, n_params, n_buffers, nones) for p, _, n_params, n_buffers, nones in snapshot.modules
        ]
        self.sizes, self.any_none = snapshot.sizes, snapshot.any_none
        self.norms = [index[id(m)] for m in snapshot.norms]
        self.fused = snapshot.fused
        self.observers = [index[i] for i in snapshot.fused_observers if i in index]
        self.names = prepared.names
        self.is_buffer = prepared.is_buffer
        self.slots = [at(s) for s in prepared.slots]
        self.where = [
            None if w is None else [(dotted, at(s)) for dotted, s in w] for w in prepared.where
        ]
        self.swap_names = prepared.swap_names
        #: per slot filled: its dictionary's position in the flat list of slot dictionaries
        #: (``_parameters`` then ``_buffers`` of each module), and the attribute
        self.swap_to = [
            (2 * index[id(m)] + (d is m._buffers), attr)
            for (d, attr), (m, _) in zip(prepared.swap_to, _swap_slots(prepared))
        ]
        #: ``where`` when no name fills more than its own slot (shared between calls: read only)
        self.untied = None if prepared.tied else prepared.where
        self.swap_src = prepared.swap_src
        self.alias = alias
        #: the shape of each leaf of the state the plan was made with (accepted by the full path)
        self.shapes: list[Any] = [None] * len(leaf_names) if shapes is None else shapes
        position = {n: i for i, n in enumerate(prepared.names)}
        #: per leaf of the state: the slot of the given name it is (or of the first name of
        #: the tied tensor it is a second name of), the index of that name, and whether it is
        #: such a second name; or None for a key the module does not have
        self.leaf_of: list[tuple[int, bool, str, int, bool] | None] = []
        for n in leaf_names:
            first = n if n in position else alias.get(n)
            if first is None:
                self.leaf_of.append(None)
            else:
                i = position[first]
                self.leaf_of.append((*self.slots[i], i, first != n))
        #: every leaf of the state is a given name, in the order of the names (no second name
        #: of a tied tensor, no key the module does not have)
        self.direct = [
            of[3] if of is not None and not of[4] else -1 for of in self.leaf_of
        ] == list(range(len(prepared.names)))

    def live(self, module: nn.Module, leaves: list[Tensor]) -> Live | None:
        """The plan for this call, or None when the module changed or a tensor does not fit
        (the full path then finds out what, and raises what it raises)."""
        # Each module is found as the walk found it, through its parent's submodule slot, and
        # compared with what the plan recorded (see the module's docstring).
        mods: list[nn.Module] = []
        dicts: list[dict[str, Any]] = []
        for parent, name, cls, params, buffers, subs, non_persistent in self.modules:
            m = module if parent < 0 else mods[parent]._modules[name]
            if type(m) is not cls:  # also None: the class recorded is a module class
                return None
            # the three dictionaries against what _slots_of recorded (written out: the hot loop)
            p, b, s = m._parameters, m._buffers, m._modules
            if params is None:
                if p:
                    return None
            elif list(map(id, p.values())) != params[1] or list(p) != params[0]:
                return None
            if buffers is None:
                if b:
                    return None
            elif (
                list(map(id, b.values())) != buffers[1]
                or list(b) != buffers[0]
                or m._non_persistent_buffers_set != non_persistent
            ):
                return None
            if subs is None:
                if s:
                    return None
            elif list(map(id, s.values())) != subs[1] or list(s) != subs[0]:
                return None
            mods.append(m)
            dicts += (p, b)
        if self.direct:  # leaf j is the tensor of name j: the state's leaves, in order
            for v, (i, buffer, attr), shape in zip(leaves, self.slots, self.shapes):
                if v.shape != shape and v.shape != dicts[2 * i + buffer][attr].shape:
                    return None
            tensors: list[Tensor | None] = leaves  # type: ignore[assignment]
        else:
            tensors = [None] * len(self.names)
            for v, of, shape in zip(leaves, self.leaf_of, self.shapes):
                if of is None:
                    continue
                i, buffer, attr, k, second = of
                if v.shape != shape and v.shape != dicts[2 * i + buffer][attr].shape:
                    return None
                if second:
                    first = tensors[k]
                    if first is None or not same_tensor(v, first):
                        return None
                else:
                    tensors[k] = v
        given: list[Tensor] = tensors  # type: ignore[assignment]  # every name has its leaf
        # only what call_with_state reads (``prefixes`` and ``by_id`` serve Prepared.build)
        snapshot = _Snapshot.__new__(_Snapshot)
        snapshot.modules = [(p, m, n, b, nones) for (p, n, b, nones), m in zip(self.walk, mods)]
        snapshot.norms = [mods[i] for i in self.norms] if self.norms else []
        snapshot.fused = self.fused
        snapshot.fused_observers = {id(mods[i]) for i in self.observers}
        snapshot.sizes, snapshot.any_none = self.sizes, self.any_none
        where = self.untied
        if where is None:
            where = [
                None if w is None else [(d, (mods[i], attr)) for d, (i, _, attr) in w]
                for w in self.where
            ]
        prepared = Prepared(
            snapshot,
            self.names,
            [(mods[i], attr) for i, _, attr in self.slots],
            self.is_buffer,
            where,
            (self.swap_names, [(dicts[i], attr) for i, attr in self.swap_to], self.swap_src),
        )
        return Live(prepared, given, self.alias)


def _swap_slots(prepared: Prepared) -> list[Slot]:
    """The slot of each name of ``prepared.swap_names``."""
    out: list[Slot] = []
    for slot, where in zip(prepared.slots, prepared.where):
        out.extend([slot] if where is None else [s for _, s in where])
    return out


def lookup(
    module: nn.Module, state: Any, strict: bool, tie_weights: bool
) -> tuple[Live | None, Hashable | None]:
    """The validated plan of this call (None: take the full path), and the key to remember
    the full path's plan under (None: not to be remembered)."""
    leaves: list[Tensor] = []
    shape = structure(state, leaves)
    if shape is None:
        return None, None
    key = (shape, strict, tie_weights)
    plans = _PLANS.get(module)
    plan = None if plans is None else plans.get(key)
    if plan is None:
        return None, key
    return plan.live(module, leaves), key


def remember(
    module: nn.Module,
    key: Hashable | None,
    state: Any,
    prepared: Prepared,
    alias: dict[str, str],
) -> None:
    """Keep the full path's plan for the next calls with a state of this structure."""
    if key is None:
        return
    names: list[str] = []
    leaves: list[Tensor] = []
    structure(state, leaves, names)
    if len(set(names)) != len(names):
        return  # a name given twice (the full path keeps the last one): not planned
    plans = _PLANS.get(module)
    if plans is None:
        plans = _PLANS[module] = {}
    elif len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = Plan(prepared, names, alias, [t.shape for t in leaves])


__all__ = ["Live", "Plan", "lookup", "remember", "structure"]
