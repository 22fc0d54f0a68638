"""Which dim a ``torch.vmap`` level maps over, readable eagerly and under ``torch.compile``.

Kept in its own module so that ``import tdfunc`` does not import ``torch._dynamo``: it is
imported on first use, from inside a vmapped call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _errors as E
from ._compat import maybe_get_bdim


@torch.compiler.assume_constant_result
def _vmapped_dim(t: Tensor) -> int:
    # a property of the trace (in_dims are Python ints), so a constant for torch.compile
    return maybe_get_bdim(t)


def check_vmapped_dim(t: Tensor, batch_dims: int, key: str) -> None:
    """Raise ``ValueError`` when the innermost vmap maps a non-batch dim of leaf ``t``.

    ``t`` is a batched tensor that just lost one logical dim at unflatten (a vmap input);
    ``batch_dims`` is the node's batch ndim before vmap.
    """
    dim = _vmapped_dim(t)
    if dim >= batch_dims:
        raise ValueError(E.VMAP_DIM.format(dim=dim, key=key, batch_dims=batch_dims))
