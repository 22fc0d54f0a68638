"""A real model end to end: a small GPT-2 from ``transformers`` as a vmap ensemble, swapped
parameters under ``torch.compile``, and a safetensors checkpoint that ``transformers`` loads.

Runs when ``transformers`` is installed (``pip install transformers``); otherwise it says so
and exits cleanly. The model is built from a config: nothing is downloaded.

Tied weights: GPT-2 uses its token embedding as the output layer (``lm_head.weight`` is
``transformer.wte.weight``). ``from_module`` and ``stack_modules`` keep one leaf per tied
tensor, under its first name (as ``named_parameters()``): gradients and updates reach the one
value, so training never unties it. ``functional_call`` puts that leaf into every slot that
holds it (the embedding and the output layer), and ``tdfunc.state_dict(model, params)`` gives
every name back (one tensor under both), for ``load_state_dict`` or a safetensors file with
every name ``transformers`` expects. A copy moved to the meta device loses the tie (each slot
gets its own meta Parameter); ``functional_call`` then takes it from the model's declaration.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
except ImportError:
    print("transformers is not installed: skipping this example (pip install transformers)")
    sys.exit(0)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
MEMBERS = 4


def make_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )


def logits_of(model: torch.nn.Module, params: tdfunc.TensorDict, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with ``params`` in place of its own tensors (nothing is written)."""
    return tdfunc.functional_call(model, params, (ids,), {"use_cache": False}).logits


def main() -> None:
    config = make_config()
    members = []
    for seed in range(MEMBERS):
        torch.manual_seed(seed)
        members.append(GPT2LMHeadModel(config).eval())
    ids = torch.randint(0, config.vocab_size, (2, 16))

    # 1. parameters as a TensorDict: one leaf per tensor, the tie kept as one value
    params = tdfunc.from_module(members[0])
    assert "lm_head" not in params
    full = tdfunc.state_dict(members[0], params)
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    print(
        f"from_module: {len(params.keys(True, True))} tensors (lm_head.weight is the embedding); "
        f"tdfunc.state_dict gives all {len(full)} names back"
    )

    # 2. a vmap ensemble of the members: each slice matches that member's own output
    stacked = tdfunc.stack_modules(members)
    base = members[0]
    ensemble = torch.vmap(lambda p, x: logits_of(base, p, x), in_dims=(0, None))
    with torch.no_grad():
        out = ensemble(stacked, ids)
        for i, member in enumerate(members):
            own = member(ids, use_cache=False).logits
            torch.testing.assert_close(out[i], own, rtol=1e-4, atol=1e-4)
    print(f"vmap ensemble of {MEMBERS} GPT-2 members: logits {tuple(out.shape)} match each member")

    # 2b. the same on a structure-only copy on the meta device (no memory for its own weights).
    #     .to("meta") gives each slot its own meta Parameter, so the copy's lm_head.weight is no
    #     longer the embedding, and `stacked` has no lm_head.weight leaf: functional_call fills
    #     it from the tie the model declares (transformers' tied weights keys). A meta slot that
    #     the state does not fill and no declared tie names is a KeyError naming it.
    # --8<-- [start:meta]
    meta_base = copy.deepcopy(members[0]).to("meta")
    assert meta_base.lm_head.weight is not meta_base.transformer.wte.weight
    on_meta = torch.vmap(lambda p, x: logits_of(meta_base, p, x), in_dims=(0, None))
    with torch.no_grad():
        out = on_meta(stacked, ids)
        for i, member in enumerate(members):
            own = member(ids, use_cache=False).logits
            torch.testing.assert_close(out[i], own, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits_of(meta_base, stacked[i], ids), own)
    # --8<-- [end:meta]
    print("on a meta copy of member 0, with and without vmap: logits match each member")

    # 3. swapped parameters under torch.compile: a transformer block compiled once (fullgraph),
    #    then called with the parameters of other members without recompiling
    block = base.transformer.h[0]
    hidden = torch.randn(2, 16, config.n_embd)
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(
        lambda p, h: tdfunc.functional_call(block, p, (h,))[0], backend=counter, fullgraph=True
    )
    with torch.no_grad():
        for i in (1, 3):
            got = compiled(stacked[i]["transformer", "h", "0"], hidden)
            torch.testing.assert_close(got, members[i].transformer.h[0](hidden)[0])
    assert counter.frame_count == 1
    print("compiled functional_call, members 1 and 3 swapped in: match, one graph")
    # 4. a safetensors checkpoint that transformers loads back into a model
    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        every_name = tdfunc.state_dict(members[2], tdfunc.from_module(members[2]))
        tdfunc.save_safetensors(every_name, os.path.join(d, "model.safetensors"))
        loaded = GPT2LMHeadModel.from_pretrained(d).eval()
        mapped = tdfunc.load_safetensors(os.path.join(d, "model.safetensors"))
        with torch.no_grad():
            expected = members[2](ids, use_cache=False).logits
            torch.testing.assert_close(loaded(ids, use_cache=False).logits, expected)
            # the memory-mapped checkpoint runs as it is (functional_call copies what it maps)
            torch.testing.assert_close(logits_of(base, mapped, ids), expected)
        assert mapped["lm_head", "weight"] is mapped["transformer", "wte", "weight"]
    print("safetensors round trip: transformers.from_pretrained and tdfunc.load_safetensors agree")


if __name__ == "__main__":
    main()
