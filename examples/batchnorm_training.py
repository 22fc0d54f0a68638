"""A pure, compiled training loop of a small conv net with batch norm.

Parameters, optimizer state and running statistics are TensorDicts that are never written:
each step returns new parameters and momentum (``tdfunc.optim.sgd``), the new batch-norm
statistics (``functional_call(..., return_state=True)``) and the loss, in one
``torch.compile(fullgraph=True)`` graph. At the end the statistics and losses are compared with
the ordinary stateful loop (``nn.Module`` + ``torch.optim.SGD``, in place) on the same data.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc

STEPS, LR, MOMENTUM = 30, 0.1, 0.9


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).train()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 3, 10, 10, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean((1, 2)) > 0).long()


net = make_net()  # gives the structure; its own tensors are never used nor changed
opt = tdfunc.optim.sgd(lr=LR, momentum=MOMENTUM)


def train_step(params, opt_state, buffers, x, y):
    def loss_fn(p):
        logits, (_, new_buffers) = tdfunc.functional_call(
            net, (p, buffers), (x,), return_state=True
        )
        return F.cross_entropy(logits, y), new_buffers

    grads, (loss, new_buffers) = torch.func.grad_and_value(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return tdfunc.optim.apply_updates(params, updates), opt_state, new_buffers, loss


params = tdfunc.from_module(net, buffers=False).detach()
buffers = tdfunc.TensorDict({k: b.clone() for k, b in net.named_buffers()}).unflatten_keys(".")
opt_state = opt.init(params)  # momentum buffers and the step count
counter = CompileCounterWithBackend("aot_eager")
step = torch.compile(train_step, backend=counter, fullgraph=True)

initial, snapshot = buffers, buffers.clone()
losses = []
for i in range(STEPS):
    params, opt_state, buffers, loss = step(params, opt_state, buffers, *batch(i))
    losses.append(loss.item())
tdfunc.testing.assert_close(initial, snapshot, rtol=0, atol=0)  # never written
print(
    f"pure compiled loop: loss {losses[0]:.3f} -> {losses[-1]:.3f}, graphs compiled: "
    f"{counter.frame_count}, batches tracked: {buffers['1', 'num_batches_tracked'].item()}"
)
assert counter.frame_count == 1

# the reference: the ordinary stateful way, in place, on the same data
ref = make_net()
ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
ref_losses = []
for i in range(STEPS):
    x, y = batch(i)
    ref_opt.zero_grad()
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    ref_opt.step()
    ref_losses.append(loss.item())

ref_buffers = tdfunc.TensorDict(dict(ref.named_buffers())).unflatten_keys(".")
tdfunc.testing.assert_close(buffers, ref_buffers, rtol=1e-4, atol=1e-5)
tdfunc.testing.assert_close(params, tdfunc.from_module(ref, buffers=False), rtol=1e-4, atol=1e-5)
assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4
print("running statistics, parameters and losses match the stateful nn.Module + SGD loop")
