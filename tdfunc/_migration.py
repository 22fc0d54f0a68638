"""The migration table: every public name of ``tensordict.TensorDict`` (and the package-level
names a tensordict user reaches for) with its tdfunc spelling, or why tdfunc has none.

The one source of two things that must not drift apart: the table in
``docs/guides/migrating.md`` (:func:`render`, between the ``migration-table`` markers) and the
error a tensordict name raises on a tdfunc container or on the ``tdfunc`` package
(:func:`attribute_error`, :func:`module_hint`): ``td.setdefault``, ``td.memmap``,
``TensorDict.from_module`` and ``tdfunc.lazy_stack`` each raise an ``AttributeError`` whose
message names the tdfunc spelling of the row. These errors are built only when a lookup has
already failed (a class-level ``__getattr__``), so a name that exists costs nothing.

tensordict's in-place names (``X_``) render from :mod:`tdfunc._inplace`'s rule: the pure
``td.X(...)`` where the table has ``X``, else its hand-written pure spelling.

Example:
    >>> import torch, tdfunc
    >>> td = tdfunc.TensorDict(a=torch.zeros(2), batch_size=[2])
    >>> hasattr(td, "memmap")
    False
    >>> try:
    ...     td.memmap("/tmp/x")
    ... except AttributeError as e:
    ...     print(str(e))
    'TensorDict' object has no attribute 'memmap'; tdfunc spells tensordict's `memmap` as `tdfunc.save(td, path)`
"""

from __future__ import annotations

from typing import NamedTuple

from . import _inplace


class Row(NamedTuple):
    """One tensordict name: the tdfunc spelling (``None``: none) and a note (the reason when
    there is no spelling)."""

    spelling: str | None
    note: str = ""


def same(call: str = "(...)") -> Row:
    """The same method on a tdfunc container (a spelling starting with ``(``: the row's name is
    put in front when rendered, ``td.<name>(...)``)."""
    return Row(call)


NONE_LAZY = "lazy stacks: tdfunc stacks are dense (`tdfunc.stack`)"
NONE_IO = "an I/O format of tensordict's; tdfunc writes its own store (`tdfunc.save` / `tdfunc.load`) and safetensors (`tdfunc.save_safetensors`)"
NONE_DIST = "tensordict's own point-to-point protocol; tdfunc: `tdfunc.distributed.send` / `recv` and `Transfer` (DTensor leaves), or torch.distributed on the leaves"
NONE_NONTENSOR = (
    "non-tensor entries: a tensorclass keeps non-tensor fields (static, part of the structure)"
)
NONE_NAMES = "dim names are not supported (keep the names next to the container)"
NONE_LOCK = "nothing to do: every container is immutable"
NONE_SHARED = "shared memory: `td.apply(lambda x: x.clone().share_memory_())`; a container is never written to, so nothing to synchronise"
NONE_QUANT = (
    "quantized dtypes: quantize per leaf with `td.apply(...)` and `torch.quantize_per_tensor`"
)
NOTE_PLAIN_TENSOR = "same: a plain tensor `other` is shaped like the batch, as in tensordict ([the alignment rule](../lifted-ops.md#the-alignment-rule))"
NONE_MP = "worker processes: `torch.vmap(fn)(td)`, or a `DataLoader` over a dataset of containers"

#: tensordict.TensorDict name -> Row; a spelling starting with ``(`` is the same name called on
#: ``td``
TABLE: dict[str, Row] = {
    # ------------------------------------------------------------------ pointwise (lifted)
    **{
        n: same("()")
        for n in [
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
        ]
    },
    **{
        n: Row("(other)", NOTE_PLAIN_TENSOR)
        for n in [
            "add",
            "sub",
            "mul",
            "div",
            "pow",
            "maximum",
            "minimum",
            "bitwise_and",
            "logical_and",
        ]
    },
    "neg": same("()"),
    "isreal": same(),
    "mod": Row("td % other", "or td.remainder(other)"),
    "rsub": Row("torch.rsub(td, other)", "or other - td"),
    "addcdiv": same("(t1, t2, value=v)"),
    "addcmul": same("(t1, t2, value=v)"),
    "lerp": same("(end, weight)"),
    "clamp": same("(min, max)"),
    "clamp_max": same("(max)"),
    "clamp_min": same("(min)"),
    "where": Row("td.where(mask, other)", "a batch-shaped mask aligns with the batch dims"),
    "masked_fill": Row(
        "td.masked_fill(mask, value)", "a batch-shaped mask aligns with the batch dims"
    ),
    # ------------------------------------------------------------------ casts
    **{n: same("()") for n in ["bfloat16", "bool", "double", "float", "half", "int"]},
    **{
        n: Row(f"td.to(torch.{n})")
        for n in [
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
    },
    **{n: Row(None, NONE_QUANT) for n in ["qint8", "qint32", "quint8", "quint4x2"]},
    "type": Row("td.to(dtype)"),
    "to": same("(*args)"),
    "cpu": same("()"),
    "cuda": Row("td.to('cuda')"),
    # ------------------------------------------------------------------ over batch dims
    **{
        n: same("(dim)")
        for n in [
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
        ]
    },
    "all": Row("td.all()", "returns a 0-d bool tensor, never a Python bool (no graph break)"),
    "any": Row("td.any()", "returns a 0-d bool tensor, never a Python bool (no graph break)"),
    "max": Row("td.max(dim)", "with a dim: a `(values, indices)` pair of containers, as torch"),
    "min": Row("td.min(dim)", "with a dim: a `(values, indices)` pair of containers, as torch"),
    "cummax": Row("td.cummax(dim)", "a `(values, indices)` pair of containers, as torch"),
    "cummin": Row("td.cummin(dim)", "a `(values, indices)` pair of containers, as torch"),
    "norm": same("()"),
    "quantile": same("(q, dim)"),
    "softmax": same("(dim)"),
    "flip": same("(dims)"),
    "fliplr": Row("td.flip(1)"),
    "flipud": Row("td.flip(0)"),
    "roll": same("(shifts, dims)"),
    "rot90": same("(k, dims)"),
    "repeat": same("(*repeats)"),
    "repeat_interleave": same("(repeats, dim)"),
    "tile": same("(dims)"),
    "narrow": same("(dim, start, length)"),
    "movedim": same("(source, destination)"),
    "moveaxis": same("(source, destination)"),
    "swapdims": same("(dim0, dim1)"),
    "swapaxes": same("(dim0, dim1)"),
    "tensor_split": same("(indices_or_sections, dim)"),
    "gather": same("(dim, index)"),
    "masked_select": same("(mask)"),
    "pad": Row(
        "tdfunc.pad(td, pad_size, value=v)",
        "pads batch dims, from the first one on (`torch.nn.functional.pad(td, pad)` takes them "
        "from the last)",
    ),
    "expand_as": same("(other)"),
    # ------------------------------------------------------------------ shape
    **{
        n: same("(...)")
        for n in [
            "expand",
            "flatten",
            "permute",
            "reshape",
            "squeeze",
            "transpose",
            "unflatten",
            "unsqueeze",
            "view",
            "split",
            "chunk",
            "unbind",
        ]
    },
    "broadcast_to": Row("td.expand(shape)"),
    "atleast_1d": Row("td if td.ndim >= 1 else td.unsqueeze(0)"),
    "atleast_2d": Row("td.reshape(...) (batch dims are explicit: add the ones you need)"),
    "atleast_3d": Row(
        "td.reshape(...) (batch dims are explicit: add the ones you need)",
        "tensordict: a 1-d batch `[n]` becomes `[1, 1, n]`",
    ),
    # ------------------------------------------------------------------ attributes
    **{
        n: Row(f"td.{n}")
        for n in ["batch_size", "batch_dims", "device", "ndim", "shape", "dtype", "sorted_keys"]
    },
    "ndimension": Row("td.ndim"),
    "dim": same("()"),
    "numel": same("()"),
    "size": same("()"),
    "names": Row(None, NONE_NAMES),
    "refine_names": Row(None, NONE_NAMES),
    "rename": Row(None, NONE_NAMES),
    "is_floating_point": Row("td.dtype.is_floating_point", "when every leaf has one dtype"),
    "is_cpu": Row("td.device.type == 'cpu'"),
    "is_cuda": Row("td.device.type == 'cuda'"),
    "is_meta": Row("td.device.type == 'meta'"),
    "is_contiguous": Row("all(x.is_contiguous() for x in td.leaves())"),
    "requires_grad": Row("any(x.requires_grad for x in td.leaves())"),
    "is_locked": Row(None, NONE_LOCK + " (always locked)"),
    "is_shared": Row(None, NONE_SHARED),
    "is_memmap": Row("any(isinstance(x, tdfunc.MemoryMappedTensor) for x in td.leaves())"),
    "is_consolidated": Row(
        None, "`td.consolidate()` returns leaves that are views of one buffer; no flag is kept"
    ),
    "is_empty": same("()"),
    "is_non_tensor": Row(None, NONE_NONTENSOR),
    "depth": Row("max(len(k) for k in td.keys(include_nested=True)) - 1"),
    "param_count": Row("sum(x.numel() for x in td.leaves())"),
    "bytes": Row("sum(x.numel() * x.element_size() for x in td.leaves())"),
    "data_ptr": Row("[x.data_ptr() for x in td.leaves()]"),
    "attrs": Row("{k: (x.shape, x.dtype) for k, x in td.items(True, True)}"),
    "entry_class": Row("type(td[key])"),
    "get_item_shape": Row("td[key].shape"),
    "data": Row("td.detach()", "the same storage without autograd"),
    "grad": Row(
        "tdfunc.value_and_grad(f)(td)",
        "gradients come back as a container, with zeros for leaves the loss does not use (tensordict leaves them out)",
    ),
    # ------------------------------------------------------------------ keys
    **{n: same("(...)") for n in ["get", "items", "values", "select", "exclude", "replace"]},
    "keys": Row(
        "(include_nested, leaves_only)",
        "a list; with `include_nested`, a nested container comes after its keys, as in tensordict; `sort=True` as tensordict",
    ),
    "set": Row(
        "(key, value)",
        "PURE: tensordict writes into `td` (and returns it); here `td` is left as it was: "
        "keep the result, `td = td.set(key, value)`; `inplace=True` raises InPlaceError",
    ),
    "update": Row(
        "(other)",
        "PURE: tensordict writes into `td` (and returns it); here `td` is left as it was: "
        "keep the result, `td = td.update(other)`; `clone=` and `non_blocking=` as tensordict, "
        "`inplace=True` raises InPlaceError, its other options a TypeError naming the spelling",
    ),
    "rename_keys": Row("(mapping)", "a renamed key keeps its position (tensordict moves it last)"),
    "split_keys": Row(
        "(keys_a, keys_b, default=..., strict=..., reproduce_struct=...)",
        "PURE: `inplace=True` raises; write `*parts, td = td.split_keys(...)`. A nested container keeps its own batch size in a part (tensordict gives it the parent's)",
    ),
    "separates": Row(
        "td.split_keys(keys)", "returns (the entries, the rest); nothing is removed from `td`"
    ),
    "pop": Row(
        "value, td = td.popped(key)",
        "in place there (`td.pop` raises InPlaceError naming `td.popped`); "
        "here the value and the container without it",
    ),
    "popitem": Row("value, td = td.popped(td.keys()[-1])"),
    "setdefault": Row(
        "td if key in td else td.set(key, value)",
        "tensordict returns the value; tdfunc's spelling the container",
    ),
    "fromkeys": Row("tdfunc.TensorDict(dict.fromkeys(keys, value))"),
    "flatten_keys": same("(separator)"),
    "unflatten_keys": same("(separator)"),
    "create_nested": Row("td.set(key, tdfunc.TensorDict(batch_size=td.batch_size))"),
    "get_at": same("(key, index)"),
    "empty": same("(recurse=...)"),
    "clear": Row("td.empty()"),
    "stack_tensors": Row("td.set(out_key, torch.stack([td[k] for k in keys], dim))"),
    "cat_tensors": Row("td.set(out_key, torch.cat([td[k] for k in keys], dim))"),
    "get_non_tensor": Row(None, NONE_NONTENSOR),
    "set_non_tensor": Row(None, NONE_NONTENSOR),
    "non_tensor_items": Row(None, NONE_NONTENSOR),
    "filter_non_tensor_data": Row(None, NONE_NONTENSOR),
    # ------------------------------------------------------------------ transforms
    "apply": same("(fn, *others)"),
    "named_apply": same("(fn, *others, nested_keys=True)"),
    "clone": Row("()", "`recurse=False` as tensordict: `td.copy()`, the same leaves"),
    "copy": same("()"),
    "contiguous": same("()"),
    "detach": same("()"),
    "consolidate": Row(
        "()",
        "`num_threads=` is accepted; `filename=` raises a TypeError naming `tdfunc.save(td, path)`",
    ),
    "tolist": same("()"),
    "numpy": same("()"),
    "to_dict": same("()"),
    "state_dict": Row("td.to_state_dict()", "flat names joined by '.'"),
    "load_state_dict": Row(
        "tdfunc.TensorDict(d, batch_size=td.batch_size)", "a new container from the values"
    ),
    "to_tensordict": Row("td.clone()", "a tensorclass: `tc.to_tensordict()`"),
    "pin_memory": Row("td.apply(lambda x: x.pin_memory())"),
    "record_stream": Row("[x.record_stream(s) for x in td.leaves()]"),
    "backward": Row("td[key].backward()"),
    "zero_grad": Row(None, "gradients are values here: `tdfunc.value_and_grad` returns them"),
    "as_tensor": Row("td.apply(torch.as_tensor)"),
    "densify": Row(None, NONE_LAZY),
    "to_padded_tensor": Row(None, "nested-tensor leaves are not supported"),
    "pack": Row(
        "torch.cat([x.reshape(*td.batch_size, -1) for x in td.leaves()], -1)",
        "the packed tensor; the layout is the container itself",
    ),
    "new_zeros": same("(*size)"),
    "new_ones": same("(*size)"),
    "new_empty": same("(*size)"),
    "new_full": same("(size, value)"),
    "new_tensor": same("(data)"),
    # ------------------------------------------------------------------ building
    "from_dict": Row("tdfunc.TensorDict.from_dict(d, batch_dims=n)"),
    "from_dict_instance": Row("tdfunc.TensorDict.from_dict(d)"),
    "from_module": Row("tdfunc.from_module(module)"),
    "from_modules": Row("tdfunc.stack_modules(modules)"),
    "to_module": Row(
        "tdfunc.functional_call(module, td, args)",
        "the module is called with the container's tensors; nothing is written into it",
    ),
    "from_dataclass": Row("tdfunc.tensorclass", "decorate the dataclass"),
    "from_namedtuple": Row("tdfunc.TensorDict(nt._asdict())"),
    "to_namedtuple": Row(
        None, "containers are pytrees already: torch.utils._pytree / optree map over them"
    ),
    "from_tuple": Row("tdfunc.TensorDict({str(i): x for i, x in enumerate(t)})"),
    "from_list": Row("tdfunc.stack([tdfunc.TensorDict(d) for d in items])"),
    "from_any": Row(
        "tdfunc.TensorDict(d, batch_size=...)", "from a dict; other sources: build the dict first"
    ),
    "from_pytree": Row(None, "containers are pytrees already: no conversion"),
    "to_pytree": Row(None, "containers are pytrees already: no conversion"),
    "from_schema": Row("tdfunc.zeros_like(template)"),
    "from_struct_array": Row(None, "numpy structured arrays: build a dict of arrays"),
    "to_struct_array": Row(None, "numpy structured arrays: `td.numpy()` gives a dict of arrays"),
    "stack": Row("tdfunc.stack(tds, dim)"),
    "cat": Row("tdfunc.cat(tds, dim)"),
    "stack_from_tensordict": Row("torch.stack(td.leaves(), dim)", "leaves of one shape"),
    "cat_from_tensordict": Row("torch.cat(td.leaves(), dim)"),
    "lazy_stack": Row(None, NONE_LAZY),
    "maybe_dense_stack": Row("tdfunc.stack(tds, dim)", NONE_LAZY),
    "to_lazystack": Row(None, NONE_LAZY),
    "map": Row(None, NONE_MP),
    "map_iter": Row(None, NONE_MP),
    # ------------------------------------------------------------------ storage / I/O
    "memmap": Row("tdfunc.save(td, path)"),
    "memmap_like": Row(
        "tdfunc.memmap_like(td, path)",
        "without a path: a temporary folder, removed when the leaves are gone (as tensordict)",
    ),
    "load_memmap": Row("tdfunc.load(path)"),
    "load": Row("tdfunc.load(path)"),
    "save": Row("tdfunc.save(td, path)"),
    "saved_path": Row(None, "a loaded store's path is the one you passed to `tdfunc.load`"),
    "make_memmap": Row(None, "tdfunc writes whole containers: `tdfunc.save`"),
    "make_memmap_from_storage": Row(None, "tdfunc writes whole containers: `tdfunc.save`"),
    "make_memmap_from_tensor": Row(None, "tdfunc writes whole containers: `tdfunc.save`"),
    "from_consolidated": Row(
        None, "`td.consolidate()` keeps the container; there is no separate consolidated format"
    ),
    "dumps": Row(None, NONE_IO),
    **{
        n: Row(None, NONE_IO)
        for n in [
            "from_csv",
            "to_csv",
            "from_h5",
            "to_h5",
            "from_json",
            "to_json",
            "from_pandas",
            "to_pandas",
            "from_parquet",
            "to_parquet",
            "from_zarr",
            "to_zarr",
            "to_mds",
            "to_store",
        ]
    },
    # ------------------------------------------------------------------ distributed
    "send": Row("tdfunc.distributed.send(td, dst)"),
    "recv": Row("tdfunc.distributed.recv(template, src)"),
    **{
        n: Row(None, NONE_DIST)
        for n in [
            "isend",
            "irecv",
            "asend",
            "arecv",
            "init_remote",
            "from_remote_init",
            "all_gather",
            "all_reduce",
            "broadcast",
            "reduce",
            "scatter",
            "gather_and_stack",
        ]
    },
    # ------------------------------------------------------------------ pure spellings of X_
    # (the rest of tensordict's X_ names render from tdfunc._inplace)
}

#: package-level names of ``tensordict`` (``tensordict.lazy_stack``...) that ``tdfunc`` spells
#: differently or does not have -> Row (the ones tdfunc has under the same name are not listed)
MODULE_TABLE: dict[str, Row] = {
    "lazy_stack": Row("tdfunc.stack(tds, dim)", NONE_LAZY),
    "maybe_dense_stack": Row("tdfunc.stack(tds, dim)"),
    "dense_stack_tds": Row("tdfunc.stack(tds, dim)"),
    "LazyStackedTensorDict": Row(None, NONE_LAZY),
    "load_memmap": Row("tdfunc.load(path)"),
    "make_tensordict": Row("tdfunc.TensorDict(d, batch_size)"),
    "merge_tensordicts": Row("td.update(other)"),
    "is_tensor_collection": Row("tdfunc.is_container(x)"),
    "TensorDictBase": Row("tdfunc.Container", "the base of TensorDict and tensorclasses"),
    "TensorClass": Row("tdfunc.tensorclass", "decorate the class"),
    "TensorDictParams": Row(
        "tdfunc.from_module(module)",
        "parameters are values: `tdfunc.functional_call(module, params, args)`, "
        "gradients by `tdfunc.value_and_grad`",
    ),
    "NonTensorData": Row(None, NONE_NONTENSOR),
    "NonTensorStack": Row(None, NONE_NONTENSOR),
    "from_modules": Row("tdfunc.stack_modules(modules)"),
    "fromkeys": Row("tdfunc.TensorDict(dict.fromkeys(keys, value))"),
    "from_any": Row(
        "tdfunc.TensorDict(d, batch_size)", "from a dict; other sources: build the dict first"
    ),
    "from_namedtuple": Row("tdfunc.TensorDict(nt._asdict())"),
    "from_tuple": Row("tdfunc.TensorDict({str(i): x for i, x in enumerate(t)})"),
    "from_dataclass": Row("tdfunc.tensorclass", "decorate the dataclass"),
    "from_pytree": Row(None, "containers are pytrees already: no conversion"),
    "from_safetensors": Row("tdfunc.load_safetensors(path)"),
    "to_safetensors": Row("tdfunc.save_safetensors(td, path)"),
    "assert_allclose_td": Row("tdfunc.testing.assert_close(a, b)"),
    "assert_close": Row("tdfunc.testing.assert_close(a, b)"),
    "unravel_key": Row(
        "key if isinstance(key, str) else tuple(key)", "keys are strings or tuples of strings"
    ),
    "collate": Row(
        "torch.utils.data.default_collate",
        "it stacks a list of containers; a DataLoader over a container reads a batch in one "
        "gather, and `collate_fn=lambda x: x` gives it whole, as in tensordict",
    ),
}


def _inplace_row(name: str) -> Row:
    """The row of tensordict's in-place name ``X_``: ``td = <X's spelling>`` or the
    hand-written pure spelling of :data:`tdfunc._inplace.SPECIAL`."""
    base = name[:-1]
    if name not in _inplace.SPECIAL and base in TABLE and TABLE[base].spelling is not None:
        return Row(f"td = {spelling_of(base)}", "in place there; a new container here")
    hint = _inplace.SPECIAL[name]
    if hint.startswith(("nothing", "none")):
        return Row(None, hint.removeprefix("none: "))
    return Row(hint, "in place there; a new container here")


def spelling_of(name: str) -> str:
    """The rendered spelling of the row ``name`` (``td.X(...)`` for a same-name row).

    Example:
        >>> spelling_of("clone"), spelling_of("memmap")
        ('td.clone()', 'tdfunc.save(td, path)')
    """
    s = TABLE[name].spelling
    assert s is not None
    return f"td.{name}{s}" if s.startswith("(") else s


def table(names: list[str]) -> dict[str, Row]:
    """The rendered rows for tensordict's public ``names`` (``KeyError`` naming the ones the
    table misses)."""
    out: dict[str, Row] = {}
    missing = []
    for n in sorted(names):
        if n in TABLE:
            r = TABLE[n]
            out[n] = Row(spelling_of(n), r.note) if r.spelling is not None else r
        elif n.endswith("_"):
            out[n] = _inplace_row(n)
        else:
            missing.append(n)
    if missing:
        raise KeyError(f"the migration table has no row for tensordict's {missing}")
    return out


def render(rows: dict[str, Row]) -> str:
    """The markdown table of ``rows`` (what docs/guides/migrating.md shows).

    Example:
        >>> print(render({"memmap": Row("tdfunc.save(td, path)")}), end="")
        | tensordict | tdfunc | note |
        |---|---|---|
        | `memmap` | `tdfunc.save(td, path)` |  |
    """
    lines = [
        "| tensordict | tdfunc | note |",
        "|---|---|---|",
    ]
    for n, r in rows.items():
        sp = f"`{r.spelling}`" if r.spelling is not None else "none"
        note = r.note.replace("|", "\\|")
        lines.append(f"| `{n}` | {sp.replace('|', chr(92) + '|')} | {note} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- errors
HINT = "; tdfunc spells tensordict's `{name}` as `{spelling}`{note}"
HINT_NONE = "; tdfunc has no tensordict `{name}`: {note}"
NO_ATTRIBUTE = "{cls!r} object has no attribute {name!r}"
NO_CLASS_ATTRIBUTE = "type object {cls!r} has no attribute {name!r}"
NO_MODULE_ATTRIBUTE = "module {module!r} has no attribute {name!r}"
NO_DIM_NAMES = (
    "TensorDict(names={names!r}): dim names are not supported (keep the names next to the "
    "container); a key named 'names' goes in the source mapping: TensorDict({{'names': x}})"
)


def _hint(r: Row | None, name: str) -> str:
    if r is None:
        return ""
    if r.spelling is None:
        return HINT_NONE.format(name=name, note=r.note)
    return HINT.format(name=name, spelling=r.spelling, note=f" ({r.note})" if r.note else "")


def hint(cls: type, name: str) -> str:
    """What to add to the ``AttributeError`` of the tensordict name ``name`` missing on ``cls``:
    ``"; tdfunc spells tensordict's ... as ..."``, or ``""`` when ``name`` is not a row whose
    spelling differs (a same-name row a class lacks says nothing).

    Example:
        >>> import tdfunc
        >>> hint(tdfunc.TensorDict, "setdefault")
        "; tdfunc spells tensordict's `setdefault` as `td if key in td else td.set(key, value)` (tensordict returns the value; tdfunc's spelling the container)"
        >>> hint(tdfunc.TensorDict, "no_such_name")
        ''
    """
    r = TABLE.get(name)
    if r is None or (r.spelling is not None and r.spelling.startswith("(")):
        return ""
    return _hint(r, name)


def attribute_error(cls: type, name: str, on_class: bool = False) -> AttributeError:
    """The error for ``name`` missing on a container (``on_class``: on the class itself):
    :class:`tdfunc.InPlaceError` naming the pure spelling for an in-place name, else an
    ``AttributeError`` that names the tdfunc spelling of a tensordict name (:func:`hint`)."""
    err = _inplace.inplace_error(cls, name)
    if isinstance(err, _inplace.E.InPlaceError):
        return err
    msg = NO_CLASS_ATTRIBUTE if on_class else NO_ATTRIBUTE
    return AttributeError(msg.format(cls=cls.__name__, name=name) + hint(cls, name))


def module_error(module: str, name: str) -> AttributeError:
    """The ``AttributeError`` of ``tdfunc.<name>`` for a missing name: it names the tdfunc
    spelling of a tensordict package-level name (:data:`MODULE_TABLE`).

    Example:
        >>> print(module_error("tdfunc", "lazy_stack"))  # doctest: +ELLIPSIS
        module 'tdfunc' has no attribute 'lazy_stack'; tdfunc spells tensordict's `lazy_stack` as `tdfunc.stack(tds, dim)` ...
    """
    return AttributeError(
        NO_MODULE_ATTRIBUTE.format(module=module, name=name) + _hint(MODULE_TABLE.get(name), name)
    )
