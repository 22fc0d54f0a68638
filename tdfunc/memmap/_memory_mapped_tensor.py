"""The :class:`MemoryMappedTensor` class, a traceable wrapper subclass over the plain mapped
tensor, and the argument/result plumbing of its ``__torch_function__`` and
``__torch_dispatch__``. The design is in ``_tensor.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from .._compat import (
    DisableTorchFunctionSubclass,
    is_alias_of,
    is_functional_tensor,
    is_functorch_wrapped_tensor,
    make_wrapper_subclass,
)
from . import _errors as E
from ._leafspec import as_shape, check_leaf, check_mode, dtype_name, nbytes_of
from ._mapping import leaf_tensor, map_fd, mapped_identity, open_fd
from ._op_rules import _KINDS, _META, _PLAIN, _READ, _WRITE, _arg, _kind, _mapped, _op_info
from ._pickling import remap
from ._readonly import ReadOnlyStorage, ReadOnlyTypedStorage
from ._writing import _atomic_file, write_plain


def _unwrap(x: Any) -> Any:
    if isinstance(x, MemoryMappedTensor):
        return x._inner
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def write_tensor(fd: int, t: Tensor, bar: Any) -> None:
    """Write ``t``'s elements (a plain tensor or a leaf: its mapped bytes, read directly) in
    row-major order as raw bytes at the current position of ``fd``."""
    write_plain(fd, t._inner if isinstance(t, MemoryMappedTensor) else t, bar)


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
    """Unpickle a leaf: map the file again (:func:`._pickling.remap`, which checks it is
    still the file the sender mapped) and wrap the tensor over it."""
    args = (filename, mode, offset, nbytes, dtype, shape, stride, storage_offset, ident)
    inner, ident = remap(*args)
    return MemoryMappedTensor._wrap(inner, filename, mode, offset, ident)


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
        "Reads without ``__torch_dispatch__``" in the docstring of ``_tensor.py``)."""
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
        filename: str | os.PathLike[str] | None = None,
        *,
        exist_ok: bool = False,
    ) -> MemoryMappedTensor:
        """A new read-write (``"r+"``) file of ``shape`` and ``dtype``, disk space reserved.

        The space is reserved with ``posix_fallocate``, so a full disk is reported here, not
        as a crash on a later write. The contents read as zeros. Without a ``filename`` (as
        tensordict's anonymous map) the file is made in a temporary folder and removed at
        once: the mapping lives as long as the tensor, nothing is left on disk, and the
        tensor cannot be opened again by name (pickling it raises).

        Example:
            >>> import os, tempfile, torch
            >>> from tdfunc import MemoryMappedTensor
            >>> f = os.path.join(tempfile.mkdtemp(), "e.bin")
            >>> MemoryMappedTensor.empty((2, 2), torch.float64, f).shape
            torch.Size([2, 2])
            >>> MemoryMappedTensor.empty((3,), torch.int64).tolist()  # no file left behind
            [0, 0, 0]
        """
        shape = as_shape(shape)
        dtype_name(dtype)
        if filename is None:
            folder = tempfile.mkdtemp(prefix="tdfunc-anonymous-")
            try:
                return cls.empty(shape, dtype, os.path.join(folder, "anonymous.bin"))
            finally:
                shutil.rmtree(folder, ignore_errors=True)  # the mapping outlives the file
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
        filename: str | os.PathLike[str] | None = None,
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
