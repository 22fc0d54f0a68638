"""Returns and advantages: tdfunc.rl.gae and tdfunc.rl.td_lambda_return against step-by-step
loops written from torchrl's documented recurrences."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import check_compiled, snapshot

import tdfunc
import tdfunc.rl
from tdfunc import TensorDict, tensorclass
from tdfunc.rl import _episodes as EP
from tdfunc.rl import _returns as R
from tdfunc.rl import gae, td_lambda_return
from tdfunc.testing import assert_close


def rollout(n: int = 3, t: int = 7, seed: int = 0, feat: tuple[int, ...] = (1,)) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, t, 1, generator=g) < 0.3
    terminated = done & (torch.rand(n, t, 1, generator=g) < 0.5)
    return TensorDict(
        state_value=torch.randn(n, t, *feat, generator=g),
        next={
            "reward": torch.randn(n, t, *feat, generator=g),
            "state_value": torch.randn(n, t, *feat, generator=g),
            "done": done,
            "terminated": terminated,
        },
        batch_size=[n, t],
    )


# ------------------------------------------------------------------ loop references
# torchrl.objectives.value.functional, time at dim -2 of [*B, T, F] tensors:
#   GAE:   delta_t = r_t + gamma * (1 - term_t) * V'_t - V_t
#          A_t = delta_t + gamma * lmbda * (1 - done_t) * A_{t+1}         (A_T = 0)
#   TD(λ): V'_t <- V'_t * (1 - term_t);  g = V'_{T-1}
#          for t = T-1 .. 0: g = g * (1 - done_t) + V'_t * done_t
#                            G_t = g = r_t + gamma_t * ((1 - lmbda_t) * V'_t + lmbda_t * g)
def gae_loop(gamma, lmbda, v, nv, r, done, term):
    adv = torch.empty_like(v)
    prev = torch.zeros_like(v[..., 0, :])
    for t in reversed(range(v.shape[-2])):
        delta = r[..., t, :] + gamma * (~term[..., t, :]) * nv[..., t, :] - v[..., t, :]
        prev = delta + gamma * lmbda * (~done[..., t, :]) * prev
        adv[..., t, :] = prev
    return adv, adv + v


def td_lambda_loop(gamma, lmbda, nv, r, done, term):
    gamma = torch.as_tensor(gamma).expand(nv.shape)
    lmbda = torch.as_tensor(lmbda).expand(nv.shape)
    nv = nv * (~term)
    out = torch.empty_like(nv)
    g = nv[..., -1, :]
    for t in reversed(range(nv.shape[-2])):
        dn = done[..., t, :].to(nv.dtype)
        g = g * (1 - dn) + nv[..., t, :] * dn
        g = r[..., t, :] + gamma[..., t, :] * (
            (1 - lmbda[..., t, :]) * nv[..., t, :] + lmbda[..., t, :] * g
        )
        out[..., t, :] = g
    return out


def parts(td):
    return (
        td["state_value"],
        td["next", "state_value"],
        td["next", "reward"],
        td["next", "done"],
        td["next", "terminated"],
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("gamma", "lmbda"), [(0.99, 0.95), (0.5, 1.0), (1.0, 0.0)])
def test_gae_matches_the_loop(seed, gamma, lmbda):
    td = rollout(seed=seed)
    before = snapshot(td)
    out = gae(td, gamma=gamma, lmbda=lmbda)
    v, nv, r, done, term = parts(td)
    adv, target = gae_loop(gamma, lmbda, v, nv, r, done, term)
    torch.testing.assert_close(out["advantage"], adv)
    torch.testing.assert_close(out["value_target"], target)
    assert out.batch_size == td.batch_size
    assert_close(td, before)  # the input is not modified
    assert_close(out.exclude("advantage", "value_target"), td)


@pytest.mark.parametrize("seed", [0, 1])
def test_td_lambda_matches_the_loop(seed):
    td = rollout(seed=seed)
    before = snapshot(td)
    v, nv, r, done, term = parts(td)
    out = td_lambda_return(td, gamma=0.9, lmbda=0.7)
    want = td_lambda_loop(0.9, 0.7, nv, r, done, term)
    torch.testing.assert_close(out["value_target"], want)
    torch.testing.assert_close(out["advantage"], want - v)
    # a gamma and a lambda per step (torchrl's rolling_gamma=True)
    g = torch.Generator().manual_seed(seed)
    gam, lam = torch.rand(v.shape, generator=g), torch.rand(v.shape, generator=g)
    out = td_lambda_return(td, gamma=gam, lmbda=lam, advantage_key=None)
    torch.testing.assert_close(out["value_target"], td_lambda_loop(gam, lam, nv, r, done, term))
    assert "advantage" not in out
    assert_close(td, before)


def test_flags_terminated_truncated_and_done():
    td = rollout(seed=2)
    v, nv, r, done, term = parts(td)
    trunc = done & ~term
    split = td.exclude(("next", "done")).set(("next", "truncated"), trunc)
    # done = terminated | truncated cuts the trace; terminated alone zeroes the bootstrap
    a = gae(td, gamma=0.9, lmbda=0.8)
    b = gae(split, gamma=0.9, lmbda=0.8, done_key=None, truncated_key=("next", "truncated"))
    torch.testing.assert_close(a["advantage"], b["advantage"])
    a = td_lambda_return(td, gamma=0.9, lmbda=0.8)
    b = td_lambda_return(
        split, gamma=0.9, lmbda=0.8, done_key=None, truncated_key=("next", "truncated")
    )
    torch.testing.assert_close(a["value_target"], b["value_target"])
    # no terminated entry: done stands for it (torchrl's default)
    no_term = td.exclude(("next", "terminated"))
    adv, _ = gae_loop(0.9, 0.8, v, nv, r, done, done)
    torch.testing.assert_close(gae(no_term, gamma=0.9, lmbda=0.8)["advantage"], adv)
    # flags without the trailing dim, values with a feature dim of 3
    wide = rollout(seed=3, feat=(3,))
    flat = wide.set(("next", "done"), wide["next", "done"].squeeze(-1))
    torch.testing.assert_close(
        gae(flat, gamma=0.9, lmbda=0.8)["advantage"], gae(wide, gamma=0.9, lmbda=0.8)["advantage"]
    )


def test_time_dim_keys_and_tensorclass():
    td = rollout(seed=4)
    want = gae(td, gamma=0.9, lmbda=0.8)
    tn = td.permute(1, 0)
    got = gae(tn, gamma=0.9, lmbda=0.8, time_dim=0)
    torch.testing.assert_close(got["advantage"], want["advantage"].transpose(0, 1))
    renamed = TensorDict(
        v=td["state_value"],
        nv=td["next", "state_value"],
        rew=td["next", "reward"],
        d=td["next", "done"],
        batch_size=td.batch_size,
    )
    got = gae(
        renamed,
        gamma=0.9,
        lmbda=0.8,
        value_key="v",
        next_value_key="nv",
        reward_key="rew",
        done_key="d",
        terminated_key=None,
        advantage_key=("out", "adv"),
        value_target_key="vt",
    )
    v, nv, r, done, _ = parts(td)
    adv, target = gae_loop(0.9, 0.8, v, nv, r, done, done)
    torch.testing.assert_close(got["out", "adv"], adv)
    torch.testing.assert_close(got["vt"], target)

    @tensorclass
    class Traj:
        state_value: torch.Tensor
        next: TensorDict
        advantage: torch.Tensor | None = None
        value_target: torch.Tensor | None = None

    tc = Traj(state_value=td["state_value"], next=td["next"], batch_size=td.batch_size)
    out = gae(tc, gamma=0.9, lmbda=0.8)
    assert type(out) is Traj
    torch.testing.assert_close(out.advantage, want["advantage"])


def test_compiled_fullgraph_vmap_and_grad():
    def step(td, gamma, lmbda):
        out = gae(td, gamma=gamma, lmbda=lmbda)
        out = td_lambda_return(out, gamma=gamma, lmbda=lmbda, value_target_key="ret")
        return out.select("advantage", "value_target", "ret")

    seeds = iter(range(10, 20))
    check_compiled(step, lambda: (rollout(seed=next(seeds)), torch.tensor(0.9), torch.rand(())))
    # vmap over a leading dim of rollouts, against a loop
    tds = tdfunc.stack([rollout(seed=s) for s in (5, 6)])
    got = torch.vmap(lambda t: gae(t, gamma=0.9, lmbda=0.8))(tds)
    for i in range(2):
        assert_close(got[i], gae(tds[i], gamma=0.9, lmbda=0.8))
    # gradients through the recurrence: d advantage / d value, against the loop's
    td = rollout(seed=7)
    v = td["state_value"].requires_grad_()
    ours = torch.autograd.grad(gae(td, gamma=0.9, lmbda=0.8)["advantage"].sum(), v)[0]
    _, nv, r, done, term = parts(td)
    ref = torch.autograd.grad(gae_loop(0.9, 0.8, v, nv, r, done, term)[0].sum(), v)[0]
    torch.testing.assert_close(ours, ref)


def test_reverse_recurrence_lengths():
    for n in (1, 2, 3, 8, 9):
        x, c = torch.randn(n, 2), torch.rand(n, 2)
        y = torch.zeros(2)
        want = torch.empty(n, 2)
        for t in reversed(range(n)):
            y = x[t] + c[t] * y
            want[t] = y
        torch.testing.assert_close(R.reverse_recurrence(x, c, 0), want)


@pytest.mark.parametrize("fn", [gae, td_lambda_return])
def test_errors_name_the_key(fn):
    name = fn.__name__
    td = rollout()
    cases = [
        (td.exclude(("next", "reward")), {}, KeyError, "no reward at key ('next', 'reward')"),
        (td.exclude("state_value"), {}, KeyError, "no value at key 'state_value'"),
        (
            td.set(("next", "done"), td["next", "done"].int()),
            {},
            TypeError,
            EP.FLAG_DTYPE.format(fn=name, key="('next', 'done')", dtype=torch.int32),
        ),
        (
            td.set(("next", "terminated"), torch.zeros(3, 7, 2, dtype=torch.bool)),
            {},
            ValueError,
            EP.FLAG_SHAPE.format(
                fn=name, key="('next', 'terminated')", shape=(3, 7, 2), batch=(3, 7)
            ),
        ),
        (td.exclude(("next", "done")), {}, KeyError, "no flag at key ('next', 'done')"),
        (
            td.exclude(("next", "terminated")),
            {"done_key": None},
            KeyError,
            R.NO_FLAG.format(fn=name, key="('next', 'terminated')"),
        ),
        (td, {"truncated_key": "tr"}, KeyError, "no flag at key 'tr'"),
        (
            td.set("state_value", td["state_value"].long()),
            {},
            TypeError,
            "the value at key 'state_value' has dtype torch.int64",
        ),
        (
            td.set(("next", "reward"), torch.zeros(3, 7, 2)),
            {},
            ValueError,
            "the reward at key ('next', 'reward') has shape (3, 7, 2)",
        ),
        (td, {"time_dim": 5}, ValueError, "time_dim=5 is not a batch dim"),
        (td[0, 0], {}, ValueError, R.NO_BATCH.format(fn=name)),
        (td, {"gamma": "0.9"}, TypeError, "gamma must be a float"),
        (td["state_value"], {}, TypeError, "got Tensor"),
    ]
    for bad, kwargs, exc, msg in cases:
        kw = {"gamma": 0.9, "lmbda": 0.8, **kwargs}
        with pytest.raises(exc, match=re.escape(msg)):
            fn(bad, **kw)
    # typed errors keep their type inside torch.compile
    with pytest.raises(KeyError, match="no reward"):
        torch.compile(lambda t: fn(t, gamma=0.9, lmbda=0.8), backend="eager")(cases[0][0])
