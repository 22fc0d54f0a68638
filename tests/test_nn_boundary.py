"""Where ``functional_call`` meets torch: failures, exports, transforms, files and ties.

The module zoo (``test_nn_zoo.py``) checks the values of each kind of stateful module in every
mode; these are the cases around it: a call that raises, a returned view of a buffer, non-strict
export, ensembles under ``grad``, memory-mapped parameters, and tied weights through training,
saving and loading.
"""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc.nn import _errors as E


class Explodes(nn.Module):
    """Writes a buffer, creates one, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        self.cache = x.sum(0)
        self.register_buffer("extra", torch.ones(1))
        raise RuntimeError("boom")


def _objects(m: nn.Module) -> list[tuple[str, torch.Tensor | None]]:
    out: list[tuple[str, torch.Tensor | None]] = []
    for name, sub in m.named_modules(remove_duplicate=False):
        out += [(f"{name}.{k}", t) for k, t in sub._parameters.items()]
        out += [(f"{name}.{k}", t) for k, t in sub._buffers.items()]
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_module_left_as_it_was_when_the_call_raises(compiled: bool) -> None:
    m = Explodes()
    before = _objects(m)
    versions = [(n, t._version) for n, t in before if t is not None]
    state = tdfunc.from_module(m).detach().clone()
    fn = lambda s: tdfunc.functional_call(m, s, (torch.ones(2, 3),))  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="eager")
    with pytest.raises(RuntimeError, match="boom"):
        fn(state)
    after = _objects(m)
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(a is b for (_, a), (_, b) in zip(after, before))
    assert [(n, t._version) for n, t in after if t is not None] == versions
    assert "extra" not in m._buffers
    assert m.cache is None
    assert m.count.item() == 0
    assert state["count"].item() == 0


class Slicer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(6.0).reshape(3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[1:]


def test_returned_view_of_a_buffer_is_a_plain_tensor_that_torch_load_reads() -> None:
    m = Slicer()
    out = tdfunc.functional_call(m, tdfunc.from_module(m) * 2, (torch.ones(1),))
    assert type(out) is torch.Tensor
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    back = torch.load(buf)  # weights_only=True by default
    assert torch.equal(back, torch.tensor([[4.0, 6.0], [8.0, 10.0]]))


class SetsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("last", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.data = x.mean(0).detach()
        return self.lin(x).sum()


def test_set_data_is_reported_eagerly_and_refused_under_grad() -> None:
    m = SetsData()
    state = tdfunc.from_module(m)
    x = torch.randn(4, 3)
    _, new = tdfunc.functional_call(m, state, (x,), return_state=True)
    torch.testing.assert_close(new["last"], x.mean(0))
    assert state["last"].abs().sum().item() == 0
    assert m.last.abs().sum().item() == 0
    with pytest.raises(PermissionError):
        tdfunc.functional_call(m, state, (x,))

    # inside a transform the module's copies are the transform's tensors, and torch refuses
    # ``.data = v`` on them with its own error (instead of losing or corrupting the write)
    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        out, _ = tdfunc.functional_call(m, (p, state.exclude("lin")), (x,), return_state=True)
        return out

    with pytest.raises(RuntimeError, match=r"\.data` inside functorch transform"):
        torch.func.grad(loss)(state.select("lin"))
    assert state["last"].abs().sum().item() == 0


def test_non_strict_export() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    state = tdfunc.from_module(net).detach().clone()

    class Step(nn.Module):
        def forward(self, s: tdfunc.TensorDict, x: torch.Tensor):  # type: ignore[no-untyped-def]
            return tdfunc.functional_call(net, s, (x,), return_state=True)

    x = torch.randn(8, 3)
    for strict in (False, True):
        ep = torch.export.export(Step(), (state, x), strict=strict)
        out, new = ep.module()(state, x)
        ref = copy.deepcopy(net)
        torch.testing.assert_close(out, ref(x))
        tdfunc.testing.assert_close(new, tdfunc.from_module(ref), rtol=1e-5, atol=1e-6)
        assert state["1", "num_batches_tracked"].item() == 0


def test_ensemble_training_step_prints_no_fallback_warning(
    capfd: pytest.CaptureFixture[str],
) -> None:
    nets = [nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(4)]
    params = tdfunc.stack_modules(nets)
    x, y = torch.randn(5, 3), torch.randn(5, 1)

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return ((tdfunc.functional_call(nets[0], p, (x,)) - y) ** 2).mean()

    step = torch.vmap(torch.func.grad(loss))
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = step(params)
        torch.compile(step, backend="aot_eager", fullgraph=True)(params)
    # torch prints its batching-rule fallback warning from C++ (stderr), once per process
    printed = capfd.readouterr().err
    assert "batching rule" not in printed
    assert [str(w.message) for w in caught if "batching rule" in str(w.message)] == []
    for i, net in enumerate(nets):
        net.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        torch.testing.assert_close(grads["0", "weight"][i], net[0].weight.grad)


def test_grad_through_memory_mapped_parameters(tmp_path: Path) -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    tdfunc.save_safetensors(tdfunc.from_module(net), tmp_path / "w.safetensors")
    loaded = tdfunc.load_safetensors(tmp_path / "w.safetensors")
    assert any(isinstance(t, tdfunc.MemoryMappedTensor) for t in loaded.leaves())
    x = torch.randn(5, 3)

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return tdfunc.functional_call(net, p, (x,)).sum()

    grads = torch.func.grad(loss)(loaded)
    net(x).sum().backward()
    torch.testing.assert_close(grads["0", "weight"], net[0].weight.grad)
    assert all(type(g) is torch.Tensor for g in grads.leaves())


class TinyLM(nn.Module):
    """An embedding and an output head sharing one weight (GPT-2's tie)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(11, 4)
        self.mix = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.mix(self.wte(idx))))


def _lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 11), idx.reshape(-1))


def test_tied_weights_train_as_one_tensor(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = TinyLM()
    ref = copy.deepcopy(net)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    params = tdfunc.from_module(net).detach()
    assert sorted(params.flatten_keys(".").keys()) == ["mix.bias", "mix.weight", "wte.weight"]
    idx = torch.randint(0, 11, (3, 5))

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return _lm_loss(tdfunc.functional_call(net, p, (idx,)), idx)

    for _ in range(3):
        grads = torch.func.grad(loss)(params)
        params = params - 0.5 * grads
        opt.zero_grad()
        _lm_loss(ref(idx), idx).backward()
        opt.step()
    torch.testing.assert_close(params["wte", "weight"], ref.wte.weight.detach())
    # every name back, one tensor per tie: the module loads it and keeps the tie
    full = tdfunc.state_dict(net, params)
    assert list(full) == list(net.state_dict())
    assert full["lm_head.weight"] is full["wte.weight"]
    fresh = TinyLM()
    fresh.load_state_dict(full)
    assert fresh.lm_head.weight is fresh.wte.weight
    torch.testing.assert_close(fresh(idx), ref(idx))
    # save / load keep one value per tie
    tdfunc.save(params, tmp_path / "store")
    back = tdfunc.load(tmp_path / "store")
    tdfunc.testing.assert_close(back, params)
    # a file for other tools has every name
    tdfunc.save_safetensors(tdfunc.TensorDict(full), tmp_path / "full.safetensors")
    from safetensors.torch import load_file

    other = load_file(tmp_path / "full.safetensors")
    assert sorted(other) == sorted(net.state_dict())
    torch.testing.assert_close(other["lm_head.weight"], other["wte.weight"])


def test_two_tensors_for_one_tie_are_refused() -> None:
    net = TinyLM()
    state = dict(net.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] * 2  # another tensor under the tied name
    expected = E.TIED_TWICE.format(key="lm_head.weight", first="wte.weight")
    with pytest.raises(ValueError, match="tied weights") as info:
        tdfunc.functional_call(net, state, (torch.tensor([1, 2]),))
    assert str(info.value) == expected
    # the same tensor under both names is fine (state_dict() gives one alias per name), and
    # so is tie_weights=False
    same = dict(net.state_dict())
    assert same["lm_head.weight"] is not same["wte.weight"]
    tdfunc.functional_call(net, same, (torch.tensor([1, 2]),))
    tdfunc.functional_call(net, state, (torch.tensor([1, 2]),), tie_weights=False)


def test_state_created_without_return_state_is_refused() -> None:
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.cache = x.sum(0)
            return x

    m = Grows()
    with pytest.raises(PermissionError) as info:
        tdfunc.functional_call(m, tdfunc.TensorDict(), (torch.ones(2, 3),))
    assert str(info.value) == E.STATE_CREATED.format(key="cache", cls="Grows")
    _, new = tdfunc.functional_call(m, {}, (torch.ones(2, 3),), return_state=True)
    assert list(new) == ["cache"]
    assert m.cache is None
    with pytest.raises(TypeError) as info2:
        tdfunc.functional_call(m, (), (torch.ones(2, 3),), return_state=True)
    assert str(info2.value) == E.STATE_NO_ROOM.format(key="cache", typ="tuple")


def test_state_dict_of_a_module_and_a_state() -> None:
    lin = nn.Linear(2, 2)
    net = nn.Sequential(lin, nn.ReLU(), lin)
    assert tdfunc.state_dict(net) == dict(net.state_dict(keep_vars=True))
    zero = tdfunc.from_module(net) * 0
    sd = tdfunc.state_dict(net, zero)
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sd["2.weight"] is sd["0.weight"] is zero["0", "weight"]
    # the state's shapes are its own; a state stacked over modules is refused
    assert tdfunc.state_dict(net, {"0.weight": torch.zeros(3, 3)})["2.weight"].shape == (3, 3)
    with pytest.raises(ValueError, match="stacked over 4 modules"):
        tdfunc.state_dict(net, {"0.weight": torch.zeros(4, 2, 2)})


def test_compiled_call_runs_the_same_kernels_as_torch_func() -> None:
    """Inductor: no copy or extra call for tensors the module does not write."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    state = tdfunc.from_module(m).detach().clone()
    flat = {k: v.detach().clone() for k, v in m.named_parameters()}
    x = torch.randn(4, 8)

    def calls(fn, p):  # type: ignore[no-untyped-def]
        torch._dynamo.reset()
        with torch.no_grad():
            out, code = run_and_get_code(torch.compile(fn, fullgraph=True), p, x)
        body = code[0].split("def call(")[1]
        lines = [ln.strip() for ln in body.splitlines() if not ln.strip().startswith("#")]
        ops = re.findall(
            r"(extern_kernels\.\w+|cpp_fused_\w+|torch\.ops\.[\w.]+)", "\n".join(lines)
        )
        return out, ops

    ours, our_ops = calls(lambda p, x: tdfunc.functional_call(m, p, (x,)), state)
    theirs, their_ops = calls(lambda p, x: torch.func.functional_call(m, p, (x,)), flat)
    torch.testing.assert_close(ours, theirs)
    assert our_ops == their_ops
    assert our_ops  # the graph did run kernels


def test_gpt2_tied_head_trains_as_one_tensor() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    torch.manual_seed(0)
    net = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(net)
    params = tdfunc.from_module(net, buffers=False).detach()
    assert "lm_head" not in params  # the head is the token embedding
    ids = torch.randint(0, 32, (2, 8))

    def loss(p: tdfunc.TensorDict) -> torch.Tensor:
        return tdfunc.functional_call(net, p, (ids,), {"labels": ids}).loss

    grads = torch.func.grad(loss)(params)
    ref(ids, labels=ids).loss.backward()
    # the embedding's gradient holds both uses (input embedding and output head)
    torch.testing.assert_close(
        grads["transformer", "wte", "weight"], ref.transformer.wte.weight.grad, rtol=1e-4, atol=1e-6
    )
    new = params - 0.1 * grads
    full = tdfunc.state_dict(net, new)
    assert full["lm_head.weight"] is full["transformer.wte.weight"]
    fresh = transformers.GPT2LMHeadModel(config)
    fresh.load_state_dict(full)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
