"""optim.step: torch's fused kernels eagerly (pure on copies, or in place on donated
buffers), update + apply_updates when traced; and scalars computed once per compiled step."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import optim
from tdfunc._donate import is_consumed
from tdfunc.optim import _errors as OE
from tdfunc.optim._step import fused_of


def make(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    params = tdfunc.TensorDict(
        {
            "layer": {
                "weight": torch.randn(5, 4, generator=g),
                "bias": torch.randn(5, generator=g),
            },
            "out": torch.randn(3, 5, generator=g),
        }
    ).to(dtype)
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g, dtype=dtype))
    return params, grads


def reference(opt: Any, params: Any, grads: Any, steps: int) -> tuple[Any, Any]:
    state = opt.init(params)
    for _ in range(steps):
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


OPTIMIZERS = {
    "adamw": lambda: optim.adamw(lr=0.05),
    "adamw_amsgrad_maximize": lambda: optim.adamw(lr=0.05, amsgrad=True, maximize=True),
    "adam_l2": lambda: optim.adam(lr=0.05, weight_decay=0.1),
    "adamw_mask_tensor_lr": lambda: optim.adamw(
        lr=torch.tensor(0.05), weight_decay=0.3, mask=lambda path, p: p.ndim >= 2
    ),
    "adamw_schedule": lambda: optim.adamw(lr=optim.warmup_cosine_decay(0.1, 2, 6)),
    "sgd": lambda: optim.sgd(lr=0.1),
    "sgd_nesterov": lambda: optim.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda: optim.sgd(lr=0.1, momentum=0.5, dampening=0.3, maximize=True),
    "adagrad": lambda: optim.adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01),
    "chain_clip_adamw": lambda: optim.chain(
        optim.clip_by_global_norm(0.5), optim.adamw(lr=0.05, mask="*.weight")
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("donate", [False, True])
def test_fused_step_matches_update(name: str, donate: bool) -> None:
    opt = OPTIMIZERS[name]()
    assert fused_of(opt) is not None
    params, grads = make(torch.float64)
    ref_params, ref_state = reference(opt, params, grads, 4)
    p, s = params.clone(), opt.init(params)
    before_p, before_s = p.clone(), s.clone()
    first_p, first_s, out_leaf = p, s, p["out"]
    for _ in range(4):
        new_p, new_s = optim.step(opt, grads, s, p, donate=donate)
        assert is_consumed(p) == donate
        assert is_consumed(s) == donate
        p, s = new_p, new_s
    # a float32 tensor lr: the update path rounds lr * weight_decay to float32
    tol = 1e-7 if "tensor_lr" in name else 1e-12
    tdfunc.testing.assert_close(p, ref_params, rtol=tol, atol=tol * 1e-2)
    tdfunc.testing.assert_close(s, ref_state, rtol=tol, atol=tol * 1e-2)
    assert p.batch_size == params.batch_size
    assert not p["out"].requires_grad
    assert (p["out"] is out_leaf) == donate
    if not donate:  # pure: the first inputs hold their values
        tdfunc.testing.assert_close(first_p, before_p, rtol=0, atol=0)
        tdfunc.testing.assert_close(first_s, before_s, rtol=0, atol=0)


def test_donated_step_reuses_the_buffers_and_equals_the_pure_step() -> None:
    opt = optim.adamw(lr=0.05)
    params, grads = make()
    state = opt.init(params)
    pure_p, pure_s = optim.step(opt, grads, state, params)
    w, m = params["layer", "weight"], state["adamw", "exp_avg", "layer.weight"]
    inner = params["layer"]
    new_p, new_s = optim.step(opt, grads, state, params, donate=True)
    assert new_p["layer", "weight"] is w
    assert new_s["adamw", "exp_avg", "layer.weight"] is m
    tdfunc.testing.assert_close(new_p, pure_p, rtol=0, atol=0)
    tdfunc.testing.assert_close(new_s, pure_s, rtol=0, atol=0)
    expected = OE.DONATED_TO_STEP.format(arg="params")
    for use in (
        lambda: params["out"],
        lambda: inner["bias"],
        lambda: optim.step(opt, grads, state, new_p),
    ):
        with pytest.raises(tdfunc.DonatedError) as info:
            use()
        assert "was donated to optim.step" in str(info.value)
    with pytest.raises(tdfunc.DonatedError) as info:
        params["out"]
    assert str(info.value) == expected


def test_fused_adamw_equals_torch_fused_adamw_bit_for_bit() -> None:
    params, grads = make()
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    ps = [p.clone() for p in params.values(True, True)]
    for p, g in zip(ps, grads.values(True, True)):
        p.grad = g.clone()
    topt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True)
    p, s = params, opt.init(params)
    for _ in range(5):
        topt.step()
        p, s = optim.step(opt, grads, s, p)
    for ours, theirs in zip(p.values(True, True), ps):
        assert torch.equal(ours, theirs)


def test_fallbacks_when_no_kernel_fits() -> None:
    params, grads = make(torch.float64)
    # no fused kernel: rmsprop; per-member lr; batch dims (an ensemble); mixed dtypes
    cases = [
        (optim.rmsprop(lr=0.01), params, grads),
        (optim.adamw(lr=torch.tensor([0.1, 0.2])), *(x.expand(2) for x in (params, grads))),
        (optim.sgd(lr=0.1, momentum=0.9), *(x.expand(2) for x in (params, grads))),
        (
            optim.adamw(lr=0.1),
            params.set("out", params["out"].float()),
            grads.set("out", grads["out"].float()),
        ),
    ]
    for opt, p, g in cases:
        ref_p, ref_s = reference(opt, p, g, 2)
        p1, s1 = p, opt.init(p)
        for _ in range(2):
            p1, s1 = optim.step(opt, g, s1, p1)
        tdfunc.testing.assert_close(p1, ref_p, rtol=1e-6, atol=1e-7)
        tdfunc.testing.assert_close(s1, ref_s, rtol=1e-6, atol=1e-7)
    # and under torch.vmap
    opt = optim.adam(lr=0.1)
    ens_p, ens_g = params.expand(3).clone(), grads.expand(3).clone()
    st = torch.vmap(opt.init)(ens_p)
    got = torch.vmap(lambda g, s, p: optim.step(opt, g, s, p))(ens_g, st, ens_p)
    ref = torch.vmap(lambda g, s, p: reference_step(opt, g, s, p))(ens_g, st, ens_p)
    tdfunc.testing.assert_close(got[0], ref[0])


def reference_step(opt: Any, g: Any, s: Any, p: Any) -> tuple[Any, Any]:
    u, s = opt.update(g, s, p)
    return optim.apply_updates(p, u), s


def test_donated_fallback_writes_in_place_too() -> None:
    opt = optim.rmsprop(lr=0.01, momentum=0.9)
    params, grads = make()
    pure = optim.step(opt, grads, opt.init(params), params)
    state = opt.init(params)
    w = params["out"]
    new_p, _new_s = optim.step(opt, grads, state, params, donate=True)
    assert new_p["out"] is w
    assert is_consumed(params)
    assert is_consumed(state)
    tdfunc.testing.assert_close(new_p, pure[0], rtol=0, atol=0)


def test_requires_grad_params_step_without_autograd() -> None:
    model = torch.nn.Linear(4, 2)
    params = tdfunc.from_module(model)
    grads = params.apply(torch.ones_like).detach()
    opt = optim.adamw(lr=0.1)
    new_p, _ = optim.step(opt, grads, opt.init(params), params)
    assert not new_p["weight"].requires_grad
    assert new_p["weight"].grad_fn is None
    assert torch.equal(params["weight"], model.weight)  # the module is left as it was
    p2, _ = optim.step(opt, grads, opt.init(params), params, donate=True)
    assert p2["weight"] is model.weight  # donated: written in place, as torch.optim does


def test_compiled_step_is_one_graph_without_recompiles() -> None:
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(lr=torch.tensor(0.05)))

    def train(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        return optim.step(opt, g, s, p)

    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(train, backend=cnt, fullgraph=True)
    params, grads = make()
    p, s = params, opt.init(params)
    pe, se = params, opt.init(params)
    for _ in range(3):
        p, s = f(grads, s, p)
        pe, se = train(grads, se, pe)
    tdfunc.testing.assert_close(p, pe, rtol=1e-5, atol=1e-6)
    assert cnt.frame_count == 1


def test_donate_inside_a_compiled_function_is_refused() -> None:
    opt = optim.adamw()
    params, grads = make()
    state = opt.init(params)
    f = torch.compile(
        lambda g, s, p: optim.step(opt, g, s, p, donate=True), backend="eager", fullgraph=True
    )
    with pytest.raises(Exception, match=re.escape("tdfunc.compile(fn, donate=...)")):
        f(grads, state, params)
    assert not is_consumed(params)


def test_bad_inputs() -> None:
    params, grads = make()
    opt = optim.adamw()
    state = opt.init(params)
    with pytest.raises(TypeError, match=r"optim\.step"):
        optim.step(lambda: None, grads, state, params)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a TensorDict or a tensorclass"):
        optim.step(opt, {"a": 1}, state, params)
    with pytest.raises(optim.OptimStateError):
        optim.step(opt, grads, optim.sgd().init(params), params)
    with pytest.raises(tdfunc.StructureError):
        optim.step(opt, grads.exclude("out"), state, params)
    with pytest.raises(
        ValueError,
        match=r"params, key 'layer\.weight' shares memory with grads, key 'layer\.weight'",
    ):
        optim.step(opt, params, state, params, donate=True)
    assert not is_consumed(params)
    assert not is_consumed(state)


def test_memory_mapped_params_are_not_donated(tmp_path: Any) -> None:
    params, grads = make()
    tdfunc.save(params, tmp_path / "p")
    loaded = tdfunc.load(tmp_path / "p")
    opt = optim.sgd(lr=0.1)
    state = opt.init(loaded)
    with pytest.raises(PermissionError, match="memory-mapped"):
        optim.step(opt, grads, state, loaded, donate=True)
    new_p, _ = optim.step(opt, grads, state, loaded)  # pure: fine, the file is not written
    tdfunc.testing.assert_close(tdfunc.load(tmp_path / "p").clone(), params, rtol=0, atol=0)
    tdfunc.testing.assert_close(new_p, optim.apply_updates(params, grads * -0.1))


def test_an_eager_step_does_not_import_dynamo() -> None:
    code = (
        "import sys, torch, tdfunc\n"
        "from tdfunc import optim\n"
        "p = tdfunc.TensorDict(w=torch.ones(3))\n"
        "opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw())\n"
        "s = opt.init(p)\n"
        "p2, s = optim.step(opt, p, s, p)\n"
        "p3, s = optim.step(opt, p, s, p2, donate=True)\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "f = torch.compile(lambda g, s, p: optim.step(opt, g, s, p), backend='eager',"
        " fullgraph=True)\n"
        "p4, _ = f(p, s, p3)\n"
        "print('ok', round(float(p4['w'][0]), 6))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok")


def loop_bodies(source: str) -> list[str]:
    """The bodies of the ``for`` loops of generated C++ (brace matched, nested ones too)."""
    bodies = []
    for m in re.finditer(r"for\(", source):
        start = source.index("{", m.end())
        depth, end = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(source[end], 0)
            if depth == 0:
                break
            end += 1
        bodies.append(source[start:end])
    return bodies


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optim.adamw(lr=1e-3),
        lambda: optim.chain(
            optim.clip_by_global_norm(1.0),
            optim.scale_by_schedule(optim.cosine_decay(1.0, 100)),
            optim.adamw(lr=optim.warmup_cosine_decay(0.1, 10, 100)),
        ),
        lambda: optim.sgd(lr=optim.cosine_decay(0.1, 100), momentum=0.9),
    ],
    ids=["adamw", "chain_schedules", "sgd_schedule"],
)
def test_inductor_computes_step_scalars_once_per_step(make_opt: Any) -> None:
    """Bias corrections and schedule values are computed before the loops over the
    elements, not again for every vector of them."""
    from torch._inductor.utils import run_and_get_code

    opt = make_opt()
    params, grads = make()

    def train(g: Any, s: Any, p: Any) -> tuple[Any, Any]:
        return optim.step(opt, g, s, p)

    (p, _), code = run_and_get_code(
        torch.compile(train, backend="inductor", fullgraph=True), grads, opt.init(params), params
    )
    ref, _ = train(grads, opt.init(params), params)
    tdfunc.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)
    source = "\n".join(code)
    assert re.search(r"std::(exp|cos)\b", source), "the step scalars are not in the kernel"
    bodies = loop_bodies(source)
    assert bodies, "no loop in the generated code"
    for body in bodies:
        assert not re.search(r"std::(pow|exp|log|cos|sin)\b", body), body[:2000]


# ------------------------------------------------------------ the plan of a donated loop
class FullSteps:
    """Counts the steps that take the full path (every check) instead of the plan."""

    def __init__(self, monkeypatch: Any) -> None:
        from tdfunc.optim import _step

        self.n, real = 0, _step._full_step

        def counted(*args: Any) -> Any:
            self.n += 1
            return real(*args)

        monkeypatch.setattr(_step, "_full_step", counted)


PLANNED = {
    "adamw_tensor_lr_mask": lambda: optim.adamw(
        lr=torch.tensor(0.05), weight_decay=0.3, mask=lambda path, p: p.ndim >= 2
    ),
    "adamw_schedule": lambda: optim.adamw(lr=optim.warmup_cosine_decay(0.1, 2, 6)),
    "sgd_momentum": lambda: optim.sgd(lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_plain": lambda: optim.sgd(lr=0.1),
    "adagrad": lambda: optim.adagrad(lr=0.1, lr_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_a_donated_loop_is_checked_once_then_follows_its_plan(name: str, monkeypatch: Any) -> None:
    opt = PLANNED[name]()
    params, grads = make()
    pure_p, pure_s = params.clone(), opt.init(params)
    p, s = params.clone(), opt.init(params)
    leaf, full = p["layer", "weight"], FullSteps(monkeypatch)
    for i in range(6):
        g = grads * (i + 1)  # new grads every step, as from autograd
        pure_p, pure_s = optim.step(opt, g, pure_s, pure_p)
        old_p, old_s = p, s
        p, s = optim.step(opt, g, s, p, donate=True)
        assert is_consumed(old_p)
        assert is_consumed(old_s)
        assert not is_consumed(g)
        tdfunc.testing.assert_close(p, pure_p, rtol=0, atol=0)
        tdfunc.testing.assert_close(s, pure_s, rtol=0, atol=0)
    assert p["layer", "weight"] is leaf  # written in place all along
    assert full.n == 1 + 6  # the pure steps, and the first donated one
    with pytest.raises(tdfunc.DonatedError, match=r"was donated to optim\.step"):
        optim.step(opt, grads, old_s, p, donate=True)


def test_a_chain_takes_the_full_path_every_step(monkeypatch: Any) -> None:
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(lr=0.05))
    params, grads = make()
    p, s = params.clone(), opt.init(params)
    full = FullSteps(monkeypatch)
    for _ in range(3):
        p, s = optim.step(opt, grads, s, p, donate=True)
    assert full.n == 3
    ref_p, _ = reference(opt, params, grads, 3)
    tdfunc.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-8)


def _planned_loop() -> tuple[Any, Any, Any, Any]:
    opt = optim.adamw(lr=torch.tensor(0.05), weight_decay=0.1)
    params, grads = make()
    p, s = params.clone(), opt.init(params)
    for _ in range(2):
        p, s = optim.step(opt, grads, s, p, donate=True)
    return opt, grads, p, s


def test_the_plan_sees_writes_and_follows_them(monkeypatch: Any) -> None:
    opt, grads, p, s = _planned_loop()
    twin_p, twin_s = p.clone(), s.clone()
    full = FullSteps(monkeypatch)
    p["out"].add_(1.0)  # an in-place write between steps (version counter)
    twin_p["out"].add_(1.0)
    s["adamw", "exp_avg", "layer.bias"].zero_()
    twin_s["adamw", "exp_avg", "layer.bias"].zero_()
    p, s = optim.step(opt, grads, s, p, donate=True)
    twin_p, twin_s = optim.step(opt, grads, twin_s, twin_p)
    assert full.n == 2  # the write sent the donated step down the full path
    tdfunc.testing.assert_close(p, twin_p, rtol=0, atol=0)
    tdfunc.testing.assert_close(s, twin_s, rtol=0, atol=0)
    p, s = optim.step(opt, grads, s, p, donate=True)
    assert full.n == 2  # and the full path made a new plan


def test_the_plan_sees_a_swapped_tensor_that_aliases(monkeypatch: Any) -> None:
    opt, grads, p, s = _planned_loop()
    full = FullSteps(monkeypatch)
    with torch.no_grad():  # no version bump: only the data address tells
        p["out"].data = s["adamw", "exp_avg", "out"]
    with pytest.raises(
        ValueError, match=r"state, key 'adamw\.exp_avg\.out' and params, key 'out' share memory"
    ):
        optim.step(opt, grads, s, p, donate=True)
    assert full.n == 1
    assert not is_consumed(p)
    assert not is_consumed(s)


def test_the_plan_sees_grads_that_alias_the_params(monkeypatch: Any) -> None:
    opt, _, p, s = _planned_loop()
    full = FullSteps(monkeypatch)
    with pytest.raises(ValueError, match=r"shares memory with grads, key 'layer\.weight'"):
        optim.step(opt, p, s, p, donate=True)
    view = p.apply(lambda x: x[:])  # a view of the same storage, another container
    with pytest.raises(ValueError, match="shares memory with grads"):
        optim.step(opt, view, s, p, donate=True)
    assert full.n == 2
    assert not is_consumed(p)
    assert not is_consumed(s)


def test_the_plan_sees_other_containers(monkeypatch: Any) -> None:
    opt, grads, p, s = _planned_loop()
    full = FullSteps(monkeypatch)
    # a new state with a new learning rate: another container, the full path, the new lr
    s2 = optim.set_hyperparams(s, lr=0.5)
    twin_p, twin_s = optim.step(opt, grads, s2.clone(), p.clone())
    p2, s3 = optim.step(opt, grads, s2, p, donate=True)
    tdfunc.testing.assert_close(p2, twin_p, rtol=0, atol=0)
    tdfunc.testing.assert_close(s3, twin_s, rtol=0, atol=0)
    assert full.n == 2
    # the same leaves under other names: the state does not belong to them
    renamed = tdfunc.TensorDict(a=p2["layer", "weight"], b=p2["layer", "bias"], c=p2["out"])
    g_renamed = tdfunc.TensorDict(
        a=grads["layer", "weight"], b=grads["layer", "bias"], c=grads["out"]
    )
    with pytest.raises(optim.OptimStateError):
        optim.step(opt, g_renamed, s3, renamed, donate=True)
    assert full.n == 3
    # the same leaves in a state of another optimizer: refused by the full path
    wrong = tdfunc.TensorDict({"adam": s3["adamw"]})
    with pytest.raises(optim.OptimStateError, match="adam"):
        optim.step(opt, grads, wrong, p2, donate=True)
    # a structure mismatch still names the keys
    with pytest.raises(tdfunc.StructureError):
        optim.step(opt, grads.exclude("out"), s3, p2, donate=True)


def test_the_plan_keeps_nothing_alive() -> None:
    import gc
    import weakref

    opt, grads, p, s = _planned_loop()
    leaf = weakref.ref(p["out"])
    state_ref = weakref.ref(s)
    del p, s
    gc.collect()
    assert leaf() is None
    assert state_ref() is None
    params, _ = make()
    p, _s = optim.step(opt, grads, opt.init(params), params.clone(), donate=True)
    assert p["out"].shape == (3, 5)


def test_consumed_grads_are_refused_on_the_planned_path() -> None:
    opt, grads, p, s = _planned_loop()
    g = grads.clone()
    other_opt = optim.sgd(lr=0.1)
    optim.step(other_opt, grads, other_opt.init(g), g, donate=True)  # consumes g
    with pytest.raises(tdfunc.DonatedError):
        optim.step(opt, g, s, p, donate=True)
    assert not is_consumed(p)
    assert not is_consumed(s)


def test_the_plan_walks_each_new_grads_container(monkeypatch: Any) -> None:
    opt, grads, p, s = _planned_loop()
    full = FullSteps(monkeypatch)
    ref_p, ref_s = p.clone(), s.clone()
    for _ in range(3):  # new grads containers every step (as value_and_grad returns)
        g = grads.apply(lambda x: x.clone())
        p, s = optim.step(opt, g, s, p, donate=True)
        u, ref_s = opt.update(g, ref_s, ref_p)
        ref_p = optim.apply_updates(ref_p, u)
    assert full.n == 0
    tdfunc.testing.assert_close(p, ref_p, rtol=1e-6, atol=1e-7)
    tdfunc.testing.assert_close(s, ref_s, rtol=1e-6, atol=1e-7)
    # the same leaves and names, another nesting: the plan's structure walk refuses it, and
    # the full path names the keys
    flat = tdfunc.TensorDict(
        {"layer.weight": grads["layer", "weight"], "layer.bias": grads["layer", "bias"]},
        out=grads["out"],
    )
    with pytest.raises(tdfunc.StructureError):
        optim.step(opt, flat, s, p, donate=True)
    assert full.n == 1
    assert not is_consumed(p)
    # the same leaves in another params container of the same structure: planned
    p2 = p.apply(lambda x: x)
    p3, s = optim.step(opt, grads, s, p2, donate=True)
    assert full.n == 1
    assert p3["out"] is p["out"]
