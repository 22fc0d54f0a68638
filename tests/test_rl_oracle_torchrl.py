"""tdfunc.rl against torchrl on the same random data: GAE, TD(λ) and split_trajectories.

Skipped where torchrl is not installed (the main suite's venv). To run it: a venv with
torch, ``torchrl`` and ``tensordict`` (``python -m venv .venv-torchrl``, then
``.venv-torchrl/bin/pip install torch==2.13.0``, ``torchrl==0.14.1 'tensordict>=0.14,<0.15'``
and ``optree pytest hypothesis``), and from the repository root::

    PYTHONPATH=. .venv-torchrl/bin/python -m pytest -q -p no:cacheprovider tests/test_rl_oracle_torchrl.py
"""

from __future__ import annotations

import pytest
import torch

torchrl = pytest.importorskip("torchrl")
tensordict = pytest.importorskip("tensordict")

from torchrl.collectors.utils import split_trajectories as trl_split  # noqa: E402
from torchrl.objectives.value import GAE, TDLambdaEstimator  # noqa: E402
from torchrl.objectives.value.functional import (  # noqa: E402
    generalized_advantage_estimate,
    td_lambda_return_estimate,
)

import tdfunc  # noqa: E402
import tdfunc.rl  # noqa: E402


def data(n: int, t: int, seed: int, feat: int = 1, p: float = 0.25):
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, t, 1, generator=g) < p
    term = done & (torch.rand(n, t, 1, generator=g) < 0.5)
    return {
        "state_value": torch.randn(n, t, feat, generator=g),
        ("next", "state_value"): torch.randn(n, t, feat, generator=g),
        ("next", "reward"): torch.randn(n, t, feat, generator=g),
        ("next", "done"): done,
        ("next", "terminated"): term,
        "obs": torch.randn(n, t, 3, generator=g),
    }


def ours(d, n, t):
    td = tdfunc.TensorDict(batch_size=[n, t])
    for k, v in d.items():
        td = td.set(k, v)
    return td


def theirs(d, n, t):
    return tensordict.TensorDict(d, batch_size=[n, t])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("gamma", "lmbda"), [(0.99, 0.95), (0.9, 0.5), (1.0, 1.0)])
def test_gae_and_td_lambda_match_torchrl_functional(seed, gamma, lmbda):
    n, t = 3, 11
    d = data(n, t, seed)
    td = ours(d, n, t)
    v, nv, r = d["state_value"], d["next", "state_value"], d["next", "reward"]
    done, term = d["next", "done"], d["next", "terminated"]
    adv, target = generalized_advantage_estimate(gamma, lmbda, v, nv, r, done, term, time_dim=-2)
    out = tdfunc.rl.gae(td, gamma=gamma, lmbda=lmbda)
    torch.testing.assert_close(out["advantage"], adv)
    torch.testing.assert_close(out["value_target"], target)
    ret = td_lambda_return_estimate(gamma, lmbda, nv, r, done, term, time_dim=-2)
    out = tdfunc.rl.td_lambda_return(td, gamma=gamma, lmbda=lmbda)
    torch.testing.assert_close(out["value_target"], ret)
    # per-step gamma and lambda (rolling_gamma=True)
    g = torch.Generator().manual_seed(seed + 100)
    gam, lam = torch.rand(v.shape, generator=g), torch.rand(v.shape, generator=g)
    ret = td_lambda_return_estimate(gam, lam, nv, r, done, term, time_dim=-2)
    out = tdfunc.rl.td_lambda_return(td, gamma=gam, lmbda=lam)
    torch.testing.assert_close(out["value_target"], ret)


@pytest.mark.parametrize("seed", range(3))
def test_gae_and_td_lambda_match_torchrl_modules(seed):
    """The value-estimator modules read the same keys: state_value, ('next', ...)."""
    n, t = 4, 9
    d = data(n, t, seed)
    gae = GAE(gamma=0.97, lmbda=0.9, value_network=None, vectorized=False)
    want = gae(theirs(d, n, t))
    got = tdfunc.rl.gae(ours(d, n, t), gamma=0.97, lmbda=0.9)
    torch.testing.assert_close(got["advantage"], want["advantage"])
    torch.testing.assert_close(got["value_target"], want["value_target"])
    tdl = TDLambdaEstimator(gamma=0.97, lmbda=0.9, value_network=None, vectorized=False)
    want = tdl(theirs(d, n, t))
    got = tdfunc.rl.td_lambda_return(ours(d, n, t), gamma=0.97, lmbda=0.9)
    torch.testing.assert_close(got["advantage"], want["advantage"])
    torch.testing.assert_close(got["value_target"], want["value_target"])
    # no terminated entry: done stands for it in both
    d2 = {k: v for k, v in d.items() if k != ("next", "terminated")}
    want = GAE(gamma=0.97, lmbda=0.9, value_network=None, vectorized=False)(theirs(d2, n, t))
    got = tdfunc.rl.gae(ours(d2, n, t), gamma=0.97, lmbda=0.9)
    torch.testing.assert_close(got["advantage"], want["advantage"])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", [(3, 8), (1, 5), (8,)])
def test_split_trajectories_matches_torchrl(seed, shape):
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(*shape, 1, generator=g) < (0.0 if seed == 0 else 0.3)
    d = {"obs": torch.randn(*shape, 2, generator=g), ("next", "done"): done}
    td_theirs = tensordict.TensorDict(d, batch_size=shape)
    want = trl_split(td_theirs, done_key="done")
    td_ours = tdfunc.TensorDict(batch_size=shape).set("obs", d["obs"]).set(("next", "done"), done)
    got = tdfunc.rl.split_trajectories(td_ours, padded=True)
    assert got.batch_size == want.batch_size
    torch.testing.assert_close(got["mask"], want["mask"])
    torch.testing.assert_close(got["obs"], want["obs"])
    torch.testing.assert_close(got["next", "done"], want["next", "done"])
    jagged = tdfunc.rl.split_trajectories(td_ours)
    rows = jagged["obs"].unbind()
    assert len(rows) == want.batch_size[0]
    for i, row in enumerate(rows):
        torch.testing.assert_close(row, want["obs"][i][want["mask"][i]])
