"""A functional training step compiled with torch.compile(fullgraph=True): parameters, the
optimizer state and the data batch are TensorDicts; the update is a pure tdfunc.optim.sgd with
momentum whose learning rate is a tensor in its state (changing it does not recompile).

The step is pure, and the loop never uses the old parameters and state again, so it donates
them (``tdfunc.compile(..., donate=(0, 1))``): the compiled graph writes the new values into
their memory instead of allocating new tensors every step, with the same results."""

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


opt = tdfunc.optim.sgd(lr=torch.tensor(0.05), momentum=0.9)


def train_step(params, state, batch):
    grads, loss = torch.func.grad_and_value(loss_fn)(params, batch)
    params, state = tdfunc.optim.step(opt, grads, state, params)
    return params, state, loss


counter = CompileCounterWithBackend("inductor")  # real compilation, plus a frame count
step = tdfunc.compile(train_step, donate=(0, 1), backend=counter, fullgraph=True)

# a copy: donated tensors receive the new values, and detach() alone shares the module's memory
params = tdfunc.from_module(model).detach().clone()
first = params["0", "weight"]
state = opt.init(params)  # {"sgd": {"momentum_buffer": <params-shaped>, "step": 0, "lr": 0.05}}
t0 = time.perf_counter()
params, state, loss = step(params, state, make_batch())
print(f"first call (compiles): {time.perf_counter() - t0:.1f} s, loss {loss:.4f}")
for i in range(300):
    if i == 200:  # decay the learning rate: a new value in the state, the same graph
        state = tdfunc.optim.set_hyperparams(state, lr=0.01)
    params, state, loss = step(params, state, make_batch())
    if i % 100 == 0:
        print(f"step {i:3d} loss {loss:.4f}")
print(f"final loss {loss:.4f}; frames compiled: {counter.frame_count} (one graph, no breaks)")
assert counter.frame_count == 1
assert int(state["sgd", "step"]) == 301
assert loss < 0.05
assert params["0", "weight"] is first  # every step wrote into the same memory
old_params = params
params, state, loss = step(params, state, make_batch())
try:
    old_params["0", "weight"]  # donated to the step: consumed
    raise AssertionError("a donated container was usable after the call")
except tdfunc.DonatedError as e:
    print(f"reusing a donated container: {e}")

# the same step eagerly gives the same numbers
p0 = tdfunc.from_module(model).detach().clone()
b = make_batch()
eager = train_step(p0, opt.init(p0), b)
compiled = step(p0.clone(), opt.init(p0), b)
tdfunc.testing.assert_close(compiled[0], eager[0], atol=1e-5, rtol=1e-5)
print("compiled step == eager step")
