"""safetensors files: save a container as one, load any one as a container (zero-copy).

The safetensors format is an 8-byte little-endian header length, a JSON header that maps each
tensor name to ``{"dtype", "shape", "data_offsets"}`` (plus an optional ``"__metadata__"``
mapping of strings to strings), then the raw bytes of every tensor, with no holes.

How tdfunc uses it
    * Leaves are stored under their key paths joined by ``"."``: for ``tdfunc.from_module(m)``
      those are exactly ``m.state_dict()``'s names, so ``m.load_state_dict(
      safetensors.torch.load_file(path))`` reads a file tdfunc wrote.
    * What the flat names cannot say (batch sizes, node types, tensorclass static fields,
      ``None`` fields, key order, keys that contain ``"."``, tied leaves) goes into the
      metadata entry ``"tdfunc"`` as JSON, with a format version. No pickle: node types are
      named by their pytree ``serialized_type_name`` and must already be defined in the
      process that loads the file. A file without that entry (written by any other tool)
      loads as nested TensorDicts with ``batch_size=()``.
    * Tensors are written largest item size first, so every offset is a multiple of its
      dtype's size once the header is padded to 8 bytes (as ``safetensors`` itself does).
    * The writer needs no third-party package; the reader maps the file once
      (``mmap``, through :mod:`tdfunc.memmap`) and returns
      :class:`~tdfunc.MemoryMappedTensor` leaves: loading reads only the header, and a
      ``mode="r"`` leaf refuses writes with ``PermissionError`` like a store's leaves.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .._keys import fmt_key
from .._tree import KeyPath, Node, is_node
from ..memmap._tensor import (
    MemoryMappedTensor,
    check_mode,
    create_unique,
    fsync_dir,
    leaf_tensor,
    map_fd,
    nbytes_of,
    open_fd,
    write_all,
    write_tensor,
)
from ..tensordict import TensorDict
from . import _errors as E
from ._errors import SafetensorsFormatError

#: version of the structure written under :data:`META_KEY` (a reader refuses newer ones)
FORMAT_VERSION = 1
#: the metadata entry holding tdfunc's structure (JSON)
META_KEY = "tdfunc"
#: the largest header tdfunc reads (the ``safetensors`` library's own limit)
MAX_HEADER = 100_000_000

#: safetensors dtype names <-> torch dtypes (those both sides know)
ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "F32": torch.float32,
    "C64": torch.complex64,
    "F64": torch.float64,
    "I64": torch.int64,
    "U64": torch.uint64,
}
for _st, _torch in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
):
    if hasattr(torch, _torch):
        ST_DTYPES[_st] = getattr(torch, _torch)
ST_NAMES: dict[torch.dtype, str] = {d: n for n, d in ST_DTYPES.items()}


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------
def _static_json(value: Any) -> Any:
    """A static field value as JSON (tuples as ``{"tuple": [...]}``), or raise ``TypeError``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_static_json(v) for v in value]}
    raise TypeError(type(value).__name__)


def _type_name(node: Node) -> str:
    info = pytree.SUPPORTED_SERIALIZED_TYPES.get(type(node))
    return str(getattr(info, "serialized_type_name", type(node).__qualname__))


class _Plan:
    """The leaves to write (name, tensor) in key order, and the structure description."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.leaves: list[tuple[str, Tensor]] = []
        self.origin: dict[str, KeyPath] = {}
        self.ties: dict[tuple[Any, ...], str] = {}

    def leaf(self, path: KeyPath, t: Tensor) -> dict[str, Any]:
        key = fmt_key(path)
        if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
            what = "nested" if t.is_nested else "meta" if t.device.type == "meta" else t.layout
            raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, filename=self.filename, what=what))
        if t.dtype not in ST_NAMES:
            raise TypeError(
                E.UNSUPPORTED_DTYPE.format(
                    key=key,
                    filename=self.filename,
                    dtype=t.dtype,
                    supported=sorted(str(d).removeprefix("torch.") for d in ST_NAMES),
                )
            )
        name = ".".join(path)
        if name in self.origin:
            raise ValueError(
                E.KEY_COLLISION.format(
                    filename=self.filename, a=fmt_key(self.origin[name]), b=key, name=name
                )
            )
        self.origin[name] = path
        self.leaves.append((name, t))
        entry: dict[str, Any] = {"leaf": name}
        if t.numel():
            inner = t._inner if isinstance(t, MemoryMappedTensor) else t
            ident = (
                inner.device,
                inner.untyped_storage().data_ptr(),
                inner.storage_offset(),
                tuple(inner.shape),
                inner.stride(),
                inner.dtype,
            )
            first = self.ties.setdefault(ident, name)
            if first != name:
                entry["tie"] = first
        return entry

    def node(self, node: Node, prefix: KeyPath) -> dict[str, Any]:
        children: list[list[Any]] = []
        for k, v in zip(node._tdf_keys(), node._tdf_children()):
            path = (*prefix, k)
            if v is None:
                children.append([k, {"none": True}])
            elif isinstance(v, Tensor):
                children.append([k, self.leaf(path, v)])
            elif is_node(v):
                children.append([k, self.node(v, path)])
            else:
                raise TypeError(
                    E.NOT_SAVABLE_CHILD.format(
                        key=fmt_key(path), filename=self.filename, typ=type(v).__name__
                    )
                )
        static = []
        for name, value in node._tdf_static():
            try:
                static.append([name, _static_json(value)])
            except TypeError as err:
                raise TypeError(
                    E.STATIC_NOT_JSON.format(
                        name=name,
                        cls=type(node).__name__,
                        key=fmt_key(prefix) if prefix else "<root>",
                        filename=self.filename,
                        vtyp=err.args[0],
                    )
                ) from None
        dev = node._device
        return {
            "type": _type_name(node),
            "batch_size": [int(s) for s in node._batch_size],
            "device": None if dev is None else str(dev),
            "static": static,
            "children": children,
        }


def _header(plan: _Plan, structure: dict[str, Any], metadata: Mapping[str, str] | None) -> bytes:
    meta: dict[str, str] = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                E.BAD_METADATA.format(key=k, typ=type(v if isinstance(k, str) else k).__name__)
            )
        if k == META_KEY:
            raise ValueError(E.RESERVED_METADATA.format(key=k))
        meta[k] = v
    meta[META_KEY] = json.dumps(
        {"version": FORMAT_VERSION, "root": structure}, separators=(",", ":")
    )
    # largest item size first: every offset is a multiple of its dtype's size
    order = sorted(range(len(plan.leaves)), key=lambda i: -plan.leaves[i][1].dtype.itemsize)
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for i in order:
        name, t = plan.leaves[i]
        n = nbytes_of(t.shape, t.dtype)
        offsets[name] = (pos, pos + n)
        pos += n
    header: dict[str, Any] = {"__metadata__": meta}
    for name, t in plan.leaves:
        header[name] = {
            "dtype": ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": list(offsets[name]),
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # the data starts 8-byte aligned
    plan.leaves = [plan.leaves[i] for i in order]
    return struct.pack("<Q", len(raw)) + raw


def save_safetensors(
    td: Any,
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Save a TensorDict or tensorclass as one safetensors file.

    Leaves are stored under their key paths joined by ``"."`` (for ``tdfunc.from_module(m)``
    exactly the names of ``m.state_dict()``), so any safetensors reader gets a flat dict of
    tensors; the structure tdfunc needs to rebuild the container (batch sizes, tensorclass
    types and static fields, ``None`` fields, key order, tied leaves) is JSON in the
    metadata entry ``"tdfunc"``. ``metadata`` adds entries of your own (``"format": "pt"`` is
    set unless given, as ``transformers`` expects). Tied leaves (one tensor under two keys)
    are written under both names.

    The file is written aside and renamed into place: a reader sees the old file or the whole
    new one, never a partial file. An existing file is replaced only with ``overwrite=True``.

    Args:
        td: the container to save (leaves on any device; they are copied to the host).
        path: the file to write.
        metadata: extra ``str -> str`` entries for the safetensors metadata.
        overwrite: replace ``path`` if it exists (``FileExistsError`` otherwise).

    Raises:
        ValueError: two key paths give the same name (``"a.b"`` next to ``("a", "b")``).
        TypeError: a dtype safetensors cannot store (e.g. ``complex128``), a static field that
            is not JSON data, metadata that is not ``str -> str``.
        FileExistsError: ``path`` exists and ``overwrite`` is false.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> f = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), n={"b": torch.zeros(2)}, batch_size=[2])
        >>> tdfunc.save_safetensors(td, f)
        >>> back = tdfunc.load_safetensors(f)
        >>> back["n", "b"].shape, back.batch_size
        (torch.Size([2]), torch.Size([2]))
    """
    filename = os.path.abspath(os.fspath(path))
    if not is_node(td):
        raise TypeError(E.NOT_A_CONTAINER.format(typ=type(td).__name__))
    plan = _Plan(filename)
    structure = plan.node(td, ())
    head = _header(plan, structure, metadata)
    if not overwrite and os.path.lexists(filename):
        raise FileExistsError(E.FILE_EXISTS.format(filename=filename))
    parent = os.path.dirname(filename)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = create_unique(parent, f".{os.path.basename(filename)}.", directory=False)
    try:
        write_all(fd, memoryview(head), None)
        for _, t in plan.leaves:
            write_tensor(fd, t, None)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        _commit(tmp, filename, overwrite)
        fsync_dir(parent)
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _commit(tmp: str, filename: str, overwrite: bool) -> None:
    """Move the written file into place; without ``overwrite``, never replace a file."""
    if overwrite:
        os.replace(tmp, filename)
        return
    try:
        os.link(tmp, filename)  # fails if the name exists: no window for a second writer
    except FileExistsError:
        raise FileExistsError(E.FILE_EXISTS.format(filename=filename)) from None
    except OSError:  # a file system without hard links
        if os.path.lexists(filename):
            raise FileExistsError(E.FILE_EXISTS.format(filename=filename)) from None
        os.replace(tmp, filename)


# --------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------
class _Reader:
    """Checks the header of one file and builds leaves over one mapping of it."""

    def __init__(self, filename: str, mode: str) -> None:
        self.filename = filename
        self.mode = mode

    def corrupt(self, detail: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(
            E.CORRUPT_HEADER.format(filename=self.filename, detail=detail)
        )

    def truncated(self, detail: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(E.TRUNCATED.format(filename=self.filename, detail=detail))

    def read_header(self, fd: int, size: int) -> dict[str, Any]:
        if size < 8:
            raise self.truncated(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > MAX_HEADER:
            raise self.corrupt(f"header length {n} is larger than {MAX_HEADER} bytes")
        if 8 + n > size:
            raise self.truncated(f"the header needs {8 + n} bytes, the file has {size}")
        raw = b""
        while len(raw) < n:
            chunk = os.pread(fd, n - len(raw), 8 + len(raw))
            if not chunk:
                raise self.truncated(f"the header needs {8 + n} bytes")
            raw += chunk
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.corrupt(f"the header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise self.corrupt("the header is not a JSON object")
        self.data_start = 8 + n
        return header

    def entries(self, header: dict[str, Any], size: int) -> dict[str, tuple[torch.dtype, Any, int]]:
        """name -> (dtype, shape, absolute offset), every entry checked against the file size."""
        out: dict[str, tuple[torch.dtype, Any, int]] = {}
        spans: list[tuple[int, int, str]] = []
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(e, dict):
                raise self.corrupt(f"entry {name!r} is not an object")
            dname = e.get("dtype")
            shape = e.get("shape")
            offs = e.get("data_offsets")
            dtype = ST_DTYPES.get(dname) if isinstance(dname, str) else None
            if dtype is None:
                if isinstance(dname, str):
                    raise TypeError(
                        E.UNKNOWN_DTYPE.format(
                            key=name,
                            filename=self.filename,
                            dtype=dname,
                            supported=sorted(ST_DTYPES),
                        )
                    )
                raise self.corrupt(f"entry {name!r} has no dtype")
            if not (
                isinstance(shape, list)
                and len(shape) <= 64
                and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            ):
                raise self.corrupt(f"entry {name!r} has a bad shape {shape!r}")
            if not (
                isinstance(offs, list)
                and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
            ):
                raise self.corrupt(f"entry {name!r} has bad data_offsets {offs!r}")
            begin, end = offs
            n = nbytes_of(shape, dtype)
            if end - begin != n:
                raise self.corrupt(
                    f"entry {name!r}: data_offsets {offs} hold {end - begin} bytes, but shape "
                    f"{shape} of {dname} needs {n}"
                )
            if self.data_start + end > size:
                raise self.truncated(
                    f"tensor {name!r} ends at byte {self.data_start + end}, the file has {size}"
                )
            if n:
                spans.append((begin, end, name))
            out[name] = (dtype, shape, self.data_start + begin)
        last_end, last = 0, ""
        for begin, end, name in sorted(spans):
            if begin < last_end:
                raise self.corrupt(f"tensors {last!r} and {name!r} overlap")
            last_end, last = end, name
        return out

    def leaves(
        self, fd: int, size: int, entries: dict[str, tuple[torch.dtype, Any, int]]
    ) -> dict[str, Tensor]:
        st = os.fstat(fd)
        base = map_fd(fd, self.filename, self.mode, size)
        ident = (st.st_dev, st.st_ino)
        out: dict[str, Tensor] = {}
        for name, (dtype, shape, off) in entries.items():
            inner = leaf_tensor(base, off, dtype, torch.Size(shape), self.mode, self.filename)
            out[name] = MemoryMappedTensor._wrap(inner, self.filename, self.mode, off, ident)
        return out


def _read_metadata(header: dict[str, Any], reader: _Reader) -> dict[str, str]:
    meta = header.get("__metadata__", {})
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise reader.corrupt("__metadata__ is not a mapping of strings to strings")
    return meta


class _Builder:
    """Rebuilds the container described by tdfunc's structure entry."""

    def __init__(self, filename: str, leaves: dict[str, Tensor]) -> None:
        self.filename = filename
        self.leaves = leaves
        self.used: set[str] = set()

    def bad(self, detail: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(
            E.CORRUPT_STRUCTURE.format(filename=self.filename, detail=detail)
        )

    def static_value(self, v: Any, depth: int = 0) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if (
            depth < 64
            and isinstance(v, dict)
            and list(v) == ["tuple"]
            and isinstance(v["tuple"], list)
        ):
            return tuple(self.static_value(x, depth + 1) for x in v["tuple"])
        raise self.bad(f"bad static value {v!r}"[:200])

    def node(self, d: Any, path: KeyPath) -> Any:
        where = fmt_key(path) if path else "<root>"
        if len(path) > 256 or not isinstance(d, dict):
            raise self.bad(f"node {where} is not an object")
        name = d.get("type")
        cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name) if isinstance(name, str) else None
        if not (isinstance(cls, type) and issubclass(cls, Node)):
            raise TypeError(E.UNKNOWN_TYPE.format(filename=self.filename, where=where, name=name))
        bs = d.get("batch_size")
        children = d.get("children")
        static = d.get("static", [])
        if not (isinstance(bs, list) and all(isinstance(s, int) and s >= 0 for s in bs)):
            raise self.bad(f"node {where} has a bad batch_size {bs!r}")
        if not isinstance(children, list) or not isinstance(static, list):
            raise self.bad(f"node {where} has no children/static lists")
        kids: dict[str, Any] = {}
        for item in children:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise self.bad(f"node {where} has a bad child {item!r}"[:200])
            k, c = item
            kids[k] = self.child(c, (*path, k))
        stat_kw: dict[str, Any] = {}
        for item in static:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise self.bad(f"node {where} has a bad static field {item!r}"[:200])
            stat_kw[item[0]] = self.static_value(item[1])
        device = None if d.get("device") is None else "cpu"
        try:
            if issubclass(cls, TensorDict):
                if stat_kw or any(v is None for v in kids.values()):
                    raise TypeError("a TensorDict has no static or None fields")
                return cls(kids, batch_size=bs, device=device)
            build: Any = cls  # a tensorclass: its generated, validating constructor
            return build(**kids, **stat_kw, batch_size=bs, device=device)
        except (TypeError, ValueError, KeyError) as e:
            raise self.bad(f"node {where} does not fit {name}: {e}") from None

    def child(self, c: Any, path: KeyPath) -> Any:
        if isinstance(c, dict) and "leaf" in c:
            name = c["leaf"]
            if not isinstance(name, str) or name not in self.leaves:
                raise self.bad(f"key {fmt_key(path)} names no tensor of the file ({name!r})")
            self.used.add(name)
            tie = c.get("tie")
            if isinstance(tie, str) and tie in self.leaves:
                same = self.leaves[tie]
                t = self.leaves[name]
                if same.shape == t.shape and same.dtype == t.dtype:
                    return same  # one tensor under both keys, as when saved
            return self.leaves[name]
        if isinstance(c, dict) and c.get("none") is True:
            return None
        return self.node(c, path)


def _nested(filename: str, leaves: dict[str, Tensor], flat: bool) -> TensorDict:
    """The tensors of a file without (or ignoring) tdfunc's structure: names split at '.'."""
    if flat:
        return TensorDict._new(dict(leaves), torch.Size(()), None)
    root: dict[str, Any] = {}
    for name, t in leaves.items():
        parts = name.split(".")
        cur = root
        for i, p in enumerate(parts[:-1]):
            nxt = cur.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ValueError(
                    E.NAME_CONFLICT.format(filename=filename, a=".".join(parts[: i + 1]), b=name)
                )
            cur = nxt
        if parts[-1] in cur:
            raise ValueError(E.NAME_CONFLICT.format(filename=filename, a=name, b=name + ".*"))
        cur[parts[-1]] = t
    return _as_td(root)


def _as_td(d: dict[str, Any]) -> TensorDict:
    return TensorDict._new(
        {k: _as_td(v) if isinstance(v, dict) else v for k, v in d.items()}, torch.Size(()), None
    )


def load_safetensors(
    path: str | os.PathLike[str],
    *,
    mode: str = "r",
    device: torch.device | str | None = None,
    structure: str = "auto",
) -> Any:
    """Load a safetensors file as a TensorDict (or the tensorclass it was saved from).

    The file is mapped, not read: loading reads the header only, and each leaf is a
    :class:`~tdfunc.MemoryMappedTensor` over its bytes, read when used. ``mode="r"`` leaves
    refuse writes with ``PermissionError`` (eagerly and under ``torch.compile``); ``"r+"``
    writes go to the file; ``"c"`` writes stay in memory.

    A file tdfunc wrote comes back with its structure (batch sizes, tensorclass types, static
    and ``None`` fields, key order, tied leaves). A file any other tool wrote (or
    ``structure="nested"``) gives nested TensorDicts with ``batch_size=()``, its names split
    at ``"."``; ``structure="flat"`` keeps the names as they are, one level deep.

    Args:
        path: the safetensors file.
        mode: ``"r"`` (read-only, default), ``"r+"`` (read-write) or ``"c"`` (copy-on-write).
        device: if given, the leaves are copied to it (no longer mapped unless ``"cpu"``).
        structure: ``"auto"``, ``"nested"`` or ``"flat"`` (see above).

    Raises:
        SafetensorsFormatError: (a ``ValueError``) the file is truncated or corrupt, or its tdfunc
            structure is from a newer version or does not fit its tensors.
        TypeError: a dtype tdfunc cannot map, or a tensorclass type not defined in this process.
        ValueError: with ``structure="nested"``, a name is both a tensor and a nested level.
        PermissionError: ``mode="r+"`` on a file this process cannot write.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> f = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> tdfunc.save_safetensors(tdfunc.TensorDict(w=torch.arange(3.0)), f)
        >>> x = tdfunc.load_safetensors(f)
        >>> x["w"].tolist(), x["w"].mode
        ([0.0, 1.0, 2.0], 'r')
        >>> try:
        ...     x["w"].add_(1)
        ... except PermissionError:
        ...     print("read-only")
        read-only
    """
    check_mode(mode)
    if structure not in ("auto", "nested", "flat"):
        raise ValueError(E.BAD_STRUCTURE_ARG.format(value=structure))
    filename = os.path.abspath(os.fspath(path))
    reader = _Reader(filename, mode)
    fd = open_fd(filename, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise reader.corrupt("not a regular file")
        header = reader.read_header(fd, st.st_size)
        meta = _read_metadata(header, reader)
        entries = reader.entries(header, st.st_size)
        leaves = reader.leaves(fd, st.st_size, entries)
    finally:
        os.close(fd)
    raw = meta.get(META_KEY)
    if structure != "auto" or raw is None:
        out: Any = _nested(filename, leaves, structure == "flat")
    else:
        out = _structured(filename, raw, leaves)
    if device is not None:
        out = out.to(device)
    return out


def _structured(filename: str, raw: str, leaves: dict[str, Tensor]) -> Any:
    builder = _Builder(filename, leaves)
    try:
        desc = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise builder.bad(f"not JSON: {e}") from None
    if not isinstance(desc, dict) or not isinstance(desc.get("version"), int):
        raise builder.bad("no format version")
    if desc["version"] > FORMAT_VERSION:
        raise SafetensorsFormatError(
            E.NEWER_VERSION.format(
                filename=filename, version=desc["version"], supported=FORMAT_VERSION
            )
        )
    out = builder.node(desc.get("root"), ())
    extra = sorted(set(leaves) - builder.used)
    if extra:
        raise builder.bad(f"tensors {extra[:5]} are not part of the structure")
    return out


__all__ = ["SafetensorsFormatError", "load_safetensors", "save_safetensors"]
