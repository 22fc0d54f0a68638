"""Schedules: functions of the number of updates done so far (an int64 tensor of the
state's step count) to a float64 tensor. Pure tensor arithmetic, so a schedule inside a
compiled step is part of the graph (no recompiles as the count moves) and works per member
under ``torch.vmap``. Pass one as an optimizer's ``lr`` (called with the count before the
update, like ``torch.optim.lr_scheduler`` stepped after each ``optimizer.step()``) or to
:func:`tdfunc.optim.scale_by_schedule`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import _errors as E
from ._core import Schedule


def _f(count: Tensor) -> Tensor:
    return count.to(torch.float64)


def _positive_int(what: str, name: str, v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(
            E.BAD_SCHEDULE.format(what=what, detail=f"{name} must be an int > 0, got {v!r}")
        )
    return v


def constant(value: float) -> Schedule:
    """``value`` at every step.

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> optim.constant(0.1)(torch.tensor(5)).item()
        0.1
    """

    def schedule(count: Tensor) -> Tensor:
        return torch.full_like(_f(count), value)

    return schedule


def linear(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps`` updates,
    starting after ``transition_begin``; constant before and after.

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.linear(0.0, 1.0, transition_steps=4)
        >>> [s(torch.tensor(i)).item() for i in (0, 2, 4, 9)]
        [0.0, 0.5, 1.0, 1.0]
    """
    steps = _positive_int("linear", "transition_steps", transition_steps)

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp((_f(count) - transition_begin) / steps, 0.0, 1.0)
        return init_value + frac * (end_value - init_value)

    return schedule


def linear_warmup(peak_value: float, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps`` updates,
    then ``peak_value`` (``torch.optim.lr_scheduler.LinearLR`` with
    ``start_factor=init_value / peak_value``, ``total_iters=warmup_steps``).

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.linear_warmup(1.0, warmup_steps=2)
        >>> [s(torch.tensor(i)).item() for i in range(4)]
        [0.0, 0.5, 1.0, 1.0]
    """
    return linear(init_value, peak_value, warmup_steps)


def cosine_decay(init_value: float, decay_steps: int, end_value: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``end_value`` over ``decay_steps`` updates, then
    ``end_value``: the closed form of ``torch.optim.lr_scheduler.CosineAnnealingLR``
    (``T_max=decay_steps``, ``eta_min=end_value``).

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.cosine_decay(1.0, decay_steps=4)
        >>> [round(s(torch.tensor(i)).item(), 4) for i in (0, 2, 4, 6)]
        [1.0, 0.5, 0.0, 0.0]
    """
    steps = _positive_int("cosine_decay", "decay_steps", decay_steps)

    def schedule(count: Tensor) -> Tensor:
        t = torch.clamp(_f(count), max=float(steps))
        return end_value + (init_value - end_value) * (1.0 + torch.cos(math.pi * t / steps)) / 2.0

    return schedule


def step_decay(init_value: float, step_size: int, gamma: float = 0.1) -> Schedule:
    """``init_value * gamma ** (count // step_size)``, as ``torch.optim.lr_scheduler.StepLR``.

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.step_decay(1.0, step_size=2, gamma=0.5)
        >>> [s(torch.tensor(i)).item() for i in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    size = _positive_int("step_decay", "step_size", step_size)

    def schedule(count: Tensor) -> Tensor:
        k = torch.div(count, size, rounding_mode="floor")
        return init_value * torch.pow(torch.full_like(_f(count), gamma), _f(k))

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i]`` from ``boundaries[i - 1]`` on, each called with the count since its
    start (``len(boundaries) == len(schedules) - 1``, increasing).

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.join_schedules(
        ...     [optim.linear_warmup(1.0, 2), optim.cosine_decay(1.0, 2)], boundaries=[2]
        ... )
        >>> [round(s(torch.tensor(i)).item(), 4) for i in range(5)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if len(boundaries) != len(schedules) - 1 or not schedules:
        raise ValueError(
            E.BAD_SCHEDULE.format(
                what="join_schedules",
                detail=f"{len(schedules)} schedules need {len(schedules) - 1} boundaries, got "
                f"{len(boundaries)}",
            )
        )
    if any(b <= a for a, b in itertools.pairwise(boundaries)) or any(b < 0 for b in boundaries):
        raise ValueError(
            E.BAD_SCHEDULE.format(
                what="join_schedules",
                detail=f"boundaries must increase from 0, got {list(boundaries)}",
            )
        )
    scheds, bounds = list(schedules), [int(b) for b in boundaries]

    def schedule(count: Tensor) -> Tensor:
        out = scheds[0](count)
        for b, s in zip(bounds, scheds[1:]):
            out = torch.where(count >= b, s(count - b), out)
        return out

    return schedule


def warmup_cosine_decay(
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> Schedule:
    """Linear warm-up to ``peak_value`` over ``warmup_steps``, then cosine decay to
    ``end_value`` until ``decay_steps`` (counted from the start), then ``end_value``.

    Example:
        >>> import torch
        >>> from tdfunc import optim
        >>> s = optim.warmup_cosine_decay(1.0, warmup_steps=2, decay_steps=4)
        >>> [round(s(torch.tensor(i)).item(), 4) for i in range(6)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    if decay_steps <= warmup_steps:
        raise ValueError(
            E.BAD_SCHEDULE.format(
                what="warmup_cosine_decay",
                detail=f"decay_steps ({decay_steps}) must exceed warmup_steps ({warmup_steps})",
            )
        )
    return join_schedules(
        [
            linear_warmup(peak_value, warmup_steps, init_value),
            cosine_decay(peak_value, decay_steps - warmup_steps, end_value),
        ],
        [warmup_steps],
    )
