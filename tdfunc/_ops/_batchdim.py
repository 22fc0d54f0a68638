"""Torch functions over the batch dims of a container: reductions, scans, softmax, sorting,
shape and index ops, ``pad`` and ``pad_sequence``.

Which torch functions lift, and how, is read from torch's own metadata (ATen schemas and
tags), one rule per family:

- **over dims** (:func:`_over_dims`): every argument named ``dim`` / ``dims`` / ``dim0`` /
  ``dim1`` / ``axis0`` / ``axis1`` / ``source`` / ``destination`` with an integer type in
  the function's schema names a *batch* dim (negative dims count from the end of the batch
  dims; a dim outside them is an ``IndexError`` naming the dim and the batch size); the
  function runs on every leaf with those dims, and the new batch size is read from the
  first result (each leaf keeps its feature dims, at the end). Index tensors (``index``,
  ``indices``, ``src``) with one dim per batch dim are aligned with the batch dims and
  expanded over each leaf's feature dims (``gather``, ``scatter``, ``take_along_dim``); a
  container operand gives its leaves. Reductions (an overload tagged
  ``torch.Tag.reduction`` or one that takes ``keepdim``) with no dim reduce each whole leaf
  (``batch_size=()``), as :func:`reduce` always did; for every other op a dim is required.
  Results that torch returns as named tuples (``max``/``min``/``sort``/``topk`` with a dim,
  ``cummax`` ...) come back as the same named tuple of containers (``.values``,
  ``.indices``); a list of tensors (``tensor_split``) as a tuple of containers.
  A container with ``batch_size=()`` accepts dim ``0`` / ``-1`` as a 0-d tensor does.
- **sizes over batch dims** (:func:`_sizes`): ``repeat`` / ``tile`` take one size per batch
  dim (``tile`` pads on the left as torch does); feature dims are kept.
- ``expand_as`` (the batch size of a container, or the shape of a tensor), ``masked_select``
  with a batch-shaped mask (``td[mask]``: ``batch_size=[n_selected]``), ``pad`` (constant
  padding of the last batch dims) and ``pad_sequence`` (containers of one structure, padded
  along their first batch dim).

:func:`rule_for` gives the rule of a torch function (``None`` when it is not of these
families); :data:`METHODS` is the table of container methods that are sugar over them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _errors as E
from .._compat import pad_sequence_op
from .._jagged._layout import layout_of
from .._jagged._layout import refuse as refuse_jagged
from .._tree import is_node, leaves, leaves_and_nontensors, map_leaves
from ._indexing import index
from ._math import elementwise
from ._pointwise import align_to_batch
from ._pointwise import rule_for as _pointwise_rule
from ._shape import _map_shape, expand, squeeze, unsqueeze
from ._structure import check_batch_invariant, match_structure, norm_dim, refuse_per_sample

# --------------------------------------------------------------------------------------
# schemas: what each argument of a torch function is
# --------------------------------------------------------------------------------------
#: argument names that name dims, when the schema types them as integers
_DIM_NAMES = frozenset(
    {"dim", "dims", "dim0", "dim1", "axis", "axis0", "axis1", "source", "destination"}
)
#: tensor arguments that address positions of the input (one dim per batch dim): aligned
#: with the batch dims and expanded over each leaf's feature dims
_ALIGN_NAMES = frozenset({"index", "indices", "src"})
_REQUIRED = inspect.Parameter.empty
#: ``isinstance(x, Tensor)`` under another name: traced code that also reads ``_tree``'s
#: ``Tensor`` would reach one class through two module globals, which Dynamo guards with a
#: Python identity check on every compiled call
_is_tensor = torch.is_tensor


class _Sig(NamedTuple):
    """One way to call a torch function: its arguments and what each one is."""

    names: tuple[str, ...]
    n_pos: int  # how many can be given by position
    kinds: tuple[str, ...]  # "T" tensor, "TL" tensor list, "I" int, "IL" ints, "B" bool,
    # "N" number, "D" dtype, "S" str, "?" anything; a trailing "?" when None is accepted
    defaults: tuple[Any, ...]
    dims: tuple[int, ...]  # positions of the dim arguments
    aligned: tuple[int, ...]  # positions of the tensors aligned with the batch dims
    reduction: bool  # a reduction: no dim reduces each whole leaf
    pointwise: bool  # this overload is elementwise (``max(td, other)``): not ours
    checks: tuple[Callable[[Any], bool], ...] = ()  # what each argument accepts (by kind)
    operands: tuple[int, ...] = ()  # positions after the input that can hold a tensor
    # positions of the arguments without a default: read from here while binding, not by
    # comparing each default with the sentinel (two defaults that are the one sentinel
    # object cost a Python identity guard per compiled call)
    required: tuple[int, ...] = ()


def _kind(typ: str) -> str:
    opt = typ.startswith("Optional[")
    if opt:
        typ = typ[len("Optional[") : -1]
    k = {
        "Tensor": "T",
        "List[Tensor]": "TL",
        "int": "I",
        "List[int]": "IL",
        "bool": "B",
        "float": "N",
        "number": "N",
        "ScalarType": "D",
        "str": "S",
    }.get(typ, "?")
    return k + "?" if opt else k


#: read once here: traced code that reaches ``torch`` through this module's global while the
#: caller's frame reaches it through its own costs a Python identity guard per compiled call.
#: The tuples are written where they are used: a tuple global costs a guard on its type, its
#: length and each item per compiled call, a class global one
_SymInt = torch.SymInt
_Size = torch.Size


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, _SymInt)) and not isinstance(v, bool)


#: what each kind of argument accepts
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "T": lambda v: _is_tensor(v) or is_node(v),
    "I": _is_int,
    "IL": lambda v: _is_int(v) or isinstance(v, (list, tuple, _Size)),
    "B": lambda v: isinstance(v, bool),
    "N": lambda v: isinstance(v, (int, float, complex, torch.SymInt, torch.SymFloat)),
    "D": lambda v: isinstance(v, torch.dtype),
    "S": lambda v: isinstance(v, str),
    "TL": lambda v: isinstance(v, (list, tuple)),
    "?": lambda v: True,
}


def _check_of(kind: str) -> Callable[[Any], bool]:
    base = _CHECKS[kind.rstrip("?")] if kind != "?" else _CHECKS["?"]
    if kind.endswith("?") and kind != "?":
        return lambda v: v is None or base(v)
    return base


def _fits(kind: str, v: Any) -> bool:
    return _check_of(kind)(v)


def _operands(kinds: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(kinds) if i > 0 and k[0] in "T?")


def _is_dim(name: str, kind: str) -> bool:
    return name in _DIM_NAMES and kind.rstrip("?") in ("I", "IL")


def _aten_sigs(name: str, reduction: bool) -> tuple[_Sig, ...]:
    """The ATen overloads of ``aten::<name>`` that take a tensor first and write nothing."""
    packet = getattr(torch.ops.aten, name, None)
    out: list[_Sig] = []
    if packet is None:
        return ()
    for overload in packet.overloads():
        op = getattr(packet, overload)
        s = op._schema
        args = s.arguments
        if not args or str(args[0].type) != "Tensor":
            continue
        if any(a.alias_info is not None and a.alias_info.is_write for a in args):
            continue  # out= and in-place overloads
        if "Dimname" in str(s):
            continue  # named tensors
        names = tuple(a.name for a in args)
        kinds = tuple(_kind(str(a.real_type)) for a in args)
        defaults = tuple(a.default_value if a.has_default_value() else _REQUIRED for a in args)
        n_pos = sum(1 for a in args if not a.kwarg_only)
        tags = op.tags
        out.append(
            _Sig(
                names,
                n_pos,
                kinds,
                defaults,
                tuple(i for i, (n, k) in enumerate(zip(names, kinds)) if _is_dim(n, k)),
                tuple(
                    i
                    for i, (n, k) in enumerate(zip(names, kinds))
                    if n in _ALIGN_NAMES and k[0] == "T"
                )
                if not name.startswith("index_")  # index_select's index is along one dim
                else (),
                reduction or torch.Tag.reduction in tags or "keepdim" in names,
                torch.Tag.pointwise in tags,
                tuple(_check_of(k) for k in kinds),
                _operands(kinds),
                _required(defaults),
            )
        )
    return tuple(out)


def _py_sig(func: Callable[..., Any], aten: tuple[_Sig, ...]) -> _Sig:
    """A Python function's signature (``F.softmax``, ``torch.norm``): names and defaults
    from Python, what each argument is from the ATen overloads of the same name."""
    params = list(inspect.signature(func).parameters.values())
    names = tuple(p.name for p in params)
    kinds_by_name = {n: k for s in aten for n, k in zip(s.names, s.kinds)}
    kinds = tuple(
        "T" if i == 0 else kinds_by_name.get(n, "I").rstrip("?") + "?" if n in _DIM_NAMES else "?"
        for i, n in enumerate(names)
    )
    return _Sig(
        names,
        sum(1 for p in params if p.kind <= inspect.Parameter.POSITIONAL_OR_KEYWORD),
        kinds,
        tuple(p.default for p in params),
        tuple(i for i, (n, k) in enumerate(zip(names, kinds)) if _is_dim(n, k)),
        (),
        any(s.reduction for s in aten),
        False,
        tuple(_check_of(k) for k in kinds),
        _operands(kinds),
        _required(tuple(p.default for p in params)),
    )


def _required(defaults: tuple[Any, ...]) -> tuple[int, ...]:
    return tuple(i for i, d in enumerate(defaults) if d is _REQUIRED)


def _bind(
    sigs: tuple[_Sig, ...], args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[_Sig | None, Sequence[Any]]:
    """The first overload the arguments fit (by count, name and kind), as torch picks one,
    and the positional arguments as that overload takes them."""
    for s in sigs:
        a = args
        if len(a) > s.n_pos:
            if not (s.n_pos == 2 and s.kinds[1] == "IL" and all(_fits("I", v) for v in a[1:])):
                continue
            a = (a[0], list(a[1:]))  # ``x.flip(0, 1)``: the int list given as varargs
        checks = s.checks
        if not all(checks[i](v) for i, v in enumerate(a)):
            continue
        ok = True
        for k, v in kwargs.items():
            if k not in s.names:
                ok = False
                break
            i = s.names.index(k)
            if i < len(a) or not checks[i](v):
                ok = False
                break
        if not ok:
            continue
        if any(i >= len(a) and s.names[i] not in kwargs for i in s.required):
            continue
        return s, a
    return None, args


# --------------------------------------------------------------------------------------
# the family "over dims": reductions, scans, softmax, sorting, dim-wise shape / index ops
# --------------------------------------------------------------------------------------
def _get(args: list[Any], kw: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if i < len(args) else kw[name]


def _put(args: list[Any], kw: dict[str, Any], i: int, name: str, value: Any) -> None:
    if i < len(args):
        args[i] = value
    else:
        kw[name] = value


def _norm_dims(value: Any, bs: torch.Size) -> Any:
    nd = max(len(bs), 1)  # a 0-d batch takes 0 and -1, as a 0-d tensor
    if isinstance(value, (list, tuple, _Size)):
        return [norm_dim(d, nd, bs) for d in value]
    return norm_dim(value, nd, bs)


def _is_all(value: Any) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and len(value) == 0)


def _result(node: Any, outs: list[Any], first_leaf: Tensor, bd: int, whole: bool) -> Any:
    """The container(s) of per-leaf results; the batch size read from the first result."""
    r0 = outs[0]
    if _is_tensor(r0):
        if whole:  # each whole leaf reduced: 0-d, or all-ones with keepdim
            bs = r0.shape[:bd] if r0.ndim == first_leaf.ndim else torch.Size(())
            return map_leaves(node, outs, bs, node._device, False)
        feat = first_leaf.ndim - bd
        # every argument given: a default that a call uses costs a guard when compiled
        return map_leaves(node, outs, r0.shape[: r0.ndim - feat], node._device, True)
    # a tuple of tensors (a torch.return_types named tuple, or a list of pieces)
    parts = [_result(node, [o[j] for o in outs], first_leaf, bd, whole) for j in range(len(r0))]
    if hasattr(r0, "n_fields"):  # torch.return_types.*: the same type, holding containers
        return type(r0)(parts)
    return tuple(parts)


def _input_first(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The input given by keyword (``torch.sum(input=td, dim=0)``) moved to the front, as
    torch's Python binding does: ``input`` is its name for ATen's first argument ``self``."""
    if args or "input" not in kwargs:
        return args, kwargs
    return (kwargs["input"],), {k: v for k, v in kwargs.items() if k != "input"}


def _over_dims(name: str, func: Callable[..., Any], sigs: tuple[_Sig, ...]) -> Callable[..., Any]:
    """The rule of a torch function whose dim arguments name batch dims."""

    def rule(*args: Any, **kwargs: Any) -> Any:
        if not args:
            args, kwargs = _input_first(args, kwargs)
        sig, bound = _bind(sigs, args, kwargs)
        if sig is None:
            raise TypeError(
                E.BATCHDIM_NO_OVERLOAD.format(
                    op=name,
                    args=", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs]),
                )
            )
        if sig.pointwise:  # max(td, other) & co: the pointwise family's rule
            pointwise = _pointwise_rule(func)
            if pointwise is not None:
                return pointwise(*args, **kwargs)
            return elementwise(func, bound, kwargs)
        node = bound[0] if bound else kwargs.get(sig.names[0])
        if not is_node(node):
            raise TypeError(E.BATCHDIM_SELF.format(op=name, typ=type(node).__name__))
        return _lift(name, func, sig, node, list(bound), {**kwargs})

    rule.__name__ = f"over_batch_dims[{name}]"
    return rule


def _lift(
    name: str, func: Callable[..., Any], sig: _Sig, node: Any, args: list[Any], kw: dict[str, Any]
) -> Any:
    bs = node._batch_size
    bd = len(bs)
    whole = False
    any_dim = False
    for i in sig.dims:
        n = sig.names[i]
        given = i < len(args) or n in kw
        value = _get(args, kw, i, n) if given else sig.defaults[i]
        if value is _REQUIRED:
            continue
        if value is None or (not given and _is_all(value)):
            if sig.reduction:  # no dim: each whole leaf is reduced
                whole = True
                continue
            raise ValueError(
                E.BATCHDIM_NEEDS_DIM.format(op=name, arg=n, batch_size=tuple(bs), value=value)
            )
        any_dim = True
        if _is_all(value) and sig.reduction:  # an explicit empty list: every batch dim
            _put(args, kw, i, n, list(range(bd)))
        else:
            _put(args, kw, i, n, _norm_dims(value, bs))
    if bd == 0 and any_dim and not whole:
        return _zero_d(name, func, sig, node, args, kw)
    # the slots that change per leaf: container operands and aligned index tensors
    slots: list[tuple[int, str, Any, bool]] = []
    for i in sig.operands:
        n = sig.names[i]
        if not (i < len(args) or n in kw):
            continue
        v = _get(args, kw, i, n)
        if is_node(v):
            slots.append((i, n, leaves(match_structure(node, v, name)), False))
        elif i in sig.aligned and _is_tensor(v):
            if v.ndim != bd:
                raise ValueError(
                    E.BATCHDIM_ALIGN.format(
                        op=name, arg=n, shape=tuple(v.shape), batch_size=tuple(bs)
                    )
                )
            slots.append((i, n, v, True))
    ls, nts = leaves_and_nontensors(node)
    if any_dim and not whole:  # torch defines no op on the batch dim alone of a jagged leaf
        refuse_jagged(node, name, "", ls)
        if nts:  # nor can a per-sample value follow an op by the leaves' values
            refuse_per_sample(node, nts, name)
    if not ls:  # no leaves: the batch size from a meta tensor of the batch shape
        ls = [torch.empty(bs, device="meta")]
        slots = [(i, n, v.to("meta"), al) for i, n, v, al in slots if not isinstance(v, list)]
    if not slots and args:  # the common case: only the input changes from leaf to leaf
        rest = args[1:]
        return _result(node, [func(x, *rest, **kw) for x in ls], ls[0], bd, whole)
    outs = []
    self_name = sig.names[0]
    for j, x in enumerate(ls):
        _put(args, kw, 0, self_name, x)
        for i, n, v, al in slots:
            _put(
                args,
                kw,
                i,
                n,
                v[j] if isinstance(v, list) else align_to_batch(v, bd, x) if al else v,
            )
        outs.append(func(*args, **kw))
    return _result(node, outs, ls[0], bd, whole)


def _zero_d(
    name: str, func: Callable[..., Any], sig: _Sig, node: Any, args: list[Any], kw: dict[str, Any]
) -> Any:
    """A container with ``batch_size=()`` and dim 0 / -1 (as a 0-d tensor takes them): the op
    over a batch dim of size 1, which is then removed again when the op kept it."""
    aligned = {sig.names[i] for i in sig.aligned}

    def up(v: Any, aligned_slot: bool) -> Any:
        if is_node(v):
            return unsqueeze(v, 0)
        if aligned_slot and _is_tensor(v) and v.ndim == 0:
            return v.unsqueeze(0)
        return v

    args = [up(v, i in sig.aligned) for i, v in enumerate(args)]
    kw = {k: up(v, k in aligned) for k, v in kw.items()}
    out = _lift(name, func, sig, args[0] if args else kw[sig.names[0]], args, kw)
    return _down(out)


def _down(out: Any) -> Any:
    if is_node(out):
        return squeeze(out, 0) if len(out._batch_size) == 1 else out
    if hasattr(out, "n_fields"):
        return type(out)([_down(o) for o in out])
    return tuple(_down(o) for o in out)


# --------------------------------------------------------------------------------------
# the other families
# --------------------------------------------------------------------------------------
def _sizes_arg(sizes: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, _Size)):
        return tuple(sizes[0])
    return tuple(sizes)


def repeat(node: Any, *sizes: Any) -> Any:
    """Repeat along the batch dims (one count per batch dim, more add leading batch dims).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2, 3), batch_size=[2])
        >>> repeat(td, 3)["a"].shape
        torch.Size([6, 3])
    """
    bs = node._batch_size
    reps = _sizes_arg(sizes)
    if len(reps) < len(bs):
        raise ValueError(
            E.BATCHDIM_SIZES.format(
                op="repeat", sizes="repeats", n=len(reps), bd=len(bs), batch_size=tuple(bs)
            )
        )
    return _map_shape(node, lambda x: x.repeat(*reps, *(1,) * (x.ndim - len(bs))))


def tile(node: Any, *sizes: Any) -> Any:
    """``torch.tile`` over the batch dims: fewer counts than batch dims count from the last.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2, 3, 4), batch_size=[2, 3])
        >>> tile(td, (2,))["a"].shape
        torch.Size([2, 6, 4])
    """
    bs = node._batch_size
    reps = _sizes_arg(sizes)
    reps = (1,) * (len(bs) - len(reps)) + reps
    return _map_shape(node, lambda x: x.repeat(*reps, *(1,) * (x.ndim - len(bs))))


def expand_as(node: Any, other: Any) -> Any:
    """Expand the batch dims to ``other``'s batch size (a container) or shape (a tensor)."""
    return expand(node, other._batch_size if is_node(other) else other.shape)


def masked_select(node: Any, mask: Tensor) -> Any:
    """The batch entries where ``mask`` (of the batch size) is true: ``td[mask]``, with
    ``batch_size=[n_selected]``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.arange(6.0).reshape(3, 2), batch_size=[3])
        >>> masked_select(td, torch.tensor([True, False, True]))["a"].tolist()
        [[0.0, 1.0], [4.0, 5.0]]
    """
    if not _is_tensor(mask) or mask.shape != node._batch_size:
        raise ValueError(
            E.BATCHDIM_MASK.format(
                op="masked_select",
                shape=tuple(getattr(mask, "shape", ())),
                batch_size=tuple(node._batch_size),
            )
        )
    if mask.dtype != torch.bool:
        raise TypeError(E.BATCHDIM_MASK_DTYPE.format(op="masked_select", dtype=mask.dtype))
    return index(node, mask)


def pad(node: Any, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Any:
    """Constant padding of the last batch dims (``pad`` as in ``F.pad``: ``(left, right)``
    of the last batch dim first); feature dims are not padded.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), batch_size=[2])
        >>> pad(td, [1, 0])["a"][:, 0].tolist()
        [0.0, 1.0, 1.0]
    """
    bs = node._batch_size
    pads = tuple(pad)
    if mode != "constant":
        what = f"mode {mode!r} pads the last dims of each leaf, which are feature dims"
        raise ValueError(E.BATCHDIM_PAD.format(op="pad", what=what, batch_size=tuple(bs)))
    if len(pads) % 2 or len(pads) // 2 > len(bs):
        what = f"{len(pads)} pad values do not fit {len(bs)} batch dims"
        raise ValueError(E.BATCHDIM_PAD.format(op="pad", what=what, batch_size=tuple(bs)))
    fill = 0.0 if value is None else value

    def f(x: Tensor) -> Tensor:
        return torch.constant_pad_nd(x, (0, 0) * (x.ndim - len(bs)) + pads, fill)

    return _map_shape(node, f)


def pad_sequence(
    sequences: Sequence[Any],
    batch_first: bool = False,
    padding_value: float = 0.0,
    padding_side: str = "right",
) -> Any:
    """``torch.nn.utils.rnn.pad_sequence`` of containers of one structure: padded along their
    first batch dim and stacked (``batch_size=[B, L, ...]`` with ``batch_first``, else
    ``[L, B, ...]``).

    Example:
        >>> import torch, tdfunc
        >>> a = tdfunc.TensorDict(x=torch.ones(2, 3), batch_size=[2])
        >>> b = tdfunc.TensorDict(x=torch.ones(4, 3), batch_size=[4])
        >>> pad_sequence([a, b], batch_first=True).batch_size
        torch.Size([2, 4])
    """
    nodes = list(sequences)
    first = nodes[0]
    nodes = [first, *(match_structure(first, n, "pad_sequence") for n in nodes[1:])]
    for n in nodes:
        if not n._batch_size:
            raise RuntimeError(E.NEEDS_A_BATCH_DIM.format(op="pad_sequence"))
    columns = [leaves(n) for n in nodes]
    out = [
        torch.nn.utils.rnn.pad_sequence(list(c), batch_first, padding_value, padding_side)
        for c in zip(*columns)
    ]
    lens = [n._batch_size[0] for n in nodes]
    rest = first._batch_size[1:]
    longest = max(lens)
    bs = torch.Size([len(nodes), longest, *rest] if batch_first else [longest, len(nodes), *rest])
    check_batch_invariant(first, out, bs, "pad_sequence")
    return map_leaves(first, out, bs)


def common_layout(node: Any) -> torch.layout | None:
    """The layout of every leaf (``torch.strided`` without leaves), ``None`` when they differ;
    a leaf's layout is asked under its ``torch.func`` / ``torch.vmap`` wrappers.

    Example:
        >>> import torch, tdfunc
        >>> common_layout(tdfunc.TensorDict(a=torch.zeros(2)))
        torch.strided
    """
    found = {layout_of(x) for x in leaves(node)}  # asked under transform wrappers
    if not found:
        return torch.strided
    return found.pop() if len(found) == 1 else None


def _every_leaf(pred: str) -> Callable[..., bool]:
    """``torch.is_floating_point(td)`` / ``is_complex``: true when every leaf is (the query
    the Python-level reductions of ``torch.masked`` make before they call torch)."""

    def rule(input: Any) -> bool:
        return all(getattr(x, pred)() for x in leaves(input))

    return rule


# --------------------------------------------------------------------------------------
# reductions with the signature of the container methods (``td.sum(dim, keepdim)``)
# --------------------------------------------------------------------------------------
def reduce(node: Any, name: str, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    """Reduce every leaf with ``torch.<name>``.

    With ``dim=None`` each leaf is reduced whole (the result has ``batch_size=()``, 0-d leaves);
    with ``dim`` (an int or a tuple of batch dims) only those batch dims are reduced.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(4, 3), batch_size=[4])
        >>> td.sum(dim=0)["a"].tolist(), td.sum()["a"].item()
        ([4.0, 4.0, 4.0], 12.0)
    """
    fn = _REDUCE_FNS.get(name) or getattr(torch, name)
    if dim is None:
        return map_leaves(
            node, [fn(x, **kwargs) for x in leaves(node)], torch.Size(()), keep_extra=False
        )
    bs = node._batch_size
    asked = dim if isinstance(dim, (tuple, list)) else (dim,)
    dims = sorted({_norm_dims(d, bs) for d in asked})
    if name in _ONE_DIM:  # torch takes one dim: reduce them one at a time, the last first
        out = node
        for d in reversed(dims):
            out = _RULES[fn](out, d, keepdim=keepdim, **kwargs)
        return out
    if not bs:  # dim 0 / -1 of a 0-d batch: the rule's 0-d path
        return _RULES[fn](node, dims, keepdim=keepdim, **kwargs)
    # the hot path of td.sum(0) & co: the dims are known batch dims, nothing to bind
    ls = leaves(node)
    refuse_jagged(node, name, "", ls)  # torch reduces a jagged batch dim only with its ragged dim
    out = [fn(x, dims, keepdim=keepdim, **kwargs) for x in ls]
    new_bd = len(bs) if keepdim else len(bs) - len(dims)
    if out:  # the batch size read from the first result, as _result does
        return map_leaves(node, out, out[0].shape[:new_bd], node._device, True)
    if keepdim:
        new_bs = torch.Size([1 if i in dims else s for i, s in enumerate(bs)])
    else:
        new_bs = torch.Size([s for i, s in enumerate(bs) if i not in dims])
    return map_leaves(node, out, new_bs)


#: reductions whose torch function takes a single dim
_ONE_DIM = frozenset({"prod", "all", "any"})
#: the torch function of each reduction method (``td.sum(0)``...), read from here in traced
#: code: see ``_SymInt``
_REDUCE_FNS: dict[str, Callable[..., Any]] = {
    n: getattr(torch, n)
    for n in ("sum", "mean", "prod", "amax", "amin", "std", "var", "all", "any")
}


def all_(node: Any, dim: Any = None) -> Any:
    """0-d bool tensor: every element of every leaf is true (or a node reduced over ``dim``)."""
    if dim is not None:
        return reduce(node, "all", dim)
    ls = leaves(node)
    if not ls:
        return torch.tensor(True)
    return torch.stack([x.all() for x in ls]).all()


def any_(node: Any, dim: Any = None) -> Any:
    """0-d bool tensor: some element of some leaf is true (or a node reduced over ``dim``)."""
    if dim is not None:
        return reduce(node, "any", dim)
    ls = leaves(node)
    if not ls:
        return torch.tensor(False)
    return torch.stack([x.any() for x in ls]).any()


# --------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------
#: the families, by ATen name (the rule is the same for every name of a family; what each
#: argument is comes from the name's schemas)
FAMILIES: dict[str, list[str]] = {
    "reductions": [
        "sum",
        "mean",
        "nansum",
        "nanmean",
        "prod",
        "amax",
        "amin",
        "aminmax",
        "std",
        "var",
        "std_mean",
        "var_mean",
        "all",
        "any",
        "argmax",
        "argmin",
        "count_nonzero",
        "logsumexp",
        "norm",
        "linalg_vector_norm",
        "max",
        "min",
        "median",
        "nanmedian",
        "mode",
        "kthvalue",
        "quantile",
        "nanquantile",
        "hash_tensor",
        "special_logsumexp",
    ],
    "scans": ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"],
    "softmax": ["softmax", "log_softmax", "special_softmax", "special_log_softmax"],
    "sorting": ["sort", "argsort", "topk", "msort"],
    "shape": [
        "flip",
        "roll",
        "rot90",
        "narrow",
        "movedim",
        "moveaxis",
        "swapdims",
        "swapaxes",
        "tensor_split",
        "repeat_interleave",
    ],
    "index": [
        "gather",
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_select",
        "take_along_dim",
    ],
    "sizes": ["repeat", "tile"],
    "other": ["expand_as", "masked_select", "pad", "constant_pad_nd", "pad_sequence"],
}


def _tile_rule(input: Any, *sizes: Any, dims: Any = None) -> Any:
    return tile(input, *(sizes if dims is None else (dims,)))


def _masked_select_rule(input: Any, mask: Tensor) -> Any:
    return masked_select(input, mask)


#: the rules of these names take their arguments under torch's names (``input=``, ``dims=``)
_SPECIAL: dict[str, Callable[..., Any]] = {
    "repeat": repeat,
    "tile": _tile_rule,
    "expand_as": expand_as,
    "masked_select": _masked_select_rule,
}


def _pad_rule(input: Any, pad: Sequence[int], mode: str = "constant", value: Any = None) -> Any:
    if not is_node(input):
        raise TypeError(E.BATCHDIM_SELF.format(op="pad", typ=type(input).__name__))
    return _PAD(input, pad, mode, value)


_PAD = pad


def _constant_pad_nd(input: Any, pad: Sequence[int], value: Any = 0) -> Any:
    return _pad_rule(input, pad, "constant", value)


def _pad_sequence_rule(
    sequences: Any,
    batch_first: bool = False,
    padding_value: float = 0.0,
    padding_side: str = "right",
) -> Any:
    return pad_sequence(sequences, batch_first, padding_value, padding_side)


def _aggregate(agg: Callable[..., Any], over: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.all(td)`` / ``any`` without a dim: one 0-d bool tensor over every leaf (as
    ``td.all()``; never a Python bool); with a dim, the rule over batch dims."""

    def rule(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _input_first(args, kwargs)
        if len(args) == 1 and set(kwargs) <= {"dim"} and kwargs.get("dim") is None:
            return agg(args[0])
        return over(*args, **kwargs)

    return rule


def _functions(name: str) -> list[Any]:
    """The torch callables named ``name`` (``torch.x``, ``Tensor.x``, ``special`` / ``linalg``
    / ``nn.functional`` spellings)."""
    out = []
    for ns, n in (
        (torch, name),
        (Tensor, name),
        (torch.special, name.removeprefix("special_")),
        (torch.linalg, name.removeprefix("linalg_")),
        (F, name),
    ):
        if ns in (torch.special, torch.linalg) and n == name:
            continue
        f = getattr(ns, n, None)
        if callable(f) and not isinstance(f, type):
            out.append(f)
    return out


def _build() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}
    for family, names in FAMILIES.items():
        for name in names:
            if family == "other" or family == "sizes":
                continue
            reduction = family == "reductions"
            aten = _aten_sigs(name, reduction)
            for f in _functions(name):
                if f in table:
                    continue
                try:
                    sigs = (_py_sig(f, aten),) if inspect.isfunction(f) else aten
                except (TypeError, ValueError):
                    sigs = aten
                if sigs:
                    table[f] = _over_dims(name, f, sigs)
    for name, rule in _SPECIAL.items():
        for f in _functions(name):
            table[f] = rule
    for name, agg in (("all", all_), ("any", any_)):
        for f in _functions(name):
            table[f] = _aggregate(agg, table[f])
    for pred in ("is_floating_point", "is_complex"):
        for f in _functions(pred):
            table[f] = _every_leaf(pred)
    table[F.pad] = _pad_rule
    table[torch.constant_pad_nd] = _constant_pad_nd
    table[torch.nn.utils.rnn.pad_sequence] = _pad_sequence_rule
    table[pad_sequence_op] = _pad_sequence_rule
    return table


_RULES: dict[Any, Callable[..., Any]] = _build()


def rule_for(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The rule that lifts ``func`` over a container's batch dims, or ``None`` when ``func``
    is not of these families. The rule is called as ``func`` is (``rule(*args, **kwargs)``).

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.arange(6.0).reshape(3, 2), batch_size=[3])
        >>> rule_for(torch.cumsum)(td, 0)["a"][:, 0].tolist()
        [0.0, 2.0, 6.0]
        >>> rule_for(torch.exp) is None
        True
    """
    return _RULES.get(func)


#: container methods that are sugar over these rules: method name -> the ``Tensor`` method it
#: mirrors (a method takes its arguments as the tensor method does: ``td.flip(0, 1)``); the
#: method calls ``rule_for(METHODS[name])`` with the container first
METHODS: dict[str, Callable[..., Any]] = {
    name: getattr(Tensor, name)
    for names in FAMILIES.values()
    for name in names
    if getattr(Tensor, name, None) in _RULES
}
