"""Error message templates and exception types of :mod:`tdfunc.optim` (asserted in tests)."""

from __future__ import annotations

from .._errors import StructureError

#: ``init`` / ``update`` given something else than a TensorDict or tensorclass.
NOT_A_CONTAINER = (
    "{what} must be a TensorDict or a tensorclass instance, got {typ}; wrap tensors with "
    "tdfunc.TensorDict(...) or use tdfunc.from_module(module)"
)
#: A leaf that is not floating point (integer buffers, bool masks, complex).
NOT_FLOATING = (
    "{what}: the leaf at key {key} has dtype {dtype}; optimizers update floating-point leaves "
    "only. Leave it out (tdfunc.from_module(module, buffers=False), params.exclude(key)) or "
    "optimize the floating-point leaves only with "
    "tdfunc.optim.masked(opt, lambda path, leaf: leaf.is_floating_point())"
)
#: The grads (or updates) and params given to ``update`` / ``apply_updates`` differ.
GRADS_VS_PARAMS = "{what}: grads and params"
#: A state that was not made by this transformation's ``init``.
WRONG_STATE = (
    "{what}: this state was not made by {expected}'s init: expected the top-level key "
    "{expected!r}, got {got}. Pass the state returned by this optimizer's init (or by its "
    "previous update)"
)
#: The right transformation, but other options (e.g. amsgrad) or a hand-edited state.
STATE_KEYS = (
    "{what}: the state of {name!r} has the keys {got}, expected {expected}; it was made by an "
    "optimizer with other options (e.g. amsgrad, momentum, centered, tensor hyperparameters)"
)
#: A state built for another parameter structure.
STATE_PARAMS = (
    "{what}: the state entry {entry!r} was built for other params: missing keys {missing}, "
    "extra keys {extra}. Call init on these params"
)
#: Two key paths that give one leaf name (the state's buffers are keyed by these names).
NAME_COLLISION = (
    "{what}: the key paths {a} and {b} both give the leaf name {name!r}; the state keys its "
    "buffers by the key paths joined by '.': rename one of them"
)
#: A state built for parameters of other shapes (same keys).
STATE_SHAPE = (
    "{what}: the state entry {entry!r} has shape {got} at key {key}, but the grads there have "
    "shape {expected}. Call init on these params"
)
#: A state buffer's dtype differs from the grads' at one key (grads cast by hand, or a state
#: made from params of another dtype).
STATE_DTYPE = (
    "{what}: the state entry {entry!r} has dtype {got} at key {key}, but the grads there have "
    "dtype {expected}. Give grads of the params' dtype, or call init on params of that dtype"
)
#: The state's batch size differs from the params' (an ensemble state for a single model...).
STATE_BATCH = (
    "{what}: the state has batch_size {got} but the grads have batch_size {expected}; the state "
    "follows the batch dims of the params it was initialised with (one entry per member)"
)
#: A transformation that needs ``params`` was called without.
NEEDS_PARAMS = "{what} needs params: call update(grads, state, params)"
#: A tensor hyperparameter whose shape does not fit the params' batch size.
HYPER_SHAPE = (
    "{what}: the hyperparameter {name!r} has shape {shape}, which does not broadcast to the "
    "params' batch_size {batch_size} (one value per ensemble member, or one value for all)"
)
#: A hyperparameter out of range (the checks of torch.optim).
BAD_HYPER = "{what}: invalid {name} value: {value} ({rule})"
#: ``set_hyperparams`` with a name that is nowhere in the state.
NO_HYPER = (
    "set_hyperparams: no tensor hyperparameter named {name!r} in the state (found: {found}); "
    "only hyperparameters given as tensors when the optimizer was built are kept in the state. "
    "To change a scheduled rate at run time, give the optimizer a tensor lr and the schedule "
    "as a scale of its updates: chain(adamw(lr=torch.tensor(3e-4)), scale_by_schedule(...))"
)
#: ``multi_transform``: a leaf without a label, or a label without a transformation.
NO_LABEL = (
    "multi_transform: the leaf at key {key} got the label {label!r}, which is not one of the "
    "transformations {labels}"
)
#: ``masked`` / ``multi_transform``: a mask container that does not fit the params.
MASK_KEYS = (
    "{what}: the mask has no entry for the leaf at key {key}; give a mask with the params' keys, "
    "a key pattern or a callable (path, leaf) -> bool"
)
#: A mask entry that is not a boolean.
MASK_VALUE = "{what}: the mask entry at key {key} is {value!r}; mask entries must be booleans"
#: Something else than a GradientTransformation given where one is expected.
NOT_A_TRANSFORMATION = (
    "{what}: expected a GradientTransformation (e.g. tdfunc.optim.adam()), got {typ}"
)
#: ``sgd(nesterov=True)`` without momentum or with dampening.
NESTEROV = "sgd: nesterov momentum requires a momentum and zero dampening (as torch.optim.SGD)"
#: ``scale`` / ``scale_by_schedule`` given something else than a number, tensor or schedule.
BAD_SCALE = "{what}: expected {expected}, got {value!r}"
#: A mask of an unsupported kind.
BAD_MASK = (
    "{what}: a mask is a key pattern, a list of patterns, a callable (path, leaf) -> bool or a "
    "container of booleans; got {typ}"
)
#: ``multi_transform`` labels of an unsupported kind.
BAD_LABELS = (
    "multi_transform: labels must be a callable (path, leaf) -> name or a mapping "
    "{{pattern: name}}, got {typ}"
)
#: A schedule argument out of range.
BAD_SCHEDULE = "{what}: {detail}"


class OptimStateError(StructureError):
    """A state that does not belong to this optimizer or to these params.

    Raised by ``update`` when the state was made by another transformation, by the same one
    with other options, or for params of another structure, batch size or shapes. A
    :class:`tdfunc.StructureError` (a ``ValueError``).
    """


#: A key pattern of a mask that matches no leaf (a typo would switch the transformation off).
MASK_NO_MATCH = (
    "{what}: the key pattern {pattern!r} matches no leaf (nearest key: {nearest!r}); "
    "patterns are globs over the '.'-joined key paths, e.g. '*.bias'"
)
#: A label pattern of multi_transform whose every leaf an earlier pattern took (first match wins).
LABEL_SHADOWED = (
    "{what}: the key pattern {pattern!r} labels no leaf: every leaf it matches is taken by the "
    "earlier pattern {earlier!r} (the first matching pattern wins); put it before that one"
)
#: A mask that selects no leaf at all.
MASK_SELECTS_NOTHING = (
    "{what}: the mask selects no leaf (keys: {keys}); a mask that selects nothing switches the "
    "transformation off: drop it instead"
)
DONATED_TO_STEP = (
    "{arg} was donated to optim.step(..., donate=True): its buffers now hold the new "
    "{arg}; use the values it returned"
)
DONATE_TRACED = (
    "optim.step(..., donate=True) cannot run inside a compiled function (a traced function "
    "cannot consume its inputs): call optim.step without donate there, and donate the "
    "arguments of the whole function with tdfunc.compile(fn, donate=...)"
)
