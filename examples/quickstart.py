"""Quickstart: build, read, update (functionally), reshape, compute and compile a TensorDict."""

import torch

import tdfunc

td = tdfunc.TensorDict(
    {"obs": torch.randn(8, 4), "reward": torch.zeros(8), "next": {"obs": torch.randn(8, 4)}},
    batch_size=[8],
)
print(td)

# reading: string keys, tuple keys for nested entries
assert td["next", "obs"].shape == (8, 4)

# functional updates return a new TensorDict; the original is untouched
td2 = td.set("done", torch.zeros(8, dtype=torch.bool))
assert "done" in td2
assert "done" not in td

# out-of-place indexed write, like JAX
td3 = td.at[0].set(1.0)
assert td3["reward"][0] == 1.0
assert td["reward"][0] == 0.0

# batch-dim ops and arithmetic
halves = td.reshape(2, 4)
assert halves.batch_size == (2, 4)
scaled = 2 * td + 1
assert torch.equal(scaled["reward"], torch.ones(8))
assert tdfunc.stack([td, td]).batch_size == (2, 8)


# compiled: one graph, no graph breaks, same result as eager
def step(td: tdfunc.TensorDict) -> tdfunc.TensorDict:
    return td.set("reward", td["reward"] + td["obs"].sum(-1)).apply(torch.tanh)


compiled_step = torch.compile(step, fullgraph=True)
out = compiled_step(td)
assert out.batch_size == td.batch_size
tdfunc.testing.assert_close(out, step(td))

# torch.vmap sees the batch dims through the pytree rule
per_item = torch.vmap(lambda t: t.sum())(td)
assert per_item.batch_size == (8,)
print("quickstart ok")
