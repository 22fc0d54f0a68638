"""What crosses ``tdfunc.compile``'s boundary: jagged leaves as their parts, per-sample
values as row ids.

A container argument of a function compiled with :func:`tdfunc.compile` may hold data whose
natural form costs a compile each time it changes, or keeps the compile out of torch's
caches. At the boundary (eager code around the call, never traced) such a container is
passed in another form, and the function sees the container it was given:

* **A jagged leaf** (``torch.nested``, ``layout=torch.jagged``, ragged dim 1) crosses as
  dense tensors: its values take its place in the container, and its offsets (and lengths,
  when it has them) are passed beside it. Inside the compiled function the leaf is built
  again with ``torch.nested.nested_tensor_from_jagged`` (traced) before the function runs.
  The graph's inputs are then plain tensors, so inductor's FX graph cache and AOTAutograd's
  cache key it (a jagged input has no stable cache hash: torch skips the AOTAutograd cache
  and warns), and the values' ragged dim is marked dynamic (``maybe_mark_dynamic``), so a
  new total length does not compile again. Jagged outputs come back as jagged tensors.
* **A per-sample non-tensor value** (:meth:`tdfunc.NonTensor.per_sample`, e.g. a list of
  strings per row) crosses as its row ids: an integer tensor of its batch shape numbering
  its rows in a table kept here, outside the graph (:class:`tdfunc._nontensor.RowIds`).
  Indexing, ``stack``, ``cat``, ``split`` and every batch shape op move the ids as they move
  a tensor leaf, so the graph never depends on the values and new values never compile
  again. After the call the outputs' row ids are looked up in the table and the outputs hold
  the values again. Reading the value inside raises ``TypeError`` naming the key.

Containers passed directly as positional or keyword arguments cross this way; containers
nested in lists, tuples or dicts, and bare jagged tensors, are passed as they are (torch's
own handling). The inputs are never modified: the boundary builds new containers around the
same tensors (a view of a jagged leaf's values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import maybe_mark_dynamic
from .._keys import fmt_key
from .._nontensor import NonTensor, RowIds, flat_values, row_ids
from .._nontensor import _from_flat as nontensor_from_flat
from .._tree import KeyPath, Node, is_node, leaves, leaves_and_nontensors, map_leaves, with_leaves
from ._layout import is_jagged

#: per container argument that holds jagged leaves: ``(argument, ((leaf index, has lengths),
#: ...))``, the argument a position or a keyword (static: part of the compiled structure)
Plan = tuple[tuple["int | str", tuple[tuple[int, bool], ...]], ...]


class Crossing:
    """The arguments of one call as they cross (see the module docs): containers with their
    jagged leaves as values and per-sample values as row ids, the jagged leaves' other parts,
    and the table of the per-sample values the row ids number."""

    __slots__ = ("args", "kwargs", "parts", "plan", "table")

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        plan: Plan,
        parts: list[Tensor],
        table: list[Any],
    ) -> None:
        self.args = args
        self.kwargs = kwargs
        self.plan = plan
        self.parts = parts
        self.table = table


def _nontensor_paths(node: Node, prefix: KeyPath, out: list[KeyPath]) -> list[KeyPath]:
    """The key paths of ``node``'s non-tensor leaves, in the order of
    :func:`tdfunc._tree.leaves_and_nontensors` (only walked when one is per sample)."""
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if isinstance(v, NonTensor):
            out.append((*prefix, k))
        elif isinstance(v, Node):
            _nontensor_paths(v, (*prefix, k), out)
    return out


def _crosses_as_it_is(node: Node) -> bool:
    """True when ``node`` holds no jagged leaf and no per-sample value (the common case,
    answered before any rebuild; one pass, ~0.1 us a leaf)."""
    for v in node._data.values() if node._tdf_dict_layout else node._tdf_children():
        if type(v) is Tensor:
            if v.is_nested:
                return False
        elif isinstance(v, Node):
            if not _crosses_as_it_is(v):
                return False
        elif isinstance(v, Tensor):
            if v.is_nested:
                return False
        elif isinstance(v, NonTensor) and v.shape is not None:
            return False
    return True


def _device_of(node: Node, ls: Sequence[Tensor]) -> torch.device:
    """Where a node's row ids live: its device, else its first leaf's (the index tensors of
    the ops that move them are made there)."""
    dev = node._device
    if dev is not None:
        return torch.device(dev)
    return ls[0].device if ls else torch.device("cpu")


def _cross(node: Node, table: list[Any]) -> tuple[Node, tuple[tuple[int, bool], ...], list[Tensor]]:
    """``node`` as it crosses (itself when nothing in it needs to), the positions of its
    jagged leaves with whether each has lengths, and their offsets / lengths in order."""
    ls, nts = leaves_and_nontensors(node)
    slots: list[tuple[int, bool]] = []
    parts: list[Tensor] = []
    new_ls: list[Tensor] | None = None
    if any(t.is_nested for t in ls):
        for i, t in enumerate(ls):
            nt: Any = t  # a jagged tensor: offsets(), lengths(), its ragged dim
            if not is_jagged(nt) or nt._ragged_idx != 1:  # another ragged dim: as it is
                continue
            if new_ls is None:
                new_ls = list(ls)
            values = nt.values()  # a new view: marking it leaves the caller's tensor alone
            maybe_mark_dynamic(values, 0)
            new_ls[i] = values
            lengths = nt.lengths()
            parts.append(nt.offsets())
            if lengths is not None:
                parts.append(lengths)
            slots.append((i, lengths is not None))
    new_nts: list[NonTensor] | None = None
    if any(nt.shape is not None and type(nt) is NonTensor for _, nt in nts):
        paths = _nontensor_paths(node, (), [])
        device = _device_of(node, ls)
        new_nts = []
        for path, (bs, nt) in zip(paths, nts):
            if nt.shape is None or type(nt) is not NonTensor:
                new_nts.append(nt)
                continue
            start = len(table)
            table.extend(flat_values(nt, bs))
            ids = torch.arange(start, len(table), device=device).reshape(nt.shape)
            new_nts.append(row_ids(ids, fmt_key(path)))
    if new_ls is None and new_nts is None:
        return node, (), parts
    return map_leaves(node, ls if new_ls is None else new_ls, nts=new_nts), tuple(slots), parts


def enter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Crossing | None:
    """The arguments of a call as they cross the boundary, or ``None`` when no container
    argument holds a jagged leaf or a per-sample value (they pass as they are). Eager.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(x=torch.ones(2), text=["a", "b"], batch_size=[2])
        >>> c = enter((td,), {})
        >>> c.args[0]._data["text"], c.table
        (NonTensor(<row ids of shape (2,)>, per_sample=True), ['a', 'b'])
        >>> enter((tdfunc.TensorDict(x=torch.ones(2)),), {}) is None
        True
    """
    table: list[Any] = []
    plan: list[tuple[int | str, tuple[tuple[int, bool], ...]]] = []
    parts: list[Tensor] = []
    new_args: list[Any] | None = None
    new_kwargs: dict[str, Any] | None = None
    arguments: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    for where, x in arguments:
        if not is_node(x) or _crosses_as_it_is(x):
            continue
        crossed, slots, p = _cross(x, table)
        if crossed is x:
            continue
        if slots:
            plan.append((where, slots))
            parts.extend(p)
        if isinstance(where, int):
            new_args = list(args) if new_args is None else new_args
            new_args[where] = crossed
        else:
            new_kwargs = dict(kwargs) if new_kwargs is None else new_kwargs
            new_kwargs[where] = crossed
    if new_args is None and new_kwargs is None:
        return None
    return Crossing(
        args if new_args is None else tuple(new_args),
        kwargs if new_kwargs is None else new_kwargs,
        tuple(plan),
        parts,
        table,
    )


def inside(
    plan: Plan, parts: Sequence[Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments the function is given: each jagged leaf of ``plan`` built again from
    its values (in its place) and its offsets and lengths (``parts``, in order). Traced.

    Example:
        >>> import torch, tdfunc
        >>> nt = torch.nested.nested_tensor([torch.ones(1), torch.ones(2)], layout=torch.jagged)
        >>> c = enter((tdfunc.TensorDict(x=nt, batch_size=[2]),), {})
        >>> c.args[0]["x"].shape, c.plan
        (torch.Size([3]), ((0, ((0, False),)),))
        >>> (td,), _ = inside(c.plan, c.parts, c.args, c.kwargs)
        >>> [r.tolist() for r in td["x"].unbind()]
        [[1.0], [1.0, 1.0]]
    """
    if not plan:
        return args, kwargs
    new_args = list(args)
    new_kwargs = dict(kwargs)
    k = 0
    for where, slots in plan:
        node = new_args[where] if isinstance(where, int) else new_kwargs[where]
        ls = leaves(node)
        for i, has_lengths in slots:
            offsets = parts[k]
            lengths = parts[k + 1] if has_lengths else None
            k += 2 if has_lengths else 1
            ls[i] = torch.nested.nested_tensor_from_jagged(ls[i], offsets, lengths)
        if isinstance(where, int):
            new_args[where] = with_leaves(node, ls)
        else:
            new_kwargs[where] = with_leaves(node, ls)
    return tuple(new_args), new_kwargs


def _resolve(x: Any, table: Sequence[Any]) -> Any:
    """``x`` with the row ids in it replaced by the values they number (itself when none)."""
    if isinstance(x, RowIds):
        return _values_of(x, table)
    if not is_node(x):
        return x
    ls, nts = leaves_and_nontensors(x)
    if not any(type(nt) is RowIds for _, nt in nts):
        return x
    new = [_values_of(nt, table) if isinstance(nt, RowIds) else nt for _, nt in nts]
    return map_leaves(x, ls, nts=new)


def _values_of(nt: RowIds, table: Sequence[Any]) -> NonTensor:
    ids = nt.ids
    flat = [table[i] for i in ids.reshape(-1).tolist()]
    return nontensor_from_flat(flat, tuple(ids.shape))


def leave(out: Any, crossing: Crossing | None) -> Any:
    """The outputs of a call with the row ids in them back as values (eager; ``out`` itself
    when no per-sample value crossed).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(x=torch.ones(3), text=["a", "b", "c"], batch_size=[3])
        >>> c = enter((td,), {})
        >>> leave(c.args[0][torch.tensor([2, 0])], c)["text"]
        ('c', 'a')
    """
    if crossing is None or not crossing.table:
        return out
    table = crossing.table
    if isinstance(out, RowIds) or is_node(out):
        return _resolve(out, table)
    if isinstance(out, (tuple, list, dict)):
        from .._compat import pytree

        return pytree.tree_map(lambda x: _resolve(x, table), out, is_leaf=_stops)
    return out


def _stops(x: Any) -> bool:
    return is_node(x) or isinstance(x, RowIds)
