"""A replay buffer on disk: the same state and samplers over a writable store, written
with explicit store calls.

:func:`create_store` saves an empty :class:`ReplayState` as a store (atomically, like
:func:`tdfunc.save`; the rows are written in chunks, never all in memory) and returns it
loaded read-write. :func:`store_add` and :func:`store_update_priorities` write into that
file in place (the explicit store writes: :func:`add` refuses such a state rather than
return an in-memory copy and leave the file as it was). :func:`open_store` opens it again,
in this process or another one; :func:`store_sample` samples from it while another process
adds.

The commit protocol (one writer at a time: each write holds an exclusive ``flock`` on the
data file, so writers in several processes take turns):

1. ``start`` moves past the rows about to be replaced (one 8-byte write);
2. the rows are written (one copy a leaf, two where they wrap round the ring), then their
   priorities;
3. ``end`` moves past them (one 8-byte write): the commit.

Rows ``start <= i < end`` are whole at every instant, so a process killed anywhere in an add
leaves a store whose readers see the rows of the adds before it and nothing of the killed
one (at worst, the rows step 1 gave up). A reader never blocks the writer: it reads ``end``,
then ``start``, samples rows among them, and reads ``start`` again after reading the rows;
a row below it may have been replaced while being read, and the sample is drawn again
(:func:`store_sample`). Opening a store read-write rebuilds the priority trees from their
leaves (a writer killed between two levels leaves inner sums behind).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .._tree import flatten, is_node, leaves_and_nontensors, leaves_with_paths
from ..memmap._store import load, save
from ..memmap._write import check_writable, read_scalar, write_rows, write_scalar
from ..tensordict import TensorDict
from ._replay import (
    ReplayState,
    _node,
    check_batch,
    check_priorities,
    check_state,
    sample,
    spec,
    stored_priority,
    tree_set,
)

NOT_A_BUFFER_STORE = (
    "{path!r} holds a {typ}, not a replay buffer (tdfunc.rl.ReplayState); make one with "
    "tdfunc.rl.create_store"
)
BUSY = (
    "store_sample: rows kept being replaced while they were read ({attempts} attempts): the "
    "writer adds faster than this reader samples; sample fewer rows at a time, or use a "
    "larger buffer"
)


@contextmanager
def _writer(state: ReplayState) -> Iterator[None]:
    """An exclusive ``flock`` on the store's data file for one write (released when the
    process dies, so a killed writer never leaves the store locked)."""
    filename = state.end.filename  # type: ignore[attr-defined]  # a memory-mapped leaf
    fd = os.open(filename, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_store(state: Any, what: str) -> None:
    """``state`` is a :class:`ReplayState` every leaf of which is a store leaf opened
    ``"r+"`` (``PermissionError`` naming the key and the file for a read-only one)."""
    check_state(state, what)
    for path, leaf in leaves_with_paths(_node(state)):
        check_writable(path, leaf, what)


def create_store(
    path: str | os.PathLike[str],
    example: Any,
    capacity: int,
    *,
    prioritized: bool = False,
    alpha: float = 0.6,
    beta: float = 0.4,
    eps: float = 1e-8,
    overwrite: bool = False,
) -> ReplayState:
    """Make an empty replay buffer on disk at ``path`` and return it loaded read-write.

    The arguments are :func:`init`'s; ``overwrite`` is :func:`tdfunc.save`'s. The store is
    saved atomically (zero rows, written in chunks: a buffer larger than memory is fine).

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> store = rl.create_store(path, tdfunc.TensorDict(obs=torch.zeros(2)), 10)
        >>> rl.store_add(store, tdfunc.TensorDict(obs=torch.ones(3, 2), batch_size=[3]))
        >>> int(rl.size(rl.open_store(path)))          # another process sees the 3 rows
        3
    """
    state = spec(example, capacity, prioritized, alpha, beta, eps, "create_store", False)
    save(state, path, overwrite=overwrite)
    return open_store(path, mode="r+")


def open_store(path: str | os.PathLike[str], *, mode: str = "r") -> ReplayState:
    """Load the replay buffer at ``path``: ``mode="r"`` to sample from it (with
    :func:`store_sample` while another process adds), ``"r+"`` to add to it too. Opened
    read-write, the priority trees are rebuilt from their leaves (a writer killed while
    updating them leaves inner sums behind).

    Raises:
        TypeError: the store holds another container. And :func:`tdfunc.load`'s errors.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> _ = rl.create_store(path, tdfunc.TensorDict(x=torch.zeros(())), 4, prioritized=True)
        >>> rl.open_store(path).priorities.sum_tree.mode
        'r'
    """
    state = load(path, mode=mode)
    if not isinstance(state, ReplayState):
        raise TypeError(NOT_A_BUFFER_STORE.format(path=os.fspath(path), typ=type(state).__name__))
    if mode == "r+" and state.priorities is not None:
        with _writer(state):
            _rebuild_trees(state)
    return state


def _rebuild_trees(state: ReplayState) -> None:
    """Recompute every inner node of the priority trees from the leaves of the rows that hold
    data (the others: 0 and ``inf``), in place."""
    p = state.priorities
    assert p is not None
    s, m = p.sum_tree, p.min_tree
    n = s.shape[0] // 2
    cap = state.capacity
    rows = torch.arange(n)
    held = ((rows - state.start) % cap < state.end - state.start) & (rows < cap)
    leaf = torch.where(held, s[n:], 0.0)
    s[n:] = leaf
    m[n:] = torch.where(held, leaf, float("inf"))
    lo = n // 2
    while lo >= 1:
        s[lo : 2 * lo] = s[2 * lo : 4 * lo].view(-1, 2).sum(1)
        m[lo : 2 * lo] = m[2 * lo : 4 * lo].view(-1, 2).amin(1)
        lo //= 2


def store_add(store: ReplayState, batch: Any) -> None:
    """Add the rows of ``batch`` to the buffer on disk, in place: :func:`add`'s rows and
    counters, written into the store's file with the commit protocol of this module (rows
    first, then the counter that makes them visible). Another process adding to the same
    store waits for this one.

    Raises:
        PermissionError: the store was opened read-only (naming the key and the file).
        KeyError, ValueError, TypeError: as :func:`add` (a batch that does not fit), all
            before anything is written.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> store = rl.create_store(path, tdfunc.TensorDict(x=torch.zeros(())), 3)
        >>> rl.store_add(store, tdfunc.TensorDict(x=torch.arange(4.0), batch_size=[4]))
        Traceback (most recent call last):
        ...
        ValueError: store_add: the batch has 4 rows, more than the buffer's capacity 3; add it in parts, or make a larger buffer
        >>> rl.store_add(store, tdfunc.TensorDict(x=torch.arange(2.0), batch_size=[2]))
        >>> rl.open_store(path).storage["x"].tolist()
        [0.0, 1.0, 0.0]
    """
    StoreWriter(store).add(batch)


#: plans a :class:`StoreWriter` keeps (one per structure of batch); more clears them
_MAX_PLANS = 8


def _batch_key(batch: Any) -> tuple[Hashable, list[Tensor]] | None:
    """The structure key of ``batch`` (its type, keys and nesting, batch size, and each
    leaf's shape and dtype: everything :func:`check_batch` looks at) and its leaves, in one
    walk (:func:`tdfunc._tree.flatten`); ``None`` for a batch the full checks alone take
    (not a container, a leaf that is not a plain tensor)."""
    if not is_node(batch):
        return None
    ls, ctx = flatten(batch)
    shapes = []
    for t in ls:
        if type(t) is not Tensor:
            return None
        shapes.append((t.shape, t.dtype))
    return (type(batch), ctx, batch.batch_size, tuple(shapes)), ls


class StoreWriter:
    """:func:`store_add` for many batches into one store (what :class:`ReplayBuffer` on disk
    adds with): the store is checked once, when the writer is made, and each structure of
    batch once.

    The plans (boundary code, never traced) map a batch's structure key
    (:func:`_batch_key`: type, keys, nesting, batch size, leaf shapes and dtypes) to where
    each leaf of the storage finds its rows among the batch's leaves, as :func:`check_batch`
    paired them by key. A batch with the key of a plan passes every check that plan's batch
    passed (they depend on nothing else: the state is a value, its leaves and their modes
    fixed); any other batch takes the full checks, which raise before anything is written.

    Raises:
        PermissionError, TypeError, ValueError: as :func:`store_add`, for the store.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> writer = StoreWriter(rl.create_store(path, tdfunc.TensorDict(x=torch.zeros(())), 3))
        >>> for first in (0, 2):
        ...     writer.add(tdfunc.TensorDict(x=torch.arange(first, first + 2.0), batch_size=[2]))
        >>> rl.open_store(path).storage["x"].tolist()
        [3.0, 1.0, 2.0]
    """

    __slots__ = ("_leaves", "_paths", "_plans", "_state")

    def __init__(self, store: ReplayState) -> None:
        _check_store(store, "store_add")
        self._state = store
        pairs = leaves_with_paths(_node(store).storage)
        self._paths = [p for p, _ in pairs]
        self._leaves = [t for _, t in pairs]
        # a storage with non-tensor values takes the full checks every time (they compare
        # the batch's by value; a key holds them by identity). Without any, a batch holding
        # one never passes the checks, so no plan is ever made for it.
        nontensors = leaves_and_nontensors(_node(store).storage)[1]
        self._plans: dict[Hashable, list[int]] | None = None if nontensors else {}

    def add(self, batch: Any) -> None:
        """Add the rows of ``batch`` (:func:`store_add`)."""
        store = self._state
        plans = self._plans
        found = None if plans is None else _batch_key(batch)
        plan = None if found is None or plans is None else plans.get(found[0])
        if found is not None and plan is not None:
            ls = found[1]
            pairs = [(None, leaf, ls[i]) for leaf, i in zip(self._leaves, plan)]
        else:
            pairs = check_batch(store, batch, "store_add", writable=True)
            if found is not None:
                self._remember(batch, found, pairs)
        with _writer(store):
            _write_rows(store, pairs, int(batch.batch_size[0]))

    def _remember(self, batch: Any, found: tuple[Hashable, list[Tensor]], pairs: list[Any]) -> None:
        """Keep the plan of a batch that passed the checks: the position, among its leaves,
        of the leaf each storage leaf was paired with, found by key path (one tensor under
        two keys is not one position)."""
        key, ls = found
        paths = leaves_with_paths(batch)
        if len(paths) != len(ls) or any(t is not u for (_, t), u in zip(paths, ls)):
            return  # leaves in another order than the key's walk: no plan
        where = {p: i for i, (p, _) in enumerate(paths)}
        plan = [where.get(p, -1) for p, _, _ in pairs]
        if -1 in plan or [p for p, _, _ in pairs] != self._paths:
            return
        plans = self._plans
        assert plans is not None
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plans[key] = plan


def _write_rows(store: ReplayState, pairs: list[Any], n: int) -> None:
    """The commit protocol of this module for ``n`` checked rows (``pairs``: the storage's
    leaves and the batch's, from :func:`check_batch`), under the writer's lock. The counters
    are host integers read from the file; the ``n`` rows at the cursor of the ring are at
    most two runs of rows, each written with one copy a leaf."""
    cap = store.capacity
    start, end = read_scalar(store.start), read_scalar(store.end)
    new_end = end + n
    new_start = max(start, new_end - cap)
    first = end % cap
    head = min(n, cap - first)  # rows before the end of the ring; the rest go to row 0
    if new_start != start:
        write_scalar(store.start, new_start)  # 1. give up the rows about to be replaced
    with torch.no_grad():
        for _, leaf, v in pairs:  # 2. the rows
            if not isinstance(v, Tensor):  # a number: every row
                v = torch.tensor(v).expand(n, *leaf.shape[1:])
            if head == n:
                write_rows(leaf, first, v)
            else:
                write_rows(leaf, first, v[:head])
                write_rows(leaf, 0, v[head:])
        p = store.priorities
        if p is not None:  # and their priorities
            rows = (torch.arange(n, device=p.sum_tree.device) + first) % cap
            tree_set(p, rows, stored_priority(p, p.max_priority).expand(n), inplace=True)
    write_scalar(store.end, new_end)  # 3. the commit


def store_update_priorities(store: ReplayState, index: Any, priority: Any) -> None:
    """:func:`update_priorities` written into the buffer on disk, in place (locked against
    other writers).

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> store = rl.create_store(path, tdfunc.TensorDict(x=torch.zeros(())), 4,
        ...                         prioritized=True, alpha=1.0, eps=0.0)
        >>> rl.store_add(store, tdfunc.TensorDict(x=torch.arange(4.0), batch_size=[4]))
        >>> rl.store_update_priorities(store, torch.tensor([1]), 5.0)
        >>> float(rl.open_store(path).priorities.sum_tree[1])   # 1 + 5 + 1 + 1
        8.0
    """
    _check_store(store, "store_update_priorities")
    p, rows, pr = check_priorities(store, index, priority, "store_update_priorities")
    with _writer(store), torch.no_grad():
        tree_set(p, rows, stored_priority(p, pr), inplace=True)
        if pr.numel():
            p.max_priority.copy_(torch.maximum(p.max_priority, pr.max()))


def store_sample(
    store: ReplayState,
    fn: Callable[..., tuple[Any, TensorDict]] = sample,
    *args: Any,
    attempts: int = 100,
    **kwargs: Any,
) -> tuple[Any, TensorDict]:
    """``fn(state, *args, **kwargs)`` (:func:`sample`, :func:`sample_slices` or
    :func:`sample_episodes`) on a buffer on disk that another process may be adding to:
    every row returned is whole. The counters are read once (``end``, then ``start``) for
    the whole call; after the rows are read, a sample holding a row that was given up
    meanwhile (below ``start`` read again) is drawn again, up to ``attempts`` times.

    Raises:
        TimeoutError: every attempt met a replaced row.

    Example:
        >>> import os, tempfile, torch, tdfunc
        >>> from tdfunc import rl
        >>> path = os.path.join(tempfile.mkdtemp(), "buffer")
        >>> store = rl.create_store(path, tdfunc.TensorDict(x=torch.zeros(())), 8)
        >>> rl.store_add(store, tdfunc.TensorDict(x=torch.arange(5.0), batch_size=[5]))
        >>> reader = rl.open_store(path)                  # read-only, e.g. another process
        >>> batch, info = rl.store_sample(reader, rl.sample, 4)
        >>> bool((batch["x"] == info["index"].double()).all())
        True
    """
    check_state(store, "store_sample")
    cap = store.capacity
    for _ in range(attempts):
        end = store.end.clone()  # end first: rows below it were whole when it was written
        start = store.start.clone()
        if bool(start >= end) and bool(store.end != end):
            continue  # several adds between the two reads: read them again
        view = _node(store).replace(start=start, end=end)
        batch, info = fn(view, *args, **kwargs)
        index: Tensor = info["index"]
        if index.is_nested:
            index = index.values()
        now = store.start.clone()  # after the rows were read
        row = end - 1 - (end - 1 - index) % cap  # the absolute row each index held
        if bool(((row >= start) & (row >= now)).all()):
            return batch, info
    raise TimeoutError(BUSY.format(attempts=attempts))


__all__ = [
    "create_store",
    "open_store",
    "store_add",
    "store_sample",
    "store_update_priorities",
]
