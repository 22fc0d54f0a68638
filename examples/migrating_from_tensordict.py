"""Migrating from tensordict: each in-place idiom next to its tdfunc form, with equal results.

Run: ``python examples/migrating_from_tensordict.py`` (needs the ``tensordict`` package).
"""

import os
import tempfile

import tensordict
import torch
from torch import nn

import tdfunc

torch.manual_seed(0)
x = torch.randn(4, 3)

# --8<-- [start:updates]
# tensordict: td["a"] = x, td.set_("a", y), del td["b"] (the object changes)
old = tensordict.TensorDict(a=torch.zeros(4, 3), b=torch.ones(4), batch_size=[4])
old["c"] = x
old.set_("a", x + 1)
del old["b"]

# tdfunc: each step returns a new TensorDict (rebind the name)
td = tdfunc.TensorDict(a=torch.zeros(4, 3), b=torch.ones(4), batch_size=[4])
td = td.set("c", x)
td = td.set("a", x + 1)  # or td.update({"a": x + 1, ...}) for several
td = td.exclude("b")  # or: b, td = td.popped("b") (pure: the value and the rest)
tdfunc.testing.assert_close(td, tdfunc.from_tensordict(old))

# tensordict's in-place methods have no tdfunc method: the error names the pure spelling
for inplace, pure in [
    (lambda t: t.zero_(), lambda t: torch.zeros_like(t)),
    (lambda t: t.apply_(torch.exp), lambda t: t.apply(torch.exp)),
    (lambda t: t.rename_key_("c", "z"), lambda t: t.rename_key("c", "z")),
]:
    try:
        inplace(td)
    except tdfunc.InPlaceError as e:  # a TypeError
        print(e)
    expected = tdfunc.from_tensordict(inplace(tdfunc.to_tensordict(td).clone()))
    tdfunc.testing.assert_close(pure(td), expected)
# --8<-- [end:updates]


# --8<-- [start:arithmetic]
# a plain tensor shaped like the batch lines up with the batch dims in both libraries (one
# weight per row of every leaf, whatever its feature dims)
w = torch.tensor([1.0, 2.0, 3.0])
leaves = {"a": torch.rand(3, 3), "b": torch.rand(3, 4)}
theirs = tensordict.TensorDict(leaves, batch_size=[3]) * w
ours = tdfunc.TensorDict(leaves, batch_size=[3]) * w
tdfunc.testing.assert_close(ours, tdfunc.from_tensordict(theirs))
torch.testing.assert_close(ours["a"], leaves["a"] * w[:, None])  # the rows, not the columns

# samples of different lengths: pad_sequence pads and stacks them, masks included
lengths = [2, 4, 3]
theirs = tensordict.pad_sequence(
    [tensordict.TensorDict(obs=torch.ones(n, 5), batch_size=[n]) for n in lengths],
    return_mask=True,
)
ours = tdfunc.pad_sequence(
    [tdfunc.TensorDict(obs=torch.ones(n, 5), batch_size=[n]) for n in lengths],
    return_mask=True,
)
assert ours.batch_size == theirs.batch_size == (3, 4)
assert torch.equal(ours["masks", "obs"], theirs["masks", "obs"])
# --8<-- [end:arithmetic]

# --8<-- [start:modules]
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))

# tensordict: swap the parameters into the module for the call
params_old = tensordict.TensorDict.from_module(model)
with (params_old * 0.5).to_module(model):
    y_old = model(x)

# tdfunc: pass them to the call; the module is never changed
params = tdfunc.from_module(model)
y = tdfunc.functional_call(model, params * 0.5, (x,))
torch.testing.assert_close(y, y_old)

# loading a container into a module: every state_dict name, tied ones included
model.load_state_dict(tdfunc.state_dict(model, params * 1.0))
# --8<-- [end:modules]

# --8<-- [start:storage]
with tempfile.TemporaryDirectory() as tmp:
    # tensordict: td.memmap(path) / TensorDict.load_memmap(path)
    old.memmap(os.path.join(tmp, "theirs"))
    theirs = tensordict.TensorDict.load_memmap(os.path.join(tmp, "theirs"))
    # tdfunc: save / load (atomic, versioned, read-only by default)
    tdfunc.save(td, os.path.join(tmp, "ours"))
    ours = tdfunc.load(os.path.join(tmp, "ours"))
    for key in td.keys(include_nested=True, leaves_only=True):
        assert torch.equal(ours[key] * 1, theirs[key] * 1)
# --8<-- [end:storage]
print("each tensordict idiom and its tdfunc form agree")
