"""Episodes of a rollout: :func:`split_trajectories` cuts a rollout ``[N, T]`` at its done
flags into a batch of episodes, jagged (one row per episode, its steps the ragged dim) or
padded with a mask; :func:`merge_trajectories` puts the steps of such a batch back in the
rollout's layout.

The order is torchrl's ``split_trajectories``: environment after environment, each one's
episodes in time order; an episode still running at the end of the rollout is cut there, and
no episode spans two environments. Everything is computed by tensor ops over the whole
rollout (no loop over environments or episodes, no value read back by Python): the steps
keep their order, so the jagged leaves' values are the rollout's leaves reshaped to
``[N * T, ...]`` and only the offsets depend on the flags. The number of episodes and their
longest length are data-dependent sizes: ``torch.compile(fullgraph=True)`` traces them as
unbacked sizes (the output size of ``torch.nonzero``), one graph for every pattern of flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._compat import assert_async
from .._jagged._layout import is_jagged
from .._keys import ABSENT, as_path, fmt_key, get_path
from .._tree import KeyPath, Node, is_node, leaves, leaves_with_paths, map_leaves

Key = str | tuple[str, ...]

NOT_A_CONTAINER = "{fn} expects a TensorDict or tensorclass, got {typ}"
NO_TIME_DIM = (
    "split_trajectories: the rollout has batch_size (); it needs a time dim (batch_size (T,) "
    "or (N, T)): build it with batch_size=[N, T]"
)
BAD_TIME_DIM = "{fn}: time_dim={time_dim} is not a batch dim of batch_size {batch}"
EMPTY_ROLLOUT = "split_trajectories: the rollout has no step (batch_size {batch})"
FLAG_MISSING = (
    "{fn}: no flag at key {key} (keys of the rollout: {available}); name the done flag with "
    "done_key=... (several keys are OR-ed: done_key=[('next', 'terminated'), ('next', "
    "'truncated')])"
)
FLAG_NOT_TENSOR = "{fn}: the flag at key {key} is a {typ}, not a tensor"
FLAG_DTYPE = (
    "{fn}: the flag at key {key} has dtype {dtype}; done / terminated / truncated flags are "
    "torch.bool (cast it with .bool())"
)
FLAG_SHAPE = (
    "{fn}: the flag at key {key} has shape {shape}; it must have the rollout's batch shape "
    "{batch}, or that shape with a trailing dim of 1"
)
MASK_KEY_TAKEN = (
    "split_trajectories: the mask key {key} is already an entry of the rollout; pass "
    "mask_key=... to write the mask elsewhere"
)
NOT_EPISODES = (
    "merge_trajectories: key {key} is not a jagged leaf ({what}); a batch of episodes has "
    "jagged leaves (split_trajectories(...)) or, padded, a mask at mask_key"
)
HOLES = (
    "merge_trajectories: the jagged leaf at key {key} has holes (lengths); compact it first "
    "(tdfunc.as_jagged)"
)
EPISODES_BATCH = (
    "merge_trajectories: the episodes have batch_size {batch}; jagged episodes have one batch "
    "dim, padded ones two (episode, step) with the mask at mask_key"
)
MASK_NOT_BOOL = (
    "merge_trajectories: the mask at key {key} must be a torch.bool tensor of the batch shape "
    "{batch}, got {what}"
)
STEP_COUNT = (
    "merge_trajectories: key {key} holds {got} steps but batch_size {batch} has {want} positions"
)
MASK_COUNT = "merge_trajectories: the mask does not hold as many steps as batch_size {batch}"


def _check_container(x: Any, fn: str) -> None:
    if not is_node(x):
        raise TypeError(NOT_A_CONTAINER.format(fn=fn, typ=type(x).__name__))


def _time_dim(time_dim: int, nb: int, batch: Sequence[int], fn: str) -> int:
    if not isinstance(time_dim, int) or isinstance(time_dim, bool) or not -nb <= time_dim < nb:
        raise ValueError(BAD_TIME_DIM.format(fn=fn, time_dim=time_dim, batch=tuple(batch)))
    return time_dim % nb


def flag_paths(keys: Any) -> tuple[KeyPath, ...]:
    """One key (a string or a tuple path) or a list of keys -> their paths."""
    if isinstance(keys, (str, tuple)):
        return (as_path(keys),)
    return tuple(as_path(k) for k in keys)


def read_flag(node: Any, path: KeyPath, fn: str) -> Tensor:
    """The bool flag at ``path`` of shape ``batch_size`` (a trailing dim of 1 dropped);
    ``KeyError`` / ``TypeError`` / ``ValueError`` naming the key."""
    value = get_path(node, path, ABSENT)
    if value is ABSENT:
        raise KeyError(
            FLAG_MISSING.format(fn=fn, key=fmt_key(path), available=list(node._tdf_keys()))
        )
    if not isinstance(value, Tensor):
        raise TypeError(FLAG_NOT_TENSOR.format(fn=fn, key=fmt_key(path), typ=type(value).__name__))
    if value.dtype != torch.bool:
        raise TypeError(FLAG_DTYPE.format(fn=fn, key=fmt_key(path), dtype=value.dtype))
    batch = node._batch_size
    if value.shape != batch and value.shape != (*batch, 1):
        raise ValueError(
            FLAG_SHAPE.format(
                fn=fn, key=fmt_key(path), shape=tuple(value.shape), batch=tuple(batch)
            )
        )
    return value.reshape(batch)


def any_flag(node: Any, paths: Sequence[KeyPath], fn: str) -> Tensor:
    """The OR of the flags at ``paths``, of shape ``batch_size``."""
    flags = [read_flag(node, p, fn) for p in paths]
    out = flags[0]
    for f in flags[1:]:
        out = out | f
    return out


def _steps(x: Tensor, nb: int, t: int) -> Tensor:
    """A leaf with its batch dims (time moved last) flattened into one: ``[N * T, ...]``."""
    if t != nb - 1:
        x = x.movedim(t, nb - 1)
    return x.reshape((-1, *x.shape[nb:]))


def split_trajectories(
    rollout: Any,
    *,
    done_key: Key | Sequence[Key] = ("next", "done"),
    time_dim: int = -1,
    padded: bool = False,
    mask_key: Key = "mask",
) -> Any:
    """The episodes of a rollout, cut at its done flags: one batch row per episode.

    ``rollout`` has ``batch_size`` ``(T,)`` or ``(N, T)`` (or more leading dims, flattened
    in order): ``N`` environments over ``T`` steps. An episode ends after each step whose
    flag is set, and at the end of the rollout (an episode still running is cut there; no
    episode spans two environments). The episodes come environment after environment, each
    one's in time order, as torchrl's ``split_trajectories`` orders them.

    With ``padded=False`` the result has ``batch_size`` ``(E,)`` (``E`` episodes) and every
    leaf is jagged, as :func:`tdfunc.as_jagged` makes them (``torch.nested``,
    ``layout=torch.jagged``, the steps its ragged dim; all leaves share one offsets tensor).
    With ``padded=True`` it has ``batch_size`` ``(E, L)`` (``L`` the longest episode), each
    episode's steps first in its row and zeros after them, and under ``mask_key`` a bool
    tensor ``(E, L)`` that is ``True`` at the steps (torchrl's padded layout and ``"mask"``).
    The input is not modified. :func:`merge_trajectories` is the inverse.

    Compiled (``torch.compile(fullgraph=True)``), both forms are one graph whatever the flags
    (``E`` and ``L`` are unbacked sizes, from ``torch.nonzero``); no value is read back.

    Args:
        rollout: a TensorDict or tensorclass with a time dim.
        done_key: the key of the flag that ends an episode, or a list of keys whose flags are
            OR-ed (``[("next", "terminated"), ("next", "truncated")]``). Each flag is a bool
            tensor of the rollout's batch shape, or that shape with a trailing dim of 1.
        time_dim: the batch dim that is time (default the last, as torchrl); the others
            are environments.
        padded: give the padded form with a mask instead of jagged leaves.
        mask_key: where the padded form writes its mask.

    Returns:
        A container of ``rollout``'s type: batch ``(E,)`` with jagged leaves, or ``(E, L)``
        padded with the mask at ``mask_key``.

    Raises:
        KeyError: a flag key is missing; the mask key is taken (padded).
        TypeError: ``rollout`` is not a container; a flag is not a bool tensor (naming the
            key); a per-step non-tensor value (it has no jagged form).
        ValueError: no time dim, ``time_dim`` out of range, no step, a flag of another shape
            (naming the key).

    Example:
        >>> import torch, tdfunc, tdfunc.rl
        >>> done = torch.tensor([[False, True, False], [False, False, False]])
        >>> rollout = tdfunc.TensorDict(
        ...     obs=torch.arange(6.0).reshape(2, 3), next={"done": done}, batch_size=[2, 3])
        >>> eps = tdfunc.rl.split_trajectories(rollout)
        >>> eps.batch_size, [e.tolist() for e in eps["obs"].unbind()]
        (torch.Size([3]), [[0.0, 1.0], [2.0], [3.0, 4.0, 5.0]])
        >>> pad = tdfunc.rl.split_trajectories(rollout, padded=True)
        >>> pad["obs"].tolist(), pad["mask"].sum(1).tolist()
        ([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [3.0, 4.0, 5.0]], [2, 1, 3])
    """
    fn = "split_trajectories"
    _check_container(rollout, fn)
    batch = rollout._batch_size
    nb = len(batch)
    if nb == 0:
        raise ValueError(NO_TIME_DIM)
    t = _time_dim(time_dim, nb, batch, fn)
    if batch.numel() == 0:
        raise ValueError(EMPTY_ROLLOUT.format(batch=tuple(batch)))
    mask_path = as_path(mask_key)
    if padded and get_path(rollout, mask_path, ABSENT) is not ABSENT:
        raise KeyError(MASK_KEY_TAKEN.format(key=fmt_key(mask_path)))
    done = _steps(any_flag(rollout, flag_paths(done_key), fn), nb, t)
    steps = [_steps(x, nb, t) for x in leaves(rollout)]
    n_steps = batch[t]
    # the last step of each environment ends its episode
    last = torch.arange(done.shape[0], device=done.device) % n_steps == n_steps - 1
    ends = done | last
    stops = torch.nonzero(ends).squeeze(1) + 1
    offsets = torch.cat([stops.new_zeros(1), stops])
    n_episodes = stops.shape[0]
    starts = torch.cat([ends.new_ones(1), ends[:-1]])
    index = torch.arange(ends.shape[0], device=ends.device)
    pos = index - torch.where(starts, index, 0).cummax(0).values
    # the longest and the shortest length as sizes, not values read back: position p occurs
    # in count[p] episodes, so the positions in some episode are 0 .. longest - 1 and those
    # in every episode 0 .. shortest - 1
    count = torch.zeros(n_steps, dtype=pos.dtype, device=pos.device).index_add(
        0, pos, torch.ones_like(pos)
    )
    longest = torch.nonzero(count).shape[0]
    if not padded:
        shortest = torch.nonzero(count == n_episodes).shape[0]
        out = [
            torch.nested.nested_tensor_from_jagged(
                x, offsets, min_seqlen=shortest, max_seqlen=longest
            )
            for x in steps
        ]
        return map_leaves(rollout, out, torch.Size([n_episodes]), rollout._device, False)
    episode = starts.cumsum(0) - 1
    shape = (n_episodes, longest)
    out = [x.new_zeros((*shape, *x.shape[1:])).index_put((episode, pos), x) for x in steps]
    mask = torch.zeros(shape, dtype=torch.bool, device=ends.device).index_put(
        (episode, pos), torch.ones_like(ends)
    )
    result = map_leaves(rollout, out, torch.Size(shape), rollout._device, False)
    return result.set(mask_path, mask)


def merge_trajectories(
    episodes: Any,
    batch_size: Sequence[int] | None = None,
    *,
    time_dim: int = -1,
    mask_key: Key = "mask",
) -> Any:
    """The steps of a batch of episodes in a rollout's layout: the inverse of
    :func:`split_trajectories`.

    The steps are taken episode after episode, each one's in order (the jagged leaves'
    values; the padded form's steps where its mask at ``mask_key`` is ``True``, the mask
    left out of the result) and laid out as ``batch_size`` with time at ``time_dim``: the
    rollout :func:`split_trajectories` was given. Without ``batch_size`` they stay one flat
    batch dim, in that order (each environment's steps in time order, one environment after
    the other).

    Args:
        episodes: the result of :func:`split_trajectories` (jagged or padded).
        batch_size: the rollout's batch size, or ``None`` for the flat order.
        time_dim: the batch dim of ``batch_size`` that is time.
        mask_key: where a padded batch holds its mask.

    Returns:
        A container of ``episodes``' type with ``batch_size`` (or ``(steps,)``).

    Raises:
        TypeError: not a container; a leaf that is neither jagged nor padded (naming the
            key); a mask that is not bool.
        ValueError: another number of steps than ``batch_size`` has positions (jagged; a
            padded mask with another count of steps fails when the program runs, with
            ``RuntimeError``), ``time_dim`` out of range.

    Example:
        >>> import torch, tdfunc, tdfunc.rl
        >>> done = torch.tensor([[False, True, False], [False, False, False]])
        >>> rollout = tdfunc.TensorDict(
        ...     obs=torch.arange(6.0).reshape(2, 3), next={"done": done}, batch_size=[2, 3])
        >>> for padded in (False, True):
        ...     eps = tdfunc.rl.split_trajectories(rollout, padded=padded)
        ...     back = tdfunc.rl.merge_trajectories(eps, rollout.batch_size)
        ...     print(back.batch_size, back["obs"].tolist())
        torch.Size([2, 3]) [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        torch.Size([2, 3]) [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """
    fn = "merge_trajectories"
    _check_container(episodes, fn)
    mask_path = as_path(mask_key)
    mask = get_path(episodes, mask_path, ABSENT)
    ebatch = episodes._batch_size
    if mask is not ABSENT:
        if len(ebatch) != 2:
            raise ValueError(EPISODES_BATCH.format(batch=tuple(ebatch)))
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != ebatch:
            what = (
                f"{mask.dtype} {tuple(mask.shape)}"
                if isinstance(mask, Tensor)
                else type(mask).__name__
            )
            raise TypeError(
                MASK_NOT_BOOL.format(key=fmt_key(mask_path), batch=tuple(ebatch), what=what)
            )
        body = episodes.exclude(mask_path)
        flat_mask = mask.reshape(-1)
        if batch_size is None:
            rows = torch.nonzero(flat_mask).squeeze(1)
        else:
            want = torch.Size(batch_size).numel()
            assert_async(flat_mask.sum() == want, MASK_COUNT.format(batch=tuple(batch_size)))
            rows = torch.nonzero_static(flat_mask, size=want).squeeze(1)
        flat = [x.reshape((-1, *x.shape[2:]))[rows] for x in leaves(body)]
    else:
        if len(ebatch) != 1:
            raise ValueError(EPISODES_BATCH.format(batch=tuple(ebatch)))
        body = episodes
        flat = [_values(body, i, x) for i, x in enumerate(leaves(body))]
    if batch_size is None:
        n = flat[0].shape[0] if flat else 0
        return map_leaves(body, flat, torch.Size([n]), body._device, False)
    batch = torch.Size(batch_size)
    nb = len(batch)
    t = _time_dim(time_dim, nb, batch, fn) if nb else 0
    if mask is ABSENT:
        for i, x in enumerate(flat):
            if x.shape[0] != batch.numel():
                raise ValueError(
                    STEP_COUNT.format(
                        key=_key_of(body, i), got=x.shape[0], batch=tuple(batch), want=batch.numel()
                    )
                )
    # time last, then moved back to time_dim
    order = [*batch[:t], *batch[t + 1 :], batch[t]] if nb else []
    out = [x.reshape((*order, *x.shape[1:])) for x in flat]
    if nb and t != nb - 1:
        out = [x.movedim(nb - 1, t) for x in out]
    return map_leaves(body, out, batch, body._device, False)


def _key_of(node: Node, i: int) -> str:
    return fmt_key(leaves_with_paths(node)[i][0])


def _values(node: Node, i: int, x: Any) -> Tensor:
    """The steps of jagged leaf ``i``, episode after episode."""
    if not is_jagged(x):
        what = "a nested tensor of another layout" if x.is_nested else f"shape {tuple(x.shape)}"
        raise TypeError(NOT_EPISODES.format(key=_key_of(node, i), what=what))
    if x.lengths() is not None:
        raise ValueError(HOLES.format(key=_key_of(node, i)))
    if x._ragged_idx != 1:
        raise TypeError(
            NOT_EPISODES.format(key=_key_of(node, i), what=f"ragged dim {x._ragged_idx}")
        )
    return x.values()


__all__ = ["merge_trajectories", "split_trajectories"]
