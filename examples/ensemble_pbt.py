"""Population-based training: 8 MLPs, each with its own learning rate, in one compiled step.

The members are stacked (``tdfunc.stack_modules``: batch ``[8]``) and trained by one pure
``tdfunc.optim.adam`` under ``torch.vmap``; the learning rate is a tensor with one value per
member, kept in the optimizer state. Every 40 steps the worst quarter of the population copies
the parameters and optimizer state of the best quarter (exploit) and perturbs its learning rate
(explore): new values in the same containers, so the compiled step never recompiles. The
parameters and optimizer state are saved with ``tdfunc.save``, loaded back, and training resumes
from the checkpoint exactly as it would have without it. The step donates its params and
state (``tdfunc.compile(..., donate=(0, 1))``): the population is updated in its own memory.

Run: ``python examples/ensemble_pbt.py``
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import optim

torch.manual_seed(0)
N, STEPS, EVERY = 8, 160, 40


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))


members = [make_mlp() for _ in range(N)]
base = copy.deepcopy(members[0]).to("meta")  # the structure only
params = tdfunc.stack_modules(members).detach()  # batch [8]
opt = optim.adam(lr=torch.logspace(-4, -0.5, N))  # one learning rate per member
state = opt.init(params)  # batch [8]: moments, step count and lr of every member
print("learning rates:", [f"{v:.1e}" for v in state["adam", "lr"].tolist()])

target = lambda x: x[:, :1].sin() * x[:, 1:]  # noqa: E731
x_train, x_val = torch.randn(512, 2), torch.randn(256, 2)
y_train, y_val = target(x_train), target(x_val)


def loss_fn(p: tdfunc.TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((tdfunc.functional_call(base, p, (x,)) - y) ** 2).mean()


def member_step(p: tdfunc.TensorDict, s: tdfunc.TensorDict, x: torch.Tensor, y: torch.Tensor):
    grads, loss = torch.func.grad_and_value(loss_fn)(p, x, y)
    updates, s = opt.update(grads, s, p)
    return optim.apply_updates(p, updates), s, loss


counter = CompileCounterWithBackend("aot_eager")
# the loop never reads the old params and state again: donate them (the step writes the new
# values into their memory instead of allocating a population's worth of tensors per step)
train_step = tdfunc.compile(
    torch.vmap(member_step, in_dims=(0, 0, None, None)),
    donate=(0, 1),
    backend=counter,
    fullgraph=True,
)
val_losses = torch.vmap(loss_fn, in_dims=(0, None, None))


def exploit_and_explore(
    params: tdfunc.TensorDict, state: tdfunc.TensorDict, generator: torch.Generator
) -> tuple[tdfunc.TensorDict, tdfunc.TensorDict]:
    """The worst quarter takes the best quarter's params and state, with a perturbed lr."""
    order = val_losses(params, x_val, y_val).argsort()
    k = N // 4
    source = torch.arange(N)
    source[order[-k:]] = order[:k]  # worst <- best
    params, state = params[source], state[source]  # gathers: new tensors, same structure
    factor = torch.where(torch.rand(k, generator=generator) < 0.5, 0.5, 2.0)
    lr = state["adam", "lr"].clone()
    lr[order[-k:]] = lr[order[-k:]] * factor
    return params, optim.set_hyperparams(state, lr=lr)


g = torch.Generator().manual_seed(1)
for step in range(STEPS):
    params, state, losses = train_step(params, state, x_train, y_train)
    if (step + 1) % EVERY == 0:
        params, state = exploit_and_explore(params, state, g)
        best = val_losses(params, x_val, y_val).min().item()
        print(
            f"step {step + 1:3d}: best validation loss {best:.4f}, learning rates "
            f"{[f'{v:.1e}' for v in state['adam', 'lr'].tolist()]}"
        )
print(f"graphs compiled: {counter.frame_count} (learning rates changed {STEPS // EVERY} times)")
assert counter.frame_count == 1
assert val_losses(params, x_val, y_val).min() < 0.01

# checkpoint: parameters and optimizer state in one store, loaded back
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "population")
    tdfunc.save(tdfunc.TensorDict(params=params, opt_state=state, batch_size=[N]), path)
    ckpt = tdfunc.load(path).clone()  # mapped from disk, then copied into memory
tdfunc.testing.assert_close(ckpt["opt_state"], state, rtol=0, atol=0)

resumed_p, resumed_s = ckpt["params"], ckpt["opt_state"]
for _ in range(20):
    params, state, _ = train_step(params, state, x_train, y_train)
    resumed_p, resumed_s, _ = train_step(resumed_p, resumed_s, x_train, y_train)
tdfunc.testing.assert_close(resumed_p, params, rtol=0, atol=0)
tdfunc.testing.assert_close(resumed_s, state, rtol=0, atol=0)
print(
    f"resumed from the checkpoint: identical after 20 more steps (step count "
    f"{resumed_s['adam', 'step'].tolist()[0]})"
)
assert counter.frame_count == 1
