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

import importlib.util
import json
import os
import secrets
import shutil
import sys
from contextlib import nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from . import _errors as E
from ._tensor import (
    DTYPES,
    MemoryMappedTensor,
    check_leaf,
    check_mode,
    create_unique,
    dtype_name,
    fsync_dir,
    leaf_tensor,
    map_file,
    nbytes_of,
    reserve,
    write_all,
    write_tensor,
)
from .._tree import KeyPath, Node, fmt_key, is_node

FORMAT = "tdfunc.memmap"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
DATA = "data.bin"
ALIGN = 64
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


def _static_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(_static_from_json(v) for v in value["tuple"])
    return value


def _describe(node: Node, prefix: KeyPath, layout: _Layout) -> dict[str, Any]:
    children: dict[str, Any] = {}
    for k, v in zip(node._tdf_keys(), node._tdf_children()):
        path = prefix + (k,)
        if v is None:
            children[k] = {"kind": "none"}
        elif isinstance(v, Tensor):
            children[k] = layout.add(path, v)
        elif is_node(v):
            children[k] = _describe(v, path, layout)
        else:
            raise TypeError(f"key {fmt_key(path)}: cannot save a child of type {type(v).__name__}")
    static = getattr(node, "_tdf_static", tuple)()
    return {
        "kind": "node",
        "type": _type_name(node),
        "batch_size": list(node._batch_size),
        "device": None if node._device is None else str(node._device),
        "static": [[k, _static_to_json(node, k, v)] for k, v in static],
        "children": children,
    }


def _plan(node: Any) -> tuple[dict[str, Any], _Layout]:
    if not is_node(node):
        raise TypeError(E.NOT_A_CONTAINER.format(typ=type(node).__name__))
    layout = _Layout()
    root = _describe(node, (), layout)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
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


def _check_target(path: str, overwrite: bool) -> None:
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(E.STORE_EXISTS.format(path=path))
    if not _is_store_or_empty(path):
        raise FileExistsError(E.NOT_A_STORE_OVERWRITE.format(path=path, manifest=MANIFEST))


def _commit(tmp: str, path: str, overwrite: bool) -> None:
    """Move the finished store ``tmp`` onto ``path`` (see the module docstring)."""
    parent, name = os.path.split(path)
    _check_target(path, overwrite)
    if os.path.lexists(path):
        old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)
        fsync_dir(parent)


def _write_store(
    node: Any, path: str | os.PathLike[str], overwrite: bool, progress: bool | None, fill: bool
) -> str:
    manifest, layout = _plan(node)
    path = os.path.abspath(os.fspath(path))
    _check_target(path, overwrite)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    _, tmp = create_unique(parent, f".{name}.saving-", directory=True)
    try:
        fd = os.open(os.path.join(tmp, DATA), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
            Only a store or an empty directory is ever replaced.
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
    td: Any, path: str | os.PathLike[str], *, overwrite: bool = False, progress: bool | None = None
) -> Any:
    """A new store at ``path`` with ``td``'s structure, dtypes and shapes, filled with zeros,
    returned loaded read-write (``mode="r+"``): preallocated storage, e.g. a replay buffer.

    The disk space is reserved up front (``posix_fallocate``), so a full disk is reported
    here rather than as a crash on a later write. ``overwrite`` and ``progress`` are as in
    :func:`save`.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> spec = tdfunc.TensorDict(obs=torch.zeros(1000, 8), batch_size=[1000])
        >>> buf = tdfunc.memmap_like(spec, os.path.join(tempfile.mkdtemp(), "buffer"))
        >>> buf["obs"][0] = torch.ones(8)      # writes go to the file
        >>> buf["obs"].mode, buf["obs"][0].sum().item()
        ('r+', 8.0)
    """
    target = _write_store(td, path, overwrite, progress, fill=False)
    return load(target, mode="r+")


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
class _Reader:
    """Validates manifest entries and builds the container over one mapping."""

    def __init__(
        self,
        manifest_path: str,
        base: torch.UntypedStorage,
        data_path: str,
        data_bytes: int,
        mode: str,
    ) -> None:
        self.manifest = manifest_path
        self.base = base
        self.data = data_path
        self.data_bytes = data_bytes
        self.mode = mode
        self.spans: list[tuple[int, int, KeyPath]] = []

    def corrupt(self, detail: str) -> E.MemmapFormatError:
        return E.MemmapFormatError(E.CORRUPT_MANIFEST.format(manifest=self.manifest, detail=detail))

    def field(self, entry: Any, name: str, typ: Any, path: KeyPath) -> Any:
        if not isinstance(entry, dict) or name not in entry:
            raise self.corrupt(f"entry {_where(path)} has no field {name!r}")
        value = entry[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise self.corrupt(f"field {name!r} of entry {_where(path)} is {value!r}")
        return value

    def ints(self, entry: Any, name: str, path: KeyPath) -> list[int]:
        value = self.field(entry, name, list, path)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise self.corrupt(f"field {name!r} of entry {_where(path)} is {value!r}")
        return value

    def leaf(self, entry: dict[str, Any], path: KeyPath) -> Tensor:
        name = self.field(entry, "dtype", str, path)
        dtype = DTYPES.get(name)
        if dtype is None:
            raise E.MemmapFormatError(
                E.UNKNOWN_DTYPE.format(manifest=self.manifest, dtype=name, key=_where(path))
            )
        shape = torch.Size(self.ints(entry, "shape", path))
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
        inner = leaf_tensor(self.base, off, dtype, shape)
        return MemoryMappedTensor._wrap(inner, self.data, self.mode, off)

    def node(self, entry: Any, path: KeyPath) -> Any:
        name = self.field(entry, "type", str, path)
        cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
        if not (isinstance(cls, type) and issubclass(cls, Node)):
            raise E.MemmapFormatError(
                E.UNKNOWN_TYPE.format(manifest=self.manifest, name=name, where=_where(path))
            )
        bs = torch.Size(self.ints(entry, "batch_size", path))
        dev = entry.get("device")
        if dev is not None and not isinstance(dev, str):
            raise self.corrupt(f"field 'device' of entry {_where(path)} is {dev!r}")
        static = tuple(
            (str(k), _static_from_json(v)) for k, v in self.field(entry, "static", list, path)
        )
        keys: list[str] = []
        kids: list[Any] = []
        ndims: list[int] = []
        for k, sub in self.field(entry, "children", dict, path).items():
            sub_path = path + (k,)
            kind = self.field(sub, "kind", str, sub_path)
            if kind == "none":
                kid, nd = None, -1
            elif kind == "tensor":
                kid = self.leaf(sub, sub_path)
                nd = kid.ndim
                if kid.shape[: len(bs)] != bs:
                    raise self.corrupt(
                        f"leaf {_where(sub_path)} does not start with batch {list(bs)}"
                    )
            elif kind == "node":
                kid = self.node(sub, sub_path)
                nd = len(kid._batch_size)
                if kid._batch_size[: len(bs)] != bs:
                    raise self.corrupt(
                        f"node {_where(sub_path)} does not start with batch {list(bs)}"
                    )
            else:
                raise self.corrupt(f"entry {_where(sub_path)} has unknown kind {kind!r}")
            keys.append(k)
            kids.append(kid)
            ndims.append(nd)
        # leaves live on the host: a store saved from an accelerator loads onto the CPU
        device = None if dev is None else "cpu"
        empty = None if any(nd >= 0 for nd in ndims) else tuple(bs)
        ctx = (tuple(keys), len(bs), tuple(ndims), device, empty, static)
        return pytree.SUPPORTED_NODES[cls].unflatten_fn([c for c in kids if c is not None], ctx)

    def check_overlaps(self) -> None:
        end, prev = 0, ()
        for off, n, path in sorted(self.spans, key=lambda s: s[0]):
            if off < end:
                raise self.corrupt(f"leaves {_where(prev)} and {_where(path)} overlap")
            end, prev = off + n, path


def _where(path: KeyPath) -> str:
    return "<root>" if not path else fmt_key(path)


def _read_manifest(path: str) -> tuple[str, dict[str, Any]]:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(path):
        raise FileNotFoundError(E.NOT_FOUND.format(path=path))
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(E.NO_MANIFEST.format(path=path, manifest=MANIFEST))
    with open(manifest_path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise E.MemmapFormatError(
            E.CORRUPT_MANIFEST.format(manifest=manifest_path, detail=f"not valid JSON ({e})")
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise E.MemmapFormatError(
            E.CORRUPT_MANIFEST.format(manifest=manifest_path, detail=f"'format' is not {FORMAT!r}")
        )
    version = manifest.get("version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise E.MemmapFormatError(
            E.UNKNOWN_VERSION.format(
                manifest=manifest_path, version=version, supported=list(SUPPORTED_VERSIONS)
            )
        )
    return manifest_path, manifest


def load(path: str | os.PathLike[str], *, mode: str = "r") -> Any:
    """Map a store written by :func:`save` / :func:`memmap_like`; nothing is read until used.

    Loading costs O(number of leaves): the manifest is parsed, every offset and size is
    checked against the data file's size (no data is read) and the file is mapped once.

    Args:
        path: the store directory.
        mode: ``"r"`` read-only (the default; any write raises ``PermissionError``, the file
            cannot change), ``"r+"`` read-write (``PermissionError`` here if the data file is
            not writable), ``"c"`` copy-on-write (writable in memory, the file is untouched).

    Returns:
        The saved TensorDict / tensorclass with :class:`MemoryMappedTensor` leaves on the CPU.

    Raises:
        FileNotFoundError: no store (or no data file) at ``path``.
        MemmapFormatError: corrupt manifest, unknown format version, data file shorter than
            the manifest says, unknown dtype or unregistered tensorclass name.
        PermissionError: ``mode="r+"`` on a file this process cannot write.

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
    manifest_path, manifest = _read_manifest(path)
    data_file = manifest.get("data_file")
    data_bytes = manifest.get("data_bytes")
    if (
        not isinstance(data_file, str)
        or not data_file
        or os.path.basename(data_file) != data_file
        or data_file in (".", "..")
    ):
        raise E.MemmapFormatError(
            E.CORRUPT_MANIFEST.format(manifest=manifest_path, detail=f"bad data_file {data_file!r}")
        )
    if not isinstance(data_bytes, int) or isinstance(data_bytes, bool) or data_bytes < 0:
        raise E.MemmapFormatError(
            E.CORRUPT_MANIFEST.format(
                manifest=manifest_path, detail=f"bad data_bytes {data_bytes!r}"
            )
        )
    data_path = os.path.join(path, data_file)
    if not os.path.isfile(data_path):
        raise FileNotFoundError(E.DATA_MISSING.format(filename=data_path, manifest=manifest_path))
    size = os.stat(data_path).st_size
    if size < data_bytes:
        raise E.MemmapFormatError(
            E.DATA_TOO_SHORT.format(
                filename=data_path, size=size, need=data_bytes, manifest=manifest_path
            )
        )
    base = map_file(data_path, mode, data_bytes)
    reader = _Reader(manifest_path, base, data_path, data_bytes, mode)
    root = manifest.get("root")
    if reader.field({"root": root}, "root", dict, ()).get("kind") != "node":
        raise reader.corrupt("the root entry is not a node")
    out = reader.node(root, ())
    reader.check_overlaps()
    return out
