"""Point-to-point transfer of sharded containers: the wire protocol of ``send`` / ``recv``.

Three messages per transfer, whatever the number of leaves:

1. sender -> receiver: a fixed-size int64 header (magic, version, status, strategy, sizes,
   the sender's mesh shape and coordinate);
2. receiver -> sender: a fixed-size int64 reply (status and the receiver's mesh), so both
   sides validate the pairing and raise the same ``ValueError`` instead of hanging; a
   rejection is followed by its message as bytes;
3. sender -> receiver: one uint8 message: JSON metadata (tree structure, key paths, dtypes,
   global and local shapes, placements encoded structurally, source mesh) followed by every
   leaf's bytes at 64-byte aligned offsets.

Everything travels as tensors on the process group's device (CPU for gloo, CUDA for nccl).

Each kind of message has its own tag (:data:`HEADER_TAG`, ...; the header's includes the
protocol version), so a message the program sends with ``dist.send`` (tag 0) or a message of
another kind can never land in one of ours: gloo aborts the process when a message is larger
than the buffer that receives it, and silently fills part of a larger buffer. A message that
is not ours simply is not received, and the wait for ours ends at the timeout.

Every wait has a deadline (``timeout`` seconds, or the process group's timeout for None):
a peer that never answers gives ``TimeoutError``, a peer that died ``ConnectionError``, both
naming the peer rank and the step. After a timeout gloo closes every connection of the rank
that timed out (its whole process group), so the group must be rebuilt before further use.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..._compat import pytree
from ..._json import loads_unique
from ..._keys import KeyPath, fmt_key
from ..._nontensor import NonTensor
from ..._ops._structure import check_batch_invariant
from ..._tensorclass import is_tensorclass
from ..._tree import class_of, context_from_json, nested_type_names, node_type
from ..._tree import leaves as tree_leaves
from . import errors as E
from .placements import encode_placements

MAGIC = 0x7464665F  # "tdf_"
VERSION = 2
#: seconds each step of send / recv waits for the peer unless ``timeout=`` says otherwise
DEFAULT_TIMEOUT = 120.0
TAG_BASE = 0x74640000  # "td" << 16; gloo tags are 32-bit
HEADER_TAG = TAG_BASE + 16 * VERSION + 1
REPLY_TAG = TAG_BASE + 16 * VERSION + 2
TEXT_TAG = TAG_BASE + 16 * VERSION + 3
DATA_TAG = TAG_BASE + 16 * VERSION + 4
MAX_MESH_DIMS = 8
HEADER_LEN = 8 + 2 * MAX_MESH_DIMS  # 7 fields + the mesh (ndim, shape, coordinate)
REPLY_LEN = 3 + 2 * MAX_MESH_DIMS  # status, message size + the mesh
ALIGN = 64
STRATEGIES = ("local", "full")

OK = 0
FAILED = 1


def comm_device(group: Any) -> torch.device:
    """Where transport tensors live: CUDA for a pure nccl group, CPU otherwise (gloo)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _mesh_fields(shape: Sequence[int] | None, coord: Sequence[int] | None) -> list[int]:
    if shape is None:
        return [-1] + [-1] * (2 * MAX_MESH_DIMS)
    if len(shape) > MAX_MESH_DIMS:
        raise ValueError(E.MESH_TOO_LARGE.format(max=MAX_MESH_DIMS, ndim=len(shape)))
    pad = [-1] * (MAX_MESH_DIMS - len(shape))
    c = list(coord) if coord is not None else [-1] * len(shape)
    return [len(shape), *shape, *pad, *c, *pad]


def _read_mesh(fields: Sequence[int]) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    n = fields[0]
    if n < 0:
        return None, None
    shape = tuple(fields[1 : 1 + n])
    coord = tuple(fields[1 + MAX_MESH_DIMS : 1 + MAX_MESH_DIMS + n])
    return shape, (None if any(c < 0 for c in coord) else coord)


class Peer:
    """One side of a point-to-point exchange: who talks to whom, over which group, with which
    deadline (seconds, or None for the process group's timeout) and what to suggest when the
    peer does not answer."""

    def __init__(
        self,
        op: str,
        rank: int,
        peer: int,
        group: Any,
        device: torch.device,
        timeout: Any,
        hint: str | None = None,
    ) -> None:
        self.op = op
        self.rank = rank
        self.peer = peer
        self.group = group
        self.device = device
        self.timeout = timeout
        other = "recv" if op == "send" else "send"
        self.hint = hint or E.PEER_HINT.format(peer=peer, other=other, rank=rank)

    def finish(self, work: Any, step: str) -> None:
        """Wait for ``work``; ``TimeoutError`` / ``ConnectionError`` naming the peer and
        ``step`` (what the peer was expected to do) when it does not complete."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            text = str(e).strip()
            reason = text.splitlines()[0] if text else type(e).__name__
            if "timed out" in reason.lower() or "timeout" in reason.lower():
                waited = (
                    "the process group's timeout" if self.timeout is None else f"{self.timeout:g} s"
                )
                raise TimeoutError(
                    E.PEER_TIMEOUT.format(
                        op=self.op,
                        rank=self.rank,
                        peer=self.peer,
                        timeout=waited,
                        step=step,
                        hint=self.hint,
                    )
                ) from e
            raise ConnectionError(
                E.PEER_LOST.format(
                    op=self.op, rank=self.rank, peer=self.peer, step=step, reason=reason
                )
            ) from e

    def isend(self, t: Tensor, tag: int) -> Any:
        """Start sending ``t`` to the peer."""
        return dist.isend(t, self.peer, group=self.group, tag=tag)

    def irecv(self, t: Tensor, tag: int) -> Any:
        """Start receiving into ``t`` from the peer."""
        return dist.irecv(t, self.peer, group=self.group, tag=tag)

    def send(self, t: Tensor, tag: int, step: str) -> None:
        """Send ``t`` to the peer; ``step`` says what the peer is expected to do."""
        self.finish(self.isend(t, tag), step)

    def recv(self, t: Tensor, tag: int, step: str) -> None:
        """Receive into ``t`` from the peer."""
        self.finish(self.irecv(t, tag), step)


#: the longest failure reason (UTF-8 bytes) a peer sends or reads; longer ones are cut
MAX_REASON = 1 << 16


def _bytes_tensor(text: str, device: torch.device, limit: int | None = None) -> Tensor:
    raw = bytearray(text.encode("utf-8"))
    if limit is not None and len(raw) > limit:
        raw = bytearray(bytes(raw[:limit]).decode("utf-8", "ignore").encode("utf-8"))
    return (
        torch.frombuffer(raw, dtype=torch.uint8).to(device)
        if raw
        else torch.empty(0, dtype=torch.uint8, device=device)
    )


def reason_tensor(text: str, device: torch.device) -> Tensor:
    """A failure reason as UTF-8 bytes, cut to :data:`MAX_REASON` (what a peer reads)."""
    return _bytes_tensor(text, device, MAX_REASON)


def _text(t: Tensor) -> str:
    return t.cpu().numpy().tobytes().decode("utf-8")


def meta_error(what: str, peer: int, field: str, detail: str) -> E.TransferMetadataError:
    """The :class:`~.errors.TransferMetadataError` for ``field`` of a message (``what``)
    from rank ``peer``."""
    return E.TransferMetadataError(
        E.TRANSFER_META.format(what=what, peer=peer, field=field, detail=detail)
    )


def device_limit(device: torch.device) -> int:
    """The most bytes one received message may announce on ``device``: its total memory
    (a larger size is refused before anything is allocated)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def check_size(n: Any, limit: int, what: str, peer: int, field: str) -> int:
    """``n`` (a byte count a peer announced) as an int in ``[0, limit]``."""
    if type(n) is not int:
        raise meta_error(what, peer, field, f"expected an int, got {type(n).__name__}")
    if n < 0:
        raise meta_error(what, peer, field, f"a negative size ({n})")
    if n > limit:
        raise E.TransferMetadataError(
            E.TRANSFER_SIZE.format(what=what, peer=peer, field=field, size=n, limit=limit)
        )
    return n


def _recv_text(n: int, link: Peer, step: str, tag: int = TEXT_TAG) -> str:
    """A failure reason of ``n`` bytes (at most :data:`MAX_REASON`) from the peer."""
    check_size(n, MAX_REASON, "a failure reason", link.peer, "message bytes")
    if n == 0:
        return ""
    t = torch.empty(n, dtype=torch.uint8, device=link.device)
    link.recv(t, tag, step)
    return t.cpu().numpy().tobytes().decode("utf-8", "replace")  # a reason is only shown


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


#: every dtype of this torch by :func:`dtype_name` (a name read from a file or a peer is
#: looked up here, never with ``getattr(torch, name)``: torch's module ``__getattr__``
#: imports lazy submodules and calls deprecated helpers)
_DTYPES: dict[str, torch.dtype] = {
    dtype_name(d): d for d in list(vars(torch).values()) if isinstance(d, torch.dtype)
}


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name` (``ValueError`` for unknown names)."""
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ValueError(f"unknown dtype {name!r} in transfer metadata")
    return dt


def loads(text: str | bytes) -> Any:
    """JSON from a file or a peer: a key given twice in one object is refused
    (``ValueError``), so every reader of the data reads the same values (JSON readers
    disagree on duplicates: Python's keeps the last one, others the first)."""
    return loads_unique(text, E.JSON_DUPLICATE_KEY)


# --------------------------------------------------------------------------------------
# sender
# --------------------------------------------------------------------------------------
class Outgoing:
    """What a sender ships: metadata, the tensors to pack, and its mesh."""

    def __init__(
        self,
        meta: dict[str, Any],
        tensors: list[Tensor],
        mesh: DeviceMesh | None,
        has_dtensor: bool,
    ) -> None:
        self.meta = meta
        self.tensors = tensors
        self.mesh = mesh
        self.has_dtensor = has_dtensor


def describe(
    node: Any,
    pairs: Sequence[tuple[KeyPath, Tensor]],
    payload: Sequence[Tensor],
    sources: Sequence[Tensor],
    strategy: str,
    mesh: DeviceMesh | None,
) -> Outgoing:
    """Metadata for ``node``: ``payload[i]`` is what travels for leaf ``pairs[i]``, ``sources[i]``
    the leaf it came from (a DTensor or a plain tensor)."""
    _, spec = pytree.tree_flatten(node)
    entries: list[dict[str, Any]] = []
    offset = 0
    for (path, _), t, src in zip(pairs, payload, sources):
        nbytes = t.numel() * t.element_size()
        entry: dict[str, Any] = {
            "path": list(path),
            "kind": "dtensor" if isinstance(src, DTensor) and strategy == "local" else "tensor",
            "was_dtensor": isinstance(src, DTensor),
            "dtype": dtype_name(t.dtype),
            "shape": list(src.shape),
            "local_shape": list(t.shape),
            "requires_grad": bool(src.requires_grad),
            "offset": offset,
            "nbytes": nbytes,
        }
        if isinstance(src, DTensor):
            entry["placements"] = encode_placements(src.placements, path)
        entries.append(entry)
        offset = _align(offset + nbytes)
    mesh_meta = None
    if mesh is not None:
        coord = mesh.get_coordinate()
        mesh_meta = {
            "shape": list(mesh.shape),
            "dim_names": None if mesh.mesh_dim_names is None else list(mesh.mesh_dim_names),
            "device_type": mesh.device_type,
            "coordinate": None if coord is None else list(coord),
        }
    meta = {
        "format": "tdfunc.transfer",
        "version": VERSION,
        "strategy": strategy,
        "mesh": mesh_meta,
        "tree": json.loads(pytree.treespec_dumps(spec)),
        "leaves": entries,
        "data_nbytes": offset,
    }
    has_dt = any(isinstance(s, DTensor) for s in sources)
    return Outgoing(meta, list(payload), mesh, has_dt)


def _header(
    status: int,
    strategy: int,
    meta_n: int,
    total: int,
    has_dt: bool,
    shape: Sequence[int] | None,
    coord: Sequence[int] | None,
    device: torch.device,
) -> Tensor:
    fields = [MAGIC, VERSION, status, strategy, meta_n, total, int(has_dt)]
    return torch.tensor(fields + _mesh_fields(shape, coord), dtype=torch.int64, device=device)


def send_error(reason: str, link: Peer) -> None:
    """Tell the receiver this send failed (it raises too instead of waiting)."""
    device = link.device
    msg = reason_tensor(reason, device)
    header = _header(FAILED, 0, msg.numel(), 0, False, None, None, device)
    link.send(header, HEADER_TAG, "accept the transfer (call recv)")
    if msg.numel():
        link.send(msg, TEXT_TAG, "read why the transfer failed")


def send_outgoing(out: Outgoing, link: Peer) -> int:
    """Run the sender side of the protocol; return the bytes of the consolidated message."""
    device, dst = link.device, link.peer
    meta_bytes = _bytes_tensor(json.dumps(out.meta, separators=(",", ":")), device)
    meta_n = meta_bytes.numel()
    start = _align(meta_n)
    total = start + out.meta["data_nbytes"]
    coord = None if out.mesh is None else out.mesh.get_coordinate()
    shape = None if out.mesh is None else tuple(out.mesh.shape)
    strategy = STRATEGIES.index(out.meta["strategy"])
    header = _header(OK, strategy, meta_n, total, out.has_dtensor, shape, coord, device)
    link.send(header, HEADER_TAG, "accept the transfer (call recv)")
    reply = torch.empty(REPLY_LEN, dtype=torch.int64, device=device)
    link.recv(reply, REPLY_TAG, "reply to the transfer header")
    r = reply.tolist()
    if r[0] not in (OK, FAILED):
        raise meta_error("the reply to a transfer header", dst, "status", f"{r[0]} is not 0 or 1")
    if r[0] != OK:
        reason = _recv_text(r[1], link, "say why it rejected the transfer")
        raise ValueError(E.RECEIVER_FAILED.format(dst=dst, reason=reason))
    buf = torch.zeros(total, dtype=torch.uint8, device=device)
    buf[:meta_n].copy_(meta_bytes)
    for entry, t in zip(out.meta["leaves"], out.tensors):
        n = entry["nbytes"]
        if n:
            off = start + entry["offset"]
            buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    link.send(buf, DATA_TAG, "receive the data")
    return total


# --------------------------------------------------------------------------------------
# receiver
# --------------------------------------------------------------------------------------
class Incoming:
    """What a receiver got: metadata and the raw leaves (local shards or full tensors)."""

    def __init__(self, meta: dict[str, Any], tensors: list[Tensor]) -> None:
        self.meta = meta
        self.tensors = tensors


def _validate(
    src: int,
    dst: int,
    h: Sequence[int],
    mesh: DeviceMesh | None,
    placements: Any,
) -> str | None:
    strategy = STRATEGIES[h[3]] if 0 <= h[3] < len(STRATEGIES) else "?"
    has_dt = bool(h[6])
    s_shape, s_coord = _read_mesh(h[7:])
    r_coord = None if mesh is None else mesh.get_coordinate()
    if placements is not None and mesh is None:
        return E.RECV_PLACEMENTS_NO_MESH.format(dst=dst)
    if mesh is not None and r_coord is None:
        return E.RECV_NOT_IN_MESH.format(dst=dst, src=src)
    if (
        placements is not None
        and isinstance(placements, Sequence)
        and not isinstance(placements, str)
        and len(placements) != mesh.ndim  # type: ignore[union-attr]
    ):
        return E.RECV_PLACEMENTS_LENGTH.format(dst=dst, n=len(placements), ndim=mesh.ndim)  # type: ignore[union-attr]
    if strategy == "local" and has_dt:
        if mesh is None:
            return E.NO_RECV_MESH.format(src=src, dst=dst)
        r_shape = tuple(mesh.shape)
        if r_shape != s_shape or tuple(r_coord) != s_coord:  # type: ignore[arg-type]
            return E.MESH_MISMATCH.format(
                src=src,
                src_coord=s_coord,
                src_shape=s_shape,
                dst=dst,
                dst_coord=tuple(r_coord),  # type: ignore[arg-type]
                dst_shape=r_shape,
            )
    return None


HEADER_WHAT = "the transfer header"
META_WHAT = "the transfer metadata"


def header_problem(h: Sequence[int], peer: int, limit: int) -> E.TransferMetadataError | None:
    """What is wrong with a transfer header from rank ``peer`` whose magic and version
    fit (None: nothing): every field is checked before a byte is allocated for it, sizes
    against ``limit`` (:func:`device_limit`)."""
    try:
        if h[2] not in (OK, FAILED):
            raise meta_error(HEADER_WHAT, peer, "status", f"{h[2]} is not 0 or 1")
        if h[2] == FAILED:
            check_size(h[4], MAX_REASON, HEADER_WHAT, peer, "message bytes")
            return None
        if not 0 <= h[3] < len(STRATEGIES):
            raise meta_error(
                HEADER_WHAT, peer, "strategy", f"{h[3]} is not an index of {STRATEGIES}"
            )
        meta_n = check_size(h[4], limit, HEADER_WHAT, peer, "metadata bytes")
        total = check_size(h[5], limit, HEADER_WHAT, peer, "total bytes")
        if meta_n == 0 or total < _align(meta_n):
            raise meta_error(
                HEADER_WHAT, peer, "total bytes", f"{total} cannot hold {meta_n} metadata bytes"
            )
        if h[6] not in (0, 1):
            raise meta_error(HEADER_WHAT, peer, "has_dtensor", f"{h[6]} is not 0 or 1")
        n, m = h[7], MAX_MESH_DIMS
        if n == -1:
            rest = [i for i, v in enumerate(h[8:]) if v != -1]
            if rest:
                raise meta_error(HEADER_WHAT, peer, f"mesh field {rest[0]}", "set without a mesh")
            return None
        if not 1 <= n <= m:
            raise meta_error(HEADER_WHAT, peer, "mesh ndim", f"{n} is not in [1, {m}] or -1")
        shape, coord = h[8 : 8 + m], h[8 + m : 8 + 2 * m]
        for i in range(m):
            if i >= n and (shape[i] != -1 or coord[i] != -1):
                raise meta_error(HEADER_WHAT, peer, f"mesh dim {i}", f"set past ndim {n}")
            if i < n and shape[i] < 1:
                raise meta_error(HEADER_WHAT, peer, f"mesh shape[{i}]", f"{shape[i]} is not >= 1")
            if i < n and not -1 <= coord[i] < shape[i]:
                raise meta_error(
                    HEADER_WHAT, peer, f"mesh coordinate[{i}]", f"{coord[i]} is out of range"
                )
    except E.TransferMetadataError as e:
        return e
    return None


def receive(
    link: Peer,
    mesh: DeviceMesh | None,
    placements: Any,
    check: Callable[[bytes, Sequence[int]], dict[str, Any]],
) -> Incoming:
    """Run the receiver side of the protocol; ``ValueError`` (after telling the sender) on a
    pairing that does not fit, :class:`~.errors.TransferMetadataError` on a header or
    metadata that does not follow the format (``check(raw, header)`` parses and checks the
    metadata's UTF-8 JSON bytes before any tensor is built from them)."""
    device, src, dst = link.device, link.peer, link.rank
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    link.recv(header, HEADER_TAG, "send a transfer header")
    h = header.tolist()
    if h[0] != MAGIC or h[1] != VERSION:
        raise ValueError(E.BAD_HEADER.format(dst=dst, src=src, magic=h[0], version=h[1]))
    bad = header_problem(h, src, device_limit(device))
    if h[2] == FAILED:
        if bad is not None:
            raise bad
        reason = _recv_text(h[4], link, "say why it failed")
        raise ValueError(E.SENDER_FAILED.format(src=src, reason=reason))
    problem = str(bad) if bad is not None else _validate(src, dst, h, mesh, placements)
    shape = None if mesh is None else tuple(mesh.shape)
    coord = None if mesh is None else mesh.get_coordinate()
    msg = reason_tensor(problem or "", device)
    reply = torch.tensor(
        [OK if problem is None else FAILED, msg.numel(), *_mesh_fields(shape, coord)],
        dtype=torch.int64,
        device=device,
    )
    link.send(reply, REPLY_TAG, "read the reply to its header")
    if problem is not None:
        if msg.numel():
            link.send(msg, TEXT_TAG, "read why the transfer was rejected")
        raise bad if bad is not None else ValueError(problem)
    meta_n, total = h[4], h[5]
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    link.recv(buf, DATA_TAG, "send the data")
    meta = check(buf[:meta_n].cpu().numpy().tobytes(), h)
    start = _align(meta_n)
    tensors = []
    for entry in meta["leaves"]:
        dtype = dtype_from_name(entry["dtype"])
        off = start + entry["offset"]
        raw = buf[off : off + entry["nbytes"]]
        t = raw.view(dtype) if entry["nbytes"] else torch.empty(0, dtype=dtype, device=device)
        tensors.append(t.reshape(entry["local_shape"]))
    return Incoming(meta, tensors)


#: nesting of node specs a structure may have (a checkpoint holds at most 64 levels)
MAX_SPEC_DEPTH = 256
_NODE_FIELDS = frozenset(("type", "context", "children_spec"))


def _bad(detail: str) -> E.SpecFormatError:
    return E.SpecFormatError(E.SPEC_BAD.format(detail=detail))


def _node_class(name: Any, unknown: str) -> type:
    """The tdfunc node class registered as ``name`` in this process (a dict lookup: nothing
    is imported). ``ValueError`` (``unknown``) for a name nothing registered,
    :class:`SpecFormatError` for a registered pytree type that is not a tdfunc node (dict,
    list, defaultdict, ...: their JSON decoders import what the data names)."""
    if not isinstance(name, str):
        raise _bad(f"a node type that is not a string: {str(name)[:80]!r}")
    cls = node_type(name)
    known = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
    if cls is None:
        if known is None:
            raise ValueError(unknown.format(name=name))
        raise E.SpecFormatError(E.SPEC_NODE_KIND.format(name=name))
    found: type = cls
    if known is not found:  # another class took the name in torch's registry
        raise E.SpecFormatError(E.SPEC_NODE_KIND.format(name=name))
    return found


def _check_fields(cls: type, ctx: tuple) -> None:
    """A tensorclass context names the class's own fields and static fields (in order); a
    TensorDict has no static fields. Nested nodes too."""
    tc = is_tensorclass(cls)  # a TensorDict has free keys and no static fields
    names = cls._tdf_child_names if tc else None  # type: ignore[attr-defined]
    statics = cls._tdf_static_names if tc else ()  # type: ignore[attr-defined]
    if names is not None and tuple(ctx[0]) != tuple(names):
        raise _bad(f"the fields {list(ctx[0])} are not those of {cls.__qualname__}")
    if tuple(k for k, _ in ctx[5]) != tuple(statics):
        raise _bad(f"the static fields of a {cls.__qualname__} are not {list(statics)}")
    for _, token, sub in ctx[7]:
        _check_fields(class_of(token), sub)


def _children(ctx: tuple) -> int:
    """How many children torch's pytree sees for a node of context ``ctx``: its own
    children that are neither ``None`` nor non-tensor leaves (those live in the context)
    and, nested nodes flattened in place, theirs."""
    subs = {i for i, _, _ in ctx[7]}
    own = sum(
        1
        for i, nd in enumerate(ctx[2])
        if not isinstance(nd, NonTensor) and nd != -1 and i not in subs
    )
    return own + sum(_children(sub) for _, _, sub in ctx[7])


def _spec_of(obj: Any, unknown: str, depth: int) -> pytree.TreeSpec:
    if depth > MAX_SPEC_DEPTH:
        raise _bad(f"nested more than {MAX_SPEC_DEPTH} levels")
    if not isinstance(obj, dict) or not set(obj) <= _NODE_FIELDS or "children_spec" not in obj:
        raise _bad("a node is not {'type', 'context', 'children_spec'}")
    name, raw, kids = obj.get("type"), obj.get("context"), obj["children_spec"]
    if name is None:
        if raw is not None or kids != []:
            raise _bad("a leaf with a context or children")
        return pytree.treespec_leaf()
    cls = _node_class(name, unknown)
    if not isinstance(kids, list):
        raise _bad("children_spec is not a list")
    try:
        inners = nested_type_names(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(f"a {name} context: {e}") from None
    for inner in inners:  # every nested node's type, before anything is built
        _node_class(inner, unknown)
    try:
        ctx = context_from_json(raw)
    except (ValueError, RecursionError) as e:
        raise _bad(f"a {name} context: {e}") from None
    _check_fields(cls, ctx)
    want = _children(ctx)
    if len(kids) != want:
        raise _bad(f"a {name} node has {len(kids)} child specs for {want} children")
    return pytree.TreeSpec(cls, ctx, [_spec_of(k, unknown, depth + 1) for k in kids])


def spec_from_json(tree: Any, unknown: str = E.UNKNOWN_NODE_TYPE) -> pytree.TreeSpec:
    """The pytree spec of a container from its JSON form (``treespec_dumps``), read from a
    file or a peer: tdfunc's own decoder, never torch's ``treespec_loads`` (whose decoders
    for builtin node kinds import modules, follow attributes and subscript what the data
    names: ``enum`` contexts, ``defaultdict`` factories).

    Allow-list: leaves, and TensorDict / tensorclass nodes registered in this process
    (looked up by name in the registry; nothing is imported) with contexts of the shape
    tdfunc writes (keys, batch dims, child ndims, device, static fields of JSON values,
    nested nodes), a tensorclass's fields its class's own.

    Raises:
        ValueError: (``unknown``) a container type that is not registered in this process.
        SpecFormatError: anything else (another node kind, a malformed context, a count of
            children that does not match).
    """
    if not (isinstance(tree, list) and len(tree) == 2 and type(tree[0]) is int and tree[0] == 1):
        raise _bad("not [1, <node>] (protocol 1)")
    spec = _spec_of(tree[1], unknown, 0)
    if spec.is_leaf():
        raise _bad("the root is a leaf, not a container")
    return spec


def unflatten(tree: Any, leaves: Sequence[Tensor], unknown: str = E.UNKNOWN_NODE_TYPE) -> Any:
    """Rebuild the sender's (or the saved) container from the JSON ``tree`` (checked by
    :func:`spec_from_json`) and its leaves; the result satisfies the batch-size invariant
    of every node (:class:`SpecFormatError` otherwise)."""
    spec = spec_from_json(tree, unknown)
    if spec.num_leaves != len(leaves):
        raise _bad(f"{spec.num_leaves} leaves in the structure, {len(leaves)} given")
    try:
        node = pytree.tree_unflatten(list(leaves), spec)
        check_batch_invariant(node, tree_leaves(node), node._batch_size, "reading a structure")
    except (ValueError, TypeError, IndexError, RuntimeError) as e:
        raise _bad(f"{type(e).__name__}: {e}") from None
    return node


def key_of(entry: dict[str, Any]) -> str:
    """The key path of a metadata entry, formatted for messages."""
    return fmt_key(tuple(entry["path"]))
