"""What Dynamo traces instead of the eager readers of :func:`tdfunc.functional_call`.

Each function here is the traceable twin of an eager function of ``_state``, ``_versions`` or
``_plan``, which Dynamo traces in its place (``torch.compiler.substitute_in_graph``): the same
rule, read the way Dynamo can (the reasons are next to each twin).

They are registered with :func:`tdfunc._twins.traced_as`: at once when ``torch._dynamo`` is
already imported, otherwise right after it gets imported, before Dynamo can trace anything.
Registering imports nothing, so an eager-only process never imports ``torch._dynamo`` because
of :func:`tdfunc.functional_call` (``tdfunc.nn`` imports this module).
"""

from __future__ import annotations

from collections.abc import Hashable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from .._compat import comptime, reparametrize_module
from .._twins import traced_as
from ._plan import Live, lookup
from ._state import private_copies, private_copy, swapped
from ._versions import bump_written, record_unrecorded_writes, write_marks


@traced_as(write_marks)
def _traced_write_marks(tensors: list[Tensor], storages: list[bool]) -> list[tuple[int, int, bool]]:
    # fake tensors have no copy-on-write memory and no storage to swap (see _versions)
    return [(o.shape[0], 0, False) for o in torch.ops.tdfunc.versions(tensors)]


@traced_as(record_unrecorded_writes)
def _traced_record_unrecorded_writes() -> None:
    # fake tensors record no version for in-place foreach ops (torch 2.13-2.15: a buffer
    # updated with torch._foreach_add_ keeps its version while Dynamo traces): at trace time,
    # bump the example tensors every traced op writes by its schema (comptime runs the
    # function on Dynamo's graph while tracing; nothing of it is in the compiled program)
    comptime(lambda ctx: bump_written(ctx.graph()))


@traced_as(private_copy)
def _traced_private_copy(t: Tensor, buffer: bool = False) -> Tensor:
    # A compiled graph is functional: a copy is a clone there, whatever it is eagerly, and
    # inductor removes the clones nothing writes (``aten._lazy_clone`` would stay an op call)
    return t.clone()


@traced_as(private_copies)
def _traced_private_copies(tensors: list[Tensor], buffers: list[bool]) -> list[Tensor]:
    # as private_copy's twin, for each tensor
    return [t.clone() for t in tensors]


@traced_as(swapped)
def _traced_swapped(
    module: torch.nn.Module, swap: dict[str, Tensor], targets: list[tuple[dict[str, Any], str]]
) -> AbstractContextManager[None]:
    # torch's reparametrisation: Dynamo lets it mutate the module inside higher-order ops.
    # A module Dynamo will not trace (torch 2.15: RNN, GRU, LSTM without ``allow_rnn``) is a
    # placeholder there whose attributes the reparametrisation cannot read (an internal error);
    # a method call on it breaks the graph instead, and the swap then runs eagerly. On any
    # other module the call traces to nothing.
    module._parameters.keys()
    return reparametrize_module(module, swap, stack_weights=True)


@traced_as(lookup)
def _traced_lookup(
    module: nn.Module, state: Any, strict: bool, tie_weights: bool
) -> tuple[Live | None, Hashable | None]:
    # the plan cache is eager boundary code: a traced call always takes the full path (its
    # result is a constant of the graph anyway) and stores nothing
    return None, None


__all__: list[str] = []
