"""``Container``: the methods shared by TensorDict and tensorclasses.

Every method is one line of sugar over a pure function of :mod:`tdfunc._ops`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import _errors as E
from . import _inplace, _keys, _migration
from . import _ops as ops
from ._compat import DisableTorchFunctionSubclass
from ._dispatch import _DUNDER, _DUNDER_ALIASED, _HANDLERS, _NO_HANDLER, _PYTREE_PASSTHROUGH
from ._keys import ABSENT, Key, as_path, get_path, is_key
from ._nontensor import NonTensor
from ._nontensor import compare as nontensor_compare
from ._ops import _lift
from ._tree import Node, leaves, leaves_and_nontensors, map_leaves, shallow_copy

T = TypeVar("T", bound="Container")


class Container(Node):
    """Base class of :class:`tdfunc.TensorDict` and ``@tdfunc.tensorclass`` types.

    It holds the batch size and device; subclasses hold the children.

    Besides the methods below, a container has one method per entry of tdfunc's table of
    lifted torch functions, each the ``Tensor`` method of that name on every leaf: the
    pointwise family (``td.exp()``, ``td.clamp(min=0)``, ``td.bool()``, ...) keeps the batch
    size; the batch-dim family (``td.cumsum(0)``, ``td.softmax(0)``, ...) takes batch dims.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(x=torch.tensor([[0.0, 1.0], [2.0, 3.0]]), batch_size=[2])
        >>> td.clamp(min=1.0)["x"]  # the pointwise family
        tensor([[1., 1.],
                [2., 3.]])
        >>> td.cumsum(0)["x"]  # the batch-dim family: dim 0 is the batch dim
        tensor([[0., 1.],
                [2., 4.]])
    """

    __slots__ = ("_batch_size", "_device")

    # ---------------------------------------------------------------- attributes
    @property
    def batch_size(self) -> torch.Size:
        """The leading dims shared by every leaf.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.batch_size
            torch.Size([2])
        """
        return self._batch_size

    @property
    def shape(self) -> torch.Size:
        """Alias of :attr:`batch_size`.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.shape
            torch.Size([2])
        """
        return self._batch_size

    @property
    def batch_dims(self) -> int:
        """Number of batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.batch_dims
            1
        """
        return len(self._batch_size)

    @property
    def ndim(self) -> int:
        """Number of batch dims (alias of :attr:`batch_dims`).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.ndim
            1
        """
        return len(self._batch_size)

    @property
    def device(self) -> torch.device | None:
        """The device every leaf lives on, or None when not fixed.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.device is None, td.to("cpu").device
            (True, device(type='cpu'))
        """
        return self._device

    @property
    def layout(self) -> torch.layout | None:
        """The layout every leaf has (``torch.strided`` for a container without leaves), or
        ``None`` when leaves differ. Python-level torch functions read it (``torch.masked``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.layout
            torch.strided
        """
        return ops.common_layout(self)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype every leaf has, or ``None`` when leaves differ or there is none.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.dtype, td.set("n", torch.zeros(2, dtype=torch.int64)).dtype
            (torch.float32, None)
        """
        return ops.common_dtype(self)

    def numel(self) -> int:
        """Product of the batch size.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.numel()
            2
        """
        n = 1
        for s in self._batch_size:
            n = n * s
        return n

    def dim(self) -> int:
        """Number of batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.dim()
            1
        """
        return len(self._batch_size)

    def size(self, dim: int | None = None) -> Any:
        """The batch size, or one of its dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.size(), td.size(0)
            (torch.Size([2]), 2)
        """
        return self._batch_size if dim is None else self._batch_size[dim]

    def __len__(self) -> int:
        """The size of the first batch dim; ``TypeError`` without batch dims (as ``len()``
        of a 0-d tensor): iteration is not defined there either."""
        if not self._batch_size:
            raise TypeError(E.LEN_UNBATCHED.format(cls=type(self).__name__))
        return self._batch_size[0]

    def __getitems__(self: T, indices: Sequence[int]) -> T:
        """``self[indices]`` in one gather along the first batch dim: what a
        ``torch.utils.data.DataLoader`` over a container asks for a batch (torch's
        ``__getitems__`` protocol). So, as in tensordict, ``collate_fn=lambda x: x`` gives the
        batch container, and the default collate returns it as it is.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.arange(6.0), batch_size=[6])
            >>> td.__getitems__([4, 1])["x"].tolist()
            [4.0, 1.0]
        """
        out: T = ops.index(self, torch.as_tensor(indices, dtype=torch.long))
        return out

    def __iter__(self) -> Iterator[Any]:
        if not self._batch_size:
            raise TypeError(
                f"iteration over a {type(self).__name__} with batch_size=() is not defined"
            )
        return iter(ops.unbind(self, 0))

    def __bool__(self) -> bool:
        raise RuntimeError(E.BOOL_AMBIGUOUS.format(cls=type(self).__name__))

    # ---------------------------------------------------------------- immutability
    def __setattr__(self, name: str, value: Any) -> None:
        hint = _inplace.SETATTR.get(name, f"td.replace({name}=...) or td.set({name!r}, ...)")
        raise TypeError(
            E.MUTATION.format(
                cls=type(self).__name__, what=f"setting attribute {name!r}", hint=hint
            )
        )

    def __delattr__(self, name: str) -> None:
        raise TypeError(
            E.MUTATION.format(
                cls=type(self).__name__,
                what=f"deleting attribute {name!r}",
                hint=f"td.exclude({name!r})",
            )
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        # a store loaded read-write: name the call that writes into its file (deferred import:
        # memmap sits on top of the core; this runs only on the way to the error)
        from .memmap._write import writable_file

        filename = writable_file(self)
        if filename is not None and not (is_key(key) and key not in self):
            hint = (
                f"td[{key!r}][...] = value" if is_key(key) else "tdfunc.write_at(td, index, value)"
            )
            raise E.InPlaceError(
                E.MUTATION_STORE.format(cls=type(self).__name__, filename=filename, hint=hint)
            )
        hint = f"td = td.set({key!r}, value)" if is_key(key) else "td = td.at[index].set(value)"
        raise E.InPlaceError(
            E.MUTATION.format(cls=type(self).__name__, what="item assignment", hint=hint)
        )

    def __delitem__(self, key: Any) -> None:
        raise E.InPlaceError(
            E.MUTATION.format(
                cls=type(self).__name__, what="item deletion", hint=f"td = td.exclude({key!r})"
            )
        )

    def __getattr__(self, name: str) -> Any:
        # reached only when the normal lookup fails: tensordict's in-place names (zero_,
        # clamp_, update_...) raise InPlaceError naming the pure spelling (tdfunc._inplace),
        # its other names an AttributeError naming the tdfunc spelling (tdfunc._migration)
        raise _migration.attribute_error(type(self), name)

    __hash__ = object.__hash__

    # ---------------------------------------------------------------- keys
    def get(self, key: Key, default: Any = None) -> Any:
        """The value at ``key`` (a string or a tuple path), or ``default`` when missing.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(n={"b": torch.ones(2)}, batch_size=[2])
            >>> td.get(("n", "b")).shape, td.get("zz", 0)
            (torch.Size([2]), 0)
        """
        v = get_path(self, as_path(key), default)
        return v.value if isinstance(v, NonTensor) else v

    def keys(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[Any]:
        """Keys of the entries (``None`` fields are skipped): strings at the top level, tuples
        below it when ``include_nested`` (a nested container after its own keys, as in
        tensordict); ``leaves_only`` keeps tensor entries only; ``sort`` orders them by their
        names joined with ``"."`` (as tensordict's ``sort=True``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.ones(1)})
            >>> td.keys(), td.keys(include_nested=True)
            (['a', 'n'], ['a', ('n', 'b'), 'n'])
            >>> td.keys(include_nested=True, leaves_only=True)
            ['a', ('n', 'b')]
        """
        return [k for k, _ in self.items(include_nested, leaves_only, sort=sort)]

    def values(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[Any]:
        """Values in the order of :meth:`keys`.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> [v.shape for v in td.values()]
            [torch.Size([2, 3])]
        """
        return [v for _, v in self.items(include_nested, leaves_only, sort=sort)]

    def items(
        self, include_nested: bool = False, leaves_only: bool = False, *, sort: bool = False
    ) -> list[tuple[Any, Any]]:
        """``(key, value)`` pairs in the order of :meth:`keys`.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> [(k, v.shape) for k, v in td.items()]
            [('x', torch.Size([2, 3]))]
        """
        pairs = _keys.walk(
            self, leaves_only=leaves_only, include_nested=include_nested, nodes_last=True
        )
        if sort:
            pairs = sorted(pairs, key=lambda pv: ".".join(pv[0]))
        return [(p[0] if len(p) == 1 else p, v) for p, v in pairs]

    def __contains__(self, key: object) -> bool:
        return get_path(self, as_path(key), ABSENT) is not ABSENT

    def select(self: T, *keys: Key, inplace: bool = False, strict: bool = True) -> T:
        """A new container with only ``keys`` (strings or tuple paths).

        ``KeyError`` for a missing key when ``strict``; a tensorclass cannot lose fields, so
        selecting part of one is a ``TypeError``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
            >>> td.select("b").keys()
            ['b']
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "select")
        return _keys.select(self, [as_path(k) for k in keys], strict)

    def exclude(self: T, *keys: Key, inplace: bool = False) -> T:
        """A new container without ``keys`` (missing keys are ignored).

        A tensorclass cannot lose a field: excluding one is a ``TypeError``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
            >>> td.exclude("a").keys()
            ['b']
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "exclude")
        return _keys.exclude(self, [as_path(k) for k in keys])

    def rename_key(self: T, old: Key, new: Key, *, overwrite: bool = False) -> T:
        """A new container with the entry at ``old`` moved to ``new``.

        ``KeyError`` if ``old`` is missing, or if ``new`` already exists and ``overwrite`` is
        false (a rename never drops a value silently). With ``overwrite=True`` the value at
        ``new`` is replaced. Within one parent the entry keeps its position. Moving a field out
        of a tensorclass is a ``TypeError`` (its fields are fixed).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
            >>> td.rename_key("a", "c").keys()
            ['c', 'b']
            >>> td.rename_key("a", "b", overwrite=True)["b"].tolist()
            [0.0]
        """
        return _keys.rename_key(self, as_path(old), as_path(new), overwrite)

    def rename_keys(self: T, mapping: Any, *, strict: bool = True) -> T:
        """Every ``old -> new`` of ``mapping`` at once (swaps allowed); ``KeyError`` for a
        missing ``old`` when ``strict``, or for a ``new`` that exists and is not renamed away.
        A renamed key keeps its position when no new key is also an old one.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> list(td.set("y", torch.ones(2)).rename_keys({"x": "y", "y": "x"})["x"].shape)
            [2]
        """
        return ops.rename_keys(self, mapping, strict=strict)

    def popped(self: T, key: Key, default: Any = _keys.MISSING) -> tuple[Any, T]:
        """``(value, container without key)``; this container is left as it was (``default``
        is the value when ``key`` is missing, then the container is returned as is).

        The pure counterpart of tensordict's ``td.pop(key)``, which deletes the key from
        ``td``: ``td.pop`` raises :class:`tdfunc.InPlaceError` naming this spelling,
        ``value, td = td.popped(key)``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> value, rest = td.popped("x")
            >>> value.shape, list(rest.keys()), list(td.keys())
            (torch.Size([2, 3]), [], ['x'])
        """
        return ops.pop(self, key, default)

    def split_keys(
        self,
        *key_sets: ops.KeySet,
        inplace: bool = False,
        default: Any = _keys.MISSING,
        strict: bool = True,
        reproduce_struct: bool = False,
    ) -> tuple[Any, ...]:
        """One container per key set (keys, a ``{old: new}`` mapping, or a predicate
        ``fn(path, leaf)``), then one with the rest; each set takes from what the earlier
        ones left. ``strict=False`` skips a missing key or puts ``default`` there;
        ``reproduce_struct=True`` keeps the tree of nested containers in every output;
        ``inplace=True`` raises :class:`tdfunc.InPlaceError` naming the pure spelling,
        ``*parts, td = td.split_keys(...)``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> picked, rest = td.set("y", torch.ones(2)).split_keys(["x"])
            >>> list(picked.keys()), list(rest.keys())
            (['x'], ['y'])
        """
        return ops.split_keys(
            self,
            *key_sets,
            inplace=inplace,
            default=default,
            strict=strict,
            reproduce_struct=reproduce_struct,
        )

    def get_at(self, key: Key, index: Any, default: Any = _keys.MISSING) -> Any:
        """``td[key][index]``; ``default`` (when given) for a missing key.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.get_at("x", 0).shape, td.get_at("missing", 0, default=None)
            (torch.Size([3]), None)
        """
        return ops.get_at(self, key, index, default)

    @property
    def sorted_keys(self) -> list[str]:
        """The top-level keys, sorted.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.set("a", torch.zeros(2)).sorted_keys  # a property
            ['a', 'x']
        """
        return ops.sorted_keys(self)

    def is_empty(self) -> bool:
        """True when no tensor leaf is held at any depth.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.is_empty(), td.empty().is_empty()
            (False, True)
        """
        return ops.is_empty(self)

    def empty(self: T, recurse: bool = False) -> T:
        """Same type, batch size and device, no leaves (``recurse``: keep nested containers).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> e = td.empty()
            >>> e.batch_size, list(e.keys())
            (torch.Size([2]), [])
        """
        return ops.empty(self, recurse)

    def filter_empty(self: T) -> T:
        """Without the nested containers that hold no leaf (pure ``filter_empty_``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> list(td.set("n", td.empty()).filter_empty().keys())
            ['x']
        """
        return ops.filter_empty(self)

    def tolist(self, *, convert_tensors: bool = False) -> Any:
        """Nested lists over the batch dims whose elements are dicts of tensors (numbers and
        lists with ``convert_tensors=True``), as tensordict's ``tolist``. Eager only: Python
        objects built from tensor values cannot stay in a compiled graph.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([1, 2]), batch_size=[2])
            >>> td.tolist(convert_tensors=True)
            [{'x': 1}, {'x': 2}]
        """
        return ops.tolist(self, convert_tensors=convert_tensors)

    def numpy(self) -> dict[str, Any]:
        """A nested dict of numpy arrays (eager only).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.numpy()["x"].shape
            (2, 3)
        """
        return ops.numpy(self)

    # ---------------------------------------------------------------- indexing
    @property
    def at(self) -> ops.AtIndexer:
        """Out-of-place indexed updates: ``td.at[idx].set(value)`` / ``.add(value)``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.at[0].add(1.0)["x"].sum(1)
            tensor([3., 0.])
        """
        return ops.AtIndexer(self)

    # ---------------------------------------------------------------- shape
    def reshape(self: T, *shape: Any) -> T:
        """Reshape the batch dims (``-1`` allowed); the feature dims of every leaf are kept.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(4, 3, 2), batch_size=[4, 3])
            >>> td.reshape(-1).batch_size, td.reshape(-1)["a"].shape
            (torch.Size([12]), torch.Size([12, 2]))
        """
        return ops.reshape(self, *shape)

    def view(self: T, *shape: Any) -> T:
        """View the batch dims with a new shape.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
            >>> td.view(6).batch_size, td.view(6)["x"].shape
            (torch.Size([6]), torch.Size([6, 4]))
        """
        return ops.view(self, *shape)

    def permute(self: T, *dims: Any) -> T:
        """Permute the batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
            >>> td.permute(1, 0)["x"].shape
            torch.Size([3, 2, 4])
        """
        return ops.permute(self, *dims)

    def transpose(self: T, dim0: int, dim1: int) -> T:
        """Swap two batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
            >>> td.transpose(0, 1)["x"].shape
            torch.Size([3, 2, 4])
        """
        return ops.transpose(self, dim0, dim1)

    def squeeze(self: T, dim: int | None = None) -> T:
        """Remove batch dims of size 1.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.unsqueeze(0).squeeze(0).batch_size
            torch.Size([2])
        """
        return ops.squeeze(self, dim)

    def unsqueeze(self: T, dim: int) -> T:
        """Insert a batch dim of size 1.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.unsqueeze(0).batch_size, td.unsqueeze(0)["x"].shape
            (torch.Size([1, 2]), torch.Size([1, 2, 3]))
        """
        return ops.unsqueeze(self, dim)

    def flatten(self: T, start_dim: int = 0, end_dim: int = -1, *, inplace: bool = False) -> T:
        """Flatten a range of batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
            >>> td.flatten(0, 1)["x"].shape
            torch.Size([6, 4])
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "flatten")
        return ops.flatten(self, start_dim, end_dim)

    def unflatten(self: T, dim: int, sizes: Sequence[int], *, inplace: bool = False) -> T:
        """Split one batch dim into several.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(6, 4), batch_size=[6])
            >>> td.unflatten(0, (2, 3))["x"].shape
            torch.Size([2, 3, 4])
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "unflatten")
        return ops.unflatten(self, dim, sizes)

    def expand(self: T, *shape: Any) -> T:
        """Expand the batch dims.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.expand(4, 2).batch_size, td.expand(4, 2)["x"].shape
            (torch.Size([4, 2]), torch.Size([4, 2, 3]))
        """
        return ops.expand(self, *shape)

    # ---------------------------------------------------------------- combination
    def unbind(self: T, dim: int = 0) -> tuple[T, ...]:
        """The slices along batch dim ``dim``, as ``torch.unbind``: a tuple of
        ``batch_size[dim]`` containers of the same type without that dim, whose leaves are
        views (``leaf.select(dim, i)``) of this container's leaves.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> rows = td.unbind(0)
            >>> len(rows), rows[0].batch_size, rows[0]["x"].shape
            (2, torch.Size([]), torch.Size([3]))
        """
        return ops.unbind(self, dim)

    def split(self: T, split_size: int | Sequence[int], dim: int = 0) -> tuple[T, ...]:
        """Split along a batch dim into pieces of ``split_size`` (or the given sizes).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(6, 4), batch_size=[6])
            >>> [p.batch_size[0] for p in td.split([2, 4])], [p.batch_size[0] for p in td.split(4)]
            ([2, 4], [4, 2])
        """
        return ops.split(self, split_size, dim)

    def chunk(self: T, chunks: int, dim: int = 0) -> tuple[T, ...]:
        """Split along a batch dim into ``chunks`` pieces.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(6, 4), batch_size=[6])
            >>> [p.batch_size[0] for p in td.chunk(3)]
            [2, 2, 2]
        """
        return ops.chunk(self, chunks, dim)

    # ---------------------------------------------------------------- transforms
    def apply(
        self: T,
        fn: Callable[..., Tensor],
        *others: Any,
        batch_size: Sequence[int] | None = None,
        inplace: bool = False,
    ) -> T:
        """``fn`` on every leaf (zipped with the leaves of ``others``, containers of the same
        structure), in a container of the same structure.

        The result keeps this batch size, so every new leaf must start with these batch
        dims. When ``fn`` changes them (a reduction over a batch dim, an index, a reshape),
        pass the result's ``batch_size``: without it a leaf that lost a batch dim is
        refused with ``ValueError``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.apply(lambda t: t + 1)["x"].sum()
            tensor(6.)
            >>> td.apply(torch.add, td)["x"].shape  # zipped with the leaves of another container
            torch.Size([2, 3])
            >>> td.apply(lambda t: t.sum(0), batch_size=[]).batch_size  # a reduction over the batch dim
            torch.Size([])
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "apply")
        return ops.apply(self, fn, *others, batch_size=batch_size)

    def named_apply(
        self: T,
        fn: Callable[..., Tensor],
        *others: Any,
        nested_keys: bool | None = None,
        batch_size: Sequence[int] | None = None,
        inplace: bool = False,
    ) -> T:
        """``fn(key, leaf, *other_leaves)`` on every leaf (``others``: containers of the same
        structure). ``key`` is the tuple key path by default; ``nested_keys=True`` passes it as
        tensordict does (a string at the top level, a tuple below), ``nested_keys=False`` the
        leaf's own key (tensordict's default). ``batch_size`` sets the result's.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.zeros(1)})
            >>> td.named_apply(lambda k, x: x + len(k), nested_keys=True)["n", "b"].tolist()
            [2.0]
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "named_apply")
        return ops.named_apply(self, fn, *others, nested_keys=nested_keys, batch_size=batch_size)

    def new_zeros(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, zeros; each leaf keeps its feature dims and dtype.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> z = td.new_zeros(4)
            >>> z.batch_size, z["x"].shape, z["x"].sum()
            (torch.Size([4]), torch.Size([4, 3]), tensor(0.))
        """
        return ops.new_zeros(self, *size, **kwargs)

    def new_ones(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, ones; each leaf keeps its feature dims and dtype.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.new_ones(4)["x"].sum()
            tensor(12.)
        """
        return ops.new_ones(self, *size, **kwargs)

    def new_empty(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, uninitialised; each leaf keeps its feature dims and dtype.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.new_empty(4)["x"].shape
            torch.Size([4, 3])
        """
        return ops.new_empty(self, *size, **kwargs)

    def new_full(self: T, size: Sequence[int], fill_value: Any, **kwargs: Any) -> T:
        """Batch size ``size``, ``fill_value``; each leaf keeps its feature dims and dtype.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.new_full([4], 2.0)["x"].sum()
            tensor(24.)
        """
        return ops.new_full(self, size, fill_value, **kwargs)

    def new_tensor(self: T, data: Any, **kwargs: Any) -> T:
        """Every leaf a copy of ``data`` in that leaf's dtype (batch size: ``data``'s shape).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.new_tensor([1, 2, 3])["x"]
            tensor([1., 2., 3.])
        """
        return ops.new_tensor(self, data, **kwargs)

    def to(self: T, *args: Any, **kwargs: Any) -> T:
        """Move / cast every leaf (``td.to("cpu")``, ``td.to(torch.float64)``).

        A dtype casts **every** leaf, integer and bool leaves included (labels become
        ``float64``), unlike ``nn.Module.to``, which casts floating-point tensors only. To cast
        the floating leaves only, use :meth:`apply` with
        ``lambda t: t.to(dtype) if t.is_floating_point() else t`` (below).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), label=torch.tensor([1, 0]), batch_size=[2])
            >>> td.to(torch.float64)["label"].dtype  # every leaf, integers included
            torch.float64
            >>> cast = td.apply(lambda t: t.to(torch.float64) if t.is_floating_point() else t)
            >>> cast["x"].dtype, cast["label"].dtype  # floating leaves only, as nn.Module.to
            (torch.float64, torch.int64)
        """
        return ops.to(self, *args, **kwargs)

    def clone(self: T, recurse: bool = True) -> T:
        """A copy with cloned leaves: new plain tensors with the same values, sharing no
        memory with this container. A memory-mapped leaf (from :func:`tdfunc.load`) becomes
        a plain in-memory ``torch.Tensor``, detached from its file and mode.
        ``recurse=False`` (tensordict's option) is :meth:`copy`: the same leaves.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> c = td.clone()
            >>> c["x"] is td["x"], torch.equal(c["x"], td["x"])
            (False, True)
        """
        if not recurse:
            return self.copy()
        return ops.clone(self)

    def detach(self: T) -> T:
        """Leaves detached from autograd.

        Example:
            >>> import torch, tdfunc
            >>> w = torch.zeros(2, requires_grad=True)
            >>> tdfunc.TensorDict(w=w * 2, batch_size=[2]).detach()["w"].requires_grad
            False
        """
        return ops.detach(self)

    def contiguous(self: T, *, inplace: bool = False) -> T:
        """Contiguous leaves.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2, 3])
            >>> td.transpose(0, 1).contiguous()["x"].is_contiguous()
            True
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "contiguous")
        return ops.contiguous(self)

    def consolidate(
        self: T,
        filename: Any = None,
        *,
        num_threads: int = 0,
        non_blocking: bool = False,
        inplace: bool = False,
        **options: Any,
    ) -> T:
        """A copy whose leaves are views into one flat buffer.

        tensordict's options: ``num_threads`` and ``non_blocking`` are accepted (the result
        does not depend on them); ``inplace=True`` raises :class:`tdfunc.InPlaceError`, and a
        ``filename`` or another option a ``TypeError``, each naming the tdfunc spelling
        (``tdfunc.save(td, path)`` for a file, ``td.consolidate().to(device)``...).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> c = td.set("y", torch.ones(2)).consolidate()
            >>> c["x"].untyped_storage().data_ptr() == c["y"].untyped_storage().data_ptr()
            True
        """
        if inplace:
            raise _inplace.inplace_option_error(type(self), "consolidate")
        if filename is not None or options:
            option = "filename" if filename is not None else next(iter(options))
            raise _inplace.option_error(type(self), "consolidate", option)
        return ops.consolidate(self)

    def cpu(self: T) -> T:
        """Move leaves to the CPU.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.cpu()["x"].device
            device(type='cpu')
        """
        return ops.to(self, "cpu")

    def copy(self: T) -> T:
        """A shallow copy: a new container sharing the same leaves.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> td.copy()["x"] is td["x"]
            True
        """
        return shallow_copy(self)

    def leaves(self) -> list[Tensor]:
        """All tensor leaves, depth first.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.zeros(2, 3), batch_size=[2])
            >>> [t.shape for t in td.set(("n", "y"), torch.ones(2)).leaves()]
            [torch.Size([2, 3]), torch.Size([2])]
        """
        return leaves(self)

    def to_state_dict(self, sep: str = ".") -> dict[str, Tensor]:
        """A plain ``dict`` of every tensor leaf under its flat name (the key path joined by
        ``sep``): what PyTorch APIs that take a state dict expect, e.g.
        ``module.load_state_dict(params.to_state_dict())``. The tensors are shared, not
        copied. Parameters from :func:`tdfunc.from_module` hold one leaf per tied tensor: for a
        module with tied weights, :func:`tdfunc.state_dict` gives every name back. A container
        is not itself a ``collections.abc.Mapping``: like a tensor, its ``len()`` and
        iteration follow the first batch dim, not the keys.

        Example:
            >>> import torch, tdfunc
            >>> lin = torch.nn.Linear(2, 1)
            >>> params = tdfunc.from_module(lin).apply(torch.zeros_like)
            >>> lin.load_state_dict(params.to_state_dict())
            <All keys matched successfully>
            >>> lin.weight.sum().item()
            0.0
        """
        return ops.to_state_dict(self, sep)

    # ---------------------------------------------------------------- arithmetic
    def __add__(self: T, other: Any) -> T:
        return _binop(operator.add, self, other)

    def __radd__(self: T, other: Any) -> T:
        return _binop(operator.add, other, self)

    def __sub__(self: T, other: Any) -> T:
        return _binop(operator.sub, self, other)

    def __rsub__(self: T, other: Any) -> T:
        return _binop(operator.sub, other, self)

    def __mul__(self: T, other: Any) -> T:
        return _binop(operator.mul, self, other)

    def __rmul__(self: T, other: Any) -> T:
        return _binop(operator.mul, other, self)

    def __truediv__(self: T, other: Any) -> T:
        return _binop(operator.truediv, self, other)

    def __rtruediv__(self: T, other: Any) -> T:
        return _binop(operator.truediv, other, self)

    def __floordiv__(self: T, other: Any) -> T:
        return _binop(operator.floordiv, self, other)

    def __rfloordiv__(self: T, other: Any) -> T:
        return _binop(operator.floordiv, other, self)

    def __mod__(self: T, other: Any) -> T:
        return _binop(operator.mod, self, other)

    def __rmod__(self: T, other: Any) -> T:
        return _binop(operator.mod, other, self)

    def __pow__(self: T, other: Any) -> T:
        return _binop(operator.pow, self, other)

    def __rpow__(self: T, other: Any) -> T:
        return _binop(operator.pow, other, self)

    def __and__(self: T, other: Any) -> T:
        return _binop(operator.and_, self, other)

    def __rand__(self: T, other: Any) -> T:
        return _binop(operator.and_, other, self)

    def __or__(self: T, other: Any) -> T:
        return _binop(operator.or_, self, other)

    def __ror__(self: T, other: Any) -> T:
        return _binop(operator.or_, other, self)

    def __xor__(self: T, other: Any) -> T:
        return _binop(operator.xor, self, other)

    def __rxor__(self: T, other: Any) -> T:
        return _binop(operator.xor, other, self)

    def __eq__(self: T, other: Any) -> T:  # type: ignore[override]
        return _compare_nontensors(_binop(operator.eq, self, other), self, other, False)

    def __ne__(self: T, other: Any) -> T:  # type: ignore[override]
        return _compare_nontensors(_binop(operator.ne, self, other), self, other, True)

    def __lt__(self: T, other: Any) -> T:
        return _binop(operator.lt, self, other)

    def __le__(self: T, other: Any) -> T:
        return _binop(operator.le, self, other)

    def __gt__(self: T, other: Any) -> T:
        return _binop(operator.gt, self, other)

    def __ge__(self: T, other: Any) -> T:
        return _binop(operator.ge, self, other)

    def __neg__(self: T) -> T:
        return ops.unary(operator.neg, self)

    def __abs__(self: T) -> T:
        return ops.unary(operator.abs, self)

    def __invert__(self: T) -> T:
        return ops.unary(operator.invert, self)

    def abs(self: T) -> T:
        """Elementwise absolute value.

        Example:
            >>> import torch, tdfunc
            >>> tdfunc.TensorDict(x=torch.tensor([-1.0, 2.0]), batch_size=[2]).abs()["x"]
            tensor([1., 2.])
        """
        return ops.unary(torch.abs, self)

    def bitwise_not(self: T) -> T:
        """Elementwise ``~`` (bitwise not; logical not for bool leaves).

        Same as ``~td``, and also traceable by ``torch.compile(fullgraph=True)``, which does not
        trace the ``~`` operator on non-tensor objects.

        Example:
            >>> import torch, tdfunc
            >>> tdfunc.TensorDict(m=torch.tensor([True, False])).bitwise_not()["m"].tolist()
            [False, True]
        """
        return ops.unary(torch.bitwise_not, self)

    # ---------------------------------------------------------------- reductions
    def sum(self: T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> T:
        """Sum over batch dims ``dim`` (or each whole leaf when ``dim=None``).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.sum(0)["x"], td.sum()["x"]
            (tensor([4., 6.]), tensor(10.))
        """
        return ops.reduce(self, "sum", dim, keepdim, **kwargs)

    def mean(self: T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> T:
        """Mean over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.mean(0)["x"]
            tensor([2., 3.])
        """
        return ops.reduce(self, "mean", dim, keepdim, **kwargs)

    def prod(self: T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> T:
        """Product over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.prod(0)["x"]
            tensor([3., 8.])
        """
        return ops.reduce(self, "prod", dim, keepdim, **kwargs)

    def amax(self: T, dim: Any = None, keepdim: bool = False) -> T:
        """Maximum over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.amax(0)["x"]
            tensor([3., 4.])
        """
        return ops.reduce(self, "amax", dim, keepdim)

    def amin(self: T, dim: Any = None, keepdim: bool = False) -> T:
        """Minimum over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.amin(0)["x"]
            tensor([1., 2.])
        """
        return ops.reduce(self, "amin", dim, keepdim)

    def std(self: T, dim: Any = None, keepdim: bool = False, *, correction: int = 1) -> T:
        """Standard deviation over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.std(0)["x"]
            tensor([1.4142, 1.4142])
        """
        return ops.reduce(self, "std", dim, keepdim, correction=correction)

    def var(self: T, dim: Any = None, keepdim: bool = False, *, correction: int = 1) -> T:
        """Variance over batch dims ``dim`` (or each whole leaf).

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(x=torch.tensor([[1.0, 2.0], [3.0, 4.0]]), batch_size=[2])
            >>> td.var(0)["x"]
            tensor([2., 2.])
        """
        return ops.reduce(self, "var", dim, keepdim, correction=correction)

    def all(self, dim: Any = None) -> Any:
        """0-d bool tensor (never a Python bool); a container when ``dim`` is given.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(b=torch.tensor([True, False]), batch_size=[2])
            >>> td.all(), td.all(0)["b"]
            (tensor(False), tensor(False))
        """
        return ops.all_(self, dim)

    def any(self, dim: Any = None) -> Any:
        """0-d bool tensor (never a Python bool); a container when ``dim`` is given.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(b=torch.tensor([True, False]), batch_size=[2])
            >>> td.any(), td.any(0)["b"]
            (tensor(True), tensor(True))
        """
        return ops.any_(self, dim)

    # ---------------------------------------------------------------- torch functions
    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        impl = _HANDLERS.get(name, _NO_HANDLER).get(func)  # the common case: two dict hits
        if impl is not None:
            return impl(*args, **kwargs)
        if name in _PYTREE_PASSTHROUGH:
            # functions that take any pytree of tensors: containers are pytrees already
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "wrapped":
            # Tensor.__rsub__ & co. are functools.wraps wrappers; Dynamo (torch 2.15)
            # reports the wrapper's code name as __name__: take the wrapped method's
            name = getattr(getattr(func, "__wrapped__", None), "__name__", "")
        dunder = _DUNDER.get(name)
        if dunder is None:
            for f, d in _DUNDER_ALIASED:  # compared by identity: Dynamo's dict lookup
                if func is f:  # of a Python function key misses it
                    dunder = d
        if dunder is not None:  # the operator itself, in its order
            op, swap = dunder
            if swap:
                args = (args[1], args[0], *args[2:])
            return ops.elementwise(op, args, kwargs)
        # everything else: the lifted-op table (pointwise, over batch dims), or a TypeError
        # naming the function and why it does not lift
        return _lift.dispatch(func, args, kwargs)


#: the operands of an operator besides tensors (``_is_tensor``: traced code that reaches the
#: ``Tensor`` class through this module's globals and ``_tree``'s would cost a Python
#: identity guard per compiled call)
_SUPPORTED = (Container, int, float, bool, complex)
_is_tensor = torch.is_tensor


def _operand(x: Any) -> bool:
    return isinstance(x, _SUPPORTED) or _is_tensor(x)


def _compare_nontensors(out: Any, a: Any, b: Any, negate: bool) -> Any:
    """``a == b`` / ``a != b`` (``out``, tensors compared) with every non-tensor leaf
    compared too, per batch position: a bool tensor in its place (as tensordict)."""
    if out is NotImplemented:
        return out
    ls, nts = leaves_and_nontensors(out)
    if not nts:
        return out
    other = leaves_and_nontensors(b)[1] if isinstance(b, Node) else [(None, b)] * len(nts)
    cmp = [
        nontensor_compare(x, y, bs, negate)
        for (bs, x), (_, y) in zip(leaves_and_nontensors(a)[1], other)
    ]
    return map_leaves(out, ls, None, nts=cmp)


def _binop(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    if not (_operand(a) and _operand(b)):
        a, b = ops.as_operand(a), ops.as_operand(b)
        if not (_operand(a) and _operand(b)):
            return NotImplemented
    return ops.binary(op, a, b)


#: every lifted torch function's Tensor-like method (``td.exp()``, ``td.clamp(...)``,
#: ``td.bool()``, ``td.cumsum(0)``), one mechanism from the table in ``_ops/_lift.py``;
#: methods written above are kept. A tensorclass field may take one of these names (a field
#: ``max`` or ``sign`` shadows the method on that class; ``torch.max(obj, 0)`` still lifts)
LIFTED_METHODS = frozenset(_lift.install_methods(Container))
