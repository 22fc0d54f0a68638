""":class:`Transfer`: a planned, reusable transfer of a sharded container between two meshes
(the protocol is in :mod:`.handshake`, the planner in :mod:`.plan`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from ..._compat import pytree
from ..._keys import fmt_key
from ..._tree import is_node, leaves_with_paths
from .._common import errors as E
from .._common import wire
from .._common.mesh import describe_mesh
from .._redistribute.redistribute import DEFAULT_BACKEND, redistribute
from . import handshake as X
from . import trust
from .plan import Grid, Traffic, TransferPlan, as_grid, plan_for


def check_timeout(timeout: Any) -> None:
    """``ValueError`` unless ``timeout`` is None or a positive number of seconds."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(E.BAD_TIMEOUT.format(timeout=timeout))


#: dtypes each backend can all-reduce (gloo measured on this torch: ``Invalid scalar type``
#: for int16, uint16 and float8; nccl from its documented types). Other backends: not checked.
REDUCIBLE: dict[str, frozenset[torch.dtype]] = {
    "gloo": frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.complex128,
        }
    ),
    "nccl": frozenset(
        {
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int32,
            torch.int64,
        }
    ),
}


def backend_for(name: str, device_type: str) -> str:
    """The backend of a process group named ``name`` (``dist.get_backend``) for tensors of
    ``device_type``: ``"cpu:gloo,cuda:nccl"`` names one per device."""
    for part in name.split(","):
        dev, _, backend = part.rpartition(":")
        if not dev or dev == device_type:
            return backend
    return name


def check_reducible(td: Any, rank: int) -> None:
    """``ValueError`` naming the leaf if a ``Partial`` source has a dtype the backend of
    its mesh cannot all-reduce (checked before the handshake's verdict, so every rank
    raises and no data moves; gloo would fail inside the collective)."""
    for path, x in leaves_with_paths(td):
        if not isinstance(x, DTensor):
            continue
        for dim, p in enumerate(x.placements):
            if not isinstance(p, Partial):
                continue
            name = str(dist.get_backend(x.device_mesh.get_group(dim)))
            backend = backend_for(name, x.device_mesh.device_type)
            ok = REDUCIBLE.get(backend)
            complex_order = x.dtype.is_complex and p.reduce_op in ("max", "min")
            if (ok is not None and x.dtype not in ok) or complex_order:
                raise ValueError(
                    E.PLAN_PARTIAL_DTYPE.format(
                        rank=rank,
                        key=fmt_key(path),
                        op=p.reduce_op,
                        backend=backend,
                        dtype=x.dtype,
                    )
                )


def _signature(td: Any) -> tuple[Any, ...]:
    """What a sender's container must keep from step to step: structure, key paths, global
    shapes, dtypes, placements, requires_grad and the mesh."""
    pairs = leaves_with_paths(td)
    return (
        pytree.tree_flatten(td)[1],
        tuple(
            (
                path,
                tuple(x.shape),
                x.dtype,
                tuple(x.placements) if isinstance(x, DTensor) else None,
                x.requires_grad,
                x.device_mesh if isinstance(x, DTensor) else None,
            )
            for path, x in pairs
        ),
    )


class Transfer:
    """A planned transfer of a sharded container from mesh ``src`` to mesh ``dst``, reusable
    step after step (weight synchronisation: a trainer mesh pushing parameters to an
    inference mesh sharded differently).

    Building it is a handshake among every rank of both meshes (each calls ``Transfer(...)``
    at the same point of its program): the sending mesh's first rank sends the layout of its
    container (JSON: key paths, global shapes, dtypes, placements, both meshes), the
    receivers state their target placements, and every rank derives the same
    :class:`TransferPlan` (cached by layout). Anything that does not fit (ranks that pass
    different containers, receivers asking for different placements, a sender that expected
    other placements, a rank outside both meshes' views) raises ``ValueError`` on every rank
    before any data moves.

    Each step then moves only what each receiver needs, in one message per (sender,
    receiver) pair; ranks in both meshes copy what they hold locally. Packing and unpacking
    run as cached compiled graphs.

    Args:
        src: the sending mesh (a ``DeviceMesh`` or its rank array).
        dst: the receiving mesh: a ``DeviceMesh`` on the receiving ranks (the results are
            DTensors on it); its rank array is enough on ranks that only send.
        placements: the target placements, as in :func:`redistribute` (one sequence, a
            mapping from key paths, or a callable ``(key_path, meta_tensor) -> placements``).
            Required on receiving ranks; optional on the others (then checked against the
            receivers').
        like: on ranks of the sending mesh, a container with the layout of the ones it will
            send (usually the first one): DTensor leaves on ``src`` (plain tensor leaves travel
            as replicated tensors and arrive plain).
        group: the process group carrying the messages (default: the world).
        compile: run packing and unpacking as cached ``torch.compile(fullgraph=True)``
            graphs (``False``: the same code, eagerly).
        backend: their ``torch.compile`` backend.
        timeout: seconds each wait for a peer may last (``None``: the process group's).

    Attributes:
        plan: the :class:`TransferPlan`.
        bytes: its :class:`Traffic` (payload bytes: total, per sending and receiving rank,
            local copies); each message adds a 64-byte header.
        sends, receives: whether this rank sends / receives.

    Raises:
        ValueError: see above (every rank); TimeoutError: a peer did not take part within
            ``timeout``; TypeError: ``dst`` is not a DeviceMesh on a receiving rank.

    Example:
        The complete program (4 trainer ranks, 2 inference ranks, several steps) is
        ``examples/weight_sync.py``::

            sync = Transfer(train_mesh, infer_mesh, [Shard(1)], like=params)  # every rank
            for step in range(steps):
                if in_train:
                    sync.send(params)          # trainer ranks
                else:
                    params = sync.recv()       # inference ranks: DTensors on infer_mesh
            # a rank in both meshes calls sync(params), which sends and returns what it gets
    """

    def __init__(
        self,
        src: Any,
        dst: Any,
        placements: Any = None,
        *,
        like: Any = None,
        group: dist.ProcessGroup | None = None,
        compile: bool = True,
        backend: Any = DEFAULT_BACKEND,
        timeout: float | None = wire.DEFAULT_TIMEOUT,
    ) -> None:
        self._open("Transfer", src, dst, placements, like, group, compile, backend, timeout, None)

    @classmethod
    def _one_shot(
        cls,
        op: str,
        src: Any,
        dst: Any,
        placements: Any,
        like: Any,
        group: Any,
        compile: bool,
        backend: Any,
        timeout: Any,
        error: BaseException | None,
    ) -> Transfer:
        """A transfer for one ``send`` / ``recv`` call (``op``), with the role that call
        implies checked in the handshake; ``error``: an argument error to report."""
        self = cls.__new__(cls)
        self._open(op, src, dst, placements, like, group, compile, backend, timeout, error)
        return self

    def _open(
        self,
        op: str,
        src: Any,
        dst: Any,
        placements: Any,
        like: Any,
        group: Any,
        compile: bool,
        backend: Any,
        timeout: Any,
        error: BaseException | None,
    ) -> None:
        check_timeout(timeout)
        src_grid, dst_grid = as_grid(src), as_grid(dst)
        rank = dist.get_rank()
        self.rank = rank
        self.sends = rank in src_grid.ranks
        self.receives = rank in dst_grid.ranks
        if not (self.sends or self.receives):
            raise ValueError(
                E.PLAN_NOT_IN.format(
                    rank=rank, src=list(src_grid.nested()), dst=list(dst_grid.nested())
                )
            )
        self._src_grid: Grid = src_grid
        self._dst_grid: Grid = dst_grid
        self.group, self.compile, self.backend, self.timeout = group, compile, backend, timeout
        self.device = wire.comm_device(group)
        self._op = op
        self._mesh: DeviceMesh | None = dst if isinstance(dst, DeviceMesh) else None
        layout = None
        self._sig: tuple[Any, ...] | None = None
        try:
            if error is not None:
                raise error
            if op == "send" and self.receives:
                raise ValueError(E.PLAN_ROLE_RECV.format(rank=rank, mesh=list(dst_grid.nested())))
            if self.sends:
                if like is None:
                    raise ValueError(
                        E.PLAN_ROLE_SOURCE.format(rank=rank, mesh=list(src_grid.nested()))
                    )
                layout, mesh = X.layout_of(like, dst_grid, op)
                if as_grid(mesh) != src_grid:
                    raise ValueError(
                        E.PLAN_SRC_MESH.format(
                            rank=rank, mesh=describe_mesh(mesh), src=list(src_grid.nested())
                        )
                    )
                self._sig = _signature(like)
                check_reducible(like, rank)
            if self.receives:
                if placements is None:
                    raise ValueError(E.PLAN_NO_PLACEMENTS.format(rank=rank, op=op))
                if self._mesh is None:
                    raise TypeError(E.PLAN_DST_MESH.format(rank=rank, typ=type(dst).__name__))
        except (TypeError, ValueError, KeyError) as e:
            error = e
        side = X.Side(op, rank, src_grid, dst_grid, layout, error, self._answerer(placements))
        self.layout, targets = X.handshake(side, group, self.device, timeout)
        self._key = X.layout_key(self.layout, targets)
        self.plan: TransferPlan = plan_for(self._key)
        self.bytes: Traffic = self.plan.bytes
        self._digest = X.digest_of(self.layout, targets)
        self._step = 0
        self._reduce = {
            s.path: s.reduced for s in self.plan.leaves if s.reduced is not None and not s.plain
        }

    def _answerer(self, placements: Any) -> Callable[[dict[str, Any]], list[Any] | None]:
        def answer(layout: dict[str, Any]) -> list[Any] | None:
            theirs = X.grid_from_json(layout["src_mesh"]), X.grid_from_json(layout["dst_mesh"])
            if theirs != (self._src_grid, self._dst_grid):
                raise ValueError(
                    E.PLAN_MESH_DIFFERS.format(
                        rank=self.rank,
                        mine=[list(self._src_grid.nested()), list(self._dst_grid.nested())],
                        leader=self._src_grid.ranks[0],
                        theirs=[list(theirs[0].nested()), list(theirs[1].nested())],
                    )
                )
            if placements is None:
                return None
            targets = X.resolve_targets(layout, placements, self._dst_grid)
            limit = wire.device_limit(self.device)
            leader = self._src_grid.ranks[0]
            trust.check_fits(layout, targets, self._dst_grid, self.rank, leader, limit)
            return targets

        return answer

    # ----------------------------------------------------------------------------------
    def send(self, td: Any) -> int:
        """Send this rank's part of ``td`` (a rank of the sending mesh only); return the bytes
        of the messages it sent (payload and 64-byte headers)."""
        if self.receives:
            raise ValueError(
                E.PLAN_ROLE_RECV.format(rank=self.rank, mesh=list(self.plan.dst_mesh.nested()))
            )
        return self._run(td)[0]

    def recv(self) -> Any:
        """Receive this rank's shards (a rank of the receiving mesh only): a container of the
        sender's type whose leaves are DTensors on the receiving mesh with the target
        placements (plain leaves stay plain)."""
        if self.sends:
            raise ValueError(
                E.PLAN_ROLE_SOURCE.format(rank=self.rank, mesh=list(self.plan.src_mesh.nested()))
            )
        return self._run(None)[1]

    def __call__(self, td: Any = None) -> Any:
        """Run this rank's part of one step: send ``td`` (ranks of the sending mesh) and
        return what it receives (ranks of the receiving mesh; None on the others)."""
        return self._run(td)[1]

    def __repr__(self) -> str:
        return f"Transfer(rank={self.rank}, sends={self.sends}, receives={self.receives}, {self.plan!r})"

    # ----------------------------------------------------------------------------------
    def _source(self, td: Any) -> list[Tensor]:
        """This rank's local shards of ``td`` as the plan reads them (checked, reduced)."""
        if td is None:
            raise ValueError(
                E.PLAN_ROLE_SOURCE.format(rank=self.rank, mesh=list(self.plan.src_mesh.nested()))
            )
        sig = _signature(td) if is_node(td) else None
        if sig != self._sig:
            raise ValueError(
                E.PLAN_STEP_LAYOUT.format(rank=self.rank, what=_sig_diff(self._sig, sig))
            )
        if self._reduce:
            td = redistribute(
                td,
                lambda path, x: self._reduce.get(path),
                compile=self.compile,
                backend=self.backend,
            )
        out = []
        for _, x in leaves_with_paths(td):
            t = x._local_tensor if isinstance(x, DTensor) else x.detach()
            if t.device.type != self.device.type:
                t = t.to(self.device)
            out.append(t)
        return out

    def _run(self, td: Any) -> tuple[int, Any]:
        self._step += 1
        step, device, digest = self._step, self.device, self._digest
        failure: BaseException | None = None
        xs: list[Tensor] = []
        if self.sends:
            try:
                xs = self._source(td)
            except (TypeError, ValueError, KeyError) as e:
                failure = e
        works: list[tuple[wire.Peer, Any, str]] = []
        inbufs: list[Tensor] = []
        rs = X.recv_side(self._key, self.rank, device.type) if self.receives else None
        if rs is not None:
            for peer, n in zip(rs.peers, rs.nbytes):
                buf = torch.empty(X.HEADER_BYTES + n, dtype=torch.uint8, device=device)
                lk = self._link(peer)
                works.append((lk, lk.irecv(buf, X.DATA_TAG), "send its part of the step"))
                inbufs.append(buf)
        sent = 0
        if self.sends:
            ss = X.send_side(self._key, self.rank)
            if failure is not None:
                text = wire.reason_tensor(X.reason(failure), device)
                outs = [X.failed_buffer(n, digest, step, text) for n in ss.nbytes]
                for peer in ss.peers:
                    lk = self._link(peer)
                    if text.numel():
                        works.append((lk, lk.isend(text, X.FAILURE_TAG), "read why it failed"))
            else:
                headers = [X.data_header(wire.OK, digest, step, 0, device) for _ in ss.peers]
                pack = (
                    X.compiled_pack(self._key, self.rank, self.backend)
                    if self.compile
                    else _eager_pack(ss)
                )
                outs = pack(xs, headers)
            for peer, buf in zip(ss.peers, outs):
                lk = self._link(peer)
                works.append((lk, lk.isend(buf, X.DATA_TAG), "receive its part of the step"))
                sent += buf.numel()
        for lk, w, what in works:
            lk.finish(w, what)
        if failure is not None:
            raise failure
        if rs is None:
            return sent, None
        problems = []
        for peer, buf in zip(rs.peers, inbufs):
            h = X.read_header(buf)
            if h[0] == wire.MAGIC and h[2] == wire.FAILED:
                lk = self._link(peer)
                problems.append(
                    E.SENDER_FAILED.format(
                        src=peer,
                        reason=wire._recv_text(h[5], lk, "say why it failed", X.FAILURE_TAG),
                    )
                )
                continue
            problem = X.check_header(h, peer, self.rank, digest, step)
            if problem is not None:
                problems.append(problem)
        if problems:
            raise ValueError(problems[0])
        if self.compile:
            unpack = X.compiled_unpack(self._key, self.rank, device.type, self.backend)
        else:
            unpack = _eager_unpack(rs)
        locals_ = unpack(inbufs, xs)
        assert self._mesh is not None
        leaves = X.box_results(self._key, self.layout, self._mesh, locals_)
        return sent, wire.unflatten(self.layout["tree"], leaves)

    def _link(self, peer: int) -> wire.Peer:
        hint = E.PLAN_HINT.format(peer=peer, op=self._op)
        return wire.Peer(self._op, self.rank, peer, self.group, self.device, self.timeout, hint)


def _sig_diff(mine: Any, got: Any) -> str:
    if got is None:
        return "kind of value (not a TensorDict or tensorclass)"
    if mine[0] != got[0] or [e[0] for e in mine[1]] != [e[0] for e in got[1]]:
        return "key paths or structure"
    names = ("key path", "global shape", "dtype", "placements", "requires_grad", "mesh")
    for a, b in zip(mine[1], got[1]):
        for i in range(1, 6):
            if a[i] != b[i]:
                return f"{names[i]} of key {fmt_key(a[0])} ({b[i]} instead of {a[i]})"
    return "layout"


def _eager_pack(side: X.SendSide) -> Callable[..., list[Tensor]]:
    return lambda xs, hs: X.pack(xs, hs, side)


def _eager_unpack(side: X.RecvSide) -> Callable[..., list[Tensor]]:
    return lambda bufs, xs: X.unpack(bufs, xs, side)
