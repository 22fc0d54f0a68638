"""tdfunc.compile(fn, donate=...): outputs written into donated inputs, eager and compiled,
and every rule on what may be donated."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as E
from tdfunc._donate import is_consumed, store_outputs


@tdfunc.tensorclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def make() -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    params = tdfunc.TensorDict(
        w=torch.randn(4, 3, generator=g), inner={"b": torch.randn(3, generator=g)}
    )
    state = tdfunc.TensorDict(n=torch.zeros((), dtype=torch.int64), m=torch.zeros(4, 3))
    grads = params.apply(lambda p: torch.randn(p.shape, generator=g))
    return params, state, grads


def step(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
    m = state["m"] * 0.9 + grads["w"]
    new = params.apply(lambda p, g: p - 0.1 * g, grads)
    return new.set("w", new["w"] - 0.01 * m), state.set("n", state["n"] + 1).set("m", m)


def run(fn: Any, steps: int, donate: bool) -> tuple[Any, Any, list[Any]]:
    """``steps`` calls feeding the outputs back; the leaves of the first inputs."""
    params, state, grads = make()
    first = [params["w"], params["inner", "b"], state["n"], state["m"]]
    for _ in range(steps):
        params, state = fn(params, state, grads)
    return params, state, first


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_donated_step_writes_in_place_with_the_undonated_values(mode: str) -> None:
    cnt = CompileCounterWithBackend("eager")
    kw: dict[str, Any] = {"disable": True} if mode == "eager" else {"backend": cnt}
    fn = tdfunc.compile(step, donate=(0, 1), fullgraph=True, **kw)
    params, state, first = run(fn, 3, donate=True)
    ref_params, ref_state, _ = run(step, 3, donate=False)
    # bit-identical to the plain run, and the outputs are the donated tensors themselves
    assert torch.equal(params["w"], ref_params["w"])
    assert torch.equal(params["inner", "b"], ref_params["inner", "b"])
    assert torch.equal(state["m"], ref_state["m"])
    assert int(state["n"]) == 3
    assert params["w"] is first[0]
    assert params["inner", "b"] is first[1]
    assert state["n"] is first[2]
    assert state["m"] is first[3]
    assert params.batch_size == torch.Size([])
    assert params["inner"].batch_size == torch.Size([])
    if mode == "compiled":
        assert cnt.frame_count == 1  # three calls, one graph: no recompile


def test_donated_inductor_step_is_exact_and_reuses_memory() -> None:
    opt = tdfunc.optim.adamw(lr=torch.tensor(1e-2))

    def train(params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        return tdfunc.optim.step(opt, grads, state, params)

    params, _, grads = make()
    plain = torch.compile(train, backend="inductor", fullgraph=True)
    donated = tdfunc.compile(train, donate=(0, 1), backend="inductor", fullgraph=True)
    p1, s1 = params.clone(), opt.init(params)
    p2, s2 = params.clone(), opt.init(params)
    ptrs = [t.data_ptr() for t in (p2["w"], s2["adamw", "exp_avg", "w"])]
    for _ in range(3):
        p1, s1 = plain(p1, s1, grads)
        p2, s2 = donated(p2, s2, grads)
    tdfunc.testing.assert_close(p1, p2, rtol=0, atol=0)
    tdfunc.testing.assert_close(s1, s2, rtol=0, atol=0)
    assert [t.data_ptr() for t in (p2["w"], s2["adamw", "exp_avg", "w"])] == ptrs


def test_a_consumed_container_raises_naming_the_call() -> None:
    fn = tdfunc.compile(step, donate=(0, 1), backend="eager", fullgraph=True)
    params, state, grads = make()
    inner = params["inner"]
    w = params["w"]
    new_params, _ = fn(params, state, grads)
    expected = E.DONATED.format(arg=0, what="tdfunc.compile(step)", call=1)
    for use in (
        lambda: params["w"],
        lambda: params + 1,
        lambda: params.batch_size,
        lambda: inner["b"],  # nested containers are consumed too
        lambda: list(params.keys()),
    ):
        with pytest.raises(tdfunc.DonatedError) as info:
            use()
        assert str(info.value) == expected
    with pytest.raises(tdfunc.DonatedError, match=r"argument 1 .* \(call 1\)"):
        fn(new_params, state, grads)  # the state was consumed by call 1
    assert is_consumed(params)
    assert is_consumed(inner)
    assert not is_consumed(new_params)
    assert "donated TensorDict" in repr(params)
    # a tensor taken out before the call is the donated buffer: it holds the new value
    assert w is new_params["w"]


def test_only_matching_leaves_are_reused() -> None:
    def fn(params: Any) -> Any:
        return tdfunc.TensorDict(
            w=params["w"].double(),
            v=params["w"] * 2,
            extra=torch.ones(2, 2),
            b=params["inner", "b"] + 1,
        )

    params, _, _ = make()
    w, b = params["w"], params["inner", "b"]
    expected = fn(params.clone())
    out = tdfunc.compile(fn, donate=0, backend="eager", fullgraph=True)(params)
    tdfunc.testing.assert_close(out, expected)
    assert out["w"].dtype == torch.float64
    assert out["w"] is not w
    assert out["v"] is w  # first float32 [4, 3] output takes w's buffer
    assert out["extra"] is not w
    assert out["b"] is b


def test_pass_through_views_and_swaps() -> None:
    def fn(a: Any) -> Any:
        # swapped leaves, a pass-through leaf, and a view of a donated buffer
        return tdfunc.TensorDict(x=a["y"] * 1, y=a["x"] * 1, z=a["z"], row=a["x"][0])

    for kw in ({"backend": "eager"}, {"disable": True}):
        a = tdfunc.TensorDict(x=torch.ones(3), y=torch.full((3,), 2.0), z=torch.zeros(3))
        z = a["z"]
        out = tdfunc.compile(fn, donate=0, **kw)(a)
        assert out["x"].tolist() == [2.0, 2.0, 2.0]
        assert out["y"].tolist() == [1.0, 1.0, 1.0]
        assert out["z"] is z
        # the view was taken of x before x's buffer received y's value: it is a copy
        assert out["row"].item() == 1.0


def test_tensorclass_and_decorator_form() -> None:
    @tdfunc.compile(donate=0, backend="eager", fullgraph=True)
    def swap(p: Pair) -> Pair:
        return Pair(x=p.y + 1, y=p.x + 1)

    p = Pair(x=torch.zeros(2), y=torch.ones(2))
    x = p.x
    out = swap(p)
    assert out.x is x
    assert out.x.tolist() == [2.0, 2.0]
    assert out.y.tolist() == [1.0, 1.0]
    with pytest.raises(tdfunc.DonatedError):
        p.x  # noqa: B018
    assert isinstance(out, Pair)
    assert not is_consumed(out)


def test_without_donate_it_is_torch_compile() -> None:
    params, state, grads = make()
    fn = tdfunc.compile(step, backend="eager", fullgraph=True)
    out, _ = fn(params, state, grads)
    assert out["w"] is not params["w"]
    assert not is_consumed(params)


# ------------------------------------------------------------------------ refused inputs
def _unchanged(before: Any, after: Any) -> None:
    assert not is_consumed(after)
    tdfunc.testing.assert_close(before, after, rtol=0, atol=0)


def test_memory_mapped_leaves_are_refused(tmp_path: Any) -> None:
    params, state, grads = make()
    tdfunc.save(params, tmp_path / "p")
    fn = tdfunc.compile(step, donate=(0, 1), backend="eager")
    ro = tdfunc.load(tmp_path / "p")
    with pytest.raises(PermissionError, match=r"argument 0, key 'w' is memory-mapped"):
        fn(ro, state, grads)
    rw = tdfunc.load(tmp_path / "p", mode="r+")
    with pytest.raises(ValueError, match=r"mode 'r\+'\) and cannot be donated"):
        fn(rw, state, grads)
    cow = tdfunc.load(tmp_path / "p", mode="c")
    with pytest.raises(ValueError, match="copy-on-write") as e:
        fn(cow, state, grads)
    # the true reason: a copy-on-write leaf never writes its file
    assert str(e.value) == E.DONATE_MEMMAP_PRIVATE.format(
        what="tdfunc.compile(step)", at="argument 0, key 'w'"
    )
    assert "written into its file" not in str(e.value)
    _unchanged(params, tdfunc.load(tmp_path / "p").clone())
    assert not is_consumed(ro)
    assert not is_consumed(rw)
    assert not is_consumed(cow)
    assert not is_consumed(state)


def test_aliased_and_shared_leaves_are_refused() -> None:
    params, state, grads = make()
    before = params.clone()
    fn = tdfunc.compile(step, donate=(0, 1), backend="eager")
    aliased = state.set("m", params["w"])  # a state buffer that is a param buffer
    with pytest.raises(ValueError, match=r"argument 0, key 'w' and argument 1, key 'm' share"):
        fn(params, aliased, grads)
    view = state.set("m", params["w"].clone())
    fn_ok = tdfunc.compile(step, donate=(0, 1), backend="eager")
    fn_ok(params.clone(), view, grads)  # separate memory: accepted
    with pytest.raises(ValueError, match=r"argument 0, key 'w' shares memory with argument 2"):
        fn(params, state, params)  # the params passed again, as grads, not donated
    with pytest.raises(ValueError, match=r"shares memory with argument 'g'"):
        tdfunc.compile(lambda p, g: p + g, donate=0, backend="eager")(params, g=params["w"])
    _unchanged(before, params)
    assert not is_consumed(state)
    assert not is_consumed(aliased)


def test_overlapping_views_of_one_buffer_are_refused_disjoint_ones_accepted() -> None:
    flat = torch.arange(6.0)
    fn = tdfunc.compile(lambda t: t * 2, donate=0, backend="eager")
    with pytest.raises(ValueError, match="share memory"):
        fn(tdfunc.TensorDict(a=flat[:4], b=flat[2:]))
    # one tensor under two keys: the message names both
    with pytest.raises(ValueError, match="key 'a' and argument 0, key 'b' share memory"):
        fn(tdfunc.TensorDict(a=flat, b=flat))
    out = fn(tdfunc.TensorDict(a=flat[:3], b=flat[3:]))
    assert flat.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert out["a"].data_ptr() == flat.data_ptr()


@pytest.mark.parametrize(
    ("donate", "args", "error", "text"),
    [
        (0, (torch.ones(2),), TypeError, "argument 0 is donated but is a Tensor"),
        (1, (tdfunc.TensorDict(a=torch.ones(1)),), TypeError, "passed 1 positional"),
        (0, ({"a": torch.ones(1)},), TypeError, "but is a dict"),
    ],
)
def test_bad_donated_arguments(donate: Any, args: Any, error: type, text: str) -> None:
    fn = tdfunc.compile(lambda *a: a, donate=donate, backend="eager")
    with pytest.raises(error, match=text):
        fn(*args)


def test_bad_donate_values_and_grad_leaves() -> None:
    for bad in (-1, "0", 1.5, True):
        with pytest.raises(TypeError, match="donate takes argument positions"):
            tdfunc.compile(step, donate=bad)
    with pytest.raises(ValueError, match="names an argument twice"):
        tdfunc.compile(step, donate=(0, 0))
    params, state, grads = make()
    leafy = params.set("w", params["w"].clone().requires_grad_())
    with pytest.raises(ValueError, match="argument 0, key 'w' requires grad"):
        tdfunc.compile(step, donate=0, backend="eager")(leafy, state, grads)
    assert not is_consumed(leafy)


def test_store_outputs_keeps_unmatched_outputs() -> None:
    a = torch.zeros(2)
    out = store_outputs({"x": torch.ones(3), "y": 5, "z": torch.ones(2)}, [a])
    assert out["x"].shape == (3,)
    assert out["y"] == 5
    assert out["z"] is a
    assert a.tolist() == [1, 1]


def test_first_call_with_memory_mapped_leaves_warns_and_a_copy_compiles_once(
    tmp_path: Any,
) -> None:
    path = str(tmp_path / "state")
    tdfunc.save(tdfunc.TensorDict(w=torch.arange(4.0)), path)

    def step(params: Any, other: Any) -> Any:
        return params.apply(lambda p: p * 2), other.apply(lambda o: o + 1)

    # a loaded (memory-mapped) state in an argument that is not donated: warned, and indeed
    # the next call with the plain tensors the step returned compiles again
    cnt = CompileCounterWithBackend("eager")
    fn = tdfunc.compile(step, donate=0, backend=cnt, fullgraph=True)
    with pytest.warns(UserWarning, match=r"argument 1 holds memory-mapped leaves \(key 'w'"):
        p, o = fn(tdfunc.TensorDict(w=torch.ones(4)), tdfunc.load(path))
    p, o = fn(p, o)
    assert cnt.frame_count == 2
    assert o["w"].tolist() == [2.0, 3.0, 4.0, 5.0]
    # with a copy: no warning, one graph
    cnt = CompileCounterWithBackend("eager")
    fn = tdfunc.compile(step, donate=0, backend=cnt, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p, o = fn(tdfunc.TensorDict(w=torch.ones(4)), tdfunc.load(path).clone())
        p, o = fn(p, o)
    assert cnt.frame_count == 1
    assert o["w"].tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.slow
def test_donated_dtensors_eager_and_compiled() -> None:
    import _dist_training as W

    from tdfunc.testing import launch

    (res,) = launch(W.run_donated_dtensors, 1, timeout=200, pg_timeout=60)
    want = [[(4 * x + 3) for x in row] for row in torch.arange(12.0).reshape(4, 3).tolist()]
    for name in ("eager", "compiled"):
        r = res[name]
        assert r["same_objects"] is True, name  # the outputs live in the donated DTensors
        assert r["placements"] == ["Shard(dim=0)", "Replicate()"], name
        assert r["values"] == want, name
        assert r["reuse"].startswith("DonatedError: "), r["reuse"]
    assert res["frames"] == 1
    for case in ("alias", "alias_local"):
        assert res[case].startswith("ValueError: "), res[case]
        assert "key 'a' and argument 0, key 'c' share memory" in res[case], res[case]
