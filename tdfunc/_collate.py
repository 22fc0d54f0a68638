"""DataLoader support: torch's default collate stacks TensorDicts and tensorclasses.

Importing this module registers one collate function for :class:`tdfunc.TensorDict` and every
tensorclass (their common base) in ``torch.utils.data._utils.collate.default_collate_fn_map``,
the extension point torch documents for ``default_collate`` / ``collate``. With it, a Dataset
whose items are TensorDicts (or tuples / dicts holding them) works with a plain
``DataLoader(ds, batch_size=32, num_workers=2)``: a batch is ``tdfunc.stack(items)``, with a
new leading batch dim. Memory-mapped leaves are read into plain tensors by the stack, so the
batch does not depend on the store.

Inside a worker process, the stacked leaves are moved to shared memory (as torch does for
plain tensors), so sending the batch to the main process does not pickle their data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import get_worker_info

from . import _ops as ops
from ._compat import register_default_collate
from ._tree import Node

__all__ = ["collate_nodes"]


def collate_nodes(
    batch: Sequence[Any], *, collate_fn_map: dict[type | tuple[type, ...], Callable] | None = None
) -> Any:
    """Stack a list of TensorDicts / tensorclasses of one structure into one batch.

    It is what ``torch.utils.data.default_collate`` calls for these types once tdfunc is
    imported; a different structure or leaf shape raises ``ValueError`` naming the key.

    Args:
        batch: the items of one batch (same type and structure).
        collate_fn_map: passed by torch's ``collate``; unused.

    Example:
        >>> import torch, tdfunc
        >>> from torch.utils.data import default_collate
        >>> items = [tdfunc.TensorDict(x=torch.full((3,), float(i))) for i in range(4)]
        >>> batch = default_collate(items)
        >>> type(batch).__name__, batch.batch_size, batch["x"][:, 0].tolist()
        ('TensorDict', torch.Size([4]), [0.0, 1.0, 2.0, 3.0])
    """
    del collate_fn_map
    # a container is already a batch: a DataLoader over a container reads one with
    # Container.__getitems__ (one gather)
    stacked = batch if isinstance(batch, Node) else ops.stack(list(batch))
    if get_worker_info() is None:
        return stacked
    return ops.apply(stacked, _to_shared)


def _to_shared(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and not t.is_shared():
        return t.share_memory_()
    return t


register_default_collate(Node, collate_nodes)
