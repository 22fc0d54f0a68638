"""What new users hit, and how to read it: each case of the troubleshooting page, run.

1. Under ``torch.compile(fullgraph=True)`` an error that tdfunc raises (here a ``KeyError``
   for a missing key) reaches the caller wrapped in Dynamo's ``Unsupported: Observed
   exception``; tdfunc's own message is in the text (``Developer debug context``) and in
   ``__cause__``. ``torch.compiler.set_stance("force_eager")`` runs the same compiled
   function eagerly and raises the plain error.
2. Immutability covers the container, not the tensors in it.
3. ``nn.Module.load_state_dict`` takes a flat dict of names, not a container:
   ``tdfunc.state_dict(module, params)`` gives it every name (tied ones included).

Run: ``python examples/troubleshooting.py``
"""

import torch
from torch import nn

import tdfunc

# --8<-- [start:compiled_error]
td = tdfunc.TensorDict(obs=torch.zeros(4, 3), batch_size=[4])


@torch.compile(fullgraph=True)
def policy(td: tdfunc.TensorDict) -> torch.Tensor:
    return td["observation"].sum(-1)  # a typo: the key is "obs"


try:
    policy(td)
except torch._dynamo.exc.Unsupported as e:
    text = str(e)
    assert text.startswith("Observed exception")
    # tdfunc's message is in the debug context, and the original exception in __cause__
    assert "key 'observation' not found in TensorDict" in text
    print("compiled:", e.__cause__)
else:
    raise AssertionError("expected an error")

# the same compiled function, run eagerly: the plain error and a traceback into your code
with torch.compiler.set_stance("force_eager"):
    try:
        policy(td)
    except KeyError as e:
        print("eager:", e)
    else:
        raise AssertionError("expected a KeyError")
# --8<-- [end:compiled_error]

# --8<-- [start:immutability]
a = tdfunc.TensorDict(w=torch.zeros(3), batch_size=[3])
b = a.set("w2", torch.ones(3))  # a new container: a is unchanged...
assert "w2" not in a
b["w"].add_(1)  # ...but b["w"] is a["w"]: in-place tensor ops reach both
assert a["w"].tolist() == [1.0, 1.0, 1.0]
c = a.clone()  # copies the tensors: now nothing is shared
c["w"].add_(1)
assert a["w"].tolist() == [1.0, 1.0, 1.0]
# --8<-- [end:immutability]

# --8<-- [start:load_state_dict]
model = nn.Linear(3, 2)
params = tdfunc.from_module(model) * 0.5  # a nested TensorDict, e.g. after an update
try:
    model.load_state_dict(params)
except TypeError as e:
    print("load_state_dict:", e)  # "Expected state_dict to be dict-like, got ..."
else:
    raise AssertionError("expected a TypeError")
model.load_state_dict(tdfunc.state_dict(model, params))  # every name of model.state_dict()
assert torch.equal(model.weight, params["weight"])

# with tied weights, a container holds the tied tensor once: flatten_keys misses a name
shared = nn.Linear(3, 3)
net = nn.Sequential(shared, shared)  # "1.weight" is "0.weight"
params = tdfunc.from_module(net) * 0.5
assert list(params.flatten_keys(".").keys()) == ["0.weight", "0.bias"]
net.load_state_dict(tdfunc.state_dict(net, params))  # every name, ties included
assert net[1].weight is net[0].weight
assert torch.equal(net[1].weight, params["0", "weight"])
# --8<-- [end:load_state_dict]
print("troubleshooting ok")
