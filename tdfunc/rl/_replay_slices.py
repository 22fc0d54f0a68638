"""Sampling trajectories out of a replay buffer: contiguous slices (torchrl's
``SliceSampler``) and whole episodes.

The rows are read in the order they were added (oldest first: absolute rows ``start`` to
``end``), so an episode stored across the end of the ring is one episode. An episode is a run
of rows with the same id under ``traj_key``, or the rows up to and including one whose done
flag (``done_key``, default ``("next", "done")``) is set; the last episode may still be
running. As torchrl's ``SliceSampler``, each slice first draws an episode uniformly among
those at least ``slice_len`` rows long (shorter ones are never drawn, torchrl's
``strict_length=True``), then a start uniformly inside it. The episode boundaries are found by
tensor ops over the capacity (a running max and min of start positions, no loop over
episodes), so :func:`sample_slices` compiles with ``fullgraph=True`` into one graph whatever
the episodes; :func:`sample_episodes` returns jagged rows (their lengths are data) and runs
eagerly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._jagged._batch import as_jagged
from .._keys import ABSENT, as_path, fmt_key, get_path
from .._ops._indexing import index as index_rows
from .._raising import refuse_if
from .._tree import leaves_with_paths
from ..tensordict import TensorDict
from ._replay import ReplayState, _check_int, check_state

Key = str | tuple[str, ...]

#: the done flag read when neither key is given (torchrl's ``end_key``)
DONE_KEY: tuple[str, ...] = ("next", "done")

BOTH_KEYS = "{what}: give traj_key or done_key, not both"
ROW_BATCH = (
    "{what}: the storage has batch_size {batch}; trajectories are read along its only batch "
    "dim, so its rows must have batch_size () (store one row per step)"
)
FLAG_MISSING = "{what}: the storage has no key {key} (its keys: {available}); {hint}"
FLAG_HINT_DONE = "name the done flag with done_key=..., or the episode ids with traj_key=..."
FLAG_HINT_TRAJ = "name the episode ids with traj_key=..."
FLAG_SHAPE = (
    "{what}: the leaf at key {key} has shape {shape}; a per-step flag or id has shape "
    "[capacity] or [capacity, 1]"
)
FLAG_DTYPE = "{what}: the done flag at key {key} has dtype {dtype}; it must be torch.bool"
NO_TRAJECTORY = (
    "{what}: the buffer holds no episode of at least {length} rows (episodes are cut at the "
    "done flags or where the ids change); add more rows or sample shorter slices"
)


def _flag(state: ReplayState, key: Key, what: str, done: bool) -> Tensor:
    path = as_path(key)
    leaf = get_path(state.storage, path, ABSENT)
    if not isinstance(leaf, Tensor):
        available = [fmt_key(p) for p, _ in leaves_with_paths(state.storage)]
        hint = FLAG_HINT_DONE if done else FLAG_HINT_TRAJ
        raise KeyError(
            FLAG_MISSING.format(what=what, key=fmt_key(path), available=available, hint=hint)
        )
    if leaf.ndim == 2 and leaf.shape[1] == 1:
        leaf = leaf[:, 0]
    if leaf.ndim != 1:
        raise ValueError(FLAG_SHAPE.format(what=what, key=fmt_key(path), shape=tuple(leaf.shape)))
    if done and leaf.dtype != torch.bool:
        raise TypeError(FLAG_DTYPE.format(what=what, key=fmt_key(path), dtype=leaf.dtype))
    return leaf


def episodes(
    state: ReplayState, traj_key: Key | None, done_key: Key | None, what: str
) -> tuple[Tensor, Tensor]:
    """For each position ``j`` of the rows in the order they were added (``j = 0`` the oldest;
    row ``(start + j) % capacity``): the length of the episode starting at ``j`` (0 where none
    starts), and ``start``-relative positions ``arange(capacity)``."""
    check_state(state, what)
    if traj_key is not None and done_key is not None:
        raise TypeError(BOTH_KEYS.format(what=what))
    if len(state.storage.batch_size) != 1:
        raise ValueError(ROW_BATCH.format(what=what, batch=tuple(state.storage.batch_size)))
    cap = state.capacity
    device = state.end.device
    j = torch.arange(cap, device=device)
    rows = (state.start + j) % cap
    n = state.end - state.start
    if traj_key is not None:
        ids = _flag(state, traj_key, what, done=False)[rows]
        cut = ids != torch.roll(ids, 1)
    else:
        done = _flag(state, DONE_KEY if done_key is None else done_key, what, done=True)[rows]
        cut = torch.roll(done, 1)
    new = ((j == 0) | cut) & (j < n)
    # where the episode starting at j ends: the next start after j, or the last row
    starts = torch.where(new, j, cap)
    after = torch.cat([starts[1:], starts.new_full((1,), cap)])
    next_start = torch.flip(torch.cummin(torch.flip(after, (0,)), 0).values, (0,))
    length = torch.where(new, torch.minimum(next_start, n) - j, 0)
    return length, j


def _pick(
    length: Tensor, min_len: int, count: int, generator: torch.Generator | None, what: str
) -> tuple[Tensor, Tensor]:
    """``count`` episodes drawn uniformly among those at least ``min_len`` rows long: their
    start positions and lengths."""
    eligible = length >= max(min_len, 1)
    total = eligible.sum()
    refuse_if(total <= 0, ValueError, NO_TRAJECTORY.format(what=what, length=min_len))
    u = torch.rand(count, dtype=torch.float64, generator=generator, device=length.device)
    r = torch.minimum((u * total).to(torch.int64), total - 1)
    first = torch.searchsorted(torch.cumsum(eligible.to(torch.int64), 0), r + 1)
    first = torch.clamp(first, max=length.shape[0] - 1)
    return first, length[first]


def sample_slices(
    state: ReplayState,
    num_slices: int,
    slice_len: int,
    generator: torch.Generator | None = None,
    *,
    traj_key: Key | None = None,
    done_key: Key | None = None,
) -> tuple[Any, TensorDict]:
    """Draw ``num_slices`` runs of ``slice_len`` consecutive steps, each inside one episode
    (torchrl's ``SliceSampler`` with ``num_slices`` and ``strict_length=True``).

    Args:
        state: a buffer whose rows are steps (storage batch size ``[capacity]``).
        num_slices: the number of slices.
        slice_len: the steps of each slice; episodes shorter than this are never drawn.
        generator: the random stream, or ``None`` for torch's global one (inside
            ``torch.compile``: ``None``).
        traj_key: the key of an episode id per step (episodes: runs of equal ids).
        done_key: the key of a done flag per step (an episode ends at a set flag); the
            default, when neither is given, is ``("next", "done")``.

    Returns:
        ``batch`` of batch size ``[num_slices, slice_len]`` (``batch[k]`` one slice, in
        time order) and ``info`` with ``"index"``, the storage row of each step
        (``[num_slices, slice_len]``).

    Raises:
        KeyError: no leaf at the key. ValueError: no episode of ``slice_len`` rows (also
        by the compiled program), a storage whose rows have batch dims. TypeError: a done
        flag that is not ``torch.bool``, both keys given.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(t=torch.zeros(()), ep=torch.zeros((), dtype=torch.long)), 16)
        >>> steps = tdfunc.TensorDict(t=torch.arange(10.0), ep=torch.tensor([0] * 4 + [1] * 6),
        ...                           batch_size=[10])
        >>> state = rl.add(state, steps)
        >>> batch, info = rl.sample_slices(state, 3, 5, torch.Generator().manual_seed(0), traj_key="ep")
        >>> batch.batch_size, batch["ep"].tolist()   # only episode 1 has 5 steps
        (torch.Size([3, 5]), [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    """
    what = "sample_slices"
    _check_int(num_slices, what, "num_slices")
    _check_int(slice_len, what, "slice_len")
    length, _ = episodes(state, traj_key, done_key, what)
    first, ep_len = _pick(length, slice_len, num_slices, generator, what)
    room = ep_len - slice_len + 1
    u = torch.rand(num_slices, dtype=torch.float64, generator=generator, device=length.device)
    off = torch.minimum((u * room).to(torch.int64), room - 1).clamp(min=0)
    steps = torch.arange(slice_len, device=length.device)
    rows = (state.start + (first + off)[:, None] + steps) % state.capacity
    info = TensorDict(index=rows, batch_size=[num_slices, slice_len])
    return index_rows(state.storage, rows), info


def sample_episodes(
    state: ReplayState,
    num_episodes: int,
    generator: torch.Generator | None = None,
    *,
    traj_key: Key | None = None,
    done_key: Key | None = None,
) -> tuple[Any, TensorDict]:
    """Draw ``num_episodes`` whole episodes (uniformly among the episodes stored, with
    replacement), as jagged rows: ``batch[k]`` is episode ``k``'s steps. Eager (the lengths
    are data). Keys as in :func:`sample_slices`; the oldest episode may have lost its first
    steps to the ring, the newest may still be running.

    Returns:
        ``batch`` of batch size ``[num_episodes]`` whose leaves are jagged (the steps are the
        ragged dim; :func:`tdfunc.to_padded` pads them) and ``info`` with ``"index"`` (the
        storage rows, jagged the same way) and ``"length"``.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> row = tdfunc.TensorDict(t=torch.zeros(()), next={"done": torch.zeros((), dtype=torch.bool)})
        >>> done = torch.tensor([False, True, False, False, True])
        >>> steps = tdfunc.TensorDict(t=torch.arange(5.0), next={"done": done}, batch_size=[5])
        >>> state = rl.add(rl.init(row, 8), steps)
        >>> batch, info = rl.sample_episodes(state, 8, torch.Generator().manual_seed(0))
        >>> sorted(set(info["length"].tolist())), batch["t"].is_nested
        ([2, 3], True)
    """
    what = "sample_episodes"
    _check_int(num_episodes, what, "num_episodes")
    length, _ = episodes(state, traj_key, done_key, what)
    first, ep_len = _pick(length, 1, num_episodes, generator, what)
    lens = ep_len.tolist()
    starts = first.tolist()
    pos = torch.cat([torch.arange(s, s + n, device=length.device) for s, n in zip(starts, lens)])
    rows = (state.start + pos) % state.capacity
    flat = index_rows(state.storage, rows)
    keys = [path for path, _ in leaves_with_paths(flat)]
    batch = as_jagged(list(flat.split(lens)), keys=keys)
    index = torch.nested.nested_tensor_from_jagged(
        rows, offsets=torch.cat([rows.new_zeros(1), torch.cumsum(ep_len, 0)])
    )
    info = TensorDict(index=index, length=ep_len, batch_size=[num_episodes])
    return batch, info


__all__ = ["sample_episodes", "sample_slices"]
