"""tensordict's in-place names and their pure spelling: the one table.

A container is a value: nothing writes into it. tensordict's in-place API (``td.zero_()``,
``td.clamp_(...)``, ``td.set_(...)``, ``td["a"] = x``...) therefore has no method here;
calling one raises :class:`tdfunc.InPlaceError` (a ``TypeError``) whose message names the
pure spelling.

The table is derived rather than listed: a public name ``X_`` is in place when ``X`` is an
attribute of the container's class or of ``torch.Tensor`` (torch's own convention for
in-place variants); its pure spelling is ``td.X(...)`` when the container has ``X``, else
``td.apply(lambda x: x.X(...))``. Only the names whose pure spelling is something else
(tensordict's own in-place API: ``zero_``, ``update_``, ``apply_``, ``lock_``...) are listed,
in :data:`SPECIAL`.

Example:
    >>> import torch, tdfunc
    >>> td = tdfunc.TensorDict(a=torch.ones(2))
    >>> pure_spelling(type(td), "zero_"), pure_spelling(type(td), "abs_")
    ('td = torch.zeros_like(td)', 'td = td.abs(...)')
    >>> print(pure_spelling(type(td), "keys"))
    None
"""

from __future__ import annotations

import torch

from . import _errors as E

#: in-place names whose pure spelling is not ``td.X(...)`` for ``X_``
SPECIAL: dict[str, str] = {
    "zero_": "td = torch.zeros_like(td)",
    "fill_": "td = td.set(key, torch.full_like(td[key], value))",
    "copy_": "td = other (a container is a value; other.clone() gives tensors of its own)",
    "copy_at_": "td = td.at[idx].set(other)",
    "update_": "td = td.update(other) (a tensorclass: tc = tc.replace(...))",
    "update_at_": "td = td.at[idx].set(values)",
    "set_": "td = td.set(key, value)",
    "set_at_": "td = td.at[idx].set(td[idx].set(key, value))",
    "apply_": "td = td.apply(fn)",
    "rename_key_": "td = td.rename_key(old, new)",
    "del_": "td = td.exclude(key)",
    "filter_empty_": "td = td.filter_empty()",
    "requires_grad_": "td = td.apply(lambda x: x.detach().requires_grad_())",
    "detach_": "td = td.detach()",
    "lock_": "nothing: a container is always immutable (drop the call)",
    "unlock_": "nothing: a container is never locked; td.set(...), td.update(...) and "
    "td.at[idx].set(...) return new containers",
    "auto_batch_size_": "td = tdfunc.TensorDict.from_dict(td.to_dict(), batch_dims=n)",
    "auto_device_": "td = td.to(device)",
    "clear_device_": "td = tdfunc.TensorDict(td.to_dict(), batch_size=td.batch_size)",
    "clear_refs_for_compile_": "nothing: a container keeps no caches (drop the call)",
    "load_": "td = tdfunc.load(path)",
    "load_memmap_": "td = tdfunc.load(path)",
    "memmap_": "tdfunc.save(td, path); td = tdfunc.load(path)",
    "memmap_refresh_": "td = tdfunc.load(path)",
    "rename_": "none: dim names are not supported (keep names next to the container)",
    "share_memory_": "td = td.apply(lambda x: x.clone().share_memory_())",
    "__setitem__": "td = td.set(key, value) for a key, td = td.at[index].set(value) for an index",
    # tensordict names without a trailing "_" that write in place there (the pure operation
    # has a name tensordict does not use, so the same call never means something else)
    "pop": "value, td = td.popped(key)",
    "popitem": "value, td = td.popped(td.keys()[-1])",
    "clear": "td = td.empty()",
    "setdefault": "td = td if key in td else td.set(key, value)",
    "__delitem__": "td = td.exclude(key)",
}


#: tensordict's settable attributes (``td.batch_size = ...``) -> the pure spelling
SETATTR: dict[str, str] = {
    "batch_size": "td = tdfunc.TensorDict(dict(td.items()), new_batch_size) (a tensorclass: "
    "tc = tc.apply(lambda x: x, batch_size=new_batch_size))",
    "device": "td = td.to(device)",
    "names": "none: dim names are not supported (keep the names next to the container)",
}


#: methods whose tensordict signature takes ``inplace=True`` -> the pure spelling of that call
INPLACE_OPTIONS: dict[str, str] = {
    "split_keys": "*parts, td = td.split_keys(keys, ...) (the last part is td without the keys)",
    "select": "td = td.select(*keys)",
    "exclude": "td = td.exclude(*keys)",
    "apply": "td = td.apply(fn, *others)",
    "named_apply": "td = td.named_apply(fn, *others)",
    "contiguous": "td = td.contiguous()",
    "consolidate": "td = td.consolidate()",
    "flatten": "td = td.flatten(start_dim, end_dim)",
    "unflatten": "td = td.unflatten(dim, sizes)",
    "flatten_keys": "td = td.flatten_keys(separator)",
    "unflatten_keys": "td = td.unflatten_keys(separator)",
    "set": "td = td.set(key, value)",
    "update": "td = td.update(other)",
}

#: tensordict's ``consolidate`` options tdfunc does not take -> the tdfunc spelling
CONSOLIDATE_OPTIONS: dict[str, str] = {
    "filename": "tdfunc.save(td, path) writes a container to disk; td.consolidate() keeps it in memory",
    "device": "td.consolidate().to(device)",
    "share_memory": "td.consolidate().apply(lambda x: x.share_memory_()) (the leaves are views of one buffer)",
    "pin_memory": "td.consolidate().apply(lambda x: x.pin_memory())",
    "use_buffer": "td.consolidate() (it always allocates its own buffer)",
    "return_early": "td.consolidate() (it returns when done)",
    "metadata": "td.consolidate() (no metadata is kept: the container is the layout)",
}
#: tensordict's ``update`` options tdfunc does not take (keyword arguments of ``update`` are
#: otherwise entries: these names would become keys) -> the tdfunc spelling
UPDATE_OPTIONS: dict[str, str] = {
    "keys_to_update": "td.update(other.select(*keys, strict=False))",
    "is_leaf": "td.update(other) (containers are the nodes, tensors the leaves)",
    "update_batch_size": "tdfunc.TensorDict(td.update(other).to_dict(), batch_size=new)",
    "ignore_lock": "td.update(other) (a container is never locked)",
}
OPTIONS: dict[str, dict[str, str]] = {"consolidate": CONSOLIDATE_OPTIONS, "update": UPDATE_OPTIONS}
OPTION = "{cls}.{method}() does not take tensordict's {option}=: {hint}"


def inplace_option_error(cls: type, method: str) -> E.InPlaceError:
    """The error for ``td.method(..., inplace=True)``: :class:`InPlaceError` naming the pure
    spelling of that call (from :data:`INPLACE_OPTIONS`).

    Example:
        >>> import tdfunc
        >>> print(inplace_option_error(tdfunc.TensorDict, "split_keys"))  # doctest: +ELLIPSIS
        TensorDict.split_keys(inplace=True) writes in place, ... *parts, td = td.split_keys(...
    """
    name = f"{method}(inplace=True)"
    return E.InPlaceError(
        E.INPLACE.format(cls=cls.__name__, name=name, hint=INPLACE_OPTIONS[method])
    )


def option_error(cls: type, method: str, option: str) -> TypeError:
    """The ``TypeError`` for a tensordict option of ``method`` that tdfunc does not take: it
    names the tdfunc spelling (:data:`OPTIONS`).

    Example:
        >>> import tdfunc
        >>> print(option_error(tdfunc.TensorDict, "consolidate", "filename"))  # doctest: +ELLIPSIS
        TensorDict.consolidate() does not take tensordict's filename=: tdfunc.save(td, path) ...
    """
    hint = OPTIONS[method].get(option, f"td.{method}() (no such option)")
    return TypeError(OPTION.format(cls=cls.__name__, method=method, option=option, hint=hint))


def pure_spelling(cls: type, name: str) -> str | None:
    """The pure spelling of the in-place name ``name`` on containers of class ``cls``, or
    ``None`` when ``name`` is not an in-place name."""
    hint = SPECIAL.get(name)
    if hint is not None:
        return hint
    if name.startswith("_") or not name.endswith("_") or len(name) < 2:
        return None
    base = name[:-1]
    if hasattr(cls, base):
        return f"td = td.{base}(...)"
    if hasattr(torch.Tensor, base):
        return f"td = td.apply(lambda x: x.{base}(...))"
    return None


def inplace_error(cls: type, name: str) -> AttributeError:
    """The error for looking up ``name`` on a container of class ``cls`` that lacks it:
    :class:`InPlaceError` naming the pure spelling for an in-place name, else the plain
    ``AttributeError``."""
    hint = pure_spelling(cls, name)
    if hint is None:
        return AttributeError(E.NO_ATTRIBUTE.format(cls=cls.__name__, name=name))
    return E.InPlaceError(E.INPLACE.format(cls=cls.__name__, name=name, hint=hint))
