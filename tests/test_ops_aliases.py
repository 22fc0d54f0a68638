"""torch's aliases (``torch.divide``, ``torch.arccos``, ``torch.greater`` ...) lift as the
function torch's docstring names, eager and compiled; their ``Tensor`` methods are container
methods."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc._ops import _lift
from tdfunc._ops._aliases import alias_rules, target_of

ALIASES, ALIAS_METHODS = alias_rules({**_lift._pointwise._RULES, **_lift._batchdim._RULES})


def _pair() -> tuple[tdfunc.TensorDict, tdfunc.TensorDict]:
    g = torch.Generator().manual_seed(0)

    def td(shift: float) -> tdfunc.TensorDict:
        return tdfunc.TensorDict(
            a=torch.rand(3, 2, generator=g) * 0.8 + shift,
            n=tdfunc.TensorDict(b=torch.rand(3, generator=g) * 0.8 + shift, batch_size=[3]),
            batch_size=[3],
        )

    return td(0.1), td(0.15)


def _call(f: Any, x: tdfunc.TensorDict, y: tdfunc.TensorDict) -> Any:
    """``f`` called as its target is on one tensor: unary, with a container, or with a
    number (the first that torch accepts on a plain leaf)."""
    leaf = x["a"]
    for args in ((x,), (x, y), (x, 0.5)):
        probe = tuple(a["a"] if isinstance(a, tdfunc.TensorDict) else a for a in args)
        try:
            f(*probe)
        except (TypeError, RuntimeError):
            continue
        return args
    raise AssertionError(f"no sample call for {f} on {leaf.shape}")


def test_the_aliases_torch_documents_are_found() -> None:
    names = {_lift._public_name(f) for f in ALIASES}
    for n in (
        "torch.divide",
        "torch.subtract",
        "torch.multiply",
        "torch.arccos",
        "torch.greater",
        "torch.not_equal",
        "torch.fix",
        "torch.special.psi",
        "Tensor.divide",
    ):
        assert n in names
    assert {"divide", "subtract", "greater", "absolute"} <= set(ALIAS_METHODS)
    assert target_of(torch.divide) is torch.div
    assert target_of(torch.exp) is None


@pytest.mark.parametrize("f", sorted(ALIASES, key=_lift._public_name), ids=_lift._public_name)
def test_alias_lifts_as_its_target(f: Any) -> None:
    x, y = _pair()
    before = x.clone()
    args = _call(f, x, y)
    if _lift._public_name(f).startswith("Tensor."):  # a Tensor method: the container's own
        got = getattr(args[0], f.__name__)(*args[1:])
    else:
        got = f(*args)
    target = target_of(f)
    want = target(*args)
    assert got.keys(True, True) == want.keys(True, True)
    for key in (("a",), ("n", "b")):
        leaf_args = tuple(a.get(key) if isinstance(a, tdfunc.TensorDict) else a for a in args)
        one = f(*leaf_args)  # the alias on the leaf itself (NaN where out of its domain)
        torch.testing.assert_close(got.get(key), one, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(want.get(key), one, atol=0, rtol=0, equal_nan=True)
    assert got.batch_size == x.batch_size
    tdfunc.testing.assert_close(x, before, atol=0, rtol=0)


def test_alias_methods_are_container_methods() -> None:
    x, y = _pair()
    tdfunc.testing.assert_close(x.divide(y), x / y, atol=0, rtol=0)
    tdfunc.testing.assert_close(x.subtract(y, alpha=2), x - 2 * y, atol=0, rtol=0)
    tdfunc.testing.assert_close(x.greater(y), x > y, atol=0, rtol=0)
    tdfunc.testing.assert_close(x.negative(), -x, atol=0, rtol=0)


def test_aliases_compiled_one_frame() -> None:
    cnt = CompileCounterWithBackend("eager")

    def f(x, y):
        return torch.divide(x, y), torch.greater(x, y), x.subtract(y), torch.arccos(x)

    fn = torch.compile(f, backend=cnt, fullgraph=True)
    x, y = _pair()
    for k in range(2):
        got, want = fn(x * (k + 1) * 0.5, y), f(x * (k + 1) * 0.5, y)
        for g, w in zip(got, want):
            tdfunc.testing.assert_close(g, w, atol=1e-6, rtol=0)
    assert cnt.frame_count == 1
