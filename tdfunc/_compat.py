"""The one home of private torch APIs: one version-checked shim per feature.

No other module of ``tdfunc`` names a private torch internal in code (``tests/test_compat.py``
enforces it). A shim is the torch object itself (the same function object, so Dynamo traces a
call through it exactly as a call to the original) or, where torch differs between versions,
a small function. A shim whose internal is missing on the running torch does not fail
``import tdfunc``: it raises ``RuntimeError`` naming the feature when it is used (:func:`missing`);
only ``pytree`` is required at import (containers are registered with it then).
What lives in ``torch._higher_order_ops`` and ``torch.distributed`` is imported on first use,
never by ``import tdfunc``; nothing here imports ``torch._dynamo``.

Versions checked: 2.13, 2.14, 2.15 ("ok": present and behaving as the shim expects).

| shim                           | private torch API used                                 | 2.13 | 2.14 | 2.15 | public replacement |
|--------------------------------|--------------------------------------------------------|------|------|------|--------------------|
| pytree                         | torch.utils._pytree (module)                           | ok   | ok   | ok   | none yet           |
| foreach_add, foreach_add_,     | torch._foreach_add, _foreach_add_, _sub, _mul, _mul_,  | ok   | ok   | ok   | none yet           |
| ... (16 foreach_* names)       | _div, _div_, _neg, _sign, _sqrt, _lerp, _addcmul,      |      |      |      |                    |
|                                | _addcmul_, _addcdiv_, _maximum, _norm                  |      |      |      |                    |
| fused_adam_, fused_adamw_,     | torch._fused_adam_, _fused_adamw_, _fused_sgd_,        | ok   | ok   | ok   | none yet           |
| fused_sgd_, fused_adagrad_     | _fused_adagrad_ (torch.optim's fused=True kernels)     |      |      |      |                    |
| check                          | torch._check                                           | ok   | ok   | ok   | none yet           |
| assert_async                   | torch._assert_async                                    | ok   | ok   | ok   | none yet           |
| is_batchedtensor               | torch._C._functorch.is_batchedtensor                   | ok   | ok   | ok   | none yet           |
| functorch_transforms_active    | torch._C._are_functorch_transforms_active              | ok   | -    | ok   | none yet           |
| undo_compiled_grad_hooks_switch| torch._C._autograd._saved_tensors_hooks_get_disabled_ | ok   | ok   | ok   | none yet           |
|                                | error_message, _saved_tensors_hooks_enable             |      |      |      |                    |
| is_functorch_wrapped_tensor    | torch._C._functorch.is_functorch_wrapped_tensor        | ok   | ok   | ok   | none yet           |
| get_unwrapped                  | torch._C._functorch.get_unwrapped                      | ok   | ok   | ok   | none yet           |
| maybe_get_bdim                 | torch._C._functorch.maybe_get_bdim                     | ok   | ok   | ok   | none yet           |
| maybe_get_level                | torch._C._functorch.maybe_get_level                    | ok   | ok   | ok   | none yet           |
| add_batch_dim                  | torch._C._functorch._add_batch_dim                     | ok   | ok   | ok   | none yet           |
| unwrap_for_grad                | torch._C._functorch._unwrap_for_grad                   | ok   | ok   | ok   | none yet           |
| unwrap_batched                 | torch._C._functorch._unwrap_batched                    | ok   | ok   | ok   | none yet           |
| functorch_level                | torch._C._functorch.peek_interpreter_stack,            | ok   | ok   | ok   | none yet           |
|                                | torch._functorch.pyfunctorch.coerce_cinterpreter       |      |      |      |                    |
| lazy_clone                     | torch._lazy_clone (aten._lazy_clone)                   | ok   | ok   | ok   | none yet           |
| is_cow                         | torch._C._is_cow_tensor, torch._C._dispatch_keys       | ok   | (1)  | (1)  | none yet           |
| is_alias_of                    | torch._C._is_alias_of                                  | ok   | ok   | ok   | none yet           |
| is_functional_tensor           | torch._is_functional_tensor                            | ok   | ok   | ok   | none yet           |
| DisableTorchFunctionSubclass   | torch._C.DisableTorchFunctionSubclass                  | ok   | ok   | ok   | none yet           |
| TensorBase                     | torch._C.TensorBase                                    | ok   | ok   | ok   | none yet           |
| OpOverloadPacket               | torch._ops.OpOverloadPacket                            | ok   | ok   | ok   | none yet           |
| OpOverload                     | torch._ops.OpOverload                                  | ok   | ok   | ok   | none yet           |
| operator_schemas               | torch._C._jit_get_schemas_for_operator                 | ok   | -    | -    | none yet           |
| comptime (lazy)                | torch._dynamo.comptime.comptime                        | ok   | -    | -    | none yet           |
| unary_foreach                  | torch._foreach_<unary> (exp, sigmoid, abs ...)         | ok   | ok   | ok   | none yet           |
| pad_sequence_op                | torch._C._nn.pad_sequence                              | ok   | ok   | ok   | none yet (5)       |
| make_wrapper_subclass          | torch.Tensor._make_wrapper_subclass                    | ok   | ok   | ok   | none yet           |
| make_subclass                  | torch.Tensor._make_subclass                            | ok   | ok   | ok   | none yet           |
| is_traceable_wrapper_subclass  | torch.utils._python_dispatch.(same name)               | ok   | ok   | ok   | none yet           |
| NormBase                       | torch.nn.modules.batchnorm._NormBase                   | ok   | ok   | ok   | none yet           |
| reparametrize_module           | torch.nn.utils.stateless._reparametrize_module         | ok   | ok   | ok   | none yet (2)       |
| register_default_collate       | torch.utils.data._utils.collate.default_collate_fn_map | ok   | ok   | ok   | none yet           |
| register_ordered_effect        | (public) CustomOpDef.register_effect, EffectType       | ok   | ok   | ok   | itself (3)         |
| torch_scan (lazy)              | torch._higher_order_ops.scan.scan                      | ok   | ok   | ok   | none yet           |
| torch_while_loop (lazy)        | torch._higher_order_ops.while_loop.while_loop          | ok   | ok   | ok   | none yet (4)       |
| DTensorSpec, TensorMeta (lazy) | torch.distributed.tensor._dtensor_spec.(same names)    | ok   | ok   | ok   | none yet           |
| StridedShard (lazy)            | torch.distributed.tensor.placement_types._StridedShard | ok   | ok   | ok   | none yet           |
| functional_collectives (lazy)  | torch.distributed._functional_collectives (module:     | ok   | ok   | ok   | none yet           |
|                                | all_gather_single, reduce_scatter_single, all_reduce,  |      |      |      |                    |
|                                | all_gather_single_autograd)                            |      |      |      |                    |
| recompute_collectives (lazy)   | torch._functorch.config.patch(unsafe_allow_optimiza-   | ok   | ok   | ok   | none yet           |
|                                | tion_of_collectives, activation_memory_budget)         |      |      |      |                    |
| compiled_graphs (lazy)         | torch._dynamo.utils.counters["stats"]["unique_graphs"] | ok   | -    | ok   | none yet           |
| maybe_mark_dynamic (lazy)      | torch._dynamo.maybe_mark_dynamic                       | ok   | -    | -    | none yet           |
| trace_autograd (lazy)          | torch._dynamo.config.trace_autograd_ops (set, restored)| ok   | -    | ok   | none yet           |
| autograd_traced (lazy)         | torch._dynamo.config.trace_autograd_ops (read)         | ok   | -    | ok   | none yet           |

(1) torch >= 2.14 raises ``RuntimeError`` for Python tensor subclasses (``FakeTensor``); the
    shim answers ``False`` for any tensor with Python dispatch, as torch's own guards do.
(2) ``torch.func.functional_call`` calls a module; it is not a context manager around a call.
(3) Public, but not on every torch: the shim does nothing where it is missing (see there).
(4) ``torch.while_loop`` is the same object, but it is not in ``torch.__all__``.
(5) ``torch.nn.utils.rnn.pad_sequence`` is public, but ``__torch_function__`` receives the C
    function it calls.

Retired: ``torch._dynamo.substitute_in_graph`` is called through its public twin
``torch.compiler.substitute_in_graph`` (the same call, public on every supported torch), so
it needs no shim.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
from torch import Tensor

from . import _errors as E

if TYPE_CHECKING:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as DTensorSpec
    from torch.distributed.tensor._dtensor_spec import TensorMeta as TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard as StridedShard


def _parse_version(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string (``"2.15.0a0+git..."``)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if m is None:
        return (0, 0, 0)
    return (int(m[1]), int(m[2]), int(m[3] or 0))


#: the running torch as ``(major, minor, patch)``
TORCH_VERSION: tuple[int, int, int] = _parse_version(torch.__version__)
#: the oldest torch tdfunc supports (every shim below exists there)
MIN_TORCH: tuple[int, int] = (2, 13)
#: the torch versions every shim is checked on
CHECKED = ("2.13", "2.14", "2.15")
_MIN = ".".join(map(str, MIN_TORCH))

_T = TypeVar("_T")


def _module(name: str) -> Any:
    """The torch module ``name``, imported if it is not yet (``ImportError`` if missing)."""
    return importlib.import_module(name)


def missing(feature: str, minimum: str) -> NoReturn:
    """Raise ``RuntimeError``: ``feature`` needs torch >= ``minimum``, which is not running."""
    raise RuntimeError(
        E.TORCH_MISSING.format(
            feature=feature,
            version=torch.__version__,
            minimum=minimum,
            checked=", ".join(CHECKED),
        )
    )


def _function(get: Callable[[], _T], feature: str, minimum: str = _MIN) -> _T:
    """``get()`` (a torch object), or a stand-in that raises :func:`missing` when called."""
    try:
        return get()
    except (AttributeError, ImportError, RuntimeError):

        def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
            missing(feature, minimum)

        unavailable.__tdfunc_missing__ = feature  # type: ignore[attr-defined]
        return unavailable  # type: ignore[return-value]


def _class(get: Callable[[], type[_T]], feature: str, minimum: str = _MIN) -> type[_T]:
    """``get()`` (a torch class), or a stand-in class that raises :func:`missing` when it is
    instantiated or used in ``isinstance`` / ``issubclass`` (identity tests just fail)."""
    try:
        return get()
    except (AttributeError, ImportError, RuntimeError):

        class _Unavailable(type):
            def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
                missing(feature, minimum)

            def __instancecheck__(cls, obj: Any) -> NoReturn:
                missing(feature, minimum)

            def __subclasscheck__(cls, sub: Any) -> NoReturn:
                missing(feature, minimum)

        return _Unavailable("Unavailable", (), {"__tdfunc_missing__": feature})  # type: ignore[return-value]


# --------------------------------------------------------------------------------------
# pytree (node registration runs at import: required)
# --------------------------------------------------------------------------------------
try:
    import torch.utils._pytree as pytree  # torch's pytree module: registration, flatten, specs
except ImportError:  # pragma: no cover - every supported torch has it
    missing("pytree registration (torch.utils._pytree)", _MIN)


# --------------------------------------------------------------------------------------
# foreach ops: one kernel launch per op over a list of tensors (eager ops, optimizers)
# --------------------------------------------------------------------------------------
_FOREACH = "foreach list arithmetic (torch._foreach_*)"
#: ``torch._foreach_add``: ``xs + ys`` / ``xs + s`` elementwise over lists
foreach_add = _function(lambda: torch._foreach_add, _FOREACH)
#: ``torch._foreach_add_``: in place
foreach_add_ = _function(lambda: torch._foreach_add_, _FOREACH)
#: ``torch._foreach_sub``
foreach_sub = _function(lambda: torch._foreach_sub, _FOREACH)
#: ``torch._foreach_mul``
foreach_mul = _function(lambda: torch._foreach_mul, _FOREACH)
#: ``torch._foreach_mul_``: in place
foreach_mul_ = _function(lambda: torch._foreach_mul_, _FOREACH)
#: ``torch._foreach_div``
foreach_div = _function(lambda: torch._foreach_div, _FOREACH)
#: ``torch._foreach_div_``: in place
foreach_div_ = _function(lambda: torch._foreach_div_, _FOREACH)
#: ``torch._foreach_neg``
foreach_neg = _function(lambda: torch._foreach_neg, _FOREACH)
#: ``torch._foreach_sign``
foreach_sign = _function(lambda: torch._foreach_sign, _FOREACH)
#: ``torch._foreach_sqrt``
foreach_sqrt = _function(lambda: torch._foreach_sqrt, _FOREACH)
#: ``torch._foreach_lerp``
foreach_lerp = _function(lambda: torch._foreach_lerp, _FOREACH)
#: ``torch._foreach_addcmul``: ``xs + value * ys * zs``
foreach_addcmul = _function(lambda: torch._foreach_addcmul, _FOREACH)
#: ``torch._foreach_addcmul_``: in place
foreach_addcmul_ = _function(lambda: torch._foreach_addcmul_, _FOREACH)
#: ``torch._foreach_addcdiv_``: ``xs += value * ys / zs`` in place
foreach_addcdiv_ = _function(lambda: torch._foreach_addcdiv_, _FOREACH)
#: ``torch._foreach_maximum``
foreach_maximum = _function(lambda: torch._foreach_maximum, _FOREACH)
#: ``torch._foreach_norm``: one norm per tensor
foreach_norm = _function(lambda: torch._foreach_norm, _FOREACH)
#: the out-of-place unary ``torch._foreach_<name>`` functions, by ``<name>`` (``exp``,
#: ``sigmoid`` ...): the pointwise lift's one call over a container's leaves
unary_foreach: dict[str, Callable[..., Any]] = {
    n.removeprefix("_foreach_"): getattr(torch, n)
    for n in dir(torch)
    if n.startswith("_foreach_") and not n.endswith("_")
}


# --------------------------------------------------------------------------------------
# tracing: checks a compiled program runs
# --------------------------------------------------------------------------------------
#: ``torch._check``: assert a (symbolic) condition, checked when the compiled program runs
# --------------------------------------------------------------------------------------
# fused optimizer kernels (torch.optim's fused=True): in place, eager only
# --------------------------------------------------------------------------------------
_FUSED = "fused optimizer kernels (torch._fused_adam_ ...)"
fused_adam_ = _function(lambda: torch._fused_adam_, _FUSED)
fused_adamw_ = _function(lambda: torch._fused_adamw_, _FUSED)
fused_sgd_ = _function(lambda: torch._fused_sgd_, _FUSED)
fused_adagrad_ = _function(lambda: torch._fused_adagrad_, _FUSED)

check = _function(lambda: torch._check, "runtime shape checks (torch._check)")
#: ``torch._assert_async``: fail the (compiled) program at run time when a tensor is False
assert_async = _function(lambda: torch._assert_async, "run-time assertions (torch._assert_async)")


# --------------------------------------------------------------------------------------
# functorch introspection: vmap levels and grad wrappers
# --------------------------------------------------------------------------------------
_FUNCTORCH = "functorch introspection (torch._C._functorch)"
#: whether a tensor is a ``torch.vmap`` batched tensor
is_batchedtensor = _function(lambda: torch._C._functorch.is_batchedtensor, _FUNCTORCH)
#: whether any functorch transform (vmap, grad, jvp...) is active: when none is, no tensor
#: is a batched tensor (one call instead of a check per tensor)
functorch_transforms_active = _function(
    lambda: torch._C._are_functorch_transforms_active, _FUNCTORCH
)

_HOOKS = "autograd's saved-tensor hooks switch (torch._C._autograd)"
_hooks_disabled_message = _function(
    lambda: torch._C._autograd._saved_tensors_hooks_get_disabled_error_message, _HOOKS
)
_hooks_enable = _function(lambda: torch._C._autograd._saved_tensors_hooks_enable, _HOOKS)
#: the start of the message with which ``torch.func.grad`` / ``vjp`` disable the hooks
_FUNC_HOOKS_MESSAGE = "torch.func.{grad, vjp, jacrev, hessian}"


def undo_compiled_grad_hooks_switch() -> None:
    """Enable autograd's saved-tensor hooks again where a compiled ``torch.func.grad`` (or
    ``vjp``) program disabled them and is being left by an exception: the graph disables
    them for its body and enables them at its end, which an exception skips, so every later
    ``saved_tensors_hooks`` of the process would fail (torch 2.13-2.15, Dynamo's own graph;
    eager ``torch.func`` restores them itself). Called just before a compiled program raises
    one of tdfunc's typed errors; a switch made by the caller (another message, or an active
    ``torch.func`` transform, whose exit restores it) is left alone.

    Example:
        >>> undo_compiled_grad_hooks_switch()  # nothing disabled: nothing to do
        >>> import torch
        >>> torch._C._autograd._saved_tensors_hooks_get_disabled_error_message() is None
        True
    """
    message = _hooks_disabled_message()
    if (
        message is not None
        and message.startswith(_FUNC_HOOKS_MESSAGE)
        and not functorch_transforms_active()
    ):
        _hooks_enable()


#: whether a tensor is wrapped by a functorch transform (vmap or grad level)
is_functorch_wrapped_tensor = _function(
    lambda: torch._C._functorch.is_functorch_wrapped_tensor, _FUNCTORCH
)
#: the tensor one functorch wrapper down
get_unwrapped = _function(lambda: torch._C._functorch.get_unwrapped, _FUNCTORCH)
#: the dim a batched tensor's vmap level maps over
maybe_get_bdim = _function(lambda: torch._C._functorch.maybe_get_bdim, _FUNCTORCH)
#: the vmap level of a batched tensor
maybe_get_level = _function(lambda: torch._C._functorch.maybe_get_level, _FUNCTORCH)
#: wrap a tensor as batched at ``(bdim, level)`` (the inverse of ``get_unwrapped``)
add_batch_dim = _function(lambda: torch._C._functorch._add_batch_dim, _FUNCTORCH)
#: the tensor under a grad (or jvp) wrapper of ``level``; any other tensor as it is (Dynamo
#: traces it, unlike ``get_unwrapped``)
unwrap_for_grad = _function(lambda: torch._C._functorch._unwrap_for_grad, _FUNCTORCH)
#: ``(tensor, bdim)`` under a batched wrapper of ``level``; any other tensor as it is, with
#: ``None`` (Dynamo traces it, unlike ``get_unwrapped``)
unwrap_batched = _function(lambda: torch._C._functorch._unwrap_batched, _FUNCTORCH)
_peek_interpreter_stack = _function(lambda: torch._C._functorch.peek_interpreter_stack, _FUNCTORCH)
_coerce_cinterpreter = _function(
    lambda: _module("torch._functorch.pyfunctorch").coerce_cinterpreter, _FUNCTORCH
)


def functorch_level() -> int:
    """The level of the innermost active functorch transform (``vmap``, ``grad``, ``jvp``...),
    0 outside every transform. Levels count from 1 up to this one, one per active transform.

    Read from the interpreter stack, which Dynamo traces (it answers with a constant and
    guards on the stack); ``torch._C._functorch.maybe_current_level`` returns the same number
    but Dynamo cannot put an int-returning call in a graph.

    Example:
        >>> import torch
        >>> functorch_level()
        0
        >>> torch.func.grad(lambda x: x * functorch_level())(torch.ones(()))
        tensor(1.)
    """
    if not functorch_transforms_active():
        return 0
    level: int = _coerce_cinterpreter(_peek_interpreter_stack()).level()
    return level


# --------------------------------------------------------------------------------------
# memory: copy-on-write clones, aliasing, functional tensors
# --------------------------------------------------------------------------------------
#: ``aten._lazy_clone``: a copy-on-write clone (nothing copied until one side is written)
lazy_clone = _function(lambda: torch._lazy_clone, "copy-on-write clones (aten._lazy_clone)")
#: whether two tensors share memory (``torch._C._is_alias_of``)
is_alias_of: Callable[[Tensor, Tensor], bool] = _function(
    lambda: torch._C._is_alias_of,  # type: ignore[attr-defined]
    "alias tests (torch._C._is_alias_of)",
)
#: whether a tensor is a functionalization wrapper (made while ``torch.compile`` traces)
is_functional_tensor = _function(
    lambda: torch._is_functional_tensor, "functional tensor tests (torch._is_functional_tensor)"
)

_is_cow_tensor: Callable[[Tensor], bool] = _function(
    lambda: torch._C._is_cow_tensor,  # type: ignore[attr-defined]
    "copy-on-write tests (torch._C._is_cow_tensor)",
)
_dispatch_keys = torch._C._dispatch_keys
_PYTHON_KEY = torch._C.DispatchKey.Python


def is_cow(t: Tensor) -> bool:
    """Whether ``t``'s memory is a copy-on-write clone's (``torch._C._is_cow_tensor``).

    ``False`` for tensors with Python dispatch (``FakeTensor``, ``MemoryMappedTensor``...):
    they have no copy-on-write memory of their own, and torch >= 2.14 raises for them (non-strict
    ``torch.export`` runs eager readers on fake tensors). Torch's own guard code draws the same
    line (``DispatchKey.Python``); a plain ``torch.Tensor`` (not a subclass) never has it.
    """
    if type(t) is not Tensor and _dispatch_keys(t).has(_PYTHON_KEY):
        return False
    return _is_cow_tensor(t)


# --------------------------------------------------------------------------------------
# tensor subclasses and __torch_function__
# --------------------------------------------------------------------------------------
#: context manager: run torch functions without ``__torch_function__`` of subclasses
DisableTorchFunctionSubclass = _function(
    lambda: torch._C.DisableTorchFunctionSubclass,
    "disabling __torch_function__ (torch._C.DisableTorchFunctionSubclass)",
)
#: the C base class of ``torch.Tensor`` (owner of the C-implemented tensor methods)
TensorBase = _class(lambda: torch._C.TensorBase, "tensor method owners (torch._C.TensorBase)")
#: the type of ``torch.ops.aten.<name>`` (all overloads of one ATen op)
OpOverloadPacket = _class(
    lambda: torch._ops.OpOverloadPacket, "ATen op schemas (torch._ops.OpOverloadPacket)"
)
#: ``torch._ops.OpOverload``: one overload of an operator (its ``tags``: the pointwise lift)
OpOverload = _class(lambda: torch._ops.OpOverload, "ATen op tags (torch._ops.OpOverload)")
#: the schemas of every overload of an operator, by its qualified name (``"aten::add_"``)
operator_schemas = _function(
    lambda: torch._C._jit_get_schemas_for_operator,
    "operator schemas by name (torch._C._jit_get_schemas_for_operator)",
)
#: the C function behind ``torch.nn.utils.rnn.pad_sequence``: the torch function a container's
#: ``__torch_function__`` receives for ``pad_sequence([td, ...])``
pad_sequence_op = _function(
    lambda: torch._C._nn.pad_sequence, "pad_sequence of containers (torch._C._nn.pad_sequence)"
)
#: make a wrapper tensor subclass instance with the given metadata and no storage of its own
make_wrapper_subclass = _function(
    lambda: torch.Tensor._make_wrapper_subclass,
    "wrapper tensor subclasses (torch.Tensor._make_wrapper_subclass)",
)
#: view a tensor as an instance of a subclass of ``torch.Tensor`` (same memory and metadata)
make_subclass = _function(
    lambda: torch.Tensor._make_subclass,
    "tensor subclass views (torch.Tensor._make_subclass)",
)
#: whether an object is a traceable wrapper subclass (``__tensor_flatten__``: DTensor...)
if TYPE_CHECKING:  # the same function, with torch's TypeIs annotation
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
else:
    is_traceable_wrapper_subclass = _function(
        lambda: _module("torch.utils._python_dispatch").is_traceable_wrapper_subclass,
        "wrapper subclass tests (torch.utils._python_dispatch.is_traceable_wrapper_subclass)",
    )


# --------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------
#: base class of batch and instance norm modules (they write running statistics)
NormBase = _class(
    lambda: torch.nn.modules.batchnorm._NormBase,
    "norm statistics detection (torch.nn.modules.batchnorm._NormBase)",
)
#: context manager: a module's parameters and buffers swapped for given tensors (the form
#: Dynamo lets mutate a module inside higher-order ops)
if TYPE_CHECKING:  # the same function, with torch's annotations
    from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
else:
    reparametrize_module = _function(
        lambda: _module("torch.nn.utils.stateless")._reparametrize_module,
        "module reparametrization (torch.nn.utils.stateless._reparametrize_module)",
    )


# --------------------------------------------------------------------------------------
# data loading
# --------------------------------------------------------------------------------------
def register_default_collate(typ: type, fn: Callable[..., Any]) -> bool:
    """Make torch's ``default_collate`` (DataLoader) collate instances of ``typ`` with ``fn``
    (``torch.utils.data._utils.collate.default_collate_fn_map``). ``False`` when this torch
    has no such table: then ``default_collate`` refuses containers with its own ``TypeError``
    (nothing else is lost)."""
    try:
        from torch.utils.data._utils.collate import default_collate_fn_map
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    default_collate_fn_map[typ] = fn
    return True


# --------------------------------------------------------------------------------------
# custom ops
# --------------------------------------------------------------------------------------
def register_ordered_effect(op: Any) -> bool:
    """Give custom op ``op`` (a ``torch.library.custom_op``) an ordered side effect, so that
    compiled graphs keep every call, in program order, although its result is unused
    (``op.register_effect(torch.library.EffectType.ORDERED)``).

    ``False`` when this torch cannot: the op still runs eagerly, but a compiled graph may drop
    it (for ``tdfunc::refuse_write``: a write to a read-only ``MemoryMappedTensor`` inside
    ``torch.compile`` would no longer raise ``PermissionError``; the file is mapped privately,
    so it is never changed either way).
    """
    register = getattr(op, "register_effect", None)
    effect = getattr(getattr(torch.library, "EffectType", None), "ORDERED", None)
    if register is None or effect is None:
        return False
    register(effect)
    return True


# --------------------------------------------------------------------------------------
# control flow operators (lazy: imported on first call)
# --------------------------------------------------------------------------------------
def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # pragma: no cover - a parent package is missing
        return False


# torch imports torch._higher_order_ops itself (torch.cond): looking the modules up is free
_HAS_SCAN = _has_module("torch._higher_order_ops.scan")
_HAS_WHILE_LOOP = _has_module("torch._higher_order_ops.while_loop")


def torch_scan() -> Callable[..., Any]:
    """torch's scan operator (``torch._higher_order_ops.scan.scan``), imported on first call."""
    if not _HAS_SCAN:
        missing("tdfunc.scan (torch._higher_order_ops.scan)", _MIN)
    from torch._higher_order_ops.scan import scan

    return scan


def torch_while_loop() -> Callable[..., Any]:
    """torch's while_loop operator (``torch._higher_order_ops.while_loop.while_loop``),
    imported on first call."""
    if not _HAS_WHILE_LOOP:
        missing("tdfunc.while_loop (torch._higher_order_ops.while_loop)", _MIN)
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop


def functional_collectives() -> Any:
    """torch's traceable collectives (``torch.distributed._functional_collectives``: Dynamo
    puts ``all_gather_single``, ``reduce_scatter_single`` and ``all_reduce`` into the graph),
    imported on first call."""
    try:
        return _module("torch.distributed._functional_collectives")
    except ImportError:
        missing("traceable collectives (torch.distributed._functional_collectives)", _MIN)


def comptime(fn: Callable[[Any], None]) -> None:
    """Call ``fn(ctx)`` while Dynamo traces the caller, ``ctx`` being Dynamo's compile-time
    context (``torch._dynamo.comptime.comptime``); eagerly nothing. Imports ``torch._dynamo``:
    only for the traced twins (``tdfunc._twins``), which run once Dynamo is loaded."""
    try:
        from torch._dynamo.comptime import comptime as at_trace_time
    except ImportError:
        missing("compile-time callbacks (torch._dynamo.comptime)", _MIN)
    at_trace_time(fn)


def compiled_graphs() -> int:
    """How many graphs Dynamo has compiled in this process
    (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``); 0 while Dynamo is not
    loaded (only read around a call of ``tdfunc.compile``, which loads it)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["stats"]["unique_graphs"])
    except (AttributeError, KeyError, TypeError):
        missing("compile counts (torch._dynamo.utils.counters)", _MIN)


def maybe_mark_dynamic(t: Tensor, dim: int) -> None:
    """Tell Dynamo that dim ``dim`` of the input ``t`` varies between calls
    (``torch._dynamo.maybe_mark_dynamic``): its first compile is symbolic in that dim instead
    of specialising and compiling again at the second size; unlike ``mark_dynamic`` it never
    raises when the compile specialises the dim. Imports ``torch._dynamo``: only called by
    ``tdfunc.compile``'s boundary, which compiles anyway."""
    try:
        from torch._dynamo import maybe_mark_dynamic as mark
    except ImportError:
        missing("dynamic dims of compiled inputs (torch._dynamo.maybe_mark_dynamic)", _MIN)
    mark(t, dim)


class _TraceAutograd:
    """Sets ``torch._dynamo.config.trace_autograd_ops`` for the length of a ``with`` block and
    puts back what it was (cheaper than the config's own ``patch``: ~1 us a call)."""

    __slots__ = ("config", "prev")

    def __init__(self, config: Any) -> None:
        self.config = config
        self.prev = True

    def __enter__(self) -> None:
        self.prev = self.config.trace_autograd_ops
        if not self.prev:
            self.config.trace_autograd_ops = True

    def __exit__(self, *exc: object) -> None:
        if not self.prev:
            self.config.trace_autograd_ops = False


_DYNAMO_CONFIG: list[Any] = []  # torch._dynamo.config, checked once (boundary code only)


def trace_autograd() -> _TraceAutograd:
    """A context manager under which Dynamo traces ``torch.autograd.grad`` into the graph
    instead of refusing it (``torch._dynamo.config.trace_autograd_ops = True``), so a
    compiled step can take gradients with :func:`tdfunc.value_and_grad`; ``tdfunc.compile``
    runs every call under it. Imported on first call (the caller is about to run Dynamo)."""
    if not _DYNAMO_CONFIG:
        config = _module("torch._dynamo.config")
        if not hasattr(config, "trace_autograd_ops"):
            missing(
                "gradients inside a compiled step (torch._dynamo.config.trace_autograd_ops)", _MIN
            )
        _DYNAMO_CONFIG.append(config)
    return _TraceAutograd(_DYNAMO_CONFIG[0])


def autograd_traced() -> bool:
    """Whether Dynamo traces ``torch.autograd.grad`` now
    (``torch._dynamo.config.trace_autograd_ops``: set inside :func:`trace_autograd`); read
    while tracing, when ``torch._dynamo`` is loaded."""
    config = _module("torch._dynamo.config")
    return bool(getattr(config, "trace_autograd_ops", False))


def recompute_collectives() -> Any:
    """A context manager under which AOTAutograd's partitioner may recompute collectives
    in the backward instead of saving their outputs (``torch._functorch.config.patch(
    unsafe_allow_optimization_of_collectives=True, activation_memory_budget=0.5)``: the
    budget makes it weigh recomputation against memory). Read when a graph is compiled."""
    try:
        config = _module("torch._functorch.config")
        return config.patch(
            unsafe_allow_optimization_of_collectives=True, activation_memory_budget=0.5
        )
    except (ImportError, AttributeError, RuntimeError):
        missing("recomputing collectives (torch._functorch.config)", _MIN)


# --------------------------------------------------------------------------------------
# DTensor internals (lazy: importing torch.distributed.tensor takes about a second)
# --------------------------------------------------------------------------------------
#: lazily imported classes: name -> (module, attribute, feature)
_LAZY: dict[str, tuple[str, str, str]] = {
    # a DTensor's placements, mesh and tensor metadata: builds a DTensor without from_local
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec", "DTensor specs"),
    # shape, stride and dtype of a DTensor's global tensor (part of a DTensorSpec)
    "TensorMeta": ("torch.distributed.tensor._dtensor_spec", "TensorMeta", "DTensor specs"),
    # the placement torch uses for a shard of a shard (FSDP + TP): encoded in checkpoints
    "StridedShard": (
        "torch.distributed.tensor.placement_types",
        "_StridedShard",
        "strided-shard placements",
    ),
}

if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        """The lazily imported classes of ``_LAZY`` (cached in the module once loaded)."""
        entry = _LAZY.get(name)
        if entry is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module, attr, feature = entry
        value = _class(lambda: getattr(_module(module), attr), f"{feature} ({module}.{attr})")
        globals()[name] = value
        return value


__all__ = [
    "CHECKED",
    "MIN_TORCH",
    "TORCH_VERSION",
    "DTensorSpec",
    "DisableTorchFunctionSubclass",
    "NormBase",
    "OpOverload",
    "OpOverloadPacket",
    "StridedShard",
    "TensorBase",
    "TensorMeta",
    "add_batch_dim",
    "check",
    "compiled_graphs",
    "comptime",
    "foreach_add",
    "foreach_add_",
    "foreach_addcdiv_",
    "foreach_addcmul",
    "foreach_addcmul_",
    "foreach_div",
    "foreach_div_",
    "foreach_lerp",
    "foreach_maximum",
    "foreach_mul",
    "foreach_mul_",
    "foreach_neg",
    "foreach_norm",
    "foreach_sign",
    "foreach_sqrt",
    "foreach_sub",
    "functional_collectives",
    "functorch_level",
    "fused_adagrad_",
    "fused_adam_",
    "fused_adamw_",
    "fused_sgd_",
    "get_unwrapped",
    "is_alias_of",
    "is_batchedtensor",
    "is_cow",
    "is_functional_tensor",
    "is_functorch_wrapped_tensor",
    "is_traceable_wrapper_subclass",
    "lazy_clone",
    "make_subclass",
    "make_wrapper_subclass",
    "maybe_get_bdim",
    "maybe_get_level",
    "maybe_mark_dynamic",
    "missing",
    "operator_schemas",
    "pad_sequence_op",
    "pytree",
    "recompute_collectives",
    "register_default_collate",
    "register_ordered_effect",
    "reparametrize_module",
    "torch_scan",
    "torch_while_loop",
    "unary_foreach",
    "unwrap_batched",
    "unwrap_for_grad",
]
