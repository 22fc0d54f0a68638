"""Placements: structured JSON encoding, per-leaf resolution of a placement spec, validation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..._compat import StridedShard
from ..._keys import KeyPath, as_path, fmt_key
from . import errors as E

#: A placement spec: one sequence for every leaf, a mapping from key paths (a string or a
#: tuple of strings; a nested container's path covers every leaf below it) to sequences, or a
#: callable ``(key_path, leaf) -> sequence | None``.
PlacementSpec = (
    Sequence[Placement]
    | Mapping[str | tuple[str, ...], Sequence[Placement]]
    | Callable[[KeyPath, Tensor], Sequence[Placement] | None]
)
Placements = tuple[Placement, ...]


class MeshShape(Protocol):
    """What placement checks read from a mesh: a ``DeviceMesh`` or a rank array
    (:class:`~.._transfer.plan.Grid`)."""

    @property
    def ndim(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


# --------------------------------------------------------------------------------------
# JSON encoding (structural: never str(p), never pickle)
# --------------------------------------------------------------------------------------
def encode_placement(p: Placement, key: KeyPath = ()) -> dict[str, Any]:
    """A JSON-ready dict describing ``p``.

    Example:
        >>> from torch.distributed.tensor import Shard, Partial
        >>> encode_placement(Shard(1)), encode_placement(Partial("max"))
        ({'type': 'shard', 'dim': 1}, {'type': 'partial', 'reduce_op': 'max'})
    """
    typ = type(p)  # exact types: a subclass may carry state the encoding would drop
    if typ is Shard:
        return {"type": "shard", "dim": int(cast(Shard, p).dim)}
    if typ is Replicate:
        return {"type": "replicate"}
    if typ is Partial:
        return {"type": "partial", "reduce_op": str(cast(Partial, p).reduce_op)}
    if typ is StridedShard:
        ss = cast(StridedShard, p)
        return {"type": "strided_shard", "dim": int(ss.dim), "split_factor": int(ss.split_factor)}
    raise TypeError(
        E.UNENCODABLE_PLACEMENT.format(
            key=fmt_key(key) if key else "?", placement=p, typ=typ.__name__
        )
    )


def _reduce_ops() -> frozenset[str]:
    """The reduce ops torch's collectives take by name (``torch.distributed.ReduceOp``'s,
    lower case), the names ``Partial(reduce_op)`` documents; ``premul_sum`` needs a factor a
    name cannot carry."""
    names = {n.lower() for n in dist.ReduceOp.RedOpType.__members__}
    return frozenset(names - {"premul_sum"})


#: every ``reduce_op`` :func:`decode_placement` accepts for ``Partial``
REDUCE_OPS = _reduce_ops()
#: the fields of each encoded placement type (:func:`encode_placement` writes exactly these)
_FIELDS = {
    "shard": ("type", "dim"),
    "replicate": ("type",),
    "partial": ("type", "reduce_op"),
    "strided_shard": ("type", "dim", "split_factor"),
}


def _field(obj: dict[str, Any], name: str, detail: str) -> E.PlacementFormatError:
    return E.PlacementFormatError(E.BAD_PLACEMENT_FIELD.format(obj=obj, field=name, detail=detail))


def _int_field(obj: dict[str, Any], name: str, low: int) -> int:
    v = obj[name]
    if type(v) is not int:  # a bool is not a dim
        raise _field(obj, name, f"must be an int, got {type(v).__name__}")
    if v < low:
        raise _field(obj, name, f"must be >= {low}, got {v}")
    return v


def decode_placement(obj: Any) -> Placement:
    """Inverse of :func:`encode_placement`: accepts exactly what it writes (dims ints >= 0,
    a ``reduce_op`` among :data:`REDUCE_OPS`, no other field); :class:`PlacementFormatError`
    (a ``ValueError``) naming the field otherwise.

    Example:
        >>> decode_placement({"type": "shard", "dim": 0})
        Shard(dim=0)
    """
    kind = obj.get("type") if isinstance(obj, dict) else None
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise E.PlacementFormatError(E.BAD_PLACEMENT_JSON.format(obj=obj))
    for name in fields:
        if name not in obj:
            raise _field(obj, name, "is missing")
    for name in obj:
        if name not in fields:
            raise _field(obj, name, f"is not a field of a {kind} placement")
    if kind == "shard":
        return Shard(_int_field(obj, "dim", 0))
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        op = obj["reduce_op"]
        if not isinstance(op, str) or op not in REDUCE_OPS:
            raise E.PlacementFormatError(
                E.BAD_REDUCE_OP.format(obj=obj, op=op, ops=", ".join(sorted(REDUCE_OPS)))
            )
        return Partial(op)
    dim = _int_field(obj, "dim", 0)
    return StridedShard(dim, split_factor=_int_field(obj, "split_factor", 1))


def encode_placements(ps: Sequence[Placement], key: KeyPath = ()) -> list[dict[str, Any]]:
    """Encode a placement sequence (see :func:`encode_placement`).

    Example:
        >>> from torch.distributed.tensor import Shard, Replicate
        >>> encode_placements([Replicate(), Shard(0)])
        [{'type': 'replicate'}, {'type': 'shard', 'dim': 0}]
    """
    return [encode_placement(p, key) for p in ps]


def decode_placements(objs: Sequence[Any]) -> Placements:
    """Decode a placement sequence (see :func:`decode_placement`).

    Example:
        >>> decode_placements([{"type": "replicate"}, {"type": "partial", "reduce_op": "sum"}])
        (Replicate(), Partial(sum))
    """
    if not isinstance(objs, (list, tuple)):
        raise E.PlacementFormatError(E.BAD_PLACEMENTS_JSON.format(obj=objs))
    return tuple(decode_placement(o) for o in objs)


# --------------------------------------------------------------------------------------
# validation and resolution
# --------------------------------------------------------------------------------------
def normalize(key: KeyPath, placements: Any, shape: Sequence[int], mesh: MeshShape) -> Placements:
    """Check ``placements`` for a leaf of ``shape`` on ``mesh``; negative shard dims wrap."""
    if not isinstance(placements, Sequence) or isinstance(placements, str):
        raise TypeError(E.PLACEMENTS_SPEC.format(typ=type(placements).__name__))
    ndim = len(shape)
    if len(placements) != mesh.ndim:
        raise ValueError(
            E.PLACEMENTS_LENGTH.format(
                key=fmt_key(key),
                n=len(placements),
                placements=list(placements),
                ndim=mesh.ndim,
                mesh_shape=tuple(mesh.shape),
            )
        )
    out: list[Placement] = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                E.PLACEMENT_TYPE.format(key=fmt_key(key), value=p, typ=type(p).__name__)
            )
        if isinstance(p, (Shard, StridedShard)):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    E.SHARD_DIM.format(
                        key=fmt_key(key), dim=p.dim, mesh_dim=i, shape=tuple(shape), ndim=ndim
                    )
                )
            if p.dim < 0:
                d = p.dim + ndim
                p = (
                    StridedShard(d, split_factor=p.split_factor)
                    if isinstance(p, StridedShard)
                    else Shard(d)
                )
        out.append(p)
    return tuple(out)


def _is_sequence_spec(spec: Any) -> bool:
    return isinstance(spec, Sequence) and not isinstance(spec, str)


def resolve(
    pairs: Sequence[tuple[KeyPath, Tensor]],
    spec: Any,
    node_paths: Sequence[KeyPath],
    cls_name: str,
) -> list[Any | None]:
    """The raw placements asked for each leaf (``None``: the spec says nothing about it).

    ``pairs`` are the ``(key_path, leaf)`` of a container; ``node_paths`` every key path in
    it (leaves and nested containers), used to reject mapping keys that name nothing.
    """
    if _is_sequence_spec(spec):
        return [spec] * len(pairs)
    if isinstance(spec, Mapping):
        table = {as_path(k): v for k, v in spec.items()}
        known = set(node_paths)
        for path in table:
            if path not in known:
                raise KeyError(
                    E.UNKNOWN_PLACEMENT_KEY.format(
                        key=fmt_key(path),
                        cls=cls_name,
                        available=", ".join(fmt_key(p) for p, _ in pairs),
                    )
                )
        out: list[Any | None] = []
        for path, _ in pairs:
            found = None
            for n in range(len(path), 0, -1):  # the longest prefix wins
                if path[:n] in table:
                    found = table[path[:n]]
                    break
            out.append(found)
        return out
    if callable(spec):
        return [spec(path, leaf) for path, leaf in pairs]
    raise TypeError(E.PLACEMENTS_SPEC.format(typ=type(spec).__name__))
