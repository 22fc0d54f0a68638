"""Error types and message templates of the memory-mapped storage (kept here so tests can
assert on them)."""

from __future__ import annotations


class MemmapFormatError(ValueError):
    """A store on disk is not valid: corrupt or truncated manifest, unknown format version,
    a data file shorter than the manifest says, an unknown dtype or container type.

    It is a ``ValueError``; the message names the file at fault.

    Example:
        >>> import tdfunc
        >>> issubclass(tdfunc.MemmapFormatError, ValueError)
        True
    """


class StoreReplacedError(OSError):
    """The store (or file) a leaf or a load refers to was replaced by another version: a
    pickled leaf whose file is no longer the one its sender mapped, or a store that kept
    being replaced while ``load`` was opening it.

    Example:
        >>> import tdfunc
        >>> issubclass(tdfunc.StoreReplacedError, OSError)
        True
    """


class StoreCleanupWarning(UserWarning):
    """A save committed, but removing the previous version (or a stale temporary directory
    of a killed save) failed; the directory named in the message can be deleted by hand."""


READ_ONLY = (
    "cannot write to the memory-mapped file {filename!r} ({op}): it was opened read-only "
    "(mode='r'). Open it with mode='r+' to write to the file, or mode='c' to write to a "
    "private in-memory copy, or write to a copy made with .clone()"
)
NO_CONSTRUCTOR = (
    "MemoryMappedTensor cannot be built directly; use MemoryMappedTensor.from_tensor, "
    ".from_filename, .empty or .zeros (or tdfunc.load for a whole store)"
)
BAD_MODE = "mode must be 'r' (read-only), 'r+' (read-write) or 'c' (copy-on-write), got {mode!r}"
NOT_WRITABLE = (
    "cannot open {filename!r} with mode='r+': the file is not writable by this process "
    "({reason}). Use mode='r' to read it or mode='c' for a private writable copy"
)
NOT_READABLE = "cannot open {filename!r} for reading: {reason}"
NOT_A_FILE = "{filename!r} is not a regular file"
CANNOT_MAP = "cannot memory-map {filename!r}: {reason}"
PICKLE_FILE_GONE = (
    "cannot unpickle a memory-mapped leaf of {filename!r}: the file no longer exists (its "
    "store was replaced or deleted after the leaf was pickled). Load the store again"
)
PICKLE_FILE_REPLACED = (
    "cannot unpickle a memory-mapped leaf of {filename!r}: the file at that path is no longer "
    "the one the leaf was pickled from (it was replaced). Load the store again"
)
FILE_EXISTS = "{filename!r} already exists; pass exist_ok=True to replace it"
STORE_EXISTS = "{path!r} already exists; pass overwrite=True to replace it"
NOT_A_STORE_OVERWRITE = (
    "{path!r} exists and is not a tdfunc store (no {manifest}); refusing to replace it "
    "even with overwrite=True. Remove it yourself or choose another path"
)
LINK_NOT_A_STORE_OVERWRITE = (
    "{path!r} is a symbolic link to {target!r}, which is not a tdfunc store (no {manifest}) "
    "or does not exist; refusing to replace it even with overwrite=True. Point the link to a "
    "store, remove it yourself or choose another path"
)
FILE_TOO_SHORT = (
    "{filename!r} holds {size} bytes, but {need} bytes are needed for shape {shape} of dtype "
    "{dtype} at offset {offset}"
)
BAD_OFFSET = (
    "offset must be a non-negative multiple of {itemsize} (the size of {dtype}), got {offset}"
)
UNSUPPORTED_DTYPE = "dtype {dtype} cannot be memory-mapped{where}; supported dtypes: {supported}"
UNSUPPORTED_LEAF = (
    "key {key}: a {what} tensor cannot be memory-mapped; only strided (dense) tensors can be saved"
)
BAD_SHAPE = "shape must be a sequence of non-negative ints, got {shape!r}"
NOT_A_CONTAINER = "expected a TensorDict or a tensorclass instance, got {typ}"
UNREGISTERED_TYPE = (
    "{typ} is not registered as a pytree node with a serialized type name, so it cannot be saved"
)
STATIC_NOT_JSON = (
    "field {name!r} of {typ} holds a {vtyp}, which cannot be written to the JSON manifest; "
    "non-tensor fields may hold None, bool, int, float, str and tuples of these"
)
NO_MANIFEST = "{path!r} is not a tdfunc store: {manifest!r} is missing"
NOT_FOUND = "no tdfunc store at {path!r}"
CORRUPT_MANIFEST = "corrupt manifest {manifest!r}: {detail}"
DUPLICATE_KEY = "the key {key!r} is given twice in one JSON object"
UNKNOWN_VERSION = (
    "manifest {manifest!r} has format version {version!r}; this version of tdfunc reads "
    "versions {supported}. Upgrade tdfunc to load it"
)
DATA_TOO_SHORT = (
    "data file {filename!r} holds {size} bytes, but manifest {manifest!r} needs {need} bytes; "
    "the store is truncated or damaged"
)
DATA_MISSING = "data file {filename!r} named by manifest {manifest!r} is missing"
UNKNOWN_TYPE = (
    "manifest {manifest!r}: container type {name!r} at {where} is not registered in this "
    "process; import the module that defines that tensorclass before calling load()"
)
UNKNOWN_DTYPE = "manifest {manifest!r}: unknown or unsupported dtype {dtype!r} at key {key}"
PROGRESS_NEEDS_TQDM = "progress=True needs the optional dependency tqdm (pip install tqdm)"
NO_STORE_ACCESS = "cannot open the store directory {path!r}: {reason}"
STORE_BUSY = (
    "the store {path!r} was replaced {attempts} times while it was being opened; "
    "try again when the writers pause"
)
MEMBER_LINK = (
    "manifest {manifest!r} names {name!r}, which is a symbolic link or not a regular file; "
    "a store's files must be regular files inside the store directory"
)
CLEANUP_FAILED = (
    "the save to {path!r} committed, but the temporary directory {tmp!r} could not be "
    "removed ({reason}); delete it by hand"
)

NONTENSOR_NOT_JSON = (
    "key {key}: cannot save a non-tensor value of type {typ}: a store keeps str, numbers, "
    "bools, None and lists of them (as JSON) and never pickles; convert the value to one "
    "of those, or exclude the key before saving"
)

JAGGED_RAGGED_DIM = (
    "key {key}: a jagged leaf is saved with its ragged dim right after the batch dim (dim 1), "
    "got ragged dim {dim}; transpose it first"
)
JAGGED_UNSAVED = (
    "key {key}: cannot save a jagged leaf whose parts a load would refuse ({problem}); "
    "torch builds it without a check, but cannot read its rows either: rebuild it from its "
    "rows (torch.nested.nested_tensor(list(rows), layout=torch.jagged))"
)
JAGGED_LIKE = (
    "key {key}: memmap_like cannot preallocate a jagged leaf (its row lengths are data, not "
    "structure, and a loaded jagged leaf is a copy that writes would not reach); save the "
    "container with tdfunc.save, or exclude the key"
)

# write_at: explicit writes into a writable store ({what}: the call; {arg}: "value" or "batch")
WRITE_NOT_A_CONTAINER = (
    "write_at writes into a container loaded from a store, got {typ}; load the store with "
    "tdfunc.load(path, mode='r+') (or make one with tdfunc.memmap_like)"
)
WRITE_READ_ONLY = (
    "{what}: key {key} is the read-only memory-mapped file {filename!r} (mode='r'); "
    "load the store with tdfunc.load(path, mode='r+') to write into it"
)
WRITE_PRIVATE = (
    "{what}: key {key} is a copy-on-write mapping of {filename!r} (mode='c'): its writes "
    "never reach the file. Load the store with mode='r+' to write into the file"
)
WRITE_NOT_MAPPED = (
    "{what}: key {key} is an in-memory tensor, not a memory-mapped leaf of a store{why}, "
    "so a write would not reach any file. {what} writes into stores loaded with "
    "tdfunc.load(path, mode='r+'); an in-memory container is a value (td.at[index].set(value) "
    "returns a new one)"
)
WRITE_JAGGED = " (a jagged leaf is loaded into memory)"
WRITE_BAD_VALUE = (
    "write_at: value must be a container with the store's keys, or a number (written into "
    "every leaf), got {typ}"
)
WRITE_MISSING_KEY = "{what}: the {arg} has no key {key}, which the store has at {where}"
WRITE_EXTRA_KEY = "{what}: the {arg} has key {key}, which the store does not have"
WRITE_NOT_A_LEAF = (
    "{what}: key {key} is a {got} in the {arg} but a {want} in the store; the {arg} must "
    "have the store's structure"
)
WRITE_BATCH = (
    "write_at: the value has batch_size {got}, but index {index!r} selects batch shape "
    "{want} of the store (batch_size {batch})"
)
WRITE_SHAPE = (
    "{what}: key {key} has shape {got} in the {arg}, but the store's rows there need shape "
    "{want} (batch {batch} + the leaf's shape {feat})"
)
WRITE_DTYPE = (
    "{what}: key {key} has dtype {got} in the {arg}, which does not cast safely to the "
    "stored dtype {want}; cast it first ({arg}.apply(lambda x: x.to(...)))"
)
WRITE_NONTENSOR = (
    "{what}: key {key} is a non-tensor value, kept in the store's manifest: it cannot be "
    "written in place, and the {arg}'s differs from it. Save a new store instead"
)
