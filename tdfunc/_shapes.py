"""Shapes read from a file or a peer: one check, before torch sees them.

A shape in a manifest or a message is input. torch derives sizes, strides and a byte count
from every dim, a zero dim included: ``[2**40, 2**40, 0]`` holds no element, yet building it
ends in torch's untyped ``RuntimeError: Storage size calculation overflowed``, and a shape
below that overflow can still describe more bytes than any tensor has. Every reader of a
shape from a file or a peer (the memory-mapped store, the checkpoint manifest, the metadata
of ``send`` / ``recv`` and the layout of a planned transfer) asks :func:`shape_problem`
before any torch call and raises its own typed error with the answer, naming the key or
field and the file or peer; the store's and the checkpoint's saves refuse a leaf their loads
would refuse (``ValueError``, :data:`SHAPE_UNSAVED`, before anything is written).

The safetensors reader follows the format's reference reader instead (a zero-element
tensor of dims the reference accepts loads, ``[0, 2**62, 2**62]`` included, as the
differential fuzzer checks), and a tensor with elements there is bounded by the file's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: the most bytes the non-zero dims of a shape read from a file or a peer may hold: every
#: size, stride and byte count torch derives from such a shape fits 64 bits with room left
MAX_BYTES = 1 << 62

SHAPE_DIM = "shape {shape}: dim {dim} is {value}, not an int >= 0"
SHAPE_BYTES = (
    "shape {shape} of {dtype}: its non-zero dims hold more than {limit} bytes (2**62), "
    "the limit of a tensor read from a file or a peer"
)
#: a save refuses a leaf its load would refuse (ValueError, before anything is written)
SHAPE_UNSAVED = "key {key}: {detail}; a load would refuse it, so nothing is written"


def _text(shape: Sequence[Any]) -> str:
    text = repr(list(shape))
    return text if len(text) <= 200 else text[:197] + "..."


def shape_problem(shape: Sequence[Any], dtype: torch.dtype) -> str | None:
    """Why ``shape`` (read from a file or a peer) cannot be the shape of a tensor of
    ``dtype``, or ``None`` when it can: every dim is an ``int >= 0`` (not a ``bool``), and
    the dims other than 0 hold at most :data:`MAX_BYTES` bytes of ``dtype`` (a zero dim
    does not make the others harmless: torch computes strides from them). Pure Python, no
    torch call; the product stops at the limit, so a long shape of huge dims costs little.

    Example:
        >>> shape_problem([4, 3], torch.float32) is None
        True
        >>> shape_problem([2**31, 2**31, 0], torch.uint8) is None
        True
        >>> print(shape_problem([2**40, 2**40, 0], torch.float32))
        shape [1099511627776, 1099511627776, 0] of torch.float32: its non-zero dims hold more than 4611686018427387904 bytes (2**62), the limit of a tensor read from a file or a peer
        >>> print(shape_problem([4, -1], torch.float32))
        shape [4, -1]: dim 1 is -1, not an int >= 0
    """
    for i, d in enumerate(shape):
        if type(d) is not int or d < 0:
            return SHAPE_DIM.format(shape=_text(shape), dim=i, value=repr(d)[:40])
    n = dtype.itemsize
    for d in shape:
        if d:
            n *= d
            if n > MAX_BYTES:
                return SHAPE_BYTES.format(shape=_text(shape), dtype=dtype, limit=MAX_BYTES)
    return None
