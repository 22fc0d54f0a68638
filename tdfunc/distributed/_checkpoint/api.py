"""Checkpoints of sharded containers on ``torch.distributed.checkpoint`` (DCP).

DCP does the heavy lifting: every rank writes only its own shards, in parallel; replicated
tensors (plain leaves, ``Replicate()`` DTensors) are written once; a load reshards to whatever
layout the loading job asks for, each rank reading only the pieces it needs. What this module
adds around it, and why:

Structure
    DCP stores a flat dict of tensors. The container's structure (key paths, node types,
    batch sizes, tensorclass static fields: its pytree spec as JSON) and every leaf's global
    shape, dtype and saved placements go into ``manifest.json``. A load checks ``like``
    against it (``KeysDifferError`` / ``NodeTypesDifferError`` / ``ValueError`` naming the
    key) before any data is read, and ``like=None`` rebuilds the saved container with full
    plain tensors (one process, no process group: inspection and export).

Nothing read runs code
    DCP's own ``.metadata`` is a pickle, and each item it writes is a ``torch.save``
    archive (a pickle around the bytes). tdfunc never hands either to ``pickle``: the
    manifest (JSON) describes every chunk DCP wrote (its leaf, offsets and sizes in the
    global tensor, its file, the offset and size of its raw bytes inside the archive, and
    the SHA-256 of its dtype, shape and bytes); a load builds DCP's ``Metadata`` from it,
    lets DCP's planner decide which chunks each rank needs, and reads them as raw bytes
    (``store.Reader``), after checking the manifest against the format and the files
    (regular files only, no symlink, sizes, chunks inside their files, tiling their leaves,
    no shared bytes, depth and size limits). Saving hashes each tensor in a background pool
    while DCP writes it and the files are synced, so the checksums cost no extra pass over
    the files. ``save_checkpoint`` returns the digest of the manifest: a caller that keeps it
    elsewhere and passes it to ``load_checkpoint(digest=...)`` gets exactly that checkpoint
    or :class:`CheckpointDigestError`; without it the checks catch accidents and
    inconsistencies, not a consistent forgery.

Atomic commit
    DCP writes straight into its target folder, so a save writes a fresh version folder::

        path/
          checkpoint.json     {"format": "tdfunc.checkpoint", "version": 1,
                               "dir": "v-<16 hex>", "manifest_sha256": "..."}
          v-<16 hex>/         DCP's files (__<rank>_0.distcp, .metadata) + manifest.json

    and only when every rank has written and fsync-ed its files (DCP's final step, on the
    coordinator) does ``checkpoint.json`` switch to it, by ``os.replace`` of a fsync-ed file.
    A save killed at any point leaves ``checkpoint.json`` on the previous complete version;
    its half-written folder (and a stale temporary pointer) is removed by the next save,
    before it writes. The coordinator of a live save holds a lock on its version folder, so
    cleanup never removes it. Under a file lock, the commit also checks that no other save
    committed meanwhile (compare-and-swap): of two concurrent saves to one path, the later
    commit fails with :class:`CheckpointConflictError`. The previous version is deleted
    after the switch; a load opens every file of the version ``checkpoint.json`` names
    before reading, so a commit meanwhile does not disturb it (a folder that vanished
    before it was opened makes the load follow the pointer again).

Errors on every rank, never a hang
    Before any data moves, the ranks exchange a status and a digest of what they save or load
    (one small ``all_gather``): a rank that rejects its arguments, or ranks that pass different
    structures or paths, make every rank raise. Failures inside DCP (raised there as
    ``CheckpointException``, a ``BaseException``) reach every rank through DCP's own
    collectives and are converted to :class:`CheckpointError` (or the typed error a rank
    raised, e.g. :class:`CheckpointCorruptError`).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import secrets
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future as PyFuture
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Partial

from ..._compat import is_traceable_wrapper_subclass, pytree
from ..._errors import StructureError
from ..._keys import fmt_key
from ..._ops import match_structure
from ..._shapes import SHAPE_UNSAVED, shape_problem
from ..._tree import KeyPath, Node, leaves_with_paths, map_leaves, reorder_like
from ...interop._safetensors import save_safetensors
from .._common import errors as E
from .._common import wire
from .._common.mesh import check_node
from .._common.placements import encode_placements
from . import store
from .store import Manifest, Reader, Writer, check_target

_OK, _REJECTED = 0, 1

#: the save started with ``async_save=True`` that has not been waited for yet (at most one:
#: every save and load waits for it first, so their collectives never interleave)
_pending: list[PendingSave] = []


# --------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------
def _digest(obj: Any) -> int:
    raw = hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _exchange(group: Any, values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (one ``all_gather`` of a few int64s)."""
    device = wire.comm_device(group)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


def _agree(
    op: str, group: Any, error: BaseException | None, digest: int, what: str, nonce: int = 0
) -> int:
    """Status and digest of every rank; raise on every rank if one rejected its arguments or
    the digests differ. Returns the first rank's ``nonce`` (the save's version name)."""
    try:
        rows = _exchange(group, [_OK if error is None else _REJECTED, digest, nonce])
    except RuntimeError as e:  # gloo's error when a peer is gone
        raise _peer_error(op, e, "") from None
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(rows) if row[0] != _OK]
    if bad:
        raise ValueError(E.CKPT_REJECTED.format(op=op, ranks=bad))
    differ = [r for r, row in enumerate(rows) if row[1] != rows[0][1]]
    if differ:
        raise ValueError(E.CKPT_DISAGREE.format(op=op, what=what, ranks=differ, first=0))
    return rows[0][2]


def _peer_error(op: str, e: BaseException, committed: str) -> E.CheckpointError:
    reason = f"{type(e).__name__}: {e}"
    return E.CheckpointError(E.CKPT_COLLECTIVE.format(op=op, reason=reason, committed=committed))


def _convert(e: CheckpointException, op: str, root: str) -> Exception:
    """A typed error for DCP's ``CheckpointException`` (the same on every rank)."""
    failures = e.failures
    ranks = sorted(failures)
    first = failures[ranks[0]][0] if ranks else e
    if isinstance(first, E.CheckpointError):
        return type(first)(str(first))
    reason = f"{type(first).__name__}: {first}"
    full = isinstance(first, OSError) and first.errno == errno.ENOSPC
    if full or (op == "save_checkpoint" and store.disk_full(root)):
        reason += "; " + E.CKPT_DISK_FULL.format(path=root)
    return E.CheckpointError(E.CKPT_FAILED.format(op=op, ranks=ranks, reason=reason))


def _group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@contextmanager
def _alone(pg: Any) -> Iterator[None]:
    """DCP warns when it runs without a process group; here that is what was asked for."""
    with warnings.catch_warnings():
        if pg is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _wait_pending() -> None:
    while _pending:
        _pending.pop().result()


@atexit.register
def _wait_at_exit() -> None:
    """A process that exits with a save in flight finishes it first (its error, if any, is
    printed by the interpreter's exit handling, not lost)."""
    while _pending:
        job = _pending.pop()
        try:
            job.result()
        except Exception as e:  # exiting: report, nobody is left to catch it
            sys.stderr.write(f"tdfunc: an asynchronous save_checkpoint failed: {e}\n")


#: (the caller's group, the private gloo group async saves of that group use)
_async_group: list[tuple[Any, Any]] = []


def _group_for_async(pg: Any) -> Any:
    """A process group of the checkpoint's own for the background part of an asynchronous
    save on the default group (created once, on every rank, in the caller's thread), so
    that its collectives never interleave with the caller's."""
    if _async_group and _async_group[0][0] is pg:
        return _async_group[0][1]
    private = dist.new_group(backend="gloo")
    _async_group[:] = [(pg, private)]
    return private


def _depth(td: Any) -> tuple[int, KeyPath]:
    """How deeply containers nest in ``td`` and the deepest key path (iterative)."""
    deepest: tuple[int, KeyPath] = (1, ())
    stack: list[tuple[Any, KeyPath]] = [(td, ())]
    while stack:
        node, path = stack.pop()
        if len(path) + 1 > deepest[0]:
            deepest = (len(path) + 1, path)
        for k, v in zip(node._tdf_keys(), node._tdf_children()):
            if isinstance(v, Node):
                stack.append((v, (*path, k)))
    return deepest


def _check_depth(td: Any) -> None:
    depth, path = _depth(td)
    if depth > store.MAX_DEPTH:
        raise ValueError(
            E.CKPT_TOO_DEEP.format(key=fmt_key(path), depth=depth, limit=store.MAX_DEPTH)
        )


# --------------------------------------------------------------------------------------
# what a container becomes in DCP
# --------------------------------------------------------------------------------------
def _plain(path: KeyPath, x: Any) -> Tensor:
    """The tensor DCP stores for leaf ``x``: DTensors and plain tensors as they are; a
    tensor subclass wrapping one plain tensor (a memory-mapped leaf) as that tensor (DCP
    cannot load such a subclass back)."""
    if not isinstance(x, Tensor):
        raise TypeError(E.CKPT_LEAF_TYPE.format(key=fmt_key(path), typ=type(x).__name__))
    if isinstance(x, DTensor):
        return x if _compact(x.to_local()) else x.contiguous().clone()
    if type(x) is Tensor:
        return x if _compact(x) else x.contiguous().clone()
    if is_traceable_wrapper_subclass(x):
        attrs, _ = x.__tensor_flatten__()
        if len(attrs) == 1:
            inner = getattr(x, attrs[0])
            if type(inner) is Tensor and inner.shape == x.shape and inner.dtype == x.dtype:
                return inner if _compact(inner) else inner.contiguous().clone()
    plain = x.detach().clone()
    if type(plain) is not Tensor:
        raise TypeError(E.CKPT_LEAF_TYPE.format(key=fmt_key(path), typ=type(x).__name__))
    return plain


def _compact(t: Tensor) -> bool:
    """Whether ``t`` is contiguous and its storage holds exactly its bytes (what DCP writes
    as the raw bytes the manifest describes)."""
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _local_bytes(state: dict[str, Tensor]) -> int:
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes + 4096 for t in state.values()
    )


def _describe(td: Any) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The manifest's structure part and DCP's flat state dict for ``td``."""
    check_node(td, "save_checkpoint")
    _check_depth(td)
    _, spec = pytree.tree_flatten(td)
    leaves: list[dict[str, Any]] = []
    state: dict[str, Tensor] = {}
    owner: dict[str, KeyPath] = {}
    for path, x in leaves_with_paths(td):
        t = _plain(path, x)
        problem = shape_problem(t.shape, t.dtype)
        if problem is not None:
            raise ValueError(SHAPE_UNSAVED.format(key=fmt_key(path), detail=problem))
        name = ".".join(path)
        if name in owner:
            raise ValueError(
                E.CKPT_KEY_COLLISION.format(a=fmt_key(owner[name]), b=fmt_key(path), name=name)
            )
        owner[name] = path
        entry: dict[str, Any] = {
            "path": list(path),
            "name": name,
            "dtype": wire.dtype_name(t.dtype),
            "shape": list(t.shape),
        }
        if isinstance(t, DTensor):
            for p in t.placements:
                if isinstance(p, Partial):
                    raise ValueError(E.CKPT_PARTIAL.format(key=fmt_key(path), op=p.reduce_op))
            entry["placements"] = encode_placements(t.placements, path)
            entry["mesh_shape"] = list(t.device_mesh.shape)
        leaves.append(entry)
        state[name] = t.detach()
    body = {"tree": json.loads(pytree.treespec_dumps(spec)), "leaves": leaves}
    return body, state


class PendingSave:
    """A checkpoint being written in the background (returned by
    ``save_checkpoint(..., async_save=True)``).

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist, tdfunc
        >>> from tdfunc.distributed import save_checkpoint
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> td = tdfunc.TensorDict(x=torch.arange(3.0))
        >>> job = save_checkpoint(os.path.join(tempfile.mkdtemp(), "ck"), td, async_save=True)
        >>> job.result().startswith("sha256:")  # waits; raises the save's error if it failed
        True
        >>> job.done()
        True
    """

    def __init__(self, fut: PyFuture[Any], finish: Any) -> None:
        self._fut, self._finish = fut, finish

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._fut.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait until the checkpoint is committed and return its digest (see
        :func:`checkpoint_digest`); raise its error if it failed.

        Raises:
            CheckpointError: the save failed (:class:`CheckpointConflictError`: another save
                committed first); ``TimeoutError``: not finished within ``timeout`` seconds.
        """
        if self in _pending:
            _pending.remove(self)
        try:
            self._fut.result(timeout)
        except CheckpointException as e:
            return cast(str, self._finish(e))
        except RuntimeError as e:
            return cast(str, self._finish(e))
        return cast(str, self._finish(None))


def _read_digest(root: str, vdir: str) -> str:
    """The digest of the version a save committed in ``vdir`` (read back from its manifest,
    on every rank)."""
    try:
        raw = store._small_file(root, os.path.join(vdir, store.MANIFEST), store.MAX_MANIFEST_BYTES)
    except FileNotFoundError:  # a later save replaced it already
        now, _ = store.read_pointer(root)
        raise E.CheckpointConflictError(
            E.CKPT_CONFLICT.format(path=root, now=now, base=os.path.basename(vdir))
        ) from None
    return store.digest_of(hashlib.sha256(raw).hexdigest())


def save_checkpoint(
    path: str | os.PathLike[str],
    td: Any,
    *,
    overwrite: bool = False,
    group: Any = None,
    async_save: bool = False,
) -> Any:
    """Save a TensorDict or tensorclass (DTensor, plain and memory-mapped leaves) as a
    ``torch.distributed.checkpoint`` checkpoint, committed atomically.

    Every rank of ``group`` calls it with the same ``path`` and a container of the same
    structure. Each rank writes only its own shards; replicated leaves (plain tensors,
    ``Replicate()`` placements) are written once (a plain leaf must hold the same values on
    every rank). A memory-mapped leaf is saved as its plain data. The container's structure
    and the SHA-256 of every chunk go into the checkpoint's manifest; ``checkpoint.json``
    switches to the new version only when everything is written, so a save that dies
    midway leaves the previous checkpoint at ``path`` intact (and what it left is deleted
    by the next save). Without a process group, one process saves alone.

    The returned digest names the whole checkpoint (structure and every byte of data):
    keep it somewhere the checkpoint's readers trust and pass it to
    :func:`load_checkpoint`, which then refuses any other content.

    Args:
        path: the checkpoint directory (created if needed).
        td: the container (at most 64 levels of nesting). DTensor leaves may use any
            ``Shard`` / ``Replicate`` placements on 1-D or 2-D meshes, uneven shards
            included; ``Partial`` is refused.
        overwrite: replace a checkpoint already at ``path`` (atomically: a load sees the
            old or the new one); without it, an existing checkpoint is an error.
        group: the process group of the save (default: the world).
        async_save: return while the data is written (after a copy of the local data is
            taken): a :class:`PendingSave`. The ranks agree and plan in the caller's
            thread; the background part runs on a process group of its own (created once
            from the default group, or the ``group`` given), so the caller's collectives go
            on meanwhile. The next save or load, and the process's exit, wait for it.

    Returns:
        The digest (``"sha256:<hex>"``), or the :class:`PendingSave` of an asynchronous
        save (its ``result()`` returns the digest).

    Raises:
        ValueError: a ``Partial`` leaf, two key paths with the same checkpoint name,
            containers nested too deeply, a ``path`` that holds something else than a
            checkpoint, ranks that pass different structures (raised on every rank before
            any data is written; a rank that rejects its own arguments raises its own error,
            the others ``ValueError``).
        FileExistsError: a checkpoint is at ``path`` and ``overwrite`` is False.
        OSError: (``ENOSPC``) the rank's data does not fit on the disk; nothing is written.
        TypeError: a leaf that is not a tensor.
        CheckpointError: the save failed on some rank, or a peer died (raised on every
            surviving rank; the message says whether the checkpoint was committed; the
            previous checkpoint stays otherwise); :class:`CheckpointConflictError`: another
            save committed to ``path`` meanwhile.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist, tdfunc
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor import Shard
        >>> from tdfunc.distributed import distribute, save_checkpoint, load_checkpoint
        >>> _ = dist.is_initialized() or dist.init_process_group(
        ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> td = tdfunc.TensorDict(w=torch.arange(6.0).reshape(3, 2), b=torch.ones(3),
        ...                        batch_size=[3])
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> digest = save_checkpoint(path, distribute(td, mesh, {"w": [Shard(0)]}))
        >>> load_checkpoint(path, digest=digest)["w"][2].tolist()   # full plain tensors
        [4.0, 5.0]
    """
    _wait_pending()
    root = os.path.abspath(os.fspath(path))
    pg = group if group is not None else _group()
    error: BaseException | None = None
    body: dict[str, Any] = {}
    state: dict[str, Tensor] = {}
    base: str | None = None
    owner: int | None = None
    nonce = secrets.randbits(63)
    coordinator = pg is None or dist.get_rank(pg) == 0
    background = pg
    if async_save and pg is not None and group is None and dist.get_world_size(pg) > 1:
        background = _group_for_async(pg)  # every rank, first: nothing can fail before
    vdir = os.path.join(root, f"v-{nonce:016x}")
    try:
        body, state = _describe(td)
        if coordinator:
            base = check_target(root, overwrite)  # before anything is written there
            store.clean_stale(root)
            os.makedirs(root, exist_ok=True)
            owner = store.own_version(vdir)
        store.check_space(root, _local_bytes(state))
    except Exception as e:  # told to the other ranks, which would wait otherwise
        if owner is not None:
            os.close(owner)
            owner = None
            shutil.rmtree(vdir, ignore_errors=True)
        if pg is None:
            raise
        error = e
    if pg is not None:
        try:
            nonce = _agree(
                "save_checkpoint", pg, error, _digest([root, body]), "path or structure", nonce
            )
        except BaseException:
            if owner is not None:
                os.close(owner)
                shutil.rmtree(vdir, ignore_errors=True)
            raise
        vdir = os.path.join(root, f"v-{nonce:016x}")
    writer = Writer(root, vdir, body, base)

    def finish(failure: BaseException | None) -> str:
        """Release the version folder; the digest, or the save's typed error."""
        nonlocal owner
        if owner is not None:
            os.close(owner)
            owner = None
        if failure is None:
            return _read_digest(root, vdir)
        now, _ = store.read_pointer(root)
        committed = now == os.path.basename(vdir)
        if coordinator and not committed:  # every rank is past its writes by now
            shutil.rmtree(vdir, ignore_errors=True)
        if isinstance(failure, CheckpointException):
            raise _convert(failure, "save_checkpoint", root) from None
        if isinstance(failure, E.CheckpointError):
            raise failure
        note = E.CKPT_COMMITTED if committed else E.CKPT_NOT_COMMITTED
        raise _peer_error("save_checkpoint", failure, note) from None

    if async_save:
        try:
            with _alone(pg):
                fut = dcp.async_save(
                    state, storage_writer=writer, process_group=background, no_dist=pg is None
                )
        except (CheckpointException, RuntimeError) as e:
            finish(e)
        job = PendingSave(cast(PyFuture, fut), finish)
        _pending.append(job)
        return job
    try:
        with _alone(pg):
            dcp.save(state, storage_writer=writer, process_group=pg, no_dist=pg is None)
    except (CheckpointException, RuntimeError) as e:
        return finish(e)
    return finish(None)


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """The digest of the checkpoint committed at ``path`` (what :func:`save_checkpoint`
    returned when it wrote it): ``"sha256:"`` and the SHA-256 of its manifest, which records
    the structure and the SHA-256 of every chunk of data.

    Read it where you trust the files (right after saving); a digest read from a
    directory you do not trust proves nothing about it.

    Raises:
        FileNotFoundError: no checkpoint at ``path``; CheckpointCorruptError: its files are
            damaged.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc.distributed import save_checkpoint, checkpoint_digest
        >>> path = os.path.join(tempfile.mkdtemp(), "ck")
        >>> digest = save_checkpoint(path, tdfunc.TensorDict(x=torch.zeros(2)))
        >>> checkpoint_digest(path) == digest
        True
    """
    manifest = Manifest(os.path.abspath(os.fspath(path)))
    manifest.close()
    return store.digest_of(manifest.sha)


def _nodes(node: Any) -> list[tuple[KeyPath, Any]]:
    """Every node with its key path, depth first in key order (iterative)."""
    out: list[tuple[KeyPath, Any]] = []
    stack: list[tuple[KeyPath, Any]] = [((), node)]
    while stack:
        prefix, n = stack.pop()
        out.append((prefix, n))
        kids = [(k, v) for k, v in zip(n._tdf_keys(), n._tdf_children()) if isinstance(v, Node)]
        stack.extend(((*prefix, k), v) for k, v in reversed(kids))
    return out


def _check_like(skeleton: Any, like: Any) -> Any:
    """``like`` has the saved structure, batch sizes, global shapes and dtypes; returns it in
    the saved key order (leaves pair with the saved ones by key)."""
    check_node(like, "load_checkpoint")
    _check_depth(like)
    like = match_structure(skeleton, like, "load_checkpoint")
    for (path, a), (_, b) in zip(_nodes(skeleton), _nodes(like)):
        if a.batch_size != b.batch_size:
            raise StructureError(
                E.CKPT_BATCH.format(
                    key=fmt_key(path) if path else "(root)",
                    saved=list(a.batch_size),
                    wanted=list(b.batch_size),
                )
            )
    for (path, a), (_, b) in zip(leaves_with_paths(skeleton), leaves_with_paths(like)):
        if not isinstance(b, Tensor):
            raise TypeError(E.CKPT_LEAF_TYPE.format(key=fmt_key(path), typ=type(b).__name__))
        for what, saved, wanted in (
            ("the shape", list(a.shape), list(b.shape)),
            ("the dtype", str(a.dtype), str(b.dtype)),
        ):
            if saved != wanted:
                raise StructureError(
                    E.CKPT_SHAPE.format(key=fmt_key(path), what=what, saved=saved, wanted=wanted)
                )
        if isinstance(b, DTensor):
            for p in b.placements:
                if isinstance(p, Partial):
                    raise ValueError(E.CKPT_PARTIAL.format(key=fmt_key(path), op=p.reduce_op))
    return like


def _target(x: Tensor) -> Tensor:
    """A fresh tensor of ``x``'s layout for DCP to load into (``x`` is never written)."""
    out: Tensor
    if isinstance(x, DTensor):  # the same mesh, placements and (uneven) local shape
        out = torch.empty_like(x, requires_grad=False)
    else:
        device = "cpu" if x.device.type == "meta" else x.device
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
    return out.requires_grad_(x.requires_grad) if x.requires_grad else out


def load_checkpoint(
    path: str | os.PathLike[str],
    like: Any = None,
    *,
    group: Any = None,
    verify: bool = True,
    digest: str | None = None,
) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint`, resharded to ``like``'s layout.

    The checkpoint may come from any number of ranks and placements: each leaf takes
    ``like``'s layout (a DTensor leaf its mesh and placements, a plain leaf the full
    tensor), and each rank reads only the pieces it needs. ``like`` itself is never
    written: the result has new tensors (a memory-mapped leaf of ``like`` gives a plain
    tensor; its file is left alone). With ``like=None`` (or a ``like`` without DTensor
    leaves) the call is local to this process, with no collective and no process group
    needed: the saved container comes back with full plain tensors.

    Nothing in the directory runs code: DCP's pickled ``.metadata`` is never read (the
    manifest, JSON, describes every chunk), tensor data is read as raw bytes, never
    unpickled, and the structure is read by tdfunc's own decoder (TensorDict and
    tensorclass types already registered in this process, found by name; nothing the
    manifest names is imported or looked up). Every file is checked against the manifest (regular files only, no symlink,
    sizes, chunks inside their files and tiling their leaves) before anything is
    allocated. The load pins the version it starts with: a save that commits meanwhile
    does not disturb it.

    Args:
        path: the checkpoint directory.
        like: a container of the saved structure (keys, node types, batch sizes, static
            fields, global shapes, dtypes) whose leaves give the target layout; ``None``:
            the saved container, with full plain tensors.
        group: the process group of a load into DTensors (default: the world); every rank
            of it calls ``load_checkpoint``.
        verify: check every chunk read against the SHA-256 the manifest records (hashed in
            a background pool while the next chunks are read). ``False`` skips only that
            check: flipped bits in the data then load as wrong values.
        digest: the digest :func:`save_checkpoint` returned (kept where you trust it): the
            checkpoint must be exactly that one (its manifest, hence its structure and
            every chunk's SHA-256); implies ``verify``. Without it, the checks find
            accidents and inconsistencies, but a consistent forgery loads.

    Returns:
        A container of ``like``'s type (or the saved one) holding the checkpoint's values.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointCorruptError: a missing, truncated, changed or inconsistent file (the
            message names it and the key); :class:`CheckpointDigestError`: not the
            checkpoint ``digest`` names.
        KeysDifferError, NodeTypesDifferError: ``like`` has other keys, node types or
            static fields; StructureError: other batch sizes, shapes or dtypes (naming the
            key, the saved and the expected value); ValueError: a ``Partial`` target, a
            malformed ``digest``, or ranks that load different checkpoints or layouts.
        CheckpointError: DCP failed on some rank, or a peer died.
        All are raised on every rank of a load into DTensors, before any data moves when a
        rank can tell beforehand.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc.distributed import save_checkpoint, load_checkpoint
        >>> td = tdfunc.TensorDict(x=torch.arange(4.0), batch_size=[4])
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> digest = save_checkpoint(path, td)
        >>> load_checkpoint(path, like=td, digest=digest)["x"].tolist()
        [0.0, 1.0, 2.0, 3.0]
    """
    _wait_pending()
    root = os.path.abspath(os.fspath(path))
    if digest is not None and not (
        isinstance(digest, str)
        and digest.startswith(store.DIGEST_PREFIX)
        and store._SHA.fullmatch(digest[len(store.DIGEST_PREFIX) :]) is not None
    ):
        raise ValueError(E.CKPT_BAD_DIGEST.format(digest=digest))
    distributed = like is not None and any(
        isinstance(x, DTensor) for _, x in leaves_with_paths(like)
    )
    pg = (group if group is not None else _group()) if distributed else None
    error: BaseException | None = None
    agreed = 0
    manifest: Manifest | None = None
    matched: Any = None
    try:
        manifest = Manifest(root, digest)
        skeleton = manifest.skeleton()
        if like is not None:
            matched = _check_like(skeleton, like)
        agreed = _digest([root, manifest.sha])
    except Exception as e:  # told to the other ranks, which would wait otherwise
        if manifest is not None:
            manifest.close()
        if pg is None:
            raise
        error = e
    if pg is not None:
        _agree("load_checkpoint", pg, error, agreed, "the checkpoint")
    assert manifest is not None
    try:
        base = skeleton if like is None else matched
        names = [e["name"] for e in manifest.leaves]
        state = {n: _target(x) for n, (_, x) in zip(names, leaves_with_paths(base))}
        with _alone(pg):
            dcp.load(
                state,
                storage_reader=Reader(manifest, verify or digest is not None),
                process_group=pg,
                no_dist=pg is None,
            )
    except CheckpointException as e:
        raise _convert(e, "load_checkpoint", root) from None
    except RuntimeError as e:
        if isinstance(e, E.CheckpointError):
            raise
        raise _peer_error("load_checkpoint", e, "") from None
    finally:
        manifest.close()
    out = map_leaves(base, [state[n] for n in names])
    # the result keeps ``like``'s own key order
    return out if like is None or matched is like else reorder_like(like, out)


def export_safetensors(
    path: str | os.PathLike[str],
    file: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    digest: str | None = None,
) -> None:
    """Write a checkpoint as one safetensors file (full tensors, in this process).

    Leaves are named by their key paths joined with ``"."`` (for a container built with
    ``tdfunc.from_module(model)``, the names of ``model.state_dict()``), so
    ``tdfunc.load_safetensors``, ``safetensors.torch.load_file`` and transformers read it;
    the container's structure travels in the file's metadata (see
    ``tdfunc.save_safetensors``). The whole checkpoint is read into memory once.

    Args:
        path: the checkpoint directory.
        file: the safetensors file to write.
        overwrite: replace ``file`` if it exists.
        digest: as for :func:`load_checkpoint`: the checkpoint must be exactly that one.

    Raises:
        FileExistsError: ``file`` exists and ``overwrite`` is False.
        The errors of :func:`load_checkpoint`.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc.distributed import save_checkpoint, export_safetensors
        >>> d = tempfile.mkdtemp()
        >>> _ = save_checkpoint(os.path.join(d, "ck"), tdfunc.TensorDict(w=torch.ones(2)))
        >>> export_safetensors(os.path.join(d, "ck"), os.path.join(d, "w.safetensors"))
        >>> tdfunc.load_safetensors(os.path.join(d, "w.safetensors"))["w"].tolist()
        [1.0, 1.0]
    """
    target = os.fspath(file)
    if os.path.exists(target) and not overwrite:
        raise FileExistsError(E.CKPT_EXISTS.format(file=target))
    save_safetensors(load_checkpoint(path, digest=digest), target, overwrite=overwrite)
