"""PPO, end to end: a batched toy environment, rollouts as containers, episodes, GAE, a
replay buffer on disk, a compiled update with a critic ensemble, and a checkpoint that
resumes exactly.

1. A corridor: ``N_ENVS`` environments in plain torch (a walk to a goal cell; an episode
   ends at the goal or is cut after ``MAX_STEPS``: episodes of every length), reset where
   done, as torchrl's collectors do.
2. A rollout ``[N_ENVS, STEPS]`` collected into a TensorDict with torchrl's keys (``obs``,
   ``action``, ``action_log_prob``, ``("next", "reward" / "done" / "terminated" /
   "truncated")``); the policy is a ``ProbabilisticTensorDictSequential`` that draws its
   actions from uniform noise stored in the rollout (reproducible).
3. Episodes (``rl.split_trajectories``) for the returns; advantages by ``rl.gae`` with the
   mean of an ensemble of 4 critics (``stack_modules`` + ``torch.vmap``).
4. The rollout goes into a replay buffer on disk (``rl.create_store`` / ``rl.store_add``);
   minibatches come from ``rl.store_sample``.
5. One compiled update (``tdfunc.compile``, one graph): the clipped surrogate, the value loss
   of every critic and the entropy bonus (torchrl's ``ClipPPOLoss``, written as a function),
   gradients by ``tdfunc.value_and_grad``, AdamW from ``tdfunc.optim``.
6. The whole training state (a tensorclass) saved with ``tdfunc.save`` and loaded back: the
   resumed run equals the uninterrupted one.

Run: ``python examples/ppo.py``
"""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import rl
from tdfunc.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
)

N_ENVS, STEPS = 32, 32  # a rollout is [N_ENVS, STEPS]: 1024 transitions
SIZE, MAX_STEPS = 10, 16  # corridor cells; an episode is cut (truncated) after MAX_STEPS
GAMMA, LMBDA = 0.99, 0.95
CLIP, ENTROPY_COEF, CRITIC_COEF = 0.2, 0.01, 0.5
MINIBATCH, UPDATES = 256, 16  # 16 minibatches of 256 rows per rollout: 4 epochs' worth
CRITICS = 4
SEED = 0
# tensors of a few thousand numbers: a second thread would only add synchronisation
torch.set_num_threads(1)


# --8<-- [start:env]
def observe(env: tdfunc.TensorDict) -> torch.Tensor:
    """What the agent sees: the signed distance to the goal and the time left."""
    return torch.stack([(env["goal"] - env["pos"]) / SIZE, env["t"] / MAX_STEPS], -1)


def env_reset(n: int, g: torch.Generator) -> tdfunc.TensorDict:
    pos = torch.randint(0, SIZE, (n,), generator=g)
    goal = (pos + torch.randint(1, SIZE, (n,), generator=g)) % SIZE  # never the start cell
    return tdfunc.TensorDict(pos=pos, goal=goal, t=torch.zeros(n, dtype=torch.long), batch_size=[n])


def env_step(
    env: tdfunc.TensorDict, action: torch.Tensor, g: torch.Generator
) -> tuple[tdfunc.TensorDict, tdfunc.TensorDict]:
    """One step of every environment: (the ``next`` entries, the environments after it,
    reset where the episode ended)."""
    pos = (env["pos"] + 2 * action - 1).clamp(0, SIZE - 1)  # action 0: left, 1: right
    moved = env.replace(pos=pos, t=env["t"] + 1)
    terminated = pos == env["goal"]
    truncated = (moved["t"] >= MAX_STEPS) & ~terminated
    done = terminated | truncated
    reward = torch.where(terminated, 1.0, -0.05)
    nxt = tdfunc.TensorDict(
        obs=observe(moved),
        reward=reward,
        done=done,
        terminated=terminated,
        truncated=truncated,
        batch_size=env.batch_size,
    )
    return nxt, torch.where(done, env_reset(len(done), g), moved)  # a batch mask over envs


# --8<-- [end:env]


# --8<-- [start:modules]
torch.manual_seed(SEED)
policy = ProbabilisticTensorDictSequential(  # torchrl: ProbabilisticActor
    TensorDictModule(
        nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2)),
        in_keys="obs",
        out_keys="logits",
    ),
    ProbabilisticTensorDictModule(
        "logits",
        "action",
        distribution_class=torch.distributions.Categorical,
        default_interaction_type="random",
        uniform_key="noise",  # actions from stored uniform noise: reproducible, compiles
        return_log_prob=True,
    ),
)
# the modules before the distribution (the policy's parameter names), and the distribution
logits_net, head = policy[:-1], policy[-1]

critics = [nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1)) for _ in range(CRITICS)]
critic = copy.deepcopy(critics[0]).to("meta")  # structure only: the calls use stacked params


def values(critic_params: tdfunc.TensorDict, obs: torch.Tensor) -> torch.Tensor:
    """Every critic's value of ``obs`` in one batched call: ``[CRITICS, *obs.shape[:-1]]``."""
    call = lambda p: tdfunc.functional_call(critic, p, (obs,)).squeeze(-1)  # noqa: E731
    return torch.vmap(call)(critic_params)


def initial_params() -> tdfunc.TensorDict:
    return tdfunc.TensorDict(
        actor=tdfunc.from_module(policy).detach().clone(),
        critic=tdfunc.stack_modules(critics).detach(),  # batch [CRITICS]
    )


# --8<-- [end:modules]


# --8<-- [start:collect]
def collect(
    params: tdfunc.TensorDict, env: tdfunc.TensorDict, g: torch.Generator
) -> tuple[tdfunc.TensorDict, tdfunc.TensorDict]:
    """A rollout ``[N_ENVS, STEPS]`` with the actor's ``params``, and the environments after it."""
    steps = []
    for _ in range(STEPS):
        noise = torch.rand(N_ENVS, generator=g)
        td = tdfunc.TensorDict(obs=observe(env), noise=noise, batch_size=[N_ENVS])
        td = tdfunc.functional_call(policy, params["actor"], (td,))
        nxt, env = env_step(env, td["action"], g)
        steps.append(td.set("next", nxt))
    return tdfunc.stack(steps, dim=1), env


def advantages(params: tdfunc.TensorDict, rollout: tdfunc.TensorDict) -> tdfunc.TensorDict:
    """``rollout`` plus ``advantage`` and ``value_target`` (torchrl's GAE module's keys)."""
    with torch.no_grad():
        rollout = rollout.set("state_value", values(params["critic"], rollout["obs"]).mean(0))
        next_value = values(params["critic"], rollout["next", "obs"]).mean(0)
        rollout = rollout.set(("next", "state_value"), next_value)
    # a terminated step does not bootstrap; a truncated one does (its next value is real)
    return rl.gae(rollout, gamma=GAMMA, lmbda=LMBDA)


def episode_returns(rollout: tdfunc.TensorDict) -> torch.Tensor:
    """The return of every episode that ended in the rollout (not those it cut)."""
    episodes = rl.split_trajectories(rollout, padded=True)  # [episodes, longest], a mask
    ended = episodes["next", "done"].any(-1)
    return episodes["next", "reward"].sum(-1)[ended]  # padded steps hold zeros


# --8<-- [end:collect]


# --8<-- [start:loss]
def ppo_loss(
    params: tdfunc.TensorDict, batch: tdfunc.TensorDict
) -> tuple[torch.Tensor, tdfunc.TensorDict]:
    """torchrl's ``ClipPPOLoss`` as a function: the total, and each term as torchrl names it."""
    dist = head.get_dist(tdfunc.functional_call(logits_net, params["actor"], (batch,)))
    ratio = (dist.log_prob(batch["action"]) - batch["action_log_prob"]).exp()
    adv = batch["advantage"]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    value = values(params["critic"], batch["obs"])  # [CRITICS, MINIBATCH]: each critic learns
    losses = tdfunc.TensorDict(
        loss_objective=-surrogate.mean(),
        loss_critic=CRITIC_COEF * (value - batch["value_target"]).pow(2).mean(),
        loss_entropy=-ENTROPY_COEF * dist.entropy().mean(),
    )
    return losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"], losses


opt = tdfunc.optim.chain(tdfunc.optim.clip_by_global_norm(1.0), tdfunc.optim.adamw(lr=3e-3))


def update(
    params: tdfunc.TensorDict, opt_state: tdfunc.TensorDict, batch: tdfunc.TensorDict
) -> tuple[tdfunc.TensorDict, tdfunc.TensorDict, tdfunc.TensorDict]:
    (_, losses), grads = tdfunc.value_and_grad(ppo_loss, has_aux=True)(params, batch)
    params, opt_state = tdfunc.optim.step(opt, grads, opt_state, params)
    return params, opt_state, losses


# forward, backward and AdamW in one graph (aot_eager: AOTAutograd without code generation,
# a quick compile for a demo; leave the backend out for inductor)
counter = CompileCounterWithBackend("aot_eager")
compiled_update = tdfunc.compile(update, backend=counter, fullgraph=True)
# --8<-- [end:loss]


# --8<-- [start:train]
@tdfunc.tensorclass
class TrainState:
    params: tdfunc.TensorDict
    opt_state: tdfunc.TensorDict
    env: tdfunc.TensorDict  # the environments mid-episode: a resumed run goes on from there
    iteration: torch.Tensor


def train(state: TrainState, iterations: int, store: rl.ReplayState) -> tuple[TrainState, list]:
    """``iterations`` rounds of collect, GAE, store, update; the mean return of each round."""
    history = []
    for _ in range(iterations):
        # one random stream per iteration, from the seed and the iteration number (no
        # generator state to save: a resumed run draws the same numbers)
        g = torch.Generator().manual_seed(SEED * 1_000_003 + int(state.iteration))
        rollout, env = collect(state.params, state.env, g)
        rollout = advantages(state.params, rollout)
        history.append(episode_returns(rollout).mean().item())
        rows = rollout.select(*store.storage.keys()).reshape(-1)  # [N_ENVS * STEPS]
        rl.store_add(store, rows)  # written into the file; replaces the last rollout
        params, opt_state = state.params, state.opt_state
        for _ in range(UPDATES):
            batch, _ = rl.store_sample(store, rl.sample, MINIBATCH, generator=g)
            params, opt_state, _ = compiled_update(params, opt_state, batch)
        state = TrainState(params, opt_state, env, state.iteration + 1)
    return state, history


# --8<-- [end:train]


def main() -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tdfunc-ppo-") as tmp:
        # --8<-- [start:run]
        params = initial_params()
        env = env_reset(N_ENVS, torch.Generator().manual_seed(SEED))
        state = TrainState(params, opt.init(params), env, torch.tensor(0))
        # torchrl: ReplayBuffer(storage=LazyMemmapStorage(N_ENVS * STEPS)), one rollout's
        # rows; a row of what the update reads gives the keys, shapes and dtypes
        row = tdfunc.TensorDict(
            obs=torch.zeros(2),
            action=torch.zeros((), dtype=torch.long),
            action_log_prob=torch.zeros(()),
            advantage=torch.zeros(()),
            value_target=torch.zeros(()),
        )
        store = rl.create_store(os.path.join(tmp, "buffer"), row, capacity=N_ENVS * STEPS)

        state, first = train(state, 25, store)
        path = os.path.join(tmp, "checkpoint")
        tdfunc.save(state, path)  # params, AdamW moments, the environments, the iteration
        state, last = train(state, 10, store)  # the uninterrupted run goes on

        # later, in another process say: load (memory-mapped; .clone() reads it into memory,
        # so the compiled update sees plain tensors and does not compile again) and resume
        resumed, again = train(tdfunc.load(path).clone(), 10, store)
        tdfunc.testing.assert_close(resumed, state, rtol=0, atol=0)  # bit for bit
        assert again == last  # the same returns, iteration by iteration
        # --8<-- [end:run]
    returns = first + last
    print(f"mean episode return, first 3 iterations: {sum(returns[:3]) / 3:+.3f}")
    print(f"mean episode return, last 3 iterations:  {sum(returns[-3:]) / 3:+.3f}")
    print(f"resumed from iteration 25 to {int(resumed.iteration)}: equal to the uninterrupted run")
    print(f"compiled update: {counter.frame_count} graph; {time.perf_counter() - t0:.1f} s in all")
    assert sum(returns[-3:]) / 3 > sum(returns[:3]) / 3 + 0.2  # the policy learned
    assert counter.frame_count == 1


if __name__ == "__main__":
    main()
