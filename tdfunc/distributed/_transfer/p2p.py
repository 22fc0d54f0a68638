"""Point-to-point moves of sharded containers: :func:`send`, :func:`recv`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..._tree import leaves_with_paths
from .._common import errors as E
from .._common import placements as codec
from .._common import wire
from .._common.mesh import check_node, common_mesh
from .._common.placements import PlacementSpec
from .._redistribute import plan as plan_mod
from .._redistribute.redistribute import DEFAULT_BACKEND, dtensor_pairs, full_tensor, redistribute
from . import handshake as cross
from . import trust
from .session import Transfer, check_timeout

#: seconds each step of :func:`send` / :func:`recv` waits for the peer unless ``timeout=``
#: says otherwise (``None``: the process group's timeout, 30 minutes by default).
DEFAULT_TIMEOUT = wire.DEFAULT_TIMEOUT

#: ``ValueError`` unless ``timeout`` is None or a positive number of seconds (checked before
#: any message, so the peer sees this rank as silent and times out naming it)
_check_timeout = check_timeout


_reason = cross.reason


def _outgoing(td: Any, strategy: str, compile: bool, backend: Any) -> wire.Outgoing:
    check_node(td, "send")
    if strategy == "plan":
        raise ValueError(E.PLAN_NEEDS_MESH)
    if strategy not in wire.STRATEGIES:
        raise ValueError(E.BAD_STRATEGY.format(strategy=strategy))
    pairs, _, mesh = dtensor_pairs(td, "send")
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
    inc = wire.receive(link, mesh, placements, lambda raw, h: trust.read_meta(raw, h, src))
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
