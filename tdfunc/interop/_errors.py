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
NOT_A_CONTAINER = "save_safetensors expects a TensorDict or tensorclass, got {typ}"
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
FIELD_MISMATCH = (
    "{what}: {cls} has fields {fields}, but the source has keys {keys}; the field sets must match"
)
