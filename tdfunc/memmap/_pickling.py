"""Unpickling a leaf: :func:`remap` maps the file again, after checking that it is still
the file the sender mapped, and returns the plain tensor over it. The class module's
``_rebuild`` (what ``MemoryMappedTensor.__reduce_ex__`` names) wraps it; this module sits
below the class and never imports it.

Pickles made by earlier versions name ``tdfunc.memmap._tensor._rebuild``, which
``_tensor.py`` re-exports: keep it importable from there.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import torch
from torch import Tensor

from . import _errors as E
from ._leafspec import DTYPES, check_mode
from ._mapping import map_fd, open_fd
from ._readonly import protect


def remap(
    filename: str,
    mode: str,
    offset: int,
    nbytes: int,
    dtype: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
    ident: tuple[Any, ...] | None = None,
) -> tuple[Tensor, tuple[Any, ...] | None]:
    """Map a pickled leaf's file again (no data travelled), after checking that the file at
    ``filename`` is still the one the sender mapped (``StoreReplacedError`` otherwise):
    the protected plain tensor over its bytes and the file's identity."""
    dt = DTYPES[dtype]
    check_mode(mode)
    if nbytes == 0:
        inner = torch.empty(0, dtype=dt).set_(
            torch.UntypedStorage(0), storage_offset, shape, stride
        )
        return protect(inner, mode, filename), None
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
    return protect(inner, mode, filename), ident


def _store_id_at(data_file: str) -> Any:
    """The ``store_id`` in the manifest next to ``data_file`` (``None`` if unreadable)."""
    try:
        with open(os.path.join(os.path.dirname(data_file), "manifest.json"), "rb") as f:
            return json.loads(f.read()).get("store_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
