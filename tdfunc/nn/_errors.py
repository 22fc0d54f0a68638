"""Error message templates of ``tdfunc.nn``, kept in one place so tests can assert on them."""

#: ``functional_call``: a meta slot filled through a declared tie by a tensor of another shape.
SHAPE_MISMATCH = (
    "functional_call: key {key!r} has shape {got} but the module's tensor has shape {expected}; "
    "it is filled through a tie the module declares, from the tensor given for the other name "
    "of the tie, so both names must have one shape"
)
#: ``functional_call``: a parameter of the module given with another shape than its own.
PARAM_SHAPE = (
    "functional_call: key {key!r} is a parameter of shape {expected} in the module, but the "
    "state gives a tensor of shape {got}; give it the parameter's shape (buffers may change "
    "shape, as observers' statistics do, parameters may not), and call a state stacked over "
    "modules through torch.vmap, one module per call"
)
#: ``functional_call``: every tensor of the state is the module's shape with one leading dim.
STACKED_STATE = (
    "functional_call: every tensor of the state has a leading dim of size {n} over the shape "
    "of the module's own tensor (key {key!r}: shape {got} for the module's {expected}): a state "
    "stacked over {n} modules (as tdfunc.stack_modules makes) is called through torch.vmap, one "
    "module per call, e.g. torch.vmap(lambda s, x: tdfunc.functional_call(module, s, (x,)), "
    "in_dims=(0, None))(state, x); a state whose shapes differ from the module's for another "
    "reason (buffers that grow, as observers' statistics do) is used as it is"
)
#: ``functional_call(strict=True)``: keys that name no parameter or buffer of the module.
UNKNOWN_KEYS = (
    "functional_call(strict=True): keys {keys} are not parameters or buffers of {module} "
    "(known names: {known})"
)
#: ``functional_call(strict=True)``: module tensors the parameter TensorDict does not provide.
MISSING_KEYS = (
    "functional_call(strict=True): keys {keys} of {module} are missing from the parameters; "
    "pass strict=False to use the module's own tensors for them"
)
#: ``functional_call``: parameters of an unsupported kind.
BAD_PARAMS = (
    "functional_call: params must be a TensorDict, a tensorclass, a (nested) mapping of tensors "
    "or a tuple of those, got {typ}"
)
#: ``functional_call``: the same name given twice (tuple of parameter containers).
DUPLICATE_KEY = "functional_call: key {key!r} is given by more than one parameter container"
#: ``stack_modules``: nothing to stack.
STACK_EMPTY = "stack_modules needs at least one module, got an empty sequence"
#: ``stack_modules``: two modules do not have the same parameter names.
STACK_KEYS = (
    "stack_modules: module {index} differs from module 0 in its parameters/buffers: "
    "first differing key {key!r} (module 0 has {expected}, module {index} has {got})"
)
#: ``stack_modules``: two modules have a tensor of different shape or dtype under one name.
STACK_SHAPE = (
    "stack_modules: module {index} differs from module 0 at key {key!r}: {what} {got} != {expected}"
)


#: ``functional_call(return_state=False)``: the module wrote one of the given tensors.
STATE_WRITTEN = (
    "functional_call: module {module} ({cls}) writes the {kind} {name!r} (key {key!r}) while it "
    "runs, but the given state is never modified and return_state=False would lose the new "
    "value; pass return_state=True to get (output, new_state), put the module in eval mode "
    "(module.eval(): batch norm then stops updating its running statistics), or leave {key!r} "
    "out of the state so that the module updates its own tensor"
)
#: ``functional_call(return_state=False)``: the module created a parameter or buffer.
STATE_CREATED = (
    "functional_call: module {cls} creates the parameter or buffer {key!r} while it runs (it was "
    "absent or None before), but the module is left as it was and return_state=False would "
    "lose it; pass return_state=True to get it in new_state"
)
#: ``functional_call(return_state=True)``: a created tensor has no place in the given state.
STATE_NO_ROOM = (
    "functional_call: the module created {key!r} while it ran, but a state of type {typ} cannot "
    "hold a new key; pass the state as a TensorDict or a mapping"
)
#: ``functional_call(tie_weights=True)``: two different tensors for the names of one tensor.
TIED_TWICE = (
    "functional_call: key {key!r} names the same module tensor as {first!r} (tied weights), but "
    "the state gives another tensor for it; give one tensor per tie (tdfunc.from_module keeps "
    "one leaf per tied tensor) or pass tie_weights=False"
)
#: ``functional_call``: module tensors on the meta device (no values) the state does not give.
META_MISSING = (
    "functional_call: keys {keys} of {module} hold meta tensors (shapes, no values) and the "
    "state does not give them, so the call would compute with no values; give them in the "
    "state, or, for tied weights, tie them again in the module after .to('meta') (e.g. "
    "transformers' model.tie_weights()) or declare the tie (transformers' "
    "_tied_weights_keys) so that the tensor given for the tied name fills them"
)
