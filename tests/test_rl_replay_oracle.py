"""tdfunc.rl's prioritised sampling against torchrl's PrioritizedSampler on the same
priorities: the stored leaves, the importance weights of each row and the sampling
distribution. Skipped unless torchrl imports (it needs tensordict 0.14.x, so it lives in a
venv of its own: ``make test-rl-oracle``)."""

from __future__ import annotations

import pytest
import torch

import tdfunc
from tdfunc import rl

torchrl_data = pytest.importorskip("torchrl.data")


def _sum_tree_loads() -> bool:
    """torchrl's sum tree is a C++ extension built for one torch release: with another one
    it does not load (an undefined symbol), and PrioritizedSampler raises RuntimeError."""
    try:
        torchrl_data.PrioritizedSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _sum_tree_loads(), reason="torchrl's C++ sum tree does not load with this torch"
)

N, ALPHA, BETA, EPS = 12, 0.7, 0.5, 1e-6


def _pair() -> tuple[rl.ReplayState, torchrl_data.ReplayBuffer, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    priority = torch.rand(N, generator=g, dtype=torch.float64) * 3
    priority[3] = 0.0  # eps keeps it drawable
    rows = tdfunc.TensorDict(x=torch.arange(N, dtype=torch.float32), batch_size=[N])
    state = rl.init(rows[0], N, prioritized=True, alpha=ALPHA, beta=BETA, eps=EPS)
    state = rl.update_priorities(rl.add(state, rows), torch.arange(N), priority)
    sampler = torchrl_data.PrioritizedSampler(N, ALPHA, BETA, eps=EPS, dtype=torch.float64)
    buf = torchrl_data.ReplayBuffer(storage=torchrl_data.LazyTensorStorage(N), sampler=sampler)
    buf.extend(torch.arange(N, dtype=torch.float32))
    buf.update_priority(torch.arange(N), priority)
    return state, buf, priority


def test_stored_priorities_and_weights_match_torchrl() -> None:
    state, buf, _ = _pair()
    sampler = buf.sampler
    tree = state.priorities.sum_tree
    n = tree.shape[0] // 2
    ours = tree[n : n + N]
    theirs = torch.tensor([sampler._sum_tree[i] for i in range(N)], dtype=torch.float64)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
    _, info = buf.sample(4000, return_info=True)
    index = torch.as_tensor(info["index"])
    _, mine = rl.sample(state, 4000, torch.Generator().manual_seed(1))
    # the weight of a row is a function of the row: compare row by row
    weight_of = torch.zeros(N, dtype=torch.float64)
    weight_of[mine["index"]] = mine["weight"].double()
    torch.testing.assert_close(
        weight_of[index], torch.as_tensor(info["priority_weight"]).double(), rtol=1e-6, atol=0
    )


def test_sampling_distribution_matches_torchrl() -> None:
    state, buf, _ = _pair()
    n = 40_000
    torch.manual_seed(0)
    _, info = buf.sample(n, return_info=True)
    theirs = torch.bincount(torch.as_tensor(info["index"]), minlength=N).double()
    _, mine = rl.sample(state, n, torch.Generator().manual_seed(0))
    ours = torch.bincount(mine["index"], minlength=N).double()
    # two-sample chi-square over N - 1 degrees of freedom (11): p = 0.001 at 31.3
    chi2 = float(((ours - theirs) ** 2 / (ours + theirs).clamp(min=1)).sum())
    assert chi2 < 31.3, chi2
