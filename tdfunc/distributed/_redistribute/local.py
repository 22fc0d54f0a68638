"""Plain leaves <-> DTensor leaves: :func:`distribute`, :func:`from_local`, :func:`to_local`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from ..._keys import fmt_key, walk
from ..._tree import KeyPath, Node, leaves_with_paths, map_leaves
from .._common import errors as E
from .._common import wire
from .._common.agree import check, placements_of, reject
from .._common.mesh import check_node, describe_mesh, rebatch
from .._common.placements import PlacementSpec, normalize, resolve
from . import plan as plan_mod

#: a container type (TensorDict or a tensorclass): functions return the type they are given
T = TypeVar("T", bound=Node)

ShapeSpec = (
    Mapping[str | tuple[str, ...], Sequence[int]] | Callable[[KeyPath, Tensor], Sequence[int]]
)


def rank_in(mesh: DeviceMesh, op: str) -> tuple[int, ...]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(
            E.NOT_IN_MESH.format(rank=dist.get_rank(), mesh=describe_mesh(mesh), op=op)
        )
    return tuple(coord)


def leaf_targets(
    node: Any,
    pairs: Sequence[tuple[KeyPath, Tensor]],
    spec: Any,
    mesh: DeviceMesh,
    default: Callable[[Any], Sequence[Placement]],
) -> list[tuple[Placement, ...]]:
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        # one spec for every leaf: its validity depends only on the leaf's ndim
        memo: dict[int, tuple[Placement, ...]] = {}
        out = []
        for path, x in pairs:
            nd = x.dim()
            if nd not in memo:
                memo[nd] = normalize(path, spec, tuple(x.shape), mesh)
            out.append(memo[nd])
        return out
    asked = resolve(pairs, spec, [p for p, _ in walk(node)], type(node).__name__)
    return [
        normalize(path, default(x) if a is None else a, tuple(x.shape), mesh)
        for (path, x), a in zip(pairs, asked)
    ]


# --------------------------------------------------------------------------------------
# plain <-> DTensor
# --------------------------------------------------------------------------------------
def _broadcast(tensors: Sequence[Tensor], mesh: DeviceMesh, src: int) -> list[Tensor]:
    """Every leaf from global rank ``src`` to all ranks of ``mesh``: one byte buffer, one
    broadcast per mesh dim."""
    hit = (mesh.mesh == src).nonzero()
    if hit.shape[0] == 0:
        raise ValueError(E.SRC_NOT_IN_MESH.format(src=src, mesh=describe_mesh(mesh)))
    src_coord = hit[0].tolist()
    device = torch.device(mesh.device_type)
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total = -(-(total + n) // wire.ALIGN) * wire.ALIGN
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for t, off, n in zip(tensors, offsets, sizes):
        if n:
            buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    for d in range(mesh.ndim):
        dist.broadcast(buf, group=mesh.get_group(d), group_src=src_coord[d])
    return [
        (buf[off : off + n].view(t.dtype) if n else t.detach().to(device)).reshape(t.shape)
        for t, off, n in zip(tensors, offsets, sizes)
    ]


def distribute(
    td: T, mesh: DeviceMesh, placements: PlacementSpec, *, src_data_rank: int | None = 0
) -> T:
    """Shard or replicate every leaf of ``td`` over ``mesh``.

    Args:
        td: a TensorDict or tensorclass of plain tensors (the same structure and shapes on every
            rank of the mesh).
        mesh: the DeviceMesh; this rank must belong to it.
        placements: one placement per mesh dim for every leaf, a mapping from key paths (a
            nested container's path covers its leaves; the longest prefix wins) to placements,
            or a callable ``(key_path, leaf) -> placements or None``; leaves left out are
            replicated.
        src_data_rank: global rank whose values are used (all leaves are broadcast from it in
            one byte buffer, one collective per mesh dim); ``None`` uses each rank's own
            values with no communication.

    Returns:
        A container of the same type whose leaves are DTensors with the global shapes of
        ``td``'s leaves (its batch size is unchanged).

    Raises:
        TypeError: a leaf is already a DTensor, or a placement is not a Placement.
        ValueError: wrong number of placements, a shard dim past a leaf's ndim, this rank or
            ``src_data_rank`` outside the mesh; ranks of the mesh that pass containers with
            different keys, shapes or dtypes or ask for different placements (raised on every
            rank before any data moves).
        KeyError: the mapping names a key that does not exist.

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import distribute
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3), b={"c": torch.ones(4)}, batch_size=[4])
        >>> out = distribute(td, mesh, {"a": [Shard(1)]})
        >>> out["a"].placements, out["b", "c"].placements
        ((Shard(dim=1),), (Replicate(),))
    """
    check_node(td, "distribute")
    rank_in(mesh, "distribute")
    pairs = leaves_with_paths(td)
    try:
        for path, x in pairs:
            if isinstance(x, DTensor):
                raise TypeError(E.ALREADY_DTENSOR.format(key=fmt_key(path)))
        targets = leaf_targets(td, pairs, placements, mesh, lambda x: [Replicate()] * mesh.ndim)
    except (TypeError, ValueError, KeyError):
        reject("distribute", mesh)  # the other ranks raise too instead of waiting
        raise
    check(  # every call: distribute is a one-off that moves the whole container anyway
        "distribute",
        f"distribute(src_data_rank={src_data_rank})",
        mesh,
        tuple(p for p, _ in pairs),
        tuple(tuple(x.shape) for _, x in pairs),
        tuple(x.dtype for _, x in pairs),
        (),
        placements_of(targets),
    )
    values = [x for _, x in pairs]
    if src_data_rank is not None:
        values = _broadcast(values, mesh, src_data_rank)
    new = []
    for (_, x), v, pl in zip(pairs, values, targets):
        d = distribute_tensor(v, mesh, pl, src_data_rank=None)
        new.append(d.requires_grad_(x.requires_grad) if x.requires_grad else d)
    return map_leaves(td, new)


def from_local(
    td: T, mesh: DeviceMesh, placements: PlacementSpec, *, shapes: ShapeSpec | None = None
) -> T:
    """DTensors from this rank's local shards (``DTensor.from_local`` leaf by leaf; no
    communication).

    Args:
        td: a container of local shards (plain tensors).
        mesh: the DeviceMesh; this rank must belong to it.
        placements: as in :func:`distribute` (leaves left out are replicated).
        shapes: the global shape of each leaf (a mapping from key paths, or a callable
            ``(key_path, local) -> shape``). Without it, shards are assumed even (the global
            size along a sharded dim is the local size times the mesh size). Needed for uneven
            shards; each given shape is checked against the local shard.

    Returns:
        A container of DTensors. Its batch size keeps the leading batch dims on which all the
        global leaves agree (a container sharded along its batch dims gets the global sizes).

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import from_local
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> local = tdfunc.TensorDict(x=torch.ones(2, 3), batch_size=[2])
        >>> from_local(local, mesh, [Shard(0)])["x"].shape
        torch.Size([2, 3])
    """
    check_node(td, "from_local")
    coord = rank_in(mesh, "from_local")
    pairs = leaves_with_paths(td)
    for path, x in pairs:
        if isinstance(x, DTensor):
            raise TypeError(E.ALREADY_DTENSOR.format(key=fmt_key(path)))
    given = (
        [None] * len(pairs)
        if shapes is None
        else resolve(pairs, shapes, [p for p, _ in walk(td)], type(td).__name__)
    )
    targets = leaf_targets(td, pairs, placements, mesh, lambda x: [Replicate()] * mesh.ndim)
    new = []
    for (path, x), pl, shape in zip(pairs, targets, given):
        if shape is None:
            new.append(DTensor.from_local(x, mesh, pl, run_check=False))
            continue
        shape = tuple(int(s) for s in shape)
        expected = plan_mod.local_shape(shape, tuple(mesh.shape), pl, coord)
        if expected != tuple(x.shape):
            raise ValueError(
                E.LOCAL_SHAPE.format(
                    key=fmt_key(path),
                    local=tuple(x.shape),
                    shape=shape,
                    placements=list(pl),
                    mesh_shape=tuple(mesh.shape),
                    expected=expected,
                )
            )
        new.append(
            DTensor.from_local(
                x,
                mesh,
                pl,
                run_check=False,
                shape=torch.Size(shape),
                stride=plan_mod.contiguous_stride(shape),
            )
        )
    return rebatch(td, new)


def to_local(td: T) -> T:
    """This rank's local shard of every DTensor leaf (plain leaves pass through).

    No communication; differentiable like ``DTensor.to_local``. The batch size keeps the
    leading batch dims on which all local shards agree (a container sharded along its batch
    dims gets the local sizes).

    Example:
        >>> import torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import distribute, to_local
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> td = distribute(tdfunc.TensorDict(x=torch.ones(4), batch_size=[4]), mesh, [Shard(0)])
        >>> type(to_local(td)["x"]).__name__
        'Tensor'
    """
    check_node(td, "to_local")
    new = [x.to_local() if isinstance(x, DTensor) else x for _, x in leaves_with_paths(td)]
    return rebatch(td, new)
