"""Episodes of a rollout: tdfunc.rl.split_trajectories and merge_trajectories."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import snapshot
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
import tdfunc.rl
from tdfunc import TensorDict, tensorclass
from tdfunc.rl import _episodes as E
from tdfunc.rl import merge_trajectories, split_trajectories
from tdfunc.testing import assert_close


def rollout(n: int = 3, t: int = 6, seed: int = 0, p: float = 0.3) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, t, 1, generator=g) < p
    return TensorDict(
        obs=torch.randn(n, t, 2, generator=g),
        step=torch.arange(n * t).reshape(n, t),
        next={"done": done, "reward": torch.randn(n, t, 1, generator=g)},
        batch_size=[n, t],
    )


def reference_episodes(r: TensorDict, done: torch.Tensor) -> list[TensorDict]:
    """The episodes by a Python loop over environments and steps (time last)."""
    out = []
    n, t = r.batch_size
    for i in range(n):
        start = 0
        for j in range(t):
            if bool(done[i, j]) or j == t - 1:
                out.append(r[i, start : j + 1])
                start = j + 1
    return out


def test_hand_checked_example():
    done = torch.tensor([[False, True, False, True], [False, False, False, False]])
    r = TensorDict(x=torch.arange(8.0).reshape(2, 4), next={"done": done}, batch_size=[2, 4])
    eps = split_trajectories(r)
    assert eps.batch_size == torch.Size([3])
    assert eps["x"].offsets().tolist() == [0, 2, 4, 8]
    assert [e.tolist() for e in eps["x"].unbind()] == [[0.0, 1.0], [2.0, 3.0], [4, 5, 6, 7]]
    pad = split_trajectories(r, padded=True)
    assert pad.batch_size == torch.Size([3, 4])
    assert pad["x"].tolist() == [[0, 1, 0, 0], [2, 3, 0, 0], [4, 5, 6, 7]]
    assert pad["mask"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert pad["next"].batch_size == (3, 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_values_match_a_loop_reference(seed):
    r = rollout(seed=seed)
    before = snapshot(r)
    eps = split_trajectories(r)
    ref = reference_episodes(r, r["next", "done"].squeeze(-1))
    assert eps.batch_size == torch.Size([len(ref)])
    for key in (("obs",), ("step",), ("next", "reward"), ("next", "done")):
        rows = eps[key].unbind()
        assert len(rows) == len(ref)
        for got, want in zip(rows, ref):
            assert torch.equal(got, want[key])
    # the padded form: the same steps first in each row, zeros after, and the mask
    pad = split_trajectories(r, padded=True)
    longest = max(e.batch_size[0] for e in ref)
    assert pad.batch_size == torch.Size([len(ref), longest])
    for i, want in enumerate(ref):
        n = want.batch_size[0]
        assert pad["mask"][i].tolist() == [True] * n + [False] * (longest - n)
        assert_close(pad[i, :n].exclude("mask"), want)
        assert pad["obs"][i, n:].eq(0).all()
    # the same as tdfunc.to_padded of the jagged form
    padded = tdfunc.to_padded(eps)
    assert torch.equal(padded["obs"], pad["obs"])
    assert torch.equal(padded["masks", "obs"], pad["mask"])
    assert_close(r, before)


def test_flag_forms_time_dim_and_layouts():
    r = rollout(seed=3)
    done = r["next", "done"]
    base = split_trajectories(r)
    # a flag without the trailing dim, OR-ed flags, and the flags split in two
    flat = r.set(("next", "done"), done.squeeze(-1))
    assert torch.equal(split_trajectories(flat)["obs"].offsets(), base["obs"].offsets())
    term = done & (torch.rand(done.shape) < 0.5)
    two = r.set(("next", "terminated"), term).set(("next", "truncated"), done & ~term)
    got = split_trajectories(two, done_key=[("next", "terminated"), ("next", "truncated")])
    assert torch.equal(got["obs"].offsets(), base["obs"].offsets())
    # time first: [T, N]
    tn = r.permute(1, 0)
    got = split_trajectories(tn, time_dim=0)
    assert torch.equal(got["obs"].offsets(), base["obs"].offsets())
    assert torch.equal(got["obs"].values(), base["obs"].values())
    # one environment, and two env dims (flattened in order)
    one = split_trajectories(r[0])
    assert [len(x) for x in one["obs"].unbind()] == [len(x) for x in base["obs"].unbind()][
        : one.batch_size[0]
    ]
    r4 = tdfunc.stack([r, r])  # [2, 3, T]
    assert split_trajectories(r4).batch_size[0] == 2 * base.batch_size[0]


def test_tensorclass_keeps_its_type():
    @tensorclass
    class Step:
        obs: torch.Tensor
        done: torch.Tensor

    s = Step(
        obs=torch.arange(6.0).reshape(2, 3),
        done=torch.tensor([[True, False, False], [False, False, False]]),
        batch_size=[2, 3],
    )
    eps = split_trajectories(s, done_key="done")
    assert type(eps) is Step
    assert [x.tolist() for x in eps.obs.unbind()] == [[0.0], [1.0, 2.0], [3.0, 4.0, 5.0]]
    back = merge_trajectories(eps, s.batch_size)
    assert type(back) is Step
    assert_close(back, s)


@pytest.mark.parametrize("padded", [False, True])
def test_merge_is_the_inverse(padded):
    r = rollout(seed=4)
    eps = split_trajectories(r, padded=padded)
    before = snapshot(eps)
    assert_close(merge_trajectories(eps, r.batch_size), r)
    flat = merge_trajectories(eps)
    assert flat.batch_size == torch.Size([r.batch_size.numel()])
    assert_close(flat, r.reshape(-1))
    tn = r.permute(1, 0)
    back = merge_trajectories(
        split_trajectories(tn, time_dim=0, padded=padded), tn.batch_size, time_dim=0
    )
    assert_close(back, tn)
    assert_close(eps, before)


@pytest.mark.parametrize("padded", [False, True])
def test_compiled_fullgraph_one_frame_for_every_flag_pattern(padded):
    def split(r):
        return split_trajectories(r, padded=padded)

    def roundtrip(r):
        return merge_trajectories(split_trajectories(r, padded=padded), r.batch_size) * 2

    cnt = CompileCounterWithBackend("eager")
    c_split = torch.compile(split, backend=cnt, fullgraph=True)
    c_round = torch.compile(roundtrip, backend=cnt, fullgraph=True)
    for seed, p in ((0, 0.3), (1, 0.6), (2, 0.0)):
        r = rollout(seed=seed, p=p)
        got, want = c_split(r), split(r)
        assert got.batch_size == want.batch_size
        if padded:
            assert_close(got, want)
        else:
            for k in ("obs", ("next", "reward")):
                assert torch.equal(got[k].offsets(), want[k].offsets())
                assert torch.equal(got[k].values(), want[k].values())
        assert_close(c_round(r), r * 2)
    assert cnt.frame_count == 2  # one per function: no recompile across patterns


@pytest.mark.parametrize(
    ("make", "kwargs", "exc", "msg"),
    [
        (
            lambda r: r.exclude(("next", "done")),
            {},
            KeyError,
            E.FLAG_MISSING.format(
                fn="split_trajectories", key="('next', 'done')", available=["obs", "step", "next"]
            ),
        ),
        (
            lambda r: r,
            {"done_key": "nope"},
            KeyError,
            "no flag at key 'nope'",
        ),
        (
            lambda r: r.set(("next", "done"), r["next", "done"].float()),
            {},
            TypeError,
            E.FLAG_DTYPE.format(
                fn="split_trajectories", key="('next', 'done')", dtype=torch.float32
            ),
        ),
        (
            lambda r: r.set(("next", "done"), torch.zeros(3, 6, 2, dtype=torch.bool)),
            {},
            ValueError,
            E.FLAG_SHAPE.format(
                fn="split_trajectories", key="('next', 'done')", shape=(3, 6, 2), batch=(3, 6)
            ),
        ),
        (lambda r: r, {"done_key": "next"}, TypeError, "the flag at key 'next' is a TensorDict"),
        (lambda r: r, {"time_dim": 2}, ValueError, "time_dim=2 is not a batch dim"),
        (lambda r: r[0, 0], {}, ValueError, E.NO_TIME_DIM),
        (lambda r: r[:, :0], {}, ValueError, "no step"),
        (lambda r: r.set("mask", torch.ones(3, 6)), {"padded": True}, KeyError, "mask key 'mask'"),
        (lambda r: r["obs"], {}, TypeError, "expects a TensorDict or tensorclass, got Tensor"),
    ],
)
def test_split_errors_name_the_key(make, kwargs, exc, msg):
    r = make(rollout())
    with pytest.raises(exc, match=re.escape(msg)):
        split_trajectories(r, **kwargs)


def test_merge_errors():
    r = rollout()
    eps = split_trajectories(r)
    with pytest.raises(ValueError, match=re.escape("key 'obs' holds")):
        merge_trajectories(eps, (2, 6))
    stacked = eps.set("id", torch.arange(eps.batch_size[0]))
    with pytest.raises(TypeError, match=re.escape("key 'id' is not a jagged leaf")):
        merge_trajectories(stacked, r.batch_size)
    pad = split_trajectories(r, padded=True)
    with pytest.raises(TypeError, match=re.escape("mask at key 'mask' must be a torch.bool")):
        merge_trajectories(pad.set("mask", pad["mask"].float()), r.batch_size)
    with pytest.raises(ValueError, match=re.escape("the episodes have batch_size")):
        merge_trajectories(pad.exclude("mask"), r.batch_size)
    with pytest.raises(RuntimeError, match="does not hold as many steps"):
        merge_trajectories(pad, (2, 6))
    with pytest.raises(TypeError, match="got Tensor"):
        merge_trajectories(torch.zeros(3))


def test_errors_keep_their_type_when_compiled():
    r = rollout().exclude(("next", "done"))
    with pytest.raises(KeyError, match="no flag at key"):
        torch.compile(split_trajectories, backend="eager")(r)


def test_non_tensor_values():
    done = torch.tensor([[False, True, False]])
    r = TensorDict(x=torch.zeros(1, 3), next={"done": done}, text="hi", batch_size=[1, 3])
    for padded in (False, True):
        eps = split_trajectories(r, padded=padded)
        assert eps["text"] == "hi"  # a shared value stays
        assert merge_trajectories(eps, r.batch_size)["text"] == "hi"
    per_step = r.set("tag", [["a", "b", "c"]])
    with pytest.raises(TypeError, match="key 'tag'"):
        split_trajectories(per_step)
