"""A training step compiled by blocks: each distinct block compiles once, whatever the depth.

``tdfunc.value_and_grad`` takes the gradients with autograd on detached aliases of the
parameters (nothing is written), so AOTAutograd differentiates each compiled block; the
optimizer step runs torch's fused kernel eagerly on donated buffers. Checked against the
one-graph eager step (torch.func).
"""

import torch
import torch.nn.functional as F

import tdfunc
from tdfunc import optim


# --8<-- [start:step]
class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(64)
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 64)

    @torch.compile  # a region: one graph for every block (two: the first block's input needs no grad)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


model = torch.nn.Sequential(*[Block() for _ in range(8)])
opt = optim.adamw(lr=1e-3)


def loss_fn(params, x, y):
    return ((tdfunc.functional_call(model, params, (x,)) - y) ** 2).mean()


value_and_grad = tdfunc.value_and_grad(loss_fn)


def step(params, state, x, y):
    loss, grads = value_and_grad(params, x, y)
    params, state = optim.step(opt, grads, state, params, donate=True)
    return params, state, loss


# --8<-- [end:step]

if __name__ == "__main__":
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    params = tdfunc.from_module(model, buffers=False).detach().clone()
    state = opt.init(params)
    losses = []
    for _ in range(3):
        # the gradients against the one-graph eager step (torch.func) on the same params:
        # inductor's kernels round differently from eager ones (about 1e-6). The params are
        # not compared after Adam steps: Adam moves a parameter whose gradient is near zero
        # by about lr whatever the gradient's size, so a rounding difference there moves it
        # by up to 2 * lr.
        ref_g, ref_loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        loss, grads = value_and_grad(params, x, y)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
        tdfunc.testing.assert_close(grads, ref_g, atol=1e-5, rtol=1e-4)
        params, state, loss = step(params, state, x, y)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; gradients as the eager step's")
