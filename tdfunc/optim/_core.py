"""The shared machinery of :mod:`tdfunc.optim`: the transformation type, state checks,
hyperparameters and the list arithmetic (one ``torch._foreach_*`` call per op, or per leaf).

A state is a :class:`~tdfunc.TensorDict` with one top-level key, the transformation's tag
(``"adam"``, ``"chain"``...), holding its entries: buffers (flat TensorDicts keyed by the
leaves' names, the key paths joined by ``"."`` as in ``state_dict``), the step count and the
hyperparameters given as tensors, all with the params' batch size (one entry per ensemble
member). Flat buffers keep the state small: a compiled step guards on and rebuilds one node
per buffer instead of one per submodule. ``update`` checks a state against the tag, the
expected entries, the grads' leaf names, batch size and shapes before any arithmetic, so a
state of another optimizer or other params raises :class:`~tdfunc.optim.OptimStateError`
instead of broadcasting silently.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Union

import torch
from torch import Tensor

from .. import _compat as C
from .._ops import _can_foreach, match_structure
from .._tree import (
    KeyPath,
    has_leaves,
    is_node,
    leaves,
    leaves_with_paths,
    map_leaves,
    reorder_like,
)
from ..tensordict import TensorDict
from . import _errors as E
from . import _plan
from ._fused import Kernel, fused_inputs, local_lists, scalar

#: A schedule maps the number of updates done so far (an int64 tensor) to a value (a tensor).
Schedule = Callable[[Tensor], Tensor]
#: A hyperparameter: a Python number (fixed), a tensor (kept in the state, changeable without
#: recompiling, one value per ensemble member allowed) or a schedule of the step count.
Hyper = Union[float, Tensor, Schedule]  # noqa: UP007  # a typing alias carries a docstring
Hyper.__doc__ = """A hyperparameter of an optimizer (``lr``, ``weight_decay``): one of

* a Python number: a constant of the optimizer (changing it means a new optimizer);
* a floating tensor: kept in the state (``state[tag, "lr"]``), changed with
  :func:`tdfunc.optim.set_hyperparams` without recompiling a compiled step; a tensor of the
  params' batch size gives each ensemble member its own value. ``init`` stores it and
  ``update`` reads the state's value: an optimizer built inside a compiled step from a
  tensor argument passes a new value in with ``state = set_hyperparams(state, lr=lr)``.
  Its dtype is checked when the optimizer is built and its shape by ``init``; its values
  are not read (that would synchronise with the device and cannot be traced), so the
  range checks of Python numbers (``lr >= 0``...) do not apply to it;
* a schedule, ``count -> value`` (see :mod:`tdfunc.optim`'s schedules): evaluated at the
  number of updates done before this one (0 on the first update).
"""


class GradientTransformation(NamedTuple):
    """An optimizer or a gradient transformation: a pair of pure functions.

    ``state = init(params)`` builds the state (a :class:`~tdfunc.TensorDict`);
    ``updates, state = update(grads, state, params)`` returns the updates (same structure as
    ``grads``) and the new state. Neither writes into its arguments. Apply the updates with
    :func:`tdfunc.optim.apply_updates`.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> params = tdfunc.TensorDict(w=torch.ones(2))
        >>> opt = optim.sgd(lr=0.5)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(params, state, params)   # grads = params
        >>> optim.apply_updates(params, updates)["w"].tolist()
        [0.5, 0.5]
    """

    init: Callable[[Any], TensorDict]
    update: Callable[..., tuple[Any, TensorDict]]


# --------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------
def check_container(x: Any, what: str) -> None:
    """``TypeError`` unless ``x`` is a TensorDict or a tensorclass instance."""
    if not is_node(x):
        raise TypeError(E.NOT_A_CONTAINER.format(what=what, typ=type(x).__name__))


def fmt_path(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def float_leaves(params: Any, what: str) -> list[Tensor]:
    """The leaves of ``params``; ``TypeError`` naming the first non-floating one."""
    check_container(params, what)
    ls = leaves(params)
    if not all(x.is_floating_point() for x in ls):
        for path, x in leaves_with_paths(params):
            if not x.is_floating_point():
                raise TypeError(E.NOT_FLOATING.format(what=what, key=fmt_path(path), dtype=x.dtype))
    return ls


def grads_and_params(grads: Any, params: Any, what: str, needs_params: bool) -> Any:
    """``params`` paired with ``grads`` by key (in the grads' key order), or ``None``:
    ``StructureError`` naming the keys when their key sets differ."""
    check_container(grads, what)
    if params is None:
        if needs_params:
            raise TypeError(E.NEEDS_PARAMS.format(what=what))
        return None
    check_container(params, what)
    # the error speaks of the grads' keys against the params'
    if match_structure(params, grads, E.GRADS_VS_PARAMS.format(what=what)) is grads:
        return params
    return reorder_like(grads, params)


def _zip(nodes: list[Any], outs: list[list[Tensor]], names: list[str], prefix: str) -> bool:
    first = nodes[0]
    typ, keys = type(first), first._tdf_keys()
    rows = []
    for n in nodes:
        if n is not first and (type(n) is not typ or n._tdf_keys() != keys):
            return False
        rows.append(n._tdf_children())
    static = first._tdf_static()
    # nodes of one type without static fields (TensorDict) need no static comparison
    if static and any(n._tdf_static() != static for n in nodes):
        return False
    for i, (k, v) in enumerate(zip(keys, rows[0])):
        if isinstance(v, Tensor):
            for row, out in zip(rows, outs):
                x = row[i]
                if not isinstance(x, Tensor):
                    return False
                out.append(x)
            names.append(prefix + k)
        elif v is None:
            if any(row[i] is not None for row in rows):
                return False
        elif not _zip([row[i] for row in rows], outs, names, prefix + k + "."):
            return False
    return True


def zip_leaves(nodes: list[Any], names: list[str] | None = None) -> list[list[Tensor]] | None:
    """The leaves of each node, or ``None`` when the structures differ.

    One walk over all nodes together: an update reads the grads and the params, whose
    structures must agree; walking them in lockstep checks that and collects their leaves in
    one pass (the hot path of every eager step), and the leaves' names (key paths joined by
    ``"."``) into ``names``. When it returns ``None`` the caller runs the precise checks that
    name the keys at fault.
    """
    outs: list[list[Tensor]] = [[] for _ in nodes]
    return outs if _zip(nodes, outs, [] if names is None else names, "") else None


def leaf_names(params: Any, what: str) -> list[str]:
    """The names of the leaves (key paths joined by ``"."``, as ``state_dict``); a
    ``ValueError`` when two paths give one name (``"a.b"`` next to ``("a", "b")``)."""
    names: list[str] = []
    seen: dict[str, tuple[str, ...]] = {}
    for path, _ in leaves_with_paths(params):
        name = ".".join(path)
        if name in seen:
            raise ValueError(
                E.NAME_COLLISION.format(
                    what=what, a=fmt_path(seen[name]), b=fmt_path(path), name=name
                )
            )
        seen[name] = path
        names.append(name)
    return names


def first_device(ls: Sequence[Tensor]) -> torch.device | None:
    return ls[0].device if ls else None


# --------------------------------------------------------------------------------------
# hyperparameters
# --------------------------------------------------------------------------------------
def check_hyper(
    what: str, name: str, value: Any, low: float = 0.0, high: float | None = None
) -> None:
    """The range checks of ``torch.optim`` on a Python number; a tensor's dtype (floating
    point). A tensor's values are not read: reading them synchronises with its device and
    cannot be traced (an optimizer built inside a compiled step or under ``vmap`` with a
    tensor argument); ``init`` checks its shape against the params' batch size. Schedules are
    not checked."""
    if callable(value) and not isinstance(value, Tensor):
        return
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(
                E.BAD_HYPER.format(
                    what=what,
                    name=name,
                    value=value,
                    rule="a tensor hyperparameter must be floating point",
                )
            )
        return
    else:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(
                E.BAD_HYPER.format(
                    what=what, name=name, value=value, rule="a number, tensor or schedule"
                )
            )
        bad = value < low or (high is not None and value >= high)
    if bad:
        rule = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(E.BAD_HYPER.format(what=what, name=name, value=value, rule=rule))


def hyper_state(
    hypers: dict[str, Any], batch_size: torch.Size, device: torch.device | None, what: str
) -> dict[str, Tensor]:
    """The state entries of the tensor hyperparameters: one value per batch entry."""
    out: dict[str, Tensor] = {}
    for name, v in hypers.items():
        if isinstance(v, Tensor):
            fits = v.ndim <= len(batch_size) and all(
                a in (1, b) for a, b in zip(reversed(v.shape), reversed(batch_size))
            )
            if not fits:
                raise ValueError(
                    E.HYPER_SHAPE.format(
                        what=what, name=name, shape=tuple(v.shape), batch_size=tuple(batch_size)
                    )
                )
            out[name] = torch.broadcast_to(v.detach(), batch_size).to(device=device).clone()
    return out


def hyper_value(hypers: dict[str, Any], name: str, inner: Any, count: Tensor) -> Any:
    """A hyperparameter at this step: the state's tensor, the schedule's value, or the number."""
    v = hypers[name]
    if isinstance(v, Tensor):
        return inner._tdf_get(name, None)
    if callable(v):
        return once(v(count))
    return v


def once(x: Any) -> Any:
    """``x``, a scalar of the step (a schedule's value), computed once per compiled step.

    Inductor inlines a cheap scalar expression into every vectorised loop that reads it: a
    cosine schedule would be evaluated again for every 8 floats of every leaf. A tensor
    stacked with itself is stored in a buffer instead, read by the loops; the value is
    exactly ``x`` (eagerly one small extra op).

    Example:
        >>> import torch
        >>> once(torch.tensor(0.5)).item(), once(0.5)
        (0.5, 0.5)
    """
    return torch.stack([x, x])[0] if isinstance(x, Tensor) else x


def is_zero(v: Any) -> bool:
    """A Python number equal to zero (tensors and schedules are never skipped)."""
    return isinstance(v, (int, float)) and v == 0


# --------------------------------------------------------------------------------------
# states
# --------------------------------------------------------------------------------------
def make_state(tag: str, entries: dict[str, Any], batch_size: torch.Size) -> TensorDict:
    """``TensorDict({tag: TensorDict(entries)})`` with the params' batch size."""
    return TensorDict({tag: TensorDict(entries, batch_size=batch_size)}, batch_size=batch_size)


def step_count(batch_size: torch.Size, device: torch.device | None) -> Tensor:
    """The step count entry: zeros of the batch size (int64)."""
    return torch.zeros(batch_size, dtype=torch.int64, device=device)


def open_state(state: Any, tag: str, keys: Sequence[str], grads: Any, what: str) -> Any:
    """The entries of ``state`` for the transformation ``tag``; typed errors otherwise."""
    if not isinstance(state, TensorDict):
        raise TypeError(E.NOT_A_CONTAINER.format(what=f"{what}: state", typ=type(state).__name__))
    top = state._tdf_keys()
    if top != (tag,):
        raise E.OptimStateError(E.WRONG_STATE.format(what=what, expected=tag, got=list(top)))
    inner = state._tdf_get(tag, None)
    got = inner._tdf_keys() if isinstance(inner, TensorDict) else ()
    if sorted(got) != sorted(keys):
        raise E.OptimStateError(
            E.STATE_KEYS.format(what=what, name=tag, got=sorted(got), expected=sorted(keys))
        )
    # a state without tensors keeps its batch size under torch.vmap (nothing to map): only a
    # state with entries must follow the grads' batch dims
    if state._batch_size != grads._batch_size and has_leaves(state):
        raise E.OptimStateError(
            E.STATE_BATCH.format(
                what=what, got=tuple(state._batch_size), expected=tuple(grads._batch_size)
            )
        )
    return inner


def buffer(
    inner: Any, entry: str, names: tuple[str, ...], ls_g: list[Tensor], what: str
) -> list[Tensor]:
    """The leaves of the buffer ``entry`` (a flat TensorDict keyed by the leaves' names) in
    the order of the grads' names (read by name: a buffer made for params in another key
    order pairs by key), with the grads' shapes and dtypes, or :class:`OptimStateError`."""
    node = inner._tdf_get(entry, None)
    if isinstance(node, TensorDict) and node._tdf_keys() != names and set(node._data) == set(names):
        node = TensorDict._new({n: node._data[n] for n in names}, node._batch_size, node._device)
    if not isinstance(node, TensorDict) or node._tdf_keys() != names:
        got = node._tdf_keys() if isinstance(node, TensorDict) else ()
        raise E.OptimStateError(
            E.STATE_PARAMS.format(
                what=what,
                entry=entry,
                missing=sorted(set(names) - set(got)),
                extra=sorted(set(got) - set(names)),
            )
        )
    ls = list(node._tdf_children())
    if not all(x.shape == g.shape and x.dtype == g.dtype for x, g in zip(ls, ls_g)):
        for name, x, g in zip(names, ls, ls_g):
            if x.shape != g.shape:
                raise E.OptimStateError(
                    E.STATE_SHAPE.format(
                        what=what,
                        entry=entry,
                        key=repr(name),
                        got=tuple(x.shape),
                        expected=tuple(g.shape),
                    )
                )
            if x.dtype != g.dtype:
                raise E.OptimStateError(
                    E.STATE_DTYPE.format(
                        what=what, entry=entry, key=repr(name), got=x.dtype, expected=g.dtype
                    )
                )
    return ls


def new_state(
    state: Any, tag: str, values: dict[str, Any], names: tuple[str, ...] | None = None
) -> TensorDict:
    """``state`` with new entries (trusted: the structure was checked by :func:`open_state`).

    ``values`` maps each entry to a tensor or to the list of a buffer's new leaves; entries
    not given keep their value. A buffer's list follows ``names`` (the grads' leaf names, as
    :func:`buffer` read it); each buffer keeps its own key order in the new state.
    """
    inner = state._tdf_get(tag, None)
    out: list[Tensor] = []
    for k, v in zip(inner._tdf_keys(), inner._tdf_children()):
        new = values.get(k, v)
        if isinstance(new, list):
            own = v._tdf_keys() if isinstance(v, TensorDict) else None
            if names is not None and own is not None and own != names:
                pos = {n: i for i, n in enumerate(names)}
                new = [new[pos[n]] for n in own]
            out.extend(new)
        elif isinstance(new, Tensor):
            out.append(new)
        else:
            out.extend(leaves(new))
    return map_leaves(state, out)


# --------------------------------------------------------------------------------------
# list arithmetic
# --------------------------------------------------------------------------------------
def bcast(s: Any, x: Tensor) -> Any:
    """A per-member scalar ``s`` (shape = batch size) made to broadcast against leaf ``x``.

    Under ``torch.vmap`` a member's scalar is 0-d and nothing is done; outside, a scalar of
    shape ``[N]`` becomes ``[N, 1, ...]`` in ``x``'s dtype (so it does not promote ``x``).
    """
    if isinstance(s, Tensor) and s.ndim > 0:
        s = s.reshape(s.shape + (1,) * (x.ndim - s.ndim))
        if s.dtype != x.dtype:
            s = s.to(x.dtype)
    return s


# --------------------------------------------------------------------------------------
# selecting leaves (masks of masked(), the decay mask of optimizers)
# --------------------------------------------------------------------------------------
#: which leaves: a key pattern, a list of patterns, a callable ``(key_path, leaf) -> bool``
#: or a container of booleans with the params' keys
Mask = str | Sequence[str] | Callable[[KeyPath, Tensor], bool] | Any


def glob_match(pattern: str, text: str) -> bool:
    """``pattern`` matches all of ``text``; ``*`` matches any run of characters (dots too).

    Plain string methods (not ``fnmatch``/``re``), so a compiled step traces it as constants.

    Example:
        >>> glob_match("*.bias", "layer.0.bias"), glob_match("enc.*", "dec.w")
        (True, False)
    """
    parts = pattern.split("*")
    if len(parts) == 1:
        return pattern == text
    if not text.startswith(parts[0]):
        return False
    pos = len(parts[0])
    for mid in parts[1:-1]:
        i = text.find(mid, pos)
        if i < 0:
            return False
        pos = i + len(mid)
    return len(text) - pos >= len(parts[-1]) and text.endswith(parts[-1])


def selector(mask: Mask, what: str) -> Callable[[KeyPath, Tensor], bool]:
    """The mask as a predicate over ``(key_path, leaf)``."""
    if isinstance(mask, str):
        pattern = mask
        return lambda path, leaf: glob_match(pattern, ".".join(path))
    if is_node(mask):
        table: dict[KeyPath, bool] = {}
        for path, v in leaves_with_paths(mask):  # type: ignore[arg-type]
            if v.numel() != 1 or v.dtype != torch.bool:
                raise TypeError(E.MASK_VALUE.format(what=what, key=fmt_path(path), value=v))
            table[path] = bool(v)

        def lookup(path: KeyPath, leaf: Tensor) -> bool:
            if path not in table:
                raise KeyError(E.MASK_KEYS.format(what=what, key=fmt_path(path)))
            return table[path]

        return lookup
    if callable(mask):
        return mask
    if isinstance(mask, Sequence) and all(isinstance(m, str) for m in mask):
        patterns = tuple(mask)
        return lambda path, leaf: any(glob_match(p, ".".join(path)) for p in patterns)
    raise TypeError(E.BAD_MASK.format(what=what, typ=type(mask).__name__))


def check_selection(
    mask: Mask, pairs: Sequence[tuple[KeyPath, Tensor]], picked: Sequence[bool], what: str
) -> None:
    """A key pattern that matches no leaf, or a mask that selects none, is an error: a typo
    (``"*.bais"``) would otherwise switch the transformation off without a word.

    Example:
        >>> import torch
        >>> pairs = [(("l", "bias"), torch.zeros(1)), (("l", "weight"), torch.zeros(1))]
        >>> check_selection("*.bais", pairs, [False, False], "masked")
        Traceback (most recent call last):
        ...
        KeyError: "masked: the key pattern '*.bais' matches no leaf (nearest key: 'l.bias'); ..."
    """
    keys = [".".join(p) for p, _ in pairs]
    patterns: tuple[str, ...] = (mask,) if isinstance(mask, str) else ()
    if isinstance(mask, Sequence) and not isinstance(mask, str):
        patterns = tuple(m for m in mask if isinstance(m, str))
    for pattern in patterns:
        if not any(glob_match(pattern, k) for k in keys):
            near = difflib.get_close_matches(pattern, keys, n=1, cutoff=0.0)
            raise KeyError(
                E.MASK_NO_MATCH.format(
                    what=what, pattern=pattern, nearest=near[0] if near else None
                )
            )
    if keys and not any(picked):
        raise KeyError(E.MASK_SELECTS_NOTHING.format(what=what, keys=keys[:8]))


#: the key of ``math``'s hyperparameters that holds the leaves selected for weight decay
DECAY_PICKS = "decay_picks"


def decay_picks(mask: Mask | None, grads: Any, what: str) -> list[int] | None:
    """Positions of the leaves that get weight decay (None: all of them)."""
    if mask is None:
        return None
    sel = selector(mask, what)
    pairs = leaves_with_paths(grads)
    flags = [bool(sel(path, x)) for path, x in pairs]
    check_selection(mask, pairs, flags, what)
    return [i for i, f in enumerate(flags) if f]


def add_at(
    L: Lists, xs: list[Tensor], ys: list[Tensor], alpha: Any, picks: list[int] | None
) -> list[Tensor]:
    """``xs + alpha * ys`` at the positions ``picks`` (all when None); new tensors there,
    the others as they are."""
    if picks is None:
        return L.add(xs, ys, alpha=alpha)
    out = list(xs)
    for i, x in zip(picks, L.add([xs[i] for i in picks], [ys[i] for i in picks], alpha=alpha)):
        out[i] = x
    return out


def add_at_(
    L: Lists, xs: list[Tensor], ys: list[Tensor], alpha: Any, picks: list[int] | None
) -> None:
    """``xs += alpha * ys`` at the positions ``picks`` (all when None), in place (``xs`` are
    tensors this module created)."""
    if picks is None:
        L.add_(xs, ys, alpha=alpha)
    else:
        L.add_([xs[i] for i in picks], [ys[i] for i in picks], alpha=alpha)


class Lists:
    """Elementwise ops over lists of leaves: one ``torch._foreach_*`` call each when
    possible, per-leaf ops otherwise (under ``torch.vmap``, whose batched tensors foreach
    cannot take, and for per-member scalars outside vmap).

    Methods ending in ``_`` write into their first argument: call them only on lists this
    module created (never on a caller's tensors).
    """

    __slots__ = ("bd", "fe")

    def __init__(self, ls: list[Tensor], batch_size: torch.Size) -> None:
        self.bd = len(batch_size)
        self.fe = self.bd == 0 and _can_foreach(ls)

    def neg(self, xs: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_neg(xs))
        return [torch.neg(x) for x in xs]

    def sign(self, xs: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_sign(xs))
        return [torch.sign(x) for x in xs]

    def sqrt(self, xs: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_sqrt(xs))
        return [torch.sqrt(x) for x in xs]

    def mul(self, xs: list[Tensor], s: Any) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_mul(xs, s))
        return [x * bcast(s, x) for x in xs]

    def mul_(self, xs: list[Tensor], s: Any) -> list[Tensor]:
        if self.fe:
            C.foreach_mul_(xs, s)
        else:
            for x in xs:
                x.mul_(bcast(s, x))
        return xs

    def div_(self, xs: list[Tensor], s: Any) -> list[Tensor]:
        if self.fe:
            C.foreach_div_(xs, s)
        else:
            for x in xs:
                x.div_(bcast(s, x))
        return xs

    def add_scalar_(self, xs: list[Tensor], s: Any) -> list[Tensor]:
        if self.fe:
            C.foreach_add_(xs, s)
        else:
            for x in xs:
                x.add_(bcast(s, x))
        return xs

    def mul_list(self, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_mul(xs, ys))
        return [x * y for x, y in zip(xs, ys)]

    def div_list(self, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_div(xs, ys))
        return [x / y for x, y in zip(xs, ys)]

    def add(self, xs: list[Tensor], ys: list[Tensor], alpha: Any = 1.0) -> list[Tensor]:
        """``xs + alpha * ys`` (new tensors); ``alpha`` a number or a per-member tensor."""
        if isinstance(alpha, Tensor):
            return self.add(xs, self.mul(ys, alpha))
        if self.fe:
            return list(C.foreach_add(xs, ys, alpha=alpha))
        return [torch.add(x, y, alpha=alpha) for x, y in zip(xs, ys)]

    def add_(self, xs: list[Tensor], ys: list[Tensor], alpha: Any = 1.0) -> list[Tensor]:
        if isinstance(alpha, Tensor):
            return self.add_(xs, self.mul(ys, alpha))
        if self.fe:
            C.foreach_add_(xs, ys, alpha=alpha)
        else:
            for x, y in zip(xs, ys):
                x.add_(y, alpha=alpha)
        return xs

    def lerp(self, xs: list[Tensor], ys: list[Tensor], w: float) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_lerp(xs, ys, w))
        return [torch.lerp(x, y, w) for x, y in zip(xs, ys)]

    def addcmul_(
        self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float
    ) -> list[Tensor]:
        if self.fe:
            C.foreach_addcmul_(xs, ys, zs, value)
        else:
            # not addcmul_: it has no vmap batching rule (a slow fallback and a warning)
            for x, y, z in zip(xs, ys, zs):
                x.add_(y * z, alpha=value)
        return xs

    def addcmul(
        self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float
    ) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_addcmul(xs, ys, zs, value))
        return [torch.add(x, y * z, alpha=value) for x, y, z in zip(xs, ys, zs)]

    def addcdiv_(
        self, xs: list[Tensor], ys: list[Tensor], zs: list[Tensor], value: float
    ) -> list[Tensor]:
        if self.fe:
            C.foreach_addcdiv_(xs, ys, zs, value)
        else:
            for x, y, z in zip(xs, ys, zs):
                x.add_(y / z, alpha=value)
        return xs

    def maximum(self, xs: list[Tensor], ys: list[Tensor]) -> list[Tensor]:
        if self.fe:
            return list(C.foreach_maximum(xs, ys))
        return [torch.maximum(x, y) for x, y in zip(xs, ys)]


#: ``math(L, grads, params, buffers, count, hypers) -> (updates, new entries)``
Math = Callable[
    [Lists, list[Tensor], "list[Tensor] | None", dict[str, list[Tensor]], Any, dict[str, Any]],
    tuple[list[Tensor], dict[str, Any]],
]


def build(
    tag: str,
    buffers: dict[str, float],
    hypers: dict[str, Any],
    needs_params: bool,
    math: Math,
    with_step: bool = True,
    decay_mask: Mask | None = None,
    fused: Kernel | None = None,
) -> GradientTransformation:
    """A transformation whose state holds ``buffers`` (params-shaped, filled with the given
    values), the step count (``with_step``) and the tensor ``hypers``; ``math`` computes one
    step from the leaves (``count`` is ``None`` without a step count). ``hypers`` passed to
    ``math`` also hold, under :data:`DECAY_PICKS`, the positions of the leaves that
    ``decay_mask`` selects for weight decay (None: every leaf). ``fused`` (optional) is the
    same step on torch's fused kernel, for :func:`tdfunc.optim.step` (see
    :mod:`tdfunc.optim._fused`); it runs when the leaves and hyperparameters fit a kernel."""
    assert tag in TAGS, tag
    tensor_hypers = [n for n, v in hypers.items() if isinstance(v, Tensor)]
    keys = (*buffers, *(("step",) if with_step else ()), *tensor_hypers)
    what_init, what_update = f"{tag}.init", f"{tag}.update"

    def init(params: Any) -> Any:
        ls = float_leaves(params, what_init)
        decay_picks(decay_mask, params, what_init)  # a pattern that matches nothing: now
        bs, dev = params._batch_size, first_device(ls)
        names = leaf_names(params, what_init) if buffers else []
        entries: dict[str, Any] = {
            name: TensorDict(
                {
                    n: torch.full_like(p, fill) if fill else torch.zeros_like(p)
                    for n, p in zip(names, ls)
                },
                batch_size=bs,
            )
            for name, fill in buffers.items()
        }
        if with_step:
            entries["step"] = step_count(bs, dev)
        entries.update(hyper_state(hypers, bs, dev, what_init))
        return make_state(tag, entries, bs)

    def open_step(grads: Any, state: Any, params: Any) -> _Step:
        check_container(grads, what_update)
        if params is None and needs_params:
            raise TypeError(E.NEEDS_PARAMS.format(what=what_update))
        inner = open_state(state, tag, keys, grads, what_update)
        nodes = [grads, *([] if params is None else [params])]
        names: list[str] = []
        lists = zip_leaves(nodes, names) if all(map(is_node, nodes)) else None
        if lists is None:  # params in another key order, or name what differs
            params = grads_and_params(grads, params, what_update, needs_params)
            nodes, names = [grads, params], []
            lists = zip_leaves(nodes, names)
            if lists is None:  # pragma: no cover
                raise AssertionError("unreachable: the structures differ")
        ls_g = lists[0]
        key = tuple(names)
        bufs = {name: buffer(inner, name, key, ls_g, what_update) for name in buffers}
        count = inner._tdf_get("step", None)
        h = {n: hyper_value(hypers, n, inner, count) for n in hypers}
        h[DECAY_PICKS] = decay_picks(decay_mask, grads, what_update)
        return _Step(ls_g, None if params is None else lists[1], bufs, count, h, params, key)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        s = open_step(grads, state, params)
        upd, new = math(Lists(s.g, grads._batch_size), s.g, s.p, s.bufs, s.count, s.h)
        if with_step:
            new["step"] = s.count + 1
        return map_leaves(grads, upd), new_state(state, tag, new, s.names)

    if fused is not None:
        kernel = fused

        def fused_step(grads: Any, state: Any, params: Any, donate: bool) -> Any:
            s = open_step(grads, state, params)
            if s.p is None or grads._batch_size:
                return None
            got = fused_inputs(s.g, s.p, s.bufs, s.h, donate)
            if got is None:
                return None
            lr, wd, new_p, new = got
            # DTensor leaves: the kernel writes their local tensors (an elementwise update)
            kp, kg, *kb = local_lists(new_p, s.g, *new.values())
            kernel(lr, wd, kp, kg, dict(zip(new, kb)), s.count, s.h[DECAY_PICKS])
            entries: dict[str, Any] = dict(new)
            if with_step:
                entries["step"] = s.count + 1
            out = map_leaves(s.params, new_p)  # params in the grads' key order
            if s.params is not params:  # the result keeps the params' own order
                out = reorder_like(params, out)
            return out, new_state(state, tag, entries, s.names)

        # the plan of the last donated step (see tdfunc.optim._plan): one per optimizer
        plan: list[_plan.Plan | None] = [None]

        def remember(grads: Any, params: Any, state: Any) -> None:
            """Keep the plan of the containers a donated fused step just returned, after
            :func:`tdfunc.optim.step` checked its inputs in full."""
            count = state._tdf_get(tag, None)._tdf_get("step", None)
            plan[0] = _plan.record(params, state, count)

        def planned_step(grads: Any, state: Any, params: Any) -> Any:
            """The donated fused step over the containers the last one returned, without
            the checks (None: the plan does not hold; take the full path)."""
            p = plan[0]
            if p is None or not _plan.holds(p, state) or not is_node(grads) or grads._batch_size:
                return None
            lg: list[Tensor] = []
            if not _plan.walk(grads, p.spec, lg):  # one walk: the structure and the leaves
                return None
            lp = _plan.params_leaves(p, params)
            if lp is None:
                return None
            ls = leaves(state)
            if not _plan.matches(p, lg, lp, ls):
                return None
            inner = state._tdf_get(tag, None)
            count = inner._tdf_get("step", None)
            h = {n: hyper_value(hypers, n, inner, count) for n in hypers}
            lr, wd = scalar(h["lr"]), scalar(h["weight_decay"])
            if lr is None or wd is None:
                return None
            picks = decay_picks(decay_mask, grads, what_update)
            bufs = {name: list(inner._tdf_get(name, None)._tdf_children()) for name in buffers}
            kernel(lr, wd, lp, lg, bufs, count, picks)
            if p.count_at >= 0:
                ls[p.count_at] = count + 1
            out = map_leaves(params, lp), map_leaves(state, ls)
            plan[0] = _plan.after(p, lp, ls, count, *out)
            return out

        update.fused = fused_step  # type: ignore[attr-defined]  # read by optim.step
        fused_step.planned = planned_step  # type: ignore[attr-defined]  # read by optim.step
        fused_step.remember = remember  # type: ignore[attr-defined]  # read by optim.step
    return GradientTransformation(init, update)


class _Step(NamedTuple):
    """The checked inputs of one step: leaves of grads and params, buffers, count, hypers."""

    g: list[Tensor]
    p: list[Tensor] | None
    bufs: dict[str, list[Tensor]]
    count: Any
    h: dict[str, Any]
    #: the params paired with the grads (in the grads' key order)
    params: Any
    #: the grads' leaf names (the order of ``g``, ``p`` and each buffer's list)
    names: tuple[str, ...]


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates``, leaf by leaf, in the params' dtypes (a new container).

    One ``torch._foreach_add`` over all leaves (per leaf under ``torch.vmap``). Raises
    :class:`tdfunc.StructureError` naming the keys when the structures differ.

    Example:
        >>> import torch, tdfunc
        >>> p = tdfunc.TensorDict(w=torch.ones(2, dtype=torch.bfloat16))
        >>> u = tdfunc.TensorDict(w=torch.full((2,), 0.5, dtype=torch.bfloat16))
        >>> out = tdfunc.optim.apply_updates(p, u)
        >>> out["w"].tolist(), out["w"].dtype
        ([1.5, 1.5], torch.bfloat16)
    """
    what = "apply_updates"
    check_container(params, what)
    check_container(updates, what)
    lists = zip_leaves([params, updates])
    if lists is None:  # updates in another key order, or name what differs
        updates = match_structure(params, updates, f"{what}: params and updates")
        lists = zip_leaves([params, updates])
        if lists is None:  # pragma: no cover
            raise AssertionError("unreachable: the structures differ")
    lp, lu = lists
    if _can_foreach(lp) and _can_foreach(lu) and all(p.shape == u.shape for p, u in zip(lp, lu)):
        out = list(C.foreach_add(lp, lu))
    else:
        out = [p + u for p, u in zip(lp, lu)]
    out = [o if o.dtype == p.dtype else o.to(p.dtype) for o, p in zip(out, lp)]
    return map_leaves(params, out)


def set_hyperparams(state: TensorDict, **values: Any) -> TensorDict:
    """A new state whose tensor hyperparameters named in ``values`` take the given values.

    Every state entry with that name (``lr``, ``weight_decay``...) is replaced, at any depth
    (a chain holds one per optimizer), keeping its shape and dtype: a number or a 0-d tensor
    sets every ensemble member, a tensor of the batch size sets one value per member. Only
    hyperparameters given as tensors when the optimizer was built live in the state; Python
    numbers are constants of the optimizer. Raises ``KeyError`` for a name not in the state.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc import optim
        >>> opt = optim.adam(lr=torch.tensor(1e-3))
        >>> state = opt.init(tdfunc.TensorDict(w=torch.zeros(3)))
        >>> state = optim.set_hyperparams(state, lr=1e-2)
        >>> round(float(state["adam", "lr"]), 6)
        0.01
    """
    check_container(state, "set_hyperparams")
    found: list[tuple[str, ...]] = []
    _hyper_paths(state, (), found)
    names = sorted({p[-1] for p in found})
    for name in values:
        if name not in names:
            raise KeyError(E.NO_HYPER.format(name=name, found=names))
    targets = {p for p in found if p[-1] in values}

    def swap(path: tuple[str, ...], x: Tensor) -> Tensor:
        if path not in targets:
            return x
        v = torch.as_tensor(values[path[-1]], dtype=x.dtype, device=x.device)
        return torch.broadcast_to(v, x.shape).clone()

    return state.named_apply(swap)


#: Tags of every transformation (the top-level key of its state): a constant, so a state
#: loaded in a fresh process is understood before any optimizer is built.
TAGS = frozenset(
    {
        "sgd",
        "adam",
        "adamw",
        "rmsprop",
        "adagrad",
        "lion",
        "clip_by_global_norm",
        "add_decayed_weights",
        "scale",
        "set_to_zero",
        "chain",
        "masked",
        "multi_transform",
    }
)


def _hyper_paths(node: Any, prefix: tuple[str, ...], out: list[tuple[str, ...]]) -> None:
    """Paths of the tensor hyperparameters: direct tensor entries (not ``step``) of the
    entries of a state node (one key, a transformation's tag); nested states are searched."""
    keys = node._tdf_keys()
    if len(keys) == 1 and keys[0] in TAGS:
        inner = node._tdf_get(keys[0], None)
        for k, v in zip(inner._tdf_keys(), inner._tdf_children()):
            if isinstance(v, Tensor):
                if k != "step":
                    out.append((*prefix, keys[0], k))
            elif isinstance(v, TensorDict):
                _hyper_paths(v, (*prefix, keys[0], k), out)
