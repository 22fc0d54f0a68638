"""Container helpers for :mod:`tdfunc.distributed`: leaves, one mesh, rebuilt batch sizes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import _errors as E
from .._keys import fmt_key
from .._tree import KeyPath, is_node


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


def node_paths(node: Any, prefix: KeyPath = ()) -> list[KeyPath]:
    """Every key path of leaves and nested containers."""
    out: list[KeyPath] = []
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        if v is None:
            continue
        out.append(prefix + (k,))
        if is_node(v):
            out.extend(node_paths(v, prefix + (k,)))
    return out


def _agreed(shapes: Sequence[torch.Size], limit: int) -> int:
    """How many leading dims (at most ``limit``) all ``shapes`` share."""
    n = limit
    for s in shapes:
        n = min(n, len(s))
    first = shapes[0] if shapes else None
    for i in range(n):
        if any(s[i] != first[i] for s in shapes):  # type: ignore[index]
            return i
    return n


def _rebuild(node: Any, it: Iterator[Tensor]) -> tuple[Any, torch.Size | None]:
    children: list[Any] = []
    shapes: list[torch.Size] = []
    for v in node._tdf_children():
        if isinstance(v, Tensor):
            t = next(it)
            children.append(t)
            shapes.append(t.shape)
        elif v is None:
            children.append(None)
        else:
            sub, sub_bs = _rebuild(v, it)
            children.append(sub)
            shapes.append(sub_bs if sub_bs is not None else sub._batch_size)
    bd = len(node._batch_size)
    if not shapes:
        return node._tdf_rebuild(children, node._batch_size, node._device), None
    n = _agreed(shapes, bd)
    bs = torch.Size(shapes[0][:n])
    return node._tdf_rebuild(children, bs, node._device), bs


def rebuild_batch(node: Any, new_leaves: Sequence[Tensor]) -> Any:
    """``node`` with ``new_leaves``; each batch size becomes the longest prefix of the old batch
    dims on which all of its (new) children agree.

    Used when leaves change shape (local shards <-> global tensors): a container sharded along
    its batch dims keeps them, with the local (or global) sizes; one whose leaves disagree
    keeps only the dims they share.
    """
    out, _ = _rebuild(node, iter(new_leaves))
    return out
