"""Cross-mesh transfers with a plan (strategy ``"plan"``): the handshake, packing and the
data exchange behind :class:`Transfer`, ``send(td, dst_mesh)`` and ``recv(src_mesh, ...)``.

Handshake (once per :class:`Transfer`; every call of the one-shot ``send`` / ``recv``)
----------------------------------------------------------------------------------------
The *leader* is the sending mesh's first rank; the *participants* are every other rank of
either mesh. Three rounds of small point-to-point messages, each a fixed-size int64 head
followed by JSON text (never pickle), on tags of their own:

1. leader -> participants: the layout (tree structure, key paths, global shapes, dtypes,
   source placements encoded structurally, both meshes' rank arrays), or why the leader
   failed (everyone then raises ``ValueError``);
2. participants -> leader: a sender compares its own container with the layout; a receiver
   checks the meshes and resolves its target placements against the layout's leaves (a
   sender may state the placements it expects too); each answers with its placements or
   why it rejects the transfer;
3. leader -> participants: the verdict: the agreed target placements, or the reason
   (ranks that rejected their arguments, receivers that ask for different placements,
   senders that expected others). Every rank raises the same ``ValueError`` on a failure
   (a rank whose own argument was wrong raises its own ``KeyError`` / ``TypeError`` /
   ``ValueError``); nobody waits for data that will not come.

Every rank then derives the same :class:`~.plan.TransferPlan` (cached by layout).

Data (every step)
-----------------
Each sender packs, per receiver, every piece it owes it into one uint8 buffer (a 64-byte
header: magic, version, status, the plan's digest and the step number, then the pieces
back to back) and sends it: one message per (sender, receiver) pair, whatever the number of
leaves. Each receiver unpacks its buffers and its local copies into its target shards. Both
run as cached ``torch.compile(fullgraph=True)`` graphs, one per (plan, rank). A sender whose
container does not fit the plan sends a same-size buffer marked as failed with the reason,
so its receivers raise ``ValueError`` too. Every wait has a deadline (``timeout``).
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..._compat import DTensorSpec, TensorMeta, pytree
from ..._keys import KeyPath, fmt_key
from ..._tree import leaves_with_paths
from .._common import errors as E
from .._common import placements as codec
from .._common import wire
from .._common.agree import _hash
from .._common.caches import register
from .._common.mesh import check_node, common_mesh
from .._redistribute import plan as plan_mod
from . import trust
from .plan import (
    Grid,
    LayoutKey,
    as_grid,
    kind_of,
    placement_of,
    plan_for,
    resolve_kinds,
)

XTAG = wire.TAG_BASE + 0x2000
LAYOUT_HEAD_TAG = XTAG + 1
LAYOUT_TEXT_TAG = XTAG + 2
ANSWER_HEAD_TAG = XTAG + 3
ANSWER_TEXT_TAG = XTAG + 4
VERDICT_HEAD_TAG = XTAG + 5
VERDICT_TEXT_TAG = XTAG + 6
DATA_TAG = XTAG + 7
FAILURE_TAG = XTAG + 8  # the reason a sender failed a step, after its (failed) data message
#: every tag of this protocol
TAGS = tuple(XTAG + k for k in range(1, 9))
HEAD_LEN = 4  # magic, version, status, text bytes
HEADER_BYTES = 64  # of each data message: 8 int64
FORMAT = "tdfunc.transfer_plan"
OK, FAILED = wire.OK, wire.FAILED
#: compiled pack / unpack functions kept (one per plan, rank and backend)
CACHE_SIZE = 128


# --------------------------------------------------------------------------------------
# layouts: what the sending ranks hold, as JSON
# --------------------------------------------------------------------------------------
def grid_json(g: Grid) -> dict[str, Any]:
    """A mesh's rank array as JSON."""
    return {"shape": list(g.shape), "ranks": list(g.ranks)}


def grid_from_json(obj: Any) -> Grid:
    """Inverse of :func:`grid_json`."""
    return Grid(tuple(int(s) for s in obj["shape"]), tuple(int(r) for r in obj["ranks"]))


def layout_of(td: Any, dst: Grid, op: str) -> tuple[dict[str, Any], DeviceMesh]:
    """The JSON layout of a sender's container (and its DTensors' mesh).

    ``ValueError`` for a container without DTensor leaves or with placements a plan cannot
    move, ``TypeError`` for something that is not a container.
    """
    check_node(td, op)
    pairs = leaves_with_paths(td)
    mesh = common_mesh(pairs)
    if mesh is None:
        raise ValueError(E.PLAN_NO_DTENSOR.format(op=op))
    leaves = []
    for path, x in pairs:
        encoded = None
        if isinstance(x, DTensor):
            for p in x.placements:
                kind_of(p, path)  # ValueError for placements a plan cannot move
            encoded = codec.encode_placements(x.placements, path)
        leaves.append(
            {
                "path": list(path),
                "shape": list(x.shape),
                "dtype": wire.dtype_name(x.dtype),
                "placements": encoded,
                "requires_grad": bool(x.requires_grad),
            }
        )
    _, spec = pytree.tree_flatten(td)
    layout = {
        "format": FORMAT,
        "version": wire.VERSION,
        "tree": json.loads(pytree.treespec_dumps(spec)),
        "leaves": leaves,
        "src_mesh": grid_json(as_grid(mesh)),
        "dst_mesh": grid_json(dst),
    }
    return layout, mesh


def _differs(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two layouts, for the error message (None: they are equal)."""
    if mine == theirs:
        return None
    for what, field in (("sending mesh", "src_mesh"), ("receiving mesh", "dst_mesh")):
        if mine[field] != theirs[field]:
            return f"{what} ({mine[field]['ranks']} vs {theirs[field]['ranks']})"
    a, b = mine["leaves"], theirs["leaves"]
    if [x["path"] for x in a] != [x["path"] for x in b] or mine["tree"] != theirs["tree"]:
        return f"key paths or structure ({len(a)} vs {len(b)} leaves)"
    for field, what in (
        ("shape", "global shapes"),
        ("dtype", "dtypes"),
        ("placements", "placements"),
        ("requires_grad", "requires_grad flags"),
    ):
        for x, y in zip(a, b):
            if x[field] != y[field]:
                return f"{what} (key {fmt_key(tuple(x['path']))}: {x[field]} vs {y[field]})"
    return "layout"


def _pairs(layout: dict[str, Any]) -> list[tuple[KeyPath, Tensor]]:
    """``(path, meta tensor)`` of every leaf of a layout (for placement specs)."""
    return [
        (
            tuple(x["path"]),
            torch.empty(x["shape"], dtype=wire.dtype_from_name(x["dtype"]), device="meta"),
        )
        for x in layout["leaves"]
    ]


def resolve_targets(layout: dict[str, Any], spec: Any, dst: Grid) -> list[Any]:
    """The encoded target placements of every leaf (None for plain leaves)."""
    pairs = _pairs(layout)
    dt = [i for i, x in enumerate(layout["leaves"]) if x["placements"] is not None]
    kinds = resolve_kinds([pairs[i] for i in dt], spec, dst, "TensorDict", [p for p, _ in pairs])
    out: list[Any] = [None] * len(pairs)
    for i, ks in zip(dt, kinds):
        out[i] = [codec.encode_placement(p) for p in _placements(ks)]
    return out


def _placements(ks: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(placement_of(k) for k in ks)


def layout_key(layout: dict[str, Any], targets: Sequence[Any]) -> LayoutKey:
    """The planner's key for an agreed layout and its target placements."""
    src = grid_from_json(layout["src_mesh"])
    dst = grid_from_json(layout["dst_mesh"])
    leaves = layout["leaves"]
    plain = tuple(x["placements"] is None for x in leaves)
    return LayoutKey(
        paths=tuple(tuple(x["path"]) for x in leaves),
        shapes=tuple(tuple(x["shape"]) for x in leaves),
        dtypes=tuple(wire.dtype_from_name(x["dtype"]) for x in leaves),
        src=tuple(
            (("replicate",),) * src.ndim
            if x["placements"] is None
            else tuple(kind_of(p, ()) for p in codec.decode_placements(x["placements"]))
            for x in leaves
        ),
        dst=tuple(
            (("replicate",),) * dst.ndim
            if t is None
            else tuple(kind_of(p, ()) for p in codec.decode_placements(t))
            for t in targets
        ),
        plain=plain,
        src_mesh=src,
        dst_mesh=dst,
    )


# --------------------------------------------------------------------------------------
# the handshake
# --------------------------------------------------------------------------------------
class Side:
    """What this rank brings to a transfer.

    ``layout``: its container's layout (ranks of the sending mesh); ``error``: the exception
    its own arguments raised (reported to the others, then raised here); ``answer``: a
    function ``layout -> target placements or None`` checking what this rank knows (the
    meshes; on receivers, the placements it asks for).
    """

    def __init__(
        self,
        op: str,
        rank: int,
        src: Grid,
        dst: Grid,
        layout: dict[str, Any] | None,
        error: BaseException | None,
        answer: Callable[[dict[str, Any]], list[Any] | None],
    ) -> None:
        self.op = op
        self.rank = rank
        self.src = src
        self.dst = dst
        self.layout = layout
        self.error = error
        self.answer = answer


def _text_tensor(text: str, device: torch.device) -> Tensor:
    return wire._bytes_tensor(text, device)


def _head(status: int, n: int, device: torch.device) -> Tensor:
    return torch.tensor([wire.MAGIC, wire.VERSION, status, n], dtype=torch.int64, device=device)


def _post_text(link: wire.Peer, head_tag: int, text_tag: int, status: int, text: str) -> list[Any]:
    body = (
        wire.reason_tensor(text, link.device) if status != OK else _text_tensor(text, link.device)
    )
    works = [link.isend(_head(status, body.numel(), link.device), head_tag)]
    if body.numel():
        works.append(link.isend(body, text_tag))
    return works


def _post_text_all(
    links: Sequence[wire.Peer], head_tag: int, text_tag: int, status: int, text: str, step: str
) -> None:
    """Post one text message to every link, then wait for all of them (``step`` names what
    the peers must do, for the timeout message)."""
    works = [(lk, w) for lk in links for w in _post_text(lk, head_tag, text_tag, status, text)]
    for lk, w in works:
        lk.finish(w, step)


def _read_text(
    link: wire.Peer, head_tag: int, text_tag: int, step: str, what: str
) -> tuple[int, str]:
    """A head and its text (``what``, for errors): ``TransferMetadataError`` for a status
    other than OK / FAILED or a size that cannot be right (negative, a failure reason over
    :data:`~.._common.wire.MAX_REASON`, more than the device holds), before allocating."""
    head = torch.empty(HEAD_LEN, dtype=torch.int64, device=link.device)
    link.recv(head, head_tag, step)
    h = head.tolist()
    if h[0] != wire.MAGIC or h[1] != wire.VERSION:
        raise ValueError(
            E.BAD_HEADER.format(dst=link.rank, src=link.peer, magic=h[0], version=h[1])
        )
    if h[2] not in (OK, FAILED):
        raise wire.meta_error(what, link.peer, "status", f"{h[2]} is not 0 or 1")
    limit = wire.MAX_REASON if h[2] == FAILED else wire.device_limit(link.device)
    n = wire.check_size(h[3], limit, what, link.peer, "text bytes")
    text = ""
    if n > 0:
        body = torch.empty(n, dtype=torch.uint8, device=link.device)
        link.recv(body, text_tag, step)
        try:
            text = wire._text(body)
        except UnicodeDecodeError as e:
            raise wire.meta_error(what, link.peer, "(the text)", str(e)) from None
    return h[2], text


def _answer(side: Side, layout: dict[str, Any]) -> tuple[int, str, BaseException | None]:
    """This rank's answer to the layout: ``(status, text, own exception)``."""
    if side.error is not None:
        return FAILED, reason(side.error), side.error
    try:
        if side.layout is not None:
            diff = _differs(side.layout, layout)
            if diff is not None:
                raise ValueError(
                    E.PLAN_LAYOUT_DIFFERS.format(
                        rank=side.rank, leader=side.src.ranks[0], what=diff
                    )
                )
        targets = side.answer(layout)
    except (TypeError, ValueError, KeyError) as e:
        return FAILED, reason(e), e
    return OK, json.dumps({"placements": targets}, separators=(",", ":")), None


def reason(e: BaseException) -> str:
    """The message of an exception (its first argument), or its type's name."""
    return str(e.args[0]) if e.args else type(e).__name__


def _verdict(side: Side, answers: dict[int, tuple[int, str]]) -> tuple[int, str]:
    """The leader's verdict over every answer (its own included)."""
    failed = sorted(r for r, (s, _) in answers.items() if s != OK)
    if failed:
        return FAILED, E.PLAN_REJECTED.format(
            op=side.op,
            ranks=", ".join(map(str, failed)),
            reason=answers[failed[0]][1],
        )
    decoded = {r: wire.loads(t)["placements"] for r, (_, t) in sorted(answers.items())}
    asked = {r: p for r, p in decoded.items() if p is not None}
    if not asked:
        return FAILED, E.PLAN_NO_TARGETS.format(op=side.op)
    receivers = [r for r in asked if r in side.dst.ranks]
    first = receivers[0] if receivers else next(iter(asked))
    want = asked[first]
    for r, got in asked.items():
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(want, got)) if a != b)
            path = tuple(side.layout["leaves"][i]["path"]) if side.layout else (str(i),)
            return FAILED, E.PLAN_DISAGREE.format(
                op=side.op,
                rank=r,
                other=first,
                key=fmt_key(path),
                mine=_show(got[i]),
                theirs=_show(want[i]),
            )
    return OK, json.dumps({"placements": want}, separators=(",", ":"))


def _show(encoded: Any) -> str:
    if encoded is None:
        return "a plain tensor"
    return str(list(codec.decode_placements(encoded)))


def handshake(
    side: Side, group: Any, device: torch.device, timeout: Any
) -> tuple[dict[str, Any], list[Any]]:
    """Run the three rounds (see the module docstring); return ``(layout, targets)``."""
    leader = side.src.ranks[0]
    others = sorted((set(side.src.ranks) | set(side.dst.ranks)) - {leader})
    me = side.rank

    def link(peer: int) -> wire.Peer:
        hint = E.PLAN_HINT.format(peer=peer, op=side.op)
        return wire.Peer(side.op, me, peer, group, device, timeout, hint)

    if me == leader:
        return _lead(side, [link(p) for p in others])
    peer = link(leader)
    try:
        status, text = _read_text(
            peer, LAYOUT_HEAD_TAG, LAYOUT_TEXT_TAG, "send the layout", trust.LAYOUT_WHAT
        )
        if status == OK:
            layout = trust.read_layout(text, leader, dist.get_world_size())
    except E.TransferMetadataError as e:
        # answer FAILED (the leader's verdict then rejects the transfer on every rank), then
        # stop: no verdict on a layout this rank could not read is awaited
        for w in _post_text(peer, ANSWER_HEAD_TAG, ANSWER_TEXT_TAG, FAILED, reason(e)):
            peer.finish(w, "read this rank's answer")
        raise
    if status != OK:
        if side.error is not None:
            raise side.error
        raise ValueError(E.PLAN_LEADER_FAILED.format(op=side.op, leader=leader, reason=text))
    status, answer, own = _answer(side, layout)
    for w in _post_text(peer, ANSWER_HEAD_TAG, ANSWER_TEXT_TAG, status, answer):
        peer.finish(w, "read this rank's answer")
    verdict, text = _read_text(
        peer, VERDICT_HEAD_TAG, VERDICT_TEXT_TAG, "send its verdict", trust.VERDICT_WHAT
    )
    if own is not None:
        raise own
    if verdict != OK:
        raise ValueError(text)
    targets = read_targets(text, layout, side.dst, trust.VERDICT_WHAT, leader)
    assert targets is not None  # a verdict always names them
    return layout, targets


def read_targets(
    text: str, layout: dict[str, Any], dst: Grid, what: str, peer: int
) -> list[Any] | None:
    """The target placements of an answer or the verdict (``what``) from rank ``peer``:
    None (an answer that asks for nothing) or one entry per leaf of ``layout``, checked."""
    targets = trust.read_message(text, what, peer)["placements"]
    if targets is None and what == trust.ANSWER_WHAT:
        return targets
    return trust.check_targets(targets, layout, dst.ndim, what, peer)


def _lead(side: Side, links: list[wire.Peer]) -> tuple[dict[str, Any], list[Any]]:
    if side.error is not None or side.layout is None:
        why = (
            reason(side.error)
            if side.error is not None
            else E.PLAN_ROLE_SOURCE.format(rank=side.rank, mesh=list(side.src.nested()))
        )
        _post_text_all(links, LAYOUT_HEAD_TAG, LAYOUT_TEXT_TAG, FAILED, why, "read the layout")
        if side.error is not None:
            raise side.error
        raise ValueError(why)
    layout = side.layout
    text = json.dumps(layout, separators=(",", ":"))
    _post_text_all(links, LAYOUT_HEAD_TAG, LAYOUT_TEXT_TAG, OK, text, "read the layout")
    answers: dict[int, tuple[int, str]] = {}
    bad: E.TransferMetadataError | None = None
    for lk in links:
        try:
            answers[lk.peer] = _read_text(
                lk, ANSWER_HEAD_TAG, ANSWER_TEXT_TAG, "answer the layout", trust.ANSWER_WHAT
            )
            if answers[lk.peer][0] == OK:
                read_targets(answers[lk.peer][1], layout, side.dst, trust.ANSWER_WHAT, lk.peer)
        except E.TransferMetadataError as e:  # an answer not in the format rejects the transfer
            answers[lk.peer] = (FAILED, reason(e))
            bad = bad or e
    status, answer, own = _answer(side, layout)
    answers[side.rank] = (status, answer)
    verdict, vtext = _verdict(side, answers)
    _post_text_all(links, VERDICT_HEAD_TAG, VERDICT_TEXT_TAG, verdict, vtext, "read the verdict")
    if own is not None:
        raise own
    if verdict != OK:
        if bad is not None:
            raise E.TransferMetadataError(vtext) from bad
        raise ValueError(vtext)
    return layout, wire.loads(vtext)["placements"]


# --------------------------------------------------------------------------------------
# packing and unpacking (traced by torch.compile)
# --------------------------------------------------------------------------------------
class SendSide(NamedTuple):
    """A sender's static view: its receivers, ``(leaf, src_start, size)`` of each piece it owes
    each of them, and each message's payload bytes."""

    peers: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], ...]
    nbytes: tuple[int, ...]


class RecvSide(NamedTuple):
    """A receiver's static view: incoming pieces per sender
    ``(leaf, offset, nbytes, size, dst_start)``, local copies ``(leaf, src_start, size,
    dst_start)``, each leaf's target ``(shape, dtype, all zeros)`` and the device of the
    results."""

    peers: tuple[int, ...]
    nbytes: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int, int, tuple[int, ...], tuple[int, ...]], ...], ...]
    local: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
    targets: tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]
    device: str


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def send_side(key: LayoutKey, rank: int) -> SendSide:
    """The :class:`SendSide` of ``rank`` in the plan of ``key``."""
    plan = plan_for(key)
    msgs = plan.sends(rank)
    return SendSide(
        peers=tuple(m.dst for m in msgs),
        pieces=tuple(tuple((p.leaf, p.src_start, p.size) for p in m.pieces) for m in msgs),
        nbytes=tuple(m.nbytes for m in msgs),
    )


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def recv_side(key: LayoutKey, rank: int, device: str) -> RecvSide:
    """The :class:`RecvSide` of ``rank`` in the plan of ``key``."""
    plan = plan_for(key)
    msgs = plan.receives(rank)
    targets = []
    for i, spec in enumerate(plan.leaves):
        shape, zero = plan.target(i, rank)
        targets.append((shape, spec.dtype, zero))
    return RecvSide(
        peers=tuple(m.src for m in msgs),
        nbytes=tuple(m.nbytes for m in msgs),
        pieces=tuple(
            tuple((p.leaf, p.offset, p.nbytes, p.size, p.dst_start) for p in m.pieces) for m in msgs
        ),
        local=tuple((p.leaf, p.src_start, p.size, p.dst_start) for p in plan.local.get(rank, ())),
        targets=tuple(targets),
        device=device,
    )


def _cut(x: Tensor, start: Sequence[int], size: Sequence[int]) -> Tensor:
    for d, (a, n) in enumerate(zip(start, size)):
        if a != 0 or n != x.shape[d]:
            x = x.narrow(d, a, n)
    return x


def pack(
    xs: Sequence[Tensor], headers: Sequence[Tensor], side: SendSide | None = None
) -> list[Tensor]:
    """One uint8 buffer per receiver: its header, then its pieces back to back."""
    assert side is not None
    out = []
    for pieces, h in zip(side.pieces, headers):
        parts = [h.view(torch.uint8)]
        for leaf, start, size in pieces:
            parts.append(_cut(xs[leaf], start, size).contiguous().view(-1).view(torch.uint8))
        out.append(torch.cat(parts))
    return out


def unpack(
    bufs: Sequence[Tensor], xs: Sequence[Tensor], side: RecvSide | None = None
) -> list[Tensor]:
    """This rank's target shard of every leaf from its buffers and local copies."""
    assert side is not None
    parts: list[list[tuple[tuple[int, ...], tuple[int, ...], Tensor]]] = [[] for _ in side.targets]
    for buf, pieces in zip(bufs, side.pieces):
        for leaf, offset, nbytes, size, dst_start in pieces:
            dtype = side.targets[leaf][1]
            start = HEADER_BYTES + offset
            t = buf[start : start + nbytes].view(dtype).reshape(size)
            parts[leaf].append((dst_start, size, t))
    copied = set()
    for leaf, src_start, size, dst_start in side.local:
        parts[leaf].append((dst_start, size, _cut(xs[leaf], src_start, size)))
        copied.add(leaf)
    out = []
    for leaf, ((shape, dtype, zero), ps) in enumerate(zip(side.targets, parts)):
        if zero:
            out.append(torch.zeros(shape, dtype=dtype, device=side.device))
        elif not ps:
            out.append(torch.empty(shape, dtype=dtype, device=side.device))
        elif len(ps) == 1 and leaf in copied:  # the whole shard is a local copy: never alias
            out.append(ps[0][2].clone(memory_format=torch.contiguous_format))
        else:
            out.append(assemble(tuple(0 for _ in shape), shape, ps))
    return out


def assemble(
    lo: tuple[int, ...],
    shape: tuple[int, ...],
    parts: Sequence[tuple[tuple[int, ...], tuple[int, ...], Tensor]],
) -> Tensor:
    """The box at ``lo`` of size ``shape`` from ``parts`` that tile it: nested ``torch.cat``
    along guillotine cuts (a plan's pieces always admit them); one copy per element."""
    if len(parts) == 1:
        return parts[0][2].contiguous()
    for d in range(len(shape)):
        cuts = sorted({s[d] for s, _, _ in parts} - {lo[d]})
        valid = [c for c in cuts if all(s[d] + n[d] <= c or s[d] >= c for s, n, _ in parts)]
        if not valid:
            continue
        bounds = [lo[d], *valid, lo[d] + shape[d]]
        slabs = []
        for j in range(len(bounds) - 1):
            a, b = bounds[j], bounds[j + 1]
            inside = [p for p in parts if a <= p[0][d] < b]
            sub_lo = (*lo[:d], a, *lo[d + 1 :])
            sub_shape = (*shape[:d], b - a, *shape[d + 1 :])
            slabs.append(assemble(sub_lo, sub_shape, inside))
        return torch.cat(slabs, dim=d)
    raise AssertionError("pieces of a transfer plan that admit no guillotine cut")


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def compiled_pack(key: LayoutKey, rank: int, backend: Any) -> Callable[..., list[Tensor]]:
    """The cached ``torch.compile(fullgraph=True)`` of :func:`pack` for one rank of a plan
    (its own code object: Dynamo caps the graphs per code object)."""
    return _compile(pack, send_side(key, rank), backend, "tdfunc_transfer_pack")


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def compiled_unpack(
    key: LayoutKey, rank: int, device: str, backend: Any
) -> Callable[..., list[Tensor]]:
    """The cached compiled :func:`unpack` for one rank of a plan."""
    return _compile(unpack, recv_side(key, rank, device), backend, "tdfunc_transfer_unpack")


def _compile(fn: Any, side: Any, backend: Any, name: str) -> Callable[..., list[Tensor]]:
    code = fn.__code__.replace(co_name=name)
    f = types.FunctionType(code, fn.__globals__, name, (side,))
    return torch.compile(f, backend=backend, fullgraph=True, dynamic=False)


# --------------------------------------------------------------------------------------
# data exchange
# --------------------------------------------------------------------------------------
def data_header(status: int, digest: int, step: int, n: int, device: torch.device) -> Tensor:
    """The 8 int64 that open every data message."""
    return torch.tensor(
        [wire.MAGIC, wire.VERSION, status, digest, step, n, 0, 0], dtype=torch.int64, device=device
    )


def failed_buffer(nbytes: int, digest: int, step: int, reason: Tensor) -> Tensor:
    """A data message of the planned size that says the sender failed; the reason (``reason``,
    its UTF-8 bytes) follows on :data:`FAILURE_TAG`."""
    buf = torch.zeros(HEADER_BYTES + nbytes, dtype=torch.uint8, device=reason.device)
    head = data_header(FAILED, digest, step, reason.numel(), reason.device)
    buf[:HEADER_BYTES].copy_(head.view(torch.uint8))
    return buf


def read_header(buf: Tensor) -> list[int]:
    """The 8 int64 that open a data message."""
    return [int(v) for v in buf[:HEADER_BYTES].view(torch.int64).tolist()]


def check_header(h: Sequence[int], src: int, dst: int, digest: int, step: int) -> str | None:
    """Why a received data message cannot be used (None when it can; a failed sender's
    reason is read separately)."""
    if h[0] != wire.MAGIC or h[1] != wire.VERSION:
        return E.BAD_HEADER.format(dst=dst, src=src, magic=h[0], version=h[1])
    if h[3] != digest or h[4] != step:
        return E.PLAN_OUT_OF_STEP.format(dst=dst, src=src, got=h[4], step=step)
    return None


def digest_of(layout: dict[str, Any], targets: Sequence[Any]) -> int:
    """A 64-bit digest of an agreed plan, the same in every process."""
    return _hash((json.dumps(layout, sort_keys=True), json.dumps(list(targets))))


def box_results(
    key: LayoutKey, layout: dict[str, Any], mesh: DeviceMesh, locals_: Sequence[Tensor]
) -> list[Tensor]:
    """DTensors on ``mesh`` (plain tensors for plain leaves) over the received shards."""
    specs = _specs(key, mesh)
    out: list[Tensor] = []
    for entry, spec, t in zip(layout["leaves"], specs, locals_):
        x: Tensor = t
        if spec is not None:
            target = torch.device(mesh.device_type)
            if t.device.type != target.type:
                t = t.to(target)
            x = plan_mod.box(t, spec)
        if entry["requires_grad"]:
            x = x.detach().requires_grad_(True)
        out.append(x)
    return out


@register
@functools.lru_cache(maxsize=CACHE_SIZE)
def _specs(key: LayoutKey, mesh: DeviceMesh) -> tuple[DTensorSpec | None, ...]:
    out: list[DTensorSpec | None] = []
    for shape, dtype, ks, plain in zip(key.shapes, key.dtypes, key.dst, key.plain):
        if plain:
            out.append(None)
            continue
        out.append(
            DTensorSpec(
                mesh,
                tuple(placement_of(k) for k in ks),
                tensor_meta=TensorMeta(torch.Size(shape), plan_mod.contiguous_stride(shape), dtype),
            )
        )
    return tuple(out)
