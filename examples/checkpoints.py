"""Checkpoints and interop: a training state on disk, safetensors files and tensordict objects.

1. A whole training state (parameters, momentum, step: one tensorclass) is saved as a store
   with ``tdfunc.save`` and loaded back to resume; the resumed run equals the uninterrupted one.
2. A model's parameters as a safetensors file (``save_safetensors``; names are the
   ``state_dict()`` names), loaded by tdfunc memory-mapped and into a module with
   ``load_state_dict(tdfunc.state_dict(module, params))``.
3. A ``state_dict`` (every name, tied ones included) saved for transformers:
   ``from_pretrained`` of that directory gives the same logits.
4. Conversion to and from ``tensordict.TensorDict`` shares the tensors (no copy).

Run: ``python examples/checkpoints.py``
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

import tdfunc

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
x, y = torch.randn(64, 4), torch.randn(64, 1)


# --8<-- [start:state]
@tdfunc.tensorclass
class TrainState:
    params: tdfunc.TensorDict
    momentum: tdfunc.TensorDict
    step: torch.Tensor


def loss_fn(params: tdfunc.TensorDict) -> torch.Tensor:
    return ((tdfunc.functional_call(model, params, (x,)) - y) ** 2).mean()


def train(state: TrainState, steps: int) -> TrainState:
    for _ in range(steps):
        grads = torch.func.grad(loss_fn)(state.params)
        momentum = 0.9 * state.momentum + grads
        state = TrainState(state.params - 0.05 * momentum, momentum, state.step + 1)
    return state


params = tdfunc.from_module(model).detach()
start = TrainState(params, params * 0, torch.tensor(0))
# --8<-- [end:state]


def checkpoint(tmp: str) -> None:
    # --8<-- [start:checkpoint]
    path = os.path.join(tmp, "ckpt")
    state = train(start, 5)
    tdfunc.save(state, path)  # atomic; FileExistsError if the path holds a store already
    state = train(state, 5)
    tdfunc.save(state, path, overwrite=True)  # a reader sees the old or the new one, whole

    # a TrainState; .clone() reads its memory-mapped leaves once into plain tensors, so a
    # compiled step compiles once (mapped leaves are another tensor type to torch.compile)
    resumed = tdfunc.load(path).clone()
    assert type(resumed) is TrainState
    assert resumed.step.item() == 10
    resumed = train(resumed, 5)
    tdfunc.testing.assert_close(resumed, train(start, 15))  # == the uninterrupted run
    # --8<-- [end:checkpoint]
    print(f"resumed from step 10 and reached step {resumed.step.item()} as without a break")


def safetensors_files(tmp: str) -> None:
    # --8<-- [start:safetensors]
    path = os.path.join(tmp, "model.safetensors")
    tdfunc.save_safetensors(tdfunc.from_module(model), path)  # names: model.state_dict()'s

    params = tdfunc.load_safetensors(path)  # maps the file; reads the header only
    assert type(params["0", "weight"]).__name__ == "MemoryMappedTensor"

    # load_state_dict takes a flat dict of names, not a container: tdfunc.state_dict
    fresh = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    fresh.load_state_dict(tdfunc.state_dict(fresh, params))
    assert torch.equal(fresh(x), model(x))
    # --8<-- [end:safetensors]
    print(f"safetensors: {sorted(fresh.state_dict())} loaded into a new module")


def transformers_round_trip(tmp: str) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a quiet demo
    # --8<-- [start:transformers]
    import transformers

    config = transformers.GPT2Config(  # a tiny GPT-2 from its config: nothing downloaded
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=128,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    gpt = transformers.GPT2LMHeadModel(config).eval()
    params = tdfunc.from_module(gpt).detach() * 1.1  # the params you trained, say

    out = os.path.join(tmp, "gpt2")
    config.save_pretrained(out)
    # a mapping of names to tensors saves as it is: every name, the tied lm_head.weight too
    sd = tdfunc.state_dict(gpt, params)
    tdfunc.save_safetensors(sd, os.path.join(out, "model.safetensors"))

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(12)[None]
    with torch.no_grad():
        want = tdfunc.functional_call(gpt, params, (ids,)).logits
        assert torch.equal(loaded(ids).logits, want)  # the same logits, bit for bit
    # --8<-- [end:transformers]
    print("transformers: from_pretrained gives the logits of the saved params")


def tensordict_interop() -> None:
    # --8<-- [start:tensordict]
    import tensordict

    ours = tdfunc.TensorDict(obs=torch.zeros(8, 3), next={"obs": torch.ones(8, 3)}, batch_size=[8])
    theirs = tdfunc.to_tensordict(ours)  # a tensordict.TensorDict sharing the tensors
    assert isinstance(theirs, tensordict.TensorDict)
    assert theirs.batch_size == (8,)
    assert theirs["next", "obs"] is ours["next", "obs"]
    back = tdfunc.from_tensordict(theirs)
    assert back["obs"] is ours["obs"]  # no copy either way
    # --8<-- [end:tensordict]
    print("tensordict round trip shares every tensor")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="tdfunc-ckpt-") as tmp:
        checkpoint(tmp)
        safetensors_files(tmp)
        transformers_round_trip(tmp)
    tensordict_interop()


if __name__ == "__main__":
    main()
