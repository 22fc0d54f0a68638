"""The fine-tuning recipes of ``examples/lm_recipes.py`` (guide: docs/guides/fine-tuning.md) on a
tiny GPT-2: a LoRA adapter over a frozen base (gradients for the adapter only, the base bit
for bit unchanged, the compiled step as eager and compiled once), merging, soups,
interpolation and freezing by key pattern, with the tied embedding kept as one leaf."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import optim

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lm_recipes.py"
WTE = ("transformer", "wte", "weight")


@pytest.fixture(scope="module")
def ex() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("_lm_recipes_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Dynamo imports the module of the functions it traces
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture(scope="module")
def setup(ex: ModuleType) -> dict[str, Any]:
    config = ex.make_config(n_layer=2, n_embd=32)
    model = ex.make_model(config)
    base = tdfunc.from_module(model).detach()
    return {"config": config, "model": model, "base": base, "snapshot": base.clone()}


def _ids(ex: ModuleType, seed: int, n: int = 8) -> torch.Tensor:
    return ex.task_batch(torch.Generator().manual_seed(seed), n=n)


def _trained_adapter(ex: ModuleType, setup: dict[str, Any], steps: int = 3) -> Any:
    adapter = ex.lora_init(setup["base"], ex.ADAPTED, ex.RANK)
    opt = optim.adam(lr=1e-2)
    step = ex.make_adapter_step(setup["model"], opt)
    state = opt.init(adapter)
    for i in range(steps):
        adapter, state, _ = step(adapter, state, setup["base"], _ids(ex, i))
    return adapter


def _fresh_logits(ex: ModuleType, setup: dict[str, Any], params: Any, ids: torch.Tensor) -> Any:
    """The logits of a new transformers model loaded with ``state_dict(model, params)``."""
    fresh = ex.GPT2LMHeadModel(setup["config"]).eval()
    fresh.load_state_dict(tdfunc.state_dict(setup["model"], params))
    with torch.no_grad():
        return fresh(ids, use_cache=False).logits


def _assert_tied(setup: dict[str, Any], params: Any) -> None:
    assert "lm_head" not in params
    names = tdfunc.state_dict(setup["model"], params)
    assert names["lm_head.weight"] is params[WTE]
    assert names["transformer.wte.weight"] is params[WTE]


def test_matching_globs_the_dotted_key_path(ex: ModuleType) -> None:
    pred = ex.matching("*.ln_*", "transformer.wte.*")
    leaf = torch.zeros(1)
    assert pred(("transformer", "h", "0", "ln_1", "weight"), leaf)
    assert pred(("transformer", "ln_f", "bias"), leaf)
    assert pred(WTE, leaf)
    assert not pred(("transformer", "wpe", "weight"), leaf)
    assert not pred(("transformer", "h", "0", "attn", "c_attn", "weight"), leaf)


def test_the_base_holds_the_tie_as_one_leaf(setup: dict[str, Any]) -> None:
    base = setup["base"]
    _assert_tied(setup, base)
    assert len(tdfunc.state_dict(setup["model"], base)) == len(base.keys(True, True)) + 1


def test_lora_init_covers_the_chosen_weights_and_starts_at_the_base(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    base = setup["base"]
    adapter = ex.lora_init(base, ex.ADAPTED, ex.RANK)
    weights = sorted({k[:-1] for k in adapter.keys(True, True)})
    assert len(weights) == 4 * setup["config"].n_layer  # c_attn, attn c_proj, c_fc, mlp c_proj
    assert sorted(adapter.keys(True, True)) == sorted((*w, x) for w in weights for x in "AB")
    for w in weights:
        rows, cols = base[w].shape
        assert adapter[(*w, "A")].shape == (ex.RANK, cols)
        assert torch.equal(adapter[(*w, "B")], torch.zeros(rows, ex.RANK))
    assert ex.same_bits(ex.lora_merge(base, adapter), base)  # W + scale * 0 is W


def test_adapter_gradients_only_for_the_adapter_and_equal_the_side_branch_ones(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    base, model = setup["base"], setup["model"]
    adapter = ex.lora_init(base, ex.ADAPTED, ex.RANK)
    gen = torch.Generator().manual_seed(0)
    adapter = adapter.apply(lambda x: x + 0.01 * torch.randn(x.shape, generator=gen))  # B != 0
    ids = _ids(ex, 0)
    loss, grads = tdfunc.value_and_grad(ex.adapter_loss)(adapter, base, model, ids)
    assert grads.keys(True, True) == adapter.keys(True, True)
    assert all(g.abs().sum() > 0 for g in grads.leaves())
    # the oracle: plain autograd through the model with the adapter as a side branch
    leaves = adapter.apply(lambda x: x.clone().requires_grad_())
    hooked = ex.add_side_branches(model, leaves)
    logits = hooked(ids, use_cache=False).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, ex.VOCAB), ids[:, 1:].reshape(-1))
    ref_grads = torch.autograd.grad(ref, leaves.leaves())
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for k, g in zip(leaves.keys(True, True), ref_grads):
        torch.testing.assert_close(grads[k], g, rtol=1e-4, atol=1e-6)
    # nothing reached the base or the model: no graph, no .grad
    assert not any(x.requires_grad for x in base.leaves())
    assert all(p.grad is None for p in model.parameters())


def test_adapter_training_leaves_the_base_bit_for_bit(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    adapter = _trained_adapter(ex, setup, steps=3)
    assert ex.same_bits(setup["base"], setup["snapshot"])
    assert ex.same_bits(tdfunc.from_module(setup["model"]).detach(), setup["snapshot"])
    assert all(adapter[k].abs().sum() > 0 for k in adapter.keys(True, True) if k[-1] == "B")


def test_merged_adapter_gives_the_side_branch_logits_and_keeps_the_tie(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    adapter = _trained_adapter(ex, setup, steps=3)
    merged = ex.lora_merge(setup["base"], adapter)
    _assert_tied(setup, merged)
    assert sorted(merged.keys(True, True)) == sorted(setup["base"].keys(True, True))
    ids = _ids(ex, 99)
    with torch.no_grad():
        expected = ex.add_side_branches(setup["model"], adapter)(ids, use_cache=False).logits
        functional = tdfunc.functional_call(setup["model"], merged, (ids,), {"use_cache": False})
    torch.testing.assert_close(_fresh_logits(ex, setup, merged, ids), expected)
    torch.testing.assert_close(functional.logits, expected)
    # and differ from the base's: the adapter did something
    with torch.no_grad():
        plain = setup["model"](ids, use_cache=False).logits
    assert (plain - expected).abs().max() > 1e-4


@pytest.fixture(scope="module")
def copies(ex: ModuleType, setup: dict[str, Any]) -> list[Any]:
    return [ex.finetune(setup["model"], setup["base"], steps=2, seed=s) for s in range(3)]


def test_soup_is_the_mean_and_the_weighted_sum(
    ex: ModuleType, setup: dict[str, Any], copies: list[Any]
) -> None:
    a, b, c = copies
    assert not ex.same_bits(a, b)
    uniform = ex.soup(copies)
    for k in a.keys(True, True):
        torch.testing.assert_close(uniform[k], (a[k] + b[k] + c[k]) / 3)
    w = torch.tensor([0.5, 0.3, 0.2])
    weighted = ex.soup(copies, w)
    for k in a.keys(True, True):
        torch.testing.assert_close(weighted[k], 0.5 * a[k] + 0.3 * b[k] + 0.2 * c[k])
    assert ex.same_bits(ex.soup(copies, torch.tensor([0.0, 1.0, 0.0])), b)
    for params in (uniform, weighted):
        _assert_tied(setup, params)
        assert params.batch_size == ()
    ids = _ids(ex, 7)
    got = tdfunc.functional_call(setup["model"], uniform, (ids,), {"use_cache": False}).logits
    torch.testing.assert_close(got, _fresh_logits(ex, setup, uniform, ids))


def test_interpolation_endpoints_are_the_models_and_the_path_vmaps(
    ex: ModuleType, setup: dict[str, Any], copies: list[Any]
) -> None:
    a, b = copies[0], copies[1]
    model, ids = setup["model"], _ids(ex, 5)
    ts = [0.0, 0.5, 1.0]
    path = [ex.interpolate(a, b, t) for t in ts]
    assert ex.same_bits(path[0], a)
    assert ex.same_bits(path[-1], b)
    for k in a.keys(True, True):
        torch.testing.assert_close(path[1][k], ex.soup([a, b])[k])
    losses = [ex.lm_loss(model, p, ids) for p in path]
    assert torch.equal(losses[0], ex.lm_loss(model, a, ids))
    assert torch.equal(losses[-1], ex.lm_loss(model, b, ids))
    batched = torch.vmap(lambda p: ex.lm_loss(model, p, ids))(tdfunc.stack(path))
    torch.testing.assert_close(batched, torch.stack(losses), rtol=1e-5, atol=1e-5)
    _assert_tied(setup, path[1])


def test_freezing_by_key_pattern_trains_only_the_selected_leaves(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    base, model = setup["base"], setup["model"]
    trainable, frozen = base.split_keys(ex.matching("*.ln_*", "transformer.wte.*"))
    n_layer = setup["config"].n_layer
    assert len(trainable.keys(True, True)) == 4 * n_layer + 2 + 1  # ln_1, ln_2, ln_f, wte
    assert len(trainable.keys(True, True)) + len(frozen.keys(True, True)) == len(
        base.keys(True, True)
    )

    def split_loss(trainable: Any, frozen: Any, ids: torch.Tensor) -> torch.Tensor:
        return ex.lm_loss(model, frozen.update(trainable), ids)

    opt = optim.adam(lr=1e-2)
    state = opt.init(trainable)
    # moments for the trained leaves only
    assert sorted(state["adam", "exp_avg"].keys()) == sorted(
        ".".join(k) for k in trainable.keys(True, True)
    )
    tuned_part = trainable
    for i in range(2):
        _, grads = tdfunc.value_and_grad(split_loss)(tuned_part, frozen, _ids(ex, i))
        assert sorted(grads.keys(True, True)) == sorted(trainable.keys(True, True))
        updates, state = opt.update(grads, state, tuned_part)
        tuned_part = optim.apply_updates(tuned_part, updates)
    tuned = frozen.update(tuned_part)
    assert sorted(tuned.keys(True, True)) == sorted(base.keys(True, True))
    for k in base.keys(True, True):
        assert torch.equal(tuned[k], base[k]) == (k not in trainable), k
    # the tied embedding was trained as one leaf: the output layer is the new embedding
    _assert_tied(setup, tuned)
    ids = _ids(ex, 3)
    got = tdfunc.functional_call(model, tuned, (ids,), {"use_cache": False}).logits
    torch.testing.assert_close(got, _fresh_logits(ex, setup, tuned, ids))
    assert ex.same_bits(base, setup["snapshot"])


def test_freezing_in_the_optimizer_updates_only_the_selected_leaves(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    base, model = setup["base"], setup["model"]
    opt = optim.multi_transform(
        {"train": optim.adam(lr=1e-2), "frozen": optim.set_to_zero()},
        {"*.attn.*": "train", "*": "frozen"},
    )
    state = opt.init(base)
    _, grads = tdfunc.value_and_grad(ex.lm_loss, argnums=1)(model, base, _ids(ex, 0))
    updates, state = opt.update(grads, state, base)
    params = optim.apply_updates(base, updates)
    attention = {k for k in base.keys(True, True) if "attn" in k}
    assert len(attention) == 4 * setup["config"].n_layer
    for k in base.keys(True, True):
        assert torch.equal(params[k], base[k]) == (k not in attention), k
    _assert_tied(setup, params)


def test_compiled_adapter_step_matches_eager_and_compiles_once(
    ex: ModuleType, setup: dict[str, Any]
) -> None:
    base, model = setup["base"], setup["model"]
    opt = optim.adam(lr=1e-2)
    step = ex.make_adapter_step(model, opt)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    adapter = ex.lora_init(base, ex.ADAPTED, ex.RANK)
    eager = (adapter, opt.init(adapter))
    comp = (adapter, opt.init(adapter))
    for i in range(4):
        ids = _ids(ex, i)
        *eager_out, eager_loss = step(*eager, base, ids)
        *comp_out, comp_loss = compiled(*comp, base, ids)
        torch.testing.assert_close(comp_loss, eager_loss, rtol=1e-6, atol=1e-6)
        eager, comp = tuple(eager_out), tuple(comp_out)
    tdfunc.testing.assert_close(comp[0], eager[0], rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    assert ex.same_bits(base, setup["snapshot"])
