"""Redistribution plans: group leaves by placement transition, coalesce each group into one
flat buffer, and run the whole transition as one compiled graph.

How a group is coalesced
------------------------
Take the leaves that share a mesh, a dtype, source placements ``S`` and target placements
``T``. Let ``U`` be the tensor dims sharded by ``S`` or ``T``; for ``u`` in ``U``, ``a_u`` (``b_u``)
is the product of the sizes of the mesh dims that shard ``u`` in ``S`` (``T``), and
``L_u = lcm(a_u, b_u)``. A leaf whose ``u`` dim has ``P_u`` elements (``L_u`` divides ``P_u``)
is cut into ``L_u`` blocks of ``w_u = P_u / L_u`` along each ``u``; moving the block indices to
the front and flattening everything else gives a ``(L_u1, ..., L_uk, F)`` tensor, whose
``S``-chunks (``T``-chunks) along block dim ``j`` are exactly the leaf's ``S`` (``T``) shards
along ``u_j``. All leaves of the group have the same leading block dims, so they concatenate
along the last dim into one buffer. The buffer is redistributed once with
``DTensor.redistribute`` (``Shard(u_j)`` becomes ``Shard(j)``; ``Replicate`` and ``Partial`` stay)
and split back. A group therefore needs the collectives of one tensor, whatever its size.

Uneven shards: when every ``u`` is sharded by at most one mesh dim on each side and
``a_u == 1``, ``b_u == 1`` or ``a_u == b_u``, the leaf is zero-padded at the end of each ``u``
to ``P_u = L_u * ceil(size / L_u)``. Padding at the end keeps DTensor's ``torch.chunk``
boundaries (chunk ``r`` starts at ``r * ceil(size / n)``), so each rank pads its shard to the
common size before and narrows the result to its real size after. Other uneven cases (nested
sharding of one dim, or two different shard counts on the two sides) keep exact DTensor
semantics by redistributing those leaves one by one, inside the same compiled graph.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ..._compat import DTensorSpec, TensorMeta
from .._common.caches import register

Placements = tuple[Placement, ...]

#: compiled graphs kept alive (one per transition and backend)
CACHE_SIZE = 128


class Item(NamedTuple):
    """One leaf of a coalesced group (all sizes are static ints)."""

    shape: tuple[int, ...]  # global shape
    padded_src: tuple[int, ...]  # local shape under S after padding (empty: no padding)
    dst_local: tuple[int, ...]  # real local shape under T (the result is narrowed to it)
    widths: tuple[int, ...]  # w_u for u in U
    rest: tuple[int, ...]  # sizes of the dims not in U, in order
    numel_row: int  # F: elements per buffer row


class Group(NamedTuple):
    """Leaves sharing one transition. ``coalesce=False``: redistribute them one by one."""

    coalesce: bool
    src: Placements
    dst: Placements
    dims: tuple[int, ...]  # U
    blocks: tuple[int, ...]  # L_u
    src_div: tuple[int, ...]  # a_u
    dst_div: tuple[int, ...]  # b_u
    buf_src: Placements  # placements of the group buffer
    buf_dst: Placements
    items: tuple[Item, ...]


class Plan(NamedTuple):
    """A whole transition: the mesh and the groups, in the order of the compiled inputs."""

    mesh: DeviceMesh
    groups: tuple[Group, ...]


# --------------------------------------------------------------------------------------
# placements as plain tuples: hashable, comparable, and traceable by Dynamo (which cannot
# compare Placement objects themselves)
# --------------------------------------------------------------------------------------
def kind(p: Placement) -> tuple[Any, ...]:
    """``("shard", dim)``, ``("replicate",)``, ``("partial", op)``, or ``("other", p)``."""
    if isinstance(p, Shard):
        return ("shard", p.dim)
    if isinstance(p, Replicate):
        return ("replicate",)
    if isinstance(p, Partial) and type(p) is Partial:
        return ("partial", p.reduce_op)
    return ("other", p)


def kinds(ps: Sequence[Placement]) -> tuple[tuple[Any, ...], ...]:
    """:func:`kind` of each placement."""
    return tuple(kind(p) for p in ps)


def _simple(ks: Sequence[tuple[Any, ...]]) -> bool:
    return all(k[0] != "other" for k in ks)


# --------------------------------------------------------------------------------------
# shapes under placements (DTensor semantics: torch.chunk per mesh dim, mesh dims in order)
# --------------------------------------------------------------------------------------
def local_shape(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Placements,
    coord: Sequence[int],
) -> tuple[int, ...]:
    """This rank's shard shape for a global ``shape`` (``Shard`` dims chunked like ``torch.chunk``).

    Example:
        >>> from torch.distributed.tensor import Shard, Replicate
        >>> local_shape((5, 3), (2,), (Shard(0),), (1,))
        (2, 3)
    """
    return _local_shape(shape, mesh_shape, kinds(placements), coord)


def _local_shape(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    ks: Sequence[tuple[Any, ...]],
    coord: Sequence[int],
) -> tuple[int, ...]:
    out = list(shape)
    for i, k in enumerate(ks):
        if k[0] == "shard":
            size = out[k[1]]
            cs = -(-size // mesh_shape[i]) if size else 0
            out[k[1]] = max(0, min(cs, size - coord[i] * cs))
    return tuple(out)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _divisors(
    ks: Sequence[tuple[Any, ...]], dims: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[list[int], list[int]]:
    prod = [1] * len(dims)
    count = [0] * len(dims)
    for i, k in enumerate(ks):
        if k[0] == "shard":
            j = dims.index(k[1])
            prod[j] *= mesh_shape[i]
            count[j] += 1
    return prod, count


class LeafSig(NamedTuple):
    """What a plan depends on for one leaf (hashable: plans are cached by these)."""

    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    src: Placements
    local: tuple[int, ...]  # this rank's local shape
    dst: Placements


def signature(x: DTensor, dst: Placements) -> LeafSig:
    """The :class:`LeafSig` of DTensor ``x`` moving to ``dst``."""
    return LeafSig(
        tuple(x.shape), x.dtype, tuple(x.placements), tuple(x._local_tensor.shape), tuple(dst)
    )


class BadLeaf(NamedTuple):
    """A leaf whose local shard does not match its global shape and placements."""

    position: int  # in the leaf signatures
    expected: tuple[int, ...]


def build_plan(
    mesh: DeviceMesh, sigs: Sequence[LeafSig]
) -> tuple[Plan, tuple[int, ...], BadLeaf | None]:
    """Group the leaves that change placements.

    Returns the plan, the positions (in ``sigs``) of the moved leaves in the order the plan
    takes and gives them back, and the first leaf whose local shard does not fit (or None).
    Pure Python on static metadata: Dynamo traces it when a caller compiles around it.
    """
    mesh_shape = tuple(mesh.shape)
    coord = tuple(mesh.get_coordinate() or ())  # callers check that this rank is in the mesh
    buckets: dict[tuple[Any, ...], list[tuple[int, Item]]] = {}
    meta: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for pos, sig in enumerate(sigs):
        ks, kd = kinds(sig.src), kinds(sig.dst)
        if ks == kd:
            continue
        shape = sig.shape
        if _simple(ks):
            expected = _local_shape(shape, mesh_shape, ks, coord)
            if expected != sig.local:
                return Plan(mesh, ()), (), BadLeaf(pos, expected)
        grouping = coalescing(shape, ks, kd, mesh_shape)
        if grouping is None:
            key = (False, ks, kd, sig.dtype)
            buckets.setdefault(key, []).append((pos, Item(shape, (), (), (), (), 0)))
            meta[key] = (sig.src, sig.dst, (), (), (), ())
            continue
        dims, blocks, a, b = grouping
        item = make_item(shape, ks, kd, dims, blocks, mesh_shape, coord)
        key = (True, ks, kd, sig.dtype)
        buckets.setdefault(key, []).append((pos, item))
        meta[key] = (sig.src, sig.dst, dims, blocks, a, b)
    groups: list[Group] = []
    order: list[int] = []
    for key, members in buckets.items():
        src, dst, dims, blocks, a, b = meta[key]
        groups.append(
            make_group(key[0], src, dst, dims, blocks, a, b, tuple(it for _, it in members))
        )
        order.extend(pos for pos, _ in members)
    return Plan(mesh, tuple(groups)), tuple(order), None


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def cached_plan(
    mesh: DeviceMesh, sigs: tuple[LeafSig, ...]
) -> tuple[Plan, tuple[int, ...], BadLeaf | None, tuple[DTensorSpec, ...]]:
    """:func:`build_plan` memoized by value (a transition is planned once), plus the
    ``DTensorSpec`` of each moved leaf's result, in plan order."""
    plan, order, bad = build_plan(mesh, sigs)
    specs = tuple(
        DTensorSpec(
            mesh,
            sigs[i].dst,
            tensor_meta=TensorMeta(
                torch.Size(sigs[i].shape), contiguous_stride(sigs[i].shape), sigs[i].dtype
            ),
        )
        for i in order
    )
    return plan, order, bad, specs


# The two helpers below are the fast path for results that need no autograd: they skip
# DTensor.to_local / DTensor.from_local (autograd functions that rebuild and re-check the
# spec on every call, ~100x the cost of this) by reading the local shard and building the
# DTensor from a spec computed once per transition.
def local_of(x: DTensor) -> Tensor:
    """``x``'s local shard (no autograd node)."""
    return x._local_tensor


def box(local: Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over ``local`` with a precomputed ``spec`` (no autograd node)."""
    return DTensor(local, spec, requires_grad=False)


def make_item(
    shape: tuple[int, ...],
    ks: Sequence[tuple[Any, ...]],
    kd: Sequence[tuple[Any, ...]],
    dims: tuple[int, ...],
    blocks: tuple[int, ...],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
) -> Item:
    """The static sizes of one leaf of a coalesced group, for the rank at ``coord``."""
    padded = [lu * -(-shape[u] // lu) for u, lu in zip(dims, blocks)]
    pad = any(p != shape[u] for p, u in zip(padded, dims))
    full_padded = list(shape)
    for u, p in zip(dims, padded):
        full_padded[u] = p
    rest = tuple(s for d, s in enumerate(shape) if d not in dims)
    widths = tuple(p // lu for p, lu in zip(padded, blocks))
    return Item(
        shape=shape,
        padded_src=_local_shape(full_padded, mesh_shape, ks, coord) if pad else (),
        dst_local=_local_shape(shape, mesh_shape, kd, coord),
        widths=widths,
        rest=rest,
        numel_row=math.prod(widths) * math.prod(rest),
    )


def make_group(
    coalesce: bool,
    src: Placements,
    dst: Placements,
    dims: tuple[int, ...],
    blocks: tuple[int, ...],
    a: tuple[int, ...],
    b: tuple[int, ...],
    items: tuple[Any, ...],
) -> Group:
    """A :class:`Group` with its buffer placements derived."""
    return Group(
        coalesce=coalesce,
        src=src,
        dst=dst,
        dims=dims,
        blocks=blocks,
        src_div=a,
        dst_div=b,
        buf_src=_buffer_placements(src, dims) if coalesce else (),
        buf_dst=_buffer_placements(dst, dims) if coalesce else (),
        items=items,
    )


def coalescing(
    shape: tuple[int, ...],
    src: Sequence[tuple[Any, ...]],
    dst: Sequence[tuple[Any, ...]],
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``(U, L, a, b)`` when the leaf can join a flat buffer, else None.

    Even leaves always can; uneven ones when the transition is paddable (see the module
    docstring), which depends on the transition only, so even and padded leaves share a group.
    """
    if not (_simple(src) and _simple(dst)):
        return None
    dims = tuple(sorted({k[1] for k in (*src, *dst) if k[0] == "shard"}))
    a, ka = _divisors(src, dims, mesh_shape)
    b, kb = _divisors(dst, dims, mesh_shape)
    blocks = tuple(math.lcm(x, y) for x, y in zip(a, b))
    paddable = all(
        x <= 1 and y <= 1 and (p == 1 or q == 1 or p == q) for x, y, p, q in zip(ka, kb, a, b)
    )
    if paddable or all(shape[u] % lu == 0 for u, lu in zip(dims, blocks)):
        return dims, blocks, tuple(a), tuple(b)
    return None


# --------------------------------------------------------------------------------------
# the traced function
# --------------------------------------------------------------------------------------
def _front(dims: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """The permutation that brings ``dims`` to the front, the other dims after, in order."""
    return (*dims, *(d for d in range(ndim) if d not in dims))


def to_rows(t: Tensor, g: Group, it: Item) -> Tensor:
    """A leaf's local shard as ``(L_u1 / a_u1, ..., F)`` rows of the group buffer.

    Permutations that are the identity are skipped (each op costs time when the graph runs
    op by op): with one sharded dim ``u = 0`` this is a single reshape.
    """
    k = len(g.dims)
    if it.padded_src:
        pads: list[int] = []
        for d in reversed(range(t.ndim)):
            pads.extend((0, it.padded_src[d] - t.shape[d]))
        t = torch.nn.functional.pad(t, pads)
    if k == 0:
        return t.reshape(-1)
    front = _front(g.dims, t.ndim)
    if front != tuple(range(t.ndim)):
        t = t.permute(*front)
    rows = [lu // au for lu, au in zip(g.blocks, g.src_div)]
    if k > 1:
        split: list[int] = []
        for nb, wu in zip(rows, it.widths):
            split.extend((nb, wu))
        t = t.reshape(*split, math.prod(it.rest))
        t = t.permute(*range(0, 2 * k, 2), *range(1, 2 * k, 2), 2 * k)
    return t.reshape(*rows, it.numel_row)


def from_rows(t: Tensor, g: Group, it: Item) -> Tensor:
    """Inverse of :func:`to_rows` on the target side: rows back to this rank's shard."""
    k = len(g.dims)
    ndim = len(it.shape)
    if k == 0:
        return t.reshape(it.dst_local)
    nb = [lu // bu for lu, bu in zip(g.blocks, g.dst_div)]
    if k > 1:
        t = t.reshape(*nb, *it.widths, *it.rest)
        inter: list[int] = []
        for j in range(k):
            inter.extend((j, k + j))
        t = t.permute(*inter, *range(2 * k, 2 * k + len(it.rest)))
    t = t.reshape(*[n * w for n, w in zip(nb, it.widths)], *it.rest)
    front = _front(g.dims, ndim)
    if front != tuple(range(ndim)):
        t = t.permute(*[front.index(d) for d in range(ndim)])
    if it.padded_src:
        for u in g.dims:
            t = t.narrow(u, 0, it.dst_local[u])
    return t.contiguous()


def _buffer_placements(ps: Placements, dims: tuple[int, ...]) -> Placements:
    """Placements of the group buffer: ``Shard(u_j)`` becomes ``Shard(j)``."""
    return tuple(Shard(dims.index(p.dim)) if isinstance(p, Shard) else p for p in ps)


def _coalesced(mesh: DeviceMesh, g: Group, xs: Sequence[Any], local: bool) -> list[Tensor]:
    """One group through one buffer. ``local``: ``xs`` and the results are local shards."""
    rows = [to_rows(x if local else x.to_local(), g, it) for x, it in zip(xs, g.items)]
    buf = torch.cat(rows, dim=-1)
    total = sum(it.numel_row for it in g.items)
    gshape = (*g.blocks, total)
    bd = DTensor.from_local(
        buf,
        mesh,
        g.buf_src,
        run_check=False,
        shape=torch.Size(gshape),
        stride=contiguous_stride(gshape),
    )
    out = bd.redistribute(mesh, g.buf_dst).to_local()
    pieces = torch.split(out, [it.numel_row for it in g.items], dim=-1)
    shards = [from_rows(p, g, it) for p, it in zip(pieces, g.items)]
    if local:
        return shards
    return [
        DTensor.from_local(
            t,
            mesh,
            g.dst,
            run_check=False,
            shape=torch.Size(it.shape),
            stride=contiguous_stride(it.shape),
        )
        for t, it in zip(shards, g.items)
    ]


def _one(mesh: DeviceMesh, g: Group, x: Any, it: Item, local: bool) -> Tensor:
    """A leaf that cannot join a buffer: DTensor's own redistribution."""
    if not local:
        return x.redistribute(mesh, g.dst)
    d = DTensor.from_local(
        x,
        mesh,
        g.src,
        run_check=False,
        shape=torch.Size(it.shape),
        stride=contiguous_stride(it.shape),
    )
    return d.redistribute(mesh, g.dst).to_local()


def run_plan(
    leaves: Sequence[Tensor], plan: Plan | None = None, local: bool = False
) -> list[Tensor]:
    """Apply ``plan`` to the moved leaves, traced by torch.compile or run eagerly.

    ``local=False``: DTensors in and out (differentiable, traceable inside a caller's
    compiled function). ``local=True``: local shards in and out, the form of the cached
    compiled graphs; the caller wraps the results with ``DTensor.from_local``.
    """
    assert plan is not None
    out: list[Tensor] = []
    start = 0
    for g in plan.groups:
        xs = leaves[start : start + len(g.items)]
        start += len(g.items)
        if g.coalesce:
            out.extend(_coalesced(plan.mesh, g, xs, local))
        else:
            out.extend(_one(plan.mesh, g, x, it, local) for x, it in zip(xs, g.items))
    return out


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def compiled(plan: Plan, backend: Any) -> Callable[[Sequence[Tensor]], list[Tensor]]:
    """One ``torch.compile(fullgraph=True)`` function per (plan, backend), cached by value:
    local shards in, local shards out (see :func:`run_plan`).

    Dynamo keeps its compiled graphs on the code object and caps how many variants one code
    object may hold; every plan gets its own copy of :func:`run_plan`'s code object (with the
    plan as its default argument), so each transition owns exactly one graph and any number
    of transitions can coexist.
    """
    code = run_plan.__code__.replace(co_name="tdfunc_redistribute")
    fn = types.FunctionType(code, run_plan.__globals__, "tdfunc_redistribute", (plan, True))
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
