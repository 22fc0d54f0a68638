"""Fixtures of the tdfunc test suite. Shared helpers live in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _process_state_left_as_it_was() -> Iterator[None]:
    """A test leaves no functorch transform level and no disabled saved-tensor hooks behind:
    either would break an unrelated later test of the same worker (and a user's process)."""
    yield
    hooks = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    level = torch._C._functorch.peek_interpreter_stack()
    if hooks is not None:
        torch._C._autograd._saved_tensors_hooks_enable()
    assert hooks is None, f"the test left saved-tensor hooks disabled: {hooks}"
    assert level is None, "the test left a functorch transform level active"
