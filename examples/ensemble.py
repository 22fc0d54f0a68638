"""An ensemble of 8 MLPs run as one batched call: stack_modules + torch.vmap + functional_call.

The stacked parameters are a TensorDict with batch size [8] of fresh leaf tensors, so one
optimizer trains all members at once; the original modules are never modified.
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
per_member = torch.vmap(member_forward, in_dims=(0, 0))

opt = torch.optim.Adam(params.values(include_nested=True, leaves_only=True), lr=1e-2)
for step in range(121):
    opt.zero_grad()
    losses = ((per_member(params, xs) - ys) ** 2).mean(dim=(1, 2))  # one loss per member
    losses.sum().backward()
    opt.step()
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
