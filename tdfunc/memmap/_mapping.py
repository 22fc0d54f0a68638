"""Opening and memory-mapping files: ``open_fd``, ``map_fd`` (``mmap`` through libc, unmapped
when the last tensor over it is freed), a file's identity, and :func:`leaf_tensor`, the tensor
over one leaf's bytes of a mapping. The design is in ``_tensor.py`` ("Mapping").
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import _errors as E
from ._leafspec import nbytes_of
from ._readonly import protect

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
