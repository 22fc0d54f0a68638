"""Test helpers: :func:`assert_close` for containers; ``launch`` / ``RankError``: run a
function on several local processes (gloo, loopback) with deadlines, for code that uses
``torch.distributed``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ._keys import fmt_key
from ._tree import KeyPath, is_node

if TYPE_CHECKING:  # served lazily by __getattr__ below
    from .distributed._common.launch import RankError, launch


def assert_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    check_dtype: bool = True,
    _path: KeyPath = (),
) -> None:
    """Assert two containers have the same structure, batch size and close leaves.

    Leaves are compared by key: the same keys in another order are equal (a container's
    order is how it was built, not part of its value). The error names the first differing
    key path.

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.ones(2), batch_size=[2])
        >>> tdfunc.testing.assert_close(a, a + 0)
    """
    where = "the root" if not _path else f"key {fmt_key(_path)}"
    if is_node(actual) != is_node(expected):
        raise AssertionError(
            f"at {where}: expected a {type(expected).__name__}, got a {type(actual).__name__}"
        )
    if not is_node(actual):
        if actual is None or expected is None:
            if actual is not expected:
                raise AssertionError(f"at {where}: expected {expected!r}, got {actual!r}")
            return
        if not isinstance(actual, Tensor) or not isinstance(expected, Tensor):
            if actual != expected:
                raise AssertionError(f"at {where}: expected {expected!r}, got {actual!r}")
            return
        try:
            torch.testing.assert_close(
                actual, expected, rtol=rtol, atol=atol, check_dtype=check_dtype
            )
        except AssertionError as e:
            raise AssertionError(f"at {where}: {e}") from None
        return
    if type(actual) is not type(expected):
        raise AssertionError(
            f"at {where}: type {type(actual).__name__} != {type(expected).__name__}"
        )
    if actual.batch_size != expected.batch_size:
        raise AssertionError(
            f"at {where}: batch_size {tuple(actual.batch_size)} != {tuple(expected.batch_size)}"
        )
    # containers are compared by key: the same keys in another order are equal
    ka, kb = actual._tdf_keys(), expected._tdf_keys()
    if set(ka) != set(kb):
        missing = [k for k in kb if k not in ka]
        extra = [k for k in ka if k not in kb]
        raise AssertionError(f"at {where}: keys differ: missing {missing}, extra {extra}")
    sa = actual._tdf_static()
    sb = expected._tdf_static()
    if sa != sb:
        raise AssertionError(f"at {where}: static fields differ: {sa} != {sb}")
    for k, x in zip(ka, actual._tdf_children()):
        y = expected._tdf_get(k, None)
        assert_close(x, y, rtol=rtol, atol=atol, check_dtype=check_dtype, _path=(*_path, k))


def __getattr__(name: str) -> Any:
    # launch / RankError: a local multi-process runner with deadlines (for tests of code that
    # uses torch.distributed). Loaded on first use: it imports torch.distributed.tensor.
    if name in ("launch", "RankError"):
        from .distributed._common import launch as _launch

        return getattr(_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(__all__)  # not the names this module imported for itself (torch, Any...)


__all__ = ["RankError", "assert_close", "launch"]
