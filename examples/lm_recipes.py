"""Fine-tuning recipes on a small GPT-2 from ``transformers``: a LoRA adapter trained over a
frozen base, merging it, soups of fine-tuned copies, interpolation between two models, and
freezing by key pattern. Every recipe is arithmetic on parameter containers plus
``tdfunc.functional_call``; the model object is only the structure and is never written.

1. Adapter: low-rank ``A``, ``B`` per chosen weight; the loss computes ``W + scale * B @ A``
   and calls the model with it. Gradients come for the adapter's leaves only and the base
   stays bit for bit as it was. The training step compiles once (``fullgraph=True``) and its
   loss equals the eager step's.
2. Merge: the adapter folded into the weights gives a plain parameter container that a fresh
   ``GPT2LMHeadModel`` loads; its logits equal the base model's with the adapter run as a
   side branch (``x @ W + scale * (x @ B) @ A``).
3. Soups: ``tdfunc.stack(copies).mean(0)`` and a weighted soup of fine-tuned copies.
4. Interpolation ``a * (1 - t) + b * t``: the loss along the path, looped and in one
   ``torch.vmap`` call; the endpoints are the two models bit for bit.
5. Freezing by key pattern: ``split_keys`` with a glob over the dotted key paths (gradients
   for the selected leaves only), and ``optim.multi_transform`` with ``set_to_zero``.

Tied weights: GPT-2's output layer is its token embedding. ``from_module`` keeps one leaf for
both (``transformer.wte.weight``; there is no ``lm_head`` key), every recipe keeps that one
leaf, and ``tdfunc.state_dict(model, params)`` gives both names back as one tensor.

Runs when ``transformers`` is installed (``pip install transformers``); otherwise it says so
and exits cleanly. The model is built from a config: nothing is downloaded.
"""

from __future__ import annotations

import copy
import fnmatch
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict, optim

try:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging
except ImportError:
    print("transformers is not installed: skipping this example (pip install transformers)")
    sys.exit(0)

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

VOCAB, LENGTH, BATCH = 64, 16, 16
RANK, SCALE = 4, 2.0  # LoRA rank and alpha / rank
ADAPTED = ("*.c_attn.weight", "*.c_proj.weight", "*.c_fc.weight")  # every Conv1D weight


def make_config(n_layer: int = 2, n_embd: int = 64) -> GPT2Config:
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",  # type: ignore[call-arg]  # a PretrainedConfig option
    )


def make_model(config: GPT2Config, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def task_batch(gen: torch.Generator, stride: int = 5, n: int = BATCH) -> Tensor:
    """Token sequences that step by ``stride`` (mod the vocabulary) from a random start."""
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    return (start + stride * torch.arange(LENGTH)) % VOCAB


def lm_logits(model: torch.nn.Module, params: TensorDict, ids: Tensor) -> Tensor:
    """The logits of ``model`` run with ``params`` in place of its own tensors (nothing is
    written)."""
    return tdfunc.functional_call(model, params, (ids,), {"use_cache": False}).logits


def lm_loss(model: torch.nn.Module, params: TensorDict, ids: Tensor) -> Tensor:
    """Next-token cross-entropy of ``model`` run with ``params``."""
    logits = lm_logits(model, params, ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


# --8<-- [start:patterns]
def matching(*patterns: str) -> Callable[[tuple[str, ...], Tensor], bool]:
    """A predicate over ``(key_path, leaf)``: the dotted key path matches one of the globs."""
    return lambda path, leaf: any(fnmatch.fnmatchcase(".".join(path), p) for p in patterns)


# --8<-- [end:patterns]


# --8<-- [start:tied]
def tied(model: torch.nn.Module, params: TensorDict) -> bool:
    """One leaf for the token embedding and the output layer, and ``state_dict`` gives it
    under both names."""
    wte = params["transformer", "wte", "weight"]
    names = tdfunc.state_dict(model, params)
    return (
        "lm_head" not in params
        and names["lm_head.weight"] is names["transformer.wte.weight"] is wte
    )


# --8<-- [end:tied]


def same_bits(a: TensorDict, b: TensorDict) -> bool:
    """The same key paths and bit-identical leaves."""
    keys = a.keys(True, True)
    return sorted(keys) == sorted(b.keys(True, True)) and all(torch.equal(a[k], b[k]) for k in keys)


# --8<-- [start:adapter]
def lora_init(base: TensorDict, patterns: tuple[str, ...], rank: int, seed: int = 0) -> TensorDict:
    """A LoRA adapter for the 2-D leaves of ``base`` whose dotted key matches ``patterns``:
    at the weight's key path, ``A`` (rank x cols, random) and ``B`` (rows x rank, zeros),
    so the adapted model starts as the base."""
    gen = torch.Generator().manual_seed(seed)
    adapter = TensorDict()
    targets, _ = base.split_keys(matching(*patterns))
    for path, w in targets.items(include_nested=True, leaves_only=True):
        rows, cols = w.shape
        adapter = adapter.set((*path, "A"), torch.randn(rank, cols, generator=gen) / cols**0.5)
        adapter = adapter.set((*path, "B"), torch.zeros(rows, rank))
    return adapter


def lora_merge(base: TensorDict, adapter: TensorDict, scale: float = SCALE) -> TensorDict:
    """``base`` with ``W + scale * B @ A`` at every key path the adapter holds."""
    merged = base
    for path in adapter.keys(include_nested=True, leaves_only=True):
        if path[-1] == "A":
            w = path[:-1]
            delta = adapter[(*w, "B")] @ adapter[(*w, "A")]
            merged = merged.set(w, base[w] + scale * delta)
    return merged


def adapter_loss(
    adapter: TensorDict, base: TensorDict, model: torch.nn.Module, ids: Tensor
) -> Tensor:
    return lm_loss(model, lora_merge(base, adapter), ids)


def make_adapter_step(
    model: torch.nn.Module, opt: optim.GradientTransformation
) -> Callable[..., tuple[TensorDict, TensorDict, Tensor]]:
    def step(
        adapter: TensorDict, opt_state: TensorDict, base: TensorDict, ids: Tensor
    ) -> tuple[TensorDict, TensorDict, Tensor]:
        # gradients with respect to argument 0 only: the base is an input, not a variable
        loss, grads = tdfunc.value_and_grad(adapter_loss)(adapter, base, model, ids)
        updates, opt_state = opt.update(grads, opt_state, adapter)
        return optim.apply_updates(adapter, updates), opt_state, loss

    return step


# --8<-- [end:adapter]


def add_side_branches(model: torch.nn.Module, adapter: TensorDict) -> torch.nn.Module:
    """A copy of ``model`` that runs the adapter unmerged: each adapted Conv1D (``x @ W + b``)
    gets ``scale * (x @ B) @ A`` added to its output by a forward hook."""
    hooked = copy.deepcopy(model)
    for path in adapter.keys(include_nested=True, leaves_only=True):
        if path[-1] == "A":
            a, b = adapter[(*path[:-1], "A")], adapter[(*path[:-1], "B")]
            conv = hooked.get_submodule(".".join(path[:-2]))
            conv.register_forward_hook(lambda m, inp, out, a=a, b=b: out + SCALE * (inp[0] @ b) @ a)
    return hooked


def finetune(
    model: torch.nn.Module, params: TensorDict, steps: int, seed: int, lr: float = 1e-2
) -> TensorDict:
    """Every parameter trained ``steps`` Adam steps on batches drawn with ``seed``."""
    opt = optim.adam(lr=lr)
    state = opt.init(params)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _, grads = tdfunc.value_and_grad(lm_loss, argnums=1)(model, params, task_batch(gen))
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


# --8<-- [start:soup]
def soup(copies: list[TensorDict], weights: Tensor | None = None) -> TensorDict:
    """The uniform soup ``stack(copies).mean(0)``, or ``sum_i weights[i] * copies[i]``."""
    stacked = tdfunc.stack(copies)  # batch [N]: one leaf per key path, ties included
    if weights is None:
        return stacked.mean(0)
    return (stacked * weights).sum(0)  # a [N] tensor lines up with the batch dim


# --8<-- [end:soup]


# --8<-- [start:interpolate]
def interpolate(a: TensorDict, b: TensorDict, t: float) -> TensorDict:
    return a * (1 - t) + b * t


# --8<-- [end:interpolate]


def main() -> None:
    # tensors of a few thousand numbers: a second thread would only add synchronisation
    torch.set_num_threads(1)
    start = time.perf_counter()
    config = make_config()
    model = make_model(config)
    eval_ids = task_batch(torch.Generator().manual_seed(1234), n=64)

    # the base: one leaf per tensor, the tie as one leaf; detached (frozen: no graph through it)
    base = tdfunc.from_module(model).detach()
    snapshot = base.clone()
    names = tdfunc.state_dict(model, base)
    assert tied(model, base)
    print(
        f"GPT-2 ({config.n_layer} layers, n_embd {config.n_embd}): {len(base.keys(True, True))} "
        f"leaves, state_dict names {len(names)} (lm_head.weight is transformer.wte.weight)"
    )

    # 1. a LoRA adapter over the frozen base, trained with a compiled step
    # --8<-- [start:adapter-train]
    adapter = lora_init(base, ADAPTED, RANK)
    opt = optim.adam(lr=1e-2)
    step = make_adapter_step(model, opt)
    # aot_eager: forward and backward graphs without code generation, a quick compile for a
    # demo; leave the backend out for inductor
    counter = CompileCounterWithBackend("aot_eager")
    compiled_step = torch.compile(step, backend=counter, fullgraph=True)

    gen = torch.Generator().manual_seed(0)
    opt_state = opt.init(adapter)
    ids = task_batch(gen)
    _, _, eager_loss = step(adapter, opt_state, base, ids)
    losses = []
    for _ in range(60):
        adapter, opt_state, loss = compiled_step(adapter, opt_state, base, ids)
        losses.append(loss)
        ids = task_batch(gen)
    assert counter.frame_count == 1  # one graph for all 60 steps
    torch.testing.assert_close(losses[0], eager_loss)  # compiled as eagerly
    assert same_bits(base, snapshot)  # the base is bit for bit as it was
    # --8<-- [end:adapter-train]
    _, grads = tdfunc.value_and_grad(adapter_loss)(adapter, base, model, ids)
    assert grads.keys(True, True) == adapter.keys(True, True)
    n_adapter = sum(x.numel() for x in adapter.leaves())
    n_base = sum(x.numel() for x in base.leaves())
    base_loss = lm_loss(model, base, eval_ids).item()
    adapted_loss = adapter_loss(adapter, base, model, eval_ids).item()
    assert adapted_loss < base_loss
    print(
        f"adapter: {len(adapter.keys(True, True))} leaves, {n_adapter} numbers "
        f"({100 * n_adapter / n_base:.1f}% of the base's {n_base}); 60 compiled steps, "
        f"{counter.frame_count} graph; first loss {losses[0].item():.4f} as eager; "
        f"held-out loss {base_loss:.3f} -> {adapted_loss:.3f}; base bit-unchanged"
    )

    # 2. merging: a plain parameter container that a fresh transformers model loads
    # --8<-- [start:merge]
    merged = lora_merge(base, adapter)
    fresh = GPT2LMHeadModel(config).eval()
    fresh.load_state_dict(tdfunc.state_dict(model, merged))  # every name, lm_head included
    unmerged = add_side_branches(model, adapter)  # x @ W + scale * (x @ B) @ A
    with torch.no_grad():
        expected = unmerged(eval_ids, use_cache=False).logits
        got = fresh(eval_ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the tie is one leaf; functional_call puts it in both slots: the same logits
    assert tied(model, merged)
    torch.testing.assert_close(lm_logits(model, merged, eval_ids), got)
    # --8<-- [end:merge]
    print(
        f"merge: merged logits == base + side-branch logits "
        f"(max abs difference {(got - expected).abs().max().item():.1e}); "
        f"{len(merged.keys(True, True))} leaves, the tie kept"
    )

    # 3. soups of fully fine-tuned copies (same base, each on its own data order)
    copies = [finetune(model, base, steps=40, seed=s) for s in range(3)]
    # --8<-- [start:soup-use]
    uniform = soup(copies)
    weighted = soup(copies, torch.tensor([0.5, 0.25, 0.25]))
    assert tied(model, uniform)  # the tie is still one leaf
    assert tied(model, weighted)
    # --8<-- [end:soup-use]
    copy_losses = [lm_loss(model, c, eval_ids).item() for c in copies]
    uniform_loss = lm_loss(model, uniform, eval_ids).item()
    weighted_loss = lm_loss(model, weighted, eval_ids).item()
    print(
        f"soups of 3 fine-tuned copies: held-out losses of the copies "
        f"{', '.join(f'{x:.3f}' for x in copy_losses)}; uniform soup {uniform_loss:.3f}, "
        f"weighted (0.5, 0.25, 0.25) {weighted_loss:.3f}; base {base_loss:.3f}"
    )

    # 4. interpolation between two fine-tuned copies, evaluated along the path
    # --8<-- [start:path]
    ts = [0.0, 0.25, 0.5, 0.75, 1.0]
    path = [interpolate(copies[0], copies[1], t) for t in ts]
    assert same_bits(path[0], copies[0])  # the endpoints are the two models, bit for bit
    assert same_bits(path[-1], copies[1])
    along = [lm_loss(model, p, eval_ids).item() for p in path]
    # the same in one batched call over the stacked path (batch [5])
    batched = torch.vmap(lambda p: lm_loss(model, p, eval_ids))(tdfunc.stack(path))
    torch.testing.assert_close(batched, torch.tensor(along), rtol=1e-5, atol=1e-5)
    assert all(tied(model, p) for p in path)
    # --8<-- [end:path]
    print(
        "interpolation copy 0 -> copy 1: " + ", ".join(f"t={t}: {x:.3f}" for t, x in zip(ts, along))
    )

    # 5. freezing by key pattern: LayerNorms and the (tied) embedding train, the rest is frozen
    # --8<-- [start:freeze]
    trainable, frozen = base.split_keys(matching("*.ln_*", "transformer.wte.*"))

    def split_loss(trainable: TensorDict, frozen: TensorDict, ids: Tensor) -> Tensor:
        return lm_loss(model, frozen.update(trainable), ids)  # the two halves, by key

    opt = optim.adam(lr=1e-2)
    opt_state = opt.init(trainable)  # moments for the trained leaves only
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        loss, grads = tdfunc.value_and_grad(split_loss)(trainable, frozen, task_batch(gen))
        updates, opt_state = opt.update(grads, opt_state, trainable)
        trainable = optim.apply_updates(trainable, updates)
    tuned = frozen.update(trainable)
    assert same_bits(tuned.exclude(*trainable.keys(True, True)), frozen)
    # the embedding was trained, and the output layer with it: they are one leaf
    assert not torch.equal(
        tuned["transformer", "wte", "weight"], base["transformer", "wte", "weight"]
    )
    assert tied(model, tuned)
    # --8<-- [end:freeze]
    print(
        f"freeze by pattern: {len(trainable.keys(True, True))} of {len(base.keys(True, True))} "
        f"leaves trained (LayerNorms and the tied embedding); held-out loss {base_loss:.3f} -> "
        f"{lm_loss(model, tuned, eval_ids).item():.3f}; the other leaves bit-unchanged"
    )

    # the same freeze in the optimizer: gradients for every leaf, zero updates for the frozen
    # --8<-- [start:freeze-opt]
    attention_only = optim.multi_transform(
        {"train": optim.adam(lr=1e-2), "frozen": optim.set_to_zero()},
        {"*.attn.*": "train", "*": "frozen"},
    )
    params, opt_state = base, attention_only.init(base)
    loss, grads = tdfunc.value_and_grad(lm_loss, argnums=1)(model, params, task_batch(gen))
    updates, opt_state = attention_only.update(grads, opt_state, params)
    params = optim.apply_updates(params, updates)
    attention, rest = params.split_keys(matching("*.attn.*"))
    assert same_bits(rest, base.exclude(*attention.keys(True, True)))
    assert tied(model, params)
    # --8<-- [end:freeze-opt]
    changed = sum(not torch.equal(params[k], base[k]) for k in attention.keys(True, True))
    print(
        f"freeze in the optimizer: {changed} attention leaves updated, "
        f"{len(rest.keys(True, True))} other leaves bit-unchanged"
    )
    assert same_bits(base, snapshot)
    print(f"done in {time.perf_counter() - start:.1f} s; the base was never written")


if __name__ == "__main__":
    main()
