"""What a memory-mapped leaf can be: its modes, its dtypes (with the names written to
manifests), its shape and byte size, and the checks of each. No file access, no torch dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._jagged._layout import under_wrappers
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


def check_leaf(t: Tensor, key: str) -> None:
    """``TypeError`` for tensors that cannot be stored as raw bytes (what the leaf is, asked
    under its ``torch.func`` / ``torch.vmap`` wrappers)."""
    base = under_wrappers(t)[0]
    if base.layout != torch.strided:
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what=str(base.layout)))
    if base.is_nested:
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what="nested"))
    if t.device.type == "meta":
        raise TypeError(E.UNSUPPORTED_LEAF.format(key=key, what="meta"))
    dtype_name(t.dtype, where=f" (key {key})")
