"""value_and_grad: gradients through autograd (and AOTAutograd), as a pure function.

``torch.func.grad_and_value`` traces forward and backward as one function: compiled, the
forward, backward and update become one joint graph, and inductor compiles every block of a
deep model again (on torch 2.13 neither ``torch.compiler.nested_compile_region`` nor ``scan``
over stacked blocks works inside it under ``torch.compile``). :func:`value_and_grad` runs the
function on detached aliases of the differentiated leaves that require grad and takes the
gradients with ``torch.autograd.grad``: the function (or regions inside it) can be compiled
with ``torch.compile``, and AOTAutograd then splits each compiled region into a forward and a
backward graph, so torch's regional compilation, ``nested_compile_region`` and ``scan`` apply
and a block repeated N times compiles once. Inside :func:`tdfunc.compile` it is traced too
(tdfunc.compile lets Dynamo trace ``torch.autograd.grad`` for its calls): a whole step is then
one graph, as with ``torch.func``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from . import _errors as E
from . import _tree
from ._compat import pytree
from ._tree import is_node

__all__ = ["value_and_grad"]


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(not isinstance(i, int) or isinstance(i, bool) for i in nums):
        raise TypeError(E.GRAD_ARGNUMS.format(value=argnums))
    if len(set(nums)) != len(nums):
        raise ValueError(E.GRAD_ARGNUMS.format(value=argnums))
    return nums


def _unflatten(leaves: list[Tensor], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def _raise_leaf(i: int, arg: Any, leaf: Any) -> NoReturn:
    """The error for a leaf that cannot be differentiated, with its path (found only now)."""
    for path, x in pytree.tree_flatten_with_path(arg)[0]:
        if x is leaf:
            kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
            raise TypeError(
                E.GRAD_LEAF.format(arg=i, path=pytree.keystr(path) or "(root)", kind=kind)
            )
    raise AssertionError("unreachable: the leaf came from this argument")


def _detach_tree(x: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, x)


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """``fn``'s value and its gradient with respect to argument(s) ``argnums``, through autograd.

    The same values as ``torch.func.grad_and_value`` (in JAX's order: value first), taken
    another way: the leaves of the differentiated arguments (containers, tensors, or pytrees
    of them) are replaced by detached aliases that require grad, ``fn`` runs on them with
    grad enabled, and ``torch.autograd.grad`` returns the gradients. Nothing is written: not
    the given tensors (aliases are new tensor objects; autograd accumulates into no
    ``.grad``), not any module. The value and ``aux`` come back detached.

    Why: compile ``fn`` (``torch.compile(loss_fn)``), or the blocks of its model (a compiled
    block ``forward``, ``torch.compiler.nested_compile_region``, ``tdfunc.scan`` over
    :func:`tdfunc.stack_modules`), and AOTAutograd splits each compiled region into its
    forward and backward graphs: a block repeated N times compiles once, and the first call
    costs what torch's own regional recipe costs instead of growing with the depth (see the
    training-loop guide). The optimizer step then runs eagerly on torch's fused kernels
    (``optim.step(..., donate=True)``). Called inside a function compiled with
    :func:`tdfunc.compile`, it is traced with the rest (one graph: forward, backward and
    whatever follows); inside a plain ``torch.compile`` Dynamo stops at
    ``torch.autograd.grad`` unless ``torch._dynamo.config.trace_autograd_ops`` is set.

    Args:
        fn: returns a scalar tensor, or ``(scalar, aux)`` with ``has_aux=True``.
        argnums: the position(s) of the arguments to differentiate; with several positions
            the gradients come as a tuple in that order.
        has_aux: ``fn`` returns ``(value, aux)``; ``aux`` comes back with the value.

    Returns:
        A function of ``fn``'s arguments returning ``(value, grads)`` (``((value, aux),
        grads)`` with ``has_aux``); ``grads`` has the structure of the differentiated
        argument (zeros for leaves the value does not depend on).

    Raises:
        TypeError: ``argnums`` is not an int or a sequence of ints; a differentiated leaf is
            not a floating-point tensor (the message names its path); the value is not a
            scalar tensor.

    Example:
        >>> import torch, tdfunc
        >>> p = tdfunc.TensorDict(w=torch.tensor([1.0, 2.0]))
        >>> loss, g = tdfunc.value_and_grad(lambda p: (p["w"] ** 2).sum())(p)
        >>> loss.item(), g["w"].tolist(), p["w"].requires_grad
        (5.0, [2.0, 4.0], False)
    """
    nums = _argnums(argnums)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        args_l = list(args)
        inputs: list[Tensor] = []
        rebuilds: list[tuple[int, Callable[[list[Tensor]], Any]]] = []
        for i in nums:
            if not -len(args_l) <= i < len(args_l):
                raise TypeError(E.GRAD_ARGNUM_RANGE.format(index=i, n=len(args_l)))
            arg = args_l[i]
            if is_node(arg):  # the fast path: the container's own walk and trusted rebuild
                leaves = _tree.leaves(arg)
                rebuild: Callable[[list[Tensor]], Any] = functools.partial(_tree.map_leaves, arg)
            else:
                leaves, spec = pytree.tree_flatten(arg)
                rebuild = functools.partial(_unflatten, spec=spec)
            for leaf in leaves:
                if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                    _raise_leaf(i, arg, leaf)
            aliases = [leaf.detach().requires_grad_() for leaf in leaves]
            rebuilds.append((len(inputs), rebuild))
            inputs.extend(aliases)
            args_l[i] = rebuild(aliases)
        with torch.enable_grad():
            out = fn(*args_l, **kwargs)
        value, aux = out if has_aux else (out, None)
        if not isinstance(value, Tensor) or value.numel() != 1:
            what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise TypeError(E.GRAD_VALUE.format(what=what))
        got: Sequence[Tensor | None] = [None] * len(inputs)
        if value.requires_grad:
            got = torch.autograd.grad(value, inputs, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]
        trees = []
        for k, (start, rebuild) in enumerate(rebuilds):
            end = rebuilds[k + 1][0] if k + 1 < len(rebuilds) else len(grads)
            trees.append(rebuild(grads[start:end]))
        result = trees[0] if isinstance(argnums, int) else tuple(trees)
        value = value.detach()
        return ((value, _detach_tree(aux)) if has_aux else value), result

    return wrapped
