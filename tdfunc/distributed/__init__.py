"""Sharded TensorDicts: DTensor leaves, redistribution as compiled graphs, send/recv between meshes.

A TensorDict (or tensorclass) whose leaves are ``DTensor`` s over a ``DeviceMesh`` is an
ordinary value here: every function takes one and returns a new one of the same type.

* :func:`distribute`, :func:`from_local`: plain leaves -> DTensors.
* :func:`redistribute`: new placements. The whole transition runs as one
  ``torch.compile(fullgraph=True)`` graph, cached per (structure, placements); leaves that share
  a transition and a dtype are packed into one flat buffer, so a container of many small
  leaves costs the collectives of a single tensor.
* :func:`to_local`, :func:`full_tensor`: DTensors -> local shards or full tensors.
* :func:`send`, :func:`recv`: move a sharded container between groups of ranks in one
  consolidated message per peer, with structured JSON metadata (never pickle). Between two
  meshes (strategy ``"plan"``, the default for a receiving mesh), each receiver gets exactly
  the slices it keeps; :class:`Transfer` is the reusable form (weight sync every step) and
  :func:`transfer_plan` the pure planner behind both.

Every function runs on every rank of the mesh (collectives inside), like DTensor itself; the
ranks check once per transition that they ask for the same one (``ValueError`` on all of them
otherwise, never mixed data). :func:`send` / :func:`recv` wait for their peer at most
``timeout`` seconds. The examples below run in a one-process gloo group; real programs start
one process per rank (``torchrun``; ``examples/dtensor_transfer.py`` and
``examples/weight_sync.py`` use ``tdfunc.testing.launch``).

Example:
    >>> import torch, torch.distributed as dist, tdfunc
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, Replicate
    >>> from tdfunc.distributed import distribute, redistribute, full_tensor
    >>> _ = dist.is_initialized() or dist.init_process_group(
    ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> td = tdfunc.TensorDict(w=torch.arange(6.0).reshape(3, 2), b=torch.ones(3), batch_size=[3])
    >>> sharded = distribute(td, mesh, [Shard(0)])
    >>> type(sharded["w"]).__name__, sharded["w"].placements
    ('DTensor', (Shard(dim=0),))
    >>> full_tensor(redistribute(sharded, [Replicate()], backend="eager"))["w"][2].tolist()
    [4.0, 5.0]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor

from .. import _deprecate
from .._keys import fmt_key, walk
from .._tree import KeyPath, Node, leaves_with_paths, map_leaves
from . import _cross as cross
from . import _errors as E
from . import _placements as codec
from . import _plan as plan_mod
from . import _sync
from . import _transfer as wire
from . import _xplan as xplan
from ._agree import agreed_plan, check, placements_of, reject
from ._mesh import check_node, common_mesh, describe_mesh, rebatch
from ._placements import PlacementSpec, normalize, resolve
from ._sync import Transfer
from ._xplan import Traffic, TransferPlan, transfer_plan

#: a container type (TensorDict or a tensorclass): functions return the type they are given
T = TypeVar("T", bound=Node)

_LAUNCH = ("launch", "free_port", "RankError")
_CODECS = ("encode_placement", "encode_placements", "decode_placement", "decode_placements")

#: torch.compile backend of the redistribution graphs unless ``backend=`` says otherwise.
DEFAULT_BACKEND = _sync.DEFAULT_BACKEND
#: seconds each step of :func:`send` / :func:`recv` waits for the peer unless ``timeout=``
#: says otherwise (``None``: the process group's timeout, 30 minutes by default).
DEFAULT_TIMEOUT = wire.DEFAULT_TIMEOUT

ShapeSpec = (
    Mapping[str | tuple[str, ...], Sequence[int]] | Callable[[KeyPath, Tensor], Sequence[int]]
)


def _rank_in(mesh: DeviceMesh, op: str) -> tuple[int, ...]:
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(
            E.NOT_IN_MESH.format(rank=dist.get_rank(), mesh=describe_mesh(mesh), op=op)
        )
    return tuple(coord)


def _targets(
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
    _rank_in(mesh, "distribute")
    pairs = leaves_with_paths(td)
    try:
        for path, x in pairs:
            if isinstance(x, DTensor):
                raise TypeError(E.ALREADY_DTENSOR.format(key=fmt_key(path)))
        targets = _targets(td, pairs, placements, mesh, lambda x: [Replicate()] * mesh.ndim)
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
    coord = _rank_in(mesh, "from_local")
    pairs = leaves_with_paths(td)
    for path, x in pairs:
        if isinstance(x, DTensor):
            raise TypeError(E.ALREADY_DTENSOR.format(key=fmt_key(path)))
    given = (
        [None] * len(pairs)
        if shapes is None
        else resolve(pairs, shapes, [p for p, _ in walk(td)], type(td).__name__)
    )
    targets = _targets(td, pairs, placements, mesh, lambda x: [Replicate()] * mesh.ndim)
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


# --------------------------------------------------------------------------------------
# redistribution
# --------------------------------------------------------------------------------------
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


def _dtensor_pairs(
    td: Any, op: str
) -> tuple[list[tuple[KeyPath, Tensor]], list[int], DeviceMesh | None]:
    pairs = leaves_with_paths(td)
    mesh = common_mesh(pairs)
    idx = [i for i, (_, x) in enumerate(pairs) if isinstance(x, DTensor)]
    if mesh is not None:
        _rank_in(mesh, op)
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
    pairs, idx, mesh = _dtensor_pairs(td, "redistribute")
    if mesh is None:
        return td
    dpairs: list[tuple[KeyPath, DTensor]] = [pairs[i] for i in idx]  # type: ignore[misc]
    if compile:
        try:
            targets = _targets(td, dpairs, placements, mesh, lambda x: x.placements)
        except (TypeError, ValueError, KeyError):
            reject("redistribute", mesh)  # the other ranks raise too instead of waiting
            raise
    else:  # may be traced into the caller's graph: no eager communication here
        targets = _targets(td, dpairs, placements, mesh, lambda x: x.placements)
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
    pairs, idx, mesh = _dtensor_pairs(td, "full_tensor")
    if mesh is None:
        return td
    dpairs: list[tuple[KeyPath, DTensor]] = [pairs[i] for i in idx]  # type: ignore[misc]
    targets = [(Replicate(),) * mesh.ndim] * len(dpairs)
    moved = _run("full_tensor", dpairs, mesh, targets, compile, backend, unwrap=True)
    new = [x for _, x in pairs]
    for i, y in zip(idx, moved):
        new[i] = y
    return map_leaves(td, new)


# --------------------------------------------------------------------------------------
# send / recv
# --------------------------------------------------------------------------------------
#: ``ValueError`` unless ``timeout`` is None or a positive number of seconds (checked before
#: any message, so the peer sees this rank as silent and times out naming it)
_check_timeout = _sync.check_timeout


_reason = cross.reason


def _outgoing(td: Any, strategy: str, compile: bool, backend: Any) -> wire.Outgoing:
    check_node(td, "send")
    if strategy == "plan":
        raise ValueError(E.PLAN_NEEDS_MESH)
    if strategy not in wire.STRATEGIES:
        raise ValueError(E.BAD_STRATEGY.format(strategy=strategy))
    pairs, _, mesh = _dtensor_pairs(td, "send")
    for path, x in pairs:
        if isinstance(x, DTensor):
            codec.encode_placements(x.placements, path)  # TypeError for placements with no encoding
    sources = [x for _, x in pairs]
    if strategy == "local":
        payload = [x.to_local() if isinstance(x, DTensor) else x for x in sources]
    else:
        payload = [
            x for _, x in leaves_with_paths(full_tensor(td, compile=compile, backend=backend))
        ]
    return wire.describe(td, pairs, payload, sources, strategy, mesh)


def _is_rank(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def send(
    td: Any,
    dst: Any,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    placements: PlacementSpec | None = None,
    compile: bool = True,
    backend: Any = DEFAULT_BACKEND,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> int:
    """Send a (sharded) container to global rank ``dst``, or to every rank of mesh ``dst``
    along a transfer plan; the peers call :func:`recv`.

    Each rank of the sending mesh calls ``send``. With a receiving *mesh* (strategy
    ``"plan"``, what ``"auto"`` picks), the ranks of both meshes first agree on the layout
    and the target placements (the receivers give them), then each sender packs every slice
    it owes each receiver into one message per (sender, receiver) pair: only the bytes each
    receiver needs travel, replicated sources spread the reads, ``Partial`` sources are
    all-reduced on the sending mesh first (see :class:`Transfer`, :func:`transfer_plan`).
    A rank that is in both meshes calls :func:`recv` with ``source=`` instead.

    With a receiving *rank*, three point-to-point messages per peer whatever the number of
    leaves: a small header, the peer's reply (so a pairing that does not fit raises
    ``ValueError`` on both sides instead of hanging), and one consolidated uint8 message with
    JSON metadata (key paths, container types, dtypes, global and local shapes, placements
    encoded structurally, the source mesh shape and dim names) followed by the leaves' bytes.

    Args:
        td: a TensorDict or tensorclass; DTensor leaves must share one mesh that includes this
            rank; plain tensor leaves and nested containers travel too.
        dst: the receiving global rank, or the receiving mesh (a ``DeviceMesh`` or its rank
            array).
        group: the process group carrying the messages (default: the world).
        strategy: ``"auto"``: ``"plan"`` for a receiving mesh, ``"local"`` for a rank.
            ``"plan"``: see above. ``"local"``: ship only this rank's local shards; the
            receiving mesh must have the source mesh's shape and ``dst`` the same coordinate
            in it. No full tensor is built. ``"full"``: gather full tensors over the sending
            mesh first (a collective over it), then ship them; any receiving mesh fits.
        placements: with a receiving mesh, the target placements this sender expects
            (optional: the receivers give them; a difference raises ``ValueError`` on every
            rank).
        compile, backend: for the packing graphs of ``"plan"`` and the gather of ``"full"``
            (see :func:`full_tensor`).
        timeout: seconds each step waits for the peer (:data:`DEFAULT_TIMEOUT`, 120 s, by
            default; ``None``: the process group's timeout).

    Returns:
        The size in bytes of what this rank sent (consolidated messages).

    Raises:
        ValueError: a bad strategy, leaves on different meshes, or a receiver that rejected
            the transfer (its reason is in the message); a bad ``timeout`` (raised before
            anything is sent).
        TimeoutError: the receiver did not take part within ``timeout`` (the message names
            it and the step; with gloo, this rank's process group is closed afterwards);
            ConnectionError: the receiver died.

    Example:
        One function runs on every rank (complete programs: ``examples/dtensor_transfer.py``,
        ``examples/weight_sync.py``). Ranks 0 and 1 (mesh A) send to ranks 2 and 3
        (mesh B)::

            def rank_main(rank, world):
                mesh_a, mesh_b = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
                if rank < 2:
                    sharded = distribute(params, mesh_a, [Shard(0)])
                    return send(sharded, mesh_b)  # bytes sent
                td = recv(mesh_a, mesh=mesh_b, placements=[Shard(1)])
                return full_tensor(td)

            launch(rank_main, 4)  # one process per rank (tdfunc.testing.launch)
    """
    _check_timeout(timeout)
    if _is_rank(dst):
        link = wire.Peer("send", dist.get_rank(), dst, group, wire.comm_device(group), timeout)
        try:
            if placements is not None:
                raise ValueError(E.PLAN_NEEDS_MESH)
            out = _outgoing(td, "local" if strategy == "auto" else strategy, compile, backend)
        except (TypeError, ValueError, KeyError) as e:
            wire.send_error(_reason(e), link)
            raise
        return wire.send_outgoing(out, link)
    error: BaseException | None = None
    if strategy not in ("auto", "plan"):
        known = strategy in wire.STRATEGIES
        error = ValueError(
            E.PLAN_STRATEGY.format(strategy=strategy)
            if known
            else E.BAD_STRATEGY.format(strategy=strategy)
        )
    check_node(td, "send")
    mesh = common_mesh(leaves_with_paths(td))
    if mesh is None:
        raise ValueError(E.PLAN_NO_DTENSOR.format(op="send"))
    planned = Transfer._one_shot(
        "send", mesh, dst, placements, td, group, compile, backend, timeout, error
    )
    return planned.send(td)


def recv(
    src: Any,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: DeviceMesh | None = None,
    placements: PlacementSpec | None = None,
    source: Any = None,
    compile: bool = True,
    backend: Any = DEFAULT_BACKEND,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """Receive what global rank ``src`` (or every rank of mesh ``src``) sent with
    :func:`send`; return the same container type.

    From a sending *mesh* (a planned transfer, see :func:`send`): every rank of the receiving
    ``mesh`` calls ``recv`` with the target ``placements``; the result's leaves are DTensors
    on ``mesh`` with those placements (plain leaves stay plain), built from exactly the
    slices this rank needs. A rank in both meshes passes its own container as ``source``:
    it sends its part, copies what it already holds, and receives the rest. (Ranks of the
    sending mesh only may call ``recv(..., source=td)`` too: it sends and returns None, so
    one call can serve every rank.)

    From a sending *rank*: with ``strategy="local"`` the shards become DTensors on ``mesh``
    (``DTensor.from_local`` with the source placements and global shapes); with ``"full"``
    they become replicated DTensors on ``mesh``, or plain tensors when ``mesh`` is None.
    When ``placements`` is given the result is then redistributed on ``mesh`` in one compiled
    graph (a collective over the receiving mesh: every receiving rank must ask for the same
    placements). Plain leaves stay plain.

    Args:
        src: the sending global rank, or the sending mesh (a ``DeviceMesh`` or its rank
            array).
        group: the process group carrying the messages (default: the world).
        mesh: the receiving DeviceMesh (needed for DTensor leaves sent with ``"local"``: same
            shape as the sender's mesh, this rank at the sender's coordinate; and from a
            sending mesh).
        placements: target placements, as in :func:`redistribute` (required from a sending
            mesh).
        source: from a sending mesh, on a rank that is in it too: the container it sends.
        compile, backend: see :func:`redistribute`.
        timeout: seconds each step waits for the sender (:data:`DEFAULT_TIMEOUT`, 120 s, by
            default; ``None``: the process group's timeout).

    Raises:
        ValueError: the pairing does not fit (also raised on the sender), placements without a
            mesh or of the wrong length, a shard dim past a leaf's ndim; a bad ``timeout``
            (raised before anything is received). From a sending mesh: anything the ranks do
            not agree on, on every rank (see :class:`Transfer`).
        TimeoutError: no transfer from ``src`` within ``timeout`` (also when ``src`` sent
            something else than a :func:`send`: a plain ``dist.send`` never lands in a
            transfer); ConnectionError: the sender died. The message names ``src`` and the
            step; with gloo, this rank's process group is closed after a timeout.

    Example:
        See :func:`send`: the same ``rank_main`` runs :func:`send` on mesh A and this function on
        mesh B (complete programs: ``examples/dtensor_transfer.py``, ``examples/weight_sync.py``).
    """
    _check_timeout(timeout)
    if not _is_rank(src):
        if mesh is None:
            raise TypeError(E.PLAN_DST_MESH.format(rank=dist.get_rank(), typ="NoneType"))
        planned = Transfer._one_shot(
            "recv", src, mesh, placements, source, group, compile, backend, timeout, None
        )
        return planned(source)
    link = wire.Peer("recv", dist.get_rank(), src, group, wire.comm_device(group), timeout)
    inc = wire.receive(link, mesh, placements)
    leaves: list[Tensor] = []
    for entry, t in zip(inc.meta["leaves"], inc.tensors):
        x: Tensor = t
        if mesh is not None and (entry["kind"] == "dtensor" or entry["was_dtensor"]):
            target = torch.device(mesh.device_type)
            local = t if t.device.type == target.type else t.to(target)
            if entry["kind"] == "dtensor":
                pl = codec.decode_placements(entry["placements"])
            else:
                pl = (Replicate(),) * mesh.ndim
            shape = tuple(entry["shape"])
            x = DTensor.from_local(
                local,
                mesh,
                pl,
                run_check=False,
                shape=torch.Size(shape),
                stride=plan_mod.contiguous_stride(shape),
            )
        if entry["requires_grad"]:
            x = x.detach().requires_grad_(True)
        leaves.append(x)
    node = wire.unflatten(inc.meta["tree"], leaves)
    if placements is not None:
        node = redistribute(node, placements, compile=compile, backend=backend)
    return node


def cache_clear() -> None:
    """Drop the cached redistribution plans and graphs (they are rebuilt on next use).

    Example:
        >>> from tdfunc.distributed import cache_clear
        >>> cache_clear()
    """
    plan_mod.compiled.cache_clear()
    plan_mod.cached_plan.cache_clear()
    agreed_plan.cache_clear()
    xplan.plan_for.cache_clear()
    for fn in (cross.send_side, cross.recv_side, cross.compiled_pack, cross.compiled_unpack):
        fn.cache_clear()
    cross._specs.cache_clear()


def _late(module: str, name: str) -> Callable[[], Any]:
    """Read ``name`` from a private module of this package when called."""
    return lambda: getattr(importlib.import_module(module, __name__), name)


_TEST_HELPER = "tdfunc.distributed._launch.{} (a test helper, not part of the API)"
_TESTING = "tdfunc.testing.{} (the test launcher)"
_CODEC = "send / recv, which encode placements themselves (tdfunc.distributed._placements.{})"

#: names that left the public API: deprecated aliases for one release
__getattr__ = _deprecate.module_getattr(
    __name__,
    {
        **{
            n: (_late("._launch", n), (_TESTING if n != "free_port" else _TEST_HELPER).format(n))
            for n in _LAUNCH
        },
        **{n: (_late("._placements", n), _CODEC.format(n)) for n in _CODECS},
    },
)

__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_TIMEOUT",
    "Traffic",
    "Transfer",
    "TransferPlan",
    "cache_clear",
    "distribute",
    "from_local",
    "full_tensor",
    "recv",
    "redistribute",
    "send",
    "to_local",
    "transfer_plan",
]
