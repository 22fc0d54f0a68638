"""The files of a checkpoint (see ``api.py`` for the design): the version folders,
``checkpoint.json`` and its atomic commit, the manifest (tdfunc's own JSON description of
every chunk DCP wrote, with a SHA-256 of its bytes), DCP's file writer wrapped to record it,
and a reader that never hands anything of the directory to ``pickle``.

Trust: nothing read here is believed before it is checked. Only regular files are opened,
never through a symlink, each relative to its version folder's descriptor; sizes are
checked before anything is allocated, and every leaf's shape before torch sees it (dims
``>= 0``, the non-zero ones holding at most ``2**62`` bytes: ``tdfunc._shapes``); every
chunk must lie inside its file, cover exactly its own bytes, and the chunks of a leaf must
tile it as a grid (checked in O(n log n)); a JSON key given twice is refused; the structure
is read by ``wire.spec_from_json`` (tdfunc node types found by name in this process's
registry, nothing imported). Tensor data is read as raw bytes at the offsets the manifest
records (never unpickled), so a crafted file can at worst give wrong values, and a verified
load (the default) catches those by the SHA-256 of every chunk; a caller that keeps
:func:`checkpoint_digest` elsewhere catches a crafted manifest.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shutil
import stat
import struct
import threading
import zipfile
from collections.abc import Iterator, Sequence
from concurrent.futures import Future as PyFuture
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..._shapes import shape_problem
from ..._tree import is_node, leaves_with_paths
from .._common import errors as E
from .._common import wire

FORMAT = "tdfunc.checkpoint"
VERSION = 2
POINTER = "checkpoint.json"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
LOCK = ".lock"
#: prefix of replaced versions being deleted
TRASH = ".trash-"
#: temporary files of an atomic write (``<name>.tmp-<8 hex>``)
_TMP = re.compile(r".+\.tmp-[0-9a-f]{8}")
_VERSION_DIR = re.compile(r"v-[0-9a-f]{16}")
_DATA_FILE = re.compile(r"__[0-9]{1,9}_[0-9]{1,9}\.distcp")
_SIDECAR = "{prefix}chunks.json"
_SHA = re.compile(r"[0-9a-f]{64}")
#: the record of a torch.save archive that holds a storage's bytes
_DATA_RECORD = re.compile(r"[^/]+/data/[0-9]+")
DIGEST_PREFIX = "sha256:"

#: limits on what a load parses (a checkpoint that exceeds them is refused, typed)
MAX_POINTER_BYTES = 4096
MAX_MANIFEST_BYTES = 256 << 20
#: nesting of containers a checkpoint holds (a save refuses deeper ones before writing)
MAX_DEPTH = 64
#: nesting of the manifest's JSON (the structure of a MAX_DEPTH-deep container fits)
MAX_JSON_DEPTH = 8 * MAX_DEPTH + 16
MAX_LEAVES = 1 << 20
MAX_CHUNKS_PER_LEAF = 1 << 14
MAX_DIMS = 64
#: hashing unit: a chunk's SHA-256 is that of the concatenated SHA-256s of its blocks, so
#: blocks hash in parallel and while the next ones are read
BLOCK = 8 << 20
_POOL_WORKERS = max(2, min(8, os.cpu_count() or 2))
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="tdfunc-checkpoint-hash")
    return _POOL


_POOL: ThreadPoolExecutor | None = None


# --------------------------------------------------------------------------------------
# small helpers: errors, files, hashing
# --------------------------------------------------------------------------------------
def _corrupt(root: str, file: str, detail: str) -> E.CheckpointCorruptError:
    return E.CheckpointCorruptError(E.CKPT_CORRUPT.format(path=root, file=file, detail=detail))


def _need(cond: bool, root: str, file: str, detail: str) -> None:
    if not cond:
        raise _corrupt(root, file, detail)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _json_depth(obj: Any) -> int:
    """The nesting depth of a parsed JSON value (iterative: any depth is safe)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(x, dict):
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            stack.extend((v, d + 1) for v in x)
    return deepest


def _json(root: str, file: str, raw: bytes) -> Any:
    try:
        obj = wire.loads(raw)
    except (ValueError, RecursionError) as e:
        dup = isinstance(e, ValueError) and not isinstance(e, json.JSONDecodeError)
        detail = str(e) if dup else f"not JSON ({type(e).__name__})"
        raise _corrupt(root, file, detail) from None
    depth = _json_depth(obj)
    _need(depth <= MAX_JSON_DEPTH, root, file, f"nested {depth} deep (limit {MAX_JSON_DEPTH})")
    return obj


def open_regular(root: str, name: str, dir_fd: int | None = None, folder: str = "") -> int:
    """A descriptor of the regular file ``name`` (relative to ``dir_fd``), opened without
    following a symlink and without blocking on a FIFO; anything else is
    :class:`CheckpointCorruptError` (FileNotFoundError when it does not exist)."""
    shown = os.path.join(folder, name)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        why = "a symlink" if e.errno == errno.ELOOP else os.strerror(e.errno or 0)
        raise _corrupt(root, shown, f"cannot be opened ({why})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _corrupt(root, shown, "not a regular file")
    return fd


def read_exact(fd: int, offset: int, n: int) -> bytes:
    out = bytearray(n)
    got = _pread_into(fd, memoryview(out), offset)
    return bytes(out[:got])


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``; the number of bytes read (short at EOF)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _small_file(
    root: str, name: str, limit: int, dir_fd: int | None = None, folder: str = ""
) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (``folder``: the path of
    ``dir_fd``, for messages)."""
    fd = open_regular(root, name, dir_fd, folder)
    try:
        size = os.fstat(fd).st_size
        shown = os.path.join(folder, name)
        _need(size <= limit, root, shown, f"{size} bytes (limit {limit})")
        data = read_exact(fd, 0, size)
        _need(len(data) == size, root, shown, "changed while it was read")
        return data
    finally:
        os.close(fd)


def _bytes_of(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without numpy."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    buf = (ctypes.c_char * n).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _block_sha(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def hash_blocks(view: memoryview) -> list[PyFuture[bytes]]:
    """SHA-256 of each BLOCK of ``view``, computed in the background pool."""
    pool = _pool()
    return [pool.submit(_block_sha, view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]


def _chunk_header(dtype: str, sizes: Sequence[int]) -> bytes:
    """What a chunk's checksum covers besides its bytes: its dtype and shape (an edited
    dtype or shape is a mismatch, not a reinterpretation)."""
    return json.dumps([dtype, list(sizes)]).encode()


def combine(header: bytes, blocks: Sequence[PyFuture[bytes]]) -> str:
    """A chunk's checksum: the SHA-256 of its header and its blocks' SHA-256s."""
    h = hashlib.sha256(header)
    for b in blocks:
        h.update(b.result())
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, sync: bool = True) -> None:
    """``data`` into ``path`` through a fresh temporary file (never through a symlink;
    fsync-ed if ``sync``) and ``os.replace``."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)


def digest_of(manifest_sha: str) -> str:
    return DIGEST_PREFIX + manifest_sha


# --------------------------------------------------------------------------------------
# the root folder: lock, ownership of version folders, stale leftovers
# --------------------------------------------------------------------------------------
@contextmanager
def root_lock(root: str) -> Iterator[None]:
    """The exclusive lock of ``root`` (its ``.lock`` file; never through a symlink)."""
    path = os.path.join(root, LOCK)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise E.CheckpointError(E.CKPT_BAD_LOCK.format(path=root, file=path)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise E.CheckpointError(E.CKPT_BAD_LOCK.format(path=root, file=path))
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def own_version(vdir: str) -> int:
    """Create ``vdir`` and hold its ownership lock (a live save's folder is never cleaned
    up); returns the descriptor that holds it (close it to release)."""
    os.mkdir(vdir)
    fd = os.open(vdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _unowned(path: str) -> bool:
    """Whether no live save holds the folder ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return True  # not a directory we could lock: nothing of ours holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _leftovers(root: str, keep: str | None) -> list[str]:
    """Under the root lock: rename what dead saves left (their version folders, temporary
    files, trash) out of the way; returns the paths to delete."""
    out = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name == keep:
            continue
        if _VERSION_DIR.fullmatch(name) and _unowned(path):
            gone = os.path.join(root, f"{TRASH}{name}")
            os.rename(path, gone)
            out.append(gone)
        elif name.startswith(TRASH):
            out.append(path)
        elif _TMP.fullmatch(name) and name.startswith(POINTER):
            os.unlink(path)
    return out


def remove_all(paths: Sequence[str]) -> None:
    for p in paths:
        if os.path.islink(p) or not os.path.isdir(p):
            with suppress(FileNotFoundError):
                os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)


def clean_stale(root: str) -> None:
    """Delete what killed or failed saves left at ``root`` (not the committed version, not
    a folder a live save holds), so that a full disk is freed before the next write."""
    if not os.path.isdir(root):
        return
    with root_lock(root):
        now, _ = read_pointer(root)
        trash = _leftovers(root, now)
    remove_all(trash)


def read_pointer(root: str) -> tuple[str | None, bytes | None]:
    """The version folder ``checkpoint.json`` names (None if there is none) and its bytes."""
    try:
        raw = _small_file(root, os.path.join(root, POINTER), MAX_POINTER_BYTES)
    except FileNotFoundError:
        return None, None
    try:
        obj = wire.loads(raw)  # a pointer with a key given twice names no version
        name = obj["dir"] if isinstance(obj, dict) else None
    except (ValueError, KeyError, RecursionError, TypeError):
        name = None
    return (name if isinstance(name, str) else "<unreadable>"), raw


def commit(root: str, vdir: str, manifest_sha: str, base: str | None) -> None:
    """Switch ``checkpoint.json`` to ``vdir`` if it still names ``base``; then delete the
    other version folders (the previous version, and those of saves that died; never one a
    live save holds)."""
    name = os.path.basename(vdir)
    pointer = {"format": FORMAT, "version": VERSION, "dir": name, "manifest_sha256": manifest_sha}
    with root_lock(root):
        now, _ = read_pointer(root)
        if now != base:
            shutil.rmtree(vdir, ignore_errors=True)
            raise E.CheckpointConflictError(E.CKPT_CONFLICT.format(path=root, now=now, base=base))
        _write_file(os.path.join(root, POINTER), json.dumps(pointer).encode())
        _fsync_dir(root)
        trash = _leftovers(root, name)
    # deleting large files takes a while: not on the caller's time (a reader that opened a
    # version's files keeps reading them; a folder left over by a process that exits first
    # is deleted by the next save)
    threading.Thread(target=remove_all, args=(trash,), name="tdfunc-checkpoint-cleanup").start()


def check_target(root: str, overwrite: bool) -> str | None:
    """The version folder a save to ``root`` replaces (None: a new checkpoint); raises if
    ``root`` holds something that is not a checkpoint, or a checkpoint and not
    ``overwrite``."""
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        raise ValueError(E.CKPT_NOT_TARGET.format(path=root, pointer=POINTER))
    base, _ = read_pointer(root)
    if base is not None and not overwrite:
        raise FileExistsError(E.CKPT_EXISTS_SAVE.format(path=root))
    if base is None:
        entries = [
            n
            for n in os.listdir(root)
            if n != LOCK
            and not _VERSION_DIR.fullmatch(n)
            and not n.startswith(TRASH)
            and not (_TMP.fullmatch(n) and n.startswith(POINTER))
        ]
        if entries:  # only what a killed first save leaves behind may be there
            raise ValueError(E.CKPT_NOT_TARGET.format(path=root, pointer=POINTER))
    return base


def check_space(root: str, nbytes: int) -> None:
    """Refuse a save that cannot fit (``OSError`` with ``ENOSPC``) before writing."""
    probe = root
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    st = os.statvfs(probe)
    free = st.f_bavail * st.f_frsize
    need = nbytes + (1 << 20)
    if free < need:
        raise OSError(errno.ENOSPC, E.CKPT_NO_SPACE.format(path=root, need=need, free=free))


def disk_full(root: str) -> bool:
    """Whether the filesystem of ``root`` has (almost) no space left."""
    try:
        st = os.statvfs(root if os.path.exists(root) else os.path.dirname(root))
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


# --------------------------------------------------------------------------------------
# writing: DCP's file writer + the chunks' offsets and checksums + the commit
# --------------------------------------------------------------------------------------
def _data_record(root: str, fd: int, file: str, offset: int, length: int) -> tuple[int, int]:
    """Where the raw bytes of the one tensor of a ``torch.save`` item (at ``offset``,
    ``length`` bytes in ``fd``) lie: (absolute offset, size). Only the zip directory and
    one local header are read."""
    with os.fdopen(os.dup(fd), "rb") as f:
        infos = zipfile.ZipFile(_Region(f, offset, length)).infolist()
        data = [i for i in infos if _DATA_RECORD.fullmatch(i.filename)]
        if not data:
            return offset, 0
        if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
            raise E.CheckpointError(E.CKPT_ITEM_LAYOUT.format(path=root, file=file, offset=offset))
        head = read_exact(fd, offset + data[0].header_offset, 30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise E.CheckpointError(E.CKPT_ITEM_LAYOUT.format(path=root, file=file, offset=offset))
        n, m = struct.unpack_from("<HH", head, 26)
        return offset + data[0].header_offset + 30 + n + m, data[0].file_size


class _Region:
    """A read-only file object over ``length`` bytes of ``f`` from ``start`` (one item)."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, self._len)[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return bytes(data)


def _index_key(index: MetadataIndex) -> str:
    return json.dumps([index.fqn, list(index.offset or ())])


class Writer(FileSystemWriter):
    """DCP's file writer. Each rank hashes the tensors it writes (in a background pool,
    while DCP writes them and the files are synced), then finds where each tensor's raw
    bytes lie in its item; the coordinator's last step writes the manifest (every chunk:
    file, offset, size, SHA-256) and commits the version."""

    def __init__(self, root: str, vdir: str, body: dict[str, Any], base: str | None) -> None:
        super().__init__(vdir, single_file_per_rank=True, sync_files=False, overwrite=False)
        self._root, self._vdir, self._body, self._base = root, vdir, body, base
        self.manifest_sha: str | None = None

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        hashes: dict[str, tuple[int, bytes, list[PyFuture[bytes]]]] = {}
        keep = []
        for item in plan.items:
            t = planner.resolve_data(item)
            if not isinstance(t, Tensor):
                raise E.CheckpointError(E.CKPT_LEAF_TYPE.format(key=item.index.fqn, typ="bytes"))
            t = t.detach().cpu()
            if not t.is_contiguous():  # api._plain makes every leaf contiguous
                raise E.CheckpointError(
                    E.CKPT_ITEM_LAYOUT.format(path=self._root, file=item.index.fqn, offset=0)
                )
            keep.append(t)
            header = _chunk_header(wire.dtype_name(t.dtype), list(t.shape))
            hashes[_index_key(item.index)] = (t.nbytes, header, hash_blocks(_bytes_of(t)))
        fut = super().write_data(plan, planner)
        results = fut.wait()  # the file writer has finished by now
        table: dict[str, list[WriteResult]] = {}
        for wr in results:
            rel = wr.storage_data.relative_path
            table.setdefault(rel, []).append(wr)
        sidecar: dict[str, Any] = {}
        for rel, wrs in table.items():
            path = os.path.join(self._vdir, rel)
            fd = os.open(path, os.O_RDWR)
            try:
                os.fsync(fd)  # while the pool hashes
                for wr in wrs:
                    info = wr.storage_data
                    at, size = _data_record(self._root, fd, path, info.offset, info.length)
                    nbytes, header, blocks = hashes[_index_key(wr.index)]
                    if size != nbytes:
                        raise E.CheckpointError(
                            E.CKPT_ITEM_LAYOUT.format(path=self._root, file=path, offset=at)
                        )
                    sidecar[_index_key(wr.index)] = [rel, at, size, combine(header, blocks)]
            finally:
                os.close(fd)
        del keep
        name = _SIDECAR.format(prefix=plan.storage_data.prefix)
        # not fsync-ed: only the coordinator reads it, and the fsync-ed manifest holds it
        _write_file(os.path.join(self._vdir, name), json.dumps(sidecar).encode(), sync=False)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)  # DCP's own .metadata, for DCP's reader
        chunks: dict[str, Any] = {}
        for name in sorted(os.listdir(self._vdir)):
            if name.endswith("chunks.json"):
                path = os.path.join(self._vdir, name)
                with open(path, "rb") as f:
                    chunks.update(wire.loads(f.read()))
                os.unlink(path)
        files: dict[str, int] = {}
        leaves = []
        for entry in self._body["leaves"]:
            md = metadata.state_dict_metadata[entry["name"]]
            assert isinstance(md, TensorStorageMetadata)
            out = []
            for c in md.chunks:
                key = _index_key(MetadataIndex(entry["name"], c.offsets))
                if key not in chunks:
                    raise _corrupt(self._root, self._vdir, f"no record of chunk {key}")
                rel, at, size, sha = chunks[key]
                out.append([list(c.offsets), list(c.sizes), rel, at, size, sha])
                files.setdefault(rel, os.path.getsize(os.path.join(self._vdir, rel)))
            leaves.append({**entry, "chunks": out})
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tree": self._body["tree"],
            "leaves": leaves,
            "files": files,
        }
        data = json.dumps(manifest, separators=(",", ":")).encode()
        _write_file(os.path.join(self._vdir, MANIFEST), data)
        _fsync_dir(self._vdir)
        sha = hashlib.sha256(data).hexdigest()
        commit(self._root, self._vdir, sha, self._base)
        self.manifest_sha = sha


# --------------------------------------------------------------------------------------
# reading: the manifest, the pinned files, the reader
# --------------------------------------------------------------------------------------
class _Chunk:
    __slots__ = ("at", "file", "nbytes", "offsets", "sha", "sizes")

    def __init__(self, offsets: list[int], sizes: list[int], file: str, at: int, n: int, sha: str):
        self.offsets, self.sizes, self.file, self.at, self.nbytes, self.sha = (
            offsets,
            sizes,
            file,
            at,
            n,
            sha,
        )


def _grid_problem(chunks: Sequence[_Chunk], shape: Sequence[int]) -> str | None:
    """Why the non-empty ``chunks`` (each inside ``shape``) do not tile it exactly (None
    when they do), in O(n log n): every save writes a grid (each dim of a leaf cut at the
    same places for every chunk, the product of its shards' intervals), so each dim's
    distinct intervals, sorted, must cut ``[0, size)`` without overlap or gap (neighbours
    compared), no chunk may repeat, and there must be one chunk per cell."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if 0 not in c.sizes]
    if not boxes:
        return None if 0 in shape else "chunks do not tile it"
    if len(set(boxes)) != len(boxes):
        return "chunks overlap"
    cells = 1
    for d, size in enumerate(shape):
        cuts = sorted({(off[d], n[d]) for off, n in boxes})
        end = 0
        for o, n in cuts:
            if o < end:  # two cuts of one dim cross: an overlap, or (in 2+ dims) no grid
                return "chunks overlap" if len(shape) == 1 else "not a grid"
            if o > end:
                return "chunks do not tile it"
            end = o + n
        if end != size:
            return "chunks do not tile it"
        cells *= len(cuts)
    return None if cells == len(boxes) else "not a grid"


class Manifest:
    """One committed version, checked against the format and its files before anything
    is believed, with every file it names open (so a later commit that deletes the version
    does not disturb a load that started). Close it when done."""

    def __init__(self, root: str, digest: str | None = None) -> None:
        self.root = root
        self.fds: dict[str, int] = {}
        for _ in range(5):
            try:
                self._open(digest)
                return
            except _Moved:
                self.close()
        raise E.CheckpointError(E.CKPT_BUSY.format(path=root))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    def _open(self, digest: str | None) -> None:
        root = self.root
        pointer_file = os.path.join(root, POINTER)
        try:
            raw_ptr = _small_file(root, pointer_file, MAX_POINTER_BYTES)
        except FileNotFoundError:
            raise FileNotFoundError(E.CKPT_NOT_FOUND.format(path=root, file=pointer_file)) from None
        ptr = _json(root, pointer_file, raw_ptr)
        if isinstance(ptr, dict) and ptr.get("format") == FORMAT and ptr.get("version") == 1:
            raise _corrupt(root, pointer_file, E.CKPT_OLD_FORMAT)
        ok = (
            isinstance(ptr, dict)
            and ptr.get("format") == FORMAT
            and ptr.get("version") == VERSION
            and isinstance(ptr.get("dir"), str)
            and _VERSION_DIR.fullmatch(ptr["dir"]) is not None
            and isinstance(ptr.get("manifest_sha256"), str)
        )
        _need(ok, root, pointer_file, f"not a {FORMAT} version {VERSION} pointer")
        self.vdir = os.path.join(root, ptr["dir"])
        try:
            dfd = os.open(self.vdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise self._moved_or(raw_ptr, self.vdir, "missing") from None
        except OSError:
            raise _corrupt(root, self.vdir, "not a directory") from None
        try:
            self._read(dfd, ptr, raw_ptr, digest)
        finally:
            os.close(dfd)

    def _moved_or(self, raw_ptr: bytes, file: str, detail: str) -> Exception:
        """A file vanished: a commit switched versions meanwhile (retry), or it is missing."""
        _, now = read_pointer(self.root)
        if now != raw_ptr:
            return _Moved()
        return _corrupt(self.root, file, detail)

    def _read(self, dfd: int, ptr: dict[str, Any], raw_ptr: bytes, digest: str | None) -> None:
        root = self.root
        mfile = os.path.join(self.vdir, MANIFEST)
        try:
            raw = _small_file(root, MANIFEST, MAX_MANIFEST_BYTES, dfd, self.vdir)
        except FileNotFoundError:
            raise self._moved_or(raw_ptr, mfile, "missing") from None
        sha = hashlib.sha256(raw).hexdigest()
        if digest is not None and digest_of(sha) != digest:
            raise E.CheckpointDigestError(
                E.CKPT_DIGEST.format(path=root, want=digest, got=digest_of(sha))
            )
        _need(sha == ptr["manifest_sha256"], root, mfile, "checksum mismatch")
        self.sha = sha
        m = _json(root, mfile, raw)
        ok = isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") == VERSION
        _need(ok, root, mfile, f"not a {FORMAT} version {VERSION} manifest")
        leaves, files = m.get("leaves"), m.get("files")
        _need(isinstance(leaves, list) and isinstance(files, dict), root, mfile, "bad fields")
        _need(len(leaves) <= MAX_LEAVES, root, mfile, f"more than {MAX_LEAVES} leaves")
        self.tree = m.get("tree")
        self.sizes: dict[str, int] = {}
        for name, size in files.items():
            _need(_DATA_FILE.fullmatch(name) is not None, root, mfile, f"bad file name {name!r}")
            _need(_is_int(size), root, mfile, f"bad entry for {name}")
            self.sizes[name] = size
        self.leaves: list[dict[str, Any]] = leaves
        self.chunks: dict[str, list[_Chunk]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        spans: dict[str, list[tuple[int, int, str]]] = {}
        for e in leaves:
            self._leaf(e, mfile, spans)
        for file, ranges in spans.items():  # no two chunks share a byte
            ranges.sort()
            for (a, n, ka), (b, _, kb) in itertools.pairwise(ranges):
                _need(a + n <= b, root, mfile, f"chunks of {ka} and {kb} overlap in {file}")
        for name, size in self.sizes.items():  # every file: there, regular, of its size
            where = os.path.join(self.vdir, name)
            try:
                fd = open_regular(root, name, dfd, self.vdir)
            except FileNotFoundError:
                raise self._moved_or(raw_ptr, where, "missing") from None
            self.fds[name] = fd
            got = os.fstat(fd).st_size
            _need(got == size, root, where, f"size {got} bytes, the manifest records {size}")

    def _leaf(self, e: Any, mfile: str, spans: dict[str, list[tuple[int, int, str]]]) -> None:
        root = self.root
        ok = (
            isinstance(e, dict)
            and isinstance(e.get("path"), list)
            and all(isinstance(k, str) for k in e["path"])
            and isinstance(e.get("name"), str)
            and isinstance(e.get("dtype"), str)
            and isinstance(e.get("shape"), list)
            and len(e["shape"]) <= MAX_DIMS
            and all(_is_int(s) for s in e["shape"])
            and isinstance(e.get("chunks"), list)
            and len(e["chunks"]) <= MAX_CHUNKS_PER_LEAF
        )
        _need(ok, root, mfile, "bad leaf entry")
        name, shape = e["name"], e["shape"]
        _need(name not in self.chunks, root, mfile, f"leaf {name!r} appears twice")
        try:
            dtype = wire.dtype_from_name(e["dtype"])
        except Exception:
            raise _corrupt(root, mfile, f"leaf {name!r}: unknown dtype {e['dtype']!r}") from None
        problem = shape_problem(shape, dtype)  # before torch sees it (skeleton, metadata)
        _need(problem is None, root, mfile, f"leaf {name!r}: {problem}")
        itemsize = dtype.itemsize
        out: list[_Chunk] = []
        volume = 0
        for c in e["chunks"]:
            good = (
                isinstance(c, list)
                and len(c) == 6
                and isinstance(c[0], list)
                and isinstance(c[1], list)
                and len(c[0]) == len(c[1]) == len(shape)
                and all(_is_int(x) for x in (*c[0], *c[1]))
                and all(o + s <= d for o, s, d in zip(c[0], c[1], shape))
                and isinstance(c[2], str)
                and c[2] in self.sizes
                and _is_int(c[3])
                and _is_int(c[4])
                and isinstance(c[5], str)
                and _SHA.fullmatch(c[5]) is not None
            )
            _need(good, root, mfile, f"leaf {name!r}: bad chunk entry")
            n = math.prod(c[1])
            _need(c[4] == n * itemsize, root, mfile, f"leaf {name!r}: chunk of the wrong size")
            _need(
                c[3] + c[4] <= self.sizes[c[2]],
                root,
                mfile,
                f"leaf {name!r}: chunk beyond the end of {c[2]}",
            )
            chunk = _Chunk(c[0], c[1], c[2], c[3], c[4], c[5])
            out.append(chunk)
            volume += n
            if c[4]:
                spans.setdefault(c[2], []).append((c[3], c[4], repr(name)))
        problem = _grid_problem(out, shape)
        if problem == "not a grid":
            raise _corrupt(root, mfile, E.CKPT_NOT_GRID.format(name=name))
        _need(problem is None, root, mfile, f"leaf {name!r}: {problem}")
        _need(volume == math.prod(shape), root, mfile, f"leaf {name!r}: chunks do not tile it")
        self.chunks[name] = out
        self.dtypes[name] = dtype

    def skeleton(self) -> Any:
        """The saved container with meta-device leaves of the saved shapes and dtypes."""
        mfile = os.path.join(self.vdir, MANIFEST)
        holders = [
            torch.empty(e["shape"], dtype=self.dtypes[e["name"]], device="meta")
            for e in self.leaves
        ]
        try:  # tdfunc's own decoder: nothing the file names is imported or looked up
            node = wire.unflatten(self.tree, holders, E.CKPT_UNKNOWN_TYPE)
        except E.SpecFormatError as e:
            raise _corrupt(self.root, mfile, f"bad structure ({e})") from None
        paths = [p for p, _ in leaves_with_paths(node)] if is_node(node) else None
        _need(
            paths == [tuple(e["path"]) for e in self.leaves],
            self.root,
            mfile,
            "the leaves do not match the structure",
        )
        return node

    def metadata(self) -> Metadata:
        """DCP's description of the checkpoint, built from the manifest (DCP's pickled
        ``.metadata`` is never read)."""
        sd: dict[str, Any] = {}
        storage: dict[MetadataIndex, _Chunk] = {}
        for e in self.leaves:
            name = e["name"]
            chunks = self.chunks[name]
            sd[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=self.dtypes[name]),
                size=torch.Size(e["shape"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                    for c in chunks
                ],
            )
            for i, c in enumerate(chunks):
                storage[MetadataIndex(name, c.offsets, i)] = c
        return Metadata(state_dict_metadata=sd, storage_data=storage)


class _Moved(Exception):
    """The version a load started with was replaced while its files were being opened."""


class Reader(FileSystemReader):
    """A DCP storage reader over a checked :class:`Manifest`: the metadata comes from the
    manifest, every chunk is read as raw bytes from the pinned files (straight into the
    target when it is one contiguous piece) and checked against its SHA-256 if ``verify``."""

    def __init__(self, manifest: Manifest, verify: bool) -> None:
        super().__init__(manifest.vdir)
        self._m, self._verify = manifest, verify

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._m.metadata()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self._m
        by_chunk: dict[int, tuple[_Chunk, str, list[Any]]] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:  # never produced by a manifest: refuse
                raise _corrupt(m.root, m.vdir, f"item {req.storage_index.fqn!r} is not a tensor")
            chunk = self.storage_data.get(req.storage_index)
            _need(isinstance(chunk, _Chunk), m.root, m.vdir, f"no chunk {req.storage_index}")
            assert isinstance(chunk, _Chunk)
            by_chunk.setdefault(id(chunk), (chunk, req.storage_index.fqn, []))[2].append(req)
        checks: list[tuple[_Chunk, str, bytes, list[PyFuture[bytes]], Any]] = []
        for chunk, fqn, reqs in sorted(by_chunk.values(), key=lambda x: (x[0].file, x[0].at)):
            dtype = m.dtypes[fqn]
            whole = (
                len(reqs) == 1
                and list(reqs[0].storage_offsets) == [0] * len(chunk.sizes)
                and list(reqs[0].lengths) == chunk.sizes
            )
            target = planner.resolve_tensor(reqs[0]).detach() if whole else None
            direct = (
                target is not None
                and target.is_contiguous()
                and target.dtype == dtype
                and list(target.shape) == chunk.sizes
                and target.device.type == "cpu"
            )
            buf = target if direct else torch.empty(chunk.sizes, dtype=dtype)
            assert buf is not None
            view = _bytes_of(buf)
            file = os.path.join(m.vdir, chunk.file)
            got = _pread_into(m.fds[chunk.file], view, chunk.at)
            _need(got == chunk.nbytes, m.root, file, f"chunk of {fqn!r}: truncated")
            if self._verify:
                header = _chunk_header(wire.dtype_name(dtype), chunk.sizes)
                checks.append((chunk, fqn, header, hash_blocks(view), buf))
            for req in reqs:
                self._deliver(req, buf, planner, file, direct)
        for chunk, fqn, header, blocks, _buf in checks:
            file = os.path.join(m.vdir, chunk.file)
            where = f"chunk of {fqn!r} at bytes {chunk.at}..{chunk.at + chunk.nbytes}"
            _need(combine(header, blocks) == chunk.sha, m.root, file, f"{where}: checksum mismatch")
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _deliver(
        self, req: Any, piece: Tensor, planner: LoadPlanner, file: str, direct: bool
    ) -> None:
        if direct:
            planner.commit_tensor(req, planner.resolve_tensor(req).detach())
            return
        for d, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            if off != 0 or n != piece.shape[d]:
                piece = piece.narrow(d, off, n)
        target = planner.resolve_tensor(req).detach()
        _need(target.shape == piece.shape, self._m.root, file, "chunk of the wrong shape")
        target.copy_(piece)
        planner.commit_tensor(req, target)
