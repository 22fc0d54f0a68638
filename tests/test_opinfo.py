"""Conformance against torch's own op database: every unary and binary ufunc OpInfo, each CPU
sample wrapped in a nested container whose batch size is the sample's shape, gives the
container of the op on the leaf; a sample of each family under torch.compile (fullgraph,
counting backend), torch.vmap and torch.func.grad."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import binary_ufuncs, unary_ufuncs

import tdfunc

#: the OpInfos that do not lift, with the reason (the rest of each family must lift)
NOT_LIFTED = {
    "nn.functional.prelu": "its weight is per channel (dim 1 of the input), not pointwise: "
    "no pointwise tag, so it raises TypeError naming td.apply",
    "nn.functional.rrelu": "random: leaf-by-leaf calls draw other random numbers than one call",
    "fill": "aten.fill is untagged; a container spells it torch.full_like(td, v)",
    "__rdiv__": "Tensor.__rdiv__ is a Python alias of __rtruediv__; containers define the "
    "reflected operators Python calls (number / td works)",
}
#: samples torch itself cannot run on this machine (counted as not lifted in the rate)
CPU_ONLY_SKIPPED = {"jiterator_unary", "jiterator_binary", "jiterator_binary_return_by_ref"}
MAX_SAMPLES = 3


def _family(db):
    return [op for op in db if not op.name.startswith("_refs")]


def _wrap(x):
    return tdfunc.TensorDict(
        a=x, n=tdfunc.TensorDict(b=x.clone(), batch_size=x.shape), batch_size=x.shape
    )


def _dtype(op):
    for dt in (torch.float32, torch.int64, torch.bool, torch.complex64):
        if dt in op.supported_dtypes("cpu"):
            return dt
    return None


def _caller(op):
    f = op.op
    name = getattr(f, "__name__", "")
    if getattr(torch.Tensor, name, None) is f:  # an unbound Tensor method: the container's
        return lambda t, *a, **k: getattr(t, name)(*a, **k)
    return f


def _check(op) -> int:
    """Number of samples checked (their result equals the leaf's); raises on a mismatch."""
    dt = _dtype(op)
    call = _caller(op)
    n = 0
    for s in op.sample_inputs("cpu", dt):
        x = s.input
        if not isinstance(x, torch.Tensor):
            continue
        try:
            want = op.op(x, *s.args, **s.kwargs)
        except Exception:  # torch refuses this sample itself (dtype, device)
            continue
        first = want[0] if isinstance(want, tuple) else want
        if first.shape != x.shape:  # broadcasting grows the batch: not this check
            continue
        args = [
            _wrap(a) if isinstance(a, torch.Tensor) and a.shape == x.shape else a for a in s.args
        ]
        td = _wrap(x)
        got = call(td, *args, **s.kwargs)
        pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
        for g, w in pairs:
            assert g.batch_size == x.shape
            torch.testing.assert_close(g["a"], w, equal_nan=True)
            torch.testing.assert_close(g["n", "b"], w, equal_nan=True)
        torch.testing.assert_close(td["a"], x, equal_nan=True)  # input unchanged
        n += 1
        if n >= MAX_SAMPLES:
            break
    return n


def _ops(db):
    return [
        pytest.param(
            op, id=f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
        )
        for op in _family(db)
        if op.name not in CPU_ONLY_SKIPPED
    ]


def _lifts(op) -> bool:
    try:
        _check(op)
    except Exception:
        return False
    return True


@pytest.mark.parametrize("op", _ops(unary_ufuncs) + _ops(binary_ufuncs))
def test_ufunc_lifts(op):
    if op.name in NOT_LIFTED:
        assert not _lifts(op), f"{op.name} lifts now: remove it from NOT_LIFTED"
        return
    assert _check(op) > 0, f"{op.name}: no CPU sample was checked"


@pytest.mark.parametrize("family", [unary_ufuncs, binary_ufuncs], ids=["unary", "binary"])
def test_at_least_95_percent_of_each_family_lifts(family):
    ops = _family(family)
    lifted = [op for op in ops if op.name not in NOT_LIFTED and op.name not in CPU_ONLY_SKIPPED]
    assert len(lifted) / len(ops) >= 0.95, (len(lifted), len(ops))


def test_not_lifted_names_the_function_and_apply():
    td = _wrap(torch.randn(2, 3))
    w = torch.ones(3)
    with pytest.raises(TypeError, match=r"torch\.prelu does not lift.*td\.apply"):
        torch.nn.functional.prelu(td, w)


# ------------------------------------------------------------------- transforms (a sample)
_SAMPLE = [torch.exp, torch.sigmoid, torch.nn.functional.silu, torch.atan2, torch.hypot]


def _args(f, td):
    return (td, td * 0.5 + 1) if f in (torch.atan2, torch.hypot) else (td,)


@pytest.mark.parametrize("f", _SAMPLE, ids=lambda f: f.__name__)
def test_sample_compiled_one_frame_no_recompile(f):
    from torch._dynamo.testing import CompileCounterWithBackend

    cnt = CompileCounterWithBackend("eager")
    g = torch.compile(lambda td: f(*_args(f, td)), backend=cnt, fullgraph=True)
    td = _wrap(torch.randn(3, 2))
    torch.testing.assert_close(g(td)["a"], f(*_args(f, td))["a"])
    g(_wrap(torch.randn(3, 2)))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("f", _SAMPLE, ids=lambda f: f.__name__)
def test_sample_vmapped(f):
    td = _wrap(torch.randn(4, 3))
    got = torch.vmap(lambda t: f(*_args(f, t)))(td)
    want = f(*_args(f, td))
    assert got.batch_size == td.batch_size
    torch.testing.assert_close(got["n", "b"], want["n", "b"])


@pytest.mark.parametrize("f", _SAMPLE, ids=lambda f: f.__name__)
def test_sample_grad(f):
    x = torch.randn(3, 2)
    td = _wrap(x)
    g = torch.func.grad(lambda t: f(*_args(f, t)).sum()["a"] + f(*_args(f, t)).sum()["n", "b"])(td)
    want = torch.func.grad(lambda y: f(*_args(f, y)).sum())(x)
    torch.testing.assert_close(g["a"], want)
    torch.testing.assert_close(g["n", "b"], want)
