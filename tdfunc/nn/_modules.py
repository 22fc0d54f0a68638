"""Key-routed modules: read entries of a TensorDict, run a module, return a new TensorDict.

:class:`TensorDictModule` wraps any callable (usually an ``nn.Module``): ``forward(td)`` reads
``in_keys`` from ``td``, calls the module and returns a **new** container holding the input
entries plus the outputs under ``out_keys``. :class:`TensorDictSequential` chains such modules.
Nothing here ever writes into its input, keeps state between calls or branches on values, so
``torch.compile(module, fullgraph=True)``, ``torch.vmap``, ``torch.func`` and ``torch.export``
see one plain graph.

The names and state-dict layout follow ``tensordict.nn`` (``module.weight``,
``module.0.module.weight``), so code and checkpoints written for it keep working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from torch import nn

from .._errors import InPlaceError
from .._keys import fmt_key
from .._tree import KeyPath, Node, is_node
from ._routing import (
    BAD_INDEX,
    BAD_KWARG,
    INPLACE_MODULE,
    KWARGS_AND_TD,
    MISSING,
    NO_INPUT,
    NO_MODULES,
    NO_OUT_KEYS,
    NOT_A_CONTAINER,
    NOT_AN_OUT_KEY,
    NOT_CALLABLE,
    NOT_KEY_ROUTED,
    OUTPUT_COUNT,
    SEQ_MISSING_IN_KEY,
    STEP_OUTPUT,
    Key,
    apply_plan,
    check_out_paths,
    child,
    describe,
    from_kwargs,
    has_key,
    kwarg_name,
    make_plan,
    overlaps,
    public_key,
    read_key,
    to_path,
    to_paths,
)


# ---------------------------------------------------------------------------------- modules
class TensorDictModule(nn.Module):
    """Route entries of a TensorDict through a module and return a new TensorDict.

    ``forward(td)`` reads ``in_keys`` from ``td``, calls ``module`` with them (positionally, or
    by keyword when ``in_keys`` is a mapping) and returns a **new** container: the entries of
    ``td`` plus the outputs under ``out_keys``. The input is never modified. A tensorclass input
    gives a tensorclass of the same type (its out keys must be fields).

    Args:
        module: any callable; an ``nn.Module`` is registered as the submodule ``module`` (its
            parameters are named ``module.<name>`` as in ``tensordict.nn``).
        in_keys: the keys to read: a key (``"obs"``, or a tuple path ``("next", "obs")``), a
            sequence of keys (passed positionally in that order), or a mapping from the
            module's keyword names to keys (``{"x": "obs", "h": ("state", "h")}``).
        out_keys: a key or a sequence of keys; the module returns one tensor (or
            TensorDict/tensorclass) per out key: a single value for one key, a tuple for several.

    Raises:
        KeyError: (at call) an in key is missing; the message names the key and the module.
        ValueError: (at call) the module returned a different number of outputs than out keys,
            or an output does not start with the batch size; (at construction) duplicate or
            nested out keys.
        TypeError: (at call) an out key would overwrite a nested container with a tensor, or
            pass through a tensor, or is not a field of a tensorclass input; (at construction)
            ``module`` is not callable or a key is not a string / tuple of strings.

    In keys are checked before the module runs; outputs are checked before a result exists.
    Nothing is ever written into the input, so an error leaves no partial result behind.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc.nn import TensorDictModule
        >>> actor = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["obs"], out_keys=["action"])
        >>> td = tdfunc.TensorDict(obs=torch.randn(5, 3), batch_size=[5])
        >>> out = actor(td)
        >>> out["action"].shape, "action" in td
        (torch.Size([5, 2]), False)
        >>> actor.in_keys, actor.out_keys
        (['obs'], ['action'])
    """

    _fn: Callable[..., Any]

    def __init__(
        self,
        module: Callable[..., Any],
        in_keys: Key | Sequence[Key] | Mapping[str, Key],
        out_keys: Key | Sequence[Key],
    ) -> None:
        super().__init__()
        if not callable(module):
            raise TypeError(NOT_CALLABLE.format(typ=type(module).__name__))
        if isinstance(in_keys, Mapping):
            for name in in_keys:
                if not isinstance(name, str) or not name:
                    raise TypeError(BAD_KWARG.format(name=name))
            kwargs: tuple[str, ...] | None = tuple(in_keys)
            in_paths = tuple(to_path(k, "in_keys") for k in in_keys.values())
        else:
            kwargs = None
            in_paths = to_paths(in_keys, "in_keys")
        out_paths = to_paths(out_keys, "out_keys")
        if not out_paths:
            raise ValueError(NO_OUT_KEYS)
        check_out_paths(out_paths)
        self.module = module
        self._name = (
            f"TensorDictModule(module={describe(module)}, in_keys={[public_key(p) for p in in_paths]}, "
            f"out_keys={[public_key(p) for p in out_paths]})"
        )
        # everything forward needs, in one immutable tuple (one cheap guard under compile)
        self._route = (
            in_paths,
            kwargs,
            out_paths,
            make_plan(out_paths, range(len(out_paths))),
            self._name,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "module":
            # A plain reference for the call path: reading a registered submodule goes through
            # nn.Module.__getattr__, which costs more than the rest of a small forward.
            object.__setattr__(self, "_fn", value)

    @property
    def in_keys(self) -> list[Key]:
        """The keys read from the input, in call order (a fresh list)."""
        return [public_key(p) for p in self._route[0]]

    @property
    def out_keys(self) -> list[Key]:
        """The keys written in the result, in output order (a fresh list)."""
        return [public_key(p) for p in self._route[2]]

    @property
    def in_kwargs(self) -> tuple[str, ...] | None:
        """The keyword names the inputs are passed under, or None when passed positionally."""
        return self._route[1]

    def forward(self, td: Any = None, **tensors: Any) -> Any:
        """Read ``in_keys``, call the module and return ``td`` plus the outputs (a new container).

        Called with keyword tensors instead (``mod(obs=t)``, one keyword per in key, a nested
        key ``("a", "b")`` as ``a_b``), it returns the outputs themselves: the value of the
        one out key, or a tuple in ``out_keys`` order. That form also works through
        ``torch.export.export(mod, (), kwargs)``.
        """
        if tensors:
            return _keyword_call(self, self._route[0], self._route[2], td, tensors)
        if td is None:
            raise TypeError(
                NO_INPUT.format(module=self._name, names=[kwarg_name(p) for p in self._route[0]])
            )
        return self._forward(td)

    def _forward(self, td: Any) -> Any:
        in_paths, kwargs, out_paths, plan, name = self._route
        if not isinstance(td, Node):
            raise TypeError(NOT_A_CONTAINER.format(module=name, typ=type(td).__name__))
        args = []
        for path in in_paths:
            args.append(read_key(td, path, name))
        out = self._fn(*args) if kwargs is None else self._fn(**dict(zip(kwargs, args)))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        if len(outputs) != len(out_paths):
            raise ValueError(
                OUTPUT_COUNT.format(
                    module=name,
                    got=len(outputs),
                    expected=len(out_paths),
                    out_keys=self.out_keys,
                )
            )
        return apply_plan(td, plan, outputs, name, ())

    def select_out_keys(self, *keys: Key) -> NoReturn:
        """tensordict's ``select_out_keys`` changes the module in place: it raises
        :class:`tdfunc.InPlaceError` naming the pure spelling, a sequence of this module that
        returns only ``keys`` (``TensorDictSequential(m).with_out_keys(...)``)."""
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="select_out_keys",
                hint="m = TensorDictSequential(m).with_out_keys("
                f"{', '.join(map(repr, keys)) or '...'})",
            )
        )

    def reset_out_keys(self) -> NoReturn:
        """tensordict's ``reset_out_keys`` changes the module in place: it raises
        :class:`tdfunc.InPlaceError` (a module here always writes every out key)."""
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="reset_out_keys",
                hint="m (a TensorDictModule always writes every out key; drop the call)",
            )
        )

    def extra_repr(self) -> str:
        head = "" if isinstance(self.module, nn.Module) else f"module={describe(self.module)}, "
        return f"{head}in_keys={self.in_keys}, out_keys={self.out_keys}"


def _keyword_call(
    module: Any,
    in_paths: tuple[KeyPath, ...],
    out_paths: tuple[KeyPath, ...],
    td: Any,
    tensors: dict[str, Any],
) -> Any:
    """``module(**tensors)``: the keywords as a TensorDict, then the out keys' values."""
    name = module._name
    if td is not None:
        raise TypeError(KWARGS_AND_TD.format(module=name, names=[kwarg_name(p) for p in in_paths]))
    out = module._forward(from_kwargs(in_paths, tensors, name))
    values = tuple(read_key(out, p, name) for p in out_paths)
    return values[0] if len(values) == 1 else values


def _routing(module: Any) -> tuple[tuple[KeyPath, ...], tuple[KeyPath, ...]]:
    return to_paths(list(module.in_keys), "in_keys"), to_paths(list(module.out_keys), "out_keys")


class _Step(nn.Module):
    """A plain ``TensorDict -> TensorDict`` function as a step of a sequence.

    Its reads and writes are unknown: it declares no keys, and keys it writes cannot be
    selected with ``selected_out_keys``.
    """

    in_keys: tuple[Key, ...] = ()
    out_keys: tuple[Key, ...] = ()

    def __init__(self, fn: Callable[[Any], Any], index: int) -> None:
        super().__init__()
        self.fn = fn
        self.index = index

    def forward(self, td: Any) -> Any:
        out = self.fn(td)
        if not isinstance(out, Node):
            raise TypeError(
                STEP_OUTPUT.format(
                    seq="TensorDictSequential",
                    index=self.index,
                    step=describe(self.fn),
                    typ=type(out).__name__,
                )
            )
        return out

    def extra_repr(self) -> str:
        return f"fn={describe(self.fn)}"


class TensorDictSequential(nn.Module):
    """Run key-routed modules in order; each one sees the outputs of the ones before it.

    ``forward(td)`` returns a **new** container: ``td`` plus every entry the modules wrote (or
    only ``selected_out_keys`` of them). The input is never modified.

    Args:
        *modules: key-routed modules (:class:`TensorDictModule`, nested
            :class:`TensorDictSequential`, or any ``nn.Module`` with ``in_keys``/``out_keys``
            attributes whose ``forward(td)`` returns a new container), or plain functions
            ``TensorDict -> TensorDict`` (e.g. ``lambda td: td.exclude("hidden")``). A plain
            function declares no keys: the keys that modules after it read are not checked
            before the sequence runs, and keys it writes cannot be selected.
        selected_out_keys: if given, the result holds the input plus only these outputs;
            intermediate entries are dropped (an input entry an intermediate overwrote keeps
            its input value).

    Attributes:
        in_keys: the keys the sequence needs from its input (read before anything writes them).
        out_keys: every key the sequence writes into its result, in order (or the selection).

    The sequence is fixed at construction (its keys are computed then); build a new one to
    change it, e.g. with :meth:`with_out_keys`. Each module is called through
    ``nn.Module.__call__``, so hooks registered on it run.

    Raises:
        KeyError: (at call) an in key is missing; the message names the key and the module
            needing it, before any module runs. (At construction) a selected key is not written.
        TypeError: (at construction) a module is not key-routed.

    Example:
        >>> import torch, tdfunc
        >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
        >>> policy = TensorDictSequential(
        ...     TensorDictModule(torch.nn.Linear(3, 8), in_keys="obs", out_keys="hidden"),
        ...     TensorDictModule(torch.nn.Linear(8, 2), in_keys="hidden", out_keys="action"),
        ...     selected_out_keys=["action"],
        ... )
        >>> out = policy(tdfunc.TensorDict(obs=torch.randn(4, 3), batch_size=[4]))
        >>> sorted(out.keys()), policy.in_keys, policy.out_keys
        (['action', 'obs'], ['obs'], ['action'])
    """

    def __init__(self, *modules: nn.Module, selected_out_keys: Sequence[Key] | None = None) -> None:
        super().__init__()
        if not modules:
            raise ValueError(NO_MODULES)
        steps: list[nn.Module] = []
        for i, m in enumerate(modules):
            if isinstance(m, nn.Module) and hasattr(m, "in_keys") and hasattr(m, "out_keys"):
                steps.append(m)
            elif callable(m) and not isinstance(m, nn.Module):
                steps.append(_Step(m, i))  # a plain TensorDict -> TensorDict function
            else:
                raise TypeError(NOT_KEY_ROUTED.format(index=i, typ=type(m).__name__))
        modules = tuple(steps)
        self.module = nn.ModuleList(modules)
        # the same modules as a plain tuple for the call path (see TensorDictModule.__setattr__)
        self._steps = tuple(modules)
        needed: list[tuple[KeyPath, int]] = []
        written: list[KeyPath] = []
        opaque = False  # after a plain function, which keys exist is known only at run time
        for i, m in enumerate(modules):
            ins, outs = _routing(m)
            opaque = opaque or isinstance(m, _Step)
            for p in () if opaque else ins:
                produced = any(overlaps(p, w) for w in written)
                if not produced and all(p != q for q, _ in needed):
                    needed.append((p, i))
            for p in outs:
                if p not in written:
                    written.append(p)
        self._in_paths = tuple(p for p, _ in needed)
        self._all_out_paths = tuple(written)
        if selected_out_keys is None:
            self._selected: tuple[KeyPath, ...] | None = None
        else:
            selected = to_paths(selected_out_keys, "selected_out_keys")
            for p in selected:
                if p not in written:
                    raise KeyError(
                        NOT_AN_OUT_KEY.format(
                            seq="TensorDictSequential",
                            key=fmt_key(p),
                            out_keys=[public_key(w) for w in written],
                        )
                    )
            self._selected = selected
        self._name = f"TensorDictSequential(in_keys={self.in_keys}, out_keys={self.out_keys})"
        plan = (
            None
            if self._selected is None
            else make_plan(self._selected, range(len(self._selected)))
        )
        self._route = (tuple(needed), self._selected, plan, self._name)

    @property
    def in_keys(self) -> list[Key]:
        """The keys needed from outside (a fresh list)."""
        return [public_key(p) for p in self._in_paths]

    @property
    def out_keys(self) -> list[Key]:
        """The keys written in the result: the selection if any, else every written key."""
        paths = self._all_out_paths if self._selected is None else self._selected
        return [public_key(p) for p in paths]

    @property
    def selected_out_keys(self) -> list[Key] | None:
        """The selected out keys, or None when every written key is returned."""
        return None if self._selected is None else [public_key(p) for p in self._selected]

    def with_out_keys(self, *keys: Key) -> TensorDictSequential:
        """A new sequence sharing these modules that returns only ``keys`` among its outputs
        (this one is left as it was).

        Example:
            >>> import torch
            >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
            >>> seq = TensorDictSequential(
            ...     TensorDictModule(lambda x: x + 1, in_keys="a", out_keys="b"),
            ...     TensorDictModule(lambda x: x * 2, in_keys="b", out_keys="c"))
            >>> seq.with_out_keys("c").out_keys, seq.out_keys
            (['c'], ['b', 'c'])
        """
        return TensorDictSequential(*self.module, selected_out_keys=list(keys))

    def select_out_keys(self, *keys: Key) -> NoReturn:
        """tensordict's ``select_out_keys`` changes the module in place; modules here are
        fixed at construction, so it raises :class:`tdfunc.InPlaceError` naming the pure
        spelling, :meth:`with_out_keys` (a new sequence)."""
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="select_out_keys",
                hint=f"seq = seq.with_out_keys({', '.join(map(repr, keys)) or '...'})",
            )
        )

    def reset_out_keys(self) -> NoReturn:
        """tensordict's ``reset_out_keys`` changes the module in place: it raises
        :class:`tdfunc.InPlaceError` naming the pure spelling (a new sequence of the same
        modules, ``TensorDictSequential(*seq.module)``)."""
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="reset_out_keys",
                hint="seq = TensorDictSequential(*seq.module)",
            )
        )

    def forward(self, td: Any = None, **tensors: Any) -> Any:
        """Run the modules in order and return ``td`` plus their outputs (a new container).

        Called with keyword tensors (``seq(obs=t)``, named after :attr:`in_keys`), it returns
        the values of :attr:`out_keys` instead: one value, or a tuple in that order.
        """
        if tensors:
            return _keyword_call(self, self._in_paths, self._out_paths(), td, tensors)
        if td is None:
            raise TypeError(
                NO_INPUT.format(module=self._name, names=[kwarg_name(p) for p in self._in_paths])
            )
        return self._forward(td)

    def __len__(self) -> int:
        """The number of modules (plain functions count as one each).

        Example:
            >>> import torch
            >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
            >>> len(TensorDictSequential(
            ...     TensorDictModule(lambda x: x + 1, in_keys="a", out_keys="b"),
            ...     TensorDictModule(lambda x: x * 2, in_keys="b", out_keys="c")))
            2
        """
        return len(self._steps)

    def __getitem__(self, index: int | slice) -> Any:
        """Module ``index`` (as given, a plain function as its wrapping step), or for a slice a
        new :class:`TensorDictSequential` of those modules (sharing them; without
        ``selected_out_keys``, as in ``tensordict.nn``).

        Raises:
            IndexError: ``index`` is out of range.
            TypeError: ``index`` is not an int or a slice.

        Example:
            >>> import torch
            >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
            >>> seq = TensorDictSequential(
            ...     TensorDictModule(lambda x: x + 1, in_keys="a", out_keys="b"),
            ...     TensorDictModule(lambda x: x * 2, in_keys="b", out_keys="c"))
            >>> seq[-1].out_keys, seq[1:].in_keys, seq[:1].out_keys
            (['c'], ['b'], ['b'])
        """
        if isinstance(index, slice):
            return type(self)(*self._steps[index])
        if isinstance(index, int) and not isinstance(index, bool):
            return self._steps[index]
        raise TypeError(BAD_INDEX.format(typ=type(index).__name__))

    def __setitem__(self, index: int | slice, module: Any) -> NoReturn:
        """tensordict's ``seq[i] = m`` changes the sequence in place: it raises
        :class:`tdfunc.InPlaceError` naming the pure spelling (a new sequence).

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
            >>> seq = TensorDictSequential(TensorDictModule(lambda x: x, in_keys="a", out_keys="b"))
            >>> try:
            ...     seq[0] = seq[0]
            ... except tdfunc.InPlaceError as e:
            ...     print(str(e).split(": ")[-1])
            seq = TensorDictSequential(*seq[:i], new_module, *seq[i + 1:])
        """
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="__setitem__",
                hint="seq = TensorDictSequential(*seq[:i], new_module, *seq[i + 1:])",
            )
        )

    def __delitem__(self, index: int | slice) -> NoReturn:
        """tensordict's ``del seq[i]`` changes the sequence in place: it raises
        :class:`tdfunc.InPlaceError` naming the pure spelling (a new sequence).

        Example:
            >>> import torch, tdfunc
            >>> from tdfunc.nn import TensorDictModule, TensorDictSequential
            >>> seq = TensorDictSequential(TensorDictModule(lambda x: x, in_keys="a", out_keys="b"))
            >>> try:
            ...     del seq[0]
            ... except tdfunc.InPlaceError as e:
            ...     print(str(e).split(": ")[-1])
            seq = TensorDictSequential(*seq[:i], *seq[i + 1:])
        """
        raise InPlaceError(
            INPLACE_MODULE.format(
                cls=type(self).__name__,
                name="__delitem__",
                hint="seq = TensorDictSequential(*seq[:i], *seq[i + 1:])",
            )
        )

    def _out_paths(self) -> tuple[KeyPath, ...]:
        return self._all_out_paths if self._selected is None else self._selected

    def _forward(self, td: Any) -> Any:
        needed, selected, plan, name = self._route
        if not isinstance(td, Node):
            raise TypeError(NOT_A_CONTAINER.format(module=name, typ=type(td).__name__))
        for path, index in needed:
            if not has_key(td, path):
                self._raise_missing(td, path, index)
        out = td
        for m in self._steps:
            out = m(out)
        if selected is None or plan is None:
            return out
        outputs = []
        for path in selected:
            outputs.append(read_key(out, path, name))
        return apply_plan(td, plan, outputs, name, ())

    def _raise_missing(self, td: Any, path: KeyPath, index: int) -> None:
        parent: Any = td
        for k in path[:-1]:
            nxt = child(parent, k) if is_node(parent) else MISSING
            if nxt is MISSING or not is_node(nxt):
                break
            parent = nxt
        m = self.module[index]
        raise KeyError(
            SEQ_MISSING_IN_KEY.format(
                seq=self._name,
                key=fmt_key(path),
                index=index,
                module=getattr(m, "_name", type(m).__name__),
                cls=type(td).__name__,
                available=list(parent._tdf_keys()),
            )
        )

    def extra_repr(self) -> str:
        sel = "" if self._selected is None else f", selected_out_keys={self.selected_out_keys}"
        return f"in_keys={self.in_keys}, out_keys={self.out_keys}{sel}"


__all__ = ["TensorDictModule", "TensorDictSequential"]
