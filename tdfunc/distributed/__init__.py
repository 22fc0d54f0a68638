"""Sharded TensorDicts: DTensor leaves, redistribution as compiled graphs, send/recv between meshes.

A TensorDict (or tensorclass) whose leaves are ``DTensor`` s over a ``DeviceMesh`` is an
ordinary value here: every function takes one and returns a new one of the same type.

* :func:`distribute`, :func:`from_local`: plain leaves -> DTensors.
* :func:`redistribute`: new placements. The whole transition runs as one
  ``torch.compile(fullgraph=True)`` graph, cached per (structure, placements); leaves that share
  a transition and a dtype are packed into one flat buffer, so a container of many small
  leaves costs the collectives of a single tensor.
* :func:`to_local`, :func:`full_tensor`: DTensors -> local shards or full tensors.
* :func:`send`, :func:`recv`: move a sharded container between groups of ranks in one
  consolidated message per peer, with structured JSON metadata (never pickle). Between two
  meshes (strategy ``"plan"``, the default for a receiving mesh), each receiver gets exactly
  the slices it keeps; :class:`Transfer` is the reusable form (weight sync every step) and
  :func:`transfer_plan` the pure planner behind both.
* :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`export_safetensors`,
  :func:`checkpoint_digest`: checkpoints on ``torch.distributed.checkpoint`` (each rank
  writes its shards, replicated leaves once), resharded on load to any number of ranks and
  placements (or one process, no group), with the container's structure, a SHA-256 of every
  chunk, an atomic commit, a digest to load by, and a loader that never unpickles.

Every function runs on every rank of the mesh (collectives inside), like DTensor itself; the
ranks check once per transition that they ask for the same one (``ValueError`` on all of them
otherwise, never mixed data). :func:`send` / :func:`recv` wait for their peer at most
``timeout`` seconds. The examples below run in a one-process gloo group; real programs start
one process per rank (``torchrun``; ``examples/dtensor_transfer.py`` and
``examples/weight_sync.py`` use ``tdfunc.testing.launch``).

Example:
    >>> import torch, torch.distributed as dist, tdfunc
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, Replicate
    >>> from tdfunc.distributed import distribute, redistribute, full_tensor
    >>> _ = dist.is_initialized() or dist.init_process_group(
    ...     "gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1,))
    >>> td = tdfunc.TensorDict(w=torch.arange(6.0).reshape(3, 2), b=torch.ones(3), batch_size=[3])
    >>> sharded = distribute(td, mesh, [Shard(0)])
    >>> type(sharded["w"]).__name__, sharded["w"].placements
    ('DTensor', (Shard(dim=0),))
    >>> full_tensor(redistribute(sharded, [Replicate()], backend="eager"))["w"][2].tolist()
    [4.0, 5.0]
"""

import importlib
from collections.abc import Callable
from typing import Any

from .. import _deprecate
from ._checkpoint.api import (
    PendingSave,
    checkpoint_digest,
    export_safetensors,
    load_checkpoint,
    save_checkpoint,
)
from ._common.caches import cache_clear
from ._common.errors import (
    CheckpointConflictError,
    CheckpointCorruptError,
    CheckpointDigestError,
    CheckpointError,
    TransferMetadataError,
)
from ._redistribute.local import distribute, from_local, to_local
from ._redistribute.redistribute import DEFAULT_BACKEND, full_tensor, redistribute
from ._training.step import ShardedStep, sharded_step
from ._transfer.p2p import DEFAULT_TIMEOUT, recv, send
from ._transfer.plan import Traffic, TransferPlan, transfer_plan
from ._transfer.session import Transfer

_LAUNCH = ("launch", "free_port", "RankError")
_CODECS = ("encode_placement", "encode_placements", "decode_placement", "decode_placements")


def _late(module: str, name: str) -> Callable[[], Any]:
    """Read ``name`` from a private module of this package when called."""
    return lambda: getattr(importlib.import_module(module, __name__), name)


_TEST_HELPER = "tdfunc.distributed._common.launch.{} (a test helper, not part of the API)"
_TESTING = "tdfunc.testing.{} (the test launcher)"
_CODEC = (
    "send / recv, which encode placements themselves (tdfunc.distributed._common.placements.{})"
)

#: names that left the public API: deprecated aliases for one release
__getattr__ = _deprecate.module_getattr(
    __name__,
    {
        **{
            n: (
                _late("._common.launch", n),
                (_TESTING if n != "free_port" else _TEST_HELPER).format(n),
            )
            for n in _LAUNCH
        },
        **{n: (_late("._common.placements", n), _CODEC.format(n)) for n in _CODECS},
    },
)


def __dir__() -> list[str]:
    return list(__all__)  # not the names this module imported for itself (importlib, Any...)


__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_TIMEOUT",
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointDigestError",
    "CheckpointError",
    "PendingSave",
    "ShardedStep",
    "Traffic",
    "Transfer",
    "TransferMetadataError",
    "TransferPlan",
    "cache_clear",
    "checkpoint_digest",
    "distribute",
    "export_safetensors",
    "from_local",
    "full_tensor",
    "load_checkpoint",
    "recv",
    "redistribute",
    "save_checkpoint",
    "send",
    "sharded_step",
    "to_local",
    "transfer_plan",
]
