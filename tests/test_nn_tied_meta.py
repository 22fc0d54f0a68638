"""functional_call on a structure-only (meta) copy of a model with tied weights.

``copy.deepcopy(model).to("meta")`` gives every slot its own meta Parameter: the tie of GPT-2's
``lm_head.weight`` to ``transformer.wte.weight`` is gone from the copy, and a state built by
``stack_modules``/``from_module`` holds one leaf per tie (no ``lm_head.weight``). The tie is
then taken from the model's declaration; a meta slot the state does not fill is a ``KeyError``
naming it, never a computation on a tensor without values.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc.nn._errors import META_MISSING, SHAPE_MISMATCH

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def gpt2_members(n_layer: int, count: int = 3) -> list[nn.Module]:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    out = []
    for seed in range(count):
        torch.manual_seed(seed)
        out.append(transformers.GPT2LMHeadModel(config).eval())
    return out


def member_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def call(base: nn.Module, p: Any, ids: torch.Tensor) -> torch.Tensor:
    return tdfunc.functional_call(base, p, (ids,), {"use_cache": False}).logits


def test_meta_copy_unties_the_gpt2_parameters() -> None:
    # what the recipe starts from: the members are tied, the meta copy is not
    model = gpt2_members(1, 1)[0]
    assert model.lm_head.weight is model.transformer.wte.weight
    base = copy.deepcopy(model).to("meta")
    assert base.lm_head.weight is not base.transformer.wte.weight
    assert base.lm_head.weight.is_meta
    assert "lm_head" not in tdfunc.stack_modules([model])


@pytest.mark.parametrize("n_layer", [1, 2])
def test_vmap_ensemble_on_a_meta_copy_matches_each_member(n_layer: int) -> None:
    members = gpt2_members(n_layer)
    stacked = tdfunc.stack_modules(members)
    base = copy.deepcopy(members[0]).to("meta")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        out = torch.vmap(lambda p, x: call(base, p, x), in_dims=(0, None))(stacked, ids)
    assert out.shape == (3, 2, 7, 64)
    for i, member in enumerate(members):
        torch.testing.assert_close(out[i], member_logits(member, ids), rtol=1e-5, atol=1e-5)
    # the meta copy is left as it was
    assert base.lm_head.weight.is_meta
    assert base.transformer.wte.weight.is_meta
    assert base.lm_head.weight is not base.transformer.wte.weight


@pytest.mark.parametrize("n_layer", [1, 2])
def test_one_member_on_a_meta_copy_matches_it(n_layer: int) -> None:
    members = gpt2_members(n_layer)
    stacked = tdfunc.stack_modules(members)
    base = copy.deepcopy(members[0]).to("meta")
    ids = torch.randint(0, 64, (2, 7))
    for _ in range(2):  # the full path, then the kept plan
        for i, member in enumerate(members):
            with torch.no_grad():
                got = call(base, stacked[i], ids)
            torch.testing.assert_close(got, member_logits(member, ids), rtol=1e-5, atol=1e-5)


def test_meta_copy_grad_reaches_the_one_tied_leaf() -> None:
    members = gpt2_members(1, 2)
    params = tdfunc.from_module(members[1])
    base = copy.deepcopy(members[0]).to("meta")
    ids = torch.randint(0, 64, (2, 7))
    grads = torch.func.grad(lambda p: call(base, p, ids).square().mean())(params)
    expected = torch.autograd.grad(
        members[1](ids, use_cache=False).logits.square().mean(),
        members[1].transformer.wte.weight,
    )[0]
    torch.testing.assert_close(grads["transformer", "wte", "weight"], expected)


def test_state_that_gives_the_output_name_fills_the_embedding() -> None:
    # the declared tie works both ways: a state holding only lm_head.weight fills wte too
    model = gpt2_members(1, 1)[0]
    flat = dict(tdfunc.from_module(model).flatten_keys(".").items())
    flat["lm_head.weight"] = flat.pop("transformer.wte.weight")
    base = copy.deepcopy(model).to("meta")
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        got = call(base, flat, ids)
    torch.testing.assert_close(got, member_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_undeclared_tie_on_a_meta_copy_raises_naming_the_key() -> None:
    # no declaration (tie_word_embeddings=False): the missing name is an error, not a meta read
    model = gpt2_members(1, 1)[0]
    model.config.tie_word_embeddings = False
    model.all_tied_weights_keys = {}
    params = tdfunc.from_module(model)
    base = copy.deepcopy(model).to("meta")
    text = META_MISSING.format(keys=["lm_head.weight"], module="GPT2LMHeadModel")
    with pytest.raises(KeyError, match=re.escape(text)):
        call(base, params, torch.zeros(1, 3, dtype=torch.long))


def test_compiled_call_on_a_meta_copy_matches_the_member() -> None:
    members = gpt2_members(1, 2)
    stacked = tdfunc.stack_modules(members)
    base = copy.deepcopy(members[0]).to("meta")
    ids = torch.randint(0, 64, (2, 7))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda p, x: call(base, p, x), backend=counter, fullgraph=True)
    with torch.no_grad():
        for i, member in enumerate(members):
            got = compiled(stacked[i], ids)
            torch.testing.assert_close(got, member_logits(member, ids), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1  # member 1 reuses member 0's graph


# --------------------------------------------------------------------------------------
# plain modules (no transformers declaration)
# --------------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """An embedding used again as the output layer, with or without a declared tie."""

    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        if declare:
            self._tied_weights_keys = {"head.weight": "emb.weight"}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


def test_plain_module_declared_tie_on_a_meta_copy() -> None:
    torch.manual_seed(0)
    model = TiedLM(declare=True)
    params = tdfunc.from_module(model)
    assert sorted(params.flatten_keys(".").keys()) == ["emb.weight", "mid.bias", "mid.weight"]
    base = copy.deepcopy(model).to("meta")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(tdfunc.functional_call(base, params, (ids,)), model(ids))


class Config:
    def __init__(self, tie: bool) -> None:
        self.tie_word_embeddings = tie


class OldStyleLM(TiedLM):
    """transformers 4's declaration: a list of names, the embeddings' getters, a config."""

    def __init__(self, tie: bool) -> None:
        super().__init__(declare=False)
        self._tied_weights_keys = ["head.weight"]
        self.config = Config(tie)
        if not tie:
            self.head.weight = nn.Parameter(torch.randn(10, 4))

    def get_input_embeddings(self) -> nn.Module:
        return self.emb

    def get_output_embeddings(self) -> nn.Module:
        return self.head


def test_embedding_getters_declare_the_tie_on_a_meta_copy() -> None:
    torch.manual_seed(0)
    model = OldStyleLM(tie=True)
    params = tdfunc.from_module(model)
    base = copy.deepcopy(model).to("meta")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(tdfunc.functional_call(base, params, (ids,)), model(ids))
        # the declared tie counts as given for strict=True
        torch.testing.assert_close(
            tdfunc.functional_call(base, params, (ids,), strict=True), model(ids)
        )
    # tie_weights=False: no tie is taken, from the module or from its declaration
    text = META_MISSING.format(keys=["head.weight"], module="OldStyleLM")
    with pytest.raises(KeyError, match=re.escape(text)):
        tdfunc.functional_call(base, params, (ids,), tie_weights=False)
    # a config that does not tie declares nothing
    untied = OldStyleLM(tie=False)
    with pytest.raises(KeyError, match=re.escape(text)):
        tdfunc.functional_call(
            copy.deepcopy(untied).to("meta"),
            tdfunc.from_module(untied).exclude(("head", "weight")),
            (ids,),
        )


def test_declared_tie_with_a_wrong_shape_is_a_value_error() -> None:
    model = TiedLM(declare=True)
    model._tied_weights_keys = {"head.weight": "mid.weight"}  # (4, 4) for a (10, 4) slot
    base = copy.deepcopy(model).to("meta")
    text = SHAPE_MISMATCH.format(key="head.weight", got=(4, 4), expected=(10, 4))
    with pytest.raises(ValueError, match=re.escape(text)):
        tdfunc.functional_call(base, tdfunc.from_module(model), (torch.tensor([[1]]),))


def test_plain_module_undeclared_tie_on_a_meta_copy_raises() -> None:
    model = TiedLM(declare=False)
    params = tdfunc.from_module(model)
    base = copy.deepcopy(model).to("meta")
    text = META_MISSING.format(keys=["head.weight"], module="TiedLM")
    with pytest.raises(KeyError, match=re.escape(text)):
        tdfunc.functional_call(base, params, (torch.tensor([[1]]),))
    # retied after .to("meta"): the tie is found on the module again
    base.head.weight = base.emb.weight
    with torch.no_grad():
        torch.testing.assert_close(
            tdfunc.functional_call(base, params, (torch.tensor([[1]]),)), model(torch.tensor([[1]]))
        )


def test_untied_meta_module_missing_key_raises_naming_it() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    params = tdfunc.from_module(model).exclude(("2", "bias"))
    base = copy.deepcopy(model).to("meta")
    text = META_MISSING.format(keys=["2.bias"], module="Sequential")
    for _ in range(2):  # nothing is kept after the error: raised again
        with pytest.raises(KeyError, match=re.escape(text)):
            tdfunc.functional_call(base, params, (torch.ones(1, 3),))
    # under vmap too
    stacked = tdfunc.stack_modules([model, model]).exclude(("2", "bias"))
    with pytest.raises(KeyError, match=re.escape(text)):
        torch.vmap(lambda p: tdfunc.functional_call(base, p, (torch.ones(1, 3),)))(stacked)
    # and when the full state is given, the meta copy runs
    with torch.no_grad():
        got = tdfunc.functional_call(base, tdfunc.from_module(model), (torch.ones(1, 3),))
        torch.testing.assert_close(got, model(torch.ones(1, 3)))


def test_meta_non_persistent_buffer_raises_naming_it() -> None:
    class WithCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("scale", torch.full((2,), 3.0), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    model = WithCache()
    base = copy.deepcopy(model).to("meta")
    text = META_MISSING.format(keys=["scale"], module="WithCache")
    with pytest.raises(KeyError, match=re.escape(text)):
        tdfunc.functional_call(base, tdfunc.from_module(model), (torch.ones(1, 2),))
    state = tdfunc.from_module(model).set("scale", model.scale)
    with torch.no_grad():
        torch.testing.assert_close(
            tdfunc.functional_call(base, state, (torch.ones(1, 2),)), model(torch.ones(1, 2))
        )


def test_a_slot_object_cannot_turn_meta_in_place() -> None:
    # the kept plan (nn/_plan.py) validates slots by object identity only: that is enough
    # because torch refuses to move a tensor object to or from the meta device in place
    p = nn.Parameter(torch.ones(2))
    m = torch.empty(2, device="meta")
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            p.data = m
        with pytest.raises(RuntimeError):
            p.set_(m)
        with pytest.raises(RuntimeError):
            m.set_(torch.ones(2))


def test_kept_plan_on_a_meta_copy_after_a_materialised_one() -> None:
    # one plan per module: the meta copy and the member it was made from do not share one
    model = TiedLM(declare=False)
    params = tdfunc.from_module(model)
    ids = torch.tensor([[1, 2]])
    base = copy.deepcopy(model).to("meta")
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(tdfunc.functional_call(model, params, (ids,)), model(ids))
            with pytest.raises(KeyError, match=r"head\.weight"):
                tdfunc.functional_call(base, params, (ids,))
        base.to_empty(device="cpu")  # new objects in every slot: the full path again
        base.head.weight.copy_(model.head.weight)  # its own values now (strict=False uses them)
        torch.testing.assert_close(tdfunc.functional_call(base, params, (ids,)), model(ids))


def test_state_dict_of_a_meta_copy_gives_the_declared_tie() -> None:
    model = gpt2_members(1, 1)[0]
    params = tdfunc.from_module(model)
    base = copy.deepcopy(model).to("meta")
    sd = tdfunc.state_dict(base, params)
    assert sorted(sd) == sorted(model.state_dict())
    assert sd["lm_head.weight"] is params["transformer", "wte", "weight"]
    assert not any(t.is_meta for t in sd.values())
    # an undeclared meta name stays the module's own (meta) tensor, as documented
    plain = TiedLM(declare=False)
    sd = tdfunc.state_dict(copy.deepcopy(plain).to("meta"), tdfunc.from_module(plain))
    assert sd["head.weight"].is_meta
    assert not sd["emb.weight"].is_meta
