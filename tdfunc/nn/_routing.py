"""Reading and writing a TensorDict / tensorclass by key: the routing under ``tdfunc.nn``'s
key-routed modules.

Keys are normalised once to *paths* (tuples of strings). Writes follow a *plan*, the out paths
grouped by first key and computed once per module, and build a new container: the input is
never modified. Every check raises a typed error whose text is a constant below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._keys import ABSENT, as_path, fmt_key, get_path, is_key
from .._keys import child as _child
from .._nontensor import NonTensor
from .._tree import KeyPath, Node, is_node
from ..tensordict import TensorDict

Key = str | tuple[str, ...]

MISSING: Any = object()

# ---------------------------------------------------------------------------------- messages
MISSING_IN_KEY = (
    "{module} needs key {key}, which is missing from the input {cls} (available keys: {available})"
)
IN_KEY_THROUGH_LEAF = "{module} needs key {key}, but {prefix} is a {kind}, not a nested container"
SEQ_MISSING_IN_KEY = (
    "{seq}: key {key} needed by module {index} ({module}) is missing from the input {cls} "
    "(available keys: {available})"
)
OUTPUT_COUNT = (
    "{module} returned {got} output(s) but has {expected} out_keys {out_keys}; "
    "return one value per out key (a tensor for one key, a tuple for several)"
)
OUTPUT_KIND = (
    "{module} returned a {typ} for out key {key}; outputs must be tensors or "
    "TensorDict/tensorclass values"
)
OUTPUT_SHAPE = (
    "{module} returned shape {shape} for out key {key}, which does not start with the "
    "batch_size {batch_size} of the container it goes into"
)
OVERWRITE_SUBTREE = (
    "{module} would overwrite the nested {kind} at {key} with a {typ}; "
    "write the output under a new key or below the nested container (e.g. {hint})"
)
WRITE_THROUGH_LEAF = (
    "{module} cannot write out key {key}: {prefix} is a {kind}, not a nested container"
)
NOT_A_FIELD = (
    "{module} cannot write out key {key}: {cls} has no field {field!r} (fields: {fields}); "
    "add the field to the tensorclass or convert the input to a TensorDict first"
)
NOT_A_CONTAINER = (
    "{module} expects a TensorDict or tensorclass input, got {typ}; "
    "wrap tensors with tdfunc.TensorDict({{...}}, batch_size=...)"
)
BAD_KEY = "{what}: keys must be non-empty strings or non-empty tuples of strings, got {key!r}"
BAD_KEYS_ARG = (
    "{what} must be a key, a sequence of keys or (for in_keys) a mapping from keyword "
    "names to keys, got {typ}"
)
BAD_KWARG = "in_keys mapping: keyword names must be strings, got {name!r}"
NO_OUT_KEYS = "out_keys must name at least one key"
NOT_CALLABLE = "TensorDictModule: module must be callable, got {typ}"
DUPLICATE_OUT_KEY = "out_keys {out_keys}: key {key} is written twice"
NESTED_OUT_KEYS = "out_keys {out_keys}: key {inner} lies inside key {outer}; write one of them"
NOT_KEY_ROUTED = (
    "TensorDictSequential: module {index} ({typ}) is not key-routed (it has no in_keys/out_keys); "
    "wrap it: TensorDictModule(module, in_keys=[...], out_keys=[...]), or pass a plain "
    "function that takes and returns a TensorDict"
)
STEP_OUTPUT = (
    "{seq}: step {index} ({step}) returned a {typ}; a plain function in a TensorDictSequential "
    "must return a TensorDict or tensorclass (e.g. lambda td: td.exclude('hidden'))"
)
KWARGS_AND_TD = (
    "{module}: pass either a TensorDict / tensorclass or keyword tensors named after the "
    "in_keys {names}, not both"
)
UNKNOWN_KWARGS = (
    "{module}: unexpected keyword input(s) {got}; keyword inputs are named after the in_keys: "
    "{names} (a nested key ('a', 'b') is passed as a_b)"
)
NO_INPUT = (
    "{module}: no input; pass a TensorDict or keyword tensors named after the in_keys {names}"
)
NOT_AN_OUT_KEY = "{seq}: selected out key {key} is not written by any module (out keys: {out_keys})"
NO_MODULES = "TensorDictSequential needs at least one module"
BAD_INDEX = "TensorDictSequential indices are ints or slices, got {typ}"
INPLACE_MODULE = (
    "{cls}.{name} changes the module in place in tensordict; here a module is fixed when it "
    "is built: the pure spelling returns a new module (rebind the name): {hint}"
)


# ---------------------------------------------------------------------------------- keys
def unravel(key: Any) -> Any:
    """Nested tuples of keys flattened into one path (as ``tensordict`` writes them):
    ``(("a",), ("b", "c"))`` -> ``("a", "b", "c")``; anything else is returned as is."""
    if not isinstance(key, tuple) or all(isinstance(k, str) for k in key):
        return key
    out: list[Any] = []
    for k in key:
        sub = unravel(k)
        if isinstance(sub, tuple):
            out.extend(sub)
        else:
            out.append(sub)
    return tuple(out)


def to_path(key: Any, what: str) -> KeyPath:
    """``"a"`` -> ``("a",)``; a non-empty tuple of strings is already a path; nested tuples
    are flattened (``(("a",), "b")`` -> ``("a", "b")``).

    Normalised as every key of a container is; routing also rejects empty names.
    """
    key = unravel(key)
    if is_key(key):
        path = as_path(key)
        if all(path):
            return path
    raise TypeError(BAD_KEY.format(what=what, key=key))


def to_paths(keys: Any, what: str) -> tuple[KeyPath, ...]:
    """One key or an iterable of keys -> a tuple of paths (a tuple of strings is one key)."""
    if isinstance(keys, (str, tuple)):
        return (to_path(keys, what),)
    if isinstance(keys, Iterable) and not isinstance(keys, (Mapping, bytes)):
        return tuple(to_path(k, what) for k in keys)
    raise TypeError(BAD_KEYS_ARG.format(what=what, typ=type(keys).__name__))


def kwarg_name(path: KeyPath) -> str:
    """The keyword a key is passed under when a module is called with keyword tensors
    (``mod(obs=t)``): the path joined by ``"_"``, as ``tensordict.nn`` does."""
    return "_".join(path)


def from_kwargs(paths: Sequence[KeyPath], kwargs: Mapping[str, Any], owner: str) -> TensorDict:
    """The TensorDict (``batch_size=()``) that keyword tensors stand for: each keyword goes
    under the in key it names (nested key ``("a", "b")`` for the keyword ``a_b``)."""
    by_name = {kwarg_name(p): p for p in paths}
    unknown = [k for k in kwargs if k not in by_name]
    if unknown:
        raise TypeError(UNKNOWN_KWARGS.format(module=owner, got=unknown, names=list(by_name)))
    root: dict[str, Any] = {}
    for name, value in kwargs.items():
        *parents, last = by_name[name]
        cur = root
        for k in parents:
            cur = cur.setdefault(k, {})
        cur[last] = value
    return TensorDict(root)


def public_key(path: KeyPath) -> Key:
    """The user-facing form of a key path: ``'a'`` or ``('a', 'b')``."""
    return path[0] if len(path) == 1 else path


def overlaps(a: KeyPath, b: KeyPath) -> bool:
    """True when one path is a prefix of (or equal to) the other."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def check_out_paths(paths: tuple[KeyPath, ...]) -> None:
    """Out paths must be distinct and none may lie inside another."""
    shown = [public_key(p) for p in paths]
    for i, p in enumerate(paths):
        for q in paths[:i]:
            if p == q:
                raise ValueError(DUPLICATE_OUT_KEY.format(out_keys=shown, key=fmt_key(p)))
            if overlaps(p, q):
                inner, outer = (p, q) if len(p) > len(q) else (q, p)
                raise ValueError(
                    NESTED_OUT_KEYS.format(
                        out_keys=shown, inner=fmt_key(inner), outer=fmt_key(outer)
                    )
                )


# ---------------------------------------------------------------------------------- reading
def child(node: Any, key: str) -> Any:
    """The child ``key`` of a node, or :data:`MISSING`."""
    return _child(node, key, MISSING)


def read_key(node: Any, path: KeyPath, owner: str) -> Any:
    """The value at ``path`` (``KeyError`` naming the key and ``owner`` when missing); a
    non-tensor leaf gives its value, as ``td[key]`` does."""
    if len(path) == 1 and isinstance(node, TensorDict):
        value = node._data.get(path[0], MISSING)
        if value is not MISSING:
            return value.value if isinstance(value, NonTensor) else value
    value = node
    for i, k in enumerate(path):
        if not is_node(value):
            raise KeyError(
                IN_KEY_THROUGH_LEAF.format(
                    module=owner,
                    key=fmt_key(path),
                    prefix=fmt_key(path[:i]),
                    kind=type(value).__name__,
                )
            )
        parent = value
        value = child(parent, k)
        if value is MISSING:
            raise KeyError(
                MISSING_IN_KEY.format(
                    module=owner,
                    key=fmt_key(path),
                    cls=type(node).__name__,
                    available=available(parent, path[:i]),
                )
            )
    return value.value if isinstance(value, NonTensor) else value


def available(node: Any, prefix: KeyPath) -> list[Key]:
    """The keys of ``node`` as full paths under ``prefix`` (for error messages)."""
    return [public_key((*prefix, k)) for k in node._tdf_keys()]


def has_key(node: Any, path: KeyPath) -> bool:
    """True when ``path`` leads to a value in ``node``."""
    return get_path(node, path, ABSENT) is not ABSENT


# ---------------------------------------------------------------------------------- writing
# A write plan is the out paths grouped by their first key, computed once at construction:
# ``(("c", (("d", 0),)), ("e", 1))`` writes output 0 at ("c", "d") and output 1 at "e".
Plan = tuple[tuple[str, Any], ...]


def make_plan(paths: Sequence[KeyPath], indices: Sequence[int]) -> Plan:
    """Group ``paths`` (writing ``outputs[indices[i]]``) into a nested write plan."""
    groups: dict[str, list[tuple[KeyPath, int]]] = {}
    for path, i in zip(paths, indices):
        groups.setdefault(path[0], []).append((path[1:], i))
    plan: list[tuple[str, Any]] = []
    for k, subs in groups.items():
        if len(subs) == 1 and not subs[0][0]:
            plan.append((k, subs[0][1]))
        else:
            plan.append((k, make_plan([p for p, _ in subs], [i for _, i in subs])))
    return tuple(plan)


def checked_output(
    value: Any,
    current: Any,
    prefix: KeyPath,
    key: str,
    bs: torch.Size,
    dev: torch.device | None,
    owner: str,
) -> Any:
    """Validate one output against the container it goes into; move it to ``dev`` if needed."""
    if isinstance(value, Tensor):
        if isinstance(current, Node):
            raise TypeError(
                OVERWRITE_SUBTREE.format(
                    module=owner,
                    kind=type(current).__name__,
                    key=fmt_key((*prefix, key)),
                    typ=type(value).__name__,
                    hint=fmt_key((*prefix, key, "value")),
                )
            )
        shape = value.shape
    elif isinstance(value, Node):
        shape = value._batch_size
    else:
        raise TypeError(
            OUTPUT_KIND.format(module=owner, typ=type(value).__name__, key=fmt_key((*prefix, key)))
        )
    if bs and shape[: len(bs)] != bs:
        raise ValueError(
            OUTPUT_SHAPE.format(
                module=owner, key=fmt_key((*prefix, key)), shape=tuple(shape), batch_size=tuple(bs)
            )
        )
    if dev is not None and value.device != dev:
        return value.to(dev)
    return value


def apply_plan(node: Any, plan: Plan, outputs: Sequence[Any], owner: str, prefix: KeyPath) -> Any:
    """A copy of ``node`` with ``outputs`` written where ``plan`` says (checks as it goes).

    Nothing is written into ``node``: an error leaves no trace but the exception. A
    tensorclass is rebuilt through its checked ``replace``, so its field types hold.
    """
    bs, dev = node._batch_size, node._device
    is_td = isinstance(node, TensorDict)
    if is_td:
        data = node._data.copy()
    else:
        keys = node._tdf_keys()
        data = dict(zip(keys, node._tdf_children()))
        changes: dict[str, Any] = {}
    for k, sub in plan:
        current = data.get(k, MISSING)
        if current is MISSING and not is_td:
            raise TypeError(
                NOT_A_FIELD.format(
                    module=owner,
                    key=fmt_key((*prefix, k)),
                    cls=type(node).__name__,
                    field=k,
                    fields=list(keys),
                )
            )
        if isinstance(sub, int):
            value = checked_output(outputs[sub], current, prefix, k, bs, dev, owner)
        elif current is MISSING or (current is None and not is_td):
            value = new_from_plan(sub, outputs, owner, (*prefix, k), bs, dev)
        elif is_node(current):
            value = apply_plan(current, sub, outputs, owner, (*prefix, k))
        else:
            raise TypeError(
                WRITE_THROUGH_LEAF.format(
                    module=owner,
                    key=fmt_key((*prefix, k, *first_path(sub))),
                    prefix=fmt_key((*prefix, k)),
                    kind=type(current).__name__,
                )
            )
        if is_td:
            data[k] = value
        else:
            changes[k] = value
    if is_td:
        return TensorDict._new(data, bs, dev)
    return node.replace(**changes)


def new_from_plan(
    plan: Plan,
    outputs: Sequence[Any],
    owner: str,
    prefix: KeyPath,
    bs: torch.Size,
    dev: torch.device | None,
) -> TensorDict:
    """A new nested TensorDict (batch ``bs``) holding ``outputs`` where ``plan`` says."""
    data: dict[str, Any] = {}
    for k, sub in plan:
        if isinstance(sub, int):
            data[k] = checked_output(outputs[sub], MISSING, prefix, k, bs, dev, owner)
        else:
            data[k] = new_from_plan(sub, outputs, owner, (*prefix, k), bs, dev)
    return TensorDict._new(data, bs, dev)


def first_path(plan: Plan) -> KeyPath:
    """The first path a plan writes (for error messages)."""
    k, sub = plan[0]
    return (k,) if isinstance(sub, int) else (k, *first_path(sub))


def describe(module: Any) -> str:
    """A short name for a wrapped callable: its class, or its ``__name__``."""
    if isinstance(module, nn.Module):
        return type(module).__name__
    return getattr(module, "__name__", type(module).__name__)
