"""A tensorclass used by the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import torch

from tdfunc import tensorclass


@tensorclass
class Pair:
    """Two tensors with a shared batch dim."""

    x: torch.Tensor
    y: torch.Tensor
