"""Replay buffers as values: a :class:`ReplayState` and the pure functions over it.

The buffer is a container (flashbax's shape): the rows in ``storage`` (a container whose first
batch dim is the capacity), two counters and, for prioritised replay, a sum tree and a min
tree held as tensors (:class:`Priorities`). :func:`init` builds one; :func:`add` returns a new
state with a batch of rows written at the cursor (a ring: the oldest rows are replaced);
:func:`sample` draws rows uniformly, or in proportion to ``priority ** alpha`` with torchrl's
importance weights; :func:`update_priorities` sets the priorities of sampled rows. None of
them writes into its arguments, and all of them compile with ``torch.compile(fullgraph=True)``
(the checks of values, such as sampling an empty buffer, are graph ops that raise the eager
error when the compiled program runs: :func:`tdfunc._raising.refuse_if`).

In place only when asked: ``tdfunc.compile(fn, donate=...)`` on a function that adds writes
the new rows into the donated state's memory (inductor turns the functional row update into
a store of the batch's rows: no copy of the storage per call), and ``add(..., donate=True)``
does the same eagerly. A state on disk is written with the explicit store calls of
:mod:`tdfunc.rl._replay_store`.

Why two absolute counters (``start``, ``end``) and not a cursor and a size: the rows that
hold data are those with absolute index ``start <= i < end``, row ``i`` stored at
``i % capacity`` (``cursor = end % capacity``, ``size = end - start``). Both only grow, and each
is one 8-byte word, so a store on disk commits an add with one write (``end``) after the rows,
and a reader in another process can tell afterwards whether a row it read was being
replaced meanwhile (its index fell below ``start``). A cursor and a size cannot be committed
by one write, and the size shrinks and grows back while rows are replaced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _donate
from .._base import Container
from .._jagged._layout import is_jagged
from .._keys import fmt_key
from .._ops import zeros_like
from .._ops._indexing import index as index_rows
from .._raising import refuse_if
from .._tensorclass import tensorclass
from .._tree import is_node, leaves, leaves_with_paths, map_leaves, shallow_copy
from ..memmap._write import check_rows, pair_leaves
from ..tensordict import TensorDict

NOT_A_CONTAINER = "{what}: {arg} must be a TensorDict or a tensorclass instance, got {typ}"
NOT_A_STATE = (
    "{what}: state must be a ReplayState (made by tdfunc.rl.init or loaded from a store), got {typ}"
)
BAD_CAPACITY = "{what}: capacity must be an int >= 1, got {value!r}"
BAD_COUNT = "{what}: {name} must be an int >= 1, got {value!r}"
BAD_HYPER = "{what}: {name} must be a number >= 0, got {value!r}"
JAGGED_EXAMPLE = (
    "init: key {key} is a jagged leaf; a replay buffer stores rows of fixed shapes (pad the "
    "leaf with tdfunc.to_padded, or store its rows as episodes of a fixed length)"
)
NO_BATCH_DIM = (
    "{what}: the batch has batch_size {got}; it must be a batch of rows, batch_size "
    "[n, {row}] (the buffer's rows have batch_size {row_bs})"
)
BATCH_TOO_LARGE = (
    "{what}: the batch has {n} rows, more than the buffer's capacity {capacity}; add it in "
    "parts, or make a larger buffer"
)
WRITABLE_STORE = (
    "{what}: the state's storage is a store loaded read-write (key {key}, file {filename!r}); "
    "a pure add would return an in-memory copy and leave the file as it was. Write into the "
    "store with tdfunc.rl.store_add(state, batch), or pass state.clone() for an in-memory buffer"
)
EMPTY = "{what}: the replay buffer holds no rows yet; add some before sampling"
NOT_PRIORITIZED = (
    "{what}: the buffer has no priorities; make it with tdfunc.rl.init(..., prioritized=True)"
)
BAD_INDEX_DTYPE = "{what}: index must be an integer tensor of rows (info['index']), got {dtype}"
INDEX_OUT_OF_RANGE = "{what}: index holds a row outside [0, {capacity}) (the buffer's capacity)"
INDEX_NO_DATA = (
    "{what}: index names a row that holds no data yet (rows written so far: the sampled "
    "info['index'] values)"
)
PRIORITY_SHAPE = (
    "{what}: priority has shape {got}; it must be a number or broadcast to the index's shape {want}"
)
BAD_PRIORITY = (
    "{what}: every priority must be a number >= 0 (not NaN) with (priority + eps) ** alpha > 0"
)

#: the dtype of the priority trees, the max priority and beta (float32 sums of a million
#: rows lose the small priorities)
TREE_DTYPE = torch.float64


@tensorclass(serialized_type_name="tdfunc.rl.Priorities")
class Priorities:
    """The priorities of a prioritised :class:`ReplayState`, as tensors.

    ``sum_tree`` and ``min_tree`` are complete binary trees over ``n`` leaves (``n``, the
    capacity rounded up to a power of two), stored in heap order: node ``k`` has children
    ``2k`` and ``2k + 1``, the root is node 1, row ``i``'s leaf is node ``n + i``. A row's
    leaf holds ``(priority + eps) ** alpha`` (0 in the sum tree and ``inf`` in the min tree
    for a row with no data), each inner node the sum (min) of its children, so the root holds
    the total (the smallest). ``max_priority`` is the largest priority given so far (new
    rows get it, torchrl's rule: 1 before any), ``beta`` the exponent of the importance
    weights (a tensor: :func:`set_beta` changes it without recompiling). ``alpha`` and
    ``eps`` are fixed when the buffer is made (the trees hold their result).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(2)), 3, prioritized=True)
        >>> p = state.priorities
        >>> p.sum_tree.shape, p.alpha, float(p.beta)
        (torch.Size([8]), 0.6, 0.4)
    """

    sum_tree: Tensor
    min_tree: Tensor
    max_priority: Tensor
    beta: Tensor
    alpha: float = 0.6
    eps: float = 1e-8


@tensorclass(serialized_type_name="tdfunc.rl.ReplayState")
class ReplayState:
    """The state of a replay buffer, a value: rows, counters and (prioritised) priorities.

    * ``storage``: a container whose first batch dim is the capacity; row ``i % capacity``
      holds the ``i``-th row ever added.
    * ``start``, ``end``: int64 scalars; rows ``start <= i < end`` hold data
      (``end - start`` rows, at most the capacity). ``cursor`` (where the next row goes) is
      ``end % capacity``.
    * ``priorities``: a :class:`Priorities`, or ``None`` for uniform sampling.

    It saves and loads like any container (``tdfunc.save`` / ``tdfunc.load``; a process that
    loads one imports ``tdfunc.rl``). Build one with :func:`init` (in memory) or
    :func:`create_store` (on disk).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(obs=torch.zeros(3)), capacity=4)
        >>> three = tdfunc.TensorDict(obs=torch.ones(3, 3), batch_size=[3])
        >>> state = rl.add(rl.add(state, three), three)     # 6 rows: the ring wrapped
        >>> state.capacity, int(rl.size(state)), int(state.cursor)
        (4, 4, 2)
    """

    storage: Container
    start: Tensor
    end: Tensor
    priorities: Priorities | None = None

    @property
    def capacity(self) -> int:
        """The number of rows the buffer holds at most (the storage's first batch dim)."""
        return int(self.storage.batch_size[0])

    @property
    def cursor(self) -> Tensor:
        """Where the next row goes: ``end % capacity`` (an int64 scalar)."""
        return self.end % self.capacity


def _node(x: ReplayState | Priorities) -> Any:
    """``x`` seen as the container it is (type checkers do not see that a tensorclass is a
    ``Container``, with its methods)."""
    return x


def size(state: ReplayState) -> Tensor:
    """The number of rows that hold data, ``end - start`` (an int64 scalar tensor).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(())), capacity=8)
        >>> int(rl.size(rl.add(state, tdfunc.TensorDict(x=torch.ones(3), batch_size=[3]))))
        3
    """
    check_state(state, "size")
    return state.end - state.start


# --------------------------------------------------------------------------------------
# checks shared by the functions here and the store calls
# --------------------------------------------------------------------------------------
def check_state(state: Any, what: str) -> None:
    """``TypeError`` unless ``state`` is a :class:`ReplayState`."""
    if not isinstance(state, ReplayState):
        raise TypeError(NOT_A_STATE.format(what=what, typ=type(state).__name__))


def _check_int(value: Any, what: str, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(BAD_COUNT.format(what=what, name=name, value=value))
    return value


def _check_hyper(value: Any, what: str, name: str) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not value >= 0
        or value == float("inf")
    ):
        raise ValueError(BAD_HYPER.format(what=what, name=name, value=value))
    return float(value)


def check_batch(state: ReplayState, batch: Any, what: str, writable: bool) -> list[Any]:
    """The leaves of ``batch`` paired with the storage's (key by key), after every check:
    the batch's structure is the storage's (``KeyError`` naming the key), its batch size is
    ``[n, *row batch]`` with ``n <= capacity`` and each leaf has the stored row shape
    (``ValueError`` naming the key), dtypes cast safely (``TypeError``). ``writable``: every
    leaf of the storage must be a store leaf opened ``"r+"`` (``PermissionError`` for a
    read-only one)."""
    if not is_node(batch):
        raise TypeError(NOT_A_CONTAINER.format(what=what, arg="batch", typ=type(batch).__name__))
    storage = state.storage
    pairs = pair_leaves(storage, batch, what, "batch", writable)
    row_bs = storage.batch_size[1:]
    got = batch.batch_size
    if len(got) != len(row_bs) + 1 or got[1:] != row_bs:
        raise ValueError(
            NO_BATCH_DIM.format(
                what=what,
                got=tuple(got),
                row=", ".join(map(str, row_bs)) or "",
                row_bs=tuple(row_bs),
            )
        )
    n = int(got[0])
    if n > state.capacity:
        raise ValueError(BATCH_TOO_LARGE.format(what=what, n=n, capacity=state.capacity))
    check_rows(pairs, 1, torch.Size([n]), what, "batch")
    return pairs


def _refuse_store(state: ReplayState, what: str) -> None:
    """A pure call on a state whose leaves are a read-write store would leave the file as it
    was: refused, naming the store call (``TypeError``)."""
    from ..memmap._tensor import MemoryMappedTensor

    for path, leaf in leaves_with_paths(_node(state)):
        if isinstance(leaf, MemoryMappedTensor) and leaf.mode == "r+":
            raise TypeError(
                WRITABLE_STORE.format(what=what, key=fmt_key(path), filename=leaf.filename)
            )


# --------------------------------------------------------------------------------------
# the trees
# --------------------------------------------------------------------------------------
def _tree_leaves(capacity: int) -> int:
    return 1 << max(capacity - 1, 0).bit_length()


def new_priorities(
    capacity: int, alpha: float, beta: float, eps: float, device: torch.device | None
) -> Priorities:
    """Empty trees for ``capacity`` rows (no row holds data)."""
    n = _tree_leaves(capacity)
    kw: dict[str, Any] = {"dtype": TREE_DTYPE, "device": device}
    return Priorities(
        sum_tree=torch.zeros(2 * n, **kw),
        min_tree=torch.full((2 * n,), float("inf"), **kw),
        max_priority=torch.ones((), **kw),
        beta=torch.full((), beta, **kw),
        alpha=alpha,
        eps=eps,
    )


def tree_set(p: Priorities, rows: Tensor, stored: Tensor, inplace: bool) -> tuple[Tensor, Tensor]:
    """The trees with rows ``rows`` set to ``stored`` (already ``(priority + eps) ** alpha``)
    and every inner node above them recomputed (``log2(n)`` small index ops). ``inplace``
    writes into ``p``'s trees (donated buffers, a store); else into copies of them."""
    s, m = p.sum_tree, p.min_tree
    if not inplace:
        s, m = s.clone(), m.clone()
    n = s.shape[0] // 2
    node = rows.reshape(-1) + n
    s.index_put_((node,), stored.reshape(-1).to(s.dtype))
    m.index_put_((node,), s[node])  # one value per row, also for a row given twice
    for _ in range(n.bit_length() - 1):
        node = node // 2
        s.index_put_((node,), s[2 * node] + s[2 * node + 1])
        m.index_put_((node,), torch.minimum(m[2 * node], m[2 * node + 1]))
    return s, m


def descend(sum_tree: Tensor, mass: Tensor) -> Tensor:
    """For each ``mass`` in ``[0, total)``, the row whose interval of the running sum of the
    leaves holds it: a walk from the root, one level per step over all masses at once. It
    never enters a subtree whose sum is 0, so a row with no data (or priority 0) is never
    returned while the total is positive, whatever the rounding."""
    n = sum_tree.shape[0] // 2
    node = torch.ones(mass.shape, dtype=torch.int64, device=mass.device)
    for _ in range(n.bit_length() - 1):
        left = sum_tree[2 * node]
        right = sum_tree[2 * node + 1]
        go_right = ((mass >= left) & (right > 0)) | (left <= 0)
        mass = torch.where(go_right, mass - left, mass)
        node = 2 * node + go_right.to(torch.int64)
    return node - n


def stored_priority(p: Priorities, priority: Tensor) -> Tensor:
    """What a row's leaf holds for ``priority``: ``(priority + eps) ** alpha``."""
    return (priority.to(TREE_DTYPE) + p.eps) ** p.alpha


# --------------------------------------------------------------------------------------
# init / add
# --------------------------------------------------------------------------------------
def spec(
    example: Any,
    capacity: int,
    prioritized: bool,
    alpha: float,
    beta: float,
    eps: float,
    what: str,
    materialize: bool,
) -> ReplayState:
    """The state :func:`init` and :func:`create_store` make, checked; ``materialize=False``
    leaves the storage as a zero-stride view of the example (no memory: a store saves it
    in chunks)."""
    if not is_node(example):
        raise TypeError(
            NOT_A_CONTAINER.format(what=what, arg="example", typ=type(example).__name__)
        )
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(BAD_CAPACITY.format(what=what, value=capacity))
    alpha = _check_hyper(alpha, what, "alpha")
    beta = _check_hyper(beta, what, "beta")
    eps = _check_hyper(eps, what, "eps")
    for path, leaf in leaves_with_paths(example):
        if is_jagged(leaf):
            raise TypeError(JAGGED_EXAMPLE.format(key=fmt_key(path)))
    ls = leaves(example)
    device = ls[0].device if ls else None
    rows = example.expand(capacity, *example.batch_size)
    storage = zeros_like(rows) if materialize else rows
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return ReplayState(
        storage=storage,
        start=zero,
        end=zero.clone(),
        priorities=new_priorities(capacity, alpha, beta, eps, device) if prioritized else None,
    )


def init(
    example: Any,
    capacity: int,
    *,
    prioritized: bool = False,
    alpha: float = 0.6,
    beta: float = 0.4,
    eps: float = 1e-8,
) -> ReplayState:
    """A new, empty replay buffer for rows shaped like ``example``.

    Args:
        example: one row: a container whose leaves have a row's shapes and dtypes (its
            values are not used). The storage has batch size ``[capacity, *example's]``.
        capacity: the most rows the buffer holds; adding more replaces the oldest.
        prioritized: keep priorities (sum and min trees) for :func:`sample` to draw rows in
            proportion to ``priority ** alpha`` (torchrl's ``PrioritizedSampler``).
        alpha: the priority exponent (0: uniform); fixed for the buffer's life.
        beta: the importance-weight exponent (change it with :func:`set_beta`).
        eps: added to every priority before the exponent.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> row = tdfunc.TensorDict(obs=torch.zeros(4), action=torch.zeros((), dtype=torch.long))
        >>> state = rl.init(row, capacity=100)
        >>> state.storage.batch_size, state.storage["action"].dtype, int(rl.size(state))
        (torch.Size([100]), torch.int64, 0)
    """
    return spec(example, capacity, prioritized, alpha, beta, eps, "init", materialize=True)


def plan_add(state: ReplayState, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Where ``n`` new rows go and the counters after them: ``(rows, start, end)``."""
    cap = state.capacity
    rows = (state.end + torch.arange(n, device=state.end.device)) % cap
    end = state.end + n
    return rows, torch.maximum(state.start, end - cap), end


def add(state: ReplayState, batch: Any, *, donate: bool = False) -> ReplayState:
    """A new state with the rows of ``batch`` written at the cursor (a ring: once the buffer
    is full, the oldest rows are replaced). Prioritised, the new rows get the largest
    priority given so far (1 before any), as torchrl's ``PrioritizedSampler`` does.

    ``state`` is left as it was: the new storage is a copy with the rows written, which
    compiled and donated (``tdfunc.compile(fn, donate=...)``) is a write of the new rows into
    the donated storage. ``donate=True`` (eager only; in a compiled function, donate with
    ``tdfunc.compile``) writes the rows into ``state``'s own tensors and consumes ``state``
    (a later use raises :class:`tdfunc.DonatedError`), as :func:`tdfunc.optim.step` does.

    Args:
        state: the buffer.
        batch: rows with the storage's keys: batch size ``[n, *row batch]``, ``n`` at most
            the capacity, leaf shapes ``[n, *row shape]``; dtypes are cast to the stored ones.
        donate: write into ``state`` and consume it.

    Raises:
        KeyError: the batch lacks a key of the storage or has one it does not (naming it).
        ValueError: a batch size or a leaf shape that does not fit (naming the key), more rows
            than the capacity.
        TypeError: not a :class:`ReplayState`; a state whose storage is a read-write store
            (write into it with :func:`store_add`); a dtype that does not cast safely.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(())), capacity=3)
        >>> state = rl.add(state, tdfunc.TensorDict(x=torch.tensor([1.0, 2.0]), batch_size=[2]))
        >>> state = rl.add(state, tdfunc.TensorDict(x=torch.tensor([3.0, 4.0]), batch_size=[2]))
        >>> state.storage["x"].tolist(), int(state.cursor), int(rl.size(state))
        ([4.0, 2.0, 3.0], 1, 3)
    """
    check_state(state, "add")
    if not donate:
        _refuse_store(state, "add")
    pairs = check_batch(state, batch, "add", writable=False)
    n = int(batch.batch_size[0])
    rows, start, end = plan_add(state, n)
    p = state.priorities
    if donate:
        _donate.check_donated((state, batch), {}, (0,), "rl.add", names=("state", "batch"))
        with torch.no_grad():
            for _, leaf, v in pairs:
                leaf.index_put_((rows,), v.to(device=leaf.device, dtype=leaf.dtype))
            state.start.copy_(start)
            state.end.copy_(end)
            if p is not None:
                tree_set(p, rows, stored_priority(p, p.max_priority).expand(n), inplace=True)
        out = shallow_copy(_node(state))
        _donate.consume(state, DONATED.format(what="rl.add"))
        return out
    new = [
        torch.index_put(leaf, (rows,), v.to(device=leaf.device, dtype=leaf.dtype))
        for _, leaf, v in pairs
    ]
    storage = map_leaves(state.storage, new)
    if p is not None:
        s, m = tree_set(p, rows, stored_priority(p, p.max_priority).expand(n), inplace=False)
        p = _node(p).replace(sum_tree=s, min_tree=m)
    return _node(state).replace(storage=storage, start=start, end=end, priorities=p)


DONATED = (
    "this replay state was donated to {what}(..., donate=True): its buffers now hold that "
    "call's result; use the state it returned"
)


# --------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------
def sample(
    state: ReplayState, batch_size: int, generator: torch.Generator | None = None
) -> tuple[Any, TensorDict]:
    """Draw ``batch_size`` rows (with replacement): ``(batch, info)``.

    Uniform over the rows that hold data, or, prioritised, row ``i`` with probability
    ``p_i / sum(p)`` where ``p_i = (priority_i + eps) ** alpha``, with torchrl's importance
    weights ``w_i = (N * P(i)) ** -beta / max_j w_j = (p_i / min(p)) ** -beta`` (the max over
    every row that holds data, as torchrl's ``PrioritizedSampler``).

    Args:
        state: the buffer (in memory or a store; the rows are read, nothing is written).
        batch_size: the number of rows.
        generator: the random stream, or ``None`` for torch's global one. Dynamo cannot trace
            a ``torch.Generator``: inside ``torch.compile`` use ``None`` (seeded with
            ``torch.manual_seed``).

    Returns:
        ``batch``, the rows (batch size ``[batch_size, *row batch]``, in memory), and
        ``info``, a TensorDict of batch size ``[batch_size]`` with ``"index"``, the row of
        the storage each came from (``batch[k]`` is ``state.storage[info["index"][k]]``),
        and, prioritised, ``"weight"`` (float32).

    Raises:
        ValueError: the buffer holds no rows (raised by the compiled program too).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(())), capacity=8)
        >>> state = rl.add(state, tdfunc.TensorDict(x=torch.arange(5.0), batch_size=[5]))
        >>> batch, info = rl.sample(state, 3, torch.Generator().manual_seed(0))
        >>> bool((batch["x"] == state.storage["x"][info["index"]]).all()), batch.batch_size
        (True, torch.Size([3]))
    """
    check_state(state, "sample")
    _check_int(batch_size, "sample", "batch_size")
    p = state.priorities
    device = state.end.device
    if p is None:
        n = state.end - state.start
        refuse_if(n <= 0, ValueError, EMPTY.format(what="sample"))
        u = torch.rand(batch_size, dtype=torch.float64, generator=generator, device=device)
        off = torch.minimum((u * n).to(torch.int64), n - 1)
        idx = (state.start + off) % state.capacity
        info = TensorDict(index=idx, batch_size=[batch_size])
    else:
        idx, weight = _prioritized(p, batch_size, generator, device, "sample")
        info = TensorDict(index=idx, weight=weight, batch_size=[batch_size])
    return index_rows(state.storage, idx), info


def _prioritized(
    p: Priorities,
    batch_size: int,
    generator: torch.Generator | None,
    device: torch.device,
    what: str,
) -> tuple[Tensor, Tensor]:
    total = p.sum_tree[1]
    refuse_if(total <= 0, ValueError, EMPTY.format(what=what))
    u = torch.rand(batch_size, dtype=TREE_DTYPE, generator=generator, device=device)
    idx = descend(p.sum_tree, u * total)
    n = p.sum_tree.shape[0] // 2
    weight = (p.sum_tree[idx + n] / p.min_tree[1]) ** (-p.beta)
    return idx, weight.to(torch.float32)


# --------------------------------------------------------------------------------------
# priorities
# --------------------------------------------------------------------------------------
def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    """``shape`` broadcasts to ``to`` (and not the other way round)."""
    if len(shape) > len(to):
        return False
    return all(a in (1, b) for a, b in zip(reversed(shape), reversed(to)))


def check_priorities(
    state: ReplayState, index: Any, priority: Any, what: str
) -> tuple[Priorities, Tensor, Tensor]:
    """The priorities, the rows and their priorities (float64, the rows' shape), checked:
    shapes and dtypes here, values by graph ops that raise when the program runs (rows in
    range and holding data, priorities ``>= 0``)."""
    check_state(state, what)
    p = state.priorities
    if p is None:
        raise TypeError(NOT_PRIORITIZED.format(what=what))
    index = torch.as_tensor(index, device=state.end.device)
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise TypeError(BAD_INDEX_DTYPE.format(what=what, dtype=index.dtype))
    rows = index.reshape(-1).to(torch.int64)
    pr = torch.as_tensor(priority, device=state.end.device)
    if not _broadcasts(pr.shape, index.shape):
        raise ValueError(
            PRIORITY_SHAPE.format(what=what, got=tuple(pr.shape), want=tuple(index.shape))
        )
    pr = pr.to(TREE_DTYPE).broadcast_to(index.shape).reshape(-1)
    cap = state.capacity
    refuse_if(
        (rows < 0) | (rows >= cap), IndexError, INDEX_OUT_OF_RANGE.format(what=what, capacity=cap)
    )
    held = (rows - state.start) % cap < state.end - state.start
    refuse_if(~held, IndexError, INDEX_NO_DATA.format(what=what))
    stored = stored_priority(p, pr)
    refuse_if(~((pr >= 0) & (stored > 0)), ValueError, BAD_PRIORITY.format(what=what))
    return p, rows, pr


def update_priorities(
    state: ReplayState, index: Any, priority: Any, *, donate: bool = False
) -> ReplayState:
    """A new state with the priorities of rows ``index`` set to ``priority`` (torchrl's
    ``update_priority``): their leaves hold ``(priority + eps) ** alpha``, and the largest
    priority so far (what new rows get) is updated. A row given twice keeps one of its
    values. ``donate=True`` (eager only) writes into ``state``'s trees and consumes it.

    Args:
        state: a prioritised buffer.
        index: rows of the storage (an integer tensor, e.g. a sample's ``info["index"]``).
        priority: a number, or a tensor that broadcasts to ``index``'s shape (e.g. the
            absolute TD errors).
        donate: write into ``state`` and consume it.

    Raises:
        TypeError: a buffer without priorities, an index that is not integer.
        ValueError: a priority shape that does not broadcast; a negative or NaN priority.
        IndexError: a row out of range or holding no data (both also by the compiled
            program).

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(())), 4, prioritized=True, alpha=1.0)
        >>> state = rl.add(state, tdfunc.TensorDict(x=torch.arange(4.0), batch_size=[4]))
        >>> state = rl.update_priorities(state, torch.tensor([0, 3]), torch.tensor([3.0, 0.0]))
        >>> round(float(state.priorities.sum_tree[1]), 6)   # 3 + 1 + 1 + 0 (+ eps)
        5.0
    """
    p, rows, pr = check_priorities(state, index, priority, "update_priorities")
    if not donate:
        _refuse_store(state, "update_priorities")
    stored = stored_priority(p, pr)
    mp = torch.maximum(p.max_priority, pr.max()) if pr.numel() else p.max_priority
    if donate:
        _donate.check_donated((state,), {}, (0,), "rl.update_priorities", names=("state",))
        with torch.no_grad():
            tree_set(p, rows, stored, inplace=True)
            p.max_priority.copy_(mp)
        out = shallow_copy(_node(state))
        _donate.consume(state, DONATED.format(what="rl.update_priorities"))
        return out
    s, m = tree_set(p, rows, stored, inplace=False)
    return _node(state).replace(
        priorities=_node(p).replace(sum_tree=s, min_tree=m, max_priority=mp)
    )


def set_beta(state: ReplayState, beta: float | Tensor) -> ReplayState:
    """A new state whose importance weights use exponent ``beta`` (torchrl anneals it
    towards 1 during training). A tensor (or a number: made a tensor) changes the state's
    ``beta`` leaf, so a compiled sampler does not recompile.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> state = rl.init(tdfunc.TensorDict(x=torch.zeros(())), 4, prioritized=True)
        >>> float(rl.set_beta(state, 1.0).priorities.beta)
        1.0
    """
    check_state(state, "set_beta")
    p = state.priorities
    if p is None:
        raise TypeError(NOT_PRIORITIZED.format(what="set_beta"))
    if not isinstance(beta, Tensor):
        beta = torch.tensor(_check_hyper(beta, "set_beta", "beta"))
    return _node(state).replace(priorities=_node(p).replace(beta=beta.to(p.beta).reshape(())))


__all__ = [
    "Priorities",
    "ReplayState",
    "add",
    "init",
    "sample",
    "set_beta",
    "size",
    "update_priorities",
]
