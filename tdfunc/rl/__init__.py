"""Reinforcement-learning pipelines over containers: episodes of a rollout, returns and
advantages.

Example:
    >>> import torch, tdfunc, tdfunc.rl
    >>> done = torch.tensor([[False, True, False]])
    >>> rollout = tdfunc.TensorDict(next={"done": done}, batch_size=[1, 3])
    >>> tdfunc.rl.split_trajectories(rollout).batch_size
    torch.Size([2])
"""

from ._episodes import merge_trajectories, split_trajectories
from ._replay import (
    Priorities,
    ReplayState,
    add,
    init,
    sample,
    set_beta,
    size,
    update_priorities,
)
from ._replay_buffer import ReplayBuffer
from ._replay_slices import sample_episodes, sample_slices
from ._replay_store import (
    create_store,
    open_store,
    store_add,
    store_sample,
    store_update_priorities,
)
from ._returns import gae, td_lambda_return

__all__ = [
    "Priorities",
    "ReplayBuffer",
    "ReplayState",
    "add",
    "create_store",
    "gae",
    "init",
    "merge_trajectories",
    "open_store",
    "sample",
    "sample_episodes",
    "sample_slices",
    "set_beta",
    "size",
    "split_trajectories",
    "store_add",
    "store_sample",
    "store_update_priorities",
    "td_lambda_return",
    "update_priorities",
]
