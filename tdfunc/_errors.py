"""Error message templates and exception types of the core, kept in one place so tests can assert on them."""

MUTATION = "{cls} is immutable: {what} is not allowed. Use the functional form instead: {hint}."
MISSING_KEY = "key {key!r} not found in {cls} (available keys: {available})"
NOT_A_NODE = (
    "key {key!r} leads to a {kind}, not a nested container, so {rest!r} cannot be looked up"
)
LEAF_SHAPE = (
    "key {key}: leaf shape {shape} does not start with batch_size {batch_size}; "
    "every leaf must have the batch dims as its leading dims"
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
BOOL_AMBIGUOUS = (
    "the truth value of a {cls} is ambiguous; use .all() or .any(), which return 0-d bool tensors"
)
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
    "flatten_keys: the key paths {a} and {b} both become {name!r} with sep={sep!r}; "
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


BATCH_SIZE_TYPE = (
    "batch_size must be an int or a sequence of ints, got {value!r} (an element of type {typ})"
)
BATCH_SIZE_NEGATIVE = "batch_size must not have negative sizes, got {value}"
BATCH_DIMS = "from_dict: batch_dims must be an int >= 0, got {value!r}"
