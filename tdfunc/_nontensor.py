"""Non-tensor leaves: a Python value shared by the whole container, or one per batch position.

A :class:`NonTensor` is a child of a node beside its tensors. It is *not* a tensor leaf: the
leaf walk of every op skips it, elementwise ops (arithmetic, ``where``, ``apply``, ``to``...)
keep it as it is, and ops that change the batch (indexing, ``stack``, ``cat``, ``unbind``,
``split``, batch shape ops) move a per-sample value with the batch. To torch's pytree it is part
of the structure (the context), never a child: ``torch.vmap`` and ``torch.func`` pass it
through. Under ``torch.compile`` a container holding one is an object Dynamo guards on by type
only until a function reads the value: a function that does not read it does not recompile
when its value changes (see ARCHITECTURE.md, "Non-tensor leaves").

How a per-sample value follows a batch op: the op's own per-leaf function is applied to an
index tensor of the value's batch shape (``arange(n).reshape(shape)``), and the values are
gathered at the indices it returns, so every op that moves batch positions of tensors moves
them for non-tensor values with the same rule (one rule, no second copy per op). Reading the
indices back is eager work: inside a compiled function such an op on a per-sample value is a
graph break (an int or a slice on the first batch dim is not: it is done in Python).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

#: messages of the non-tensor leaves (tests assert on them)
PER_SAMPLE_LENGTH = (
    "key {key}: a per-sample list must have one entry per batch position: shape {got} "
    "does not match batch_size {batch_size}"
)
PER_SAMPLE_NO_BATCH = (
    "key {key}: a list of non-tensor values needs a batch dim to follow (batch_size is ()); "
    "wrap a shared value in tdfunc.NonTensor(value)"
)
NONTENSOR_SHAPE = (
    "key {key}: a per-sample non-tensor value of batch shape {got} does not match "
    "batch_size {batch_size}"
)
NONTENSOR_OP = (
    "key {key}: {op} cannot change the batch of a per-sample non-tensor value "
    "(batch {got} -> {batch_size}); exclude the key first"
)
NONTENSOR_ALONG_BATCH = (
    "key {key}: {op} along a batch dim cannot move a per-sample non-tensor value with the "
    "tensors; exclude the key first"
)
NONTENSOR_IMMUTABLE = "NonTensor is immutable: build a new one"
PER_SAMPLE_COMPILED = (
    "key {key}: a per-sample non-tensor value is not readable inside a function compiled with "
    "tdfunc.compile: it crosses the boundary as row ids (moved by indexing, stack, cat, split "
    "like a tensor) and comes back as values with the outputs; read it outside the compiled "
    "function, or compile with plain torch.compile, which specialises on the value (one "
    "compile per distinct value)"
)
PER_SAMPLE_COMPILED_MIX = (
    "key {key}: {op} joins a per-sample value that crossed tdfunc.compile's boundary (row "
    "ids) with one made inside the compiled function; pass both in as arguments"
)


class NonTensor:
    """A non-tensor leaf: one Python value for every batch position, or one per position.

    ``NonTensor(value)`` is shared: every row of the container sees ``value``. A per-sample
    leaf is built by a container from a list (one entry per position of the batch; nested
    lists for more batch dims), by stacking containers, or with :meth:`per_sample`. The list is
    copied into (nested) tuples: the leaf is immutable like every leaf.

    ``td[key]`` returns the value (a shared value, or nested tuples); ``td.items()`` gives the
    ``NonTensor`` itself.

    Args:
        value: any Python object, shared by every batch position.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(r=torch.ones(3), text="hi", prompt=["a", "b", "c"],
        ...                        batch_size=[3])
        >>> td["text"], td["prompt"], td[1]["prompt"], td[1:]["prompt"]
        ('hi', ('a', 'b', 'c'), 'b', ('b', 'c'))
    """

    __slots__ = ("shape", "value")
    value: Any
    shape: tuple[int, ...] | None

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "shape", None)

    @classmethod
    def per_sample(cls, values: Sequence[Any], shape: Sequence[int] | None = None) -> NonTensor:
        """A per-sample leaf from nested sequences of the batch shape ``shape`` (the length of
        ``values`` when not given). ``ValueError`` when the nesting does not match ``shape``.

        Example:
            >>> NonTensor.per_sample(["a", "b"])
            NonTensor(('a', 'b'), per_sample=True)
        """
        if shape is None:
            shape = (len(values),)
        return _from_nested(values, tuple(int(s) for s in shape), ("value",))

    @property
    def is_per_sample(self) -> bool:
        """True for one value per batch position, False for a shared value."""
        return self.shape is not None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(NONTENSOR_IMMUTABLE)

    def __eq__(self, other: object) -> bool:
        if type(other) is not NonTensor:
            return NotImplemented
        return self.shape == other.shape and bool(self.value == other.value)

    def __hash__(self) -> int:
        return hash((self.shape, _hashable(self.value)))

    def __repr__(self) -> str:
        if self.shape is None:
            return f"NonTensor({self.value!r})"
        return f"NonTensor({self.value!r}, per_sample=True)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.value, self.shape))


class RowIds(NonTensor):
    """A per-sample value inside a function compiled with ``tdfunc.compile``: its row ids.

    At the boundary each per-sample :class:`NonTensor` of an argument becomes a ``RowIds``
    whose ``ids`` is an integer tensor of the value's batch shape, numbering its rows in a
    table kept outside the graph. Every op treats it as the non-tensor leaf it stands for
    (same keys, same structure, skipped by the leaf walk and by elementwise ops), and the
    ops that move batch positions move ``ids`` with the op's own per-leaf function, as they
    move a tensor leaf: traced, with no read of the value, so the graph does not depend on
    the text. Reading ``value`` (``td[key]``, ``==``, saving) raises ``TypeError`` naming
    the key; after the call the outputs' row ids are resolved back to the values.

    Example:
        >>> import torch
        >>> r = row_ids(torch.arange(3), "'prompt'")
        >>> r.shape, getitem(r, slice(1, None)).ids.tolist()
        ((3,), [1, 2])
        >>> r.value
        Traceback (most recent call last):
        ...
        TypeError: key 'prompt': a per-sample non-tensor value is not readable inside a function compiled with tdfunc.compile: it crosses the boundary as row ids (moved by indexing, stack, cat, split like a tensor) and comes back as values with the outputs; read it outside the compiled function, or compile with plain torch.compile, which specialises on the value (one compile per distinct value)
    """

    __slots__ = ("ids", "key")
    ids: Tensor
    key: str  # the key path where it crossed the boundary, formatted (named in errors)

    @property
    def value(self) -> Any:
        """Refused: ``TypeError`` naming the key (the values stay outside the graph)."""
        raise TypeError(PER_SAMPLE_COMPILED.format(key=self.key))

    @property
    def shape(self) -> tuple[int, ...] | None:  # type: ignore[override]
        """The batch shape of the rows (``None`` for one row: a shared value, as
        :func:`getitem` makes one of a per-sample value indexed by an int)."""
        return tuple(self.ids.shape) or None

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"NonTensor(<row ids of shape {tuple(self.ids.shape)}>, per_sample=True)"


def row_ids(ids: Tensor, key: str) -> RowIds:
    """Trusted: the :class:`RowIds` of ``ids`` for the value that crossed at ``key``."""
    out = object.__new__(RowIds)
    object.__setattr__(out, "ids", ids)
    object.__setattr__(out, "key", key)
    return out


def _rows_over(bs: torch.Size, nt: RowIds) -> Tensor:
    """The row ids of ``nt`` over ``bs`` (one row repeated for a shared value)."""
    return nt.ids if nt.shape is not None else nt.ids.expand(bs)


def _rebuild(value: Any, shape: tuple[int, ...] | None) -> NonTensor:
    return _new(value, shape)


def _hashable(value: Any) -> Any:
    """``value`` itself when it hashes, else its type and ``repr`` (a hash only, never equality)."""
    try:
        hash(value)
    except TypeError:
        return (type(value).__name__, repr(value))
    return value


def _new(value: Any, shape: tuple[int, ...] | None) -> NonTensor:
    """Trusted: a leaf holding ``value`` (nested tuples of ``shape``; shared when ``None``)."""
    out = object.__new__(NonTensor)
    object.__setattr__(out, "value", value)
    object.__setattr__(out, "shape", shape)
    return out


def _from_nested(values: Any, shape: tuple[int, ...], path: tuple[str, ...]) -> NonTensor:
    """Nested lists/tuples of ``shape`` copied into nested tuples (``ValueError`` otherwise)."""
    flat: list[Any] = []

    def walk(v: Any, depth: int) -> None:
        if depth == len(shape):
            flat.append(v)
            return
        if not isinstance(v, (list, tuple)) or len(v) != shape[depth]:
            got = (*shape[:depth], len(v)) if isinstance(v, (list, tuple)) else shape[:depth]
            raise ValueError(
                PER_SAMPLE_LENGTH.format(key=_fmt(path), got=tuple(got), batch_size=shape)
            )
        for x in v:
            walk(x, depth + 1)

    walk(values, 0)
    return _from_flat(flat, shape)


def _fmt(path: tuple[str, ...]) -> str:
    return repr(path[0]) if len(path) == 1 else repr(path)


def _nest(flat: Sequence[Any], shape: tuple[int, ...]) -> Any:
    if len(shape) <= 1:
        return tuple(flat)
    step = math.prod(shape[1:])
    return tuple(_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0]))


def _from_flat(flat: Sequence[Any], shape: tuple[int, ...]) -> NonTensor:
    """A leaf from row-major values: shared when ``shape`` is ``()`` (one position)."""
    if not shape:
        return _new(flat[0], None)
    return _new(_nest(flat, shape), shape)


def _flatten(value: Any, depth: int) -> list[Any]:
    if depth == 0:
        return [value]
    return [y for x in value for y in _flatten(x, depth - 1)]


def flat_values(nt: NonTensor, batch_size: Sequence[int]) -> list[Any]:
    """The row-major values of ``nt`` over ``batch_size`` (a shared value repeated)."""
    if nt.shape is None:
        return [nt.value] * math.prod(batch_size)
    return _flatten(nt.value, len(nt.shape))


def is_nontensor_candidate(value: Any) -> bool:
    """True for the user values a container stores as non-tensor leaves: ``str``, ``bytes``,
    ``None`` and :class:`NonTensor`; lists are decided by :func:`from_list`."""
    return value is None or isinstance(value, (str, bytes, NonTensor))


def _is_numeric(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_is_numeric(x) for x in v)
    return isinstance(v, (bool, int, float, complex))


def list_is_numeric(value: Sequence[Any]) -> bool:
    """A (nested) list of numbers: the container makes a tensor of it (as tensordict)."""
    return len(value) > 0 and _is_numeric(value)


def from_user(path: tuple[str, ...], value: Any, batch_size: torch.Size) -> NonTensor:
    """The leaf a container stores for a user value that is not a tensor.

    ``str`` / ``bytes`` / ``None``: shared. A list or tuple: per sample over the batch dims
    (nested lists for more than one; ``ValueError`` naming the key when the lengths do not
    match). A :class:`NonTensor`: shared as it is; per sample checked against ``batch_size``.
    """
    if isinstance(value, NonTensor):
        if value.shape is not None and value.shape != tuple(batch_size):
            raise ValueError(
                NONTENSOR_SHAPE.format(
                    key=_fmt(path), got=value.shape, batch_size=tuple(batch_size)
                )
            )
        return value
    if isinstance(value, (list, tuple)):
        if not batch_size:
            raise ValueError(PER_SAMPLE_NO_BATCH.format(key=_fmt(path)))
        return _from_nested(value, tuple(int(s) for s in batch_size), path)
    return _new(value, None)


# --------------------------------------------------------------------------------------
# batch ops: the op's per-leaf function applied to index tensors
# --------------------------------------------------------------------------------------
def _gather(flat: Sequence[Any], idx: Tensor) -> NonTensor:
    return _from_flat([flat[i] for i in idx.reshape(-1).tolist()], tuple(idx.shape))


def map_batch(
    nts: Sequence[tuple[torch.Size, NonTensor]],
    fn: Callable[[Tensor], Tensor],
    device: torch.device | None,
) -> list[NonTensor]:
    """Each leaf after a batch-dims-only function ``fn`` (the op's per-leaf function).

    A shared value stays; a per-sample one is gathered at ``fn(arange(n).reshape(shape))``.
    """
    out = []
    for _, nt in nts:
        if nt.shape is None:
            out.append(nt)
            continue
        if type(nt) is RowIds:  # row ids move as a tensor leaf: traced, no value read
            out.append(row_ids(fn(nt.ids), nt.key))
            continue
        idx = torch.arange(math.prod(nt.shape), device=device).reshape(nt.shape)
        out.append(_gather(flat_values(nt, nt.shape), fn(idx)))
    return out


def map_batch_multi(
    nts: Sequence[tuple[torch.Size, NonTensor]],
    fn: Callable[[Tensor], Sequence[Tensor]],
    first_dim: Sequence[int | slice] | None = None,
) -> list[list[NonTensor]]:
    """Like :func:`map_batch` for a function that returns several pieces (``unbind``,
    ``split``): for each leaf, one leaf per piece. ``first_dim``: the pieces are these ints /
    slices of the first batch dim (done in Python, no tensor)."""
    if first_dim is not None:
        return [[getitem(nt, k) for k in first_dim] for _, nt in nts]
    out = []
    for bs, nt in nts:
        idx = torch.arange(math.prod(bs)).reshape(bs)
        pieces = fn(idx)
        if nt.shape is None:
            out.append([nt] * len(pieces))
            continue
        if type(nt) is RowIds:
            out.append([row_ids(p, nt.key) for p in fn(nt.ids)])
            continue
        flat = flat_values(nt, bs)
        out.append([_gather(flat, p) for p in pieces])
    return out


def _expanded(bs: torch.Size, nt: NonTensor) -> Any:
    """The nested tuples of ``nt`` over ``bs`` (a shared value repeated)."""
    return nt.value if nt.shape is not None else _nest(flat_values(nt, bs), tuple(bs))


def combine(
    columns: Sequence[Sequence[tuple[torch.Size, NonTensor]]],
    fn: Callable[[list[Tensor]], Tensor],
    is_stack: bool,
    dim: int,
) -> list[NonTensor]:
    """The leaves of ``stack`` / ``cat`` (``fn`` joins index tensors) of several nodes along
    ``dim``; ``columns[i]`` holds the leaves of node ``i``. ``cat`` keeps equal shared values
    one shared value (``stack`` makes them per sample, as tensordict). Along the first dim
    the values are joined in Python (no tensor)."""
    out: list[NonTensor] = []
    for col in zip(*columns):
        first = col[0][1]
        rows = [(bs, nt) for bs, nt in col if type(nt) is RowIds]
        if rows:  # row ids join as tensors do (traced, no value read)
            key = rows[0][1].key
            if len(rows) < len(col):
                op = "stack" if is_stack else "cat"
                raise TypeError(PER_SAMPLE_COMPILED_MIX.format(key=key, op=op))
            out.append(row_ids(fn([_rows_over(bs, nt) for bs, nt in rows]), key))
            continue
        if not is_stack and first.shape is None and all(nt == first for _, nt in col[1:]):
            out.append(first)
            continue
        if dim == 0 and all(bs for bs, _ in col):
            parts = [_expanded(bs, nt) for bs, nt in col]
            if is_stack:
                out.append(_new(tuple(parts), (len(parts), *col[0][0])))
            else:
                value = tuple(x for p in parts for x in p)
                out.append(_new(value, (len(value), *col[0][0][1:])))
            continue
        flat: list[Any] = []
        idxs = []
        for bs, nt in col:
            n = math.prod(bs)
            idxs.append(torch.arange(len(flat), len(flat) + n).reshape(bs))
            flat.extend(flat_values(nt, bs))
        out.append(_gather(flat, fn(idxs)))
    return out


def getitem(nt: NonTensor, key: int | slice) -> NonTensor:
    """``nt`` indexed on its first batch dim by an int or a slice, in Python (no tensor:
    compiles without a graph break)."""
    if nt.shape is None:
        return nt
    if type(nt) is RowIds:
        return row_ids(nt.ids[key], nt.key)
    v = nt.value[key]
    if isinstance(key, slice):
        return _new(v, (len(v), *nt.shape[1:]))
    return _new(v, nt.shape[1:] or None)


def to_list(nt: NonTensor, batch_size: Sequence[int]) -> Any:
    """Nested lists over ``batch_size`` (``tolist``)."""
    flat = flat_values(nt, batch_size)
    if not batch_size:
        return flat[0]

    def nest(xs: Sequence[Any], shape: Sequence[int]) -> Any:
        if len(shape) == 1:
            return list(xs)
        step = math.prod(shape[1:])
        return [nest(xs[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]

    return nest(flat, batch_size)


def compare(a: NonTensor, b: Any, batch_size: torch.Size, negate: bool) -> Tensor:
    """``a == b`` (``!=`` when ``negate``) per batch position, as a bool tensor of
    ``batch_size`` (tensordict's answer for non-tensor values)."""
    va = flat_values(a, batch_size)
    vb = flat_values(b, batch_size) if isinstance(b, NonTensor) else [b] * len(va)
    eq = [bool(x == y) != negate for x, y in zip(va, vb)]
    return torch.tensor(eq, dtype=torch.bool).reshape(batch_size)


# --------------------------------------------------------------------------------------
# JSON (the store and the pytree context): str, numbers, bools, None and lists of them
# --------------------------------------------------------------------------------------
def is_json_value(v: Any) -> bool:
    """True for what a non-tensor leaf may hold to be saved: JSON scalars, lists/tuples of them."""
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(is_json_value(x) for x in v)
    return False


def first_non_json(v: Any) -> Any:
    """The first value inside ``v`` that :func:`is_json_value` refuses (``v`` itself or an item)."""
    if isinstance(v, (list, tuple)):
        for x in v:
            if not is_json_value(x):
                return first_non_json(x)
    return v


def to_json(nt: NonTensor) -> dict[str, Any]:
    """The JSON form of a leaf whose value passed :func:`is_json_value`."""
    return {"shape": None if nt.shape is None else list(nt.shape), "value": _jsonify(nt.value)}


def _jsonify(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return {"list": [_jsonify(x) for x in v], "tuple": isinstance(v, tuple)}
    return v


def _unjsonify(v: Any) -> Any:
    if isinstance(v, dict):
        items = [_unjsonify(x) for x in v["list"]]
        return tuple(items) if v["tuple"] else items
    return v


def _valid_json(v: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, dict):
        return (
            set(v) == {"list", "tuple"}
            and isinstance(v["list"], list)
            and isinstance(v["tuple"], bool)
            and all(_valid_json(x, depth + 1) for x in v["list"])
        )
    return False


def from_json(obj: Any) -> NonTensor:
    """A leaf from :func:`to_json`'s form, checked (``ValueError`` for anything else)."""
    ok = isinstance(obj, dict) and set(obj) == {"shape", "value"}
    shape = obj.get("shape") if ok else None
    ok = ok and (
        shape is None
        or (
            isinstance(shape, list)
            and 0 < len(shape) <= 64
            and all(type(s) is int and s >= 0 for s in shape)
        )
    )
    ok = ok and _valid_json(obj["value"])
    if not ok:
        raise ValueError(f"not a stored non-tensor value: {str(obj)[:200]}")
    value = _unjsonify(obj["value"])
    if shape is None:
        return _new(value, None)
    return _from_nested(value, tuple(shape), ("value",))


# ``torch.export.load`` (and ``torch.load(weights_only=True)``) may rebuild a leaf: its value is
# made of what that unpickler allows, and the rebuild runs no other code
torch.serialization.add_safe_globals([NonTensor, _rebuild])
