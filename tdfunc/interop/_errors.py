"""Error types and message templates of ``tdfunc.interop`` (kept here so tests can assert on
them). Every message about a file names the file."""

from __future__ import annotations


class SafetensorsFormatError(ValueError):
    """A safetensors file is not valid: truncated, a corrupt header, offsets outside the data,
    or a tdfunc structure header that does not fit the tensors (or comes from a newer format
    version). It is a ``ValueError``; the message names the file at fault.

    Example:
        >>> import tdfunc
        >>> issubclass(tdfunc.SafetensorsFormatError, ValueError)
        True
    """


# ---------------------------------------------------------------------------- safetensors
NOT_A_CONTAINER = (
    "save_safetensors expects a TensorDict, a tensorclass or a mapping of names to tensors "
    "(e.g. tdfunc.state_dict(module, params)), got {typ}"
)
FROM_TENSORDICT = (
    "save_safetensors expects a tdfunc container or a mapping of names to tensors, got a "
    "{typ} of the tensordict package; convert it first: tdfunc.from_tensordict(obj) (keeps "
    "its batch size and nesting)"
)
MAPPING_KEY = (
    "save_safetensors: the mapping's key {key!r} is a {typ}; the names of a safetensors file "
    "are strings"
)
MAPPING_VALUE = (
    "save_safetensors: the mapping's entry {key!r} is a {typ}, not a tensor; a mapping saves "
    "names to tensors, one level deep (save a TensorDict for nested data)"
)
FILE_EXISTS = (
    "{filename!r} already exists; pass overwrite=True to replace it (the new file is written "
    "aside and renamed over the old one, so readers see either the old or the new file)"
)
KEY_COLLISION = (
    "cannot save to {filename!r}: keys {a} and {b} both become the safetensors name {name!r} "
    "(nested keys are joined by '.'); rename one of them (e.g. td.rename_key({b}, ...))"
)
UNSUPPORTED_DTYPE = (
    "cannot save key {key} to {filename!r}: dtype {dtype} has no safetensors type "
    "(supported: {supported}); convert the leaf first (e.g. .to(torch.float32))"
)
UNSUPPORTED_LEAF = (
    "cannot save key {key} to {filename!r}: a {what} tensor has no raw bytes to store"
)
NOT_SAVABLE_CHILD = "cannot save key {key} to {filename!r}: a child of type {typ} is not a tensor"
STATIC_NOT_JSON = (
    "cannot save the static field {name!r} of {cls} (key {key}) to {filename!r}: a {vtyp} is "
    "not JSON data (None, bool, int, float, str or tuples of them)"
)
BAD_METADATA = (
    "save_safetensors(metadata=...): safetensors metadata maps strings to strings, got "
    "{key!r}: {typ}"
)
RESERVED_METADATA = (
    "save_safetensors(metadata=...): the key {key!r} is reserved for the structure that tdfunc "
    "writes; use another key"
)
TRUNCATED = "{filename!r} is truncated: {detail}"
CORRUPT_HEADER = "{filename!r} is not a valid safetensors file: {detail}"
CORRUPT_STRUCTURE = (
    "{filename!r}: the tdfunc structure in its metadata does not fit the file ({detail}); "
    "load the tensors without it with tdfunc.load_safetensors(path, structure='nested')"
)
NEWER_VERSION = (
    "{filename!r} was written by a newer tdfunc (structure format version {version}, this "
    "version reads up to {supported}); upgrade tdfunc, or load the flat tensors with "
    "tdfunc.load_safetensors(path, structure='nested')"
)
UNKNOWN_DTYPE = (
    "cannot load {key!r} from {filename!r}: safetensors dtype {dtype!r} is not supported by "
    "tdfunc (supported: {supported})"
)
# what a header may not do (the ``detail`` of CORRUPT_HEADER); each is refused by the
# ``safetensors`` reference reader too, except HEADER_DUPLICATE (see the reader's notes)
HEADER_NOT_UTF8 = "the header is not UTF-8 text ({reason})"
HEADER_BOM = "the header starts with a byte order mark (U+FEFF); headers are UTF-8 JSON without one"
HEADER_NOT_JSON = "{what} is not JSON ({reason})"
HEADER_TOO_DEEP = "{what} nests objects and arrays deeper than {limit} levels"
HEADER_DUPLICATE = (
    "the name {name!r} appears twice in one object of {what} (readers disagree on which one counts)"
)
HEADER_SURROGATE = "{what} holds a string with an unpaired surrogate escape ({text!r})"
HEADER_NUMBER = "{what} holds a number out of range ({text})"
HEADER_NOT_OBJECT = "the header is not a JSON object"
HEADER_METADATA = "__metadata__ is not a mapping of strings to strings"
ENTRY_NOT_OBJECT = "the entry of tensor {name!r} is not an object"
ENTRY_MISSING = "the entry of tensor {name!r} has no {field!r}"
ENTRY_BAD_DTYPE = "tensor {name!r} has dtype {dtype!r}, which is not a safetensors dtype"
ENTRY_BAD_SHAPE = (
    "tensor {name!r} has a bad shape {shape!r} (a list of integers in [0, 2**64) expected)"
)
ENTRY_BAD_OFFSETS = (
    "tensor {name!r} has bad data_offsets {offsets!r} (two integers in [0, 2**64) expected)"
)
ENTRY_NOT_CONTIGUOUS = (
    "tensor {name!r} has data_offsets {offsets}, but the tensors sorted by offset must cover "
    "the data without holes or overlaps: it must begin at byte {start} of the data"
)
ENTRY_OVERFLOW = "tensor {name!r}: shape {shape} of {dtype} overflows a 64-bit byte count"
ENTRY_PARTIAL_BYTE = "tensor {name!r}: shape {shape} of {dtype} does not fill whole bytes"
ENTRY_SIZE = (
    "tensor {name!r}: data_offsets {offsets} hold {have} bytes, but shape {shape} of {dtype} "
    "needs {need}"
)
ENTRY_F4_SHAPE = (
    "tensor {name!r}: an F4 tensor maps to torch.float4_e2m1fn_x2 (two values a byte), so its "
    "last dim must be even; got shape {shape}"
)
ENTRY_TORCH_SHAPE = "tensor {name!r}: torch cannot hold shape {shape} ({reason})"
DATA_TRAILING = (
    "the tensors cover {covered} bytes of data but {size} bytes follow the header (trailing bytes)"
)
# tdfunc's structure entry, checked against the tensor table (the ``detail`` of
# CORRUPT_STRUCTURE)
STRUCT_NO_TENSOR = "key {key} names no tensor of the file ({name!r})"
STRUCT_WRONG_NAME = (
    "key {key} names the tensor {name!r}, but a leaf's tensor is named by its key path "
    "joined by '.' ({expected!r}): leaf names swapped or keys renamed"
)
STRUCT_NAMED_TWICE = "the tensor {name!r} is named by two keys (the second is {key})"
STRUCT_BAD_TYPE = "node {where} has the type {name!r}, which is not a type name"
STRUCT_UNUSED = "tensors {names} are not part of the structure"
STRUCT_BAD_TIE = "key {key} is tied to {tie!r}, which is no earlier tensor of the structure"
STRUCT_TIE_DIFFERS = (
    "keys {a} and {b} are one tied tensor, but its two copies in the file ({na!r} and {nb!r}) "
    "differ in {what}; the file was changed after it was written. Load it with "
    "structure='nested' to read each name's own copy"
)
TIED_WRITABLE = (
    "cannot load {filename!r} with mode='r+': keys {a} and {b} are one tied tensor stored as "
    "two copies ({na!r}, {nb!r}), and a write through one name would not reach the other; "
    "load it with mode='r' or 'c' (one tensor under both keys), or save the container with "
    "the tie broken (e.g. td.set({b}, td[{b}].clone()))"
)
# saving: names that would not load back
RESERVED_NAME = (
    "cannot save key {key} to {filename!r}: the safetensors name {name!r} is reserved for the "
    "format's metadata; rename the key"
)
INVALID_TEXT = (
    "cannot save {what} {text!r} to {filename!r}: it is not valid Unicode (an unpaired "
    "surrogate), which safetensors readers refuse; use valid text"
)
HEADER_TOO_LARGE = (
    "cannot save to {filename!r}: the header would take {size} bytes, more than the {limit} "
    "that safetensors readers accept (too many keys or too much metadata)"
)
ZERO_DIM_F4 = (
    "cannot save key {key} to {filename!r}: a 0-dim torch.float4_e2m1fn_x2 tensor has no "
    "safetensors shape (F4 shapes count single values); reshape it to (1,)"
)
UNKNOWN_TYPE = (
    "cannot load {filename!r}: its node {where} is a {name!r}, which is not a TensorDict or a "
    "tensorclass defined in this process; import the module that defines it before loading, "
    "or pass structure='nested' to load nested TensorDicts"
)
NAME_CONFLICT = (
    "cannot load {filename!r} as nested TensorDicts: {a!r} is a tensor but {b!r} needs it to "
    "be a nested level; load the flat names with tdfunc.load_safetensors(path, structure='flat')"
)
BAD_STRUCTURE_ARG = (
    "load_safetensors(structure=...) must be 'auto', 'nested' or 'flat', got {value!r}"
)

# ---------------------------------------------------------------------------- tensordict
NEED_TENSORDICT = (
    "this conversion needs the 'tensordict' package: pip install tensordict "
    "(or the tdfunc[tensordict] extra)"
)
NOT_A_TENSORDICT_INPUT = (
    "from_tensordict expects a tensordict.TensorDict or a tensordict @tensorclass instance, "
    "got {typ}"
)
NOT_A_TDFUNC_INPUT = "to_tensordict expects a tdfunc TensorDict or tensorclass, got {typ}"
NOT_A_TENSORCLASS = "{what}: {cls!r} is not a {kind} @tensorclass type"
NON_TENSOR_VALUE = (
    "from_tensordict: key {key} holds a non-tensor value ({typ}); tdfunc TensorDicts hold only "
    "tensors and containers. Give a target tensorclass with a static field of that name, or "
    "exclude the key first (td.exclude({key}))"
)
LAZY_STACK_KEYS = (
    "from_tensordict: the members of the lazy stack at {where} do not have the same keys: "
    "key {key} is in {have} of {total} members; tdfunc containers hold dense values, and "
    "tensordict would drop the key. Give every member the key, or exclude it first"
)
LAZY_STACK_VALUES = (
    "from_tensordict: the members of the lazy stack at {where} hold {what} under key {key}; "
    "they cannot be stacked into one dense tensor. Make them agree (e.g. pad them), or "
    "exclude the key first"
)
CANNOT_READ = "from_tensordict: reading key {key} failed in tensordict: {reason}"
FIELD_MISMATCH = (
    "{what}: {cls} has fields {fields}, but the source has keys {keys}; the field sets must match"
)

NONTENSOR_NOT_JSON = (
    "cannot save key {key} to {filename!r}: a non-tensor value of type {typ} is not JSON data "
    "(str, numbers, bools, None and lists of them; nothing is pickled)"
)
JAGGED_UNSAVED = (
    "cannot save key {key} to {filename!r}: a jagged leaf whose parts a load would refuse "
    "({problem}); torch builds it without a check, but cannot read its rows either: rebuild "
    "it from its rows (torch.nested.nested_tensor(list(rows), layout=torch.jagged))"
)
JAGGED_RAGGED_DIM = (
    "cannot save key {key} to {filename!r}: a jagged leaf is saved with its ragged dim at "
    "dim 1, got {dim}"
)
