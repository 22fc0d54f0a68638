"""``tdfunc.rl`` side by side with torchrl in one process: replay buffers, GAE, the PPO update.

torchrl needs tensordict 0.14 (the main venv has 0.15), so these rows run in the venv of
``make test-rl-oracle``: ``make bench-rl`` (``.venv-torchrl``, with pytest-benchmark added).
Where torchrl does not import, the module is skipped. Rows (category ``rl``, one thread, CPU
time; each a ratio tdfunc / torchrl as the median of paired rounds with the A/A control, see
``compile_benchmarks/paired.py``; tdfunc's side is A):

* ``replay_add_1024_{memory,disk}``: 1024 transitions added to a full buffer of ``ROWS`` rows
  (the schema of ``test_bench_replay.py``: ``obs`` and ``("next", "obs")`` ``[124]`` float32,
  ``action`` ``[6]``, ``reward``, ``done``; 1021 bytes a row). In memory: ``rl.ReplayBuffer``
  (``rl.add(..., donate=True)``: the rows written into its own tensors) against
  ``ReplayBuffer(storage=LazyTensorStorage(ROWS)).extend``; on disk: ``rl.ReplayBuffer.create``
  (``rl.store_add``'s commit: a lock, the rows with one copy a leaf, the counter that commits
  them; the store checked once, each structure of batch once) against
  ``LazyMemmapStorage(ROWS, scratch_dir=...)``. Both write in place.
* ``replay_sample_256_{memory,disk}``: 256 rows drawn uniformly (torch's global generator on
  both sides) and gathered into memory: ``buffer.sample(256)`` (on disk through
  ``rl.store_sample``, which reads the counters around the gather) against torchrl's
  ``RandomSampler``.
* ``replay_*_memory_prioritized``: the same in memory with prioritised sampling against
  torchrl's ``PrioritizedSampler``; skipped where torchrl's C++ sum tree does not load (with
  torch 2.13.0 and torchrl 0.14.1 it fails with an undefined symbol).
* ``gae_64x1024``: GAE (gamma 0.99, lambda 0.95) over a ``[64, 1024]`` rollout (1% done
  flags, half of them terminal): ``rl.gae`` on a TensorDict (leaves ``[64, 1024, 1]``) against
  torchrl's functional ``generalized_advantage_estimate`` (a loop over the 1024 steps) and
  ``vec_generalized_advantage_estimate`` (what torchrl's ``GAE`` module calls by default), on
  the same tensors. Compiled (``fullgraph=True``, inductor): tdfunc against torchrl's eager
  loop, and against the loop compiled (full mode only: Dynamo unrolls 1024 steps, a cold
  compile of about 4 minutes on 2 cores).
* ``ppo_update``: one PPO update on a minibatch of 256 (a Categorical policy and a critic,
  MLPs 16 -> 64 -> 64 -> out, tanh): clipped surrogate, l2 value loss (coefficient 0.5),
  entropy bonus (0.01), backward and AdamW (lr 3e-4, weight decay 0.01). tdfunc: the loss as
  a function (``ProbabilisticTensorDictModule.get_dist`` for the log-probabilities and the
  entropy), ``tdfunc.value_and_grad``, ``tdfunc.optim.step`` (torch's fused AdamW kernel on
  copies: the update is pure); torchrl: ``ClipPPOLoss(loss_critic_type="l2")``, ``backward()``
  and ``torch.optim.AdamW(fused=True)`` (torch's fastest CPU step), in place. The first
  update is checked to give the same loss and the same new parameters on both sides.
  Compiled: ``tdfunc.compile(update, fullgraph=True)`` against torchrl eager, and against
  ``torch.compile`` of torchrl's whole step (graph breaks allowed: it does not trace
  ``backward()`` into one graph).

Sizes: ``ROWS`` is 2**20 (1 GiB a buffer; 3 in memory and 3 on disk: tdfunc, its A/A copy,
torchrl) in full mode and 2**14 in quick mode; ``TDFUNC_BENCH_RL_ROWS`` sets it, and
``TDFUNC_BENCH_RL_ROUNDS`` the paired rounds (15 in full mode). Quick mode uses the
Dynamo-only backend for tdfunc's compiled rows and 3 short rounds, and skips the compiled
torchrl rows: its ratios are not measurements.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tdfunc
from compile_benchmarks.paired import report
from compile_benchmarks.test_bench_replay import LEAVES
from tdfunc import rl
from tdfunc.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
)

torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed (make bench-rl)")
tensordict = pytest.importorskip("tensordict")
torchrl_data = pytest.importorskip("torchrl.data")
from tensordict.nn import TensorDictModule as TrlModule  # noqa: E402
from torchrl.modules import ProbabilisticActor, ValueOperator  # noqa: E402
from torchrl.objectives import ClipPPOLoss  # noqa: E402
from torchrl.objectives.value.functional import (  # noqa: E402
    generalized_advantage_estimate,
    vec_generalized_advantage_estimate,
)

CATEGORY = "rl"
ADD, SAMPLE = 1024, 256
GAMMA, LMBDA = 0.99, 0.95


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value else default


def _rounds(bench_quick: bool) -> int:
    return 3 if bench_quick else _env_int("TDFUNC_BENCH_RL_ROUNDS", 15)


def _sum_tree_loads() -> bool:
    """torchrl's sum tree is a C++ extension built for one torch release: with another one it
    does not load (an undefined symbol), and ``PrioritizedSampler`` raises ``RuntimeError``."""
    try:
        torchrl_data.PrioritizedSampler(2, 1.0, 1.0)
    except RuntimeError:
        return False
    return True


# --------------------------------------------------------------------------------- replay
def _chunk(rows: int, seed: int) -> dict[str, Any]:
    """``rows`` seeded transitions of the schema of ``test_bench_replay.py``, as nested dicts."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for path, (shape, dtype) in LEAVES.items():
        if dtype == torch.bool:
            value = torch.rand((rows, *shape), generator=g) < 0.05
        else:
            value = torch.randn((rows, *shape), generator=g, dtype=dtype)
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def _ours(d: dict[str, Any], rows: int) -> tdfunc.TensorDict:
    return tdfunc.TensorDict(d, batch_size=[rows])


def _theirs(d: dict[str, Any], rows: int) -> Any:
    return tensordict.TensorDict(d, batch_size=[rows])


class Buffers:
    """The buffers of one storage kind and sampler: tdfunc's, its A/A copy, torchrl's; all
    filled with the same rows."""

    def __init__(self, where: str, prioritized: bool, rows: int, root: str) -> None:
        row = _ours(_chunk(1, 0), 1)[0]
        self.rows = rows

        def ours(name: str) -> rl.ReplayBuffer:
            if where == "memory":
                return rl.ReplayBuffer(row, rows, prioritized=prioritized)
            path = os.path.join(root, f"{name}-{where}-{prioritized}")
            return rl.ReplayBuffer.create(path, row, rows, prioritized=prioritized)

        self.a, self.a2 = ours("a"), ours("a2")
        storage = (
            torchrl_data.LazyTensorStorage(rows)
            if where == "memory"
            else torchrl_data.LazyMemmapStorage(
                rows, scratch_dir=os.path.join(root, f"torchrl-{prioritized}")
            )
        )
        sampler = (
            torchrl_data.PrioritizedSampler(rows, 0.6, 0.4)
            if prioritized
            else torchrl_data.RandomSampler()
        )
        self.b = torchrl_data.ReplayBuffer(storage=storage, sampler=sampler)
        step = min(rows, 1 << 16)
        for first in range(0, rows, step):  # full buffers: sampling draws from every row
            n = min(step, rows - first)
            d = _chunk(n, 1 + first // step)
            self.a.add(_ours(d, n))
            self.a2.add(_ours(d, n))
            self.b.extend(_theirs(d, n))
        self.batch = _chunk(ADD, 12345)
        # the same rows on both sides (a random subset of them), and one more add writes the
        # same rows at the same place (both rings are full, their cursors at row 0)
        idx = torch.randint(0, rows, (1000,), generator=torch.Generator().manual_seed(3))
        self.same(idx)
        self.a.add(_ours(self.batch, ADD))
        self.b.extend(_theirs(self.batch, ADD))
        self.same(torch.arange(min(ADD, rows)))

    def same(self, idx: torch.Tensor) -> None:
        ours, theirs = self.a.state.storage[idx], self.b.storage.get(idx)
        for path in LEAVES:
            torch.testing.assert_close(ours[path], theirs[path], rtol=0, atol=0)


@pytest.fixture(scope="module")
def replay(bench_size: Callable[[Any, Any], Any]) -> Iterator[Callable[[str, bool], Buffers]]:
    """``replay(where, prioritized)``: the filled buffers, made once per module."""
    rows = max(_env_int("TDFUNC_BENCH_RL_ROWS", bench_size(1 << 20, 1 << 14)), ADD)
    root = tempfile.mkdtemp(prefix="tdfunc-bench-rl-")
    made: dict[tuple[str, bool], Buffers] = {}

    def get(where: str, prioritized: bool) -> Buffers:
        if (where, prioritized) not in made:
            made[where, prioritized] = Buffers(where, prioritized, rows, root)
        return made[where, prioritized]

    try:
        yield get
    finally:
        made.clear()
        shutil.rmtree(root, ignore_errors=True)


REPLAY_ROWS = [
    (op, where, prio)
    for prio in (False, True)
    for where in ("memory", "disk")
    for op in ("add", "sample")
    if not (prio and where == "disk")
]


@pytest.mark.parametrize(("op", "where", "prioritized"), REPLAY_ROWS)
def test_rl_replay(
    benchmark: Any,
    bench_quick: bool,
    replay: Callable[[str, bool], Buffers],
    op: str,
    where: str,
    prioritized: bool,
) -> None:
    """Replay ``add`` (1024 rows) or ``sample`` (256 rows), tdfunc / torchrl: see the module
    docstring."""
    torch.set_num_threads(1)
    if prioritized and not _sum_tree_loads():
        pytest.skip(
            "torchrl's C++ sum tree does not load with this torch (PrioritizedSampler raises "
            "RuntimeError): no prioritised comparison"
        )
    bufs = replay(where, prioritized)
    if op == "add":
        ours, theirs = _ours(bufs.batch, ADD), _theirs(bufs.batch, ADD)
        a, a2 = (lambda: bufs.a.add(ours)), (lambda: bufs.a2.add(ours))
        b = lambda: bufs.b.extend(theirs)  # noqa: E731
        rows, calls = ADD, 20 if where == "disk" else 50
    else:
        a, a2 = (lambda: bufs.a.sample(SAMPLE)), (lambda: bufs.a2.sample(SAMPLE))
        b = lambda: bufs.b.sample(SAMPLE)  # noqa: E731
        got, want = a()[0], b()
        for path in LEAVES:
            assert got[path].shape == want[path].shape
            assert got[path].dtype == want[path].dtype
        rows, calls = SAMPLE, 50
    name = f"replay_{op}_{rows}_{where}" + ("_prioritized" if prioritized else "")
    report(
        benchmark,
        category=CATEGORY,
        workload=name,
        mode="eager",
        against="torchrl",
        a=a,
        a2=a2,
        b=b,
        rounds=_rounds(bench_quick),
        calls=2 if bench_quick else calls,
        extra={"rows": rows, "store_rows": bufs.rows},
    )


# ------------------------------------------------------------------------------------ GAE
def _rollout() -> dict[str, torch.Tensor]:
    n, t = 64, 1024
    g = torch.Generator().manual_seed(0)
    done = torch.rand(n, t, 1, generator=g) < 0.01
    return {
        "value": torch.randn(n, t, 1, generator=g),
        "next_value": torch.randn(n, t, 1, generator=g),
        "reward": torch.randn(n, t, 1, generator=g),
        "done": done,
        "terminated": done & (torch.rand(n, t, 1, generator=g) < 0.5),
    }


def _gae_td(d: dict[str, torch.Tensor]) -> tdfunc.TensorDict:
    nxt = {k: d[k] for k in ("reward", "done", "terminated")}
    return tdfunc.TensorDict(
        state_value=d["value"],
        next={**nxt, "state_value": d["next_value"]},
        batch_size=d["value"].shape[:2],
    )


def _ours_gae(td: tdfunc.TensorDict) -> torch.Tensor:
    return rl.gae(td, gamma=GAMMA, lmbda=LMBDA)["advantage"]


def _theirs_gae(d: dict[str, torch.Tensor], vec: bool) -> torch.Tensor:
    fn = vec_generalized_advantage_estimate if vec else generalized_advantage_estimate
    args = (d["value"], d["next_value"], d["reward"], d["done"], d["terminated"])
    return fn(GAMMA, LMBDA, *args)[0]


GAE_ROWS = [
    pytest.param("eager", "torchrl", id="eager-vs-torchrl"),
    pytest.param("eager", "torchrl_vec", id="eager-vs-torchrl_vec"),
    pytest.param("compiled", "torchrl", id="compiled-vs-torchrl_eager"),
    pytest.param(
        "compiled",
        "torchrl_compiled",
        id="compiled-vs-torchrl_compiled",
        marks=pytest.mark.bench_full_only,
    ),
]


@pytest.mark.parametrize(("mode", "against"), GAE_ROWS)
def test_rl_gae(benchmark: Any, bench_quick: bool, mode: str, against: str) -> None:
    """GAE over a [64, 1024] rollout, tdfunc / torchrl's functional estimator."""
    torch.set_num_threads(1)
    d = _rollout()
    td, td2 = _gae_td(d), _gae_td({k: v.clone() for k, v in d.items()})
    backend = "eager" if bench_quick else "inductor"
    a: Callable[[Any], Any] = _ours_gae
    a2: Callable[[Any], Any] = _ours_gae
    if mode == "compiled":
        a = torch.compile(_ours_gae, backend=backend, fullgraph=True)
        a2 = torch.compile(lambda x: _ours_gae(x), backend=backend, fullgraph=True)  # own code
    b: Callable[[], Any] = lambda: _theirs_gae(d, against == "torchrl_vec")  # noqa: E731
    if against == "torchrl_compiled":
        theirs = torch.compile(
            lambda *x: generalized_advantage_estimate(GAMMA, LMBDA, *x)[0], fullgraph=True
        )
        args = (d["value"], d["next_value"], d["reward"], d["done"], d["terminated"])
        b = lambda: theirs(*args)  # noqa: E731
    torch.testing.assert_close(a(td), b(), rtol=1e-4, atol=1e-4)  # the same advantages
    calls = {"torchrl_vec": 1}.get(against, 5 if mode == "compiled" else 3)
    report(
        benchmark,
        category=CATEGORY,
        workload="gae_64x1024",
        mode=mode,
        against=against,
        a=lambda: a(td),
        a2=lambda: a2(td2),
        b=b,
        rounds=_rounds(bench_quick),
        calls=1 if bench_quick else calls,
    )


# ------------------------------------------------------------------------------------ PPO
OBS, HIDDEN, ACTIONS, MINIBATCH = 16, 64, 4, 256
CLIP, ENTROPY_COEF, CRITIC_COEF, LR, WEIGHT_DECAY = 0.2, 0.01, 0.5, 3e-4, 0.01
#: torchrl clips the log of the ratio to these bounds
LOG_CLIP = (math.log1p(-CLIP), math.log1p(CLIP))


def _mlp(out: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(OBS, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, out),
    )


class PPO:
    """Both sides of the PPO update, from the same networks and minibatch."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        actor_net, critic_net = _mlp(ACTIONS), _mlp(1)
        g = torch.Generator().manual_seed(1)
        data = {
            "obs": torch.randn(MINIBATCH, OBS, generator=g),
            "action": torch.randint(0, ACTIONS, (MINIBATCH,), generator=g),
            "action_log_prob": -1.0 - torch.rand(MINIBATCH, generator=g),
            "advantage": torch.randn(MINIBATCH, 1, generator=g),
            "value_target": torch.randn(MINIBATCH, 1, generator=g),
        }
        # tdfunc: the policy of examples/ppo.py, the loss as a function, a pure update
        self.policy = ProbabilisticTensorDictSequential(
            TensorDictModule(copy.deepcopy(actor_net), "obs", "logits"),
            ProbabilisticTensorDictModule(
                "logits",
                "action",
                distribution_class=torch.distributions.Categorical,
                return_log_prob=True,
            ),
        )
        self.logits_net, self.head = self.policy[:-1], self.policy[-1]
        self.critic = copy.deepcopy(critic_net)
        self.opt = tdfunc.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
        self.params = tdfunc.TensorDict(
            actor=tdfunc.from_module(self.policy).detach().clone(),
            critic=tdfunc.from_module(self.critic).detach().clone(),
        )
        self.state = self.opt.init(self.params)
        self.batch = tdfunc.TensorDict(data, batch_size=[MINIBATCH])
        # torchrl: ProbabilisticActor, ValueOperator, ClipPPOLoss, torch.optim.AdamW
        actor = ProbabilisticActor(
            TrlModule(copy.deepcopy(actor_net), ["obs"], ["logits"]),
            in_keys=["logits"],
            out_keys=["action"],
            distribution_class=torch.distributions.Categorical,
            return_log_prob=True,
        )
        critic = ValueOperator(copy.deepcopy(critic_net), in_keys=["obs"])
        self.loss_module = ClipPPOLoss(
            actor,
            critic,
            clip_epsilon=CLIP,
            entropy_coeff=ENTROPY_COEF,
            critic_coeff=CRITIC_COEF,
            loss_critic_type="l2",
            normalize_advantage=False,
        )
        self.torch_opt = torch.optim.AdamW(
            self.loss_module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        )
        self.td = tensordict.TensorDict(data, batch_size=[MINIBATCH])
        self.compiled: dict[str, Callable[..., Any]] = {}

    def loss(self, params: Any, batch: Any) -> tuple[torch.Tensor, Any]:
        dist = self.head.get_dist(
            tdfunc.functional_call(self.logits_net, params["actor"], (batch,))
        )
        log_weight = dist.log_prob(batch["action"]) - batch["action_log_prob"]
        adv = batch["advantage"].squeeze(-1)
        clipped = log_weight.clamp(*LOG_CLIP)
        gain = torch.minimum(log_weight.exp() * adv, clipped.exp() * adv)
        value = tdfunc.functional_call(self.critic, params["critic"], (batch["obs"],))
        losses = tdfunc.TensorDict(
            loss_objective=-gain.mean(),
            loss_critic=CRITIC_COEF * (value - batch["value_target"]).pow(2).mean(),
            loss_entropy=-ENTROPY_COEF * dist.entropy().mean(),
        )
        return losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"], losses

    def update(self, params: Any, state: Any, batch: Any) -> tuple[Any, Any, torch.Tensor]:
        (total, _), grads = tdfunc.value_and_grad(self.loss, has_aux=True)(params, batch)
        params, state = tdfunc.optim.step(self.opt, grads, state, params)
        return params, state, total

    def torchrl_step(self) -> torch.Tensor:
        out = self.loss_module(self.td)
        total = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
        total.backward()
        self.torch_opt.step()
        self.torch_opt.zero_grad()
        return total.detach()

    def check(self) -> None:
        """The first update gives the same loss and the same new parameters on both sides."""
        before = self.params.clone()
        params, _, total = self.update(self.params, self.state, self.batch)
        torch.testing.assert_close(total, self.torchrl_step(), rtol=1e-6, atol=1e-6)
        pairs = [
            ("actor", self.loss_module.actor_network_params, 0),
            ("critic", self.loss_module.critic_network_params, 1),
        ]
        for side, theirs, drop in pairs:
            for key, value in theirs.flatten_keys(".").items():
                path = (side, *key.split(".")[drop:])
                assert not torch.equal(params[path], before[path])  # a real step
                torch.testing.assert_close(params[path], value.data, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ppo() -> PPO:
    torch.set_num_threads(1)
    made = PPO()
    made.check()
    return made


PPO_ROWS = [
    pytest.param("eager", "torchrl", id="eager-vs-torchrl"),
    pytest.param("compiled", "torchrl", id="compiled-vs-torchrl_eager"),
    pytest.param("compiled", "torchrl_compiled", id="compiled-vs-torchrl_compiled"),
]


@pytest.mark.parametrize(("mode", "against"), PPO_ROWS)
def test_rl_ppo_update(
    benchmark: Any, bench_quick: bool, ppo: PPO, mode: str, against: str
) -> None:
    """One PPO update (clipped loss, value loss, entropy, backward, AdamW), tdfunc / torchrl."""
    torch.set_num_threads(1)
    if against == "torchrl_compiled" and bench_quick:
        pytest.skip("quick mode: no compiled torchrl row (a cold compile of about 40 s)")
    backend = "eager" if bench_quick else "inductor"
    if mode == "compiled":
        if "a" not in ppo.compiled:
            ppo.compiled["a"] = tdfunc.compile(ppo.update, backend=backend, fullgraph=True)
            ppo.compiled["a2"] = tdfunc.compile(
                lambda *x: ppo.update(*x), backend=backend, fullgraph=True
            )
        a, a2 = ppo.compiled["a"], ppo.compiled["a2"]
        want = ppo.update(ppo.params, ppo.state, ppo.batch)
        tdfunc.testing.assert_close(
            a(ppo.params, ppo.state, ppo.batch)[0], want[0], rtol=1e-5, atol=1e-6
        )
    else:
        a = a2 = ppo.update
    b: Callable[[], Any] = ppo.torchrl_step
    if against == "torchrl_compiled":
        if "b" not in ppo.compiled:
            ppo.compiled["b"] = torch.compile(ppo.torchrl_step)
        b = ppo.compiled["b"]
    p, s, x = ppo.params, ppo.state, ppo.batch
    p2, s2, x2 = p.clone(), s.clone(), x.clone()
    report(
        benchmark,
        category=CATEGORY,
        workload="ppo_update",
        mode=mode,
        against=against,
        a=lambda: a(p, s, x),
        a2=lambda: a2(p2, s2, x2),
        b=b,
        rounds=_rounds(bench_quick),
        calls=2 if bench_quick else (20 if mode == "compiled" else 10),
        extra={"minibatch": MINIBATCH},
    )
