"""Structured control flow over TensorDicts and tensorclasses: :func:`cond`, :func:`while_loop`,
:func:`scan`.

These wrap ``torch.cond``, ``torch._higher_order_ops.while_loop`` and
``torch._higher_order_ops.scan`` with the same call conventions. In torch 2.13 those operators
accept only builtin containers of tensors under ``torch.compile`` (and in eager mode, which
compiles them too), so each wrapper flattens its inputs to a tuple of tensors at the boundary,
rebuilds the TensorDicts / tensorclasses inside the user's functions, flattens their results
again, and rebuilds them after the operator. Operands may be any pytree of tensors,
TensorDicts and tensorclasses.

The structure of a result that only the user's function knows (``cond`` branches, the per-step
output of ``scan``) travels out of the operator as the key of a one-entry dict: a hashable
constant that ``torch.compile`` keeps as it is. No state is kept between calls.

Operators built on these reject outputs that alias their inputs; the wrappers clone any output
leaf that *is* an input leaf (a leaf passed through unchanged, common with ``td.set(...)``) or
that appears twice in the output. A *view* of an input (``td.reshape(...)``, ``td[0]``) must
be cloned by the user, as with the torch operators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _errors as E
from ._compat import pytree, torch_scan, torch_while_loop
from ._tree import is_node, match_structure

# Tags inside structure keys. Strings, so that a key is a tuple of plain constants that both
# torch.compile and torch.fx (which records some operator outputs as graph arguments) accept.
_LIST = "\x00tdfunc:list"
_DICT = "\x00tdfunc:dict"
_LEAF = "\x00tdfunc:leaf"


# --------------------------------------------------------------------------------------
# structure keys: a TreeSpec as a hashable tuple of constants, and back
# --------------------------------------------------------------------------------------
def _freeze(x: Any) -> Any:
    if isinstance(x, list):
        return (_LIST, *(_freeze(v) for v in x))
    if isinstance(x, tuple):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return (_DICT, *((k, _freeze(v)) for k, v in x.items()))
    return x


def _thaw(x: Any) -> Any:
    if isinstance(x, tuple):
        if x and x[0] == _LIST:
            return [_thaw(v) for v in x[1:]]
        if x and x[0] == _DICT:
            return {k: _thaw(v) for k, v in x[1:]}
        return tuple(_thaw(v) for v in x)
    return x


def _type_name(typ: type) -> Any:
    """The pytree serialized name of a node type, or the type itself when it has none."""
    entry = pytree.SUPPORTED_SERIALIZED_TYPES.get(typ)
    name = None if entry is None else entry.serialized_type_name
    if name is None or pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name) is not typ:
        return typ
    return name


def _spec_key(spec: pytree.TreeSpec) -> Any:
    if spec.is_leaf():
        return _LEAF
    return (
        _type_name(spec.type),
        _freeze(spec.context),
        tuple(_spec_key(c) for c in spec.children()),
    )


def _key_spec(key: Any) -> pytree.TreeSpec:
    if key == _LEAF:
        return pytree.treespec_leaf()
    name, ctx, children = key
    typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[name] if isinstance(name, str) else name
    return pytree.TreeSpec(typ, _thaw(ctx), [_key_spec(c) for c in children])


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _flatten(tree: Any, what: str) -> tuple[list[Tensor], pytree.TreeSpec]:
    flat, spec = pytree.tree_flatten(tree)
    for i, leaf in enumerate(flat):
        if not isinstance(leaf, Tensor):
            path = pytree.keystr(pytree.tree_flatten_with_path(tree)[0][i][0])
            raise TypeError(E.NOT_TENSOR.format(what=what, typ=type(leaf).__name__, path=path))
    return flat, spec


def _paths(tree: Any) -> list[str]:
    return [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(tree)[0]]


def _difference(expected: Any, got: Any) -> tuple[str, str, str]:
    """Key paths missing from / extra in ``got``, and a note when only metadata differs."""
    pe, pg = _paths(expected), _paths(got)
    se, sg = set(pe), set(pg)
    missing = ", ".join(p for p in pe if p not in sg) or "none"
    extra = ", ".join(p for p in pg if p not in se) or "none"
    detail = ""
    if missing == extra == "none":
        detail = (
            " (the same keys, but container types, key order or batch dims differ: expected "
            f"{_describe(expected)}, got {_describe(got)})"
        )
    return missing, extra, detail


def _describe(tree: Any) -> str:
    nodes = pytree.tree_flatten(tree, is_leaf=is_node)[0]
    return ", ".join(
        f"{type(n).__name__}(keys={list(n._tdf_keys())}, batch_dims={len(n._batch_size)})"
        if is_node(n)
        else type(n).__name__
        for n in nodes
    )


def _unalias(outs: Sequence[Tensor], ins: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Clone output leaves that are input leaves or that repeat an earlier output leaf."""
    fixed: list[Tensor] = []
    for o in outs:
        if any(o is x for x in ins) or any(o is y for y in fixed):
            o = o.clone()
        fixed.append(o)
    return tuple(fixed)


def _in_order_of(expected: Any, got: Any) -> Any:
    """``got`` with each container in the key order of its counterpart in ``expected``
    (containers meet by key: a carry rebuilt with its keys in another order is the same
    carry); anything else as it is, for :func:`_check_structure` to judge."""
    if is_node(expected) and is_node(got):
        m = match_structure(expected, got)
        return got if m is None else m
    if type(expected) is type(got) and type(got) in (tuple, list) and len(expected) == len(got):
        return type(got)(_in_order_of(e, g) for e, g in zip(expected, got))
    if type(expected) is type(got) is dict and list(expected) == list(got):
        return {k: _in_order_of(expected[k], v) for k, v in got.items()}
    return got


def _check_structure(expected: Any, got: Any, what: str, expected_what: str) -> None:
    if pytree.tree_structure(got) != pytree.tree_structure(expected):
        missing, extra, detail = _difference(expected, got)
        raise ValueError(
            E.CONTROL_STRUCTURE.format(
                what=what, expected_what=expected_what, missing=missing, extra=extra, detail=detail
            )
        )


# --------------------------------------------------------------------------------------
# cond
# --------------------------------------------------------------------------------------
def cond(
    pred: Any,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: tuple[Any, ...] | list[Any] = (),
) -> Any:
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``, as ``torch.cond``.

    ``operands`` (a tuple) and the branch results may hold TensorDicts and tensorclasses. Both
    branches must return the same structure (keys, types, batch dims); under
    ``torch.compile`` / ``torch.export`` both are traced and the choice is made at run time.

    Args:
        pred: a boolean scalar tensor (or a Python bool, which picks a branch right away).
        true_fn: called with ``*operands`` when ``pred`` is true.
        false_fn: called with ``*operands`` otherwise.
        operands: a tuple of tensors, TensorDicts, tensorclasses or builtin containers of them.

    Raises:
        ValueError: the branches return different structures (the message names the keys).
        TypeError: an operand leaf is not a tensor.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(x=torch.ones(3), batch_size=[3])
        >>> out = tdfunc.cond(td["x"].sum() > 0, lambda t: t * 2, lambda t: t - 1, (td,))
        >>> out["x"].tolist(), out.batch_size
        ([2.0, 2.0, 2.0], torch.Size([3]))
    """
    operands = tuple(operands)
    flat, in_spec = _flatten(operands, "cond operands")

    def branch(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*xs: Tensor) -> dict[Any, tuple[Tensor, ...]]:
            out = fn(*pytree.tree_unflatten(list(xs), in_spec))
            leaves, spec = _flatten(out, "cond branch output")
            return {_spec_key(spec): _unalias(leaves, xs)}

        return run

    try:
        result = torch.cond(pred, branch(true_fn), branch(false_fn), tuple(flat))
    except RuntimeError as err:
        # torch reports differing branch structures without naming them: name them
        _raise_if_branches_differ(true_fn, false_fn, operands, err)
        raise
    ((key, leaves),) = result.items()
    return pytree.tree_unflatten(list(leaves), _key_spec(key))


def _raise_if_branches_differ(
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    operands: tuple[Any, ...],
    err: Exception,
) -> None:
    """After torch.cond failed: run both branches on meta copies; raise if structures differ."""
    meta = pytree.tree_map(lambda t: torch.empty_like(t, device="meta"), operands)
    try:
        with torch.no_grad():
            a, b = true_fn(*meta), false_fn(*meta)
    except Exception:
        return  # the branches cannot run on meta tensors: keep torch's error
    if pytree.tree_structure(a) != pytree.tree_structure(b):
        missing, extra, detail = _difference(a, b)
        raise ValueError(
            E.COND_BRANCHES.format(missing=missing, extra=extra, detail=detail)
        ) from err


# --------------------------------------------------------------------------------------
# while_loop
# --------------------------------------------------------------------------------------
def while_loop(
    cond_fn: Callable[..., Any], body_fn: Callable[..., Any], carried_inputs: tuple[Any, ...]
) -> Any:
    """Run ``carried = body_fn(*carried)`` while ``cond_fn(*carried)``, as
    ``torch._higher_order_ops.while_loop``.

    ``carried_inputs`` is a tuple that may hold TensorDicts and tensorclasses; ``body_fn``
    returns a tuple of the same structure (keys, batch dims, shapes and dtypes), and may return
    leaves of its inputs unchanged. ``cond_fn`` returns a boolean scalar tensor.

    Args:
        cond_fn: ``(*carried) -> bool tensor``.
        body_fn: ``(*carried) -> tuple`` like ``carried_inputs``.
        carried_inputs: the initial values (a tuple).

    Returns:
        The final carried values, a tuple of the structure of ``carried_inputs``.

    Raises:
        ValueError: ``body_fn`` returns another structure; the message names the differing
            keys. torch raises it from inside its tracing, so it reaches the caller wrapped in a
            torch error (``RuntimeError`` / ``torch._dynamo.exc.Unsupported``) whose text
            contains the message.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(x=torch.zeros(2), n=torch.zeros(2), batch_size=[2])
        >>> step = lambda i, t: (i + 1, t.set("x", t["x"] + i))  # "n" passes through
        >>> i, out = tdfunc.while_loop(lambda i, t: i < 4, step, (torch.tensor(0), td))
        >>> int(i), out["x"].tolist()
        (4, [6.0, 6.0])
    """
    carried = tuple(carried_inputs)
    flat, spec = _flatten(carried, "while_loop carried_inputs")

    def cond_flat(*xs: Tensor) -> Any:
        return cond_fn(*pytree.tree_unflatten(list(xs), spec))

    def body_flat(*xs: Tensor) -> tuple[Tensor, ...]:
        ins = pytree.tree_unflatten(list(xs), spec)
        out = body_fn(*ins)
        if isinstance(out, list):
            out = tuple(out)
        elif not isinstance(out, tuple):
            out = (out,)
        out = _in_order_of(ins, out)
        _check_structure(ins, out, "while_loop body_fn", "carried_inputs")
        return _unalias(pytree.tree_leaves(out), xs)

    result = torch_while_loop()(cond_flat, body_flat, tuple(flat))
    return pytree.tree_unflatten(list(result), spec)


# --------------------------------------------------------------------------------------
# scan
# --------------------------------------------------------------------------------------
def _check_scan_dim(xs: Any, dim: int) -> None:
    for n in pytree.tree_flatten(xs, is_leaf=is_node)[0]:
        if is_node(n) and not 0 <= dim < len(n._batch_size):
            raise ValueError(
                E.SCAN_DIM.format(
                    cls=type(n).__name__,
                    batch_size=tuple(n._batch_size),
                    dim=dim,
                    batch_dims=len(n._batch_size),
                )
            )


def scan(
    combine_fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    *,
    dim: int = 0,
    reverse: bool = False,
    unroll: bool = False,
) -> tuple[Any, Any]:
    """Inclusive scan, as ``torch._higher_order_ops.scan``, over TensorDicts and tensorclasses.

    ``combine_fn(carry, x) -> (next_carry, y)`` is called for each slice ``x`` of ``xs`` along
    ``dim`` (for a TensorDict / tensorclass, one of its batch dims: the slice has that batch dim
    removed). ``next_carry`` has the structure of ``init``; the ``y`` are stacked along ``dim``
    (a TensorDict ``y`` gains a batch dim there).

    Args:
        combine_fn: ``(carry, x) -> (next_carry, y)``.
        init: the initial carry (tensors, TensorDicts, tensorclasses, containers of them).
        xs: the sequence to scan over.
        dim: the dim of ``xs`` to scan over.
        reverse: scan from the end.
        unroll: run ``combine_fn`` in a Python loop, once per slice, instead of torch's scan
            operator (JAX's ``lax.scan(unroll=...)``, fully unrolled): the same results, no
            loop at run time, and gradients through it with :func:`tdfunc.value_and_grad`
            inside :func:`tdfunc.compile`. Each slice is a copy (``.clone()``), so every call
            sees inputs of the same shape, strides and storage offset. Do not wrap
            ``combine_fn`` in ``torch.compiler.nested_compile_region`` for a compiled training
            step yet: torch 2.13-2.15's inductor computes wrong gradients for a region that
            reads slices of a stacked tensor (eager and ``aot_eager`` are right; see the
            training-loop guide).

    Returns:
        ``(final_carry, ys)``.

    Raises:
        ValueError: ``dim`` is not a batch dim of a container in ``xs``; or ``next_carry`` has
            another structure than ``init`` (raised from inside torch's tracing, so it reaches
            the caller wrapped in a torch error whose text contains the message). With
            ``unroll=True`` also: the leaves of ``xs`` differ in size along ``dim`` (the message
            names them), ``xs`` has no slice, or ``y`` changes structure between slices.
        TypeError: ``unroll`` is not a bool; ``combine_fn`` does not return a pair.

    Example:
        >>> import torch, tdfunc
        >>> xs = tdfunc.TensorDict(r=torch.ones(5, 2), batch_size=[5, 2])
        >>> total, ys = tdfunc.scan(lambda c, x: (c + x, c + x), xs[0] * 0, xs)
        >>> total["r"].tolist(), ys.batch_size
        ([5.0, 5.0], torch.Size([5, 2]))
        >>> total2, ys2 = tdfunc.scan(lambda c, x: (c + x, c + x), xs[0] * 0, xs, unroll=True)
        >>> bool((total2 == total).all()), bool((ys2 == ys).all())
        (True, True)
    """
    if not isinstance(unroll, bool):
        raise TypeError(E.SCAN_UNROLL.format(value=unroll))
    _check_scan_dim(xs, dim)
    flat_init, init_spec = _flatten(init, "scan init")
    flat_xs, xs_spec = _flatten(xs, "scan xs")
    if unroll:
        return _scan_unrolled(combine_fn, init, xs, flat_xs, xs_spec, dim, reverse)
    n_init = len(flat_init)

    def combine_flat(carry: list[Tensor], x: list[Tensor]) -> tuple[Any, Any]:
        c = pytree.tree_unflatten(list(carry), init_spec)
        out = combine_fn(c, pytree.tree_unflatten(list(x), xs_spec))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(E.SCAN_PAIR.format(typ=type(out).__name__))
        new_c, y = out
        new_c = _in_order_of(c, new_c)
        _check_structure(c, new_c, "scan combine_fn (next_carry)", "init")
        y_leaves, y_spec = _flatten(y, "scan combine_fn output y")
        leaves = _unalias(pytree.tree_leaves(new_c) + y_leaves, [*carry, *x])
        return list(leaves[:n_init]), {_spec_key(y_spec): leaves[n_init:]}

    carry, ys = torch_scan()(combine_flat, flat_init, flat_xs, dim=dim, reverse=reverse)
    ((key, y_leaves),) = ys.items()
    return (
        pytree.tree_unflatten(list(carry), init_spec),
        pytree.tree_unflatten(list(y_leaves), _key_spec(key)),
    )


def _scan_unrolled(
    combine_fn: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any,
    flat_xs: list[Tensor],
    xs_spec: pytree.TreeSpec,
    dim: int,
    reverse: bool,
) -> tuple[Any, Any]:
    """:func:`scan` as a Python loop (``unroll=True``): one ``combine_fn`` call per cloned
    slice, the ``y`` stacked along ``dim`` (as the operator stacks them)."""
    n = flat_xs[0].shape[dim] if flat_xs else 0
    for leaf in flat_xs[1:]:
        if leaf.shape[dim] != n:
            paths = _paths(xs)
            m = leaf.shape[dim]
            at = next(i for i, t in enumerate(flat_xs) if t.shape[dim] != n)
            raise ValueError(
                E.SCAN_LENGTH.format(dim=dim, first=paths[0], n=n, path=paths[at], m=m)
            )
    if n == 0:
        raise ValueError(E.SCAN_EMPTY.format(dim=dim))
    carry = init
    ys: list[list[Tensor]] = []
    y_spec: pytree.TreeSpec | None = None
    first_y: Any = None
    for i in range(n - 1, -1, -1) if reverse else range(n):
        x = pytree.tree_unflatten([t.select(dim, i).clone() for t in flat_xs], xs_spec)
        out = combine_fn(carry, x)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(E.SCAN_PAIR.format(typ=type(out).__name__))
        new_c, y = out
        new_c = _in_order_of(init, new_c)
        _check_structure(init, new_c, "scan combine_fn (next_carry)", "init")
        if first_y is None:
            first_y = y
        y = _in_order_of(first_y, y)
        y_leaves, spec = _flatten(y, "scan combine_fn output y")
        if y_spec is None:
            y_spec = spec
        elif spec != y_spec:
            missing, extra, note = _difference(pytree.tree_unflatten(ys[0], y_spec), y)
            detail = f"missing {missing}, extra {extra}{note}"
            raise ValueError(E.SCAN_Y_STRUCTURE.format(i=i, detail=detail))
        carry = new_c
        ys.append(y_leaves)
    if reverse:
        ys.reverse()
    assert y_spec is not None
    stacked = [torch.stack(column, dim) for column in zip(*ys)] if ys[0] else []
    return carry, pytree.tree_unflatten(stacked, y_spec)


__all__ = ["cond", "scan", "while_loop"]
