"""Container helpers for :mod:`tdfunc.distributed`: one mesh per container, batch sizes of
local shards and global tensors (on top of the core's leaves, paths and rebuild)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..._keys import fmt_key, get_path
from ..._tree import KeyPath, is_node, leaves_with_paths, map_leaves
from . import errors as E


def check_node(node: Any, op: str) -> None:
    """``TypeError`` unless ``node`` is a TensorDict or a tensorclass."""
    if not is_node(node):
        raise TypeError(E.NOT_A_CONTAINER.format(op=op, typ=type(node).__name__))


def common_mesh(pairs: Sequence[tuple[KeyPath, Tensor]]) -> DeviceMesh | None:
    """The one mesh of the DTensor leaves (None without DTensor leaves); ``ValueError`` if mixed."""
    mesh: DeviceMesh | None = None
    first: KeyPath = ()
    for path, x in pairs:
        if isinstance(x, DTensor):
            m = x.device_mesh
            if mesh is None:
                mesh, first = m, path
            elif m is not mesh and m != mesh:
                raise ValueError(
                    E.MIXED_MESH.format(
                        key=fmt_key(path),
                        mesh=describe_mesh(m),
                        first_key=fmt_key(first),
                        first_mesh=describe_mesh(mesh),
                    )
                )
    return mesh


def describe_mesh(mesh: DeviceMesh) -> str:
    """``DeviceMesh(ranks=[[0, 1]], dim_names=('dp',))``: the ranks tell meshes apart."""
    return f"DeviceMesh(ranks={mesh.mesh.tolist()}, dim_names={mesh.mesh_dim_names})"


def _agreed(shapes: Sequence[torch.Size], limit: int) -> torch.Size:
    """The longest common prefix (at most ``limit`` dims) of ``shapes``."""
    if not shapes:
        return torch.Size(())
    first = shapes[0]
    n = min(limit, *(len(s) for s in shapes))
    for i in range(n):
        if any(s[i] != first[i] for s in shapes):
            return first[:i]
    return first[:n]


def rebatch(node: Any, new_leaves: Sequence[Tensor]) -> Any:
    """``node`` with ``new_leaves`` (same ndims, new sizes: local shards <-> global tensors).

    The batch size becomes the longest prefix of the old batch dims on which all new leaves
    agree: a container sharded along its batch dims keeps them, with the local (or global)
    sizes; one whose leaves disagree keeps only the dims they share. Nested containers keep
    their extra batch dims when every leaf below them still has those sizes, else they take
    the root's new batch size: every node of the result satisfies the batch-size invariant.
    """
    if not new_leaves:
        return map_leaves(node, new_leaves)
    bd = len(node._batch_size)
    bs = _agreed([x.shape for x in new_leaves], bd)
    keep_extra = len(bs) == bd and all(
        x.shape[: len(owner)] == owner
        for (path, _), x in zip(leaves_with_paths(node), new_leaves)
        for owner in [bs + _owner_batch(node, path)[bd:]]
    )
    return map_leaves(node, new_leaves, bs, keep_extra=keep_extra)


def _owner_batch(node: Any, path: KeyPath) -> torch.Size:
    """Batch size of the node holding the leaf at ``path``."""
    return node._batch_size if len(path) == 1 else get_path(node, path[:-1])._batch_size
