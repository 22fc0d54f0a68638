"""An ensemble of 8 MLPs run as one batched call: stack_modules + torch.vmap + functional_call.

The stacked parameters are a TensorDict with batch size [8]; one pure tdfunc.optim.adam trains
all members at once (its state has the same batch size: one set of moments per member); the
original modules are never modified, and neither are the parameters: every step returns new ones.
"""

import copy

import torch
from torch import nn

import tdfunc

torch.manual_seed(0)
N, B = 8, 64


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))


members = [make_mlp() for _ in range(N)]
params = tdfunc.stack_modules(members)  # TensorDict, batch [8]
print("stacked parameters:", params.batch_size, "weight", tuple(params["0", "weight"].shape))

# a structure-only copy on the meta device does the calls: no memory for its own weights
base = copy.deepcopy(members[0]).to("meta")


def member_forward(p, x):
    return tdfunc.functional_call(base, p, (x,))


ensemble = torch.vmap(member_forward, in_dims=(0, None))  # same input for every member

x = torch.randn(B, 2)
with torch.no_grad():
    out = ensemble(params, x)  # [8, 64, 1]
    loop = torch.stack([m(x) for m in members])
assert out.shape == (N, B, 1)
torch.testing.assert_close(out, loop)
print("vmap ensemble == Python loop over the members:", tuple(out.shape))

# train every member on its own bootstrap resample of y = sin(x0) * x1, in one batched call
target = lambda x: x[:, :1].sin() * x[:, 1:]  # noqa: E731
data = torch.randn(256, 2)
idx = torch.randint(0, 256, (N, 256))
xs, ys = data[idx], target(data)[idx]  # [8, 256, 2], [8, 256, 1]

params = params.detach()  # plain tensors: the step below returns new ones, nothing requires grad
opt = tdfunc.optim.adam(lr=1e-2)
state = opt.init(params)  # TensorDict, batch [8]: exp_avg / exp_avg_sq per member, step count


def member_loss(p, x, y):
    return ((member_forward(p, x) - y) ** 2).mean()


# per-member gradients in one batched call; one pure update for the whole ensemble
grads_and_losses = torch.vmap(torch.func.grad_and_value(member_loss), in_dims=(0, 0, 0))
for step in range(121):
    grads, losses = grads_and_losses(params, xs, ys)
    updates, state = opt.update(grads, state, params)
    params = tdfunc.optim.apply_updates(params, updates)
    if step % 60 == 0:
        print(f"step {step:3d} member losses", [round(v, 4) for v in losses.tolist()])

with torch.no_grad():
    test = torch.randn(512, 2)
    preds = ensemble(params, test)
    err = ((preds.mean(0) - target(test)) ** 2).mean()
print(
    f"ensemble mean prediction test MSE {err:.4f}; spread (std over members) "
    f"{preds.std(0).mean():.4f}"
)
assert losses.max() < 0.05, losses
assert all(torch.equal(m[0].weight, members[i][0].weight) for i, m in enumerate(members))
