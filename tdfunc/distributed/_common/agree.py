"""Agreement between the ranks of a mesh before their collectives.

Collectives trust every rank to take part with the same sizes. Ranks that ask for different
placements, or pass containers with different keys, shapes or dtypes, run different
collectives: gloo then mixes their data (a silent wrong result) or aborts the process when a
message is larger than expected. So before a transition runs for the first time, the ranks of
the mesh compare a digest of what they ask for, and all of them raise the same ``ValueError``
when it differs.

The digest is a few 64-bit hashes (operation, mesh, key paths, global shapes, dtypes, source
and target placements; never the local shapes, which differ by rank). The mesh's first rank
collects them point to point (a tag of its own, so nothing else can match these messages)
and sends every rank the verdict: ``2 (n - 1)`` small messages for a mesh of ``n`` ranks.
``agreed_plan`` (in ``_redistribute/redistribute.py``: ``redistribute`` and ``full_tensor``)
remembers the transitions the mesh agreed on, so the check costs nothing on the next calls: it
runs once per cached transition.
The price: a rank that repeats an agreed transition does not check again, so if another rank
asks for something new at that moment, the two wait for each other until the process group's
timeout (both then raise, the checking rank with a message that says so; data never mixes).
``distribute`` (a one-off that moves the whole container) checks every call with
:func:`check`. A rank that rejects its own arguments tells the others (:func:`reject`), so
they raise too instead of waiting in a collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..._keys import KeyPath, fmt_key
from . import errors as E
from . import wire
from .mesh import describe_mesh

AGREE_TAG = wire.TAG_BASE + 0x1001
VERDICT_TAG = wire.TAG_BASE + 0x1002
#: what the digest compares, in order (the first: whether the rank accepted its arguments)
FIELDS = (
    "arguments",
    "operation",
    "mesh",
    "key paths",
    "global shapes",
    "dtypes",
    "source placements",
    "target placements",
)
#: ranks named in a verdict (it has a fixed size)
MAX_LISTED = 8
VERDICT_LEN = 3 + 2 * MAX_LISTED


def _hash(obj: Any) -> int:
    """A 64-bit hash of ``repr(obj)`` that is the same in every process (``hash`` is not)."""
    raw = hashlib.blake2b(repr(obj).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


ACCEPTED = _hash("accepted")
REJECTED = _hash("rejected")


def _listed(ranks: Sequence[int]) -> list[int]:
    head = list(ranks[:MAX_LISTED])
    return head + [-1] * (MAX_LISTED - len(head))


def _ranks_text(listed: Sequence[int], n: int) -> str:
    named = [r for r in listed if r >= 0]
    return ", ".join(str(r) for r in named) + (" and more" if n > len(named) else "")


def _exchange(op: str, mesh: DeviceMesh, digest: Sequence[int]) -> list[int]:
    """Send this rank's digest to the mesh's first rank and get its verdict back:
    ``[mask of differing fields, n differing, n rejected, differing ranks, rejected ranks]``.
    """
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    me, leader = dist.get_rank(), ranks[0]
    device = wire.comm_device(None)
    hint = E.AGREE_HINT.format(mesh=describe_mesh(mesh), op=op)

    def link(peer: int) -> wire.Peer:
        return wire.Peer(op, me, peer, None, device, None, hint)

    if me != leader:
        peer = link(leader)
        mine = torch.tensor(list(digest), dtype=torch.int64, device=device)
        peer.send(mine, AGREE_TAG, f"compare {op} requests")
        verdict = torch.empty(VERDICT_LEN, dtype=torch.int64, device=device)
        peer.recv(verdict, VERDICT_TAG, f"send its verdict on the {op} requests")
        return [int(v) for v in verdict.tolist()]
    bufs = {r: torch.empty(len(FIELDS), dtype=torch.int64, device=device) for r in ranks[1:]}
    works = {r: link(r).irecv(b, AGREE_TAG) for r, b in bufs.items()}
    for r, w in works.items():
        link(r).finish(w, f"compare its {op} request")
    mask, bad = 0, []
    rejected = [leader] if digest[0] == REJECTED else []
    for r in ranks[1:]:
        theirs = bufs[r].tolist()
        if theirs[0] == REJECTED:
            rejected.append(r)
        diff = [i for i, (a, b) in enumerate(zip(digest, theirs)) if a != b]
        if diff:
            bad.append(r)
            for i in diff:
                mask |= 1 << i
    out = [mask, len(bad), len(rejected), *_listed(bad), *_listed(rejected)]
    verdict = torch.tensor(out, dtype=torch.int64, device=device)
    sends = {r: link(r).isend(verdict, VERDICT_TAG) for r in ranks[1:]}
    for r, w in sends.items():
        link(r).finish(w, f"read the verdict on its {op} request")
    return out


def reject(op: str, mesh: DeviceMesh) -> None:
    """Tell the other ranks of ``mesh`` that this rank rejected its own arguments for ``op``
    (they raise ``ValueError`` naming it instead of waiting in a collective); the caller
    then raises its own error. Never raises: if the exchange itself fails (the others did
    not take part), the caller's error is still the one to report."""
    if mesh.size() == 1:
        return
    try:
        _exchange(op, mesh, [REJECTED] + [0] * (len(FIELDS) - 1))
    except (TimeoutError, ConnectionError):
        return


def check(
    op: str,
    operation: str,
    mesh: DeviceMesh,
    paths: tuple[KeyPath, ...],
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    src: tuple[Any, ...],
    dst: tuple[Any, ...],
) -> None:
    """Check that every rank of ``mesh`` asks for the same transition (``ValueError`` on all
    ranks otherwise, naming the ranks that differ from the mesh's first rank and in what).

    ``op`` names the public function in messages; ``operation`` is what the ranks compare
    (the collectives it implies, e.g. ``"distribute(src_data_rank=0)"``). ``src`` / ``dst``
    hold each leaf's placements as text (``()`` when not relevant). A peer that does not take
    part within the process group's timeout gives ``TimeoutError``.
    """
    if mesh.size() == 1:
        return
    values = ("accepted", *_fields(operation, mesh, paths, shapes, dtypes, src, dst))
    digest = [ACCEPTED, *(_hash(v) for v in values[1:])]
    mask, n_bad, n_rejected, *rest = _exchange(op, mesh, digest)
    bad, rejected = rest[:MAX_LISTED], rest[MAX_LISTED:]
    leader = int(mesh.mesh.flatten()[0])
    if n_rejected:
        raise ValueError(
            E.PEER_REJECTED.format(
                op=op, mesh=describe_mesh(mesh), ranks=_ranks_text(rejected, n_rejected)
            )
        )
    if mask:
        fields = [i for i in range(len(FIELDS)) if mask >> i & 1]
        raise ValueError(
            E.DISAGREE.format(
                op=op,
                mesh=describe_mesh(mesh),
                ranks=_ranks_text(bad, n_bad),
                leader=leader,
                what=" and the ".join(FIELDS[i] for i in fields),
                rank=dist.get_rank(),
                mine=_describe(fields[0], values, paths),
            )
        )


def _fields(
    operation: str,
    mesh: DeviceMesh,
    paths: tuple[KeyPath, ...],
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    src: tuple[Any, ...],
    dst: tuple[Any, ...],
) -> tuple[Any, ...]:
    mesh_id = (tuple(mesh.shape), mesh.mesh.flatten().tolist())
    return (operation, mesh_id, paths, shapes, dtypes, src, dst)


def _describe(field: int, values: tuple[Any, ...], paths: tuple[KeyPath, ...]) -> str:
    """This rank's value of one field, for the error message (cut at a few entries)."""
    value = values[field]
    if field == 3:
        shown = [fmt_key(p) for p in value[:6]]
        return "keys [" + ", ".join(shown) + (", ...]" if len(value) > 6 else "]")
    if field >= 4 and isinstance(value, tuple) and len(value) == len(paths) and paths:
        items = [f"{fmt_key(p)}: {v}" for p, v in zip(paths[:4], value[:4])]
        return "{" + ", ".join(items) + (", ...}" if len(paths) > 4 else "}")
    return str(value)


def placements_of(items: Sequence[Any]) -> tuple[tuple[str, ...], ...]:
    """Placements as comparable text, one tuple per leaf (``repr`` is exact for every kind)."""
    return tuple(tuple(repr(p) for p in ps) for ps in items)
