"""A functional training step compiled with torch.compile(fullgraph=True): parameters, momentum
and the data batch are TensorDicts; the update is TensorDict arithmetic; no graph breaks."""

import time

import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
w_true = torch.randn(8, 1)


def make_batch(n=256):
    x = torch.randn(n, 8)
    return tdfunc.TensorDict({"x": x, "y": (x @ w_true).tanh()}, batch_size=[n])


def loss_fn(params, batch):
    pred = tdfunc.functional_call(model, params, (batch["x"],))
    return ((pred - batch["y"]) ** 2).mean()


def train_step(params, momentum, batch, lr):
    grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
    momentum = 0.9 * momentum + grads
    return params - lr * momentum, momentum, loss


counter = CompileCounterWithBackend("inductor")  # real compilation, plus a frame count
step = torch.compile(train_step, backend=counter, fullgraph=True)

params = tdfunc.from_module(model).detach()
momentum = params * 0
lr = torch.tensor(0.05)
t0 = time.perf_counter()
params, momentum, loss = step(params, momentum, make_batch(), lr)
print(f"first call (compiles): {time.perf_counter() - t0:.1f} s, loss {loss:.4f}")
for i in range(300):
    params, momentum, loss = step(params, momentum, make_batch(), lr)
    if i % 100 == 0:
        print(f"step {i:3d} loss {loss:.4f}")
print(f"final loss {loss:.4f}; frames compiled: {counter.frame_count} (one graph, no breaks)")
assert counter.frame_count == 1
assert loss < 0.05

# the same step eagerly gives the same numbers
p0 = tdfunc.from_module(model).detach()
b = make_batch()
eager = train_step(p0, p0 * 0, b, lr)
compiled = step(p0, p0 * 0, b, lr)
tdfunc.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
print("compiled step == eager step")
