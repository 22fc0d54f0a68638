"""Typed errors raised by a compiled program when it runs (tdfunc._raising): the type and
message of the eager error, and the process left as it was (autograd's saved-tensor hooks
usable after an error inside a compiled ``torch.func.grad``)."""

from __future__ import annotations

import pytest
import torch

from tdfunc._raising import refuse, refuse_if


def _hooks_message() -> str | None:
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("which", ["refuse", "refuse_if"])
def test_an_error_inside_a_compiled_grad_leaves_saved_tensor_hooks_usable(
    backend: str, which: str
) -> None:
    """torch.func.grad compiled disables saved-tensor hooks for its body and enables them
    after it: an error raised between the two used to leave them disabled for the rest of
    the process (every later saved_tensors_hooks, e.g. activation checkpointing, failed)."""

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = (w * x).sum()
        if which == "refuse":
            refuse(ValueError, "the check failed")
        else:
            refuse_if(x < 0, ValueError, "the check failed")
        return y

    assert _hooks_message() is None
    grad = torch.compile(torch.func.grad(loss), backend=backend, fullgraph=True)
    with pytest.raises(ValueError, match="the check failed"):
        grad(torch.ones(3), -torch.ones(3))
    assert _hooks_message() is None
    assert torch._C._functorch.peek_interpreter_stack() is None
    assert torch.is_grad_enabled()
    # saved-tensor hooks work again, and the compiled function still gives its value
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        w = torch.ones(3, requires_grad=True)
        (w * w).sum().backward()
    assert packed
    assert torch.equal(w.grad, 2 * torch.ones(3))
    if which == "refuse_if":
        torch.testing.assert_close(grad(torch.ones(3), torch.arange(3.0)), torch.arange(3.0))


def test_an_error_outside_transforms_keeps_a_callers_disabled_hooks() -> None:
    """A disable the caller made (torch.autograd.graph.disable_saved_tensors_hooks) is the
    caller's: an error of a compiled program inside it leaves it in place."""
    fn = torch.compile(lambda x: refuse_if(x < 0, ValueError, "negative") or x * 2, backend="eager")
    with torch.autograd.graph.disable_saved_tensors_hooks("the caller's reason"):
        with pytest.raises(ValueError, match="negative"):
            fn(-torch.ones(2))
        assert _hooks_message() == "the caller's reason"
    assert _hooks_message() is None
