"""What the eager fused steps of :mod:`tdfunc.optim` share: which leaves torch's fused
kernels take, their inputs (hyperparameters as floats, the buffers they may write: copies, or
the donated tensors), the step counts they read, and weight-decay masks as kernel calls.

Each optimizer with a kernel gives :func:`tdfunc.optim._core.build` a ``kernel(lr, wd, params,
grads, buffers, count, picks)`` that writes ``params`` and ``buffers`` in place; ``build``
checks the state and leaves, calls :func:`fused_inputs` and wraps the result for
:func:`tdfunc.optim.step`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _compat as C
from .._jagged._layout import layout_of

#: ``kernel(lr, weight_decay, params, grads, buffers, count, decay picks)``: writes ``params``
#: and ``buffers`` (tensors this module gave it) in place
Kernel = Callable[
    [float, float, list[Tensor], list[Tensor], dict[str, list[Tensor]], Tensor, "list[int] | None"],
    None,
]


def fusable(lists: list[list[Tensor]]) -> bool:
    """Leaves a fused kernel takes: plain strided tensors (or parameters) of a floating
    dtype, on cpu or cuda, not batched by ``torch.vmap``, and at each position one dtype,
    device and shape across the lists; or, at a position, DTensors on one mesh with the same
    placements (none partial) whose local tensors are such tensors (the update is
    elementwise, so the kernel runs on the local tensors: :func:`local_lists`).

    Example:
        >>> import torch
        >>> fusable([[torch.zeros(2)], [torch.ones(2)]]), fusable([[torch.zeros(2)], [torch.ones(3)]])
        (True, False)
    """
    first = lists[0]
    if not first or first[0].device.type not in ("cpu", "cuda"):
        return False
    dtensor = _dtensor_type()
    for row in zip(*lists):
        x = row[0]
        if dtensor is not None and type(x) is dtensor:
            if not _same_spec(row, dtensor):
                return False
            row = tuple(y._local_tensor for y in row)
        if not _plain_row(row):
            return False
    return True


def _plain_row(row: tuple[Tensor, ...]) -> bool:
    """Whether the tensors of one position are plain strided tensors of one floating dtype,
    device and shape."""
    x = row[0]
    dtype, device, shape = x.dtype, x.device, x.shape
    if dtype not in _FLOATS:
        return False
    batched = C.is_batchedtensor
    for y in row:
        if (
            (type(y) is not Tensor and type(y) is not torch.nn.Parameter)
            or y.dtype != dtype
            or y.device != device
            or y.shape != shape
            or layout_of(y) != torch.strided  # asked under transform wrappers
            or batched(y)
        ):
            return False
    return True


def _dtensor_type() -> type | None:
    """``DTensor`` if ``torch.distributed.tensor`` is loaded (no DTensor exists otherwise:
    this never imports it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def _same_spec(row: tuple[Tensor, ...], dtensor: type) -> bool:
    """Whether every tensor of ``row`` is a DTensor with the first one's mesh, placements and
    global shape, and none of the placements is partial (a pending sum)."""
    x: Any = row[0]
    mesh, placements, shape = x.device_mesh, x.placements, x.shape
    if any(p.is_partial() for p in placements):
        return False
    return all(
        type(y) is dtensor
        and y.device_mesh == mesh  # type: ignore[attr-defined]
        and y.placements == placements  # type: ignore[attr-defined]
        and y.shape == shape
        for y in row
    )


def local_lists(*lists: list[Tensor]) -> list[list[Tensor]]:
    """The lists with each DTensor replaced by its local tensor (the same memory: a kernel
    writing the local tensor writes the DTensor).

    Example:
        >>> import torch
        >>> t = torch.zeros(1)
        >>> local_lists([t])[0][0] is t
        True
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(lists)
    return [[x._local_tensor if type(x) is dtensor else x for x in ls] for ls in lists]  # type: ignore[attr-defined]


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_inputs(
    g: list[Tensor], p: list[Tensor], bufs: dict[str, list[Tensor]], h: dict[str, Any], donate: bool
) -> tuple[float, float, list[Tensor], dict[str, list[Tensor]]] | None:
    """What a fused kernel takes: ``lr`` and ``weight_decay`` as floats, and the params and
    buffers it may write (copies, or the donated tensors); None when no kernel fits."""
    lr, wd = scalar(h["lr"]), scalar(h["weight_decay"])
    if lr is None or wd is None or not fusable([g, p, *bufs.values()]):
        return None
    return lr, wd, own(p, donate), {k: own(v, donate) for k, v in bufs.items()}


def scalar(v: Any) -> float | None:
    """A hyperparameter as a Python float for a fused kernel: numbers, and 0-d tensors (one
    value for the whole step); None for anything else (per-member values)."""
    if isinstance(v, Tensor):
        return float(v) if v.ndim == 0 else None
    return float(v)


def own(ls: list[Tensor], donate: bool) -> list[Tensor]:
    """The buffers a fused kernel may write: the given ones when donated, copies otherwise."""
    return ls if donate else [x.clone() for x in ls]


def steps_tensor(count: Tensor, n: int) -> list[Tensor]:
    """The step counts a fused kernel reads (after the increment): one float64 tensor,
    ``n`` times (float64 holds every count exactly)."""
    t = (count + 1).to(torch.float64)
    return [t] * n


def run_groups(
    run: Callable[[list[list[Tensor]], float], None],
    lists: list[list[Tensor]],
    decay: float,
    picks: list[int] | None,
) -> None:
    """``run(lists, decay)`` over all leaves, or, with a decay mask, over the leaves
    ``picks`` with ``decay`` and over the others with none (the kernels take one decay).
    Empty lists (an unused argument of the kernel) stay empty."""
    if picks is None or decay == 0:
        run(lists, decay)
        return
    chosen = set(picks)
    rest = [i for i in range(len(lists[0])) if i not in chosen]
    for idx, d in ((picks, decay), (rest, 0.0)):
        if idx:
            run([[x[i] for i in idx] if x else x for x in lists], d)
