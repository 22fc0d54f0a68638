"""Helpers shared by the tdfunc test modules (import them from here, not from ``conftest``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc


def compare(a: Any, b: Any) -> None:
    """assert_close over containers, tensors, tuples/lists and dicts of them."""
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)), f"expected a sequence, got {type(b).__name__}"
        assert len(a) == len(b), f"length {len(b)} != {len(a)}"
        for x, y in zip(a, b):
            compare(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"expected a dict, got {type(b).__name__}"
        assert list(a) == list(b)
        for k in a:
            compare(a[k], b[k])
    elif isinstance(a, torch.Size) or not (isinstance(a, torch.Tensor) or tdfunc.is_container(a)):
        assert a == b
    else:
        tdfunc.testing.assert_close(a, b)


def check_compiled(
    fn: Callable[..., Any],
    make: Callable[[], tuple[Any, ...]],
    *,
    backend: str = "eager",
    max_frames: int = 1,
    dynamic: bool | None = None,
) -> CompileCounterWithBackend:
    """Run ``fn`` eager and compiled (fullgraph) on ``make()``; compare; check frames and that a
    second call with new values of the same structure does not recompile."""
    args = make()
    expected = fn(*args)
    cnt = CompileCounterWithBackend(backend)
    cfn = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=dynamic)
    got = cfn(*args)
    compare(got, expected)
    frames = cnt.frame_count
    assert frames <= max_frames, f"expected at most {max_frames} frame(s), got {frames}"
    args2 = make()
    compare(cfn(*args2), fn(*args2))
    assert cnt.frame_count == frames, "recompiled on new values of the same structure"
    return cnt


def snapshot(x: Any) -> Any:
    """A deep copy of a container's leaves and structure, to check inputs are not modified."""
    if tdfunc.is_container(x):
        return x.clone()
    return x.clone() if isinstance(x, torch.Tensor) else x
