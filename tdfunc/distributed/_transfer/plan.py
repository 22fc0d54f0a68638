"""Transfer plans between two meshes: which slices of which leaves move from which sending
rank to which receiving rank. Pure Python on static metadata: no process group is needed.

The model
---------
A mesh is its rank array (:class:`Grid`: a shape and the global ranks in row-major order).
Under DTensor semantics, each rank of a mesh holds one *box* of a leaf (a product of index
ranges, one per tensor dim): ``Shard(d)`` on mesh dim ``i`` cuts the current range of dim
``d`` like ``torch.chunk`` into ``mesh.shape[i]`` chunks (mesh dims in order, so nested
sharding of one dim cuts the chunk again), ``Replicate()`` and ``Partial()`` keep it.

Sources. ``Partial`` source dims are reduced on the sending mesh first (an all-reduce, which
makes them ``Replicate``: see :attr:`LeafSpec.reduced`). The ranks whose coordinates differ
only along replicated mesh dims hold the same box (replicas); boxes of different replica
classes are disjoint and together cover the leaf. To spread the reads, each class's box is cut
once more, among its replicas only, along one tensor dim per replicated mesh dim (a dim the
receivers shard when one is large enough, so a receiver's part tends to come from one
replica, else the largest dim; tiny leaves rotate which replica serves them): every element
then has exactly one *serving* rank.

Targets. A receiving rank needs its box under the target placements; along a
``Partial("sum")`` mesh dim only coordinate 0 holds the values and the others hold zeros (the
sum is exact, also for integers), while ``Partial("avg" | "max" | "min")`` dims hold the
values everywhere.

Pieces. A receiving rank that also sends (a rank in both meshes) copies what its own box
covers locally and takes the rest from the serving ranks of the other classes; any other
receiving rank takes each part of its target from the rank serving it. Each piece is a box;
the pieces one sender owes one receiver form one message, ordered by decreasing element size
(so every piece starts at an offset aligned for its dtype with no padding). The plan moves
exactly the minimum: the sum over receivers of the target bytes they do not already hold.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from ..._keys import KeyPath, as_path, fmt_key
from ..._tree import is_node, leaves_with_paths
from .._common import errors as E
from .._common.caches import register
from .._common.placements import normalize, resolve

Box = tuple[tuple[int, int], ...]
Kind = tuple[Any, ...]
Kinds = tuple[Kind, ...]

#: reduce ops of ``Partial`` placements a plan understands
REDUCE_OPS = ("sum", "avg", "max", "min")
#: plans kept (one per layout: structure, shapes, dtypes, meshes and placements)
CACHE_SIZE = 64


# --------------------------------------------------------------------------------------
# meshes as rank arrays
# --------------------------------------------------------------------------------------
class Grid(NamedTuple):
    """A mesh as its rank array: ``shape`` and the global ``ranks`` in row-major order.

    Example:
        >>> g = as_grid([[0, 1], [2, 3]])
        >>> g.shape, g.ndim, g.coord(2), g.rank_at((0, 1))
        ((2, 2), 2, (1, 0), 1)
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.shape)

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every coordinate, in row-major order (the order of :attr:`ranks`)."""
        return itertools.product(*[range(m) for m in self.shape])

    def coord(self, rank: int) -> tuple[int, ...] | None:
        """The coordinate of global ``rank`` (None when it is not in the mesh)."""
        if rank not in self.ranks:
            return None
        flat = self.ranks.index(rank)
        out = []
        for m in reversed(self.shape):
            out.append(flat % m)
            flat //= m
        return tuple(reversed(out))

    def rank_at(self, coord: Sequence[int]) -> int:
        """The global rank at ``coord``."""
        flat = 0
        for c, m in zip(coord, self.shape):
            flat = flat * m + c
        return self.ranks[flat]

    def nested(self) -> Any:
        """The rank array as nested lists (JSON-ready)."""
        return torch.tensor(self.ranks).reshape(self.shape).tolist()


def as_grid(mesh: Any) -> Grid:
    """The :class:`Grid` of a ``DeviceMesh``, a (nested) sequence of ranks or an integer
    tensor of ranks; ``ValueError`` for an empty array or repeated / negative ranks,
    ``TypeError`` for anything else.

    Example:
        >>> as_grid([4, 5])
        Grid(shape=(2,), ranks=(4, 5))
    """
    if isinstance(mesh, Grid):
        if math.prod(mesh.shape) != len(mesh.ranks) or not mesh.shape:
            raise ValueError(E.BAD_GRID.format(ranks=list(mesh.ranks)))
        t = torch.tensor(mesh.ranks, dtype=torch.int64).reshape(mesh.shape)
    elif isinstance(mesh, DeviceMesh):
        t = mesh.mesh
    elif isinstance(mesh, Tensor):
        t = mesh
    elif isinstance(mesh, Sequence) and not isinstance(mesh, str):
        try:
            t = torch.tensor(mesh)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(E.BAD_GRID_TYPE.format(typ=type(mesh).__name__)) from e
    else:
        raise TypeError(E.BAD_GRID_TYPE.format(typ=type(mesh).__name__))
    if t.numel() == 0:
        raise ValueError(E.BAD_GRID.format(ranks=t.tolist()))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(E.BAD_GRID_TYPE.format(typ=f"tensor of {t.dtype}"))
    ranks = tuple(int(r) for r in t.flatten().tolist())
    shape = tuple(int(s) for s in t.shape)
    if t.dim() == 0 or not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 0:
        raise ValueError(E.BAD_GRID.format(ranks=t.tolist()))
    return Grid(shape, ranks)


# --------------------------------------------------------------------------------------
# placements as plain tuples (hashable, comparable) and boxes
# --------------------------------------------------------------------------------------
def kind_of(p: Placement, key: KeyPath) -> Kind:
    """``("shard", d)``, ``("replicate",)`` or ``("partial", op)``; ``ValueError`` for a
    placement a plan cannot move."""
    typ = type(p)
    if typ is Shard:
        return ("shard", int(p.dim))  # type: ignore[attr-defined]
    if typ is Replicate:
        return ("replicate",)
    if typ is Partial and str(p.reduce_op) in REDUCE_OPS:  # type: ignore[attr-defined]
        return ("partial", str(p.reduce_op))  # type: ignore[attr-defined]
    raise ValueError(E.PLAN_PLACEMENT.format(key=fmt_key(key), placement=p, ops=REDUCE_OPS))


def placement_of(k: Kind) -> Placement:
    """Inverse of :func:`kind_of`."""
    if k[0] == "shard":
        return Shard(k[1])
    if k[0] == "replicate":
        return Replicate()
    return Partial(k[1])


def box_of(shape: Sequence[int], mesh_shape: Sequence[int], ks: Kinds, coord: Sequence[int]) -> Box:
    """The box of the rank at ``coord`` (``torch.chunk`` per sharded mesh dim, in order).

    Example:
        >>> box_of((5, 4), (2, 2), (("shard", 0), ("shard", 1)), (1, 0))
        ((3, 5), (0, 2))
    """
    lo, hi = [0] * len(shape), list(shape)
    for i, k in enumerate(ks):
        if k[0] == "shard":
            d = k[1]
            size = hi[d] - lo[d]
            cs = -(-size // mesh_shape[i]) if size else 0
            start = min(lo[d] + coord[i] * cs, hi[d])
            lo[d], hi[d] = start, min(start + cs, hi[d])
    return tuple(zip(lo, hi))


def _chunk(b: Box, d: int, n: int, c: int) -> Box:
    lo, hi = b[d]
    size = hi - lo
    cs = -(-size // n) if size else 0
    start = min(lo + c * cs, hi)
    return (*b[:d], (start, min(start + cs, hi)), *b[d + 1 :])


def intersect(a: Box, b: Box) -> Box:
    """The common part of two boxes (possibly empty)."""
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


def numel(b: Box) -> int:
    """Number of elements of a box (0 when empty)."""
    return math.prod(max(0, hi - lo) for lo, hi in b)


def _empty(b: Box) -> bool:
    return any(hi <= lo for lo, hi in b)


def _reduced(ks: Kinds) -> Kinds:
    return tuple(("replicate",) if k[0] == "partial" else k for k in ks)


# --------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------
class LeafSpec(NamedTuple):
    """One leaf of a plan. ``reduced``: the source placements after the all-reduce of its
    ``Partial`` dims on the sending mesh (None when it has none); ``plain``: a plain tensor
    (replicated on the sending mesh, a plain tensor on every receiver)."""

    path: KeyPath
    shape: tuple[int, ...]
    dtype: torch.dtype
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    reduced: tuple[Placement, ...] | None
    plain: bool


class Piece(NamedTuple):
    """A box of one leaf moving from rank ``src`` to rank ``dst`` (equal: a local copy).

    ``start`` / ``size`` locate it in the global leaf, ``src_start`` in the sender's local
    shard, ``dst_start`` in the receiver's local shard; ``offset`` is its byte offset in the
    message payload (-1 for a local copy).
    """

    leaf: int
    src: int
    dst: int
    start: tuple[int, ...]
    size: tuple[int, ...]
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    nbytes: int
    offset: int


class Message(NamedTuple):
    """Everything rank ``src`` owes rank ``dst``: one buffer of ``nbytes`` payload bytes."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]
    nbytes: int


class Traffic(NamedTuple):
    """Bytes a plan moves. ``total``: payload bytes over the wire (all messages);
    ``messages``: their number (one per sender / receiver pair); ``sent`` / ``received``:
    payload bytes per rank; ``local``: bytes each rank in both meshes copies locally."""

    total: int
    messages: int
    sent: dict[int, int]
    received: dict[int, int]
    local: dict[int, int]


class TransferPlan:
    """Which slices of which leaves move between two meshes (see :func:`transfer_plan`).

    Attributes:
        key: the :class:`LayoutKey` it was planned from (plans are cached by it).
        leaves: one :class:`LeafSpec` per leaf, in order.
        src_mesh, dst_mesh: the two meshes as :class:`Grid` s.
        messages: one :class:`Message` per (sender, receiver) pair that exchanges data,
            sorted by (sender, receiver); no message from a rank to itself.
        local: the local copies (:class:`Piece` s with ``src == dst``) per rank.
        bytes: the :class:`Traffic` of the plan (total and per rank).
    """

    def __init__(
        self,
        key: LayoutKey,
        leaves: tuple[LeafSpec, ...],
        src_mesh: Grid,
        dst_mesh: Grid,
        messages: tuple[Message, ...],
        local: dict[int, tuple[Piece, ...]],
    ) -> None:
        self.key = key
        self.leaves = leaves
        self.src_mesh = src_mesh
        self.dst_mesh = dst_mesh
        self.messages = messages
        self.local = local
        sent: dict[int, int] = {}
        received: dict[int, int] = {}
        for m in messages:
            sent[m.src] = sent.get(m.src, 0) + m.nbytes
            received[m.dst] = received.get(m.dst, 0) + m.nbytes
        self.bytes = Traffic(
            total=sum(m.nbytes for m in messages),
            messages=len(messages),
            sent=sent,
            received=received,
            local={r: sum(p.nbytes for p in ps) for r, ps in local.items()},
        )

    def sends(self, rank: int) -> tuple[Message, ...]:
        """The messages ``rank`` sends, by receiver."""
        return tuple(m for m in self.messages if m.src == rank)

    def receives(self, rank: int) -> tuple[Message, ...]:
        """The messages ``rank`` receives, by sender."""
        return tuple(sorted((m for m in self.messages if m.dst == rank), key=lambda m: m.src))

    def target(self, leaf: int, rank: int) -> tuple[tuple[int, ...], bool]:
        """The local shape of ``leaf`` on receiving ``rank`` and whether it is all zeros (a
        ``Partial("sum")`` coordinate other than 0)."""
        spec = self.leaves[leaf]
        coord = self.dst_mesh.coord(rank)
        assert coord is not None
        ks = tuple(("replicate",) if spec.plain else _kind(p) for p in spec.dst)
        b = box_of(spec.shape, self.dst_mesh.shape, _reduced(ks), coord)
        return tuple(hi - lo for lo, hi in b), _zero(ks, coord)

    def __repr__(self) -> str:
        b = self.bytes
        return (
            f"TransferPlan({len(self.leaves)} leaves, {list(self.src_mesh.nested())} -> "
            f"{list(self.dst_mesh.nested())}, {b.messages} messages, {b.total} bytes)"
        )


def _kind(p: Placement) -> Kind:
    return kind_of(p, ())


def _zero(ks: Kinds, coord: Sequence[int]) -> bool:
    return any(k == ("partial", "sum") and c != 0 for k, c in zip(ks, coord))


class LayoutKey(NamedTuple):
    """What a plan depends on (hashable: plans are cached by it)."""

    paths: tuple[KeyPath, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    src: tuple[Kinds, ...]
    dst: tuple[Kinds, ...]
    plain: tuple[bool, ...]
    src_mesh: Grid
    dst_mesh: Grid


def _serving(
    shape: tuple[int, ...], src: Kinds, dst: Kinds, mesh_shape: tuple[int, ...], index: int
) -> tuple[tuple[int, int | None, int], ...]:
    """How the replicas of a box split the reads: ``(mesh dim, tensor dim or None, rotation)``
    per replicated mesh dim of size > 1 (see the module docstring)."""
    typical = list(shape)
    for i, k in enumerate(src):
        if k[0] == "shard":
            typical[k[1]] = -(-typical[k[1]] // mesh_shape[i])
    prefer = list(dict.fromkeys(k[1] for k in dst if k[0] == "shard"))
    rule: list[tuple[int, int | None, int]] = []
    for i, k in enumerate(src):
        m = mesh_shape[i]
        if k[0] != "replicate" or m == 1:
            continue
        v = next((d for d in prefer if typical[d] >= m), None)
        if v is None and typical:
            v = max(range(len(typical)), key=lambda d: (typical[d], -d))
        rotation = index % m if v is None or typical[v] < m else 0
        rule.append((i, v, rotation))
        if v is not None:
            typical[v] = -(-typical[v] // m)
    return tuple(rule)


def _serve_box(
    b: Box, rule: tuple[tuple[int, int | None, int], ...], mesh_shape: tuple[int, ...], coord: Any
) -> Box | None:
    """The part of its box the rank at ``coord`` serves (None: nothing, e.g. a 0-d leaf
    served by another replica)."""
    for i, v, rot in rule:
        c = (coord[i] + rot) % mesh_shape[i]
        if v is None:
            if c != 0:
                return None
        else:
            b = _chunk(b, v, mesh_shape[i], c)
    return b


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def plan_for(key: LayoutKey) -> TransferPlan:
    """The :class:`TransferPlan` of a layout, memoized by value."""
    sg, dg = key.src_mesh, key.dst_mesh
    src_coords = list(sg.coords())
    dst_coords = list(dg.coords())
    raw: dict[tuple[int, int], list[tuple[Piece, int]]] = {}
    local: dict[int, list[Piece]] = {}
    specs = []
    for li, (path, shape, dtype, sk, dk, plain) in enumerate(
        zip(key.paths, key.shapes, key.dtypes, key.src, key.dst, key.plain)
    ):
        eff = _reduced(sk)
        specs.append(
            LeafSpec(
                path,
                shape,
                dtype,
                tuple(placement_of(k) for k in sk),
                tuple(placement_of(k) for k in dk),
                tuple(placement_of(k) for k in eff) if eff != sk else None,
                plain,
            )
        )
        item = dtype.itemsize
        shard_dims = [i for i, k in enumerate(eff) if k[0] == "shard"]
        rule = _serving(shape, eff, dk, sg.shape, li)
        boxes = {c: box_of(shape, sg.shape, eff, c) for c in src_coords}
        serve = {c: _serve_box(boxes[c], rule, sg.shape, c) for c in src_coords}
        for e in dst_coords:
            if _zero(dk, e):
                continue
            d = dg.rank_at(e)
            need = box_of(shape, dg.shape, _reduced(dk), e)
            if _empty(need):
                continue
            own = sg.coord(d)
            if own is not None:
                part = intersect(need, boxes[own])
                if not _empty(part):
                    local.setdefault(d, []).append(
                        _piece(li, d, d, part, boxes[own], need, item, -1)
                    )
            for c in src_coords:
                if own is not None and all(c[i] == own[i] for i in shard_dims):
                    continue  # a replica of this rank's own box: already held
                served = serve[c]
                if served is None:
                    continue
                part = intersect(need, served)
                if _empty(part):
                    continue
                s = sg.rank_at(c)
                raw.setdefault((s, d), []).append(
                    (_piece(li, s, d, part, boxes[c], need, item, 0), item)
                )
    messages = []
    for (s, d), items in sorted(raw.items()):
        items.sort(key=lambda pi: (-pi[1], pi[0].leaf, pi[0].start))
        off, pieces = 0, []
        for p, _ in items:
            pieces.append(p._replace(offset=off))
            off += p.nbytes
        messages.append(Message(s, d, tuple(pieces), off))
    return TransferPlan(
        key,
        tuple(specs),
        sg,
        dg,
        tuple(messages),
        {r: tuple(ps) for r, ps in sorted(local.items())},
    )


def _piece(
    leaf: int, s: int, d: int, part: Box, held: Box, need: Box, item: int, off: int
) -> Piece:
    start = tuple(lo for lo, _ in part)
    return Piece(
        leaf=leaf,
        src=s,
        dst=d,
        start=start,
        size=tuple(hi - lo for lo, hi in part),
        src_start=tuple(a - lo for a, (lo, _) in zip(start, held)),
        dst_start=tuple(a - lo for a, (lo, _) in zip(start, need)),
        nbytes=numel(part) * item,
        offset=off,
    )


# --------------------------------------------------------------------------------------
# the public planner
# --------------------------------------------------------------------------------------
def _prefixes(paths: Sequence[KeyPath]) -> list[KeyPath]:
    return list(dict.fromkeys(p[:n] for p in paths for n in range(1, len(p) + 1)))


def resolve_kinds(
    pairs: Sequence[tuple[KeyPath, Tensor]],
    spec: Any,
    grid: Grid,
    cls_name: str,
    all_paths: Sequence[KeyPath] | None = None,
) -> tuple[Kinds, ...]:
    """The placements ``spec`` asks for each leaf (as kinds), checked against ``grid``.

    ``pairs`` may hold meta tensors: only shapes (and, for a callable spec, whatever it reads)
    matter. Leaves a mapping or callable says nothing about are replicated. ``all_paths``:
    the paths of every leaf of the container when ``pairs`` are only some of them (a mapping
    may name the others).
    """
    known = _prefixes(list(all_paths) if all_paths is not None else [p for p, _ in pairs])
    asked = resolve(pairs, spec, known, cls_name)
    out = []
    for (path, x), a in zip(pairs, asked):
        ps = normalize(path, [Replicate()] * grid.ndim if a is None else a, tuple(x.shape), grid)
        out.append(tuple(kind_of(p, path) for p in ps))
    return tuple(out)


def _shapes(shapes: Any, dtypes: Any) -> tuple[list[tuple[KeyPath, Tensor]], str]:
    """``(path, meta tensor)`` pairs for the planner's ``shapes`` / ``dtypes`` arguments."""
    if is_node(shapes):
        pairs = leaves_with_paths(shapes)
        paths = [p for p, _ in pairs]
        sizes = [tuple(x.shape) for _, x in pairs]
        found = [x.dtype for _, x in pairs]
        cls_name = type(shapes).__name__
    elif isinstance(shapes, Mapping):
        paths = [as_path(k) for k in shapes]
        sizes = [tuple(int(s) for s in v) for v in shapes.values()]
        found = [torch.float32] * len(paths)
        cls_name = "mapping"
    elif isinstance(shapes, Sequence) and not isinstance(shapes, str):
        paths = [(str(i),) for i in range(len(shapes))]
        sizes = [tuple(int(s) for s in v) for v in shapes]
        found = [torch.float32] * len(paths)
        cls_name = "sequence"
    else:
        raise TypeError(E.PLAN_SHAPES.format(typ=type(shapes).__name__))
    if dtypes is not None:
        if isinstance(dtypes, torch.dtype):
            found = [dtypes] * len(paths)
        elif isinstance(dtypes, Mapping):
            table = {as_path(k): v for k, v in dtypes.items()}
            found = [table.get(p, f) for p, f in zip(paths, found)]
        else:
            found = list(dtypes)
            if len(found) != len(paths):
                raise ValueError(E.PLAN_DTYPES.format(n=len(found), leaves=len(paths)))
    pairs = [(p, torch.empty(s, dtype=dt, device="meta")) for p, s, dt in zip(paths, sizes, found)]
    return pairs, cls_name


def transfer_plan(
    shapes: Any,
    src_mesh: Any,
    src_placements: Any,
    dst_mesh: Any,
    dst_placements: Any,
    *,
    dtypes: Any = None,
) -> TransferPlan:
    """Plan moving leaves laid out on ``src_mesh`` to ``dst_mesh`` (pure: no communication).

    Every element a receiving rank needs comes from exactly one rank: itself when it also
    sends and holds it (a local copy, no message), else the one replica that serves it
    (reads of replicated sources are spread over the replicas). No element travels that the
    receiver does not keep, so ``plan.bytes.total`` is the minimum. ``Partial`` sources are
    all-reduced on the sending mesh first (:attr:`LeafSpec.reduced`).

    Args:
        shapes: the leaves' global shapes: a mapping from key paths to shapes, a sequence of
            shapes (key paths ``"0"``, ``"1"``, ...), or a TensorDict / tensorclass (its
            leaves' shapes and dtypes).
        src_mesh, dst_mesh: the meshes: a ``DeviceMesh`` or its rank array (nested lists or
            an integer tensor of global ranks); they may share ranks.
        src_placements, dst_placements: as in :func:`redistribute`: one sequence for every
            leaf, a mapping from key paths (longest prefix wins; leaves left out are
            replicated) or a callable ``(key_path, meta_tensor) -> placements``.
            ``Shard``, ``Replicate`` and ``Partial`` (``sum``, ``avg``, ``max``, ``min``).
        dtypes: element types, for the byte counts: one dtype, a mapping from key paths or a
            sequence (default: float32, or the container's dtypes).

    Returns:
        A :class:`TransferPlan`: its ``messages`` (one per sender / receiver pair), ``local``
        copies and ``bytes`` (total and per rank).

    Raises:
        ValueError: a wrong number of placements, a shard dim past a leaf's ndim, a placement
            a plan cannot move, an empty mesh or repeated ranks.
        TypeError: a placement that is not a Placement, a mesh that is not a rank array.
        KeyError: a mapping names a key that does not exist.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import transfer_plan
        >>> plan = transfer_plan({"w": (8, 4)}, [[0, 1], [2, 3]], [Shard(0), Shard(1)],
        ...                      [4, 5], [Shard(1)])
        >>> plan.bytes.total, plan.bytes.messages  # 8 x 4 float32, each element once
        (128, 4)
        >>> [(m.src, m.dst, m.nbytes) for m in plan.messages]
        [(0, 4, 32), (1, 5, 32), (2, 4, 32), (3, 5, 32)]
    """
    sg, dg = as_grid(src_mesh), as_grid(dst_mesh)
    pairs, cls_name = _shapes(shapes, dtypes)
    key = LayoutKey(
        paths=tuple(p for p, _ in pairs),
        shapes=tuple(tuple(x.shape) for _, x in pairs),
        dtypes=tuple(x.dtype for _, x in pairs),
        src=resolve_kinds(pairs, src_placements, sg, cls_name),
        dst=resolve_kinds(pairs, dst_placements, dg, cls_name),
        plain=(False,) * len(pairs),
        src_mesh=sg,
        dst_mesh=dg,
    )
    return plan_for(key)
