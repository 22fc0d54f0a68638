"""Probabilistic key-routed modules (tdfunc.nn.ProbabilisticTensorDictModule / Sequential),
against tensordict.nn as an oracle, and TensorDictSequential's indexing, slicing and len."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributions as D
from helpers import check_compiled, snapshot
from torch import nn

import tdfunc
from tdfunc import TensorDict
from tdfunc.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
    TensorDictSequential,
)
from tdfunc.nn import _probabilistic as P
from tdfunc.nn import _routing as R
from tdfunc.testing import assert_close

tdnn = pytest.importorskip("tensordict.nn")
tensordict = pytest.importorskip("tensordict")


class Split(nn.Module):
    """``x`` -> ``(loc, scale)``, scale positive."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, s = x.chunk(2, -1)
        return loc, nn.functional.softplus(s) + 1e-3


def _normal_seq(lin, kind, uniform_key=None, lib=None):
    """obs -> (loc, scale) -> action ~ Normal; ``lib``: tensordict.nn (the oracle), same
    modules."""
    kw = {} if uniform_key is None else {"uniform_key": uniform_key}
    if lib is None:
        mod, seq, prob = (
            TensorDictModule,
            ProbabilisticTensorDictSequential,
            ProbabilisticTensorDictModule,
        )
    else:
        mod, seq, prob = (
            lib.TensorDictModule,
            lib.ProbabilisticTensorDictSequential,
            lib.ProbabilisticTensorDictModule,
        )
    return seq(
        mod(lin, in_keys="obs", out_keys="params"),
        mod(Split(), in_keys="params", out_keys=["loc", "scale"]),
        prob(
            ["loc", "scale"],
            ["action"],
            distribution_class=D.Normal,
            default_interaction_type=kind,
            return_log_prob=True,
            **kw,
        ),
    )


def _categorical_seq(lin, kind, uniform_key=None, lib=None):
    kw = {} if uniform_key is None else {"uniform_key": uniform_key}
    if lib is None:
        mod, seq, prob = (
            TensorDictModule,
            ProbabilisticTensorDictSequential,
            ProbabilisticTensorDictModule,
        )
    else:
        mod, seq, prob = (
            lib.TensorDictModule,
            lib.ProbabilisticTensorDictSequential,
            lib.ProbabilisticTensorDictModule,
        )
    return seq(
        mod(lin, in_keys="obs", out_keys=("agent", "logits")),
        prob(
            {"logits": ("agent", "logits")},
            ("agent", "action"),
            distribution_class=D.Categorical,
            default_interaction_type=kind,
            return_log_prob=True,
            **kw,
        ),
    )


def obs(b: int = 5, seed: int = 0, uniform: tuple[int, ...] | None = None) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    d = {"obs": torch.randn(b, 3, generator=g)}
    if uniform is not None:
        d["u"] = torch.rand(b, *uniform, generator=g)
    return TensorDict(d, batch_size=[b])


def to_theirs(td):
    return tdfunc.to_tensordict(td)


# ================================================================== oracle: tensordict.nn
@pytest.mark.parametrize("make", [_normal_seq, _categorical_seq])
@pytest.mark.parametrize("kind", ["mode", "mean", "deterministic", "random"])
def test_same_values_and_log_probs_as_tensordict(make, kind):
    lin = nn.Linear(3, 4 if make is _normal_seq else 5)
    if make is _categorical_seq and kind == "mean":
        pytest.skip("a categorical's mean is nan in torch (both libraries)")
    ours, theirs = make(lin, kind), make(lin, kind, lib=tdnn)
    td = obs()
    before = snapshot(td)
    torch.manual_seed(3)
    got = ours(td)
    torch.manual_seed(3)
    want = theirs(to_theirs(td))
    for key in want.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(got[key], want[key], msg=str(key))
    assert sorted(map(str, got.keys(include_nested=True, leaves_only=True))) == sorted(
        map(str, tdfunc.from_tensordict(want).keys(include_nested=True, leaves_only=True))
    )
    assert_close(td, before)  # pure: nothing written into the input
    # the distribution of a container, to score stored actions (a loss)
    dist, tdist = ours.get_dist(got), theirs.get_dist(to_theirs(got))
    torch.testing.assert_close(dist.entropy(), tdist.entropy())
    torch.testing.assert_close(ours.log_prob(got), theirs.log_prob(to_theirs(got)))
    assert sorted(got.keys()) == sorted(ours.get_dist_params(got).keys())
    for name in ("in_keys", "out_keys", "dist_params_keys", "dist_sample_keys", "log_prob_keys"):
        assert getattr(ours, name) == list(getattr(theirs, name)), name
    assert ours.log_prob_key == theirs.log_prob_key
    assert ours.default_interaction_type.value == theirs.default_interaction_type.value


@pytest.mark.parametrize(
    ("in_keys", "out_keys", "kw"),
    [
        (["loc", "scale"], "x", {}),
        ([("p", "loc"), ("p", "scale")], ("n", "x"), {"return_log_prob": True}),
        ({"loc": "mu", "scale": "sigma"}, ["x"], {"log_prob_key": "lp", "return_log_prob": True}),
        (["loc", "scale"], ["x"], {"log_prob_keys": [("o", "lp")], "return_log_prob": True}),
    ],
)
def test_keys_as_tensordict_names_them(in_keys, out_keys, kw):
    ours = ProbabilisticTensorDictModule(in_keys, out_keys, distribution_class=D.Normal, **kw)
    theirs = tdnn.ProbabilisticTensorDictModule(
        in_keys, out_keys, distribution_class=D.Normal, **kw
    )
    for name in ("in_keys", "out_keys", "dist_params_keys", "dist_sample_keys", "log_prob_keys"):
        assert getattr(ours, name) == list(getattr(theirs, name)), name
    assert ours.log_prob_key == theirs.log_prob_key
    params = TensorDict(
        {
            "loc": torch.zeros(2),
            "scale": torch.ones(2),
            "mu": torch.ones(2),
            "sigma": torch.full((2,), 2.0),
            "p": {"loc": torch.ones(2), "scale": torch.ones(2)},
        },
        batch_size=[2],
    )
    got, want = ours(params), theirs(to_theirs(params))
    for key in want.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(got[key], want[key])


def test_interaction_types_and_with_interaction_type():
    assert InteractionType("RANDOM") is InteractionType.RANDOM
    assert InteractionType(tdnn.InteractionType.MODE) is InteractionType.MODE
    m = ProbabilisticTensorDictModule(
        "logits",
        "a",
        distribution_class=D.Categorical,
        default_interaction_type=tdnn.InteractionType.MODE,
    )
    assert m.default_interaction_type is InteractionType.MODE
    td = TensorDict(logits=torch.tensor([[0.0, 5.0, 1.0]]), batch_size=[1])
    assert m(td)["a"].tolist() == [1]
    r = m.with_interaction_type("random")
    assert r.default_interaction_type is InteractionType.RANDOM
    assert m.default_interaction_type is InteractionType.MODE  # unchanged
    seq = ProbabilisticTensorDictSequential(
        TensorDictModule(lambda x: x, in_keys="x", out_keys="logits"), m
    )
    assert (
        seq.with_interaction_type("random")[-1].default_interaction_type is InteractionType.RANDOM
    )
    assert seq[-1] is m


# ================================================================== reproducible sampling
def test_uniform_key_and_generator_give_reproducible_samples():
    lin = nn.Linear(3, 4)
    seq = _normal_seq(lin, "random", uniform_key="u")
    td = obs(uniform=(2,))
    a, b = seq(td), seq(td)
    assert torch.equal(a["action"], b["action"])
    # inverse-transform sampling: loc + scale * Phi^-1(u), with rsample's gradients
    params = seq.get_dist_params(td)
    z = D.Normal(0.0, 1.0).icdf(td["u"])
    torch.testing.assert_close(a["action"], params["loc"] + params["scale"] * z)
    grad = torch.autograd.grad(a["action"].sum(), lin.weight)[0]
    assert grad.abs().sum() > 0
    # a seeded generator: the same seed gives the same samples; it advances between calls
    make = lambda: ProbabilisticTensorDictModule(  # noqa: E731
        ["loc", "scale"],
        "x",
        distribution_class=D.Normal,
        default_interaction_type="random",
        generator=7,
    )
    m1, m2 = make(), make()
    p = TensorDict(loc=torch.zeros(4), scale=torch.ones(4), batch_size=[4])
    first = m1(p)["x"]
    assert torch.equal(first, m2(p)["x"])
    assert not torch.equal(first, m1(p)["x"])


def test_categorical_from_uniform_follows_its_probabilities():
    probs = torch.tensor([0.1, 0.6, 0.3])
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    for dist in (D.Categorical(probs=probs.expand(20000, 3)),):
        x = P.from_uniform(dist, u)
        freq = torch.bincount(x, minlength=3).float() / 20000
        torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)
    one_hot = P.from_uniform(D.OneHotCategorical(probs=probs.expand(20000, 3)), u)
    assert torch.equal(one_hot.argmax(-1), x)
    bern = P.from_uniform(D.Bernoulli(probs=torch.full((20000,), 0.25)), u)
    assert abs(float(bern.mean()) - 0.25) < 0.02
    indep = D.Independent(D.Normal(torch.zeros(4, 2), torch.ones(4, 2)), 1)
    assert P.uniform_shape(indep) == torch.Size([4, 2])


# ================================================================== compile, vmap, functional_call
@pytest.mark.parametrize("make", [_normal_seq, _categorical_seq])
def test_compiled_fullgraph_sampling(make):
    lin = nn.Linear(3, 4 if make is _normal_seq else 5)
    uniform = (2,) if make is _normal_seq else ()
    seq = make(lin, "random", uniform_key="u")
    seeds = iter(range(100))
    check_compiled(seq, lambda: (obs(seed=next(seeds), uniform=uniform),))
    # torch's own sampling (the global generator) traces too: same seed, same values
    plain = make(lin, "random")
    compiled = torch.compile(plain, backend="eager", fullgraph=True)
    td = obs()
    torch.manual_seed(0)
    want = plain(td)
    torch.manual_seed(0)
    assert_close(compiled(td), want)


def test_functional_call_vmap_ensemble_compiled():
    seqs = [_normal_seq(nn.Linear(3, 4), "random", uniform_key="u") for _ in range(3)]
    params = tdfunc.stack_modules(seqs)
    base = seqs[0]

    def ensemble(p, td):
        return torch.vmap(lambda q: tdfunc.functional_call(base, q, (td,)))(p)

    td = obs(uniform=(2,))
    out = ensemble(params, td)
    assert out.batch_size == torch.Size([3, 5])
    for i, s in enumerate(seqs):
        assert_close(out[i], s(td), rtol=1e-5, atol=1e-6)
    check_compiled(ensemble, lambda: (params, obs(seed=1, uniform=(2,))))
    # vmap over the batch, a loss on stored actions through get_dist
    seq = seqs[1]
    batched = torch.vmap(seq)(td)
    assert_close(batched, seq(td), rtol=1e-5, atol=1e-6)
    # a loss on stored actions: log-probs and entropy through functional_call's parameters
    stored = seq(td)
    state = tdfunc.from_module(seq)

    def loss(p, data):
        dist = tdfunc.functional_call(seq, p, (data,), kwargs=None)
        return dist["action_log_prob"].mean()

    grads = torch.func.grad(loss)(state, stored.exclude("action_log_prob"))
    assert grads["module", "0", "module", "weight"].abs().sum() > 0
    assert seq.get_dist(stored).entropy().shape == torch.Size([5, 2])


# ================================================================== TensorDictSequential: [i], [a:b], len
def test_sequence_index_slice_and_len_as_tensordict():
    fns = [lambda x: x + 1, lambda x: x * 2, lambda x: x - 3]
    keys = [("a", "b"), ("b", "c"), ("c", "d")]
    ours = TensorDictSequential(*[TensorDictModule(f, i, o) for f, (i, o) in zip(fns, keys)])
    theirs = tdnn.TensorDictSequential(
        *[tdnn.TensorDictModule(f, i, o) for f, (i, o) in zip(fns, keys)]
    )
    assert len(ours) == len(theirs) == 3
    td = TensorDict(a=torch.ones(2), b=torch.zeros(2), c=torch.ones(2), batch_size=[2])
    for index in (0, 1, -1):
        assert ours[index] is ours.module[index]
        assert ours[index].out_keys == list(theirs[index].out_keys)
    for index in (slice(1, None), slice(None, 2), slice(None, None, 2), slice(0, 3)):
        sub, tsub = ours[index], theirs[index]
        assert type(sub) is TensorDictSequential
        assert len(sub) == len(tsub)
        assert sub.in_keys == list(tsub.in_keys)
        assert sub.out_keys == list(tsub.out_keys)
        got, want = sub(td), tsub(to_theirs(td))
        for k in want.keys():  # noqa: SIM118 (a tensordict's keys)
            torch.testing.assert_close(got[k], want[k])
        assert sub[0] is ours[index][0]  # the modules are shared
    sel = ours.with_out_keys("d")
    assert sel[1:].selected_out_keys is None  # as tensordict: a slice drops the selection
    with pytest.raises(IndexError):
        ours[3]
    with pytest.raises(TypeError, match=re.escape(R.BAD_INDEX.format(typ="str"))):
        ours["0"]
    with pytest.raises(tdfunc.InPlaceError, match="pure spelling"):
        ours[0] = ours[1]
    with pytest.raises(tdfunc.InPlaceError, match="pure spelling"):
        del ours[0]


def test_probabilistic_sequence_slices_as_tensordict():
    lin = nn.Linear(3, 4)
    ours, theirs = _normal_seq(lin, "mode"), _normal_seq(lin, "mode", lib=tdnn)
    assert len(ours) == len(theirs) == 3
    for index in (slice(0, 2), slice(1, 3), slice(2, 3)):
        assert type(ours[index]).__name__ == type(theirs[index]).__name__
    assert ours[2] is ours.module[2]


# ================================================================== errors
def test_construction_errors():
    ok = {"distribution_class": D.Normal}
    with pytest.raises(ValueError, match=re.escape(P.ONE_OUT_KEY.format(out_keys=["a", "b"]))):
        ProbabilisticTensorDictModule(["loc", "scale"], ["a", "b"], **ok)
    with pytest.raises(ValueError, match=re.escape(P.NO_OUT_KEY)):
        ProbabilisticTensorDictModule(["loc", "scale"], **ok)
    with pytest.raises(ValueError, match="default_interaction_type must be one of"):
        ProbabilisticTensorDictModule("loc", "a", default_interaction_type="sometimes", **ok)
    with pytest.raises(ValueError, match="key 'a' is written twice"):
        ProbabilisticTensorDictModule("loc", "a", return_log_prob=True, log_prob_key="a", **ok)
    with pytest.raises(TypeError, match="distribution_class must be"):
        ProbabilisticTensorDictModule("loc", "a")
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        ProbabilisticTensorDictModule("loc", "a", generator="seed", **ok)
    with pytest.raises(ValueError, match=re.escape(P.BOTH_SOURCES)):
        ProbabilisticTensorDictModule("loc", "a", generator=0, uniform_key="u", **ok)
    with pytest.raises(ValueError, match="log_prob_keys names one key"):
        ProbabilisticTensorDictModule("loc", "a", log_prob_keys=["x", "y"], **ok)
    prob = ProbabilisticTensorDictModule("logits", "a", distribution_class=D.Categorical)
    det = TensorDictModule(lambda x: x, "x", "logits")
    with pytest.raises(TypeError, match="the last module must be a ProbabilisticTensorDictModule"):
        ProbabilisticTensorDictSequential(prob, det)
    with pytest.raises(ValueError, match="return_composite=True"):
        ProbabilisticTensorDictSequential(det, prob, return_composite=True)
    two = ProbabilisticTensorDictModule("logits", "b", distribution_class=D.Categorical)
    with pytest.raises(ValueError, match="2 probabilistic modules"):
        ProbabilisticTensorDictSequential(prob, two)
    assert len(ProbabilisticTensorDictSequential(prob, two, return_composite=False)) == 2


def test_call_errors_name_the_key():
    m = ProbabilisticTensorDictModule(
        ["loc", "scale"],
        "x",
        distribution_class=D.Normal,
        default_interaction_type="random",
        uniform_key="u",
    )
    td = TensorDict(loc=torch.zeros(3), scale=torch.ones(3), u=torch.rand(3), batch_size=[3])
    with pytest.raises(KeyError, match=re.escape("needs key 'scale', which is missing")):
        m(td.exclude("scale"))
    with pytest.raises(KeyError, match=re.escape("needs key 'u', which is missing")):
        m(td.exclude("u"))
    with pytest.raises(
        ValueError, match=re.escape("the uniform noise at key 'u' has shape (3, 2)")
    ):
        m(td.set("u", torch.rand(3, 2)))
    with pytest.raises(TypeError, match="the uniform noise at key 'u' must be a floating-point"):
        m(td.set("u", torch.zeros(3, dtype=torch.long)))
    gamma = ProbabilisticTensorDictModule(
        ["concentration", "rate"],
        "x",
        distribution_class=D.Gamma,
        default_interaction_type="random",
        uniform_key="u",
    )
    g_td = TensorDict(
        concentration=torch.ones(3), rate=torch.ones(3), u=torch.rand(3), batch_size=[3]
    )
    with pytest.raises(TypeError, match="Gamma has no icdf"):
        gamma(g_td)
    with pytest.raises(TypeError, match="expects a TensorDict or tensorclass"):
        m.get_dist(torch.zeros(3))
    not_dist = ProbabilisticTensorDictModule("loc", "x", distribution_class=lambda loc: loc)
    with pytest.raises(TypeError, match="not a torch distribution"):
        not_dist(td)
    median = ProbabilisticTensorDictModule(
        ["loc", "scale"], "x", distribution_class=D.Normal, default_interaction_type="median"
    )
    with pytest.raises(NotImplementedError, match="Normal has no median"):
        median(td)
    # typed errors keep their type inside torch.compile
    with pytest.raises(KeyError, match="needs key 'scale'"):
        torch.compile(m, backend="eager")(td.exclude("scale"))


def test_keyword_call_returns_the_outputs():
    m = ProbabilisticTensorDictModule(
        ["loc", "scale"], "x", distribution_class=D.Normal, return_log_prob=True
    )
    x, lp = m(loc=torch.ones(2), scale=torch.ones(2))
    assert x.tolist() == [1.0, 1.0]
    torch.testing.assert_close(lp, D.Normal(1.0, 1.0).log_prob(torch.ones(2)))
