"""``ReplayBuffer``: an object around the replay functions, for eager code.

The functions (:func:`init`, :func:`add`, :func:`sample`...) are the API that compiles; this
class keeps a state and calls them: in memory it adds with ``donate=True`` (the rows are
written into its own tensors, no copy of the storage), on disk with the store calls.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .. import _donate
from .._tree import shallow_copy
from ..tensordict import TensorDict
from ._replay import (
    DONATED,
    ReplayState,
    _node,
    add,
    init,
    sample,
    set_beta,
    size,
    update_priorities,
)
from ._replay_slices import Key, sample_episodes, sample_slices
from ._replay_store import (
    StoreWriter,
    create_store,
    open_store,
    store_sample,
    store_update_priorities,
)


class ReplayBuffer:
    """A replay buffer object over :class:`ReplayState` (torchrl's ``ReplayBuffer`` shape):
    ``add``, ``sample``, ``sample_slices``, ``sample_episodes``, ``update_priorities``,
    ``len``. In memory (``ReplayBuffer(example, capacity)``) or on disk
    (:meth:`create` / :meth:`open`: the store calls, safe with readers in other processes).

    :attr:`state` is the current value. In memory each ``add`` donates it (written in place,
    as :func:`add` with ``donate=True``): a state read before an ``add`` raises
    :class:`tdfunc.DonatedError` when used after it; take ``state.clone()`` to keep one.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import rl
        >>> buf = rl.ReplayBuffer(tdfunc.TensorDict(obs=torch.zeros(3)), capacity=100)
        >>> buf.add(tdfunc.TensorDict(obs=torch.randn(10, 3), batch_size=[10]))
        >>> batch, info = buf.sample(4)
        >>> len(buf), batch.batch_size, info["index"].shape
        (10, torch.Size([4]), torch.Size([4]))
    """

    def __init__(
        self,
        example: Any,
        capacity: int,
        *,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-8,
    ) -> None:
        self._state = init(
            example, capacity, prioritized=prioritized, alpha=alpha, beta=beta, eps=eps
        )
        self._on_disk = False
        self._writer: StoreWriter | None = None

    @classmethod
    def _wrap(cls, state: ReplayState) -> ReplayBuffer:
        out = cls.__new__(cls)
        out._state = state
        out._on_disk = True
        out._writer = None  # made by the first add (a read-only store refuses it)
        return out

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        example: Any,
        capacity: int,
        *,
        prioritized: bool = False,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-8,
        overwrite: bool = False,
    ) -> ReplayBuffer:
        """A new buffer on disk (:func:`create_store`), open read-write.

        Example:
            >>> import os, tempfile, torch, tdfunc
            >>> from tdfunc import rl
            >>> path = os.path.join(tempfile.mkdtemp(), "buf")
            >>> buf = rl.ReplayBuffer.create(path, tdfunc.TensorDict(x=torch.zeros(())), 8)
            >>> buf.add(tdfunc.TensorDict(x=torch.ones(3), batch_size=[3]))
            >>> len(rl.ReplayBuffer.open(path))
            3
        """
        state = create_store(
            path,
            example,
            capacity,
            prioritized=prioritized,
            alpha=alpha,
            beta=beta,
            eps=eps,
            overwrite=overwrite,
        )
        return cls._wrap(state)

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, mode: str = "r") -> ReplayBuffer:
        """The buffer on disk at ``path`` (:func:`open_store`): ``"r"`` to sample,
        ``"r+"`` to add too."""
        return cls._wrap(open_store(path, mode=mode))

    @property
    def state(self) -> ReplayState:
        """The current state (a value; in memory, the next ``add`` donates it)."""
        return self._state

    @property
    def capacity(self) -> int:
        """The most rows the buffer holds."""
        return self._state.capacity

    def __len__(self) -> int:
        return int(size(self._state))

    def __repr__(self) -> str:
        where = "on disk" if self._on_disk else "in memory"
        return f"ReplayBuffer({len(self)}/{self.capacity} rows, {where})"

    def add(self, batch: Any) -> None:
        """Add the rows of ``batch`` (:func:`add`, in place)."""
        if self._on_disk:
            if self._writer is None:
                self._writer = StoreWriter(self._state)
            self._writer.add(batch)
        else:
            self._state = add(self._state, batch, donate=True)

    def sample(
        self, batch_size: int, generator: torch.Generator | None = None
    ) -> tuple[Any, TensorDict]:
        """:func:`sample` (on disk through :func:`store_sample`)."""
        return self._read(sample, batch_size, generator)

    def sample_slices(
        self,
        num_slices: int,
        slice_len: int,
        generator: torch.Generator | None = None,
        *,
        traj_key: Key | None = None,
        done_key: Key | None = None,
    ) -> tuple[Any, TensorDict]:
        """:func:`sample_slices` (on disk through :func:`store_sample`)."""
        return self._read(
            sample_slices,
            num_slices,
            slice_len,
            generator,
            traj_key=traj_key,
            done_key=done_key,
        )

    def sample_episodes(
        self,
        num_episodes: int,
        generator: torch.Generator | None = None,
        *,
        traj_key: Key | None = None,
        done_key: Key | None = None,
    ) -> tuple[Any, TensorDict]:
        """:func:`sample_episodes` (on disk through :func:`store_sample`)."""
        return self._read(
            sample_episodes, num_episodes, generator, traj_key=traj_key, done_key=done_key
        )

    def update_priorities(self, index: Any, priority: Any) -> None:
        """Set the priorities of rows ``index`` (:func:`update_priorities`, in place)."""
        if self._on_disk:
            store_update_priorities(self._state, index, priority)
        else:
            self._state = update_priorities(self._state, index, priority, donate=True)

    def set_beta(self, beta: float) -> None:
        """The importance-weight exponent of later samples (:func:`set_beta`)."""
        new = set_beta(self._state, beta)
        assert new.priorities is not None
        assert self._state.priorities is not None
        with torch.no_grad():
            self._state.priorities.beta.copy_(new.priorities.beta)
        if not self._on_disk:  # the old value no longer describes the buffer
            old, self._state = self._state, shallow_copy(_node(self._state))
            _donate.consume(old, DONATED.format(what="ReplayBuffer.set_beta"))

    def _read(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, TensorDict]:
        if self._on_disk:
            return store_sample(self._state, fn, *args, **kwargs)
        out: tuple[Any, TensorDict] = fn(self._state, *args, **kwargs)
        return out


__all__ = ["ReplayBuffer"]
