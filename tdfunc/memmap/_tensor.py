"""``MemoryMappedTensor``: a tensor leaf backed by a file, whose mode is part of the leaf.

How a write to a read-only (``mode="r"``) leaf is refused
--------------------------------------------------------
Two independent layers, so that no code path can change the file or crash the process:

1. **Python level, every tensor method.** ``MemoryMappedTensor`` is a *traceable wrapper
   subclass*: it holds a plain tensor ``_inner`` over the mapped bytes and implements
   ``__torch_dispatch__``. Every ATen op that reaches it is checked against the op's schema:
   an argument whose alias annotation says ``is_write`` (``add_``, ``copy_``, ``fill_``,
   ``index_put_`` from ``x[i] = v``, ``out=`` arguments, ``_foreach_*_``...) that is a read-only
   leaf is refused *before* the op runs. The schema is the single source of truth, so no
   list of method names can go stale. Views (indexing, ``view``, ``unbind``, ``detach``...) are
   recognised from the same alias annotations and stay ``MemoryMappedTensor`` with the mode of
   their source, so a write through a view is refused too; every other result is a plain
   tensor.
2. **OS level, everything else.** A read-only leaf is a *private* (copy-on-write,
   ``MAP_PRIVATE``) mapping of a file opened ``O_RDONLY``. Code that bypasses tensor methods
   (``torch.from_numpy(leaf.numpy())``, ``ctypes``, a C extension) can at worst change
   process-private pages: the file is never touched and, since the pages are writable, nothing
   segfaults. ``leaf.numpy()`` of a read-only leaf also returns a non-writeable array, so
   numpy itself refuses the write. (A shared read-only ``PROT_READ`` mapping, as ``numpy.memmap``
   and an early tensordict used, segfaults on such writes.)

Reads without ``__torch_dispatch__``
-----------------------------------
torch imports ``torch.distributed.tensor`` (about 0.7 s, sympy included) the first time any
op is dispatched to a Python ``__torch_dispatch__`` in a process: before calling the handler,
its C++ dispatcher (``dispatch_on_subclass`` in ``python_arg_parser.cpp``) asks whether the
argument is a ``DTensor``, and looking up that class imports it. Every new process (each
DataLoader worker) paid it on its first read of a leaf, whatever the size. So a call first
meets ``MemoryMappedTensor.__torch_function__``, which decides from the ATen schemas alone
(no list of method names): a C binding of an ATen op none of whose overloads writes an input
(``sum``, ``x[i]``, ``x + 1``, ``view``, ``index_select``, ``torch.stack``...) and passed no
``out=`` argument runs directly on the plain mapped tensors, no Python dispatch involved; a
result that shares memory with a leaf (``torch._C._is_alias_of``: a view, or the mapped tensor
itself, as ``x.to(x.dtype)`` returns) is wrapped again as a leaf with that leaf's file and mode,
so a write through it is refused as before. Everything else (in-place and ``out=`` calls,
Python-level functions such as ``torch.nn.init.normal_`` or ``F.relu(x, inplace=True)``, names
that are not ATen ops such as ``__setitem__``) goes on to ``__torch_dispatch__`` and its per-op
check below. While ``torch.compile`` traces, the leaves hold fake or functional tensors and
every call takes the checked way, as before. A fresh process thus reads a store at
``numpy.memmap``'s speed (``compile_benchmarks/test_bench_memmap.py``,
``memmap_first_read_fresh``).

The refusal is raised by a tiny custom op, ``tdfunc::refuse_write``, registered as an *ordered
effect*. In eager mode it raises at once. Under ``torch.compile`` it is recorded in the graph
(its fake kernel does nothing), kept by dead-code elimination and ordered before the write, so
the *compiled* function raises the same ``PermissionError`` naming the file when it runs, with
the ``eager``, ``aot_eager`` and ``inductor`` backends alike. (Raising while tracing would
reach the user as Dynamo's ``TorchRuntimeError``, not as a ``PermissionError``.)

Why a wrapper subclass and not a plain ``torch.Tensor`` subclass
---------------------------------------------------------------
tensordict's ``MemoryMappedTensor`` is a plain subclass (``_make_subclass``) with
``__torch_function__`` disabled. Under ``aot_eager`` the compiled function's first call runs
under an aliasing check mode (``_AnalyzeCustomOpInputOutputMode``) that returns
``NotImplemented`` for any tensor type it does not know, so the first call fails unless the
process-wide ``torch._functorch.config.check_custom_op_aliasing`` is turned off. A traceable
wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``) is unwrapped by AOTAutograd
at the compile boundary: the compiled graph only ever sees the plain inner tensor, so all three
backends work from the first call with no global setting.

Compile guards
--------------
``__tensor_flatten__`` returns ``(filename, mode, offset)`` as metadata, which Dynamo guards
on. A compiled function therefore compiles once per (store file, mode): the metadata is needed
to rebuild views returned by the compiled function with the right file (AOTAutograd rebuilds
output subclasses from the traced metadata; with the file left out of the guard, a view
returned for store B was labelled with store A's file) and to name the file in the error.
Calling the compiled function on new data saved at the same path does not recompile.

Mapping
-------
The whole file is mapped once with ``torch.UntypedStorage.from_file`` (``shared=True`` for
``"r+"``, private otherwise; it closes its descriptor after mapping, so many mapped leaves do
not use up descriptors). Each leaf gets a storage *of its own*: a slice of that mapping that
covers exactly the leaf's bytes and keeps the mapping alive. This matters under
``torch.compile``: functionalizing an in-place write clones "the whole storage" of the written
input (``clone_preserve_strides``); with one storage for the whole file that would copy the
whole store for a one-row write (and it asserts when the file size is not a multiple of the
dtype's size). A leaf records the file offset of its storage, so pickling by reference is
exact: ``(filename, mode, offset, nbytes, dtype, shape, stride, storage offset)``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import os
import secrets
import stat
import sys
from collections.abc import Sequence
from types import BuiltinFunctionType, MethodDescriptorType, WrapperDescriptorType
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from .._compat import (
    DisableTorchFunctionSubclass,
    OpOverloadPacket,
    TensorBase,
    is_alias_of,
    is_functional_tensor,
    is_functorch_wrapped_tensor,
    make_wrapper_subclass,
    register_ordered_effect,
)
from . import _errors as E

MODES = ("r", "r+", "c")

#: dtypes that can be memory-mapped, by the name written to manifests
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def dtype_name(dtype: torch.dtype, where: str = "") -> str:
    """The manifest name of ``dtype`` (``TypeError`` when it cannot be memory-mapped)."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise TypeError(
            E.UNSUPPORTED_DTYPE.format(dtype=dtype, where=where, supported=", ".join(DTYPES))
        )
    return name


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``"r"``, ``"r+"``, ``"c"`` (``ValueError`` otherwise)."""
    if mode not in MODES:
        raise ValueError(E.BAD_MODE.format(mode=mode))
    return mode


def as_shape(shape: Any) -> torch.Size:
    """A ``torch.Size`` from an int or a sequence of non-negative ints."""
    if isinstance(shape, int):
        shape = (shape,)
    if not isinstance(shape, Sequence) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise ValueError(E.BAD_SHAPE.format(shape=shape))
    return torch.Size(shape)


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes taken by a contiguous tensor of ``shape`` and ``dtype``."""
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


# --------------------------------------------------------------------------------------
# refusing writes: an ordered-effect custom op (raises when it runs, eager or compiled)
# --------------------------------------------------------------------------------------
@torch.library.custom_op("tdfunc::refuse_write", mutates_args=())
def _refuse_write(x: Tensor, filename: str, op: str) -> None:
    raise PermissionError(E.READ_ONLY.format(filename=filename, op=op))


@_refuse_write.register_fake
def _refuse_write_fake(x: Tensor, filename: str, op: str) -> None:
    return None


register_ordered_effect(_refuse_write)


# --------------------------------------------------------------------------------------
# schema analysis (one entry per ATen overload, computed once)
# --------------------------------------------------------------------------------------
_PLAIN, _VIEW, _WRITE = 0, 1, 2


@functools.cache
def _op_info(func: Any) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, int, str], ...]]:
    """``(written args, returns)`` of an ATen overload, from its schema's alias annotations.

    Written args: ``(position, name)`` of each argument annotated ``(a!)``. Returns:
    ``(kind, source position, source name)`` with kind plain / view of an argument / the
    written argument itself.
    """
    schema = func._schema
    writes = []
    alias_of: list[tuple[frozenset[str], int, str]] = []
    wild: tuple[int, str] | None = None
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None:
            continue
        alias_of.append((frozenset(info.before_set), i, a.name))
        if wild is None and "*" in info.after_set:
            wild = (i, a.name)
        if info.is_write:
            writes.append((i, a.name))
    rets = []
    for r in schema.returns:
        info = r.alias_info
        if info is None:
            rets.append((_PLAIN, -1, ""))
            continue
        sets = frozenset(info.before_set)
        # ``Tensor(a)[]`` returns (unbind, split, chunk...) do not expose their alias set:
        # the source is the argument annotated ``Tensor(a -> *)``
        src = next(((i, n) for s, i, n in alias_of if s & sets), None) if sets else wild
        if src is None:
            rets.append((_PLAIN, -1, ""))
        else:
            rets.append((_WRITE if info.is_write else _VIEW, src[0], src[1]))
    return tuple(writes), tuple(rets)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    return args[pos] if pos < len(args) else kwargs.get(name)


def _unwrap(x: Any) -> Any:
    if isinstance(x, MemoryMappedTensor):
        return x._inner
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _refuse_if_read_only(value: Any, func: Any) -> None:
    if isinstance(value, MemoryMappedTensor):
        if value._mode == "r":
            torch.ops.tdfunc.refuse_write(value._inner, value._filename, str(func))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _refuse_if_read_only(v, func)


def _rewrap(out: Any, src: MemoryMappedTensor) -> Any:
    if isinstance(out, Tensor):
        return MemoryMappedTensor._wrap(out, src._filename, src._mode, src._offset, src._ident)
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, src) for o in out)
    return out


def _result(out: Any, ret: tuple[int, int, str], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    kind, pos, name = ret
    if kind == _PLAIN:
        return out
    src = _arg(args, kw, pos, name)
    if kind == _WRITE:
        return src  # an in-place / out= op returns the very argument it wrote
    return _rewrap(out, src) if isinstance(src, MemoryMappedTensor) else out


# --------------------------------------------------------------------------------------
# reads without __torch_dispatch__
# --------------------------------------------------------------------------------------
#: Python operators whose name is not an ATen op name, and the ATen op each one calls (none of
#: them writes its operands; ``x[i]`` reads, ``x[i] = v`` is ``__setitem__``, not listed)
_OPERATORS = {
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "sub",
    "__rsub__": "rsub",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__truediv__": "div",
    "__rtruediv__": "div",
    "__floordiv__": "floor_divide",
    "__rfloordiv__": "floor_divide",
    "__mod__": "remainder",
    "__rmod__": "remainder",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__neg__": "neg",
    "__pos__": "positive",
    "__abs__": "abs",
    "__invert__": "bitwise_not",
    "__eq__": "eq",
    "__ne__": "ne",
    "__lt__": "lt",
    "__le__": "le",
    "__gt__": "gt",
    "__ge__": "ge",
    "__getitem__": "index",
}
#: metadata properties, answered from the mapped tensor (the same sizes, strides, dtype and
#: device as the leaf); ``_version``, ``grad``, ``requires_grad``... stay the leaf's own
_METADATA = frozenset(
    {
        *("shape", "dtype", "device", "ndim", "layout", "is_cpu", "is_cuda", "is_meta"),
        *("size", "stride", "dim", "numel", "storage_offset", "is_contiguous", "element_size"),
    }
)
_BUILTINS = (BuiltinFunctionType, MethodDescriptorType, WrapperDescriptorType)
#: how a call is run: on the mapped tensors (``_READ``), or through ``__torch_dispatch__``
#: with its per-op schema check (``_CHECKED``); a metadata property: ``_META``
_CHECKED, _READ, _META = 0, 1, 2
#: per torch function: ``(how, names of out= arguments)``
_KINDS: dict[Any, tuple[int, frozenset[str]]] = {}


def _kind(func: Any) -> tuple[int, frozenset[str]]:
    """How to run ``func`` on leaves. A C binding of an ATen op none of whose overloads
    writes an input is a read, unless the call passes an ``out=`` argument (the schemas say
    which arguments are outputs). Python functions (``torch.nn.init.normal_``,
    ``torch.nn.functional.relu(x, inplace=True)``...) and names that are not ATen ops
    (``__setitem__``, ``__iadd__``...) are checked op by op in ``__torch_dispatch__``."""
    kind = _KINDS.get(func)
    if kind is not None:
        return kind
    kind = (_CHECKED, frozenset())
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None) if name == "__get__" else func
    if getattr(owner, "__objclass__", None) is TensorBase and (
        getattr(owner, "__name__", "") in _METADATA
    ):
        kind = (_META, frozenset())
    elif isinstance(func, _BUILTINS):
        name = _OPERATORS.get(name, name)
        packet = None if name.startswith("__") else getattr(torch.ops.aten, name, None)
        if isinstance(packet, OpOverloadPacket):
            schemas = [getattr(packet, o)._schema for o in packet.overloads()]
            args = [a for s in schemas for a in s.arguments]
            if not any(
                a.alias_info is not None and a.alias_info.is_write and not a.is_out for a in args
            ):
                kind = (_READ, frozenset({"out", *(a.name for a in args if a.is_out)}))
    _KINDS[func] = kind
    return kind


def _mapped(x: Any) -> Tensor | None:
    """The plain tensor over real mapped memory behind leaf ``x`` (``None`` for a fake or
    functional tensor made while ``torch.compile`` traces: such calls go the checked way)."""
    t = x._inner
    if type(t) is not Tensor or is_functional_tensor(t) or is_functorch_wrapped_tensor(t):
        return None
    return t


def _plain_args(x: Any, leaves: list[tuple[Tensor | None, MemoryMappedTensor]]) -> Any:
    """``x`` with every leaf replaced by its mapped tensor; each leaf met is recorded in
    ``leaves`` as ``(mapped tensor or None, leaf)``."""
    if isinstance(x, MemoryMappedTensor):
        t = _mapped(x)
        leaves.append((t, x))
        return x if t is None else t
    if isinstance(x, (list, tuple)):
        return type(x)(_plain_args(v, leaves) for v in x)
    return x


def _rewrap_aliases(out: Any, leaves: list[tuple[Tensor | None, MemoryMappedTensor]]) -> Any:
    """``out`` with every tensor that shares memory with a leaf (a view, or the mapped tensor
    itself) wrapped again as a leaf with that leaf's file and mode; other results are plain."""
    if type(out) is Tensor:
        if out.layout == torch.strided:
            for t, leaf in leaves:
                if t is not None and is_alias_of(out, t):
                    return _rewrap(out, leaf)
        return out
    if isinstance(out, (list, tuple)) and not isinstance(out, torch.Size):
        new = [_rewrap_aliases(v, leaves) for v in out]
        if any(n is not v for n, v in zip(new, out)):
            return type(out)(new)  # list, tuple, or a torch.return_types structseq
    return out


class MemoryMappedTensor(Tensor):
    """A tensor backed by a file, with its ``filename`` and ``mode`` as part of the leaf.

    * ``"r"``: read-only. Any write (``add_``, ``copy_``, ``fill_``, ``x[i] = v``, ``out=``...),
      also through a view and inside ``torch.compile``, raises ``PermissionError`` naming the
      file; the file is mapped privately, so no other path can change it or crash.
    * ``"r+"``: read-write; writes go to the file and are seen by every process mapping it.
    * ``"c"``: copy-on-write; writable in memory, the file is never changed.

    Arithmetic results are plain tensors; views (indexing, ``view``, ``unbind``...) stay
    ``MemoryMappedTensor`` with the mode of their source. Pickling sends the file name and the
    metadata, not the data. Build one with :meth:`from_tensor`, :meth:`from_filename`,
    :meth:`empty` or :meth:`zeros`; :func:`tdfunc.load` maps a whole saved TensorDict.

    Example:
        >>> import os, tempfile, torch
        >>> from tdfunc import MemoryMappedTensor
        >>> f = os.path.join(tempfile.mkdtemp(), "x.bin")
        >>> x = MemoryMappedTensor.from_tensor(torch.arange(4.0), f)
        >>> y = MemoryMappedTensor.from_filename(f, torch.float32, (4,))   # mode="r"
        >>> (y * 2).tolist(), y.mode, type(y[1:]).__name__
        ([0.0, 2.0, 4.0, 6.0], 'r', 'MemoryMappedTensor')
        >>> try:
        ...     y[0] = 1.0
        ... except PermissionError:
        ...     print("refused")
        refused
    """

    __slots__ = ("_filename", "_ident", "_inner", "_mode", "_offset", "_storage")
    _inner: Tensor
    _filename: str
    _mode: str
    _offset: int
    _ident: tuple[Any, ...] | None
    _storage: torch.UntypedStorage | None

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run a call that cannot write directly on the mapped tensors; send every other call
        on to :meth:`__torch_dispatch__`, which checks each ATen op against its schema (see
        "Reads without ``__torch_dispatch__``" in the module docstring)."""
        kind, outs = _KINDS.get(func) or _kind(func)
        if kind == _META and type(args[0]) is MemoryMappedTensor:
            # the same sizes, strides, dtype and device as the leaf's own (a fake inner tensor
            # of a traced leaf is a subclass: it takes the checked way)
            t = args[0]._inner
            if type(t) is Tensor:
                return func(t, *args[1:], **kwargs) if kwargs else func(t, *args[1:])
        others = [t for t in types if not issubclass(cls, t)]
        for t in others:
            if not issubclass(t, Tensor):
                return NotImplemented  # e.g. a TensorDict operand: its own handler runs
        kw = kwargs or {}
        if kind == _READ and not (kw and outs & kw.keys()):
            leaves: list[tuple[Tensor | None, MemoryMappedTensor]] = []
            plain = [_plain_args(a, leaves) for a in args]
            plain_kw = {k: _plain_args(v, leaves) for k, v in kw.items()} if kw else kw
            if leaves and all(t is not None for t, _ in leaves):
                return _rewrap_aliases(func(*plain, **plain_kw), leaves)
        for t in others:  # other tensor subclasses handle the call as if leaves were plain
            out = t.__torch_function__(func, others, args, kw)
            if out is not NotImplemented:
                return out
        with DisableTorchFunctionSubclass():
            return func(*args, **kw)

    def __new__(cls, *args: Any, **kwargs: Any) -> MemoryMappedTensor:
        raise TypeError(E.NO_CONSTRUCTOR)

    @staticmethod
    def _wrap(
        inner: Tensor,
        filename: str,
        mode: str,
        offset: int,
        ident: tuple[Any, ...] | None = None,
    ) -> MemoryMappedTensor:
        """Trusted constructor: wrap a plain tensor whose storage maps the bytes of
        ``filename`` that start at ``offset``; ``ident`` is the mapped file's
        ``(device, inode)`` (``None``: looked up when pickled)."""
        r = make_wrapper_subclass(
            MemoryMappedTensor,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=inner.device,
            layout=inner.layout,
            requires_grad=False,
        )
        r._inner = inner
        r._filename = filename
        r._mode = mode
        r._offset = offset
        r._ident = ident
        r._storage = None
        return r

    # ------------------------------------------------------------------ attributes
    @property
    def filename(self) -> str:
        """Absolute path of the mapped file."""
        return self._filename

    @property
    def mode(self) -> str:  # type: ignore[override]  # the file mode, not torch.mode
        """``"r"`` (read-only), ``"r+"`` (read-write) or ``"c"`` (copy-on-write)."""
        return self._mode

    # mypy reports any override of Tensor.__repr__ (even the same signature) as incompatible
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"MemoryMappedTensor({self._inner!r}, filename={self._filename!r}, mode={self._mode!r})"
        )

    # ------------------------------------------------------------------ dispatch
    @classmethod  # torch's stubs type Tensor.__torch_dispatch__ as a plain method
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kw = kwargs or {}
        writes, rets = _op_info(func)
        for pos, name in writes:
            _refuse_if_read_only(_arg(args, kw, pos, name), func)
        # one flat pass over the arguments (the hot path of every op on a leaf of a store)
        plain = [
            a._inner
            if isinstance(a, MemoryMappedTensor)
            else _unwrap(a)
            if isinstance(a, (list, tuple))
            else a
            for a in args
        ]
        out = func(*plain, **{k: _unwrap(v) for k, v in kw.items()}) if kw else func(*plain)
        if len(rets) == 1:
            return _result(out, rets[0], args, kw)
        if not rets:
            return out
        return tuple(_result(o, r, args, kw) for o, r in zip(out, rets))

    # ------------------------------------------------------------------ compile support
    def __tensor_flatten__(self) -> tuple[list[str], tuple[str, str, int]]:
        return ["_inner"], (self._filename, self._mode, self._offset)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, Tensor],
        meta: tuple[str, str, int],
        outer_size: Any,
        outer_stride: Any,
    ) -> MemoryMappedTensor:
        return MemoryMappedTensor._wrap(inner_tensors["_inner"], *meta)

    def _stable_hash_for_caching(self) -> str:
        key = repr((self._filename, self._mode, self._offset, str(self.dtype), tuple(self.shape)))
        return hashlib.sha256(key.encode()).hexdigest()

    # ------------------------------------------------------------------ escapes
    def numpy(self, *, force: bool = False) -> np.ndarray:
        """A numpy array sharing the mapped memory; not writeable for a ``"r"`` leaf."""
        arr = self._inner.numpy(force=force)
        if self._mode == "r":
            arr.flags.writeable = False
        return arr

    def __format__(self, format_spec: str) -> str:
        return self._inner.__format__(format_spec)

    def tolist(self) -> Any:
        """The data as nested Python lists."""
        return self._inner.tolist()

    # A wrapper subclass has no data of its own: torch's storage-level methods would see an
    # empty placeholder (``data_ptr() == 0``; writing into it crashed the process). They are
    # answered from the mapped tensor instead, with the mode enforced.
    def data_ptr(self) -> int:
        """Address of the first element in the mapping (reading through it is outside the
        mode checks; writing through a raw pointer is outside the contract)."""
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The mapped bytes under this leaf as a storage; writes through it reach the file in
        ``"r+"``, memory only in ``"c"``, and raise ``PermissionError`` in ``"r"``.

        It is a storage object of the leaf's own (made once, aliasing the inner tensor's
        storage): the compile machinery records storages by identity, and the leaf must not
        look like the same tensor as its inner tensor.
        """
        if self._storage is None:
            t = self._inner
            if (
                type(t) is not Tensor or is_functional_tensor(t) or is_functorch_wrapped_tensor(t)
            ):  # a fake / functional leaf made while tracing: it has no memory to alias
                return Tensor.untyped_storage(self)
            inner = t.untyped_storage()
            s: torch.UntypedStorage = inner[0 : inner.nbytes()]
            if self._mode == "r":
                s.__class__ = ReadOnlyStorage
                cast(ReadOnlyStorage, s)._readonly_filename = self._filename
            self._storage = s
        return self._storage

    def _typed_storage(self) -> torch.TypedStorage:
        s = torch.TypedStorage(
            wrap_storage=self.untyped_storage(), dtype=self.dtype, _internal=True
        )
        if self._mode == "r":
            s.__class__ = ReadOnlyTypedStorage
        return s

    def is_shared(self) -> bool:
        """``True`` for ``"r+"`` (a shared mapping of the file); private otherwise."""
        return self._mode == "r+"

    def share_memory_(self) -> MemoryMappedTensor:
        """A no-op: a memory-mapped leaf goes to other processes by file reference."""
        return self

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """DLPack export of the mapped memory; of a ``"r"`` leaf only a copy
        (``copy=True``), since the consumer could write into it (``PermissionError``)."""
        if self._mode == "r":
            if kwargs.get("copy") is True:
                kwargs["copy"] = None
                return self._inner.clone().__dlpack__(*args, **kwargs)
            raise PermissionError(
                E.READ_ONLY.format(filename=self._filename, op="__dlpack__ (zero-copy export)")
            )
        return self._inner.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._inner.__dlpack_device__()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        inner = self._inner
        nbytes = inner.untyped_storage().nbytes()
        ident = self._ident
        if ident is None and nbytes:
            ident = mapped_identity(inner)
        return (
            _rebuild,
            (
                self._filename,
                self._mode,
                self._offset,
                nbytes,
                dtype_name(inner.dtype),
                tuple(inner.shape),
                tuple(inner.stride()),
                inner.storage_offset(),
                ident,
            ),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        """A deep copy is an in-memory copy of the data (a plain tensor)."""
        return self._inner.clone()

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_filename(
        cls,
        filename: str | os.PathLike[str],
        dtype: torch.dtype,
        shape: Sequence[int] | int,
        *,
        mode: str = "r",
        offset: int = 0,
    ) -> MemoryMappedTensor:
        """Map ``shape`` elements of ``dtype`` stored contiguously at byte ``offset`` of a file.

        Nothing is read until used. ``mode="r+"`` on a file this process cannot write raises
        ``PermissionError`` here; a file too short raises ``ValueError``.

        Example:
            >>> import os, tempfile, numpy as np, torch
            >>> from tdfunc import MemoryMappedTensor
            >>> f = os.path.join(tempfile.mkdtemp(), "raw.bin")
            >>> np.arange(6, dtype=np.int32).tofile(f)
            >>> MemoryMappedTensor.from_filename(f, torch.int32, (2, 2), offset=8).tolist()
            [[2, 3], [4, 5]]
        """
        check_mode(mode)
        shape = as_shape(shape)
        dtype_name(dtype)
        fname = os.path.abspath(os.fspath(filename))
        if not isinstance(offset, int) or offset < 0 or offset % dtype.itemsize:
            raise ValueError(
                E.BAD_OFFSET.format(itemsize=dtype.itemsize, dtype=dtype, offset=offset)
            )
        need = offset + nbytes_of(shape, dtype)
        fd = open_fd(fname, mode)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(E.NOT_A_FILE.format(filename=fname))
            if st.st_size < need:
                raise ValueError(
                    E.FILE_TOO_SHORT.format(
                        filename=fname,
                        size=st.st_size,
                        need=need,
                        shape=tuple(shape),
                        dtype=dtype,
                        offset=offset,
                    )
                )
            base = map_fd(fd, fname, mode, need)
        finally:
            os.close(fd)
        inner = leaf_tensor(base, offset, dtype, shape, mode, fname)
        return cls._wrap(inner, fname, mode, offset, (st.st_dev, st.st_ino))

    @classmethod
    def from_tensor(
        cls, t: Tensor, filename: str | os.PathLike[str], *, exist_ok: bool = False
    ) -> MemoryMappedTensor:
        """Write ``t``'s data to ``filename`` (atomically) and map it read-write (``"r+"``).

        ``FileExistsError`` if the file exists and ``exist_ok`` is false. The data of a
        tensor on another device is copied to the host; gradients are not kept.

        Example:
            >>> import os, tempfile, torch
            >>> from tdfunc import MemoryMappedTensor
            >>> f = os.path.join(tempfile.mkdtemp(), "t.bin")
            >>> m = MemoryMappedTensor.from_tensor(torch.ones(2, 3), f)
            >>> m.shape, m.mode, os.path.getsize(f)
            (torch.Size([2, 3]), 'r+', 24)
        """
        if not isinstance(t, Tensor):
            raise TypeError(f"from_tensor expects a torch.Tensor, got {type(t).__name__}")
        check_leaf(t, "'t'")
        fname = os.path.abspath(os.fspath(filename))
        if not exist_ok and os.path.lexists(fname):
            raise FileExistsError(E.FILE_EXISTS.format(filename=fname))
        nbytes = nbytes_of(t.shape, t.dtype)

        def fill(fd: int) -> None:
            write_tensor(fd, t, None)

        _atomic_file(fname, nbytes, fill)
        return cls.from_filename(fname, t.dtype, t.shape, mode="r+")

    @classmethod
    def empty(
        cls,
        shape: Sequence[int] | int,
        dtype: torch.dtype,
        filename: str | os.PathLike[str],
        *,
        exist_ok: bool = False,
    ) -> MemoryMappedTensor:
        """A new read-write (``"r+"``) file of ``shape`` and ``dtype``, disk space reserved.

        The space is reserved with ``posix_fallocate``, so a full disk is reported here, not
        as a crash on a later write. The contents read as zeros.

        Example:
            >>> import os, tempfile, torch
            >>> from tdfunc import MemoryMappedTensor
            >>> f = os.path.join(tempfile.mkdtemp(), "e.bin")
            >>> MemoryMappedTensor.empty((2, 2), torch.float64, f).shape
            torch.Size([2, 2])
        """
        shape = as_shape(shape)
        dtype_name(dtype)
        fname = os.path.abspath(os.fspath(filename))
        if not exist_ok and os.path.lexists(fname):
            raise FileExistsError(E.FILE_EXISTS.format(filename=fname))
        _atomic_file(fname, nbytes_of(shape, dtype), None)
        return cls.from_filename(fname, dtype, shape, mode="r+")

    @classmethod
    def zeros(
        cls,
        shape: Sequence[int] | int,
        dtype: torch.dtype,
        filename: str | os.PathLike[str],
        *,
        exist_ok: bool = False,
    ) -> MemoryMappedTensor:
        """Like :meth:`empty`, with the contents guaranteed to be zeros.

        Example:
            >>> import os, tempfile, torch
            >>> from tdfunc import MemoryMappedTensor
            >>> f = os.path.join(tempfile.mkdtemp(), "z.bin")
            >>> MemoryMappedTensor.zeros(3, torch.int64, f).tolist()
            [0, 0, 0]
        """
        return cls.empty(shape, dtype, filename, exist_ok=exist_ok)


def _rebuild(
    filename: str,
    mode: str,
    offset: int,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
    ident: tuple[Any, ...] | None = None,
) -> MemoryMappedTensor:
    """Unpickle a leaf: map the file again (no data travelled), after checking that the file
    at ``filename`` is still the one the sender mapped (``StoreReplacedError`` otherwise)."""
    dt = DTYPES[dtype]
    check_mode(mode)
    if nbytes == 0:
        inner = torch.empty(0, dtype=dt).set_(
            torch.UntypedStorage(0), storage_offset, shape, stride
        )
        return MemoryMappedTensor._wrap(protect(inner, mode, filename), filename, mode, offset)
    try:
        fd = open_fd(filename, mode)
    except FileNotFoundError:
        raise E.StoreReplacedError(E.PICKLE_FILE_GONE.format(filename=filename)) from None
    try:
        st = os.fstat(fd)
        if ident is not None and (
            (st.st_dev, st.st_ino) != tuple(ident[:2])
            or (len(ident) > 2 and _store_id_at(filename) != ident[2])
        ):
            raise E.StoreReplacedError(E.PICKLE_FILE_REPLACED.format(filename=filename))
        if not stat.S_ISREG(st.st_mode) or st.st_size < offset + nbytes:
            raise ValueError(
                E.FILE_TOO_SHORT.format(
                    filename=filename,
                    size=st.st_size,
                    need=offset + nbytes,
                    shape=shape,
                    dtype=dt,
                    offset=offset,
                )
            )
        storage = map_fd(fd, filename, mode, offset + nbytes)[offset : offset + nbytes]
    finally:
        os.close(fd)
    ident = (st.st_dev, st.st_ino, *tuple(ident[2:] if ident is not None else ()))
    inner = torch.empty(0, dtype=dt).set_(storage, storage_offset, shape, stride)
    return MemoryMappedTensor._wrap(protect(inner, mode, filename), filename, mode, offset, ident)


def _store_id_at(data_file: str) -> Any:
    """The ``store_id`` in the manifest next to ``data_file`` (``None`` if unreadable)."""
    try:
        with open(os.path.join(os.path.dirname(data_file), "manifest.json"), "rb") as f:
            return json.loads(f.read()).get("store_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


# --------------------------------------------------------------------------------------
# files: opening, mapping
# --------------------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
#: not accounted against the commit limit of Linux's default (heuristic) overcommit policy, so a
#: private mapping of a file larger than RAM + swap is not refused
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _Mapping:
    """One ``mmap`` of a file, unmapped when the last tensor over it is freed.

    numpy's array interface turns it into an array whose ``base`` is this object; the tensor
    made from that array keeps the array (hence the mapping) alive.
    """

    __slots__ = ("addr", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr = addr
        self.size = size

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.addr, False), "version": 3}

    def __del__(self) -> None:
        _libc.munmap(self.addr, self.size)


def _permission_error(err: int | None, message: str) -> PermissionError:
    """A ``PermissionError`` whose text is exactly ``message`` (and whose ``errno`` is set)."""
    e = PermissionError(message)
    e.errno = err
    return e


def open_fd(filename: str, mode: str, *, dir_fd: int | None = None, follow: bool = True) -> int:
    """A descriptor of ``filename`` opened for ``mode`` (read-write only for ``"r+"``).

    ``PermissionError`` names the file; with ``follow=False`` a symbolic link is refused
    (``IsADirectoryError``/``OSError`` with ``errno.ELOOP``; the caller turns it into its own
    error). ``O_NONBLOCK`` keeps a FIFO from blocking the open; the caller checks the kind.
    """
    flags = (os.O_RDWR if mode == "r+" else os.O_RDONLY) | _O_CLOEXEC | os.O_NONBLOCK
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        return os.open(filename, flags, dir_fd=dir_fd)
    except PermissionError as e:
        if mode == "r+":
            raise _permission_error(
                e.errno, E.NOT_WRITABLE.format(filename=filename, reason=e.strerror)
            ) from None
        raise _permission_error(
            e.errno, E.NOT_READABLE.format(filename=filename, reason=e.strerror)
        ) from None


def map_fd(fd: int, filename: str, mode: str, size: int) -> torch.UntypedStorage:
    """The first ``size`` bytes of the open file ``fd`` as one storage (a lazy mapping).

    ``"r+"`` maps shared (writes reach the file). ``"r"`` and ``"c"`` map privately
    (copy-on-write) with ``MAP_NORESERVE`` from a read-only descriptor: writable pages, so
    nothing that bypasses tensor methods can crash, and no commit charge, so a file larger
    than RAM + swap maps under the default overcommit policy. The caller checked the size;
    the descriptor may be closed afterwards.
    """
    if size == 0:
        return torch.UntypedStorage(0)
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = mmap.MAP_SHARED if mode == "r+" else mmap.MAP_PRIVATE | MAP_NORESERVE
    addr = _libc.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, E.CANNOT_MAP.format(filename=filename, reason=os.strerror(err)))
    return torch.from_numpy(np.asarray(_Mapping(addr, size))).untyped_storage()


def identity(fd: int) -> tuple[int, int]:
    """``(device, inode)`` of an open file: what a pickled leaf checks when it is mapped again."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def protect(t: Tensor, mode: str, filename: str) -> Tensor:
    """Mark the storage of a read-only leaf's tensor so that its own write methods refuse."""
    if mode == "r":
        s = t.untyped_storage()
        if type(s) is torch.UntypedStorage:
            s.__class__ = ReadOnlyStorage
            cast(ReadOnlyStorage, s)._readonly_filename = filename
    return t


def leaf_tensor(
    storage: torch.UntypedStorage,
    offset: int,
    dtype: torch.dtype,
    shape: torch.Size,
    mode: str = "r+",
    filename: str = "",
) -> Tensor:
    """A contiguous tensor over bytes ``[offset, offset + nbytes)`` of a file's storage.

    The tensor gets a storage of its own that covers exactly its bytes (a slice that keeps the
    mapping alive), so what torch does to "the whole storage" of a leaf (e.g. the clone that
    functionalizes an in-place write under ``torch.compile``) is bounded by the leaf's size.
    """
    n = nbytes_of(shape, dtype)
    if n == 0:
        return protect(torch.empty(shape, dtype=dtype), mode, filename)
    # torch's stubs require ``stride``; it defaults to contiguous
    t = torch.empty(0, dtype=dtype).set_(storage[offset : offset + n], 0, shape)  # type: ignore[call-overload]
    return protect(t, mode, filename)


#: storage methods that write; on a read-only leaf's storages each raises PermissionError
_STORAGE_WRITES = ("copy_", "fill_", "zero_", "__setitem__", "resize_", "byteswap")
#: more writes that only untyped storages have (file and shared-memory plumbing)
_UNTYPED_STORAGE_WRITES = ("_set_from_file", "_share_fd_cpu_", "_share_filename_cpu_")


def _refusing(op: str) -> Any:
    """A storage method that refuses ``op``, naming the read-only file."""

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        untyped = self if isinstance(self, ReadOnlyStorage) else self._untyped_storage
        raise PermissionError(
            E.READ_ONLY.format(filename=untyped._readonly_filename, op=f"storage {op}")
        )

    refuse.__name__ = op
    return refuse


class ReadOnlyStorage(torch.UntypedStorage):
    """The storage of a read-only leaf: reads work; every method that writes raises
    ``PermissionError`` naming the file (``share_memory_`` is a no-op: the data is shared by
    file reference)."""

    _readonly_filename: str  # set when a storage becomes read-only

    def share_memory_(self) -> Any:
        return self


class ReadOnlyTypedStorage(torch.TypedStorage):
    """``leaf.storage()`` of a read-only leaf: reads work, writes raise ``PermissionError``."""

    def share_memory_(self) -> Any:
        return self


for _op in (*_STORAGE_WRITES, *_UNTYPED_STORAGE_WRITES):
    setattr(ReadOnlyStorage, _op, _refusing(_op))
for _op in _STORAGE_WRITES:
    setattr(ReadOnlyTypedStorage, _op, _refusing(_op))
del _op


def mapped_identity(t: Tensor) -> tuple[int, int] | None:
    """``(device, inode)`` of the file mapped at ``t``'s data pointer, from ``/proc/self/maps``
    (for leaves rebuilt by a compiled function, which carry no identity); ``None`` if unknown."""
    ptr = t.data_ptr()
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                parts = line.split()
                lo, _, hi = parts[0].partition(b"-")
                if int(lo, 16) <= ptr < int(hi, 16) and len(parts) >= 5:
                    major, _, minor = parts[3].partition(b":")
                    ino = int(parts[4])
                    if ino == 0:
                        return None
                    return os.makedev(int(major, 16), int(minor, 16)), ino
    except OSError:
        return None
    return None


def check_leaf(t: Tensor, key: str) -> None:
    """``TypeError`` for tensors that cannot be stored as raw bytes."""
    if t.layout != torch.strided:
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what=str(t.layout)))
    if t.is_nested:
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what="nested"))
    if t.device.type == "meta":
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what="meta"))
    dtype_name(t.dtype, where=f" (key {key})")


#: bytes written per system call (and per progress-bar update)
CHUNK = 64 << 20


def _host_chunks(t: Tensor) -> Any:
    """Contiguous host pieces of ``t``, in order, each about :data:`CHUNK` bytes or less."""
    t = t.detach()
    if isinstance(t, MemoryMappedTensor):
        t = t._inner
    t = t.resolve_conj().resolve_neg()
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        yield t.reshape(-1)
        return
    if t.ndim == 0:
        yield t.reshape(1).cpu()
        return
    row = max(1, nbytes_of(t.shape[1:], t.dtype))
    step = max(1, CHUNK // row)
    for i in range(0, t.shape[0], step):
        yield t[i : i + step].contiguous().cpu().reshape(-1)


def write_all(fd: int, data: memoryview, bar: Any) -> None:
    """Write every byte of ``data`` to ``fd`` (loops over short writes)."""
    n = len(data)
    pos = 0
    while pos < n:
        k = os.write(fd, data[pos : pos + CHUNK])
        pos += k
        if bar is not None:
            bar.update(k)


def write_tensor(fd: int, t: Tensor, bar: Any) -> None:
    """Write ``t``'s elements in row-major order as raw bytes at the current position."""
    for piece in _host_chunks(t):
        write_all(fd, memoryview(piece.view(torch.uint8).numpy()).cast("B"), bar)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve(fd: int, nbytes: int, bar: Any) -> None:
    """Give the file ``nbytes`` of zeros with the disk space reserved (``posix_fallocate``)."""
    pos = 0
    while pos < nbytes:
        k = min(CHUNK * 16, nbytes - pos)
        os.posix_fallocate(fd, pos, k)
        pos += k
        if bar is not None:
            bar.update(k)


def create_unique(parent: str, prefix: str, *, directory: bool) -> tuple[int, str]:
    """Create a new file (opened for writing: ``(fd, path)``) or directory (``(-1, path)``)
    with a random name in ``parent``. Unlike ``tempfile``, the permissions follow the umask
    (``tempfile`` makes them private), since the entry is renamed into its final place."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            if directory:
                os.mkdir(path, 0o777)
                return -1, path
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue


def _atomic_file(fname: str, nbytes: int, fill: Any) -> None:
    """Create ``fname`` with ``nbytes`` via a temporary file in the same directory + rename."""
    parent = os.path.dirname(fname)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = create_unique(parent, f".{os.path.basename(fname)}.", directory=False)
    try:
        if fill is None:
            reserve(fd, nbytes, None)
        else:
            fill(fd)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, fname)
        fsync_dir(parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
