"""The files of a checkpoint (see ``_checkpoint.py`` for the design): the version folders,
``checkpoint.json`` and its atomic commit, the manifest and the checksums, and DCP's file
writer and reader wrapped to record and check them."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import struct
import threading
import zipfile
import zlib
from collections.abc import Sequence
from typing import IO, Any, cast

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._tree import is_node, leaves_with_paths
from . import _errors as E
from . import _transfer as wire

FORMAT = "tdfunc.checkpoint"
VERSION = 1
POINTER = "checkpoint.json"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
LOCK = ".lock"
#: prefix of replaced versions being deleted
TRASH = ".trash-"
_VERSION_DIR = re.compile(r"v-[0-9a-f]{16}")
_DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")
_SIDECAR = "{prefix}crc.json"
#: the record of a torch.save archive that holds a storage's bytes
_DATA_RECORD = re.compile(r"[^/]+/data/[0-9]+")
_CHUNK = 16 << 20


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, sync: bool = True) -> None:
    """``data`` into ``path`` through a temporary file (fsync-ed if ``sync``) and
    ``os.replace``."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _crc_region(f: Any, offset: int, length: int) -> int:
    f.seek(offset)
    crc, left = 0, length
    while left:
        block = f.read(min(left, _CHUNK))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


# --------------------------------------------------------------------------------------
# writing: DCP's file writer + checksums + the commit
# --------------------------------------------------------------------------------------
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

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._len - self._pos)
        self._f.seek(self._start + self._pos)
        got = int(self._f.readinto(view[:n]) or 0)
        self._pos += got
        return got

    def read(self, n: int = -1) -> bytes:
        n = self._len - self._pos if n is None or n < 0 else min(n, self._len - self._pos)
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return bytes(data)


def _records(fileobj: Any) -> list[list[Any]] | None:
    """``[name, crc32, size]`` of each record of a ``torch.save`` zip archive, read from its
    central directory (torch.save computes them while writing); None when they cannot serve
    (not such an archive, a compressed record, or CRCs turned off with
    ``torch.serialization.set_crc32_options(False)``, which writes zeros)."""
    try:
        infos = zipfile.ZipFile(fileobj).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    recs = [[i.filename, i.CRC, i.file_size] for i in infos]
    stored = all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    if not recs or not stored or any(crc == 0 and size for _, crc, size in recs):
        return None
    return recs


def _item_sum(f: Any, offset: int, length: int) -> int | list[list[Any]]:
    """What the manifest records for one item: its records' CRC-32s, or failing that the
    CRC-32 of its bytes."""
    recs = _records(_Region(f, offset, length))
    return recs if recs is not None else _crc_region(f, offset, length)


class Writer(FileSystemWriter):
    """DCP's file writer; each rank also records a CRC-32 of every item it wrote, and the
    coordinator's last step writes the manifest and commits the version."""

    def __init__(self, root: str, vdir: str, body: dict[str, Any], base: str | None) -> None:
        super().__init__(vdir, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._root, self._vdir, self._body, self._base = root, vdir, body, base

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        results = fut.wait()  # the file writer has finished by now
        table: dict[str, list[list[Any]]] = {}
        by_file: dict[str, list[Any]] = {}
        for wr in results:
            by_file.setdefault(wr.storage_data.relative_path, []).append(wr.storage_data)
        for rel, infos in by_file.items():
            with open(os.path.join(self._vdir, rel), "rb") as f:
                table[rel] = [
                    [i.offset, i.length, _item_sum(f, i.offset, i.length)]
                    for i in sorted(infos, key=lambda i: i.offset)
                ]
        sidecar = _SIDECAR.format(prefix=plan.storage_data.prefix)
        # not fsync-ed: only the coordinator reads it, and the fsync-ed manifest holds it
        _write_file(os.path.join(self._vdir, sidecar), json.dumps(table).encode(), sync=False)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        files: dict[str, Any] = {}
        wanted = {wr.storage_data.relative_path for rs in results for wr in rs}
        for name in sorted(os.listdir(self._vdir)):
            if name.endswith("crc.json"):
                with open(os.path.join(self._vdir, name), "rb") as f:
                    for rel, items in json.loads(f.read()).items():
                        size = os.path.getsize(os.path.join(self._vdir, rel))
                        files[rel] = {"size": size, "items": items}
        missing = sorted(wanted - set(files))
        if missing:
            raise E.CheckpointCorruptError(
                E.CKPT_CORRUPT.format(path=self._root, file=missing[0], detail="no checksums")
            )
        with open(os.path.join(self._vdir, DCP_METADATA), "rb") as f:
            raw = f.read()
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            **self._body,
            "files": files,
            "metadata": {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()},
            "data_bytes": sum(v["size"] for v in files.values()),
        }
        data = json.dumps(manifest).encode()
        _write_file(os.path.join(self._vdir, MANIFEST), data)
        _fsync_dir(self._vdir)
        _commit(self._root, self._vdir, hashlib.sha256(data).hexdigest(), self._base)


def _read_pointer(root: str) -> tuple[str | None, bytes | None]:
    """The version folder ``checkpoint.json`` names (None if there is none) and its bytes."""
    try:
        with open(os.path.join(root, POINTER), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None, None
    try:
        obj = json.loads(raw)
        name = obj["dir"] if isinstance(obj, dict) else None
    except (ValueError, KeyError):
        name = None
    return (name if isinstance(name, str) else "<unreadable>"), raw


def _commit(root: str, vdir: str, manifest_sha: str, base: str | None) -> None:
    """Switch ``checkpoint.json`` to ``vdir`` if it still names ``base``; then delete the
    other version folders (the previous version, and those of saves that died)."""
    name = os.path.basename(vdir)
    pointer = {"format": FORMAT, "version": VERSION, "dir": name, "manifest_sha256": manifest_sha}
    fd = os.open(os.path.join(root, LOCK), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        now, _ = _read_pointer(root)
        if now != base:
            shutil.rmtree(vdir, ignore_errors=True)
            raise E.CheckpointConflictError(E.CKPT_CONFLICT.format(path=root, now=now, base=base))
        _write_file(os.path.join(root, POINTER), json.dumps(pointer).encode())
        _fsync_dir(root)
        trash = []
        for old in os.listdir(root):
            if old != name and _VERSION_DIR.fullmatch(old):
                gone = os.path.join(root, f"{TRASH}{old}")
                os.rename(os.path.join(root, old), gone)
                trash.append(gone)
            elif old.startswith(TRASH):
                trash.append(os.path.join(root, old))
    finally:
        os.close(fd)
    # deleting large files takes a while: not on the caller's time (a folder left over by a
    # process that exits first is deleted by the next commit)
    threading.Thread(target=_remove_all, args=(trash,), name="tdfunc-checkpoint-cleanup").start()


def _remove_all(paths: Sequence[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def check_target(root: str, overwrite: bool) -> str | None:
    """The version folder a save to ``root`` replaces (None: a new checkpoint); raises if
    ``root`` holds something that is not a checkpoint, or a checkpoint and not
    ``overwrite``."""
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        raise ValueError(E.CKPT_NOT_TARGET.format(path=root, pointer=POINTER))
    base, _ = _read_pointer(root)
    if base is not None and not overwrite:
        raise FileExistsError(E.CKPT_EXISTS_SAVE.format(path=root))
    if base is None:
        entries = [
            n
            for n in os.listdir(root)
            if n != LOCK and not _VERSION_DIR.fullmatch(n) and not n.startswith(TRASH)
        ]
        if entries:  # only what a killed first save leaves behind may be there
            raise ValueError(E.CKPT_NOT_TARGET.format(path=root, pointer=POINTER))
    return base


# --------------------------------------------------------------------------------------
# reading: the manifest, the files, DCP's reader with checksums
# --------------------------------------------------------------------------------------
def _corrupt(root: str, file: str, detail: str) -> E.CheckpointCorruptError:
    return E.CheckpointCorruptError(E.CKPT_CORRUPT.format(path=root, file=file, detail=detail))


def _json(root: str, file: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise _corrupt(root, file, f"not JSON ({e})") from None


def _need(cond: bool, root: str, file: str, detail: str) -> None:
    if not cond:
        raise _corrupt(root, file, detail)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_records(x: Any) -> bool:
    return (
        isinstance(x, list)
        and len(x) > 0
        and all(
            isinstance(r, list)
            and len(r) == 3
            and isinstance(r[0], str)
            and _is_int(r[1])
            and _is_int(r[2])
            for r in x
        )
    )


def _verify(data: bytes, expected: Any) -> str | None:
    """Why ``data`` (one item) does not match what the manifest records, or None."""
    if isinstance(expected, int):
        return None if zlib.crc32(data) == expected else "checksum mismatch"
    recs = _records(io.BytesIO(data))
    if recs != expected:  # the archive's directory itself was changed
        return "checksum mismatch (the item's record table differs from the manifest)"
    view = memoryview(data)
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        at = info.header_offset
        if data[at : at + 4] != b"PK\x03\x04":
            return "checksum mismatch (a record header is damaged)"
        n, m = struct.unpack_from("<HH", data, at + 26)
        begin = at + 30 + n + m
        piece = view[begin : begin + info.file_size]
        if len(piece) != info.file_size or zlib.crc32(piece) != info.CRC:
            return f"checksum mismatch (record {info.filename!r})"
    return None


class Manifest:
    """A committed version, checked against the files it names (sizes only: the data is
    checked item by item as it is read)."""

    def __init__(self, root: str) -> None:
        self.root = root
        pointer_file = os.path.join(root, POINTER)
        if not os.path.isfile(pointer_file):
            raise FileNotFoundError(E.CKPT_NOT_FOUND.format(path=root, file=pointer_file))
        with open(pointer_file, "rb") as f:
            ptr = _json(root, pointer_file, f.read())
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
        mfile = os.path.join(self.vdir, MANIFEST)
        try:
            with open(mfile, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise _corrupt(root, mfile, "missing") from None
        sha = hashlib.sha256(raw).hexdigest()
        _need(sha == ptr["manifest_sha256"], root, mfile, "checksum mismatch")
        self.sha = sha
        m = _json(root, mfile, raw)
        _need(isinstance(m, dict) and m.get("format") == FORMAT, root, mfile, "not a manifest")
        leaves, files, meta = m.get("leaves"), m.get("files"), m.get("metadata")
        _need(isinstance(leaves, list) and isinstance(files, dict), root, mfile, "bad fields")
        _need(isinstance(meta, dict) and _is_int(meta.get("size")), root, mfile, "bad metadata")
        self.tree = m.get("tree")
        self.leaves: list[dict[str, Any]] = leaves
        for e in leaves:
            _need(
                isinstance(e, dict)
                and isinstance(e.get("path"), list)
                and all(isinstance(k, str) for k in e["path"])
                and isinstance(e.get("name"), str)
                and isinstance(e.get("dtype"), str)
                and isinstance(e.get("shape"), list)
                and all(_is_int(s) for s in e["shape"]),
                root,
                mfile,
                "bad leaf entry",
            )
        self.meta_sha, self.meta_size = meta.get("sha256"), meta["size"]
        self.items: dict[str, dict[tuple[int, int], Any]] = {}
        for name, info in files.items():
            where = os.path.join(self.vdir, name)
            _need(_DATA_FILE.fullmatch(name) is not None, root, mfile, f"bad file name {name!r}")
            ok = (
                isinstance(info, dict)
                and _is_int(info.get("size"))
                and isinstance(info.get("items"), list)
            )
            _need(ok, root, mfile, f"bad entry for {name}")
            table: dict[tuple[int, int], Any] = {}
            for it in info["items"]:
                good = (
                    isinstance(it, list)
                    and len(it) == 3
                    and _is_int(it[0])
                    and _is_int(it[1])
                    and it[0] + it[1] <= info["size"]
                    and (_is_int(it[2]) or _is_records(it[2]))
                )
                _need(good, root, mfile, f"bad item in {name}")
                table[(it[0], it[1])] = it[2]
            self.items[name] = table
            self._check_size(where, info["size"])
        meta_file = os.path.join(self.vdir, DCP_METADATA)
        self._check_size(meta_file, self.meta_size)
        with open(meta_file, "rb") as f:  # before DCP reads it: its own fallback hides errors
            good = hashlib.sha256(f.read()).hexdigest() == self.meta_sha
        _need(good, root, meta_file, "checksum mismatch")

    def _check_size(self, file: str, size: int) -> None:
        try:
            got = os.path.getsize(file)
        except FileNotFoundError:
            raise _corrupt(self.root, file, "missing") from None
        _need(got == size, self.root, file, f"size {got} bytes, the manifest records {size}")

    def skeleton(self) -> Any:
        """The saved container with meta-device leaves of the saved shapes and dtypes."""
        mfile = os.path.join(self.vdir, MANIFEST)
        try:
            wire.check_tree_types(self.tree, E.CKPT_UNKNOWN_TYPE)
        except ValueError:
            raise
        except Exception as e:
            raise _corrupt(self.root, mfile, f"bad structure ({type(e).__name__})") from None
        try:
            holders = [
                torch.empty(e["shape"], dtype=wire.dtype_from_name(e["dtype"]), device="meta")
                for e in self.leaves
            ]
            node = wire.unflatten(self.tree, holders)
        except Exception as e:  # anything the structure's JSON makes the decoder raise
            raise _corrupt(self.root, mfile, f"bad structure ({type(e).__name__}: {e})") from None
        paths = [p for p, _ in leaves_with_paths(node)] if is_node(node) else None
        _need(
            paths == [tuple(e["path"]) for e in self.leaves],
            self.root,
            mfile,
            "the leaves do not match the structure",
        )
        return node


class Reader(FileSystemReader):
    """DCP's file reader that checks the CRC-32 of every item it reads, and the SHA-256 of
    ``.metadata`` before unpickling it."""

    def __init__(self, manifest: Manifest, verify: bool) -> None:
        super().__init__(manifest.vdir)
        self._m, self._verify = manifest, verify

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        m = self._m
        file = os.path.join(m.vdir, DCP_METADATA)
        with open(file, "rb") as f:
            raw = f.read()
        _need(hashlib.sha256(raw).hexdigest() == m.meta_sha, m.root, file, "checksum mismatch")
        metadata = self._unpickle(raw)
        _need(isinstance(metadata, Metadata), m.root, file, "not DCP metadata")
        return metadata

    @staticmethod
    def _unpickle(raw: bytes) -> Any:
        import pickle

        return pickle.loads(raw)  # DCP's own format; its SHA-256 was checked just before

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not self._verify:  # DCP's own reader (the file sizes were checked)
            return super().read_data(plan, planner)
        m = self._m
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            rel = self.storage_data[req.storage_index].relative_path
            per_file.setdefault(rel, []).append(req)
        for rel, reqs in per_file.items():
            file = os.path.join(m.vdir, rel)
            table = m.items.get(rel)
            _need(table is not None, m.root, file, "not recorded in the manifest")
            assert table is not None
            reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
            last: tuple[int, Any] | None = None
            with open(file, "rb") as f:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    _need(not info.transform_descriptors, m.root, file, "unexpected transforms")
                    if last is None or last[0] != info.offset:
                        last = (info.offset, self._item(f, file, table, info, req))
                    self._deliver(req, last[1], planner, file)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _item(
        self, f: Any, file: str, table: dict[tuple[int, int], Any], info: Any, req: Any
    ) -> Any:
        m = self._m
        crc = table.get((info.offset, info.length))
        where = (
            f"item {req.storage_index.fqn!r} at bytes {info.offset}..{info.offset + info.length}"
        )
        _need(crc is not None, m.root, file, f"{where} is not recorded in the manifest")
        if isinstance(crc, list) and req.type != LoadItemType.BYTE_IO:
            t = self._checked_load(f, file, info, crc, where)
            if t is not None:
                return t
        f.seek(info.offset)
        data = f.read(info.length)
        _need(len(data) == info.length, m.root, file, f"{where}: truncated")
        why = _verify(data, crc)
        _need(why is None, m.root, file, f"{where}: {why}")
        if req.type == LoadItemType.BYTE_IO:
            return data
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # the bytes matched their checksum but do not parse
            raise _corrupt(m.root, file, f"{where}: {type(e).__name__}") from None

    def _checked_load(
        self, f: Any, file: str, info: Any, expected: list[list[Any]], where: str
    ) -> Tensor | None:
        """``torch.load`` straight from the file (no copy of the item in memory), checking
        every record: the small ones from their bytes, the tensor's data from the storage
        torch.load filled. None when the item is not one tensor (then the caller reads it
        whole)."""
        m = self._m
        region = _Region(f, info.offset, info.length)
        try:
            infos = zipfile.ZipFile(region).infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError):
            raise _corrupt(m.root, file, f"{where}: not a torch.save archive") from None
        got = [[i.filename, i.CRC, i.file_size] for i in infos]
        why = "checksum mismatch (the item's record table differs from the manifest)"
        _need(got == expected, m.root, file, f"{where}: {why}")
        data = [i for i in infos if _DATA_RECORD.fullmatch(i.filename)]
        if len(data) != 1:
            return None
        for i in infos:
            if i is data[0]:
                continue
            region.seek(i.header_offset)
            head = region.read(30)
            ok = len(head) == 30 and head[:4] == b"PK\x03\x04"
            if ok:
                n, extra = struct.unpack_from("<HH", head, 26)
                region.seek(i.header_offset + 30 + n + extra)
                ok = zlib.crc32(region.read(i.file_size)) == i.CRC
            _need(ok, m.root, file, f"{where}: checksum mismatch (record {i.filename!r})")
        region.seek(0)
        try:
            t = torch.load(cast(IO[bytes], region), map_location="cpu", weights_only=True)
        except Exception as e:
            raise _corrupt(m.root, file, f"{where}: {type(e).__name__}") from None
        _need(isinstance(t, Tensor), m.root, file, f"{where}: not a tensor")
        storage = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage)
        ok = (
            storage.nbytes() == data[0].file_size
            and zlib.crc32(cast(Any, raw.numpy())) == data[0].CRC
        )
        _need(ok, m.root, file, f"{where}: checksum mismatch (record {data[0].filename!r})")
        return t

    def _deliver(self, req: Any, item: Any, planner: LoadPlanner, file: str) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(item))
            return
        piece = item
        for d, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            if off != 0 or n != piece.shape[d]:
                piece = piece.narrow(d, off, n)
        target = planner.resolve_tensor(req).detach()
        _need(target.shape == piece.shape, self._m.root, file, "item of the wrong shape")
        target.copy_(piece)
        planner.commit_tensor(req, target)
