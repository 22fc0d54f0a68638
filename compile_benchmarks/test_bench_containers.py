"""Container operations, side by side: tdfunc, tensordict, plain pytrees and a flat-list floor.

Every workload is a ``build_*`` function below whose docstring says what is measured. It
returns, for one contender, the callable and its arguments; ``make_args(n)`` variants build
the same structure for batch size ``n`` (the ``dynamic=True`` recompile probe). All
contenders get the same tensors and produce results with the same leaves (checked by the
harness in the first pass).

Contenders: ``tdfunc`` (TensorDict), ``tdfunc_tc`` (``@tdfunc.tensorclass``, when it exists),
``tensordict`` / ``tensordict_tc`` (tensordict's TensorDict / ``@tensorclass``), ``pytree``
(nested dicts + ``torch.utils._pytree.tree_map``), ``optree`` (nested dicts +
``optree.tree_map``), ``floor`` (a flat Python list of the same tensors) and
``floor_foreach`` (one ``torch._foreach_*`` call on that list, where one exists).
"""

from __future__ import annotations

import importlib
import importlib.util
import operator
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as pytree

import tdfunc
from compile_benchmarks import CONTENDERS, available_modes

CATEGORY = "container"
TD_LIKE = ("tdfunc", "tensordict")
TC = ("tdfunc_tc", "tensordict_tc")
TREES = ("pytree", "optree")
FLOORS = ("floor", "floor_foreach")

Fn = Callable[..., Any]
Built = tuple[Fn, tuple[Any, ...]]

DEPTH = 10
KEYS50 = tuple(f"k{i}" for i in range(50))
KEYS100 = tuple(f"k{i}" for i in range(100))
CHAIN_PATH = ("n",) * DEPTH + ("x",)
MEMBER_HIT = ("n", "n", "x")
MEMBER_MISS = ("n", "q")
FEAT = 8  # feature size of the batch workloads' leaves
FIELD_FEAT = 4  # feature size of the field workloads' leaves
FIELD_BATCH = 16


# ----------------------------------------------------------------------------- contenders
def _tdfunc_tensorclass() -> Callable[[type], type] | None:
    deco = getattr(tdfunc, "tensorclass", None)
    if callable(deco) and not isinstance(deco, types.ModuleType):
        return deco
    if importlib.util.find_spec("tdfunc.tensorclass") is None:
        return None
    return getattr(importlib.import_module("tdfunc.tensorclass"), "tensorclass", None)


HAS_TDFUNC_TC = _tdfunc_tensorclass() is not None


def _tensordict() -> Any:
    return pytest.importorskip("tensordict", reason="tensordict is not installed")


_TC_CLASSES: dict[tuple[str, tuple[str, ...]], type] = {}


def tc_class(lib: str, names: tuple[str, ...]) -> type:
    """A tensorclass (tdfunc or tensordict) with one ``torch.Tensor`` field per name."""
    key = (lib, names)
    if key not in _TC_CLASSES:
        ns = {"__annotations__": dict.fromkeys(names, torch.Tensor), "__module__": __name__}
        raw = type(f"TC{len(names)}", (), ns)
        deco = _tdfunc_tensorclass() if lib == "tdfunc_tc" else _tensordict().tensorclass
        _TC_CLASSES[key] = deco(raw)
    return _TC_CLASSES[key]


def container(contender: str, src: dict[str, Any], batch: tuple[int, ...]) -> Any:
    """The contender's container holding the (nested) dict ``src`` of tensors."""
    if contender == "tdfunc":
        return tdfunc.TensorDict(src, batch_size=batch)
    if contender == "tensordict":
        return _tensordict().TensorDict(src, batch_size=batch)
    if contender in TC:
        return tc_class(contender, tuple(src))(**src, batch_size=batch)
    if contender in TREES:
        return src
    if contender in FLOORS:
        return pytree.tree_leaves(src)
    raise ValueError(f"unknown contender {contender!r}")


# ----------------------------------------------------------------------------- data
def _batch(n: int | None) -> tuple[int, ...]:
    return () if n is None else (n,)


def chain_src(n: int | None = None) -> dict[str, Any]:
    """A 10-deep chain ``{"x": t0, "n": {"x": t1, "n": {...{"x": t10}}}}``: 11 leaves."""
    shape = _batch(n)
    node: dict[str, Any] = {"x": torch.full(shape, float(DEPTH))}
    for i in range(DEPTH - 1, -1, -1):
        node = {"x": torch.full(shape, float(i)), "n": node}
    return node


def flat_src(
    keys: tuple[str, ...], n: int | None = None, feat: tuple[int, ...] = ()
) -> dict[str, Any]:
    """``len(keys)`` leaves of shape ``batch + feat``, leaf i filled with i."""
    return {k: torch.full(_batch(n) + feat, float(i)) for i, k in enumerate(keys)}


def batch_src(
    n: int, leaves: int = 20, feat: int = FEAT, lead: tuple[int, ...] = ()
) -> dict[str, Any]:
    """``leaves`` random leaves of shape ``lead + (n, feat)`` (seeded)."""
    g = torch.Generator().manual_seed(n * 1000 + leaves)
    return {f"k{i}": torch.randn((*lead, n, feat), generator=g) for i in range(leaves)}


def names(n: int) -> tuple[str, ...]:
    return tuple(f"f{i}" for i in range(n))


# ----------------------------------------------------------------------------- helpers
def leafwise(contender: str, leaf: Fn, method: Fn, foreach: Fn | None = None) -> Fn:
    """The contender's form of "apply ``leaf`` to every leaf"."""
    if contender in TD_LIKE or contender in TC:
        return method
    if contender == "pytree":
        return lambda c: pytree.tree_map(leaf, c)
    if contender == "optree":
        return lambda c: optree.tree_map(leaf, c)
    if contender == "floor":
        return lambda ls: [leaf(x) for x in ls]
    if contender == "floor_foreach" and foreach is not None:
        return foreach
    raise ValueError(f"no {contender!r} form for this workload")


def pairwise(contender: str, leaf: Fn, method: Fn, foreach: Fn | None = None) -> Fn:
    """The contender's form of "combine two containers leaf by leaf"."""
    if contender in TD_LIKE or contender in TC:
        return method
    if contender == "pytree":
        return lambda a, b: pytree.tree_map(leaf, a, b)
    if contender == "optree":
        return lambda a, b: optree.tree_map(leaf, a, b)
    if contender == "floor":
        return lambda a, b: [leaf(x, y) for x, y in zip(a, b)]
    if contender == "floor_foreach" and foreach is not None:
        return foreach
    raise ValueError(f"no {contender!r} form for this workload")


def _identity(x: Any) -> Any:
    return x


def shallow_copy(contender: str) -> Fn:
    """New container, same leaf tensors (no data copied)."""
    if contender in TD_LIKE or contender in TC:
        return lambda c: c.copy()
    if contender == "floor":
        return lambda ls: list(ls)
    return leafwise(contender, _identity, _identity)


def unbind_like(contender: str, split_leaf: Fn, method: Fn) -> Fn:
    """The contender's form of "split every leaf, regroup the pieces into containers"."""
    if contender in TD_LIKE or contender in TC:
        return method
    if contender == "pytree":

        def tree_split(c: Any) -> list[Any]:
            leaves, spec = pytree.tree_flatten(c)
            return [
                pytree.tree_unflatten(list(p), spec) for p in zip(*[split_leaf(x) for x in leaves])
            ]

        return tree_split
    if contender == "optree":

        def optree_split(c: Any) -> list[Any]:
            leaves, spec = optree.tree_flatten(c)
            return [
                optree.tree_unflatten(spec, list(p)) for p in zip(*[split_leaf(x) for x in leaves])
            ]

        return optree_split
    if contender == "floor":
        return lambda ls: list(zip(*[split_leaf(x) for x in ls]))
    raise ValueError(f"no {contender!r} form for this workload")


# ----------------------------------------------------------------------------- workloads
#: Contenders compiled only in the representative workloads (``conftest.py``): compiled,
#: Dynamo traces their ``tree_map`` away and they run the floor's graph (the floor is the
#: compiled target's comparator, no target reads these); their eager rows are what differs.
COMPILED_IF_REPRESENTATIVE = TREES


@dataclass(frozen=True)
class Workload:
    """One container workload: its builder, contenders, and which modes apply."""

    name: str
    build: Callable[[str, int | None], Built]
    contenders: tuple[str, ...]
    compiled: bool = True
    probe: bool = True
    representative: bool = False
    tc: bool = False

    @property
    def doc(self) -> str:
        return (self.build.__doc__ or self.name).strip().splitlines()[0]


WORKLOADS: dict[str, Workload] = {}


def workload(
    contenders: tuple[str, ...],
    *,
    name: str | None = None,
    tc: bool = False,
    compiled: bool = True,
    probe: bool = True,
    representative: bool = False,
) -> Callable[[Callable[[str, int | None], Built]], Callable[[str, int | None], Built]]:
    """Register a ``build(contender, n) -> (fn, args)`` function as a workload."""

    def register(build: Callable[[str, int | None], Built]) -> Callable[[str, int | None], Built]:
        wname = name or build.__name__.removeprefix("build_")
        cs = contenders + (TC if tc else ())
        WORKLOADS[wname] = Workload(wname, build, cs, compiled, probe, representative, tc)
        return build

    return register


ALL_FLAT = TD_LIKE + TREES + FLOORS
NO_FOREACH = TD_LIKE + TREES + ("floor",)


def _add1(x: Any) -> Any:
    return x + 1


def _add(x: Any, y: Any) -> Any:
    return x + y


@workload(ALL_FLAT, representative=True)
def build_add_one_nested(contender: str, n: int | None) -> Built:
    """``x + 1`` on a 10-deep nested chain of 11 scalars (``td + 1`` / ``tree_map``)."""
    c = container(contender, chain_src(n), _batch(n))
    return leafwise(contender, _add1, lambda td: td + 1, lambda ls: torch._foreach_add(ls, 1)), (c,)


@workload(ALL_FLAT, tc=True)
def build_add_one_flat(contender: str, n: int | None) -> Built:
    """``x + 1`` on 50 flat scalars (a 50-field tensorclass for the ``_tc`` contenders)."""
    c = container(contender, flat_src(KEYS50, n), _batch(n))
    return leafwise(contender, _add1, lambda td: td + 1, lambda ls: torch._foreach_add(ls, 1)), (c,)


@workload(ALL_FLAT)
def build_add_self_nested(contender: str, n: int | None) -> Built:
    """``x + x`` on the 10-deep nested chain of 11 scalars (two containers, same structure)."""
    c = container(contender, chain_src(n), _batch(n))
    return pairwise(contender, _add, lambda a, b: a + b, torch._foreach_add), (c, c)


@workload(ALL_FLAT, tc=True)
def build_add_self_flat(contender: str, n: int | None) -> Built:
    """``x + x`` on 50 flat scalars."""
    c = container(contender, flat_src(KEYS50, n), _batch(n))
    return pairwise(contender, _add, lambda a, b: a + b, torch._foreach_add), (c, c)


@workload(TD_LIKE + TREES + ("floor",))
def build_copy_nested(contender: str, n: int | None) -> Built:
    """Shallow copy of the nested chain: a new container holding the same 11 leaf tensors.

    ``c.copy()`` for tdfunc and tensordict (and their tensorclasses), ``tree_map(identity)``
    for the trees, ``list(l)`` for the floor (so the floor ratio is not meaningful here).
    """
    return shallow_copy(contender), (container(contender, chain_src(n), _batch(n)),)


@workload(TD_LIKE + TREES + ("floor",), tc=True)
def build_copy_flat(contender: str, n: int | None) -> Built:
    """Shallow copy of 50 flat scalars (see ``copy_nested`` for each contender's form)."""
    return shallow_copy(contender), (container(contender, flat_src(KEYS50, n), _batch(n)),)


def _make_clone_shallow(n_fields: int) -> None:
    def build(contender: str, n: int | None) -> Built:
        bs = (FIELD_BATCH if n is None else n,)
        src = flat_src(names(n_fields), bs[0], (FIELD_FEAT,))
        return shallow_copy(contender), (container(contender, src, bs),)

    build.__doc__ = (
        f"Shallow clone of a {n_fields}-field container (leaves [16, 4]): same leaves, new "
        f"container (tensordict: ``clone(recurse=False)`` = ``copy()``)."
    )
    workload(TD_LIKE + TREES + ("floor",), name=f"clone_shallow_{n_fields}", tc=True)(build)


for _n in (20, 80):  # the cost per field is linear: two sizes give it (a middle one adds nothing)
    _make_clone_shallow(_n)


@workload((*TD_LIKE, "pytree", "floor", "floor_foreach"))
def build_build_add(contender: str, n: int | None) -> Built:
    """Build a 100-key container from empty, one key at a time, then ``+ 1``.

    tdfunc is immutable: 100 functional ``td = td.set(k, v)`` calls, each returning a new
    TensorDict. tensordict uses its own idiom ``td[k] = v`` (in place), the pytree a dict
    assignment, the floor ``list.append``. The 100 values are inputs (pre-made tensors).
    """
    vals = [torch.full(_batch(n), float(i)) for i in range(100)]
    if contender == "tdfunc":

        def fn(vs: list[torch.Tensor]) -> Any:
            td = tdfunc.TensorDict()
            for k, v in zip(KEYS100, vs):
                td = td.set(k, v)
            return td + 1

    elif contender == "tensordict":
        TensorDict = _tensordict().TensorDict

        def fn(vs: list[torch.Tensor]) -> Any:
            td = TensorDict()
            for k, v in zip(KEYS100, vs):
                td[k] = v
            return td + 1

    elif contender == "pytree":

        def fn(vs: list[torch.Tensor]) -> Any:
            d = {}
            for k, v in zip(KEYS100, vs):
                d[k] = v
            return pytree.tree_map(_add1, d)

    else:
        foreach = contender == "floor_foreach"

        def fn(vs: list[torch.Tensor]) -> Any:
            lst = []
            for v in vs:
                lst.append(v)
            return torch._foreach_add(lst, 1) if foreach else [x + 1 for x in lst]

    return fn, (vals,)


def _batch20(contender: str, n: int | None, default: int = 100) -> Any:
    b = default if n is None else n
    return container(contender, batch_src(b), (b,))


def _index(i: Any) -> Callable[[str], Fn]:
    return lambda contender: leafwise(contender, lambda x: x[i], lambda c: c[i])


@workload(NO_FOREACH, tc=True)
def build_index_int(contender: str, n: int | None) -> Built:
    """``c[3]`` (a real int) on a batch-[100] container with 20 leaves [100, 8]."""
    return _index(3)(contender), (_batch20(contender, n),)


@workload(NO_FOREACH, tc=True)
def build_index_slice(contender: str, n: int | None) -> Built:
    """``c[::2]`` on a batch-[100] container with 20 leaves [100, 8]."""
    return _index(slice(None, None, 2))(contender), (_batch20(contender, n),)


@workload(NO_FOREACH, tc=True)
def build_index_tensor(contender: str, n: int | None) -> Built:
    """``c[idx]`` with a long index tensor of 50 rows, batch-[100] container, 20 leaves [100, 8]."""
    b = 100 if n is None else n
    idx = torch.randperm(b, generator=torch.Generator().manual_seed(0))[: b // 2]
    fn = pairwise(contender, lambda x, i: x[i], lambda c, i: c[i])
    if contender in TREES:
        tree_map = pytree.tree_map if contender == "pytree" else optree.tree_map
        fn = lambda c, i: tree_map(lambda x: x[i], c)  # noqa: E731
    elif contender == "floor":
        fn = lambda ls, i: [x[i] for x in ls]  # noqa: E731
    return fn, (_batch20(contender, n), idx)


def _fields(contender: str, n_fields: int, n: int | None) -> Any:
    b = FIELD_BATCH if n is None else n
    return container(contender, flat_src(names(n_fields), b, (FIELD_FEAT,)), (b,))


def _replace(contender: str, key: int) -> Fn:
    name = f"f{key}"
    if contender in ("tdfunc", "tdfunc_tc", "tensordict", "tensordict_tc"):
        return lambda c, v: c.replace(**{name: v})
    if contender == "pytree":
        return lambda c, v: {**c, name: v}
    if contender == "floor":

        def floor_replace(lst: list[Any], v: Any) -> list[Any]:
            out = list(lst)
            out[key] = v
            return out

        return floor_replace
    raise ValueError(contender)


def _new_values(n: int | None, count: int) -> list[torch.Tensor]:
    b = FIELD_BATCH if n is None else n
    return [torch.full((b, FIELD_FEAT), 100.0 + i) for i in range(count)]


@workload((*TD_LIKE, "pytree", "floor"), tc=True)
def build_replace_one(contender: str, n: int | None) -> Built:
    """Replace one field of a 5-field container (leaves [16, 4]) with a new tensor.

    ``c.replace(f0=v)`` for tdfunc, tensordict and the tensorclasses (new container), ``{**d,
    "f0": v}`` for the pytree, a list copy with one slot replaced for the floor.
    """
    rep = _replace(contender, 0)
    return (lambda c, v: rep(c, v)), (_fields(contender, 5, n), _new_values(n, 1)[0])


@workload((*TD_LIKE, "pytree", "floor"), tc=True)
def build_replace_chain10(contender: str, n: int | None) -> Built:
    """A chain of 10 single-field replaces on a 5-field container (fields f0..f4 in turn)."""
    reps = [_replace(contender, i % 5) for i in range(10)]

    def fn(c: Any, vals: list[torch.Tensor]) -> Any:
        for rep, v in zip(reps, vals):
            c = rep(c, v)
        return c

    return fn, (_fields(contender, 5, n), _new_values(n, 10))


READ_NAMES = names(20)


@workload((*TD_LIKE, "pytree", "floor"), tc=True)
def build_tc_read_20(contender: str, n: int | None) -> Built:
    """Read the 20 fields of a 20-field container and sum them (leaves [16, 4]).

    Tensorclasses read attributes (``c.f0``), TensorDicts and dicts read ``c["f0"]``, the
    floor reads ``l[0]``.
    """
    if contender in TC:

        def read(c: Any) -> Any:
            return reduce(operator.add, [getattr(c, k) for k in READ_NAMES])
    elif contender == "floor":

        def read(c: Any) -> Any:
            return reduce(operator.add, [c[i] for i in range(len(READ_NAMES))])
    else:

        def read(c: Any) -> Any:
            return reduce(operator.add, [c[k] for k in READ_NAMES])

    return read, (_fields(contender, 20, n),)


@workload((*TD_LIKE, "pytree", "floor"))
def build_update_20(contender: str, n: int | None) -> Built:
    """Update 20 keys of a 20-key container with the 20 values of another (leaves [16, 4]).

    tdfunc: ``td.update(other)`` returns a new TensorDict; tensordict's ``td.update(other)``
    writes into ``td`` in place (its idiom; the same keys are overwritten on every call); the
    pytree builds ``{**d, **other}``; the floor copies the list and replaces 20 slots.
    """
    base = _fields(contender, 20, n)
    b = FIELD_BATCH if n is None else n
    other = container(
        contender,
        {k: torch.full((b, FIELD_FEAT), -float(i)) for i, k in enumerate(names(20))},
        (b,),
    )
    if contender in TD_LIKE:
        fn = lambda c, o: c.update(o)  # noqa: E731
    elif contender == "pytree":
        fn = lambda c, o: {**c, **o}  # noqa: E731
    else:

        def fn(c: list[Any], o: list[Any]) -> list[Any]:
            out = list(c)
            for i, v in enumerate(o):
                out[i] = v
            return out

    return fn, (base, other)


def _creator(contender: str, keys: tuple[str, ...]) -> Fn:
    if contender == "tdfunc":
        return lambda vs: tdfunc.TensorDict(dict(zip(keys, vs)), batch_size=vs[0].shape[:1])
    if contender == "tensordict":
        TensorDict = _tensordict().TensorDict
        return lambda vs: TensorDict(dict(zip(keys, vs)), batch_size=vs[0].shape[:1])
    if contender in TC:
        cls = tc_class(contender, keys)
        return lambda vs: cls(**dict(zip(keys, vs)), batch_size=vs[0].shape[:1])
    if contender == "pytree":
        return lambda vs: dict(zip(keys, vs))
    if contender == "floor":
        return lambda vs: list(vs)
    raise ValueError(contender)


def _make_create(n_keys: int) -> None:
    def build(contender: str, n: int | None) -> Built:
        b = FIELD_BATCH if n is None else n
        vals = [torch.full((b, FIELD_FEAT), float(i)) for i in range(n_keys)]
        return _creator(contender, names(n_keys)), (vals,)

    build.__doc__ = (
        f"Create a container from {n_keys} tensors [16, 4] with batch size [16] (tdfunc and "
        f"tensordict check every leaf against it; a dict or list does not)."
    )
    workload((*TD_LIKE, "pytree", "floor"), name=f"create_{n_keys}", tc=True)(build)


for _n in (10, 100):  # as clone_shallow: two sizes give the cost per leaf
    _make_create(_n)


@workload((*TD_LIKE, "pytree", "floor"), compiled=False, probe=False)
def build_create_empty(contender: str, n: int | None) -> Built:
    """Create an empty container (``TensorDict()``, ``{}``, ``[]``)."""
    if contender == "tdfunc":
        return (lambda: tdfunc.TensorDict()), ()
    if contender == "tensordict":
        TensorDict = _tensordict().TensorDict
        return (lambda: TensorDict()), ()
    return ((dict) if contender == "pytree" else (list)), ()


@workload((*TD_LIKE, "pytree", "floor"))
def build_create_nested(contender: str, n: int | None) -> Built:
    """Create a 3-level nested container ``{"a", "b": {"c", "d": {"e"}}}`` from 3 tensors [16, 4]."""
    b = FIELD_BATCH if n is None else n
    vals = [torch.full((b, FIELD_FEAT), float(i)) for i in range(3)]

    def nest(vs: list[torch.Tensor]) -> dict[str, Any]:
        return {"a": vs[0], "b": {"c": vs[1], "d": {"e": vs[2]}}}

    if contender == "tdfunc":
        fn = lambda vs: tdfunc.TensorDict(nest(vs), batch_size=vs[0].shape[:1])  # noqa: E731
    elif contender == "tensordict":
        TensorDict = _tensordict().TensorDict
        fn = lambda vs: TensorDict(nest(vs), batch_size=vs[0].shape[:1])  # noqa: E731
    elif contender == "pytree":
        fn = nest
    else:
        fn = lambda vs: list(vs)  # noqa: E731
    return fn, (vals,)


def _walk(d: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        d = d[k]
    return d


@workload((*TD_LIKE, "pytree"), compiled=False, probe=False)
def build_get_nested(contender: str, n: int | None) -> Built:
    """Get the deepest leaf of the 10-deep chain by its 11-key path (``td[path]``, dict walk)."""
    c = container(contender, chain_src(n), _batch(n))
    if contender in TD_LIKE:
        return (lambda c: c[CHAIN_PATH]), (c,)
    return (lambda d: _walk(d, CHAIN_PATH)), (c,)


def _path_keys(path: Any) -> tuple[str, ...]:
    return tuple(k.key for k in path)


@workload(TD_LIKE + TREES, compiled=False, probe=False)
def build_keys_nested(contender: str, n: int | None) -> Built:
    """All nested leaf keys of the 10-deep chain as a list (``keys(include_nested, leaves_only)``).

    pytree: ``tree_flatten_with_path`` key paths as tuples; optree: ``tree_paths`` (sorted keys).
    """
    c = container(contender, chain_src(n), _batch(n))
    if contender == "tdfunc":
        fn = lambda c: c.keys(include_nested=True, leaves_only=True)  # noqa: E731
    elif contender == "tensordict":
        fn = lambda c: list(c.keys(include_nested=True, leaves_only=True))  # noqa: E731
    elif contender == "pytree":
        fn = lambda d: [_path_keys(p) for p, _ in pytree.tree_flatten_with_path(d)[0]]  # noqa: E731
    else:
        fn = lambda d: optree.tree_paths(d)  # noqa: E731
    return fn, (c,)


@workload(TD_LIKE + TREES, compiled=False, probe=False)
def build_values_nested(contender: str, n: int | None) -> Built:
    """All leaf values of the 10-deep chain as a list (``values(include_nested, leaves_only)``)."""
    c = container(contender, chain_src(n), _batch(n))
    if contender == "tdfunc":
        fn = lambda c: c.values(include_nested=True, leaves_only=True)  # noqa: E731
    elif contender == "tensordict":
        fn = lambda c: list(c.values(include_nested=True, leaves_only=True))  # noqa: E731
    elif contender == "pytree":
        fn = pytree.tree_leaves
    else:
        fn = optree.tree_leaves
    return fn, (c,)


@workload(TD_LIKE + TREES, compiled=False, probe=False)
def build_items_nested(contender: str, n: int | None) -> Built:
    """All ``(nested key, leaf)`` pairs of the 10-deep chain as a list."""
    c = container(contender, chain_src(n), _batch(n))
    if contender == "tdfunc":
        fn = lambda c: c.items(include_nested=True, leaves_only=True)  # noqa: E731
    elif contender == "tensordict":
        fn = lambda c: list(c.items(include_nested=True, leaves_only=True))  # noqa: E731
    elif contender == "pytree":
        fn = lambda d: [(_path_keys(p), v) for p, v in pytree.tree_flatten_with_path(d)[0]]  # noqa: E731
    else:

        def fn(d: Any) -> list[Any]:
            paths, leaves, _ = optree.tree_flatten_with_path(d)
            return list(zip(paths, leaves))

    return fn, (c,)


def _dict_contains(d: Any, path: tuple[str, ...]) -> bool:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return False
        d = d[k]
    return True


@workload((*TD_LIKE, "pytree"), compiled=False, probe=False)
def build_membership(contender: str, n: int | None) -> Built:
    """Three membership tests on the nested chain: ``"x"``, ``("n", "n", "x")`` (hits) and
    ``("n", "q")`` (a miss)."""
    c = container(contender, chain_src(n), _batch(n))
    if contender in TD_LIKE:
        fn = lambda c: ("x" in c, MEMBER_HIT in c, MEMBER_MISS in c)  # noqa: E731
    else:
        fn = lambda d: ("x" in d, _dict_contains(d, MEMBER_HIT), _dict_contains(d, MEMBER_MISS))  # noqa: E731
    return fn, (c,)


def _stack_like(contender: str, leaf_op: Fn, td_op: Fn, tc_op: Fn) -> Fn:
    if contender in TD_LIKE:
        return td_op
    if contender in TC:
        return tc_op
    if contender == "pytree":
        return lambda cs: pytree.tree_map(lambda *xs: leaf_op(xs), *cs)
    if contender == "optree":
        return lambda cs: optree.tree_map(lambda *xs: leaf_op(xs), *cs)
    if contender == "floor":
        return lambda ls: [leaf_op(xs) for xs in zip(*ls)]
    raise ValueError(contender)


def _ten(contender: str, n: int | None) -> list[Any]:
    b = 10 if n is None else n
    base = batch_src(b)
    return [container(contender, {k: v + i for k, v in base.items()}, (b,)) for i in range(10)]


@workload(NO_FOREACH, tc=True)
def build_stack10(contender: str, n: int | None) -> Built:
    """Stack 10 containers (batch [10], 20 leaves [10, 8]) along a new dim 0."""
    tstack = torch.stack if contender.startswith("tensordict") else tdfunc.stack
    fn = _stack_like(
        contender, lambda xs: torch.stack(xs, 0), lambda cs: tstack(cs, 0), lambda cs: tstack(cs, 0)
    )
    return fn, (_ten(contender, n),)


@workload(NO_FOREACH, tc=True)
def build_cat10(contender: str, n: int | None) -> Built:
    """Concatenate 10 containers (batch [10], 20 leaves [10, 8]) along dim 0 (batch [100])."""
    tcat = torch.cat if contender.startswith("tensordict") else tdfunc.cat
    fn = _stack_like(
        contender, lambda xs: torch.cat(xs, 0), lambda cs: tcat(cs, 0), lambda cs: tcat(cs, 0)
    )
    return fn, (_ten(contender, n),)


@workload(NO_FOREACH, tc=True)
def build_unbind(contender: str, n: int | None) -> Built:
    """Unbind dim 0 of a batch-[10] container with 20 leaves into 10 containers.

    The trees flatten, unbind every leaf and unflatten 10 containers; the floor returns the 10
    per-item tuples. The probe unbinds a batch-[10, n] container (10 pieces at every size).
    """
    src = batch_src(10) if n is None else batch_src(n, lead=(10,))
    c = container(contender, src, (10,) if n is None else (10, n))
    return unbind_like(contender, lambda x: x.unbind(0), lambda c: c.unbind(0)), (c,)


@workload(NO_FOREACH, tc=True)
def build_split(contender: str, n: int | None) -> Built:
    """Split a batch-[100] container with 20 leaves into 10 containers of batch [10]."""
    src = batch_src(100) if n is None else batch_src(n, lead=(100,))
    c = container(contender, src, (100,) if n is None else (100, n))
    return unbind_like(contender, lambda x: x.split(10, 0), lambda c: c.split(10, 0)), (c,)


@workload(NO_FOREACH, tc=True)
def build_reshape(contender: str, n: int | None) -> Built:
    """Reshape the batch dims [100] -> [50, 2] (``-1, 2``) of a container with 20 leaves [100, 8]."""
    fn = leafwise(contender, lambda x: x.reshape(-1, 2, *x.shape[1:]), lambda c: c.reshape(-1, 2))
    return fn, (_batch20(contender, n),)


@workload(NO_FOREACH, tc=True)
def build_permute(contender: str, n: int | None) -> Built:
    """Permute the batch dims [10, 10] -> (1, 0) of a container with 20 leaves [10, 10, 8]."""
    b = 10 if n is None else n
    c = container(contender, batch_src(b, lead=(10,)), (10, b))
    return leafwise(contender, lambda x: x.permute(1, 0, 2), lambda c: c.permute(1, 0)), (c,)


@workload(NO_FOREACH, tc=True)
def build_to_float64(contender: str, n: int | None) -> Built:
    """``to(torch.float64)`` on a batch-[100] container with 20 leaves [100, 8]."""
    fn = leafwise(contender, lambda x: x.to(torch.float64), lambda c: c.to(torch.float64))
    return fn, (_batch20(contender, n),)


def _affine(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


@workload(ALL_FLAT, tc=True)
def build_apply(contender: str, n: int | None) -> Built:
    """``apply(lambda x: x * 2 + 1)`` on a batch-[100] container with 20 leaves [100, 8]."""
    fn = leafwise(
        contender,
        _affine,
        lambda c: c.apply(_affine),
        lambda ls: torch._foreach_add(torch._foreach_mul(ls, 2), 1),
    )
    return fn, (_batch20(contender, n),)


# ----------------------------------------------------------------------------- the test
def to_device(args: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """``args`` with every tensor moved to ``device`` (containers rebuilt through pytree)."""
    if device.type == "cpu":
        return args
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, args)


def _params() -> list[Any]:
    out = []
    for w in WORKLOADS.values():
        modes = [m for m in available_modes() if w.compiled or m == "eager"]
        for mode in modes:
            for c in CONTENDERS:
                if c not in w.contenders or (c == "tdfunc_tc" and not HAS_TDFUNC_TC):
                    continue
                marks = [pytest.mark.bench_representative] if w.representative else []
                if mode != "eager" and c == "tdfunc_tc" and not w.representative:
                    marks.append(pytest.mark.bench_full_only)  # test_bench_tensorclass covers it
                out.append(pytest.param(w.name, mode, c, id=f"{w.name}-{mode}-{c}", marks=marks))
    return out


@pytest.mark.parametrize(("workload", "mode", "contender"), _params())
def test_container_op(
    measure: Callable[..., Any],
    bench_device: torch.device,
    workload: str,
    mode: str,
    contender: str,
) -> None:
    """One container workload (see its ``build_*`` docstring) for one contender and mode."""
    w = WORKLOADS[workload]
    fn, args = w.build(contender, None)
    make_args = (lambda n: to_device(w.build(contender, n)[1], bench_device)) if w.probe else None
    measure(
        fn,
        *to_device(args, bench_device),
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=make_args,
        doc=w.doc,
    )
