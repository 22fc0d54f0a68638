"""Per-sample gradients with torch.vmap(torch.func.grad(...)) over a parameter TensorDict, used
for a differentially-private style step: clip each example's gradient, then average."""

import torch
from torch import nn

import tdfunc

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
params = tdfunc.from_module(model).detach()  # TensorDict of the model's weights, batch ()
x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))


def loss_fn(p, xi, yi):
    logits = tdfunc.functional_call(model, p, (xi.unsqueeze(0),))
    return nn.functional.cross_entropy(logits, yi.unsqueeze(0))


# one gradient per example: a TensorDict with batch size [32]
per_sample = torch.vmap(torch.func.grad(loss_fn), in_dims=(None, 0, 0))(params, x, y)
print(
    "per-sample grads:", per_sample.batch_size, "0.weight", tuple(per_sample["0", "weight"].shape)
)

# check example 5 against plain autograd
model.zero_grad()
nn.functional.cross_entropy(model(x[5:6]), y[5:6]).backward()
for key, g in per_sample.items(include_nested=True, leaves_only=True):
    torch.testing.assert_close(g[5], model.get_parameter(".".join(key)).grad)
print("example 5 matches autograd")

# clip each example's gradient to norm <= 1 (norm over all its leaves), then average
sq = sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values(True, True))
scale = (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # [32]
clipped = per_sample.apply(lambda g: g * scale.view(-1, *[1] * (g.ndim - 1)))
mean_grad = clipped.mean(dim=0)  # back to batch ()
print("norms before clipping:", [round(v, 2) for v in sq.sqrt()[:6].tolist()], "...")
new_params = params - 0.5 * mean_grad


def full_loss(p):
    return nn.functional.cross_entropy(tdfunc.functional_call(model, p, (x,)), y)


before, after = full_loss(params), full_loss(new_params)
print(f"loss {before:.4f} -> {after:.4f} after one clipped step")
assert after < before
