"""Writing files durably: a tensor's bytes in chunks, reserved disk space, new entries with
unique names, fsync of a directory, and a file created atomically (temporary file + rename).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import torch
from torch import Tensor

from ._leafspec import nbytes_of

#: bytes written per system call (and per progress-bar update)
CHUNK = 64 << 20


def _host_chunks(t: Tensor) -> Any:
    """Contiguous host pieces of the plain tensor ``t``, in order, each about :data:`CHUNK`
    bytes or less (a memory-mapped leaf is unwrapped by the class module's ``write_tensor``:
    this module sits below the class)."""
    t = t.detach().resolve_conj().resolve_neg()
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


def write_plain(fd: int, t: Tensor, bar: Any) -> None:
    """Write the plain tensor ``t``'s elements in row-major order as raw bytes at the current
    position."""
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
