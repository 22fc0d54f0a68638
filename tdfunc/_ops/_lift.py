"""How a torch function lifts to containers: the op table and the dispatch behind
``Container.__torch_function__``.

One table, read from torch's own metadata, never a hand list:

- the families over batch dims (reductions, scans, softmax, sorting, dim-wise shape and
  index ops, ``pad``): :func:`tdfunc._ops._batchdim.rule_for`;
- torch's aliases (``torch.divide``, ``torch.arccos``...: their docstrings name the function
  they stand for) take that function's rule: :mod:`tdfunc._ops._aliases`;
- the pointwise family (every function whose ATen operator is tagged
  ``torch.Tag.pointwise``, casts, operators a user registers with ``torch.library`` and tags
  pointwise): :func:`tdfunc._ops._pointwise.rule_for`;
- anything else cannot lift (it may mix a leaf's feature dims, e.g. ``matmul``): a
  ``TypeError`` names the function and the reason and points at ``td.apply(...)``.

:data:`METHODS` is the table of container methods that are one-line sugar over these rules
(``td.exp()``, ``td.clamp(min=0)``, ``td.bool()``, ``td.cumsum(0)``); :func:`install_methods`
puts them on ``Container`` (names the class defines itself are kept).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import _errors as E
from .._compat import unary_foreach
from . import _aliases, _batchdim, _pointwise
from ._pointwise import align_to_batch as align_to_batch
from ._pointwise import unary as _unary  # not through the module: see tests/test_compile_guards.py


def _name(func: Any) -> str:
    mod = getattr(func, "__module__", None) or ""
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    if mod.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{qual}"
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    if qual.startswith(("Tensor.", "TensorBase.", "_TensorBase.")):
        return "Tensor." + qual.split(".", 1)[1]
    if mod.startswith("torch") or not mod:
        return f"torch.{qual}" if "." not in qual else qual
    return f"{mod}.{qual}"


def not_liftable(func: Any, reason: str) -> TypeError:
    """The ``TypeError`` for a torch function that does not lift to containers.

    Example:
        >>> import torch
        >>> str(not_liftable(torch.matmul, "it mixes feature dims"))[:47]
        'torch.matmul does not lift to containers: it mi'
    """
    return TypeError(E.LIFT_NOT_LIFTABLE.format(op=_name(func), reason=reason))


def _reason(func: Any) -> str:
    """Why ``func`` does not lift (the error path only: string work Dynamo need not trace)."""
    name = getattr(func, "__name__", "") or ""
    if name.endswith("_") and not name.endswith("__"):
        return E.LIFT_REASON_INPLACE
    return E.LIFT_REASON_UNKNOWN


def rule_for(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """The rule that lifts ``func`` to containers (called as ``func`` is), or ``None``.

    Example:
        >>> import torch
        >>> rule_for(torch.exp) is not None, rule_for(torch.cumsum) is not None
        (True, True)
        >>> rule_for(torch.matmul) is None
        True
    """
    r = _batchdim.rule_for(func)
    if r is not None:
        return r
    r = _pointwise.rule_for(func)
    if r is not None:
        return r
    return _ALIAS_RULES.get(func)


def dispatch(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` where some argument is a container: the function's rule, or
    a ``TypeError`` saying why it does not lift (never torch's "Multiple dispatch failed").

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), batch_size=[2])
        >>> dispatch(torch.exp, (td,), {})["a"].tolist()
        [1.0, 1.0]
    """
    rule = rule_for(func)
    if rule is None:
        if kwargs.get("out") is not None:
            raise not_liftable(func, E.LIFT_REASON_OUT)
        if kwargs.get("inplace") is True:
            raise not_liftable(func, E.LIFT_REASON_INPLACE)
        raise not_liftable(func, _reason(func))
    return run_rule(func, rule, args, kwargs)


def run_rule(
    func: Callable[..., Any], rule: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> Any:
    """``func(*args, **kwargs)`` through ``rule``, its rule: ``out=`` and ``inplace=True``
    refused (a container is never written to), ``inplace=False`` dropped.

    Example:
        >>> import torch, tdfunc
        >>> td = tdfunc.TensorDict(a=torch.zeros(2), batch_size=[2])
        >>> run_rule(torch.exp, TABLE[torch.exp], (td,), {})["a"].tolist()
        [1.0, 1.0]
    """
    if kwargs.get("out") is not None:
        raise not_liftable(func, E.LIFT_REASON_OUT)
    if kwargs.get("inplace") is True:
        raise not_liftable(func, E.LIFT_REASON_INPLACE)
    if "inplace" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
    return rule(*args, **kwargs)


#: every torch function of the op table -> its rule, as :func:`rule_for` gives it (the
#: batch-dim families win where both name one); read once, so that ``__torch_function__``
#: finds a rule with one dict hit (inside ``torch.compile`` a hit is guarded by its key alone,
#: where a miss is guarded by every key of the dict it missed)
TABLE: dict[Any, Callable[..., Any]] = {**_pointwise._RULES, **_batchdim._RULES}

#: torch's aliases (``torch.divide``, ``torch.arccos``, ``Tensor.greater`` ...), read from
#: torch's docstrings: each takes the rule of the function it names (``_aliases.py``)
_ALIAS_RULES, _ALIAS_METHODS = _aliases.alias_rules(TABLE)
TABLE.update(_ALIAS_RULES)


#: every container method that is sugar over a lifted function: name -> the ``Tensor``
#: method it mirrors. Pointwise first; the batch-dim table wins where both name one.
METHODS: dict[str, Callable[..., Any]] = {
    **_ALIAS_METHODS,
    **_pointwise.METHODS,
    **_batchdim.METHODS,
}


#: per installed method name: (the unary fast-path name or ``None``, the ``Tensor`` method it
#: mirrors, its rule or ``None``). The methods read it as a module global and close over
#: their name alone: a method called on a container made inside a compiled function is a
#: function Dynamo reaches without a source, and a closure cell holding a rule object (not a
#: constant) could not be rebuilt there; a global always has one.
_METHOD_PLANS: dict[str, tuple[str | None, Callable[..., Any], Callable[..., Any] | None]] = {}


def _method(name: str, tensor_method: Callable[..., Any]) -> Callable[..., Any]:
    rule = rule_for(tensor_method)  # looked up once; a call with options goes through dispatch
    # td.exp(): a unary op with a foreach twin goes straight to its hot path
    unary_rule = isinstance(rule, _pointwise._Rule) and rule.name == name
    fast = name if unary_rule and name in unary_foreach else None
    _METHOD_PLANS[name] = (fast, tensor_method, rule)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        fast, tensor_method, rule = _METHOD_PLANS[name]
        if fast is not None and not args and not kwargs:
            return _unary(fast, self)
        if kwargs or rule is None:
            return dispatch(tensor_method, (self, *args), kwargs)
        return rule(self, *args)

    method.__name__ = name
    method.__qualname__ = f"Container.{name}"
    method.__doc__ = (
        f"``Tensor.{name}`` lifted to the container: run on every leaf, where a ``dim`` names "
        f'a batch dim (the documentation\'s page "Lifted torch functions" lists every '
        f"lifted function and its rule)."
    )
    return method


def install_methods(cls: type) -> list[str]:
    """Put every method of :data:`METHODS` on ``cls`` that ``cls`` (or a base) does not
    define itself; returns the names installed."""
    done = []
    for name, f in METHODS.items():
        if any(name in vars(k) for k in cls.__mro__ if k is not object):
            continue
        setattr(cls, name, _method(name, f))
        done.append(name)
    return done


# --------------------------------------------------------------------------------------
# the reference page (docs/lifted-ops.md), generated from the table
# --------------------------------------------------------------------------------------
def _public_name(f: Any) -> str:
    name = getattr(f, "__name__", str(f))
    for prefix, ns in (
        ("torch.", torch),
        ("torch.special.", torch.special),
        ("torch.linalg.", torch.linalg),
        ("torch.nn.functional.", F),
    ):
        for attr in (name, name.removeprefix("special_"), name.removeprefix("linalg_")):
            if getattr(ns, attr, None) is f:
                return prefix + attr
    return _name(f)


def _functions(rule_table: Any) -> list[str]:
    names = {_public_name(f) for f in rule_table if not _public_name(f).startswith("Tensor.")}
    return sorted(n for n in names if not n.split(".")[-1].startswith("_"))


def eager_only() -> list[str]:
    """The lifted torch functions that lift eagerly but not inside ``torch.compile``.

    ``torch.overrides`` lists them among the functions that cannot be overridden
    (``get_ignored_functions()``: the random ``*_like`` factories, and ``F.sigmoid`` /
    ``F.tanh`` / ``F.hardsigmoid``, Python functions that call the tensor method). Eagerly they
    reach the container anyway (torch's C++ binding calls ``__torch_function__``, or the
    Python function calls the container's method); Dynamo hands ``__torch_function__`` only
    the overridable functions, so under ``torch.compile`` it stops with "Failed to convert
    args/kwargs to proxy" before tdfunc sees the call (the gap pytorch/pytorch#156649 reports
    for DTensor). Read from torch, so the list follows torch when it changes.

    Example:
        >>> "torch.rand_like" in eager_only(), "torch.exp" in eager_only()
        (True, False)
    """
    ignored = torch.overrides.get_ignored_functions()
    table = [*_pointwise.FUNCTIONS, *_batchdim._RULES, *_ALIAS_RULES]
    return sorted({_public_name(f) for f in table if f in ignored})


def reference_markdown() -> str:
    """The reference page of every lifted torch function and method, from the table.

    ``tests/test_ops_pointwise.py`` checks ``docs/lifted-ops.md`` against it (and rewrites it
    with ``TDFUNC_WRITE_DOCS=1``).
    """
    pw = _functions(_pointwise.FUNCTIONS)
    bd = _functions(_batchdim._RULES)
    al = [
        f"`{n}` ({_public_name(_aliases.target_of(f))})"
        for n, f in sorted((_public_name(f), f) for f in _ALIAS_RULES)
        if not n.startswith("Tensor.")
    ]
    methods = sorted(METHODS)
    eager = eager_only()
    out = [
        "# Lifted torch functions and methods",
        "",
        "<!-- generated from the op table by tdfunc._ops._lift.reference_markdown() on torch",
        f"     {'.'.join(torch.__version__.split('.')[:2])}: TDFUNC_WRITE_DOCS=1 pytest "
        "tests/test_ops_pointwise.py -k reference rewrites it -->",
        "",
        "A torch function called on a container lifts to it when torch's own metadata says",
        "how (`tdfunc/_ops/_lift.py`): **pointwise** functions (an ATen overload tagged",
        "`torch.Tag.pointwise`, casts, a few untagged compositions) run leaf by leaf and keep",
        "the batch size; functions **over batch dims** (reductions, scans, softmax, sorting,",
        "dim-wise shape and index ops, `pad`) take batch dims as their `dim`. Any other torch",
        "function raises a `TypeError` that names it and points at `td.apply(...)`. An",
        "operator you register with `torch.library` and tag `torch.Tag.pointwise` lifts too.",
        "The container may be passed by keyword under torch's own argument names, as a tensor",
        "(`torch.sum(input=td, dim=0)`, `torch.where(mask, td, other=td2)`).",
        "",
        "## The alignment rule",
        "",
        "One principle, as in tensordict: **a plain tensor next to a container is shaped like",
        "the batch; a mask selects leading batch positions.**",
        "",
        "A plain tensor operand of an operator or a pointwise function (`td * w`, `td + w`,",
        "`w - td`, `td > w`, `torch.maximum(td, w)`, `torch.lerp(td, td2, w)`,",
        "`torch.clamp(td, min=w)` ...) must broadcast to the batch size by torch's rules,",
        "right-aligned *within the batch*: its dims line up with the last batch dims, each of",
        "size 1 or that dim's size. It is then expanded over each leaf's feature dims, whatever",
        "their sizes:",
        "",
        "```text",
        "td: batch_size [2, 3]           w = [w0, w1, w2]   (shape [3]: batch dim 1)",
        "",
        '  "obs"    [2, 3, 5]    ->  w[None, :, None]   [1, 3, 1] -> [2, 3, 5]',
        '  "reward" [2, 3]       ->  w[None, :]         [1, 3]    -> [2, 3]',
        '  "sq"     [2, 3, 3]    ->  w[None, :, None]   (the batch dim, not the last dim)',
        "",
        "w of shape [3], [1, 3], [2, 1], [2, 3] or []: fits ([2, 1] scales along batch dim 0)",
        "w of shape [2], [5], [2, 3, 5]:                ValueError (does not fit the batch)",
        "```",
        "",
        "A `w` that does not fit raises a `ValueError` naming its shape and the batch size, and",
        "the per-leaf spelling for torch's own broadcasting against each leaf",
        "(`td.apply(lambda x: x * w)`). Python numbers and 0-d tensors are scalars. The same",
        "division makes `torch.masked.mean` / `var` / `std` with a `mask` exact on leaves with",
        "feature dims (they divide by a plain count tensor of the reduced batch shape).",
        "",
        "A **mask or index** names batch positions from the front: the `condition` of",
        "`torch.where` / `td.where`, the `mask` of `masked_fill` (and, over batch dims, the",
        "`index` of `gather`, `scatter`, `take_along_dim` and the mask of `masked_select`). When",
        "it has at most as many dims as the batch, its dims are the *leading* batch dims of",
        "every leaf and it is expanded over each leaf's feature dims:",
        "",
        "```text",
        "td: batch_size [3]            mask = [ T,  F,  T ]   (shape [3] = the batch)",
        "",
        '  "obs"    [3, 4]   ->  mask[:, None]     [3, 1] -> [3, 4]',
        '  "reward" [3]      ->  mask              [3]',
        '  "img"    [3, 2, 2] -> mask[:, None, None] [3, 1, 1] -> [3, 2, 2]',
        "",
        "torch.where(mask, td, 0)      row 0 kept | row 1 zeroed | row 2 kept, in every leaf",
        "```",
        "",
        "```python",
        "td = tdfunc.TensorDict(obs=torch.ones(3, 4), reward=torch.ones(3), batch_size=[3])",
        "mask = torch.tensor([True, False, True])",
        "out = torch.where(mask, td, 0)           # out['obs'][1] == 0, out['reward'][1] == 0",
        "out = td.masked_fill(~mask, float('nan'))",
        "w = torch.tensor([1.0, 2.0, 3.0])       # one weight per row of the batch [3]",
        "out = td * w                             # out['obs'] == td['obs'] * w[:, None]",
        "```",
        "",
        "On a batch of two or more dims the two differ: a mask `[2]` on `batch_size=[2, 3]`",
        "selects along batch dim 0, a plain operand `[3]` scales along batch dim 1. A mask",
        "with more dims than the batch (shaped like a leaf) is broadcast by torch as usual.",
        "Container operands must have the same structure (keys, nesting, node types).",
        "",
        f"## Methods ({len(methods)})",
        "",
        "Each is the `Tensor` method of that name on every leaf (`td.exp()`, `td.clamp(min=0)`,",
        "`td.bool()`, `td.cumsum(0)`):",
        "",
        ", ".join(f"`{m}`" for m in methods),
        "",
        f"## Pointwise torch functions ({len(pw)})",
        "",
        ", ".join(f"`{n}`" for n in pw),
        "",
        f"## Torch functions over batch dims ({len(bd)})",
        "",
        ", ".join(f"`{n}`" for n in bd),
        "",
        f"## Aliases ({len(al)})",
        "",
        "Functions torch documents as another name for one above (`Alias for ...` in their",
        "docstrings) lift as that one does; their `Tensor` methods are container methods too:",
        "",
        ", ".join(al),
        "",
        "## Under torch.compile",
        "",
        "The methods and functions above lift inside `torch.compile(fullgraph=True)` as they do",
        "eagerly (the tests compile a sample of every family: one frame, no recompile on new",
        f"values), except these {len(eager)}, which lift eagerly only:",
        ", ".join(f"`{n}`" for n in eager) + ".",
        "`torch.overrides` lists them among the functions that cannot be overridden",
        "(`torch.overrides.get_ignored_functions()`), and Dynamo hands a container's",
        '`__torch_function__` only the overridable ones: it stops with "Failed to convert',
        'args/kwargs to proxy" before tdfunc sees the call (the same gap as',
        "[pytorch/pytorch#156649](https://github.com/pytorch/pytorch/issues/156649) for DTensor;",
        "tdfunc does not patch torch to close it). Inside a compiled function write",
        "`td.apply(torch.rand_like)` (`randn_like`, `randint_like`: one frame), and for the",
        "activations the method or the `torch.` function (`td.sigmoid()`, `torch.tanh(td)`) or",
        "`td.apply(F.hardsigmoid)`.",
        "",
    ]
    return "\n".join(out)
