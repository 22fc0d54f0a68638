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
      :class:`~tdfunc.MemoryMappedTensor` leaves: loading reads only the header (and the
      copies of tied leaves, to compare them), and a ``mode="r"`` leaf refuses writes with
      ``PermissionError`` like a store's leaves.
    * A file is trusted for nothing. The header is checked with the rules of the
      ``safetensors`` reference reader (see :class:`_Reader`), so tdfunc accepts the files it
      accepts, with the same values; tdfunc's structure entry is checked against the tensor
      table before it is believed (each leaf names the tensor of its ``"."``-joined key path,
      each tensor is named once).
    * Ties: a tensor under two keys is written under both names (two copies: other tools need
      every name). ``"r"`` and ``"c"`` give one tensor under both keys once the copies are
      found bit-identical; ``"r+"`` refuses a tied container (a write through one name would
      not reach the other copy).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .. import _nontensor as nontensor
from .._compat import pytree
from .._jagged._layout import from_read_parts, is_jagged, jagged_problem, under_wrappers
from .._keys import fmt_key
from .._nontensor import NonTensor
from .._tensorclass import restore
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
    protect,
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
    ("F8_E8M0", "float8_e8m0fnu"),
    ("F4", "float4_e2m1fn_x2"),  # two values a byte: the torch shape's last dim is halved
):
    if hasattr(torch, _torch):
        ST_DTYPES[_st] = getattr(torch, _torch)
ST_NAMES: dict[torch.dtype, str] = {d: n for n, d in ST_DTYPES.items()}
#: every dtype name of the format, with its size in bits (F6_* have no torch dtype)
ST_BITS: dict[str, int] = {
    **{n: 8 * d.itemsize for n, d in ST_DTYPES.items()},
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "F8_E8M0": 8,
}


# --------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------
def _static_json(value: Any) -> Any:
    """A static field value as JSON (tuples as ``{"tuple": [...]}``), or raise ``TypeError``."""
    if isinstance(value, str) and _SURROGATE.search(value):
        raise TypeError("str with an unpaired surrogate")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_static_json(v) for v in value]}
    raise TypeError(type(value).__name__)


def _check_text(text: str, what: str, filename: str) -> None:
    """Refuse a name the header cannot hold: readers refuse unpaired surrogates."""
    if _SURROGATE.search(text):
        raise ValueError(E.INVALID_TEXT.format(what=what, text=text, filename=filename))


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
        base = under_wrappers(t)[0]  # what the leaf is, not its transform wrappers
        if base.layout != torch.strided or base.is_nested or t.device.type == "meta":
            what = (
                "nested" if base.is_nested else "meta" if t.device.type == "meta" else base.layout
            )
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
        if name == "__metadata__":
            raise ValueError(E.RESERVED_NAME.format(key=key, filename=self.filename, name=name))
        if t.dtype == getattr(torch, "float4_e2m1fn_x2", None) and t.ndim == 0:
            raise TypeError(E.ZERO_DIM_F4.format(key=key, filename=self.filename))
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

    def jagged(self, path: KeyPath, v: Any) -> dict[str, Any]:
        """A jagged leaf: its values, offsets and lengths (when present) as tensors named by
        the key path and ``values`` / ``offsets`` / ``lengths``; refused (``ValueError``) when
        a load would refuse them."""
        if v._ragged_idx != 1:
            raise TypeError(
                E.JAGGED_RAGGED_DIM.format(
                    key=fmt_key(path), filename=self.filename, dim=v._ragged_idx
                )
            )
        lengths = v.lengths()
        parts = {"values": v.values(), "offsets": v.offsets(), "lengths": lengths}
        problem = jagged_problem(parts["values"], parts["offsets"], lengths, v.shape[:1])
        if problem is not None:
            raise ValueError(
                E.JAGGED_UNSAVED.format(key=fmt_key(path), filename=self.filename, problem=problem)
            )
        entries: dict[str, Any] = {}
        for part, t in parts.items():
            entry = None if t is None else self.leaf((*path, part), t)
            if entry is not None:
                entry.pop("tie", None)  # loaded as copies: two leaves may share offsets
            entries[part] = entry
        return {"jagged": entries}

    def node(self, node: Node, prefix: KeyPath) -> dict[str, Any]:
        children: list[list[Any]] = []
        for k, v in zip(node._tdf_keys(), node._tdf_children()):
            path = (*prefix, k)
            _check_text(k, "key", self.filename)
            if v is None:
                children.append([k, {"none": True}])
            elif isinstance(v, Tensor) and is_jagged(v):
                children.append([k, self.jagged(path, v)])
            elif isinstance(v, Tensor):
                children.append([k, self.leaf(path, v)])
            elif is_node(v):
                children.append([k, self.node(v, path)])
            elif isinstance(v, NonTensor):
                if not nontensor.is_json_value(v.value):
                    bad = nontensor.first_non_json(v.value)
                    raise TypeError(
                        E.NONTENSOR_NOT_JSON.format(
                            key=fmt_key(path), filename=self.filename, typ=type(bad).__name__
                        )
                    )
                children.append([k, {"nontensor": nontensor.to_json(v)}])
            else:
                raise TypeError(
                    E.NOT_SAVABLE_CHILD.format(
                        key=fmt_key(path), filename=self.filename, typ=type(v).__name__
                    )
                )
        static = []
        for name, value in node._tdf_static():
            _check_text(name, "static field", self.filename)
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
        _check_text(k, "metadata key", plan.filename)
        _check_text(v, "metadata value", plan.filename)
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
        shape = list(t.shape)
        if ST_NAMES[t.dtype] == "F4":  # the format counts single values, torch pairs
            shape[-1] *= 2
        header[name] = {
            "dtype": ST_NAMES[t.dtype],
            "shape": shape,
            "data_offsets": list(offsets[name]),
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # the data starts 8-byte aligned
    if len(raw) > MAX_HEADER:
        raise ValueError(
            E.HEADER_TOO_LARGE.format(filename=plan.filename, size=len(raw), limit=MAX_HEADER)
        )
    plan.leaves = [plan.leaves[i] for i in order]
    return struct.pack("<Q", len(raw)) + raw


def _from_mapping(d: Mapping[Any, Any], filename: str) -> TensorDict:
    """The container saved for a mapping of names to tensors (a ``state_dict``): the nested
    TensorDicts its names give when split at ``"."`` (what :func:`load_safetensors` gives for
    a file of these names that another tool wrote), or, when a name is also the prefix of
    another (``"a"`` and ``"a.b"``), one flat TensorDict of the names as they are. The
    tensors are not copied."""
    tdm = sys.modules.get("tensordict")  # its objects are mappings too (never imported here)
    if tdm is not None and isinstance(d, tdm.TensorDictBase):
        raise TypeError(E.FROM_TENSORDICT.format(typ=type(d).__name__))
    leaves: dict[str, Tensor] = {}
    for k, v in d.items():
        if not isinstance(k, str):
            raise TypeError(E.MAPPING_KEY.format(key=k, typ=type(k).__name__))
        if not isinstance(v, Tensor):
            raise TypeError(E.MAPPING_VALUE.format(key=k, typ=type(v).__name__))
        leaves[k] = v
    nests = not any(name[:i] in leaves for name in leaves for i, c in enumerate(name) if c == ".")
    return _nested(filename, leaves, flat=not nests)


def save_safetensors(
    td: Any,
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> None:
    """Save a TensorDict, a tensorclass or a ``state_dict`` as one safetensors file.

    A mapping of names to tensors (``tdfunc.state_dict(m, params)``, ``m.state_dict()``) is
    written under its names as they are, tied names included: the file a tool that expects
    every name needs (``transformers``' ``from_pretrained``). It loads back as a file of
    these names from any other tool loads, nested at ``"."`` like ``from_module(m)``, and
    the tied names are one tensor; ``load_safetensors(path, structure="flat")`` gives the
    names. (A mapping where a name is also the prefix of another, ``"a"`` and ``"a.b"``,
    cannot nest: it loads back flat.)

    A container's leaves are stored under their key paths joined by ``"."`` (for
    ``tdfunc.from_module(m)`` the names of ``m.state_dict()``, except that a tied tensor, one
    leaf there, is written under its first name only: save ``tdfunc.state_dict(m, params)``
    to write every name, or load back with ``m.load_state_dict(tdfunc.state_dict(m,
    loaded))``, which fills the tied names; ``m.load_state_dict(loaded.to_state_dict())``
    reports the tied names as missing), so any safetensors reader gets a flat dict of
    tensors; the structure tdfunc needs to rebuild the container (batch sizes, tensorclass
    types and static fields, ``None`` fields, key order, tied leaves) is JSON in the
    metadata entry ``"tdfunc"``. ``metadata`` adds entries of your own (``"format": "pt"`` is
    set unless given, as ``transformers`` expects). Tied leaves (one tensor under two keys)
    are written under both names; they load as one tensor (see :func:`load_safetensors`).

    The file is written aside and renamed into place: a reader sees the old file or the whole
    new one, never a partial file. An existing file is replaced only with ``overwrite=True``.

    Args:
        td: the container, or mapping of names to tensors, to save (leaves on any device;
            they are copied to the host).
        path: the file to write.
        metadata: extra ``str -> str`` entries for the safetensors metadata.
        overwrite: replace ``path`` if it exists (``FileExistsError`` otherwise).

    Raises:
        ValueError: two key paths give the same name (``"a.b"`` next to ``("a", "b")``); a
            name no reader could load back: a top-level key ``"__metadata__"``, a key or
            metadata with an unpaired surrogate; a header above 100 MB.
        TypeError: a dtype safetensors cannot store (e.g. ``complex128``), a static field that
            is not JSON data, metadata that is not ``str -> str``; a mapping with a key that
            is not a string or a value that is not a tensor.
        FileExistsError: ``path`` exists and ``overwrite`` is false.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> f = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), n={"b": torch.zeros(2)}, batch_size=[2])
        >>> tdfunc.save_safetensors(td, f)
        >>> back = tdfunc.load_safetensors(f)
        >>> back["n", "b"].shape, back.batch_size
        (torch.Size([2]), torch.Size([2]))
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> net[1].weight = net[0].weight                       # tied
        >>> params = tdfunc.from_module(net).detach() * 2       # one leaf for the tie
        >>> tdfunc.save_safetensors(tdfunc.state_dict(net, params), f, overwrite=True)
        >>> list(tdfunc.load_safetensors(f, structure="flat").keys())   # every name
        ['0.weight', '0.bias', '1.weight', '1.bias']
        >>> back = tdfunc.load_safetensors(f)                   # nested, the tie kept
        >>> back["1", "weight"] is back["0", "weight"]
        True
    """
    filename = os.path.abspath(os.fspath(path))
    if not is_node(td):
        if not isinstance(td, Mapping):
            raise TypeError(E.NOT_A_CONTAINER.format(typ=type(td).__name__))
        td = _from_mapping(td, filename)
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
    """Checks one file against the format, as the ``safetensors`` reference reader does, and
    builds leaves over one mapping of it.

    The rules (each refused file raises :class:`SafetensorsFormatError` naming the file, and
    the tensor when one is at fault): the 8-byte length is at most :data:`MAX_HEADER` and the
    header fits in the file; the header is UTF-8 (no byte order mark) JSON text, one object,
    nested at most :data:`MAX_DEPTH` deep, without unpaired surrogate escapes, ``NaN`` or
    numbers out of the double range; ``"__metadata__"`` is ``null`` or maps strings to strings;
    every other entry has a known ``dtype``, a ``shape`` and two ``data_offsets`` of integers
    in ``[0, 2**64)``; sorted by offsets, each tensor begins where the previous one ends, its
    byte count (checked for 64-bit overflow, left to right) matches its offsets, and the last
    one ends where the file ends. One rule is stricter than the reference: a name given twice
    in one object is refused (the reference keeps the last one, other JSON readers the first).
    """

    def __init__(self, filename: str, mode: str) -> None:
        self.filename = filename
        self.mode = mode
        self.data_start = 0

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
        self.data_start = 8 + n
        return parse_header(raw, self.corrupt)

    def entries(self, header: dict[str, Any], size: int) -> dict[str, tuple[torch.dtype, Any, int]]:
        """name -> (torch dtype, torch shape, absolute offset), in the header's order."""
        infos: list[tuple[int, int, str, str, list[int]]] = []
        for name, e in header.items():
            if name != "__metadata__":
                infos.append(self.entry(name, e))
        # sorted by offsets, every tensor begins where the previous one ends
        start = 0
        for begin, end, name, dname, shape in sorted(infos, key=lambda i: (i[0], i[1])):
            if begin != start or end < begin:
                raise self.corrupt(
                    E.ENTRY_NOT_CONTIGUOUS.format(name=name, offsets=[begin, end], start=start)
                )
            start = end
            need = _nbytes(name, dname, shape, self.corrupt)
            if end - begin != need:
                raise self.corrupt(
                    E.ENTRY_SIZE.format(
                        name=name,
                        offsets=[begin, end],
                        have=end - begin,
                        shape=shape,
                        dtype=dname,
                        need=need,
                    )
                )
        have = size - self.data_start
        if start > have:
            raise self.truncated(
                f"its tensors need {start} bytes of data, {have} follow the header"
            )
        if start < have:
            raise self.corrupt(E.DATA_TRAILING.format(covered=start, size=have))
        out: dict[str, tuple[torch.dtype, Any, int]] = {}
        for begin, _end, name, dname, shape in infos:
            dtype = ST_DTYPES.get(dname)
            if dtype is None:
                raise SafetensorsFormatError(
                    E.UNKNOWN_DTYPE.format(
                        key=name, filename=self.filename, dtype=dname, supported=sorted(ST_DTYPES)
                    )
                )
            out[name] = (dtype, self.torch_shape(name, dname, shape), self.data_start + begin)
        return out

    def entry(self, name: str, e: Any) -> tuple[int, int, str, str, list[int]]:
        """``(begin, end, name, dtype name, shape)`` of one well-formed entry."""
        if not isinstance(e, dict):
            raise self.corrupt(E.ENTRY_NOT_OBJECT.format(name=name))
        for field in ("dtype", "shape", "data_offsets"):
            if field not in e:
                raise self.corrupt(E.ENTRY_MISSING.format(name=name, field=field))
        dname = e["dtype"]
        if isinstance(dname, dict) and len(dname) == 1 and None in dname.values():
            (dname,) = dname  # the other spelling of a JSON enum: {"F32": null}
        if not (isinstance(dname, str) and dname in ST_BITS):
            raise self.corrupt(E.ENTRY_BAD_DTYPE.format(name=name, dtype=dname))
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(_is_u64(s) for s in shape)):
            raise self.corrupt(E.ENTRY_BAD_SHAPE.format(name=name, shape=shape))
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_u64(o) for o in offs)):
            raise self.corrupt(E.ENTRY_BAD_OFFSETS.format(name=name, offsets=offs))
        return offs[0], offs[1], name, dname, shape

    def torch_shape(self, name: str, dname: str, shape: list[int]) -> list[int]:
        """The shape of the torch tensor (F4 packs two values a byte)."""
        if dname == "F4":
            if not shape or shape[-1] % 2:
                raise self.corrupt(E.ENTRY_F4_SHAPE.format(name=name, shape=shape))
            shape = [*shape[:-1], shape[-1] // 2]
        if any(s > _I64 for s in shape):
            raise self.corrupt(
                E.ENTRY_TORCH_SHAPE.format(name=name, shape=shape, reason="a dim above 2**63-1")
            )
        return shape

    def empty(self, name: str, dtype: torch.dtype, shape: list[int]) -> Tensor:
        """A tensor without elements, with the strides torch's ``reshape`` gives it, as the
        reference builds it: a dim may be huge (``[0, 2**62, 2**62]``), and where torch's
        stride computation overflows (``[0, 2**32, 2**31]``) both refuse the file."""
        try:
            strides = torch.empty(0, dtype=dtype).reshape(shape).stride()
        except RuntimeError as e:  # "Stride calculation overflowed"
            raise self.corrupt(
                E.ENTRY_TORCH_SHAPE.format(name=name, shape=shape, reason=e)
            ) from None
        return protect(torch.empty_strided(shape, strides, dtype=dtype), self.mode, self.filename)

    def leaves(
        self, fd: int, size: int, entries: dict[str, tuple[torch.dtype, Any, int]]
    ) -> dict[str, Tensor]:
        st = os.fstat(fd)
        base = map_fd(fd, self.filename, self.mode, size)
        ident = (st.st_dev, st.st_ino)
        out: dict[str, Tensor] = {}
        for name, (dtype, shape, off) in entries.items():
            if 0 in shape:
                inner = self.empty(name, dtype, shape)
            else:
                inner = leaf_tensor(base, off, dtype, torch.Size(shape), self.mode, self.filename)
            out[name] = MemoryMappedTensor._wrap(inner, self.filename, self.mode, off, ident)
        return out


#: the deepest nesting of objects and arrays a header may have (the reference's JSON parser)
MAX_DEPTH = 127
_U64 = 2**64 - 1
_I64 = 2**63 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_u64(v: Any) -> bool:
    return type(v) is int and 0 <= v <= _U64


def _nbytes(name: str, dname: str, shape: list[int], corrupt: Any) -> int:
    """Bytes of ``shape`` elements of ``dname``: the element count multiplied left to right,
    each step checked against 64 bits, as the reference does."""
    n = 1
    for s in shape:
        n *= s
        if n > _U64:
            raise corrupt(E.ENTRY_OVERFLOW.format(name=name, shape=shape, dtype=dname))
    bits = n * ST_BITS[dname]
    if bits > _U64:
        raise corrupt(E.ENTRY_OVERFLOW.format(name=name, shape=shape, dtype=dname))
    if bits % 8:
        raise corrupt(E.ENTRY_PARTIAL_BYTE.format(name=name, shape=shape, dtype=dname))
    return bits // 8


def parse_header(raw: bytes, corrupt: Any) -> dict[str, Any]:
    """The header bytes as a JSON object, with the reference's rules (see :class:`_Reader`);
    ``corrupt(detail)`` makes the error to raise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise corrupt(E.HEADER_NOT_UTF8.format(reason=e)) from None
    if text.startswith("\ufeff"):
        raise corrupt(E.HEADER_BOM)
    header = load_json(text, corrupt, "the header")
    if not isinstance(header, dict):
        raise corrupt(E.HEADER_NOT_OBJECT)
    meta = header.get("__metadata__")
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise corrupt(E.HEADER_METADATA)
    return header


def load_json(text: str, corrupt: Any, what: str) -> Any:
    """Strict JSON: no repeated names in an object, no ``NaN``/``Infinity``, no number out of
    the double range, no unpaired surrogate, at most :data:`MAX_DEPTH` levels. Integers in
    ``[0, 2**64)`` come back as ``int``, other numbers as ``float``."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for k, v in items:
            if k in d:
                raise corrupt(E.HEADER_DUPLICATE.format(name=k, what=what))
            d[k] = v
        return d

    def number(s: str) -> float:
        f = float(s)
        if math.isinf(f):
            raise corrupt(E.HEADER_NUMBER.format(text=s[:40], what=what))
        return f

    def integer(s: str) -> int | float:
        if s[0] == "-" or len(s) > 20:  # never a size: kept as the double it would be
            return number(s)
        v = int(s)
        return v if v <= _U64 else number(s)

    def constant(s: str) -> Any:
        raise corrupt(E.HEADER_NUMBER.format(text=s, what=what))

    try:
        value = json.loads(
            text,
            object_pairs_hook=pairs,
            parse_float=number,
            parse_int=integer,
            parse_constant=constant,
        )
    except json.JSONDecodeError as e:
        raise corrupt(E.HEADER_NOT_JSON.format(reason=e, what=what)) from None
    except RecursionError:
        raise corrupt(E.HEADER_TOO_DEEP.format(limit=MAX_DEPTH, what=what)) from None
    # depth and unpaired surrogates, without recursion
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                raise corrupt(E.HEADER_SURROGATE.format(text=v[:80], what=what))
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise corrupt(E.HEADER_TOO_DEEP.format(limit=MAX_DEPTH, what=what))
            if isinstance(v, dict):
                stack.extend((k, depth) for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
    return value


class _Builder:
    """Rebuilds the container described by tdfunc's structure entry."""

    def __init__(self, filename: str, leaves: dict[str, Tensor], mode: str) -> None:
        self.filename = filename
        self.leaves = leaves
        self.mode = mode
        #: tensor name -> the key that named it and the leaf given for it
        self.used: dict[str, tuple[KeyPath, Tensor]] = {}

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
        if not isinstance(name, str):
            raise self.bad(E.STRUCT_BAD_TYPE.format(where=where, name=name))
        cls = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name)
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
            # a tensorclass: the saved values, checked as the constructor checks them, without
            # running __init__ / __post_init__ again (as tdfunc.load)
            return restore(cls, {**kids, **stat_kw}, bs, device)
        except (TypeError, ValueError, KeyError) as e:
            raise self.bad(f"node {where} does not fit {name}: {e}") from None

    def child(self, c: Any, path: KeyPath) -> Any:
        if isinstance(c, dict) and "leaf" in c:
            return self.leaf(c, path)
        if isinstance(c, dict) and "jagged" in c:
            return self.jagged(c["jagged"], path)
        if isinstance(c, dict) and "nontensor" in c:
            try:  # checked JSON: nothing is unpickled or imported
                return nontensor.from_json(c["nontensor"])
            except ValueError as e:
                raise self.bad(f"key {fmt_key(path)}: {e}") from None
        if isinstance(c, dict) and c.get("none") is True:
            return None
        return self.node(c, path)

    def jagged(self, c: Any, path: KeyPath) -> Tensor:
        """A jagged leaf from its three entries, its offsets checked before torch builds it
        (the batch against them is checked by the container's constructor); in memory, a
        copy: a jagged tensor keeps its values as a plain tensor."""
        if not (isinstance(c, dict) and {"values", "offsets"} <= set(c) and set(c) <= _JAGGED):
            raise self.bad(f"key {fmt_key(path)}: a bad jagged entry {c!r}"[:200])
        values = self.leaf(c["values"], (*path, "values"))
        offsets = self.leaf(c["offsets"], (*path, "offsets"))
        raw = c.get("lengths")
        lengths = None if raw is None else self.leaf(raw, (*path, "lengths"))
        rows = [max(offsets.numel() - 1, 0)] if offsets.ndim == 1 else [-1]
        return from_read_parts(
            values,
            offsets,
            lengths,
            rows,
            lambda problem: self.bad(f"jagged leaf {fmt_key(path)}: {problem}"),
        )

    def leaf(self, c: dict[str, Any], path: KeyPath) -> Tensor:
        """The tensor of one leaf entry, checked against the tensor table: its name is the key
        path joined by ``"."`` (as written), names a tensor of the file, and no other key's; a
        tie gives the earlier key's tensor once the two copies are found bit-identical."""
        key, name = fmt_key(path), c["leaf"]
        if not isinstance(name, str) or name not in self.leaves:
            raise self.bad(E.STRUCT_NO_TENSOR.format(key=key, name=name))
        if name in self.used:
            raise self.bad(E.STRUCT_NAMED_TWICE.format(name=name, key=key))
        expected = ".".join(path)
        if name != expected:
            raise self.bad(E.STRUCT_WRONG_NAME.format(key=key, name=name, expected=expected))
        t = self.leaves[name]
        tie = c.get("tie")
        if tie is not None:
            if not (isinstance(tie, str) and tie in self.used):
                raise self.bad(E.STRUCT_BAD_TIE.format(key=key, tie=tie))
            first_path, first = self.used[tie]
            if self.mode == "r+":
                raise ValueError(
                    E.TIED_WRITABLE.format(
                        filename=self.filename, a=fmt_key(first_path), b=key, na=tie, nb=name
                    )
                )
            what = _differs(self.leaves[tie], t)
            if what:
                raise self.bad(
                    E.STRUCT_TIE_DIFFERS.format(
                        a=fmt_key(first_path), b=key, na=tie, nb=name, what=what
                    )
                )
            t = first
        self.used[name] = (path, t)
        return t


#: the entries of a jagged leaf in the structure
_JAGGED = frozenset({"values", "offsets", "lengths"})


def _differs(a: Tensor, b: Tensor) -> str:
    """How two copies of a tied tensor differ ("" if they are bit-identical)."""
    if a.dtype != b.dtype:
        return "dtype"
    if a.shape != b.shape:
        return "shape"
    x = a._inner if isinstance(a, MemoryMappedTensor) else a
    y = b._inner if isinstance(b, MemoryMappedTensor) else b
    if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
        return "value"
    return ""


def _recorded_tie(raw: str) -> tuple[str, str] | None:
    """The first tie (tensor names) that tdfunc's structure entry records, if it parses."""
    try:
        desc = load_json(raw, SafetensorsFormatError, "the structure")
    except SafetensorsFormatError:
        return None  # ignored by structure='nested'/'flat': nothing to protect
    stack = [desc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if isinstance(v.get("leaf"), str) and isinstance(v.get("tie"), str):
                return v["tie"], v["leaf"]
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


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

    The file is mapped, not read: loading reads the header only (and both copies of a tied
    leaf, to compare them), and each leaf is a :class:`~tdfunc.MemoryMappedTensor` over its
    bytes, read when used. ``mode="r"`` leaves refuse writes with ``PermissionError`` (eagerly
    and under ``torch.compile``); ``"r+"`` writes go to the file; ``"c"`` writes stay in
    memory.

    A file tdfunc wrote comes back with its structure (batch sizes, tensorclass types, static
    and ``None`` fields, key order, tied leaves: one tensor under both keys, once its two
    copies in the file are found bit-identical). A file any other tool wrote (or
    ``structure="nested"``) gives nested TensorDicts with ``batch_size=()``, its names split
    at ``"."``; ``structure="flat"`` keeps the names as they are, one level deep.

    Args:
        path: the safetensors file.
        mode: ``"r"`` (read-only, default), ``"r+"`` (read-write) or ``"c"`` (copy-on-write).
        device: if given, the leaves are copied to it (no longer mapped unless ``"cpu"``).
        structure: ``"auto"``, ``"nested"`` or ``"flat"`` (see above).

    The file is checked as the ``safetensors`` reference reader checks it (tdfunc accepts
    exactly the files it accepts, except that a name repeated in one JSON object is refused).

    Raises:
        SafetensorsFormatError: (a ``ValueError``) the file is truncated or not valid (the
            message names the file, and the tensor at fault), has a dtype torch has no type
            for, or its tdfunc structure is from a newer version or does not fit its tensors
            (tied copies that differ included).
        TypeError: a tensorclass type not defined in this process.
        ValueError: with ``structure="nested"``, a name is both a tensor and a nested level;
            ``mode="r+"`` on a file whose structure records tied leaves.
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
        meta = header.get("__metadata__") or {}
        entries = reader.entries(header, st.st_size)
        leaves = reader.leaves(fd, st.st_size, entries)
    finally:
        os.close(fd)
    raw = meta.get(META_KEY)
    if structure != "auto" or raw is None:
        tie = _recorded_tie(raw) if raw is not None and mode == "r+" else None
        if tie is not None:
            raise ValueError(
                E.TIED_WRITABLE.format(
                    filename=filename, a=repr(tie[0]), b=repr(tie[1]), na=tie[0], nb=tie[1]
                )
            )
        out: Any = _nested(filename, leaves, structure == "flat")
    else:
        out = _structured(filename, raw, leaves, mode)
    if device is not None:
        out = out.to(device)
    return out


def _structured(filename: str, raw: str, leaves: dict[str, Tensor], mode: str) -> Any:
    builder = _Builder(filename, leaves, mode)
    desc = load_json(raw, builder.bad, "the structure")
    if not isinstance(desc, dict) or not isinstance(desc.get("version"), int):
        raise builder.bad("no format version")
    if desc["version"] > FORMAT_VERSION:
        raise SafetensorsFormatError(
            E.NEWER_VERSION.format(
                filename=filename, version=desc["version"], supported=FORMAT_VERSION
            )
        )
    out = builder.node(desc.get("root"), ())
    extra = sorted(set(leaves) - set(builder.used))
    if extra:
        raise builder.bad(E.STRUCT_UNUSED.format(names=extra[:5]))
    return out


__all__ = ["SafetensorsFormatError", "load_safetensors", "save_safetensors"]
