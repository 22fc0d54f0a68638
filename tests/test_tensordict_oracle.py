"""tensordict (0.15.3) as the oracle for every row of the migration table with a spelling:
the same data through tensordict's method and through tdfunc's spelling give the same values,
shapes and batch sizes, and the tdfunc input is left as it was.

A case is ``(tensordict call, tdfunc call)`` over ``(x, y)``: two containers of one structure
(``x`` the input, ``y`` an operand), fresh for every case. ``same(name, *args)`` calls the same
method with the same arguments on both sides; tensordict's in-place rows ``X_`` run on a
tensordict clone and compare with the pure spelling ``X``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import tdfunc

T = pytest.importorskip("tensordict")

import migration_table as mt  # noqa: E402 - after the importorskip

ROWS = mt.table(mt.tensordict_names())

OTHER: Any = object()  # placeholder: the operand container of the same side
MASK = torch.tensor([True, False, True])
INDEX = torch.tensor([2, 0, 1])


def _data(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)

    def r(*s: int) -> torch.Tensor:
        return torch.rand(*s, generator=g) * 0.5 + 0.25

    return {"a": r(3, 4), "b": r(3), "d": r(3), "e": r(3, 4), "n": {"c": r(3, 2)}}


def _td(d: dict[str, Any]) -> Any:
    return T.TensorDict(
        {
            k: (T.TensorDict(v, batch_size=[3]) if isinstance(v, dict) else v.clone())
            for k, v in d.items()
        },
        batch_size=[3],
        device="cpu",
    )


def _tf(d: dict[str, Any]) -> Any:
    return tdfunc.TensorDict(
        {
            k: ({kk: vv.clone() for kk, vv in v.items()} if isinstance(v, dict) else v.clone())
            for k, v in d.items()
        },
        batch_size=[3],
        device="cpu",
    )


class Case(NamedTuple):
    ref: Callable[[Any, Any], Any]
    got: Callable[[Any, Any], Any]
    norm: Callable[[Any], Any] | None = None  # applied to both results before comparing


def same(name: str, *args: Any, **kw: Any) -> Case:
    def f(x: Any, y: Any) -> Any:
        return getattr(x, name)(*[y if a is OTHER else a for a in args], **kw)

    f.spec = (name, args, kw)  # type: ignore[attr-defined]
    return Case(f, f)


def split(ref: Callable[[Any, Any], Any], got: Callable[[Any, Any], Any], norm: Any = None) -> Case:
    return Case(ref, got, norm)


def _shapes(r: Any) -> Any:
    """Uninitialised values: compare structure, shapes and dtypes only."""
    if isinstance(r, T.TensorDictBase):
        r = tdfunc.from_tensordict(r, copy=True)
    return r.apply(torch.zeros_like)


UNARY = [
    "abs",
    "acos",
    "asin",
    "atan",
    "ceil",
    "cos",
    "cosh",
    "erf",
    "erfc",
    "exp",
    "expm1",
    "floor",
    "frac",
    "lgamma",
    "log",
    "log10",
    "log1p",
    "log2",
    "reciprocal",
    "round",
    "sigmoid",
    "sign",
    "sin",
    "sinh",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
    "isfinite",
    "isnan",
    "isneginf",
    "isposinf",
    "bfloat16",
    "bool",
    "double",
    "float",
    "half",
    "int",
    "cpu",
    "clone",
    "copy",
    "contiguous",
    "detach",
    "consolidate",
    "tolist",
    "numpy",
    "to_dict",
    "is_empty",
]
BINARY = ["add", "sub", "mul", "div", "pow", "maximum", "minimum"]
REDUCE = [
    "sum",
    "mean",
    "prod",
    "nansum",
    "nanmean",
    "std",
    "var",
    "amax",
    "amin",
    "logsumexp",
    "max",
    "min",
    "cummax",
    "cummin",
    "softmax",
]
DTYPES = [
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "complex64",
    "complex128",
]


def _popitem_tf(x: Any, y: Any) -> Any:
    k = x.keys()[-1]
    v, rest = x.popped(k)
    return (k, v), rest


def _grad_ref(x: Any, y: Any) -> Any:
    p = x.clone().apply(lambda t: t.requires_grad_())
    (p["a"].sum() + 2 * p["n", "c"].sum()).backward()
    return p.grad


def _grad_tf(x: Any, y: Any) -> Any:
    return tdfunc.value_and_grad(lambda t: t["a"].sum() + 2 * t["n", "c"].sum())(x)[1]


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _to_module_ref(x: Any, y: Any) -> Any:
    m = _module()
    p = T.TensorDict.from_module(m).apply(lambda t: t.detach() * 0.5)
    with p.to_module(m):
        return m(x["a"])


def _to_module_tf(x: Any, y: Any) -> Any:
    m = _module()
    p = tdfunc.from_module(m).apply(lambda t: t.detach() * 0.5)
    return tdfunc.functional_call(m, p, (x["a"],))


NT = collections.namedtuple("NT", ["a", "b"])

CASES: dict[str, Case] = {
    **{n: same(n) for n in UNARY},
    **{n: same(n, OTHER) for n in BINARY},
    "neg": same("neg"),
    "neg_": split(lambda x, y: x.neg_(), lambda x, y: -x),
    "isreal": split(lambda x, y: x.isreal(), lambda x, y: x.apply(torch.isreal)),
    "mod": split(lambda x, y: x.mod(y), lambda x, y: x % y),
    "rsub": split(lambda x, y: x.rsub(y), lambda x, y: torch.rsub(x, y)),
    **{n: same(n, 0) for n in REDUCE},
    **{
        n: split(lambda x, y, n=n: getattr(x, n)(), lambda x, y, n=n: x.to(getattr(torch, n)))
        for n in DTYPES
    },
    "bitwise_and": split(
        lambda x, y: (x > 0.5).bitwise_and(y > 0.5), lambda x, y: (x > 0.5).bitwise_and(y > 0.5)
    ),
    "logical_and": split(
        lambda x, y: (x > 0.5).logical_and(y > 0.5), lambda x, y: (x > 0.5).logical_and(y > 0.5)
    ),
    "addcdiv": same("addcdiv", OTHER, OTHER, value=0.5),
    "addcmul": same("addcmul", OTHER, OTHER, value=0.5),
    "lerp": same("lerp", OTHER, 0.3),
    "clamp": same("clamp", 0.4, 0.6),
    "clamp_max": same("clamp_max", 0.5),
    "clamp_min": same("clamp_min", 0.5),
    "where": same("where", MASK, OTHER),
    "masked_fill": same("masked_fill", MASK, 0.0),
    "type": split(lambda x, y: x.type(torch.float64), lambda x, y: x.to(torch.float64)),
    "to": same("to", torch.float64),
    "all": split(lambda x, y: (x > 0.3).all(), lambda x, y: (x > 0.3).all()),
    "any": split(lambda x, y: (x > 0.7).any(), lambda x, y: (x > 0.7).any()),
    "norm": same("norm"),
    "quantile": same("quantile", 0.5, 0),
    "flip": same("flip", 0),
    "fliplr": split(lambda x, y: x.unsqueeze(0).fliplr(), lambda x, y: x.unsqueeze(0).flip(1)),
    "flipud": split(lambda x, y: x.flipud(), lambda x, y: x.flip(0)),
    "roll": same("roll", 1, 0),
    "rot90": split(
        lambda x, y: x.unsqueeze(1).rot90(1, (0, 1)), lambda x, y: x.unsqueeze(1).rot90(1, (0, 1))
    ),
    "repeat": same("repeat", 2),
    "repeat_interleave": same("repeat_interleave", 2, 0),
    "tile": same("tile", (2,)),
    "narrow": same("narrow", 0, 1, 2),
    **{
        n: split(
            lambda x, y, n=n: getattr(x.unsqueeze(1), n)(0, 1),
            lambda x, y, n=n: getattr(x.unsqueeze(1), n)(0, 1),
        )
        for n in ("movedim", "moveaxis", "swapdims", "swapaxes")
    },
    "tensor_split": same("tensor_split", 2, 0),
    "gather": same("gather", 0, INDEX),
    "masked_select": same("masked_select", MASK),
    "pad": split(
        lambda x, y: x.pad([1, 0], value=0.5), lambda x, y: tdfunc.pad(x, [1, 0], value=0.5)
    ),
    "expand_as": split(
        lambda x, y: x.expand_as(y.expand(2, 3)), lambda x, y: x.expand_as(y.expand(2, 3))
    ),
    "expand": same("expand", 2, 3),
    "flatten": split(
        lambda x, y: x.unsqueeze(1).flatten(0, 1), lambda x, y: x.unsqueeze(1).flatten(0, 1)
    ),
    "permute": split(
        lambda x, y: x.unsqueeze(1).permute(1, 0), lambda x, y: x.unsqueeze(1).permute(1, 0)
    ),
    "reshape": same("reshape", 1, 3),
    "squeeze": split(
        lambda x, y: x.unsqueeze(1).squeeze(1), lambda x, y: x.unsqueeze(1).squeeze(1)
    ),
    "transpose": split(
        lambda x, y: x.unsqueeze(1).transpose(0, 1), lambda x, y: x.unsqueeze(1).transpose(0, 1)
    ),
    "unflatten": same("unflatten", 0, (3, 1)),
    "unsqueeze": same("unsqueeze", 0),
    "view": same("view", 1, 3),
    "split": same("split", 2, 0),
    "chunk": same("chunk", 2, 0),
    "unbind": same("unbind", 0),
    "broadcast_to": split(lambda x, y: x.broadcast_to((2, 3)), lambda x, y: x.expand(2, 3)),
    "atleast_1d": split(lambda x, y: x[0].atleast_1d(), lambda x, y: x[0].unsqueeze(0)),
    "atleast_2d": split(lambda x, y: x.atleast_2d(), lambda x, y: x.reshape(1, 3)),
    "atleast_3d": split(lambda x, y: x.atleast_3d(), lambda x, y: x.reshape(1, 1, 3)),
    **{
        n: split(lambda x, y, n=n: getattr(x, n), lambda x, y, n=n: getattr(x, n))
        for n in ["batch_size", "batch_dims", "device", "ndim", "shape"]
    },
    "dtype": split(lambda x, y: x.dtype, lambda x, y: x.dtype),
    "sorted_keys": split(lambda x, y: list(x.sorted_keys), lambda x, y: x.sorted_keys),
    "ndimension": split(lambda x, y: x.ndimension(), lambda x, y: x.ndim),
    "dim": same("dim"),
    "numel": same("numel"),
    "size": same("size"),
    "is_floating_point": split(
        lambda x, y: x.is_floating_point(), lambda x, y: x.dtype.is_floating_point
    ),
    "is_cpu": split(lambda x, y: x.is_cpu, lambda x, y: x.device.type == "cpu"),
    "is_cuda": split(lambda x, y: x.is_cuda, lambda x, y: x.device.type == "cuda"),
    "is_meta": split(lambda x, y: x.is_meta, lambda x, y: x.device.type == "meta"),
    "is_contiguous": split(
        lambda x, y: x.is_contiguous(), lambda x, y: all(t.is_contiguous() for t in x.leaves())
    ),
    "requires_grad": split(
        lambda x, y: x.requires_grad, lambda x, y: any(t.requires_grad for t in x.leaves())
    ),
    "is_memmap": split(
        lambda x, y: x.is_memmap(),
        lambda x, y: any(isinstance(t, tdfunc.MemoryMappedTensor) for t in x.leaves()),
    ),
    "depth": split(
        lambda x, y: x.depth, lambda x, y: max(len(k) for k in x.keys(include_nested=True)) - 1
    ),
    "param_count": split(
        lambda x, y: x.param_count(), lambda x, y: sum(t.numel() for t in x.leaves())
    ),
    "bytes": split(
        lambda x, y: x.bytes(), lambda x, y: sum(t.numel() * t.element_size() for t in x.leaves())
    ),
    "data_ptr": split(
        lambda x, y: [int(v) for v in x.data_ptr().values(True, True)],
        lambda x, y: [t.data_ptr() for t in x.leaves()],
        lambda r: [p != 0 for p in r],  # other tensors: the addresses themselves differ
    ),
    "attrs": split(
        lambda x, y: {k: (v.shape, v.dtype) for k, v in x.items(True, True)},
        lambda x, y: {k: (v.shape, v.dtype) for k, v in x.items(True, True)},
    ),
    "entry_class": split(lambda x, y: x.entry_class("a"), lambda x, y: type(x["a"])),
    "get_item_shape": split(lambda x, y: x.get_item_shape("a"), lambda x, y: x["a"].shape),
    "data": split(lambda x, y: x.data, lambda x, y: x.detach()),
    "grad": split(_grad_ref, _grad_tf, lambda r: r.select("a", ("n", "c"))),
    "get": same("get", ("n", "c")),
    "keys": split(lambda x, y: list(x.keys(True, True)), lambda x, y: x.keys(True, True)),
    "values": split(lambda x, y: list(x.values(True, True)), lambda x, y: x.values(True, True)),
    "items": split(lambda x, y: list(x.items(True, True)), lambda x, y: x.items(True, True)),
    "select": same("select", "a", ("n", "c")),
    "exclude": same("exclude", "a", ("n", "c")),
    "set": split(lambda x, y: x.set("z", y["a"]), lambda x, y: x.set("z", y["a"])),
    "update": split(
        lambda x, y: x.update({"z": y["b"], "a": y["a"]}),
        lambda x, y: x.update({"z": y["b"], "a": y["a"]}),
    ),
    "replace": split(lambda x, y: x.replace(a=y["a"]), lambda x, y: x.replace(a=y["a"])),
    "rename_keys": split(
        lambda x, y: x.rename_keys({"a": "z"}), lambda x, y: x.rename_keys({"a": "z"})
    ),
    "split_keys": same("split_keys", ["a", ("n", "c")]),
    "separates": split(lambda x, y: x.separates("a"), lambda x, y: x.split_keys(["a"])[0]),
    "pop": split(lambda x, y: (x.pop("a"), x), lambda x, y: x.popped("a")),
    "popitem": split(lambda x, y: (x.popitem(), x), _popitem_tf),
    "setdefault": split(
        lambda x, y: (x.setdefault("z", y["b"]), x)[1],
        lambda x, y: x if "z" in x else x.set("z", y["b"]),
    ),
    "fromkeys": split(
        lambda x, y: T.TensorDict.fromkeys(["p", "q"], 0),
        lambda x, y: tdfunc.TensorDict(dict.fromkeys(["p", "q"], 0)),
    ),
    "flatten_keys": same("flatten_keys", "."),
    "unflatten_keys": split(
        lambda x, y: x.flatten_keys(".").unflatten_keys("."),
        lambda x, y: x.flatten_keys(".").unflatten_keys("."),
    ),
    "create_nested": split(
        lambda x, y: x.create_nested("z"),
        lambda x, y: x.set("z", tdfunc.TensorDict(batch_size=x.batch_size)),
    ),
    "get_at": same("get_at", ("n", "c"), 1),
    "empty": same("empty", recurse=True),
    "clear": split(lambda x, y: x.clear(), lambda x, y: x.empty()),
    "stack_tensors": split(
        lambda x, y: x.stack_tensors("b", "d", out_key="s", dim=1, keep_entries=True),
        lambda x, y: x.set("s", torch.stack([x[k] for k in ("b", "d")], 1)),
    ),
    "cat_tensors": split(
        lambda x, y: x.cat_tensors("a", "e", out_key="s", dim=1, keep_entries=True),
        lambda x, y: x.set("s", torch.cat([x[k] for k in ("a", "e")], 1)),
    ),
    "apply": split(lambda x, y: x.apply(torch.add, y), lambda x, y: x.apply(torch.add, y)),
    "named_apply": split(
        lambda x, y: x.named_apply(lambda k, a, b: a + b * len(k), y, nested_keys=True),
        lambda x, y: x.named_apply(lambda k, a, b: a + b * len(k), y, nested_keys=True),
    ),
    "state_dict": split(lambda x, y: dict(x.state_dict()), lambda x, y: x.to_state_dict()),
    "load_state_dict": split(
        lambda x, y: x.load_state_dict(y.state_dict()),
        lambda x, y: tdfunc.TensorDict(y.to_dict(), batch_size=y.batch_size),
    ),
    "to_tensordict": split(lambda x, y: x.to_tensordict(), lambda x, y: x.clone()),
    "as_tensor": split(lambda x, y: x.as_tensor(), lambda x, y: x.apply(torch.as_tensor)),
    "pack": split(
        lambda x, y: x.pack()[0],
        lambda x, y: torch.cat([t.reshape(*x.batch_size, -1) for t in x.leaves()], -1),
    ),
    "new_zeros": same("new_zeros", 4),
    "new_ones": same("new_ones", 4),
    "new_empty": Case(same("new_empty", 4).ref, same("new_empty", 4).got, _shapes),
    "new_full": same("new_full", (4,), 2.0),
    "new_tensor": same("new_tensor", torch.ones(3)),
    "from_dict": split(
        lambda x, y: T.TensorDict.from_dict(y.to_dict(), batch_dims=1),
        lambda x, y: tdfunc.TensorDict.from_dict(y.to_dict(), batch_dims=1),
    ),
    "from_dict_instance": split(
        lambda x, y: x.from_dict_instance(y.to_dict()),
        lambda x, y: tdfunc.TensorDict.from_dict(y.to_dict()),
    ),
    "from_module": split(
        lambda x, y: T.TensorDict.from_module(_module()), lambda x, y: tdfunc.from_module(_module())
    ),
    "from_modules": split(
        lambda x, y: T.TensorDict.from_modules(_module(), _module()),
        lambda x, y: tdfunc.stack_modules([_module(), _module()]),
    ),
    "to_module": split(_to_module_ref, _to_module_tf),
    "from_namedtuple": split(
        lambda x, y: T.TensorDict.from_namedtuple(NT(x["a"], x["b"])),
        lambda x, y: tdfunc.TensorDict(NT(x["a"], x["b"])._asdict()),
    ),
    "from_tuple": split(
        lambda x, y: T.TensorDict.from_tuple((x["a"], x["b"])),
        lambda x, y: tdfunc.TensorDict({str(i): t for i, t in enumerate((x["a"], x["b"]))}),
    ),
    "from_list": split(
        lambda x, y: T.TensorDict.from_list([{"a": x["a"][0]}, {"a": x["a"][1]}]),
        lambda x, y: tdfunc.stack(
            [tdfunc.TensorDict(d) for d in ({"a": x["a"][0]}, {"a": x["a"][1]})]
        ),
    ),
    "from_any": split(
        lambda x, y: T.TensorDict.from_any(y.to_dict(), batch_size=[3]),
        lambda x, y: tdfunc.TensorDict(y.to_dict(), batch_size=[3]),
    ),
    "stack": split(
        lambda x, y: T.TensorDict.stack([x, y], 1), lambda x, y: tdfunc.stack([x, y], 1)
    ),
    "cat": split(lambda x, y: T.TensorDict.cat([x, y], 0), lambda x, y: tdfunc.cat([x, y], 0)),
    "maybe_dense_stack": split(
        lambda x, y: T.TensorDict.maybe_dense_stack([x, y], 0), lambda x, y: tdfunc.stack([x, y], 0)
    ),
    "stack_from_tensordict": split(
        lambda x, y: x.select("b", "d").stack_from_tensordict(0),
        lambda x, y: torch.stack(x.select("b", "d").leaves(), 0),
    ),
    "cat_from_tensordict": split(
        lambda x, y: x.select("a", "e").cat_from_tensordict(0),
        lambda x, y: torch.cat(x.select("a", "e").leaves(), 0),
    ),
    # in-place rows whose pure spelling is not X
    "zero_": split(lambda x, y: x.zero_(), lambda x, y: torch.zeros_like(x)),
    "fill_": split(
        lambda x, y: x.fill_("a", 2.0), lambda x, y: x.set("a", torch.full_like(x["a"], 2.0))
    ),
    "copy_": split(lambda x, y: x.copy_(y), lambda x, y: y),
    "copy_at_": split(lambda x, y: x.copy_at_(y[1], 1), lambda x, y: x.at[1].set(y[1])),
    "update_": split(lambda x, y: x.update_(y), lambda x, y: x.update(y)),
    "update_at_": split(lambda x, y: x.update_at_(y[1], 1), lambda x, y: x.at[1].set(y[1])),
    "set_": split(lambda x, y: x.set_("a", y["a"]), lambda x, y: x.set("a", y["a"])),
    "set_at_": split(
        lambda x, y: x.set_at_("a", y["a"][1], 1),
        lambda x, y: x.at[1].set(x[1].set("a", y["a"][1])),
    ),
    "apply_": split(lambda x, y: x.apply_(torch.exp), lambda x, y: x.apply(torch.exp)),
    "rename_key_": split(lambda x, y: x.rename_key_("a", "z"), lambda x, y: x.rename_key("a", "z")),
    "del_": split(lambda x, y: x.del_("a"), lambda x, y: x.exclude("a")),
    "filter_empty_": split(
        lambda x, y: x.set("z", T.TensorDict(batch_size=[3])).filter_empty_(),
        lambda x, y: x.set("z", tdfunc.TensorDict(batch_size=[3])).filter_empty(),
    ),
    "requires_grad_": split(
        lambda x, y: x.requires_grad_(), lambda x, y: x.apply(lambda t: t.detach().requires_grad_())
    ),
    "detach_": split(lambda x, y: x.detach_(), lambda x, y: x.detach()),
    "auto_batch_size_": split(
        lambda x, y: T.TensorDict(y.to_dict()).auto_batch_size_(batch_dims=1),
        lambda x, y: tdfunc.TensorDict.from_dict(y.to_dict(), batch_dims=1),
    ),
    "auto_device_": split(lambda x, y: x.auto_device_(), lambda x, y: x.to("cpu")),
    "clear_device_": split(
        lambda x, y: x.clear_device_(),
        lambda x, y: tdfunc.TensorDict(x.to_dict(), batch_size=x.batch_size),
    ),
    "share_memory_": split(
        lambda x, y: x.share_memory_(), lambda x, y: x.apply(lambda t: t.clone().share_memory_())
    ),
}

#: rows with a spelling that no oracle case runs, and why
EXEMPT: dict[str, str] = {
    "cuda": "no CUDA device on the test machine",
    "pin_memory": "pinned memory needs a CUDA device",
    "pin_memory_": "pinned memory needs a CUDA device",
    "record_stream": "CUDA streams need a CUDA device",
    "backward": "an autograd side effect on the caller's tensors (.grad), no result to compare; `grad` compares the gradients",
    "from_dataclass": "tensordict builds its own tensorclass type, tdfunc decorates the dataclass: test_tensorclass.py",
    "from_schema": "tensordict's own schema objects; the spelling (zeros_like of a template) is tested in test_ops.py",
    "send": "needs a process group: tests/test_distributed*.py",
    "recv": "needs a process group: tests/test_distributed*.py",
    "memmap": "file formats differ; the values round-trip in test_round_trips_through_files",
    "memmap_like": "file formats differ; the values round-trip in test_round_trips_through_files",
    "load_memmap": "file formats differ; the values round-trip in test_round_trips_through_files",
    "load": "file formats differ; the values round-trip in test_round_trips_through_files",
    "save": "file formats differ; the values round-trip in test_round_trips_through_files",
    "load_": "file formats differ; the values round-trip in test_round_trips_through_files",
    "load_memmap_": "file formats differ; the values round-trip in test_round_trips_through_files",
    "memmap_": "file formats differ; the values round-trip in test_round_trips_through_files",
    "memmap_refresh_": "file formats differ; the values round-trip in test_round_trips_through_files",
}


def _inplace_case(name: str) -> Case | None:
    """``X_`` on a tensordict clone against the pure ``X`` case."""
    base = CASES.get(name[:-1])
    spec = getattr(base.ref, "spec", None) if base is not None else None
    if base is None or spec is None:
        return None
    _, args, kw = spec

    def ref(x: Any, y: Any) -> Any:
        return getattr(x, name)(*[y if a is OTHER else a for a in args], **kw)

    return Case(ref, base.got, base.norm)


def case_for(name: str) -> Case | None:
    if name in CASES:
        return CASES[name]
    if name.endswith("_"):
        return _inplace_case(name)
    return None


WITH_SPELLING = [n for n, r in ROWS.items() if r.spelling is not None]


def test_every_row_with_a_spelling_has_an_oracle_case() -> None:
    missing = [n for n in WITH_SPELLING if case_for(n) is None and n not in EXEMPT]
    assert not missing, f"rows without an oracle case: {missing}"
    stale = sorted((set(CASES) | set(EXEMPT)) - set(WITH_SPELLING))
    assert not stale, f"cases for rows that have no spelling (or no row): {stale}"


def _params() -> list[Any]:
    out = []
    for n in WITH_SPELLING:
        if n in EXEMPT:
            continue
        why = mt.PENDING_ORACLE.get(n)
        marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
        out.append(pytest.param(n, marks=marks, id=n))
    return out


def _plain(r: Any) -> Any:
    """A tensordict result as tdfunc values (containers, tuples, dicts, tensors...)."""
    if isinstance(r, T.TensorDictBase):
        return tdfunc.from_tensordict(r, copy=True)
    if isinstance(r, tuple):
        return tuple(_plain(v) for v in r)
    if isinstance(r, list):
        return [_plain(v) for v in r]
    if isinstance(r, dict):
        return {k: _plain(v) for k, v in r.items()}
    return r


def check(ref: Any, got: Any, where: str = "") -> None:
    if tdfunc.is_container(ref):
        assert tdfunc.is_container(got), f"{where}: expected a container, got {type(got).__name__}"
        assert got.batch_size == ref.batch_size, (
            f"{where}: batch_size {got.batch_size} != {ref.batch_size}"
        )
        # the same keys; their order is not compared (tensordict moves a renamed key last)
        assert sorted(map(str, got.keys(True))) == sorted(map(str, ref.keys(True))), (
            f"{where}: keys {got.keys(True)} != {ref.keys(True)}"
        )
        for k, a in ref.items(True, True):
            check(a, got[k], f"{where}[{k}]")
    elif isinstance(ref, (tuple, list)):
        assert isinstance(got, (tuple, list)), (
            f"{where}: expected a sequence, got {type(got).__name__}"
        )
        assert len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(ref, got)):
            check(a, b, f"{where}[{i}]")
    elif isinstance(ref, dict):
        assert isinstance(got, dict), where
        assert list(got) == list(ref), where
        for k in ref:
            check(ref[k], got[k], f"{where}[{k}]")
    elif isinstance(ref, torch.Tensor):
        assert isinstance(got, torch.Tensor), (
            f"{where}: expected a tensor, got {type(got).__name__}"
        )
        assert got.dtype == ref.dtype, f"{where}: dtype {got.dtype} != {ref.dtype}"
        torch.testing.assert_close(got, ref, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(ref, np.ndarray):
        np.testing.assert_array_equal(got, ref)
    elif isinstance(ref, bool) and isinstance(got, torch.Tensor):
        assert got.shape == (), where  # tdfunc returns a 0-d tensor, never a Python bool
        assert bool(got) == ref, where
    else:
        assert got == ref, f"{where}: {got!r} != {ref!r}"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", _params())
def test_same_as_tensordict(name: str) -> None:
    case = case_for(name)
    assert case is not None
    d, o = _data(0), _data(1)
    x, y = _tf(d), _tf(o)
    before = x.clone()
    got = case.got(x, y)
    ref = _plain(case.ref(_td(d), _td(o)))
    if case.norm is not None:
        ref, got = case.norm(ref), case.norm(got)
    check(ref, got, name)
    tdfunc.testing.assert_close(x, before)  # the input is left as it was
    assert x.batch_size == before.batch_size


#: the rows of the op table with a plain tensor operand ``w`` shaped like the batch: it lines
#: up with the batch dims (leaves "a" [3, 4], "b" [3], "n.c" [3, 2]), as in tensordict
W = torch.tensor([0.5, 1.0, 2.0])
PLAIN_OPERAND: dict[str, Callable[[Any], Any]] = {
    **{n: (lambda x, n=n: getattr(x, n)(W)) for n in BINARY},
    "rsub": lambda x: W - x,
    "lerp": lambda x: x.lerp(x * 2, W),
    "clamp": lambda x: x.clamp(min=W * 0.5),
    "where": lambda x: x.where(MASK, W),
    "gt": lambda x: x > W,
    "eq": lambda x: x == W,
}


@pytest.mark.parametrize("name", list(PLAIN_OPERAND))
def test_a_batch_shaped_plain_operand_same_as_tensordict(name: str) -> None:
    """tensordict's ``where`` with a plain tensor ``other`` broadcasts it against each leaf
    as torch does (an error on these leaves): tdfunc lines it up with the batch, as tensordict
    does in arithmetic; compared with the per-leaf spelling there."""
    d = _data(0)
    x = _tf(d)
    got = PLAIN_OPERAND[name](x)
    if name == "where":
        ref = x.apply(
            lambda v: v.where(
                MASK.reshape(3, *(1,) * (v.ndim - 1)), W.reshape(3, *(1,) * (v.ndim - 1))
            )
        )
    else:
        ref = _plain(PLAIN_OPERAND[name](_td(d)))
    check(ref, got, name)


FILL: Any = object()  # placeholder: a batch-shaped tensor of the side's library
SPLIT_KEYS = {
    "sets": ((["a"], [("n", "c")]), {}),
    "named_twice": ((["a"], ["a"]), {"strict": False}),
    "named_twice_default": ((["a"], ["a"]), {"strict": False, "default": FILL}),
    "default": ((["a", "zz", ("n", "zz")],), {"strict": False, "default": FILL}),
    "default_none": ((["a", "zz"],), {"strict": False, "default": None}),
    "strict_ignores_default": ((["a"],), {"default": FILL}),
    "mapping": (({"a": "z", ("n", "c"): ("q", "c"), "b": "b"},), {}),
    "mapping_default": (({"zz": "y", "b": "x"},), {"strict": False, "default": FILL}),
    "predicate": ((lambda k, v: v.ndim == 2, ["b"]), {}),
    "parent_then_child": ((["n"], [("n", "c")]), {"strict": False}),
    "empty_nested": ((["g"], ["a"]), {}),
    "leaves_an_empty_parent": (([("n", "c")],), {}),
    "reproduce_struct": ((["a"], [("n", "c")]), {"reproduce_struct": True}),
    "reproduce_struct_nothing": (([],), {"reproduce_struct": True}),
    "no_sets": ((), {}),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", SPLIT_KEYS)
def test_split_keys_same_as_tensordict(name: str) -> None:
    """Every option of ``split_keys`` that a pure container has (``default``, ``strict``,
    ``reproduce_struct``, mappings, predicates), against tensordict on the same data."""
    args, kw = SPLIT_KEYS[name]
    d = _data(0)
    x = _tf(d).set("g", tdfunc.TensorDict(batch_size=[3]))
    ref_in = _td(d).set("g", T.TensorDict(batch_size=[3]))
    before = x.clone()
    got = x.split_keys(
        *args, **{k: torch.full((3,), 7.0) if v is FILL else v for k, v in kw.items()}
    )
    ref = ref_in.split_keys(
        *args, **{k: torch.full((3,), 7.0) if v is FILL else v for k, v in kw.items()}
    )
    check(_plain(ref), got, name)
    tdfunc.testing.assert_close(x, before)


@pytest.mark.parametrize("sets", [(["zz"],), (["a"], ["a"]), ({"zz": "a"},)])
def test_split_keys_strict_errors_as_tensordict(sets: tuple[Any, ...]) -> None:
    d = _data(0)
    with pytest.raises(KeyError):
        _td(d).split_keys(*sets)
    with pytest.raises(KeyError, match=r"'(zz|a)'"):
        _tf(d).split_keys(*sets)


def test_split_keys_inplace_has_a_pure_spelling() -> None:
    d = _data(0)
    ref = _td(d)
    picked, rest = ref.split_keys(["a"], inplace=True)
    with pytest.raises(tdfunc.InPlaceError, match=r"\*parts, td = td.split_keys"):
        _tf(d).split_keys(["a"], inplace=True)
    *parts, x = _tf(d).split_keys(["a"])  # the pure spelling the error names
    check(_plain((picked, rest)), (*parts, x), "split_keys(inplace=True)")


def test_round_trips_through_files(tmp_path: Path) -> None:
    """memmap / load_memmap / save / load / memmap_like: each library reads back what it wrote,
    and both read back the same values."""
    d = _data(0)
    ref = _td(d).memmap(tmp_path / "td")
    ref2 = T.TensorDict.load_memmap(tmp_path / "td")
    x = _tf(d)
    tdfunc.save(x, tmp_path / "tf")
    got = tdfunc.load(tmp_path / "tf")
    check(_plain(ref), got, "memmap")
    check(_plain(ref2), got, "load_memmap")
    like = tdfunc.memmap_like(x, tmp_path / "like")
    check(_shapes(_td(d).memmap_like(tmp_path / "td_like")), _shapes(like), "memmap_like")
