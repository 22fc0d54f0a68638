"""Tensorclass: a frozen, typed record of tensors that shares a batch size, eager and compiled.

Shows construction, functional updates, every batch op keeping the class, static fields,
nesting with TensorDict, torch.vmap, torch.compile and torch.export.
"""

import dataclasses
import io

import torch

import tdfunc
from tdfunc import tensorclass


@tensorclass
class Transition:
    obs: torch.Tensor  # tensor fields are leaves
    action: torch.Tensor
    reward: torch.Tensor
    info: tdfunc.TensorDict | None = None  # nested containers are subtrees; None is allowed
    discount: float = 0.99  # any other annotation is static metadata (part of the structure)

    def __post_init__(self) -> None:
        # runs after each construction by the user, never after operations
        if self.obs.shape[-1] != 4:
            raise ValueError(f"obs must have 4 features, got {tuple(self.obs.shape)}")

    def discounted(self) -> torch.Tensor:
        return self.reward * self.discount


t = Transition(torch.randn(32, 4), torch.randn(32, 2), torch.ones(32), batch_size=[32])
print(t)

# frozen: build new values instead of writing into old ones
t2 = t.replace(reward=torch.zeros(32))
assert torch.equal(t.reward, torch.ones(32))
assert torch.equal(t2.reward, torch.zeros(32))
assert dataclasses.replace(t, discount=0.5).batch_size == t.batch_size
assert [f.name for f in dataclasses.fields(Transition)][:3] == ["obs", "action", "reward"]
try:
    t.obs = torch.zeros(32, 4)
except dataclasses.FrozenInstanceError as err:
    print("frozen:", err)

# every batch op keeps the class and the static fields
for out in (t[:8], t.reshape(4, 8), t * 2 + 1, t.to(torch.float64), tdfunc.stack([t, t])):
    assert type(out) is Transition
    assert out.discount == 0.99
print("t.reshape(4, 8).batch_size =", t.reshape(4, 8).batch_size)

# nesting both ways
t3 = t.set(("info", "value"), torch.randn(32))
td = tdfunc.TensorDict(step=t3, time=torch.arange(32), batch_size=[32])
assert type(td[:4]["step"]) is Transition
assert td["step", "info", "value"].shape == (32,)

# torch.vmap sees the leaves (a None field is not one) and rebuilds the class
per_sample = torch.vmap(lambda s: s.replace(obs=s.obs / s.obs.norm()))(t)
assert type(per_sample) is Transition
assert per_sample.batch_size == (32,)


# torch.compile: construction, attribute access and replace in one graph
def step(obs: torch.Tensor, action: torch.Tensor) -> Transition:
    tr = Transition(obs, action, torch.zeros(obs.shape[0]), batch_size=obs.shape[:1])
    tr = tr.replace(reward=(tr.obs * tr.action.sum(-1, keepdim=True)).sum(-1))
    return tr.replace(reward=tr.discounted())


compiled_step = torch.compile(step, fullgraph=True)
obs, action = torch.randn(32, 4), torch.randn(32, 2)
tdfunc.testing.assert_close(compiled_step(obs, action), step(obs, action), rtol=1e-4, atol=1e-5)
print("compiled: matches eager")


# torch.export with a tensorclass input and output, saved and loaded
class Scale(torch.nn.Module):
    def forward(self, tr: Transition) -> Transition:
        return tr.replace(obs=tr.obs * 2)


program = torch.export.export(Scale(), (t,))
buffer = io.BytesIO()
torch.export.save(program, buffer)
buffer.seek(0)
loaded = torch.export.load(buffer)
tdfunc.testing.assert_close(loaded.module()(t), Scale()(t))
print("exported, saved and loaded")
