"""Whole TensorDicts / tensorclasses on disk: ``save``, ``load`` and ``memmap_like``.

On-disk format (version 1)
--------------------------
A store is a directory with two files::

    store/
      manifest.json   structure, dtypes, shapes, batch sizes, devices, container types
      data.bin        every leaf's bytes, back to back, each at a 64-byte aligned offset

``manifest.json``::

    {"format": "tdfunc.memmap", "version": 1, "data_file": "data.bin",
     "data_bytes": 4160, "alignment": 64,
     "root": {"kind": "node", "type": "tdfunc.TensorDict", "batch_size": [4],
              "device": "cpu", "static": [],
              "children": {"obs":  {"kind": "tensor", "dtype": "float32", "shape": [4, 256],
                                    "offset": 0, "nbytes": 4096},
                           "next": {"kind": "node", "type": "tdfunc.TensorDict", ...},
                           "mask": {"kind": "none"}}}}

* ``type`` is the container's registered pytree name (``serialized_type_name``): a
  tensorclass is found again by that name, never by importing a module named in the file.
  ``static`` holds a tensorclass's non-tensor fields (JSON values; tuples are written as
  ``{"tuple": [...]}``).
* A leaf is stored contiguous, row-major, in its dtype's native (little-endian) byte order.
* No pickle anywhere: loading parses JSON and maps bytes, it never runs code from the file.

Why one data file: opening a store is one ``stat`` and one ``mmap`` whatever the number of
leaves, saving is one sequential stream of ``write`` calls, and copying or shipping a store
moves two files. ``load`` is O(number of leaves): it parses the manifest, checks every offset
and size against the data file's size (no data is read) and slices the single mapping.

Atomic save
-----------
Everything is written into a fresh hidden directory next to the target
(``.<name>.saving-XXXX``), ``fsync``-ed (data file, manifest, directory), then renamed onto
the target. With ``overwrite=True`` the old store is first renamed aside
(``.<name>.old-XXXX``) and deleted after the new one is in place. A process killed at any point
leaves the target holding the previous complete store, the new complete store, or (only
between the two renames of an overwrite) nothing, with the previous store kept in
``.<name>.old-XXXX``; never a half-written store that loads. A killed save leaves its hidden
``.saving-`` directory behind; it is never loaded and can be deleted. Files are never
rewritten in place, so processes that have the old store mapped keep valid mappings.
``overwrite=True`` only replaces an existing store or an empty directory, never other data.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from .. import _nontensor as nontensor
from .._compat import pytree
from .._jagged._layout import from_read_parts, is_jagged, jagged_problem
from .._json import loads_unique
from .._keys import fmt_key
from .._nontensor import NonTensor
from .._shapes import SHAPE_UNSAVED, shape_problem
from .._tensorclass import is_tensorclass, restore
from .._tree import KeyPath, Node, is_node, leaves_with_paths
from . import _errors as E
from ._tensor import (
    _O_CLOEXEC,
    DTYPES,
    MemoryMappedTensor,
    _libc,
    _permission_error,
    check_leaf,
    check_mode,
    create_unique,
    dtype_name,
    fsync_dir,
    leaf_tensor,
    map_fd,
    nbytes_of,
    open_fd,
    reserve,
    write_all,
    write_tensor,
)

FORMAT = "tdfunc.memmap"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
DATA = "data.bin"
ALIGN = 64
#: how often ``load`` reopens a store that was replaced while it was being opened
OPEN_ATTEMPTS = 50
#: how often an overwriting save retries when other writers keep replacing the target
COMMIT_ATTEMPTS = 50
#: deepest nesting a manifest may describe
#: tdfunc's modules that define container types of their own, imported by :func:`load` when
#: a file holds one of their types (``import tdfunc`` does not import them)
OWN_MODULES = frozenset({"tdfunc.rl"})

MAX_DEPTH = 256
#: most dims of a tensor or batch size
MAX_NDIM = 64
#: saves and ``memmap_like`` at least this large show a progress bar on a terminal
PROGRESS_MIN_BYTES = 1 << 30


# --------------------------------------------------------------------------------------
# describing a container (save side)
# --------------------------------------------------------------------------------------
class _Layout:
    """Leaves in file order with their byte offsets."""

    def __init__(self) -> None:
        self.entries: list[tuple[KeyPath, Tensor, int, int]] = []
        self.total = 0

    def add(self, path: KeyPath, t: Tensor) -> dict[str, Any]:
        check_leaf(t, fmt_key(path))
        problem = shape_problem(t.shape, t.dtype)
        if problem is not None:
            raise ValueError(SHAPE_UNSAVED.format(key=fmt_key(path), detail=problem))
        n = nbytes_of(t.shape, t.dtype)
        off = -(-self.total // ALIGN) * ALIGN
        self.entries.append((path, t, off, n))
        self.total = off + n
        return {
            "kind": "tensor",
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "offset": off,
            "nbytes": n,
        }


def _type_name(node: Node) -> str:
    info = pytree.SUPPORTED_SERIALIZED_TYPES.get(type(node))
    name = getattr(info, "serialized_type_name", None)
    if not isinstance(name, str) or name == pytree.NO_SERIALIZED_TYPE_NAME_FOUND:
        raise TypeError(E.UNREGISTERED_TYPE.format(typ=type(node).__name__))
    return name


def _static_to_json(node: Node, name: str, value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_static_to_json(node, name, v) for v in value]}
    raise TypeError(
        E.STATIC_NOT_JSON.format(name=name, typ=type(node).__name__, vtyp=type(value).__name__)
    )


def _describe(node: Node, prefix: KeyPath, layout: _Layout) -> dict[str, Any]:
    children: dict[str, Any] = {}
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        path = (*prefix, k)
        if v is None:
            children[k] = {"kind": "none"}
        elif isinstance(v, Tensor) and is_jagged(v):
            children[k] = _describe_jagged(path, v, layout)
        elif isinstance(v, Tensor):
            children[k] = layout.add(path, v)
        elif is_node(v):
            children[k] = _describe(v, path, layout)
        elif isinstance(v, NonTensor):
            if not nontensor.is_json_value(v.value):
                bad = nontensor.first_non_json(v.value)
                raise TypeError(
                    E.NONTENSOR_NOT_JSON.format(key=fmt_key(path), typ=type(bad).__name__)
                )
            children[k] = {"kind": "nontensor", **nontensor.to_json(v)}
        else:
            raise TypeError(f"key {fmt_key(path)}: cannot save a child of type {type(v).__name__}")
    static: tuple[tuple[str, Any], ...] = node._tdf_static()
    return {
        "kind": "node",
        "type": _type_name(node),
        "batch_size": list(node._batch_size),
        "device": None if node._device is None else str(node._device),
        "static": [[k, _static_to_json(node, k, v)] for k, v in static],
        "children": children,
    }


def _describe_jagged(path: KeyPath, v: Any, layout: _Layout) -> dict[str, Any]:
    """A jagged leaf: its values, offsets and (when present) lengths, each a stored tensor;
    refused (``ValueError``) when a load would refuse them."""
    if v._ragged_idx != 1:
        raise TypeError(E.JAGGED_RAGGED_DIM.format(key=fmt_key(path), dim=v._ragged_idx))
    lengths = v.lengths()
    problem = jagged_problem(v.values(), v.offsets(), lengths, v.shape[:1])
    if problem is not None:
        raise ValueError(E.JAGGED_UNSAVED.format(key=fmt_key(path), problem=problem))
    return {
        "kind": "jagged",
        "values": layout.add(path, v.values()),
        "offsets": layout.add(path, v.offsets()),
        "lengths": None if lengths is None else layout.add(path, lengths),
    }


def _plan(node: Any) -> tuple[dict[str, Any], _Layout]:
    if not is_node(node):
        raise TypeError(E.NOT_A_CONTAINER.format(typ=type(node).__name__))
    layout = _Layout()
    root = _describe(node, (), layout)
    store_id = secrets.token_hex(12)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "store_id": store_id,
        "data_file": DATA,
        "data_bytes": layout.total,
        "alignment": ALIGN,
        "root": root,
    }
    return manifest, layout


# --------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------
def _progress(total: int, progress: bool | None, desc: str) -> Any:
    """A tqdm bar (or a no-op context): auto (``None``) shows it for >= 1 GiB on a terminal."""
    if progress is False:
        return nullcontext(None)
    tty = sys.stdout is not None and sys.stdout.isatty()
    if progress is None and not (total >= PROGRESS_MIN_BYTES and tty):
        return nullcontext(None)
    if importlib.util.find_spec("tqdm") is None:
        if progress:
            raise ModuleNotFoundError(E.PROGRESS_NEEDS_TQDM)
        return nullcontext(None)
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)


def _is_store_or_empty(path: str) -> bool:
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    return os.path.exists(os.path.join(path, MANIFEST)) or not os.listdir(path)


def _resolve_link(path: str, overwrite: bool) -> str:
    """The path a save writes to: ``path`` itself, or, for ``overwrite=True`` and a symbolic
    link to a store (or an empty directory), the store the link points to (the link is kept
    and then points to the new store). A link to anything else is refused, naming both."""
    if not (overwrite and os.path.islink(path)):
        return path
    target = os.path.realpath(path)
    if not _is_store_or_empty(target):
        raise FileExistsError(
            E.LINK_NOT_A_STORE_OVERWRITE.format(path=path, target=target, manifest=MANIFEST)
        )
    return target


def _check_target(path: str, overwrite: bool) -> None:
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(E.STORE_EXISTS.format(path=path))
    if not _is_store_or_empty(path):
        raise FileExistsError(E.NOT_A_STORE_OVERWRITE.format(path=path, manifest=MANIFEST))


# renameat2(2): atomic "create only if absent" and "swap two entries"
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_renameat2 = getattr(_libc, "renameat2", None)
if _renameat2 is not None:
    _renameat2.restype = ctypes.c_int
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
#: errno values meaning "this kernel or file system does not support the flag"
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _rename2(src: str, dst: str, flag: int) -> bool:
    """``renameat2(src, dst, flag)``; ``False`` when the flag is unsupported here."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flag) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def _rename_noreplace(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path`` only if nothing is there (``FileExistsError`` otherwise): of
    two writers racing to create a store, exactly one wins."""
    try:
        if _rename2(tmp, path, _RENAME_NOREPLACE):
            return
        if os.path.lexists(path):  # no atomic primitive: best effort
            raise FileExistsError(E.STORE_EXISTS.format(path=path))
        os.rename(tmp, path)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(E.STORE_EXISTS.format(path=path)) from None
        raise


def _short(name: str) -> str:
    """``name`` cut for hidden temporary names, so that they fit the 255-byte name limit."""
    raw = name.encode()
    if len(raw) <= 48:
        return name
    return raw[:32].decode(errors="ignore") + "~" + hashlib.sha256(raw).hexdigest()[:10]


def _temp_prefixes(name: str) -> tuple[str, str]:
    short = _short(name)
    return f".{short}.saving-", f".{short}.old-"


def _lock_dir(path: str, blocking: bool) -> int | None:
    """An open descriptor of directory ``path`` holding an exclusive ``flock``; ``None`` when
    another process holds it (non-blocking) or the directory is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove(path: str, tmp: str) -> None:
    """Delete the directory ``tmp`` after a commit; a failure is a warning, not an error."""
    try:
        shutil.rmtree(tmp)
    except FileNotFoundError:
        pass
    except OSError as e:
        warnings.warn(
            E.CLEANUP_FAILED.format(path=path, tmp=tmp, reason=e.strerror or e),
            E.StoreCleanupWarning,
            stacklevel=4,
        )


def _remove_stale(parent: str, name: str, path: str) -> None:
    """Delete the temporary directories of killed saves to ``path`` (their writer, which held
    a lock on them, is gone). A previous version moved aside (``.old-``) is only removed while
    ``path`` holds a store, so it is never the last copy."""
    saving, old = _temp_prefixes(name)
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if not (entry.startswith((saving, old))):
            continue
        if entry.startswith(old) and not os.path.isfile(os.path.join(path, MANIFEST)):
            continue
        full = os.path.join(parent, entry)
        fd = _lock_dir(full, blocking=False)
        if fd is None:
            continue  # a live save holds it
        try:
            _remove(path, full)
        finally:
            os.close(fd)


def _new_temp(parent: str, name: str) -> tuple[int, str]:
    """A fresh hidden directory for a save, locked by this process (``(lock fd, path)``)."""
    saving, _ = _temp_prefixes(name)
    while True:
        _, tmp = create_unique(parent, saving, directory=True)
        fd = _lock_dir(tmp, blocking=True)
        if fd is not None and os.fstat(fd).st_nlink > 0:
            return fd, tmp
        if fd is not None:  # removed by a concurrent cleanup before the lock was taken
            os.close(fd)


def _commit(tmp: str, path: str, overwrite: bool) -> None:
    """Make the finished store ``tmp`` the store at ``path`` (see the module docstring).

    Once the new store is in place nothing raises: cleanup failures are warnings.
    """
    parent = os.path.dirname(path)
    if not overwrite:
        _rename_noreplace(tmp, path)
        _sync_after_commit(parent, path)
        return
    for _ in range(COMMIT_ATTEMPTS):
        if not os.path.lexists(path):
            try:
                _rename_noreplace(tmp, path)
            except FileExistsError:
                continue  # created meanwhile: check what it is
            _sync_after_commit(parent, path)
            return
        _check_target(path, overwrite=True)
        try:
            swapped = _rename2(tmp, path, _RENAME_EXCHANGE)
        except FileNotFoundError:
            continue  # removed meanwhile
        if swapped:
            # ``tmp`` now holds what was at ``path``: give it back if it was not a store
            if not _is_store_or_empty(tmp):
                _rename2(tmp, path, _RENAME_EXCHANGE)
                raise FileExistsError(E.NOT_A_STORE_OVERWRITE.format(path=path, manifest=MANIFEST))
            _sync_after_commit(parent, path)
            _remove(path, tmp)
            return
        # no atomic exchange here: move the old store aside, then the new one in
        old = os.path.join(parent, _temp_prefixes(os.path.basename(path))[1] + secrets.token_hex(6))
        try:
            os.rename(path, old)
        except FileNotFoundError:
            continue
        os.rename(tmp, path)
        _sync_after_commit(parent, path)
        _remove(path, old)
        return
    raise FileExistsError(E.STORE_EXISTS.format(path=path))


def _sync_after_commit(parent: str, path: str) -> None:
    try:
        fsync_dir(parent)
    except OSError as e:
        warnings.warn(
            E.CLEANUP_FAILED.format(path=path, tmp=parent, reason=e.strerror or e),
            E.StoreCleanupWarning,
            stacklevel=4,
        )


def _write_store(
    node: Any, path: str | os.PathLike[str], overwrite: bool, progress: bool | None, fill: bool
) -> str:
    manifest, layout = _plan(node)
    path = _resolve_link(os.path.abspath(os.fspath(path)), overwrite)
    _check_target(path, overwrite)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent, name, path)
    lock, tmp = _new_temp(parent, name)
    committed = False
    try:
        data_file = manifest["data_file"]
        fd = os.open(os.path.join(tmp, data_file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            desc = f"saving {name}" if fill else f"allocating {name}"
            with _progress(layout.total, progress, desc) as bar:
                if fill:
                    pos = 0
                    for _, t, off, n in layout.entries:
                        if off > pos:
                            write_all(fd, memoryview(bytes(off - pos)), bar)
                        write_tensor(fd, t, bar)
                        pos = off + n
                else:
                    reserve(fd, layout.total, bar)
            os.fsync(fd)
        finally:
            os.close(fd)
        text = json.dumps(manifest, indent=1).encode()
        fd = os.open(os.path.join(tmp, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            write_all(fd, memoryview(text), None)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(tmp)
        _commit(tmp, path, overwrite)
        committed = True
    except BaseException:
        if not committed:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return path


def save(
    td: Any, path: str | os.PathLike[str], *, overwrite: bool = False, progress: bool | None = None
) -> None:
    """Write a TensorDict or tensorclass to the directory ``path``, atomically.

    The directory holds ``manifest.json`` (structure, dtypes, shapes, batch sizes, devices,
    container types) and ``data.bin`` (every leaf, 64-byte aligned). A save killed midway
    leaves ``path`` with the previous complete store or nothing, never a partial store.

    Args:
        td: a TensorDict or tensorclass instance (leaves on any device; data only, no grads).
        path: the store directory to create.
        overwrite: replace an existing store at ``path`` (``FileExistsError`` otherwise).
            Only a store or an empty directory is ever replaced. When ``path`` is a symbolic
            link to a store, the store it points to is replaced and the link kept.
        progress: ``True``/``False`` forces the tqdm progress bar on/off; ``None`` shows it
            for saves of 1 GiB or more when stdout is a terminal (and tqdm is installed).

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> td = tdfunc.TensorDict(obs=torch.randn(4, 3), next={"r": torch.ones(4)},
        ...                        batch_size=[4])
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> tdfunc.save(td, path)
        >>> sorted(os.listdir(path))
        ['data.bin', 'manifest.json']
        >>> tdfunc.testing.assert_close(tdfunc.load(path), td)
    """
    _write_store(td, path, overwrite, progress, fill=True)


def memmap_like(
    td: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Any:
    """A new store at ``path`` with ``td``'s structure, dtypes and shapes, filled with zeros,
    returned loaded read-write (``mode="r+"``): preallocated storage, e.g. a replay buffer.

    The disk space is reserved up front (``posix_fallocate``), so a full disk is reported
    here rather than as a crash on a later write. ``overwrite`` and ``progress`` are as in
    :func:`save`. Without a ``path`` (tensordict's ``td.memmap_like()``) the store is made
    in a temporary folder that is removed once it is mapped: the leaves keep their mapping
    (writes work, nothing is left on disk), and there is no store to ``load`` again.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> spec = tdfunc.TensorDict(obs=torch.zeros(1000, 8), batch_size=[1000])
        >>> buf = tdfunc.memmap_like(spec, os.path.join(tempfile.mkdtemp(), "buffer"))
        >>> buf["obs"][0] = torch.ones(8)      # writes go to the file
        >>> buf["obs"].mode, buf["obs"][0].sum().item()
        ('r+', 8.0)
    """
    if is_node(td):
        for key, leaf in leaves_with_paths(td):
            if is_jagged(leaf):
                raise TypeError(E.JAGGED_LIKE.format(key=fmt_key(key)))
    if path is None:
        folder = tempfile.mkdtemp(prefix="tdfunc-memmap-like-")
        try:
            target = _write_store(td, os.path.join(folder, "store"), False, progress, fill=False)
            return load(target, mode="r+")
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the mappings outlive the files
    target = _write_store(td, path, overwrite, progress, fill=False)
    return load(target, mode="r+")


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
_BIG = 1 << 62  # no tensor of this many bytes can exist


class _Reader:
    """Validates manifest entries and builds the container over one mapping."""

    def __init__(
        self,
        manifest_path: str,
        base: torch.UntypedStorage,
        data_path: str,
        data_bytes: int,
        mode: str,
        ident: tuple[Any, ...],
    ) -> None:
        self.manifest = manifest_path
        self.base = base
        self.data = data_path
        self.data_bytes = data_bytes
        self.mode = mode
        self.ident = ident
        self.spans: list[tuple[int, int, KeyPath]] = []

    def corrupt(self, detail: str) -> E.MemmapFormatError:
        return E.MemmapFormatError(E.CORRUPT_MANIFEST.format(manifest=self.manifest, detail=detail))

    def field(self, entry: Any, name: str, typ: Any, path: KeyPath) -> Any:
        if not isinstance(entry, dict) or name not in entry:
            raise self.corrupt(f"entry {_where(path)} has no field {name!r}")
        value = entry[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise self.corrupt(f"field {name!r} of entry {_where(path)} is {_short_repr(value)}")
        return value

    def ints(self, entry: Any, name: str, path: KeyPath) -> list[int]:
        value = self.field(entry, name, list, path)
        ok = len(value) <= MAX_NDIM and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _BIG for v in value
        )
        size = 1
        for v in value if ok else ():
            size *= max(v, 1)
        if not ok or size >= _BIG:
            raise self.corrupt(f"field {name!r} of entry {_where(path)} is {_short_repr(value)}")
        return value

    def shape(self, entry: dict[str, Any], path: KeyPath, dtype: torch.dtype) -> torch.Size:
        """A leaf's shape, checked before torch sees it (:func:`tdfunc._shapes.shape_problem`:
        dims ``>= 0``, the non-zero ones holding at most ``2**62`` bytes of ``dtype``)."""
        value = self.field(entry, "shape", list, path)
        if len(value) > MAX_NDIM:
            raise self.corrupt(f"field 'shape' of entry {_where(path)} is {_short_repr(value)}")
        problem = shape_problem(value, dtype)
        if problem is not None:
            raise self.corrupt(f"leaf {_where(path)}: {problem}")
        return torch.Size(value)

    def leaf(self, entry: dict[str, Any], path: KeyPath) -> Tensor:
        name = self.field(entry, "dtype", str, path)
        dtype = DTYPES.get(name)
        if dtype is None:
            raise E.MemmapFormatError(
                E.UNKNOWN_DTYPE.format(manifest=self.manifest, dtype=name, key=_where(path))
            )
        shape = self.shape(entry, path, dtype)
        off = self.field(entry, "offset", int, path)
        n = self.field(entry, "nbytes", int, path)
        if n != nbytes_of(shape, dtype) or off < 0 or off % dtype.itemsize:
            raise self.corrupt(
                f"leaf {_where(path)}: offset {off} / nbytes {n} do not fit shape "
                f"{tuple(shape)} of dtype {name}"
            )
        if off + n > self.data_bytes:
            raise self.corrupt(
                f"leaf {_where(path)} ends at byte {off + n}, past data_bytes={self.data_bytes}"
            )
        if n:
            self.spans.append((off, n, path))
        inner = leaf_tensor(self.base, off, dtype, shape, self.mode, self.data)
        return MemoryMappedTensor._wrap(inner, self.data, self.mode, off, self.ident)

    def jagged(self, entry: dict[str, Any], path: KeyPath, bs: torch.Size) -> Tensor:
        """A jagged leaf from its stored values, offsets and lengths, checked before torch
        builds it (:func:`tdfunc._jagged._layout.jagged_problem`: one of the layouts torch builds,
        one more offset than the batch's rows). Loaded into memory (a bit-for-bit copy): a
        jagged tensor holds its values as a plain tensor, which a read-only map could not
        keep read-only."""
        values = self.leaf(self.field(entry, "values", dict, path), path)
        offsets = self.leaf(self.field(entry, "offsets", dict, path), path)
        raw = entry.get("lengths")
        lengths = None if raw is None else self.leaf(self.field(entry, "lengths", dict, path), path)
        return from_read_parts(
            values,
            offsets,
            lengths,
            bs,
            lambda problem: self.corrupt(f"jagged leaf {_where(path)}: {problem}"),
        )

    def static(self, entry: Any, path: KeyPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in self.field(entry, "static", list, path):
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise self.corrupt(
                    f"entry {_where(path)} has a bad static item {_short_repr(item)}"
                )
            if item[0] in out:
                raise self.corrupt(f"entry {_where(path)} repeats static field {item[0]!r}")
            out[item[0]] = self.static_value(item[1], path, 0)
        return out

    def static_value(self, value: Any, path: KeyPath, depth: int) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if (
            depth < MAX_DEPTH
            and isinstance(value, dict)
            and list(value) == ["tuple"]
            and isinstance(value["tuple"], list)
        ):
            return tuple(self.static_value(v, path, depth + 1) for v in value["tuple"])
        raise self.corrupt(f"entry {_where(path)} has a bad static value {_short_repr(value)}")

    def node(self, entry: Any, path: KeyPath) -> Any:
        if len(path) > MAX_DEPTH:
            raise self.corrupt(f"nesting deeper than {MAX_DEPTH} levels at {_where(path[:8])}...")
        name = self.field(entry, "type", str, path)
        cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
        if cls is None and name.rpartition(".")[0] in OWN_MODULES:
            # a container type of tdfunc's own (a replay buffer's state): its module is
            # imported here, as `import tdfunc` does not import it; only the modules named in
            # OWN_MODULES, never one a file names
            importlib.import_module(name.rpartition(".")[0])
            cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
        if not (isinstance(cls, type) and issubclass(cls, Node)):
            raise E.MemmapFormatError(
                E.UNKNOWN_TYPE.format(manifest=self.manifest, name=name, where=_where(path))
            )
        bs = torch.Size(self.ints(entry, "batch_size", path))
        dev = entry.get("device")
        if dev is not None and not isinstance(dev, str):
            raise self.corrupt(f"field 'device' of entry {_where(path)} is {_short_repr(dev)}")
        static = self.static(entry, path)
        kids: dict[str, Any] = {}
        for k, sub in self.field(entry, "children", dict, path).items():
            sub_path = (*path, k)
            kind = self.field(sub, "kind", str, sub_path)
            kid: Any
            if kind == "none":
                kid = None
            elif kind == "tensor":
                kid = self.leaf(sub, sub_path)
                if kid.shape[: len(bs)] != bs:
                    raise self.corrupt(
                        f"leaf {_where(sub_path)} does not start with batch {list(bs)}"
                    )
            elif kind == "jagged":
                kid = self.jagged(sub, sub_path, bs)
            elif kind == "nontensor":
                try:  # checked JSON: nothing is unpickled or imported
                    kid = nontensor.from_json(
                        {"shape": sub.get("shape"), "value": sub.get("value")}
                    )
                except ValueError as e:
                    raise self.corrupt(f"entry {_where(sub_path)}: {e}") from None
            elif kind == "node":
                kid = self.node(sub, sub_path)
                if kid._batch_size[: len(bs)] != bs:
                    raise self.corrupt(
                        f"node {_where(sub_path)} does not start with batch {list(bs)}"
                    )
            else:
                raise self.corrupt(f"entry {_where(sub_path)} has unknown kind {kind!r}")
            kids[k] = kid
        # leaves live on the host: a store saved from an accelerator loads onto the CPU
        device = None if dev is None else "cpu"
        return self.build(cls, name, kids, static, bs, device, path)

    def build(
        self,
        cls: type,
        name: str,
        kids: dict[str, Any],
        static: dict[str, Any],
        bs: torch.Size,
        device: str | None,
        path: KeyPath,
    ) -> Any:
        """The node, built by name: a TensorDict through its validating constructor, a
        tensorclass with :func:`tdfunc._tensorclass.restore` (every field checked like the
        constructor checks it; ``__post_init__`` is not run again, so the loaded values are
        the saved ones)."""
        tc = is_tensorclass(cls)
        if tc:  # children and static fields must match the class's fields by name
            tc_cls: Any = cls  # a tensorclass type: its field tables are class attributes
            statics = tc_cls._tdf_static_names
            tensors = tuple(f for f in tc_cls._tdf_fields if f not in statics)
            for what, got, want in (("fields", kids, tensors), ("static fields", static, statics)):
                if set(got) != set(want):
                    raise self.corrupt(
                        f"{what} of {name} at {_where(path)} are {sorted(got)}, but the class "
                        f"has {sorted(want)}"
                    )
        else:
            if static:
                raise self.corrupt(f"node {_where(path)} of type {name} has static fields")
            if any(v is None for v in kids.values()):
                raise self.corrupt(f"node {_where(path)} of type {name} has a 'none' child")
        try:
            if tc:  # the saved values, checked; __post_init__ does not run again
                return restore(cls, {**kids, **static}, bs, device)
            return cls(kids, batch_size=bs, device=device)
        except (TypeError, ValueError, KeyError) as e:
            raise self.corrupt(f"node {_where(path)} does not fit {name}: {e}") from None

    def check_overlaps(self) -> None:
        end = 0
        prev: KeyPath = ()
        for off, n, path in sorted(self.spans, key=lambda s: s[0]):
            if off < end:
                raise self.corrupt(f"leaves {_where(prev)} and {_where(path)} overlap")
            end, prev = off + n, path


def _where(path: KeyPath) -> str:
    return "<root>" if not path else fmt_key(path)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _corrupt(manifest_path: str, detail: str) -> E.MemmapFormatError:
    return E.MemmapFormatError(E.CORRUPT_MANIFEST.format(manifest=manifest_path, detail=detail))


def _parse_manifest(raw: bytes, manifest_path: str) -> dict[str, Any]:
    try:
        manifest = loads_unique(raw, E.DUPLICATE_KEY)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(manifest_path, f"not valid JSON ({e})") from None
    except ValueError as e:  # a key given twice
        raise _corrupt(manifest_path, str(e)) from None
    except RecursionError:
        raise _corrupt(manifest_path, "nested too deeply") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _corrupt(manifest_path, f"'format' is not {FORMAT!r}")
    version = manifest.get("version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise E.MemmapFormatError(
            E.UNKNOWN_VERSION.format(
                manifest=manifest_path, version=version, supported=list(SUPPORTED_VERSIONS)
            )
        )
    return manifest


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


class _Replaced(Exception):
    """Internal: the directory being opened is no longer the store at the path; reopen."""


def _replaced(dfd: int, path: str) -> bool:
    """Whether the directory open as ``dfd`` is no longer the one at ``path``."""
    a = os.fstat(dfd)
    try:
        b = os.stat(path)
    except OSError:
        return True
    return (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or a.st_nlink == 0


def _open_member(
    dfd: int, path: str, name: str, mode: str, manifest_path: str, missing: str
) -> tuple[int, os.stat_result]:
    """Open the file ``name`` of the store directory ``dfd``: no symbolic links, regular files
    only (``MemmapFormatError``); ``_Replaced`` when it is missing because the store was
    replaced meanwhile, ``FileNotFoundError`` (message ``missing``) otherwise."""
    full = os.path.join(path, name)
    try:
        fd = open_fd(name, mode, dir_fd=dfd, follow=False)
    except FileNotFoundError:
        if _replaced(dfd, path):
            raise _Replaced from None
        raise FileNotFoundError(missing) from None
    except PermissionError as e:
        raise _permission_error(e.errno, str(e).replace(repr(name), repr(full), 1)) from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise E.MemmapFormatError(
                E.MEMBER_LINK.format(manifest=manifest_path, name=name)
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise E.MemmapFormatError(E.MEMBER_LINK.format(manifest=manifest_path, name=name))
    return fd, st


def _open_version(path: str, mode: str) -> Any:
    """One attempt at opening the store at ``path``: the manifest and the data file are both
    opened relative to one open descriptor of the store directory, so they belong to the same
    committed version even when another process replaces the store meanwhile."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(E.NOT_FOUND.format(path=path)) from None
    except PermissionError as e:
        raise _permission_error(
            e.errno, E.NO_STORE_ACCESS.format(path=path, reason=e.strerror)
        ) from None
    try:
        try:
            mfd, _ = _open_member(
                dfd,
                path,
                MANIFEST,
                "r",
                manifest_path,
                E.NO_MANIFEST.format(path=path, manifest=MANIFEST),
            )
        except PermissionError as e:
            if e.errno == errno.EACCES and not os.access(path, os.X_OK):
                raise _permission_error(
                    e.errno, E.NO_STORE_ACCESS.format(path=path, reason=e.strerror)
                ) from None
            raise
        try:
            manifest = _parse_manifest(_read_all(mfd), manifest_path)
        finally:
            os.close(mfd)
        data_file = manifest.get("data_file")
        data_bytes = manifest.get("data_bytes")
        if (
            not isinstance(data_file, str)
            or not data_file
            or os.path.basename(data_file) != data_file
            or data_file in (".", "..", MANIFEST)
            or "\0" in data_file
        ):
            raise _corrupt(manifest_path, f"bad data_file {_short_repr(data_file)}")
        if (
            not isinstance(data_bytes, int)
            or isinstance(data_bytes, bool)
            or not 0 <= data_bytes < _BIG
        ):
            raise _corrupt(manifest_path, f"bad data_bytes {_short_repr(data_bytes)}")
        data_path = os.path.join(path, data_file)
        fd, st = _open_member(
            dfd,
            path,
            data_file,
            mode,
            manifest_path,
            E.DATA_MISSING.format(filename=data_path, manifest=manifest_path),
        )
        try:
            if st.st_size < data_bytes:
                raise E.MemmapFormatError(
                    E.DATA_TOO_SHORT.format(
                        filename=data_path, size=st.st_size, need=data_bytes, manifest=manifest_path
                    )
                )
            base = map_fd(fd, data_path, mode, data_bytes)
        finally:
            os.close(fd)
        ident = (st.st_dev, st.st_ino, manifest.get("store_id"))
        return manifest_path, manifest, base, data_path, data_bytes, ident
    finally:
        os.close(dfd)


def load(path: str | os.PathLike[str], *, mode: str = "r") -> Any:
    """Map a store written by :func:`save` / :func:`memmap_like`; nothing is read until used.

    Loading costs O(number of leaves): the manifest is parsed, every offset and size is
    checked against the data file's size (no data is read) and the file is mapped once.
    The result is one complete committed version of the store, even while another process
    replaces it with ``save(..., overwrite=True)``.

    Args:
        path: the store directory.
        mode: ``"r"`` read-only (the default; any write raises ``PermissionError``, the file
            cannot change), ``"r+"`` read-write (``PermissionError`` here if the data file is
            not writable), ``"c"`` copy-on-write (writable in memory, the file is untouched).

    Returns:
        The saved TensorDict / tensorclass with :class:`MemoryMappedTensor` leaves on the CPU.
        A tensorclass gets back exactly the field values that were saved: each is checked
        like the constructor checks it, but ``__init__`` and ``__post_init__`` do not run
        again (a ``__post_init__`` that changes values already did when the saved instance
        was made).

        Resuming a compiled training step: Dynamo guards on the leaf type, so a step first
        called with these memory-mapped leaves and then with the plain tensors it returned
        compiles twice. Pass ``load(path).clone()`` (plain tensors, read once) to the first
        step to compile once.

    Raises:
        FileNotFoundError: no store (or no data file) at ``path``.
        MemmapFormatError: corrupt manifest, unknown format version, data file shorter than
            the manifest says, unknown dtype or unregistered tensorclass name, a manifest that
            does not fit its container class, a store file that is a symbolic link.
        PermissionError: a store this process may not read, or ``mode="r+"`` on a data file
            it may not write.
        StoreReplacedError: the store kept being replaced while it was being opened.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> tdfunc.save(tdfunc.TensorDict(x=torch.arange(3.0), batch_size=[3]), path)
        >>> td = tdfunc.load(path)
        >>> td["x"].tolist(), td["x"].mode
        ([0.0, 1.0, 2.0], 'r')
    """
    check_mode(mode)
    path = os.path.abspath(os.fspath(path))
    for attempt in range(OPEN_ATTEMPTS):
        try:
            manifest_path, manifest, base, data_path, data_bytes, ident = _open_version(path, mode)
            break
        except _Replaced:
            time.sleep(0.001 * attempt)
    else:
        raise E.StoreReplacedError(E.STORE_BUSY.format(path=path, attempts=OPEN_ATTEMPTS))
    reader = _Reader(manifest_path, base, data_path, data_bytes, mode, ident)
    root = manifest.get("root")
    if reader.field({"root": root}, "root", dict, ()).get("kind") != "node":
        raise reader.corrupt("the root entry is not a node")
    out = reader.node(root, ())
    reader.check_overlaps()
    return out
