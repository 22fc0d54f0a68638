"""The value model: what is immutable, how keys and batch dims work, and what compiles.

Each section is a claim of the documentation, checked by running it.

Run: ``python examples/value_model.py``
"""

import dataclasses

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc

# --8<-- [start:immutable]
td = tdfunc.TensorDict(obs=torch.zeros(4, 3), reward=torch.zeros(4), batch_size=[4])

# the container is immutable: no item or attribute assignment, no deletion
for attempt in (
    lambda: td.__setitem__("reward", torch.ones(4)),
    lambda: setattr(td, "reward", torch.ones(4)),
    lambda: td.__delitem__("reward"),
):
    try:
        attempt()
    except TypeError as e:
        print("refused:", e)

# every operation returns a new container and leaves its input as it was
td2 = td.set("reward", torch.ones(4))
assert td["reward"].sum() == 0
assert td2["reward"].sum() == 4

# ... but the tensors are ordinary torch tensors, shared, not copied: an in-place tensor
# op writes into the one tensor that both containers hold
assert td2["obs"] is td["obs"]
td2["obs"].add_(1)  # this writes into td's tensor too
assert td["obs"].sum() == 12
td = td.set("obs", torch.zeros(4, 3))  # the functional way: a new tensor in a new container
# --8<-- [end:immutable]

# --8<-- [start:keys]
td = tdfunc.TensorDict(
    {"obs": torch.zeros(4, 3), "next": {"obs": torch.ones(4, 3), "done": torch.zeros(4)}},
    batch_size=[4],
)
assert td["next", "obs"].shape == (4, 3)  # a key path: a tuple of string keys
assert td["next"]["obs"] is td["next", "obs"]  # the same as indexing level by level
assert ("next", "done") in td
assert list(td.keys()) == ["obs", "next"]  # top-level keys, in insertion order
assert list(td.keys(include_nested=True, leaves_only=True)) == [
    "obs",
    ("next", "obs"),
    ("next", "done"),
]
assert list(td.flatten_keys(".").keys()) == ["obs", "next.obs", "next.done"]
td = td.set(("next", "reward"), torch.zeros(4))  # setting a path creates or updates the leaf
assert td.get("missing") is None  # like dict.get; td["missing"] raises KeyError
# --8<-- [end:keys]

# --8<-- [start:batch]
td = tdfunc.TensorDict(obs=torch.zeros(8, 5, 3), action=torch.zeros(8, 5), batch_size=[8, 5])
assert td.batch_dims == 2
assert td.shape == (8, 5)
# shape ops act on the batch dims only; leaf dims after them are carried along
assert td.reshape(40).batch_size == (40,)
assert td.reshape(40)["obs"].shape == (40, 3)
assert td[0].batch_size == (5,)
assert td[:, -1].batch_size == (8,)
assert td.permute(1, 0)["obs"].shape == (5, 8, 3)
assert td.sum(dim=0).batch_size == (5,)
try:  # each leaf must start with the batch dims
    tdfunc.TensorDict(obs=torch.zeros(8, 3), batch_size=[4])
except ValueError as e:
    print("refused:", e)
# --8<-- [end:batch]

# --8<-- [start:where]
# a rollout of 4 steps: finished episodes (a batch-shaped mask) are zeroed in every leaf
rollout = tdfunc.TensorDict(
    obs=torch.ones(4, 3), reward=torch.ones(4), next={"obs": torch.ones(4, 3)}, batch_size=[4]
)
done = torch.tensor([False, True, False, True])
alive = torch.where(~done, rollout, 0)  # the mask [4] lines up with the batch dim
assert alive["obs"][1].eq(0).all()
assert alive["next", "obs"][3].eq(0).all()
assert alive["reward"].tolist() == [1.0, 0.0, 1.0, 0.0]
assert torch.equal(rollout.masked_fill(done, 0)["obs"], alive["obs"])  # the same, as a method
scaled = rollout.where(~done, rollout * 0.5)["reward"]  # td.where(mask, other)
assert scaled.tolist() == [1.0, 0.5, 1.0, 0.5]
# pointwise functions keep the batch size; what mixes feature dims says how to do it
assert rollout.sigmoid().batch_size == (4,)
assert rollout.bool().dtype == torch.bool
try:
    torch.matmul(rollout, rollout)
except TypeError as e:
    print("refused:", str(e).split(":")[0])  # torch.matmul does not lift ... td.apply(...)
# --8<-- [end:where]


# --8<-- [start:tensorclass]
@tdfunc.tensorclass
class Step:
    obs: torch.Tensor  # a tensor field: a leaf
    reward: torch.Tensor | None = None  # may be None: stays in the structure, not a leaf
    extras: tdfunc.TensorDict | None = None  # a container field: a subtree
    gamma: float = 0.99  # any other annotation: a static field, part of the structure


s = Step(torch.zeros(4, 3), batch_size=[4])
assert s.reward is None
assert s[1:].obs.shape == (3, 3)
assert len(torch.utils._pytree.tree_leaves(s)) == 1  # only obs is a leaf
s2 = s.replace(reward=torch.ones(4))
assert s.reward is None
assert s2.reward.shape == (4,)
try:
    s.obs = torch.ones(4, 3)
except dataclasses.FrozenInstanceError:
    print("refused: a tensorclass is a frozen dataclass; use s.replace(obs=...)")
# --8<-- [end:tensorclass]

# --8<-- [start:compile]
counter = CompileCounterWithBackend("eager")


@torch.compile(backend=counter, fullgraph=True)
def step(td: tdfunc.TensorDict, s: Step) -> tdfunc.TensorDict:
    td = td.set("value", td["obs"].sum(-1) * s.gamma)  # set, read, arithmetic, apply...
    return (td * 2).apply(torch.tanh)


td = tdfunc.TensorDict(obs=torch.randn(4, 3), batch_size=[4])
out = step(td, s)
out = step(td.set("obs", torch.randn(4, 3)), s)  # new values, same structure: no recompile
assert counter.frame_count == 1
step(td, s.replace(gamma=0.5))  # a static field is structure: a new graph
assert counter.frame_count == 2

# `~td` is the one operator Dynamo cannot trace on a container; bitwise_not() is the same op
flags = tdfunc.TensorDict(done=torch.zeros(4, dtype=torch.bool), batch_size=[4])
negate = torch.compile(lambda t: t.bitwise_not(), backend="eager", fullgraph=True)
assert negate(flags)["done"].all()
# --8<-- [end:compile]
print("value model ok")
