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
from . import _inplace, _keys
from . import _ops as ops
from ._compat import DisableTorchFunctionSubclass
from ._keys import ABSENT, Key, as_path, get_path, is_key
from ._ops import _lift
from ._tree import Node, leaves, shallow_copy

T = TypeVar("T", bound="Container")


class Container(Node):
    """Base class of :class:`tdfunc.TensorDict` and ``@tdfunc.tensorclass`` types.

    It holds the batch size and device; subclasses hold the children.
    """

    __slots__ = ("_batch_size", "_device")

    # ---------------------------------------------------------------- attributes
    @property
    def batch_size(self) -> torch.Size:
        """The leading dims shared by every leaf."""
        return self._batch_size

    @property
    def shape(self) -> torch.Size:
        """Alias of :attr:`batch_size`."""
        return self._batch_size

    @property
    def batch_dims(self) -> int:
        """Number of batch dims."""
        return len(self._batch_size)

    @property
    def ndim(self) -> int:
        """Number of batch dims (alias of :attr:`batch_dims`)."""
        return len(self._batch_size)

    @property
    def device(self) -> torch.device | None:
        """The device every leaf lives on, or None when not fixed."""
        return self._device

    @property
    def layout(self) -> torch.layout | None:
        """The layout every leaf has (``torch.strided`` for a container without leaves), or
        ``None`` when leaves differ. Python-level torch functions read it (``torch.masked``)."""
        return ops.common_layout(self)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype every leaf has, or ``None`` when leaves differ or there is none."""
        return ops.common_dtype(self)

    def numel(self) -> int:
        """Product of the batch size."""
        n = 1
        for s in self._batch_size:
            n = n * s
        return n

    def dim(self) -> int:
        """Number of batch dims."""
        return len(self._batch_size)

    def size(self, dim: int | None = None) -> Any:
        """The batch size, or one of its dims."""
        return self._batch_size if dim is None else self._batch_size[dim]

    def __len__(self) -> int:
        """The size of the first batch dim; ``TypeError`` without batch dims (as ``len()``
        of a 0-d tensor): iteration is not defined there either."""
        if not self._batch_size:
            raise TypeError(E.LEN_UNBATCHED.format(cls=type(self).__name__))
        return self._batch_size[0]

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
        raise TypeError(
            E.MUTATION.format(
                cls=type(self).__name__,
                what=f"setting attribute {name!r}",
                hint=f"td.replace({name}=...) or td.set({name!r}, ...)",
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
        # clamp_, update_...) raise InPlaceError naming the pure spelling (tdfunc._inplace)
        raise _inplace.inplace_error(type(self), name)

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
        return get_path(self, as_path(key), default)

    def keys(self, include_nested: bool = False, leaves_only: bool = False) -> list[Any]:
        """Keys of the entries (``None`` fields are skipped): strings at the top level, tuples
        below it when ``include_nested``; ``leaves_only`` keeps tensor entries only.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), n={"b": torch.ones(1)})
            >>> td.keys(), td.keys(include_nested=True, leaves_only=True)
            (['a', 'n'], ['a', ('n', 'b')])
        """
        return [k for k, _ in self.items(include_nested, leaves_only)]

    def values(self, include_nested: bool = False, leaves_only: bool = False) -> list[Any]:
        """Values in the order of :meth:`keys`."""
        return [v for _, v in self.items(include_nested, leaves_only)]

    def items(
        self, include_nested: bool = False, leaves_only: bool = False
    ) -> list[tuple[Any, Any]]:
        """``(key, value)`` pairs in the order of :meth:`keys`."""
        pairs = _keys.walk(self, leaves_only=leaves_only, include_nested=include_nested)
        return [(p[0] if len(p) == 1 else p, v) for p, v in pairs]

    def __contains__(self, key: object) -> bool:
        return get_path(self, as_path(key), ABSENT) is not ABSENT

    def select(self: T, *keys: Key, strict: bool = True) -> T:
        """A new container with only ``keys`` (strings or tuple paths).

        ``KeyError`` for a missing key when ``strict``; a tensorclass cannot lose fields, so
        selecting part of one is a ``TypeError``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
            >>> td.select("b").keys()
            ['b']
        """
        return _keys.select(self, [as_path(k) for k in keys], strict)

    def exclude(self: T, *keys: Key) -> T:
        """A new container without ``keys`` (missing keys are ignored).

        A tensorclass cannot lose a field: excluding one is a ``TypeError``.

        Example:
            >>> import torch, tdfunc
            >>> td = tdfunc.TensorDict(a=torch.zeros(1), b=torch.ones(1))
            >>> td.exclude("a").keys()
            ['b']
        """
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
        A renamed key keeps its position when no new key is also an old one."""
        return ops.rename_keys(self, mapping, strict=strict)

    def pop(self: T, key: Key, default: Any = _keys.MISSING) -> tuple[Any, T]:
        """PURE, unlike tensordict's: returns ``(value, container without key)`` and leaves
        this container as it was. Write ``value, td = td.pop(key)``; tensordict's
        ``td.pop(key)`` deletes the key from ``td`` instead."""
        return ops.pop(self, key, default)

    def split_keys(self, *key_sets: Sequence[Key], strict: bool = True) -> tuple[Any, ...]:
        """One container per key set, then one with the rest."""
        return ops.split_keys(self, *key_sets, strict=strict)

    def get_at(self, key: Key, index: Any, default: Any = _keys.MISSING) -> Any:
        """``td[key][index]``; ``default`` (when given) for a missing key."""
        return ops.get_at(self, key, index, default)

    @property
    def sorted_keys(self) -> list[str]:
        """The top-level keys, sorted."""
        return ops.sorted_keys(self)

    def is_empty(self) -> bool:
        """True when no tensor leaf is held at any depth."""
        return ops.is_empty(self)

    def empty(self: T, recurse: bool = False) -> T:
        """Same type, batch size and device, no leaves (``recurse``: keep nested containers)."""
        return ops.empty(self, recurse)

    def filter_empty(self: T) -> T:
        """Without the nested containers that hold no leaf (pure ``filter_empty_``)."""
        return ops.filter_empty(self)

    def tolist(self, *, convert_tensors: bool = False) -> Any:
        """Nested lists over the batch dims whose elements are dicts of tensors (numbers and
        lists with ``convert_tensors=True``), as tensordict's ``tolist``. Eager only: Python
        objects built from tensor values cannot stay in a compiled graph."""
        return ops.tolist(self, convert_tensors=convert_tensors)

    def numpy(self) -> dict[str, Any]:
        """A nested dict of numpy arrays (eager only)."""
        return ops.numpy(self)

    # ---------------------------------------------------------------- indexing
    @property
    def at(self) -> ops.AtIndexer:
        """Out-of-place indexed updates: ``td.at[idx].set(value)`` / ``.add(value)``."""
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
        """View the batch dims with a new shape."""
        return ops.view(self, *shape)

    def permute(self: T, *dims: Any) -> T:
        """Permute the batch dims."""
        return ops.permute(self, *dims)

    def transpose(self: T, dim0: int, dim1: int) -> T:
        """Swap two batch dims."""
        return ops.transpose(self, dim0, dim1)

    def squeeze(self: T, dim: int | None = None) -> T:
        """Remove batch dims of size 1."""
        return ops.squeeze(self, dim)

    def unsqueeze(self: T, dim: int) -> T:
        """Insert a batch dim of size 1."""
        return ops.unsqueeze(self, dim)

    def flatten(self: T, start_dim: int = 0, end_dim: int = -1) -> T:
        """Flatten a range of batch dims."""
        return ops.flatten(self, start_dim, end_dim)

    def unflatten(self: T, dim: int, sizes: Sequence[int]) -> T:
        """Split one batch dim into several."""
        return ops.unflatten(self, dim, sizes)

    def expand(self: T, *shape: Any) -> T:
        """Expand the batch dims."""
        return ops.expand(self, *shape)

    # ---------------------------------------------------------------- combination
    def unbind(self: T, dim: int = 0) -> tuple[T, ...]:
        """Split along a batch dim into a tuple."""
        return ops.unbind(self, dim)

    def split(self: T, split_size: int | Sequence[int], dim: int = 0) -> tuple[T, ...]:
        """Split along a batch dim into pieces of ``split_size`` (or the given sizes)."""
        return ops.split(self, split_size, dim)

    def chunk(self: T, chunks: int, dim: int = 0) -> tuple[T, ...]:
        """Split along a batch dim into ``chunks`` pieces."""
        return ops.chunk(self, chunks, dim)

    # ---------------------------------------------------------------- transforms
    def apply(
        self: T, fn: Callable[..., Tensor], *others: Any, batch_size: Sequence[int] | None = None
    ) -> T:
        """``fn`` on every leaf (zipped with the leaves of ``others``)."""
        return ops.apply(self, fn, *others, batch_size=batch_size)

    def named_apply(
        self: T,
        fn: Callable[..., Tensor],
        *others: Any,
        nested_keys: bool | None = None,
        batch_size: Sequence[int] | None = None,
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
        return ops.named_apply(self, fn, *others, nested_keys=nested_keys, batch_size=batch_size)

    def new_zeros(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, zeros; each leaf keeps its feature dims and dtype."""
        return ops.new_zeros(self, *size, **kwargs)

    def new_ones(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, ones; each leaf keeps its feature dims and dtype."""
        return ops.new_ones(self, *size, **kwargs)

    def new_empty(self: T, *size: Any, **kwargs: Any) -> T:
        """Batch size ``size``, uninitialised; each leaf keeps its feature dims and dtype."""
        return ops.new_empty(self, *size, **kwargs)

    def new_full(self: T, size: Sequence[int], fill_value: Any, **kwargs: Any) -> T:
        """Batch size ``size``, ``fill_value``; each leaf keeps its feature dims and dtype."""
        return ops.new_full(self, size, fill_value, **kwargs)

    def new_tensor(self: T, data: Any, **kwargs: Any) -> T:
        """Every leaf a copy of ``data`` in that leaf's dtype (batch size: ``data``'s shape)."""
        return ops.new_tensor(self, data, **kwargs)

    def to(self: T, *args: Any, **kwargs: Any) -> T:
        """Move / cast every leaf (``td.to("cpu")``, ``td.to(torch.float64)``)."""
        return ops.to(self, *args, **kwargs)

    def clone(self: T) -> T:
        """A copy with cloned leaves."""
        return ops.clone(self)

    def detach(self: T) -> T:
        """Leaves detached from autograd."""
        return ops.detach(self)

    def contiguous(self: T) -> T:
        """Contiguous leaves."""
        return ops.contiguous(self)

    def consolidate(self: T) -> T:
        """A copy whose leaves are views into one flat buffer."""
        return ops.consolidate(self)

    def float(self: T) -> T:
        """Cast leaves to float32."""
        return ops.to(self, torch.float32)

    def double(self: T) -> T:
        """Cast leaves to float64."""
        return ops.to(self, torch.float64)

    def cpu(self: T) -> T:
        """Move leaves to the CPU."""
        return ops.to(self, "cpu")

    def copy(self: T) -> T:
        """A shallow copy: a new container sharing the same leaves."""
        return shallow_copy(self)

    def leaves(self) -> list[Tensor]:
        """All tensor leaves, depth first."""
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
        return _binop(operator.eq, self, other)

    def __ne__(self: T, other: Any) -> T:  # type: ignore[override]
        return _binop(operator.ne, self, other)

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
        """Elementwise absolute value."""
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
        """Sum over batch dims ``dim`` (or each whole leaf when ``dim=None``)."""
        return ops.reduce(self, "sum", dim, keepdim, **kwargs)

    def mean(self: T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> T:
        """Mean over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "mean", dim, keepdim, **kwargs)

    def prod(self: T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> T:
        """Product over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "prod", dim, keepdim, **kwargs)

    def amax(self: T, dim: Any = None, keepdim: bool = False) -> T:
        """Maximum over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "amax", dim, keepdim)

    def amin(self: T, dim: Any = None, keepdim: bool = False) -> T:
        """Minimum over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "amin", dim, keepdim)

    def std(self: T, dim: Any = None, keepdim: bool = False, *, correction: int = 1) -> T:
        """Standard deviation over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "std", dim, keepdim, correction=correction)

    def var(self: T, dim: Any = None, keepdim: bool = False, *, correction: int = 1) -> T:
        """Variance over batch dims ``dim`` (or each whole leaf)."""
        return ops.reduce(self, "var", dim, keepdim, correction=correction)

    def all(self, dim: Any = None) -> Any:
        """0-d bool tensor (never a Python bool); a container when ``dim`` is given."""
        return ops.all_(self, dim)

    def any(self, dim: Any = None) -> Any:
        """0-d bool tensor (never a Python bool); a container when ``dim`` is given."""
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
        impl = _TORCH_FUNCTIONS.get(func)
        if impl is not None:
            return impl(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _PYTREE_PASSTHROUGH:
            # functions that take any pytree of tensors: containers are pytrees already
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "wrapped":
            # Tensor.__rsub__ & co. are functools.wraps wrappers; Dynamo (torch 2.15)
            # reports the wrapper's code name as __name__: take the wrapped method's
            name = getattr(getattr(func, "__wrapped__", None), "__name__", "")
        dunder = _DUNDER.get(name)
        if dunder is not None:  # the operator itself, in its order
            op, swap = dunder
            if swap:
                args = (args[1], args[0], *args[2:])
            return ops.elementwise(op, args, kwargs)
        # everything else: the lifted-op table (pointwise, over batch dims), or a TypeError
        # naming the function and why it does not lift
        return _lift.dispatch(func, args, kwargs)


_SUPPORTED = (Tensor, int, float, bool, complex)


def _binop(op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
    if not (isinstance(a, (Container, *_SUPPORTED)) and isinstance(b, (Container, *_SUPPORTED))):
        a, b = ops.as_operand(a), ops.as_operand(b)
        if not (
            isinstance(a, (Container, *_SUPPORTED)) and isinstance(b, (Container, *_SUPPORTED))
        ):
            return NotImplemented
    return ops.binary(op, a, b)


def _split(x: Any, split_size: Any, dim: int = 0) -> Any:
    return ops.split(x, split_size, dim)


_TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.stack: lambda tensors, dim=0: ops.stack(tensors, dim),
    torch.cat: lambda tensors, dim=0: ops.cat(tensors, dim),
    torch.concat: lambda tensors, dim=0: ops.cat(tensors, dim),
    torch.concatenate: lambda tensors, axis=0: ops.cat(tensors, axis),
    torch.unbind: lambda x, dim=0: ops.unbind(x, dim),
    torch.split: _split,
    torch.chunk: lambda x, chunks, dim=0: ops.chunk(x, chunks, dim),
    torch.clone: lambda x, **kw: ops.clone(x),
    torch.zeros_like: ops.zeros_like,
    torch.ones_like: ops.ones_like,
    torch.empty_like: ops.empty_like,
    torch.full_like: ops.full_like,
    torch.reshape: lambda x, shape: ops.reshape(x, shape),
    torch.permute: lambda x, dims: ops.permute(x, dims),
    torch.transpose: lambda x, dim0, dim1: ops.transpose(x, dim0, dim1),
    torch.squeeze: lambda x, dim=None: ops.squeeze(x, dim),
    torch.unsqueeze: lambda x, dim: ops.unsqueeze(x, dim),
    torch.flatten: lambda x, start_dim=0, end_dim=-1: ops.flatten(x, start_dim, end_dim),
    # reductions (torch.sum ... torch.all) are rules of the lifted-op table (_ops/_batchdim.py)
}

#: torch functions that accept arbitrary pytrees (higher-order ops such as
#: ``torch.compiler.nested_compile_region``): called as they are.
_PYTREE_PASSTHROUGH = frozenset({"invoke_subgraph_placeholder", "invoke_subgraph"})

#: Tensor's operator methods as the operators they implement, and whether the arguments
#: come reversed (``Tensor.__rsub__(t, td)`` is ``td - t``). Dynamo hands a container's
#: ``__torch_function__`` these methods for ``td - t`` inside a compiled function; calling
#: the operator instead of the method is the same computation on every torch.
_BINARY_OPERATORS: dict[str, Callable[..., Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "div": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
}
_DUNDER: dict[str, tuple[Callable[..., Any], bool]] = {
    **{f"__{n}__": (op, False) for n, op in _BINARY_OPERATORS.items()},
    **{f"__r{n}__": (op, True) for n, op in _BINARY_OPERATORS.items()},
    "__neg__": (operator.neg, False),
    "__abs__": (operator.abs, False),
    "__invert__": (operator.invert, False),
}

#: every lifted torch function's Tensor-like method (``td.exp()``, ``td.clamp(...)``,
#: ``td.bool()``, ``td.cumsum(0)``), one mechanism from the table in ``_ops/_lift.py``;
#: methods written above are kept
_lift.install_methods(Container)
