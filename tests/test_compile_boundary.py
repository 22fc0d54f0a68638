"""What crosses tdfunc.compile's boundary: jagged leaves as their parts (one compile across
lengths, a compile that torch's caches keep), per-sample values as row ids (one compile
across new values). Every result is checked against the same function run eagerly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc._jagged import _boundary as boundary
from tdfunc._nontensor import PER_SAMPLE_COMPILED, PER_SAMPLE_COMPILED_MIX, NonTensor

ROOT = Path(__file__).resolve().parents[1]


def jagged(lengths: list[int], feat: int = 4, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, feat, generator=g) for n in lengths]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def batch(seed: int, size: int = 8, low: int = 1, high: int = 64) -> Any:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (size,), generator=g).tolist()
    return tdfunc.TensorDict(
        tokens=jagged(lengths, seed=seed), y=torch.randn(size, generator=g), batch_size=[size]
    )


def same_jagged(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.is_nested
    assert b.is_nested
    assert torch.equal(a.offsets(), b.offsets())
    torch.testing.assert_close(a.values(), b.values())


def compiled(fn: Any, mode: str, **kw: Any) -> tuple[Any, CompileCounterWithBackend]:
    cnt = CompileCounterWithBackend("eager")
    if mode == "eager":
        return tdfunc.compile(fn, disable=True, **kw), cnt
    return tdfunc.compile(fn, backend=cnt, fullgraph=True, **kw), cnt


# --------------------------------------------------------------------------------------
# jagged leaves
# --------------------------------------------------------------------------------------
def forward(w: Any, b: Any) -> tuple[Any, torch.Tensor]:
    h = (b["tokens"] * w["scale"]).sin()
    return b.set("tokens", h), (h.values() ** 2).sum() + b["y"].sum()


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_jagged_epoch_compiles_once_with_eager_values(mode: str) -> None:
    w = tdfunc.TensorDict(scale=torch.linspace(0.5, 1.5, 4))
    fn, cnt = compiled(forward, mode)
    for seed in range(20):  # an epoch of random lengths 1..64
        b = batch(seed)
        out, loss = fn(w, b)
        ref, ref_loss = forward(w, b)
        torch.testing.assert_close(loss, ref_loss)
        same_jagged(out["tokens"], ref["tokens"])  # a jagged output comes back jagged
        assert torch.equal(out["y"], b["y"])
    assert cnt.frame_count == (1 if mode == "compiled" else 0)


def loss_fn(w: Any, b: Any) -> torch.Tensor:
    h = (b["tokens"] * w["scale"] + w["bias"]).tanh()
    return (h.values() ** 2).mean() + (b["y"] * w["scale"].sum()).sum()


def vg_step(w: Any, b: Any) -> tuple[torch.Tensor, Any]:
    return tdfunc.value_and_grad(loss_fn)(w, b)


def autograd_step(w: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w["scale"].detach().requires_grad_(True)
    with torch.enable_grad():
        loss = loss_fn(w.set("scale", scale), b)
        (g,) = torch.autograd.grad(loss, scale)
    return loss.detach(), g


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_jagged_gradients_wrt_dense_params_equal_eager(mode: str) -> None:
    w = tdfunc.TensorDict(scale=torch.linspace(0.5, 1.5, 4), bias=torch.full((4,), 0.1))
    vg, cnt = compiled(vg_step, mode)
    ag, cnt2 = compiled(autograd_step, mode)
    for seed in range(4):
        b = batch(seed, size=4, high=16)
        value, grads = vg(w, b)
        ref_value, ref_grads = vg_step(w, b)
        torch.testing.assert_close(value, ref_value)
        torch.testing.assert_close(grads["scale"], ref_grads["scale"])
        torch.testing.assert_close(grads["bias"], ref_grads["bias"])
        loss, g = ag(w, b)
        torch.testing.assert_close(loss, ref_value)
        torch.testing.assert_close(g, ref_grads["scale"])
    if mode == "compiled":
        assert (cnt.frame_count, cnt2.frame_count) == (1, 1)


def test_jagged_leaf_with_lengths_crosses_and_equals_eager() -> None:
    def fn(b: Any) -> Any:
        return b.apply(lambda t: t * 2)

    f, cnt = compiled(fn, "compiled")
    for n in (3, 5, 9):
        base = jagged([n, n + 2, n + 1], seed=n)
        nt = torch.nested.narrow(
            base.values().new_ones(3, 12),
            1,
            torch.tensor([0, 1, 2]),
            torch.tensor([n, 2, 4]),
            layout=torch.jagged,
        )
        b = tdfunc.TensorDict(t=nt, batch_size=[3])
        out = f(b)["t"]
        ref = fn(b)["t"]
        assert out.lengths() is not None
        assert [r.tolist() for r in out.unbind()] == [r.tolist() for r in ref.unbind()]
    assert cnt.frame_count == 1


def test_jagged_inputs_are_left_as_they_were() -> None:
    b = batch(0)
    nt, y = b["tokens"], b["y"]
    keys = list(b.keys())
    crossing = boundary.enter((b,), {})
    assert crossing is not None
    crossed = crossing.args[0]
    assert crossed is not b
    assert crossed["tokens"].shape == nt.values().shape
    assert b["tokens"] is nt
    assert b["y"] is y
    assert list(b.keys()) == keys
    # the dynamic mark is on the crossing view, not on the caller's tensors
    assert not hasattr(nt.values()._base, "_dynamo_weak_dynamic_indices")
    out, _ = tdfunc.compile(forward, backend="eager")(tdfunc.TensorDict(scale=torch.ones(4)), b)
    assert b["tokens"] is nt
    assert out["tokens"] is not nt


def test_jagged_batch_beside_a_donated_state() -> None:
    def step(state: Any, b: Any) -> Any:
        return state.set("s", state["s"] + (b["tokens"] * 2).values().sum(0))

    f, cnt = compiled(step, "compiled", donate=0)
    state = tdfunc.TensorDict(s=torch.zeros(4))
    ref = tdfunc.TensorDict(s=torch.zeros(4))
    for seed in range(3):
        b = batch(seed, size=3, high=8)
        state, ref = f(state, b), step(ref, b)
        torch.testing.assert_close(state["s"], ref["s"])
    assert cnt.frame_count == 1


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_donated_jagged_leaf_holds_the_output(mode: str) -> None:
    def step(b: Any) -> Any:
        return b.set("t", b["t"] * 2)

    f, _ = compiled(step, mode, donate=0)
    nt = jagged([2, 4], feat=3)
    ref = step(tdfunc.TensorDict(t=nt.clone(), batch_size=[2]))["t"]
    values = nt.values()
    out = f(tdfunc.TensorDict(t=nt, batch_size=[2]))["t"]
    same_jagged(out, ref)
    assert out.values().data_ptr() == values.data_ptr()  # written into the donated buffer
    torch.testing.assert_close(values, ref.values())


_CACHE_CHILD = textwrap.dedent(
    """
    import json, torch, tdfunc
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    inductor_config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True

    def step(b):
        return (b["x"] * 2 + 1).sin()

    f = tdfunc.compile(step, backend="inductor", fullgraph=True)
    for n in (3, 5):
        nt = torch.nested.nested_tensor([torch.ones(n, 2), torch.ones(2, 2)], layout=torch.jagged)
        out = f(tdfunc.TensorDict(x=nt, batch_size=[2]))
        assert out.is_nested and torch.allclose(out.values(), (nt.values() * 2 + 1).sin())
    print(json.dumps({k: dict(v) for k, v in counters.items()
                      if k in ("inductor", "aot_autograd", "stats")}))
    """
)


@pytest.mark.slow
def test_jagged_step_compiles_from_cache_in_a_second_process(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _CACHE_CHILD],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        # no cache key torch could not pickle, no subclass without a stable hash
        assert "Failed to pickle" not in proc.stderr
        assert "_stable_hash_for_caching" not in proc.stderr
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["stats"]["unique_graphs"] == 1  # lengths 3 then 5: one compile
    assert first["inductor"].get("fxgraph_cache_hit", 0) == 0
    assert second["inductor"].get("fxgraph_cache_hit", 0) >= 1
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["aot_autograd"].get("autograd_cache_hit", 0) >= 1


# --------------------------------------------------------------------------------------
# per-sample values
# --------------------------------------------------------------------------------------
def texts(call: int, n: int) -> list[str]:
    return [f"call {call} row {i}" for i in range(n)]


def moves(td: Any, perm: torch.Tensor) -> tuple[Any, ...]:
    """A function that moves rows every way but never reads the text."""
    picked = td[perm]  # a permutation (index tensor)
    stacked = tdfunc.stack([td, picked], 1)
    a, b = td.split([2, 3])
    joined = tdfunc.cat([b, a])
    return picked * 2, stacked, joined, td[1], td[1:4], td[td["x"][:, 0] > 0], a


def check_same(out: Any, ref: Any) -> None:
    if isinstance(out, tuple):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            check_same(o, r)
        return
    assert out.batch_size == ref.batch_size
    assert list(out.keys()) == list(ref.keys())
    assert out["text"] == ref["text"]  # exactly the strings eager gives
    assert out.items()[1][1] == ref.items()[1][1]  # the NonTensor leaves themselves
    torch.testing.assert_close(out["x"], ref["x"])


def test_per_sample_text_never_recompiles_and_moves_with_the_rows() -> None:
    f, cnt = compiled(moves, "compiled")
    g = torch.Generator().manual_seed(0)
    for call in range(100):
        td = tdfunc.TensorDict(
            x=torch.randn(5, 2, generator=g), text=texts(call, 5), batch_size=[5]
        )
        perm = torch.randperm(5, generator=g)
        out = f(td, perm)
        ref = moves(td, perm)
        check_same(out[:6], ref[:6])
        check_same(out[6], ref[6])
        assert all(type(o.items()[1][1]) is NonTensor for o in out)  # no row ids left
    assert cnt.frame_count == 1


def test_per_sample_text_100_calls_one_compile() -> None:
    def step(td: Any, perm: torch.Tensor) -> tuple[Any, ...]:
        a, b = td[perm].split([3, 2])
        return tdfunc.stack([td, td[perm]], 1), tdfunc.cat([b, a]), td.unsqueeze(0).expand(2, 5)

    def oracle(td: Any, perm: torch.Tensor) -> tuple[Any, ...]:
        return step(td, perm)

    f, cnt = compiled(step, "compiled")
    g = torch.Generator().manual_seed(1)
    for call in range(100):
        td = tdfunc.TensorDict(
            x=torch.randn(5, 2, generator=g), text=texts(call, 5), batch_size=[5]
        )
        perm = torch.randperm(5, generator=g)
        out, ref = f(td, perm), oracle(td, perm)
        for o, r in zip(out, ref):
            assert o["text"] == r["text"]
            torch.testing.assert_close(o["x"], r["x"])
    assert cnt.frame_count == 1


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_per_sample_values_nested_and_over_two_batch_dims(mode: str) -> None:
    def fn(td: Any) -> tuple[Any, ...]:
        return td.reshape(-1)[torch.tensor([5, 0, 3])], td.permute(1, 0), td.unbind(1)

    f, cnt = compiled(fn, mode)
    for call in range(4):
        rows = [[f"{call}-{r}-{c}" for c in range(3)] for r in range(2)]
        td = tdfunc.TensorDict(
            x=torch.randn(2, 3),
            sub=tdfunc.TensorDict(t=rows, batch_size=[2, 3]),
            shared="kept",
            batch_size=[2, 3],
        )
        out, ref = f(td), fn(td)
        assert out[0]["sub", "t"] == ref[0]["sub", "t"]
        assert out[1]["sub", "t"] == ref[1]["sub", "t"]
        assert [o["sub", "t"] for o in out[2]] == [r["sub", "t"] for r in ref[2]]
        assert out[0]["shared"] == "kept"
        assert out[0]._data["shared"] == NonTensor("kept")
        assert td["sub", "t"] == tuple(tuple(r) for r in rows)  # the input as it was
    assert cnt.frame_count == (1 if mode == "compiled" else 0)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_reading_per_sample_text_inside_raises_naming_the_key(mode: str, fullgraph: bool) -> None:
    def reads(td: Any) -> Any:
        return td["inner", "text"]

    kw: dict[str, Any] = {"disable": True} if mode == "eager" else {"backend": "eager"}
    f = tdfunc.compile(reads, fullgraph=fullgraph, **kw)
    td = tdfunc.TensorDict(inner={"text": ["a", "b"], "x": torch.ones(2)}, batch_size=[2])
    message = PER_SAMPLE_COMPILED.format(key=repr(("inner", "text")))
    if mode == "compiled" and fullgraph:
        # Dynamo reports an error raised while it traces as Unsupported, the error its cause
        with pytest.raises(torch._dynamo.exc.Unsupported) as unsupported:
            f(td)
        assert f"raised exception TypeError({message!r})" in str(unsupported.value)
        assert message in str(unsupported.value.__cause__)
    else:
        with pytest.raises(TypeError) as info:
            f(td)
        assert str(info.value) == message
    assert td["inner", "text"] == ("a", "b")


def test_joining_crossed_rows_with_rows_made_inside_raises() -> None:
    def fn(td: Any) -> Any:
        made = tdfunc.TensorDict(x=torch.zeros(1), text=["new"], batch_size=[1])
        return tdfunc.cat([td, made])

    f = tdfunc.compile(fn, backend="eager")
    td = tdfunc.TensorDict(x=torch.ones(2), text=["a", "b"], batch_size=[2])
    with pytest.raises(TypeError) as info:
        f(td)
    assert str(info.value) == PER_SAMPLE_COMPILED_MIX.format(key="'text'", op="cat")


def test_shared_values_cross_as_they_are() -> None:
    def fn(td: Any) -> Any:
        return td["x"] * len(td["tag"])

    f, cnt = compiled(fn, "compiled")
    td = tdfunc.TensorDict(x=torch.ones(2), tag="ab", batch_size=[2])
    assert boundary.enter((td,), {}) is None
    torch.testing.assert_close(f(td), torch.full((2,), 2.0))
    f(tdfunc.TensorDict(x=torch.ones(2), tag="abc", batch_size=[2]))
    assert cnt.frame_count == 2  # read inside: specialised, as under torch.compile


def test_per_sample_text_with_donation_and_keywords() -> None:
    def step(state: Any, *, batch: Any) -> tuple[Any, Any]:
        return state.set("n", state["n"] + batch["x"].sum()), batch[torch.tensor([1, 0])]

    f, cnt = compiled(step, "compiled", donate=0)
    state = tdfunc.TensorDict(n=torch.zeros(()))
    for call in range(5):
        b = tdfunc.TensorDict(x=torch.ones(2), text=texts(call, 2), batch_size=[2])
        state, picked = f(state, batch=b)
        assert picked["text"] == (f"call {call} row 1", f"call {call} row 0")
    assert float(state["n"]) == 10.0
    assert cnt.frame_count == 1


def test_plain_torch_compile_specialises_on_per_sample_values() -> None:
    # the documented difference: torch.compile guards on the values a batch op reads
    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(lambda td: td[1:] * 2, backend=cnt)
    for call in range(3):
        f(tdfunc.TensorDict(x=torch.ones(3), text=texts(call, 3), batch_size=[3]))
    assert cnt.frame_count == 3


# --------------------------------------------------------------------------------------
# the compiled frames themselves
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("donate", [(), 0])
def test_each_compiled_function_has_frames_of_its_own(donate: Any) -> None:
    # Dynamo counts recompiles per code object: twelve functions compiled through one shared
    # wrapper met torch's recompile limit (8) and the last four ran eagerly
    cnt = CompileCounterWithBackend("eager")
    for i in range(12):

        def fn(td: Any, i: int = i) -> Any:
            return td * i

        f = tdfunc.compile(fn, backend=cnt, donate=donate)
        f(tdfunc.TensorDict(x=torch.ones(3)))
    assert cnt.frame_count == 12
