"""Redistribution of DTensor leaves as one cached compiled graph: :func:`redistribute`,
:func:`full_tensor`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from ..._keys import fmt_key
from ..._tree import KeyPath, leaves_with_paths, map_leaves
from .._common import errors as E
from .._common.agree import check, placements_of, reject
from .._common.caches import register
from .._common.mesh import check_node, common_mesh
from .._common.placements import PlacementSpec
from . import plan as plan_mod
from .local import T, leaf_targets, rank_in
from .plan import LeafSig, Plan

#: torch.compile backend of the redistribution graphs unless ``backend=`` says otherwise.
DEFAULT_BACKEND = "aot_eager"
#: agreed transitions remembered per mesh (see :func:`agreed_plan`)
CACHE_SIZE = 512


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def agreed_plan(
    op: str, mesh: DeviceMesh, paths: tuple[KeyPath, ...], sigs: tuple[LeafSig, ...]
) -> tuple[Plan, tuple[int, ...], tuple[Any, ...]]:
    """The plan of a redistribution, checked across the ranks: once per transition.

    Memoized by ``(op, mesh, key paths, leaf signatures)``: a cache hit costs one lookup (the
    same hashing the plan cache needs anyway), and the comparable text is only built on a
    miss. Returns ``(plan, order, specs)`` as :func:`~.plan.cached_plan`; ``ValueError`` for
    a leaf whose local shard does not fit (after telling the other ranks) or ranks that
    disagree.
    """
    plan, order, bad, specs = plan_mod.cached_plan(mesh, sigs)
    if bad is not None:
        reject(op, mesh)
        sig = sigs[bad.position]
        raise ValueError(
            E.LOCAL_SHAPE.format(
                key=fmt_key(paths[bad.position]),
                local=sig.local,
                shape=sig.shape,
                placements=list(sig.src),
                mesh_shape=tuple(mesh.shape),
                expected=bad.expected,
            )
        )
    check(
        op,
        "redistribute",
        mesh,
        paths,
        tuple(s.shape for s in sigs),
        tuple(s.dtype for s in sigs),
        placements_of([s.src for s in sigs]),
        placements_of([s.dst for s in sigs]),
    )
    return plan, order, specs


def _run(
    op: str,
    pairs: Sequence[tuple[KeyPath, DTensor]],
    mesh: DeviceMesh,
    targets: Sequence[tuple[Placement, ...]],
    compile: bool,
    backend: Any,
    unwrap: bool = False,
) -> list[Tensor]:
    """New leaves for ``pairs`` (DTensors only) moved to ``targets``; their local shards
    when ``unwrap``.

    With ``compile``, the ranks of the mesh first check that they all ask for the same
    transition (once per cached transition); without it this code may be traced into the
    caller's graph, where no eager communication can run, so the caller's ranks must agree.
    """
    sigs = tuple(plan_mod.signature(x, t) for (_, x), t in zip(pairs, targets))
    if compile:
        plan, order, specs = agreed_plan(op, mesh, tuple(p for p, _ in pairs), sigs)
    else:
        plan, order, bad = plan_mod.build_plan(mesh, sigs)
        if bad is not None:
            raise _bad_leaf(pairs, sigs, bad, mesh)
    new: list[Any] = [x for _, x in pairs]  # DTensors, replaced by the moved leaves
    if not order:
        return [x.to_local() for x in new] if unwrap else new
    if not compile:
        for i, y in zip(order, plan_mod.run_plan([new[i] for i in order], plan)):
            new[i] = y
        return [x.to_local() for x in new] if unwrap else new
    # The cached graph moves local shards. With autograd in play, DTensor.to_local /
    # from_local keep the graph connected; without it, the cheap unwrap / wrap is enough.
    fn = plan_mod.compiled(plan, backend)
    moved = set(order)
    if torch.is_grad_enabled() and any(new[i].requires_grad for i in order):
        outs = fn([new[i].to_local() for i in order])
        if unwrap:
            return _merge(new, order, outs, moved)
        for i, y in zip(order, outs):
            sig = sigs[i]
            new[i] = DTensor.from_local(
                y,
                mesh,
                sig.dst,
                run_check=False,
                shape=torch.Size(sig.shape),
                stride=plan_mod.contiguous_stride(sig.shape),
            )
        return new
    outs = fn([plan_mod.local_of(new[i]) for i in order])
    if unwrap:
        return _merge(new, order, outs, moved)
    for i, y, spec in zip(order, outs, specs):
        new[i] = plan_mod.box(y, spec)
    return new


def _bad_leaf(
    pairs: Sequence[tuple[KeyPath, DTensor]],
    sigs: Sequence[plan_mod.LeafSig],
    bad: plan_mod.BadLeaf,
    mesh: DeviceMesh,
) -> ValueError:
    """The error for a leaf whose local shard does not fit its global shape."""
    sig = sigs[bad.position]
    return ValueError(
        E.LOCAL_SHAPE.format(
            key=fmt_key(pairs[bad.position][0]),
            local=sig.local,
            shape=sig.shape,
            placements=list(sig.src),
            mesh_shape=tuple(mesh.shape),
            expected=bad.expected,
        )
    )


def _merge(
    old: list[DTensor], order: Sequence[int], outs: Sequence[Tensor], moved: set[int]
) -> list[Tensor]:
    """Local shards: the graph's results where leaves moved, ``to_local`` elsewhere."""
    new = [x if i in moved else x.to_local() for i, x in enumerate(old)]
    for i, y in zip(order, outs):
        new[i] = y
    return new


def dtensor_pairs(
    td: Any, op: str
) -> tuple[list[tuple[KeyPath, Tensor]], list[int], DeviceMesh | None]:
    pairs = leaves_with_paths(td)
    mesh = common_mesh(pairs)
    idx = [i for i, (_, x) in enumerate(pairs) if isinstance(x, DTensor)]
    if mesh is not None:
        rank_in(mesh, op)
    return pairs, idx, mesh


def redistribute(
    td: T, placements: PlacementSpec, *, compile: bool = True, backend: Any = DEFAULT_BACKEND
) -> T:
    """Move every DTensor leaf to new placements, as one compiled graph.

    Leaves sharing a (source placements, target placements, dtype) transition are packed into
    one flat buffer and redistributed once, so the collectives do not grow with the number of
    leaves. Uneven shards are padded when that keeps DTensor's chunk boundaries (one shard
    count per tensor dim and side); other uneven leaves are redistributed one by one inside the
    same graph. Results equal ``DTensor.redistribute`` leaf by leaf.

    Args:
        td: a container whose DTensor leaves share one DeviceMesh (plain tensor leaves pass
            through unchanged).
        placements: as in :func:`distribute`; DTensor leaves left out keep their placements.
        compile: ``True`` runs the cached ``torch.compile(fullgraph=True)`` graph of this
            transition (compiled, and checked across the ranks, on first use); ``False`` runs
            the same coalesced code eagerly, e.g. inside a function that is itself being
            compiled (no cross-rank check: it would be eager communication inside a graph).
        backend: the ``torch.compile`` backend.

    Returns:
        A container of the same type and batch size.

    Raises:
        ValueError: leaves on different meshes, wrong number of placements, a shard dim past
            a leaf's ndim (the message names the key path); ranks of the mesh that ask for
            different placements or pass containers with different keys, global shapes or
            dtypes (raised on every rank, checked once per cached transition when
            ``compile=True``).

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard, Replicate
        >>> from tdfunc.distributed import distribute, redistribute
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> td = distribute(tdfunc.TensorDict(x=torch.ones(4, 2), batch_size=[4]), mesh,
        ...                 [Shard(0)])
        >>> redistribute(td, [Replicate()], backend="eager")["x"].placements
        (Replicate(),)
    """
    check_node(td, "redistribute")
    pairs, idx, mesh = dtensor_pairs(td, "redistribute")
    if mesh is None:
        return td
    dpairs: list[tuple[KeyPath, DTensor]] = [pairs[i] for i in idx]  # type: ignore[misc]
    if compile:
        try:
            targets = leaf_targets(td, dpairs, placements, mesh, lambda x: x.placements)
        except (TypeError, ValueError, KeyError):
            reject("redistribute", mesh)  # the other ranks raise too instead of waiting
            raise
    else:  # may be traced into the caller's graph: no eager communication here
        targets = leaf_targets(td, dpairs, placements, mesh, lambda x: x.placements)
    moved = _run("redistribute", dpairs, mesh, targets, compile, backend)
    new = [x for _, x in pairs]
    for i, y in zip(idx, moved):
        new[i] = y
    return map_leaves(td, new)


def full_tensor(td: T, *, compile: bool = True, backend: Any = DEFAULT_BACKEND) -> T:
    """Every DTensor leaf as a full plain tensor (the replication runs as one compiled,
    coalesced graph; see :func:`redistribute`).

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import distribute, full_tensor
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> td = distribute(tdfunc.TensorDict(x=torch.arange(4.0), batch_size=[4]), mesh,
        ...                 [Shard(0)])
        >>> full_tensor(td, backend="eager")["x"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    check_node(td, "full_tensor")
    pairs, idx, mesh = dtensor_pairs(td, "full_tensor")
    if mesh is None:
        return td
    dpairs: list[tuple[KeyPath, DTensor]] = [pairs[i] for i in idx]  # type: ignore[misc]
    targets = [(Replicate(),) * mesh.ndim] * len(dpairs)
    moved = _run("full_tensor", dpairs, mesh, targets, compile, backend, unwrap=True)
    new = [x for _, x in pairs]
    for i, y in zip(idx, moved):
        new[i] = y
    return map_leaves(td, new)
