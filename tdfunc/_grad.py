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
one graph, as with ``torch.func``. Inside a plain ``torch.compile`` Dynamo traces
``torch.func.grad_and_value`` in its place (a traced twin with the same values).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from . import _errors as E
from . import _tree
from ._compat import autograd_traced, pytree
from ._tree import is_node
from ._twins import constant_when_traced, traced_as

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
    (``optim.step(..., donate=True)``). Called inside a compiled function it is traced with
    the rest (one graph: forward, backward and whatever follows), with the same values:
    inside :func:`tdfunc.compile` through ``torch.autograd.grad`` (compiled regions and
    ``tdfunc.scan`` inside keep their own graphs); inside a plain ``torch.compile``, where
    Dynamo refuses ``torch.autograd.grad``, as ``torch.func.grad_and_value``.
    Parameters straight from :func:`tdfunc.from_module` (requiring grad) may be passed as
    they are: the gradient is taken with respect to a view of each, so nothing accumulates
    into their ``.grad``.

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
    single = isinstance(argnums, int)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return _call(fn, nums, has_aux, single, args, kwargs)

    return wrapped


def _check_value(value: Any) -> None:
    if not isinstance(value, Tensor) or value.numel() != 1:
        what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(E.GRAD_VALUE.format(what=what))


def _differentiated(
    nums: tuple[int, ...], args: tuple[Any, ...]
) -> list[tuple[int, Any, list[Tensor], Callable[[list[Tensor]], Any]]]:
    """Each differentiated argument: its position, the argument, its leaves (checked to be
    floating-point tensors) and how to rebuild it from new leaves."""
    out = []
    for i in nums:
        if not -len(args) <= i < len(args):
            raise TypeError(E.GRAD_ARGNUM_RANGE.format(index=i, n=len(args)))
        arg = args[i]
        if is_node(arg):  # the fast path: the container's own walk and trusted rebuild
            leaves = _tree.leaves(arg)  # tensors only
            rebuild: Callable[[list[Tensor]], Any] = functools.partial(_tree.map_leaves, arg)
            floats = all(map(Tensor.is_floating_point, leaves))
        else:
            leaves, spec = pytree.tree_flatten(arg)
            rebuild = functools.partial(_unflatten, spec=spec)
            floats = False
        if not floats:
            for leaf in leaves:
                if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                    _raise_leaf(i, arg, leaf)
        out.append((i % len(args), arg, leaves, rebuild))
    return out


def _call(
    fn: Callable[..., Any],
    nums: tuple[int, ...],
    has_aux: bool,
    single: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    """A call of a :func:`value_and_grad` function. Eagerly and inside :func:`tdfunc.compile`
    the gradients come from ``torch.autograd.grad`` (:func:`_via_autograd`); Dynamo traces
    :func:`_call_traced` in its place."""
    return _via_autograd(fn, nums, has_aux, single, args, kwargs)


def _via_autograd(
    fn: Callable[..., Any],
    nums: tuple[int, ...],
    has_aux: bool,
    single: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    args_l = list(args)
    inputs: list[Tensor] = []
    rebuilds: list[tuple[int, Callable[[list[Tensor]], Any]]] = []
    for i, _, leaves, rebuild in _differentiated(nums, args):
        # a new tensor object per leaf that the gradient is taken with respect to: a leaf
        # that requires grad already (a parameter straight from from_module) gets a view
        # (differentiable; no requires_grad_() on a tensor made inside a compiled function,
        # whose results Dynamo refuses to return while it requires grad), any other leaf a
        # detached alias that requires grad (one comprehension: the hot path of a step)
        aliases = [
            leaf.view_as(leaf) if leaf.requires_grad else leaf.detach().requires_grad_()
            for leaf in leaves
        ]
        rebuilds.append((len(inputs), rebuild))
        inputs.extend(aliases)
        args_l[i] = rebuild(aliases)
    with torch.enable_grad():
        out = fn(*args_l, **kwargs)
    value, aux = out if has_aux else (out, None)
    _check_value(value)
    got: Sequence[Tensor | None] = [None] * len(inputs)
    if value.requires_grad:
        got = torch.autograd.grad(value, inputs, allow_unused=True)
    grads: list[Tensor] = list(got)  # type: ignore[arg-type]  # None: replaced below
    if any(map(operator.is_, got, itertools.repeat(None))):  # a leaf unused: zeros
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, got)]
    trees = []
    for k, (start, rebuild) in enumerate(rebuilds):
        end = rebuilds[k + 1][0] if k + 1 < len(rebuilds) else len(grads)
        trees.append(rebuild(grads[start:end]))
    result = trees[0] if single else tuple(trees)
    value = value.detach()
    return ((value, _detach_tree(aux)) if has_aux else value), result


def _via_func(
    fn: Callable[..., Any],
    nums: tuple[int, ...],
    has_aux: bool,
    single: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    """The same values through ``torch.func.grad_and_value``: what a plain
    ``torch.compile`` traces (Dynamo refuses ``torch.autograd.grad`` there)."""
    diff = _differentiated(nums, args)
    positions = [i for i, _, _, _ in diff]

    def inner(*xs: Any) -> Any:
        args_l = list(args)
        for i, x in zip(positions, xs):
            args_l[i] = x
        out = fn(*args_l, **kwargs)
        _check_value(out[0] if has_aux else out)
        return out

    grads, out = torch.func.grad_and_value(inner, argnums=tuple(range(len(diff))), has_aux=has_aux)(
        *[arg for _, arg, _, _ in diff]
    )
    result = grads[0] if single else tuple(grads)
    if has_aux:
        return (out[0].detach(), _detach_tree(out[1])), result
    return out.detach(), result


@constant_when_traced
def _autograd_traced() -> bool:
    """Whether Dynamo traces ``torch.autograd.grad`` now (inside :func:`tdfunc.compile`);
    read once per trace and kept as a constant."""
    return autograd_traced()


@traced_as(_call)
def _call_traced(
    fn: Callable[..., Any],
    nums: tuple[int, ...],
    has_aux: bool,
    single: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Any]:
    # inside tdfunc.compile: autograd.grad, traced (compiled regions and scan inside keep
    # their own forward and backward graphs); inside a plain torch.compile: torch.func
    if _autograd_traced():
        return _via_autograd(fn, nums, has_aux, single, args, kwargs)
    return _via_func(fn, nums, has_aux, single, args, kwargs)
