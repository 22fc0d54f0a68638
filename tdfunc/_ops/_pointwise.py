"""The pointwise family: torch functions that act on each element alone, lifted leaf by leaf.

Which functions are pointwise is read from torch's own metadata, never from a hand list: a
torch callable (``torch.x``, ``Tensor.x``, ``torch.special.x``, ``torch.nn.functional.x``)
is pointwise when the ATen operator of its name (``aten.x`` or ``aten.special_x``) has an
overload tagged ``torch.Tag.pointwise``; an operator called as itself (``torch.ops.ns.op``,
one a user registered with ``torch.library`` and tagged pointwise included) when its own
tags say so. Casts (``Tensor.bool``, ``Tensor.half`` ... every ``Tensor`` method torch
documents as ``self.to(torch.<dtype>)``) are pointwise too, and so are the few compositions
ATen leaves untagged (:data:`_COMPOSITE_POINTWISE`, each with its reason), and the
``*_like`` factories whose schema makes one tensor of the input's shape (``rand_like``).

The rule (:func:`lift`) is written once against the leaves-plus-structure protocol:

- container operands must have the same structure; the result has it too;
- a plain tensor argument is shaped like the batch, as in tensordict: it must broadcast to
  the batch size (its dims line up with the *last* batch dims, each of size 1 or that dim's
  size; ``ValueError`` otherwise) and is expanded over each leaf's feature dims (``td * w``
  with ``w`` of shape ``[3]`` on ``batch_size=[2, 3]`` scales along batch dim 1, whatever
  the leaves' feature dims). Numbers and 0-d tensors are scalars;
- the arguments the schema names ``condition`` or ``mask`` (``torch.where``,
  ``masked_fill``) select batch positions: a mask with at most as many dims as the batch
  aligns with the *leading* batch dims and expands over each leaf's feature dims
  (:func:`align_to_batch`), as in tensordict; one with more dims is broadcast by torch;
- one argument and no options: one ``torch._foreach_*`` call over the leaves where torch
  has the twin (``exp``, ``sigmoid``, ``abs`` ...), per-leaf calls inside ``torch.vmap``;
- results that torch returns as a tuple (``frexp``) come back as a tuple of containers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._compat import OpOverload, OpOverloadPacket, unary_foreach
from .._jagged._layout import align as jagged_align
from .._jagged._layout import call_aligned as jagged_call_aligned
from .._jagged._layout import has_jagged, is_jagged
from .._tree import flat_leaves, is_node, leaves, rebuild_flat, with_leaves
from .._twins import constant_when_traced, traced_as
from ._math import _can_foreach, check_plain_operand, fits_batch
from ._structure import check_batch_invariant, match_operands

#: ``isinstance(x, Tensor)`` under another name: traced code that also reads ``_tree``'s
#: ``Tensor`` would reach one class through two module globals, which Dynamo guards with a
#: Python identity check on every call
_is_tensor = torch.is_tensor

_POINTWISE = torch.Tag.pointwise
#: schema argument names of a mask that aligns with the batch dims
_MASK_NAMES = frozenset({"condition", "mask"})


def align_to_batch(tensor: Tensor, batch_ndim: int, leaf: Tensor) -> Tensor:
    """``tensor`` aligned with the leading batch dims of ``leaf`` (``batch_ndim`` of them),
    expanded over the leaf's feature dims.

    The alignment rule for a plain tensor next to a container: a mask or index shaped like
    the batch (or like its first dims) names batch positions, so its dims are the *leading*
    dims of each leaf, not the trailing ones torch's broadcasting would pick. A tensor with
    more dims than the batch is returned as it is (torch's broadcasting applies).

    Example:
        >>> import torch
        >>> leaf = torch.zeros(3, 2, 4)  # batch (3, 2), feature (4,)
        >>> align_to_batch(torch.ones(3, 2), 2, leaf).shape
        torch.Size([3, 2, 4])
        >>> align_to_batch(torch.ones(3), 2, leaf).shape  # the first batch dim only
        torch.Size([3, 1, 4])
    """
    n = tensor.ndim
    if n > batch_ndim:
        return tensor
    view = tensor.reshape(tensor.shape + (1,) * (leaf.ndim - n))
    return view.expand(
        tuple(tensor.shape) + (-1,) * (batch_ndim - n) + tuple(leaf.shape[batch_ndim:])
    )


# --------------------------------------------------------------------------------------
# which functions are pointwise: ATen tags
# --------------------------------------------------------------------------------------
def _tagged(op: Any) -> bool:
    """An overload tagged pointwise that returns tensors (``aten.equal`` returns a bool)."""
    rets = op._schema.returns
    return _POINTWISE in op.tags and bool(rets) and all(str(r.type) == "Tensor" for r in rets)


#: ATen ops that compute element by element but carry no pointwise tag because ATen
#: registers them as compositions (CompositeImplicitAutograd: the tag is read off the ops
#: they decompose into) or leaves them untagged, and Python compositions of pointwise ops in
#: ``torch.nn.functional``; each computes one output element from the same position of its
#: inputs alone (the only names the rule does not read from tags)
_COMPOSITE_POINTWISE = frozenset(
    {
        "isclose",  # abs, mul, add, le, eq ... (CompositeImplicitAutograd)
        "floor_divide",  # div(rounding_mode='floor'), untagged
        "log_sigmoid",  # log_sigmoid_forward (CompositeImplicitAutograd)
        "special_ndtr",  # erf (CompositeImplicitAutograd)
        "real",  # a view of the real part
        "imag",  # a view of the imaginary part
        "conj",  # the conjugate bit
        "isreal",  # imag == 0
        "positive",  # identity
        "complex",  # real + 1j * imag
        "polar",  # abs * (cos + 1j * sin)
        "softsign",  # input / (1 + abs(input)), Python
        "tanhshrink",  # input - tanh(input), Python
    }
)


def _packet(name: str) -> Any:
    for n in (name, f"special_{name}"):
        p = getattr(torch.ops.aten, n, None)
        if isinstance(p, OpOverloadPacket) and any(_tagged(getattr(p, o)) for o in p.overloads()):
            return p
    return None


def _is_like(name: str) -> bool:
    """A ``*_like`` factory (``rand_like``, ``randn_like``, ``randint_like``...): its ATen
    schema takes the tensor as ``self`` and returns one tensor of its shape, so it makes a
    new leaf for each leaf (random ones draw each leaf's numbers on their own)."""
    p = getattr(torch.ops.aten, name, None) if name.endswith("_like") else None
    if not isinstance(p, OpOverloadPacket):
        return False
    for o in p.overloads():
        schema = getattr(p, o)._schema
        args, rets = schema.arguments, schema.returns
        if args and args[0].name == "self" and [str(r.type) for r in rets] == ["Tensor"]:
            return True
    return False


def _is_composite(name: str) -> bool:
    return name in _COMPOSITE_POINTWISE or f"special_{name}" in _COMPOSITE_POINTWISE


_CAST = re.compile(r"is equivalent to ``self\.to\(torch\.(\w+)\)``")


def _is_cast(name: str, f: Any) -> bool:
    """A ``Tensor`` method its docstring documents as ``self.to(torch.<dtype>)``."""
    m = _CAST.search(getattr(f, "__doc__", None) or "")
    return m is not None and isinstance(getattr(torch, m.group(1), None), torch.dtype)


def _mask_positions(packet: Any, method: bool) -> tuple[tuple[int, ...], frozenset[str]]:
    """Positions (as the Python callable takes them) and names of the mask arguments."""
    for o in packet.overloads():
        op = getattr(packet, o)
        if not _tagged(op):
            continue
        args = [a for a in op._schema.arguments if not a.kwarg_only]
        names = [a.name for a in args]
        if not _MASK_NAMES.intersection(names):
            continue
        if method and "self" in names:  # Tensor.where(self, condition, other)
            names = ["self"] + [n for n in names if n != "self"]
        pos = tuple(i for i, n in enumerate(names) if n in _MASK_NAMES)
        return pos, frozenset(_MASK_NAMES.intersection(names))
    return (), frozenset()


def _candidates() -> list[tuple[str, Any, bool]]:
    """(name, callable, is a Tensor method) of every public torch callable by namespace."""
    out = []
    for ns, method in ((torch, False), (Tensor, True), (torch.special, False), (F, False)):
        for attr in dir(ns):
            # Tensor's comparison operators (``Tensor.__eq__``) reach a container's
            # ``__torch_function__`` inside compiled code: the ATen op of their plain name
            name = attr[2:-2] if method and attr.startswith("__") and attr.endswith("__") else attr
            if name.startswith("_") or name.endswith("_"):
                continue
            f = getattr(ns, attr, None)
            if callable(f) and not isinstance(f, type):
                out.append((name, f, method and attr == name))
    return out


class _Rule:
    """The pointwise rule bound to one torch callable (its name and mask positions)."""

    __slots__ = ("func", "mask_names", "mask_pos", "name")

    def __init__(self, func: Any, name: str, mask_pos: tuple[int, ...], mask_names: frozenset[str]):
        self.func = func
        self.name = name
        self.mask_pos = mask_pos
        self.mask_names = mask_names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return lift(self.func, self.name, args, kwargs, self.mask_pos, self.mask_names)


def _build() -> tuple[dict[Any, _Rule], dict[str, Any]]:
    table: dict[Any, _Rule] = {}
    methods: dict[str, Any] = {}
    for name, f, method in _candidates():
        if f in table:
            # ``Tensor.__neg__`` is ``Tensor.neg`` (``__pos__`` is ``positive``): the
            # operator's name comes first in ``dir(Tensor)``, the method's name is the same
            # callable and rule, and still a container method
            if method and name not in methods and table[f].name == name:
                methods[name] = f
            continue
        if method and _is_cast(name, f):
            table[f] = _Rule(f, name, (), frozenset())
            methods[name] = f
            continue
        # the attribute's name, or the C function's own (``F.logsigmoid`` is ``log_sigmoid``)
        alt = getattr(f, "__name__", name) if not method else name
        alt = alt if isinstance(alt, str) and not alt.startswith("_") else name
        p = _packet(name) or _packet(alt)
        if p is None:
            if not (_is_composite(name) or _is_composite(alt) or _is_like(name)):
                continue
            table[f] = _Rule(f, name, (), frozenset())
        else:
            table[f] = _Rule(f, name, *_mask_positions(p, method))
        if method:
            methods[name] = f
    return table, methods


_RULES, _METHODS = _build()

#: container methods that are sugar over the pointwise rule: method name -> the ``Tensor``
#: method it mirrors (``td.exp()``, ``td.clamp(min=0)``, ``td.where(mask, 0)``, ``td.bool()``)
METHODS: dict[str, Any] = _METHODS

#: the lifted torch callables of the pointwise family (for the reference page)
FUNCTIONS: tuple[Any, ...] = tuple(_RULES)


@constant_when_traced
def _is_pointwise_op(func: Any) -> bool:
    """An operator called as itself (``torch.ops.ns.op``) tagged pointwise; read once and
    kept as a constant by Dynamo (tags are fixed when an operator is registered)."""
    if isinstance(func, OpOverload):
        return _tagged(func)
    if isinstance(func, OpOverloadPacket):
        return any(_tagged(getattr(func, o)) for o in func.overloads())
    return False


def rule_for(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The pointwise rule of ``func`` (called as ``func`` is), or ``None``.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), batch_size=[2])
        >>> rule_for(torch.exp)(td)["a"].tolist()
        [1.0, 1.0]
        >>> rule_for(torch.matmul) is None
        True
    """
    r = _RULES.get(func)
    if r is not None:
        return r
    if _is_pointwise_op(func):
        return _Rule(func, str(func), (), frozenset())  # "ns.op": never a torch name
    return None


# --------------------------------------------------------------------------------------
# the rule
# --------------------------------------------------------------------------------------
def _tuple_result(ref: Any, out: list[Any]) -> Any:
    first = out[0]
    cols = [with_leaves(ref, [o[i] for o in out]) for i in range(len(first))]
    if type(first) is tuple:
        return tuple(cols)
    return type(first)(cols)


def _unary_leaves(name: str, ls: list[Tensor]) -> Sequence[Tensor]:
    """``torch.<name>`` of every leaf: one ``torch._foreach_<name>`` call eagerly (per leaf
    under vmap, where foreach has no batching rule). Dynamo traces the per-leaf twin below:
    inductor fuses separate ops better than its foreach lowering (20 leaves ``[64, 8]``,
    ``exp``, CPU: 34 us per call against 52 us, the dict loop 32 us)."""
    if _can_foreach(ls):
        return unary_foreach[name](ls)
    f = getattr(torch, name)
    return [f(x) for x in ls]


def unary(name: str, node: Any) -> Any:
    """``torch.<name>(node)`` for a unary op with a ``torch._foreach_*`` twin (``td.exp()``:
    the hot path of the pointwise rule, also called by the container's method directly).

    Example:
        >>> import torch, tdfunc
        >>> unary("exp", tdfunc.TensorDict(a=torch.zeros(2)))["a"].tolist()
        [1.0, 1.0]
    """
    flat = flat_leaves(node)
    if flat is not None:
        return rebuild_flat(node, _unary_leaves(name, flat))
    return with_leaves(node, _unary_leaves(name, leaves(node)))


@traced_as(_unary_leaves)
def _unary_leaves_traced(name: str, ls: list[Tensor]) -> Sequence[Tensor]:
    f = _UNARY_FUNCTIONS[name]  # not getattr(torch, name): see _UNARY_FUNCTIONS
    return [f(x) for x in ls]


#: ``torch.<name>`` of each unary op with a foreach twin. Traced code reads the function
#: from here rather than from this module's ``torch`` global: the caller's frame reaching
#: ``torch`` through its own globals would make Dynamo check that both are the same module
#: with a Python guard on every compiled call
_UNARY_FUNCTIONS: dict[str, Callable[..., Tensor]] = {
    n: getattr(torch, n) for n in unary_foreach if hasattr(torch, n)
}


def _may_grow(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mask_pos: tuple[int, ...],
    mask_names: frozenset[str],
    bs: Any,
) -> bool:
    """Whether a result may not start with the batch dims: a mask with dims that does not
    name leading batch positions of the batch size as it is (more dims than the batch, which
    torch broadcasts, or other sizes). Plain tensors are checked against the batch before."""
    for i in mask_pos:
        if i < len(args):
            v = args[i]
            if _is_tensor(v) and v.ndim > 0 and v.shape != bs[: v.ndim]:
                return True
    for k in mask_names:
        v = kwargs.get(k)
        if _is_tensor(v) and v.ndim > 0 and v.shape != bs[: v.ndim]:
            return True
    return False


def _aligned(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mask_pos: tuple[int, ...],
    mask_names: frozenset[str],
    bs: Any,
    name: str,
) -> tuple[list[tuple[int, int]], list[tuple[str, int]]]:
    """The tensor arguments that get a view per leaf rank, each with the number of leading
    leaf dims its own dims stand for (the view adds a trailing 1 per leaf dim past them):

    - a mask (``condition``, ``mask``) with at most as many dims as the batch: its own
      ndim (it names *leading* batch positions);
    - any other tensor with dims, a plain operand: the batch ndim (it is shaped like the
      batch, right-aligned within it: checked here, ``ValueError`` otherwise).

    A mask with more dims than the batch is left to torch's broadcasting."""
    bd = len(bs)
    pos: list[tuple[int, int]] = []
    for i, v in enumerate(args):
        if _is_tensor(v) and v.ndim > 0:
            if i in mask_pos:
                if v.ndim <= bd:
                    pos.append((i, v.ndim))
            else:
                if not fits_batch(v.shape, bs):
                    check_plain_operand(v, bs, name, _spelling(name, i, args))
                pos.append((i, bd))
    kpos: list[tuple[str, int]] = []
    if kwargs:
        for k, v in kwargs.items():
            if _is_tensor(v) and v.ndim > 0:
                if k in mask_names:
                    if v.ndim <= bd:
                        kpos.append((k, v.ndim))
                else:
                    if not fits_batch(v.shape, bs):
                        check_plain_operand(v, bs, name, f"torch.{name}(x, {k}=w)")
                    kpos.append((k, bd))
    return pos, kpos


def _spelling(name: str, i: int, args: tuple[Any, ...]) -> str:
    """The per-leaf call an error suggests for the plain tensor at position ``i``."""
    shown = ["x" if is_node(a) else "w" if j == i else "..." for j, a in enumerate(args)]
    return f"torch.{name}({', '.join(shown)})"


def _one_container(
    func: Any,
    ls: list[Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    pos: int,
    views: list[tuple[int, int]],
    kviews: list[tuple[str, int]],
) -> list[Any]:
    """:func:`lift`'s common case: one container, given by position. The arguments of each
    leaf's call are one list per leaf rank (the masks and plain tensors viewed for that rank
    once), with the leaf put in place: no per-leaf list or dict is built."""
    calls: dict[int, tuple[list[Any], dict[str, Any]]] = {}
    out = []
    jagged = bool(views or kviews) and has_jagged(ls)
    for j, leaf in enumerate(ls):
        if jagged and is_jagged(leaf):  # a jagged leaf: masks as jagged tensors
            out.append(
                jagged_call_aligned(func, leaf, args, kwargs, pos, views, kviews, args[pos], j)
            )
            continue
        nd = leaf.ndim
        call = calls.get(nd)
        if call is None:
            a = list(args)
            for i, lead in views:
                m = args[i]
                a[i] = m.reshape(m.shape + (1,) * (nd - lead))
            kw = {**kwargs}  # not dict(kwargs): Dynamo traces that through a polyfill (guards)
            for k, lead in kviews:
                m = kwargs[k]
                kw[k] = m.reshape(m.shape + (1,) * (nd - lead))
            call = calls[nd] = (a, kw)
        a, kw = call
        a[pos] = leaf
        out.append(func(*a, **kw))
    return out


def lift(
    func: Any,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mask_pos: tuple[int, ...] = (),
    mask_names: frozenset[str] = frozenset(),
) -> Any:
    """``func(*args, **kwargs)`` leaf by leaf: container arguments give their leaves (same
    structure required), masks align with the leading batch dims, a plain tensor is shaped
    like the batch (right-aligned within it), numbers go to every call.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.ones(2, 3), batch_size=[2])
        >>> mask = torch.tensor([True, False])
        >>> lift(torch.where, "where", (mask, td, 0.0), {}, (0,))["a"].tolist()
        [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
        >>> lift(torch.mul, "mul", (td, torch.tensor([1.0, 2.0])), {})["a"].tolist()
        [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    """
    if len(args) == 1 and not kwargs and name in unary_foreach:
        return unary(name, args[0])
    args, kwargs, nodes = match_operands(args, kwargs, name)
    ref = nodes[0]
    ls = leaves(ref)
    bs = ref._batch_size
    views, kviews = _aligned(args, kwargs, mask_pos, mask_names, bs, name)
    pos = -1
    if len(nodes) == 1:  # where is it? (by identity: == on a container compares leaves)
        for i, a in enumerate(args):
            if a is ref:
                pos = i
    if pos >= 0:
        out = _one_container(func, ls, args, kwargs, pos, views, kviews)
    else:
        acols = [ls if a is ref else leaves(a) if is_node(a) else None for a in args]
        kcols = {k: ls if v is ref else leaves(v) for k, v in kwargs.items() if is_node(v)}
        if not views and not kviews and not kcols:
            out = [
                func(*[c[j] if c is not None else v for v, c in zip(args, acols)], **kwargs)
                for j in range(len(ls))
            ]
        else:
            # an aligned tensor as a view with one trailing 1 per leaf dim past those it
            # stands for (torch broadcasts it over the leaf), made once per leaf rank
            cache: dict[tuple[Any, int], Tensor] = {}

            def view(m: Tensor, key: Any, lead: int, ndim: int) -> Tensor:
                v = cache.get((key, ndim))
                if v is None:
                    v = cache[(key, ndim)] = m.reshape(m.shape + (1,) * (ndim - lead))
                return v

            out = []
            any_jagged = has_jagged(ls)
            for j, leaf in enumerate(ls):
                a = [c[j] if c is not None else v for v, c in zip(args, acols)]
                jagged = any_jagged and is_jagged(leaf)  # masks as jagged tensors of its rows
                for i, lead in views:
                    m = args[i]
                    a[i] = (
                        jagged_align(m, lead, leaf, ref, j)
                        if jagged
                        else view(m, i, lead, leaf.ndim)
                    )
                kw = {k: (kcols[k][j] if k in kcols else v) for k, v in kwargs.items()}
                for k, lead in kviews:
                    m = kwargs[k]
                    kw[k] = (
                        jagged_align(m, lead, leaf, ref, j)
                        if jagged
                        else view(m, k, lead, leaf.ndim)
                    )
                out.append(func(*a, **kw))
    if out and isinstance(out[0], tuple):
        return _tuple_result(ref, out)
    if _may_grow(args, kwargs, mask_pos, mask_names, bs):
        check_batch_invariant(ref, out, bs, name)
    return with_leaves(ref, out)
