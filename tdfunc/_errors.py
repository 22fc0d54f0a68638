"""Error message templates and exception types of the core, kept in one place so tests can assert on them."""

MUTATION = "{cls} is immutable: {what} is not allowed. Use the functional form instead: {hint}."
MUTATION_STORE = (
    "{cls} is immutable: item assignment is not allowed. Its leaves are memory-mapped "
    "read-write (mode='r+', file {filename!r}): write into the file with {hint}"
)
MISSING_KEY = "key {key!r} not found in {cls} (available keys: {available})"
NOT_A_NODE = (
    "key {key!r} leads to a {kind}, not a nested container, so {rest!r} cannot be looked up"
)
LEAF_SHAPE = (
    "key {key}: leaf shape {shape} does not start with batch_size {batch_size}; "
    "every leaf must have the batch dims as its leading dims"
)
RUNTIME_BATCH_CHECK = (
    "{where}: the shape does not start with the batch size (a size known only when the "
    "compiled program runs, checked then)"
)
NESTED_SHAPE = "key {key}: nested batch_size {shape} does not start with batch_size {batch_size}"
BAD_VALUE = (
    "key {key}: cannot store a value of type {typ} in a {cls}; "
    "use a tensor, a number, a numpy array, a dict or a TensorDict/tensorclass"
)
BAD_KEY = "keys must be strings or tuples of strings, got {key!r} of type {typ}"
STRUCTURE = "{what}: structures differ: missing keys {missing}, extra keys {extra}"
STACK_SHAPE = "cannot {op} containers: element {index} has batch_size {got}, expected {expected}"
TOO_MANY_INDICES = (
    "too many indices for a container with batch_size {batch_size} ({batch_dims} batch dims): "
    "the index {index!r} uses {used} dims; only batch dims can be indexed"
)
BATCH_DIM_RANGE = "dim {dim} is out of range for batch_size {batch_size} ({batch_dims} batch dims)"
LEN_UNBATCHED = (
    "len() of a {cls} with batch_size=() is not defined (no batch dim, as for a 0-d tensor); "
    "use len(td.keys()) for the number of keys"
)
BOOL_AMBIGUOUS = (
    "the truth value of a {cls} is ambiguous; use .all() or .any(), which return 0-d bool tensors"
)
UNKNOWN_CONTAINER_TYPE = (
    "a pytree structure names a container type {name!r}, which is not registered in this "
    "process; import the module that defines it first"
)
BAD_CONTEXT = "a serialized pytree structure holds a malformed TensorDict/tensorclass context"
VMAP_DIM = (
    "torch.vmap maps dim {dim} of the leaf at key {key!r}, which is not a batch dim of its "
    "TensorDict/tensorclass ({batch_dims} batch dims): in_dims for a container must name one of "
    "its batch dims (0 to batch_dims - 1), or be None"
)
NOT_A_TENSOR = "{what}: key {key} produced {typ}, not a tensor"
STRUCTURE_TYPES = (
    "{what}: containers have the same keys but different node types or static fields: {a} vs {b}"
)
RENAME_EXISTS = (
    "rename_key: the target key {new} already exists; pass overwrite=True to replace its value, "
    "or exclude it first"
)
FIXED_FIELDS = (
    "{op}: {cls} has the fixed fields {fields}; a key op cannot add or remove a field "
    "(got {names}). Convert with .to_tensordict() first, or use .replace(...)"
)
FLATTEN_COLLISION = (
    "{what}: the key paths {a} and {b} both become {name!r} with sep={sep!r}; "
    "rename one of them or use another separator"
)


class StructureError(ValueError):
    """Two containers that must share a structure (keys, node types, static fields) do not."""


class KeysDifferError(StructureError, KeyError):
    """The key sets differ (also a ``KeyError``: a key is missing on one side)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NodeTypesDifferError(StructureError, TypeError):
    """Same keys, but the node types or static fields differ (also a ``TypeError``)."""


INPLACE = (
    "{cls}.{name} writes in place, and a {cls} is an immutable value: nothing writes into it. "
    "The pure spelling returns a new container; rebind the name: {hint}"
)
NO_ATTRIBUTE = "{cls!r} object has no attribute {name!r}"


class JaggedOpError(TypeError):
    """An operation that torch does not define on a jagged leaf (``torch.nested``,
    ``layout=torch.jagged``): the message names the key and the operation. A ``TypeError``.

    Example:
        >>> import tdfunc
        >>> issubclass(tdfunc.JaggedOpError, TypeError)
        True
    """


#: a container returned by ``torch.vmap`` over a jagged leaf's batch dim (``_tree``)
JAGGED_VMAP_OUT = (
    "key {key}: torch.vmap over the batch dim of a jagged (torch.nested) leaf returns its "
    "rows as a nested tensor of the strided layout, which has no sizes: a container cannot "
    "hold it; return each row reduced to one shape (a sum over the row...), or map another "
    "argument (in_dims=None for the container)"
)


class InPlaceError(TypeError, AttributeError):
    """An in-place name of tensordict's API (``zero_``, ``clamp_``, ``update_``, item
    assignment...) called on an immutable container; the message names the pure spelling.

    A ``TypeError`` (as every mutation of a container), and an ``AttributeError`` too, so
    ``hasattr(td, "zero_")`` is ``False``: a container has no in-place method.
    """


BATCH_SIZE_TYPE = (
    "batch_size must be an int or a sequence of ints, got {value!r} (an element of type {typ})"
)
BATCH_SIZE_NEGATIVE = "batch_size must not have negative sizes, got {value}"
BATCH_DIMS = "from_dict: batch_dims must be an int >= 0, got {value!r}"


# ---- tensorclass fields
FROZEN = (
    "{cls} is frozen: cannot {what} field {name!r}. Build a new instance instead: "
    "t.replace({name}=...) or dataclasses.replace(t, {name}=...)"
)
MISSING_FIELD = "{cls}() missing required field {name!r} (fields: {fields})"
UNKNOWN_FIELD = "{cls}{where} got an unknown field {name!r} (fields: {fields})"
TOO_MANY_POSITIONAL = (
    "{cls}() takes at most {n} positional field values {names}, but {got} were given; "
    "batch_size and device are keyword-only"
)
NOT_A_CHILD = (
    "{cls}: field {name!r} is annotated {ann} and needs {expected}, got a value of type {typ}"
)
NONE_NOT_ALLOWED = (
    "{cls}: field {name!r} is annotated {ann}, which does not allow None; "
    "annotate it `{ann} | None` to make it optional"
)
FIELD_SHAPE = (
    "{cls}: field {name!r} has shape {shape}, which does not start with batch_size "
    "{batch_size}; every tensor field must have the batch dims as its leading dims"
)
STATIC_GOT_TENSOR = (
    "{cls}: field {name!r} is static (annotated {ann}) but got a value of type {typ}; "
    "annotate it torch.Tensor, TensorDict or a tensorclass to make it part of the data"
)
STATIC_UNHASHABLE = (
    "{cls}: static field {name!r} needs a hashable value (static fields are part of the "
    "structure), got a value of type {typ}; use e.g. a tuple instead of a list"
)
RESERVED_NAME = "@tensorclass {cls}: field name {name!r} shadows {what}; rename the field"
MIXED_ANNOTATION = (
    "@tensorclass {cls}: field {name!r} is annotated {ann}, which mixes tensor/container types "
    "with other types; a field is either data (tensors, TensorDicts, tensorclasses, None) or "
    "static metadata"
)
UNRESOLVED_ANNOTATION = (
    "@tensorclass {cls}: cannot resolve the annotation {ann!r} of field {name!r} ({err}); "
    "define the type before the class or import it at module level"
)
NOT_A_SUBTREE = (
    "{cls}: field {name!r} holds a {typ}, not a nested container, so {rest!r} cannot be set"
)


# ---- control flow (cond / while_loop / scan)
#: A result whose structure differs from the expected one (``{what}`` names the function).
CONTROL_STRUCTURE = (
    "{what} returned a different structure than {expected_what}: missing keys: {missing}; "
    "extra keys: {extra}{detail}"
)
#: Operands / carries / xs holding something else than tensors, TensorDicts and tensorclasses.
NOT_TENSOR = (
    "{what}: every leaf must be a tensor (inside TensorDicts, tensorclasses, tuples, lists or "
    "dicts), got {typ} at {path}"
)
#: ``scan`` over a TensorDict / tensorclass along a dim that is not one of its batch dims.
SCAN_DIM = (
    "scan: xs holds a {cls} with batch_size {batch_size}; dim={dim} must be one of its batch "
    "dims (0 <= dim < {batch_dims})"
)
#: ``scan``'s combine_fn must return a pair.
SCAN_PAIR = "scan: combine_fn must return a pair (next_carry, y), got {typ}"
SCAN_UNROLL = "scan: unroll must be True or False, got {value!r}"
SCAN_LENGTH = (
    "scan(unroll=True): every leaf of xs must have the same size along dim {dim}: {first} has "
    "{n}, {path} has {m}"
)
SCAN_EMPTY = (
    "scan(unroll=True): xs has no slice along dim {dim} (size 0), so the structure of the "
    "outputs y is unknown"
)
SCAN_Y_STRUCTURE = (
    "scan(unroll=True): combine_fn returned a y of another structure at slice {i} than at the "
    "first slice: {detail}"
)
#: ``cond``: the branches returned different structures (found when running eagerly).
COND_BRANCHES = (
    "cond: true_fn and false_fn returned different structures: keys only in true_fn's output: "
    "{missing}; keys only in false_fn's output: {extra}{detail}"
)


# ---- export
#: ``dims`` names a dim that is not a batch dim of some container.
NOT_A_BATCH_DIM = (
    "dynamic_batch_shapes: dim {dim} is not a batch dim of the {cls} at {path} "
    "(batch_size {batch_size}); only batch dims can be marked"
)
# batch shape ops: the texts of torch's own reshape errors
RESHAPE_TWO_INFERRED = "only one dimension can be inferred"
RESHAPE_NEGATIVE = "invalid shape dimension {dim}"
RESHAPE_INVALID = "shape '{shape}' is invalid for input of size {numel}"
RESHAPE_AMBIGUOUS = (
    "cannot reshape tensor of {numel} elements into shape {shape} because the unspecified "
    "dimension size -1 can be any value and is ambiguous"
)
SHAPE_ARG_MISSING = "{op}() missing the shape / dims argument"
PERMUTE_COUNT = (
    "permute: number of dims don't match: the batch_size {batch_size} has {bd} dims, got {dims}"
)
PERMUTE_REPEATED = "permute: dims {dims} are not a permutation of the batch dims (repeated dim)"
FLATTEN_ORDER = "flatten() has invalid args: start_dim {start} cannot come after end_dim {end}"
EXPAND_FEWER = (
    "expand: the number of sizes provided ({shape}) must be greater or equal to the number of "
    "batch dims of batch_size {batch_size}"
)
NEEDS_A_BATCH_DIM = "{op} expects at least one batch dim (batch_size is ())"
# torch internals (tdfunc._compat)
TORCH_MISSING = (
    "{feature} is not available on torch {version}: it needs torch >= {minimum} "
    "(tdfunc is checked on torch {checked})"
)


# ---- donation (tdfunc.compile(donate=...))
DONATED = (
    "argument {arg} was donated to {what} (call {call}): its buffers now hold that call's "
    "outputs; use the values it returned"
)
COMPILE_MEMMAP_LEAVES = (
    "{what}: argument {arg} holds memory-mapped leaves (key {key}, e.g. from tdfunc.load); "
    "Dynamo guards on the leaf type, so the next call with the plain tensors this call returns "
    "compiles the function again. Pass a copy to the first call (.clone(): plain tensors, read "
    "once) to compile once"
)
DONATE_INDEX = "tdfunc.compile: donate takes argument positions (ints >= 0), got {value!r}"
DONATE_REPEATED = "tdfunc.compile: donate names an argument twice: {value}"
DONATE_MISSING = "{what}: argument {arg} is donated, but the call passed {n} positional arguments"
DONATE_NOT_CONTAINER = (
    "{what}: argument {arg} is donated but is a {typ}; donate TensorDicts or tensorclass "
    "instances (a container can be marked as consumed, a plain tensor cannot)"
)
DONATE_MEMMAP = (
    "{what}: {at} is memory-mapped (mode {mode!r}) and cannot be donated: the outputs would be "
    "written into its file; pass a copy (.clone()) or do not donate this argument"
)
DONATE_MEMMAP_PRIVATE = (
    "{what}: {at} is memory-mapped copy-on-write (mode 'c') and cannot be donated: its file "
    "would not change, but donating it saves nothing (the first write to each page copies it "
    "from the file: the memory and time of .clone()) and the outputs would stay memory-mapped "
    "leaves of the loaded store; pass a copy (.clone()) or do not donate this argument"
)
DONATE_REQUIRES_GRAD = (
    "{what}: {at} requires grad and cannot be donated (an in-place write into an autograd "
    "leaf); donate detached tensors"
)
DONATE_ALIAS = (
    "{what}: the donated leaves at {a} and {b} share memory; each donated buffer can hold "
    "one output only. Clone one of them or do not donate"
)
DONATE_ALSO_PASSED = (
    "{what}: the donated leaf at {a} shares memory with {b}, which is not donated: the "
    "function would read a buffer it overwrites. Pass a copy or donate neither"
)


# ---- ops over batch dims (_ops/_batchdim.py)
BATCHDIM_NEEDS_DIM = (
    "{op}: argument {arg!r} must name batch dims of the container (batch_size {batch_size}); "
    "got {value!r}. On a container every dim is a batch dim; for a whole-leaf op use "
    "td.apply(lambda x: torch.{op}(x, ...))"
)
BATCHDIM_ALIGN = (
    "{op}: the tensor argument {arg!r} has shape {shape}, but a tensor given with a container "
    "must have one dim per batch dim (batch_size {batch_size}); it is aligned with the batch "
    "dims and expanded over each leaf's feature dims"
)
PLAIN_OPERAND = (
    "{op}: a plain tensor of shape {shape} next to a container must broadcast to its "
    "batch_size {batch_size}: it is shaped like the batch (its dims line up with the last "
    "batch dims, each of size 1 or that dim's size) and is expanded over each leaf's feature "
    "dims. To broadcast it against every leaf as torch would, write it per leaf: "
    "td.apply(lambda x: {spelling})"
)
# tensordict's pad / pad_sequence (_ops/_pad.py)
PAD_SIZE = (
    "pad: pad_size {pad_size} must hold an even number of sizes, at most two per batch dim "
    "(batch_size {batch_size}): (dim0_before, dim0_after, dim1_before, dim1_after, ...), "
    "from the first batch dim on"
)
PAD_SEQUENCE_EMPTY = "pad_sequence: list_of_tensordicts is empty; give at least one container"
PAD_SEQUENCE_SIDE = "pad_sequence: padding_side must be 'left' or 'right', got {side!r}"
PAD_SEQUENCE_OUT = (
    "pad_sequence: out= writes into a given container, and containers are values: use the "
    "result (padded = tdfunc.pad_sequence(samples, ...))"
)
PAD_SEQUENCE_MASK_CLASS = (
    "pad_sequence: return_mask needs TensorDict inputs, got {cls} (a tensorclass has no field "
    "for the masks); convert them first (tdfunc.TensorDict(sample.to_dict(), "
    "batch_size=sample.batch_size))"
)
PAD_SEQUENCE_LEAF = "pad_sequence: key {key} holds a {typ}; pad_sequence pads tensor leaves only"
PAD_SEQUENCE_DIM = (
    "pad_sequence: pad_dim={pad_dim} is out of range for the entry {key} of shape {shape}"
)
PAD_SEQUENCE_SHAPES = (
    "pad_sequence: the entries {key} have shapes {shapes}, which differ in a dim other than "
    "pad_dim={pad_dim} (dim {dim} of each entry)"
)
PAD_SEQUENCE_VALUES = (
    "pad_sequence: padding_value names {missing}, which name no entry of the containers "
    "(their entries: {keys})"
)
PAD_SEQUENCE_SPLIT_DIM = (
    "pad_sequence: pad_dim={pad_dim} counts from the last dim of each entry and lands on "
    "batch dims {dims} of some entries{feature}, so the batch cannot be padded along it, but "
    "the entry {key} is longer than the batch of the first sample along dim {dim}"
)
BATCHDIM_MASK = (
    "{op}: the mask has shape {shape}, but it must have the container's batch_size "
    "{batch_size} (it selects batch entries, as td[mask])"
)
BATCHDIM_MASK_DTYPE = "{op}: the mask must be a bool tensor (as in torch), got {dtype}"
BATCHDIM_SIZES = (
    "{op}: {sizes} has {n} entries, but the container has {bd} batch dims (batch_size "
    "{batch_size}); the sizes name batch dims only"
)
BATCHDIM_PAD = (
    "{op}: {what}; on a container pad takes (left, right) pairs for the last batch dims "
    "(batch_size {batch_size}) in mode 'constant'"
)
BATCHDIM_SELF = (
    "{op}: the container must be the input (first argument), got {typ}; use "
    "td.apply(...) to call it with the leaves elsewhere"
)
BATCHDIM_NO_OVERLOAD = (
    "{op}: no overload of torch.{op} takes these arguments ({args}); see torch's signature "
    "of {op}, whose dims name the container's batch dims"
)

# value_and_grad (_grad.py)
GRAD_ARGNUMS = (
    "value_and_grad: argnums must be an int or a sequence of distinct ints, got {value!r}"
)
GRAD_ARGNUM_RANGE = (
    "value_and_grad: argnums names argument {index}, but the function was called with {n} "
    "positional arguments"
)
GRAD_LEAF = (
    "value_and_grad: argument {arg} at {path} is {kind}, but every leaf of a differentiated "
    "argument must be a floating-point tensor; pass other values as another argument"
)
GRAD_VALUE = (
    "value_and_grad: the function must return a scalar tensor (or (scalar, aux) with "
    "has_aux=True), got {what}"
)

# tdfunc.compile's log lines (_donate.py; logger "tdfunc.compile")
COMPILE_RECOMPILED = (
    "{what}: call {call} compiled again ({graphs} new graph(s), {seconds:.1f} s): a guard of "
    "an earlier compile failed (a new shape, dtype, structure or Python value); run with "
    "TORCH_LOGS=recompiles to see which guard, or TORCH_LOGS=recompiles_verbose for all"
)
COMPILE_SLOW = (
    "{what}: the first call took {seconds:.1f} s to compile ({graphs} graph(s)); later "
    "processes skip most of it with torch's compile caches (on by default, in "
    "TORCHINDUCTOR_CACHE_DIR: keep that directory between runs; see the training-loop "
    "guide); TORCH_LOGS=dynamo,aot,inductor shows where the time goes"
)

# lifted torch functions (_ops/_lift.py, _ops/_pointwise.py)
LIFT_NOT_LIFTABLE = (
    "{op} does not lift to containers: {reason}. Call it on each leaf with "
    "td.apply(lambda x: {op}(x, ...)), or td.apply(f, other) over several containers"
)
LIFT_REASON_UNKNOWN = (
    "it is neither pointwise (no torch.Tag.pointwise on its ATen overloads) nor an op over "
    "batch dims, so it may mix a leaf's feature dims"
)
LIFT_REASON_INPLACE = "it writes into its input (containers are values: use the out-of-place op)"
LIFT_REASON_OUT = "out= writes into a given tensor (containers are values: use the result)"
