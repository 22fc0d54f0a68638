"""Error message templates of :mod:`tdfunc.distributed`, kept in one place for the tests."""

PLACEMENTS_LENGTH = (
    "key {key}: {n} placement(s) {placements} given for a DeviceMesh with {ndim} dim(s) "
    "(mesh shape {mesh_shape}); give exactly one placement per mesh dim"
)
PLACEMENT_TYPE = (
    "key {key}: {value!r} of type {typ} is not a Placement; use Shard(dim), Replicate() or "
    "Partial(reduce_op)"
)
PLACEMENTS_SPEC = (
    "placements must be a sequence of Placement, a mapping from key paths to such sequences, "
    "or a callable (key_path, leaf) -> sequence; got {typ}"
)
SHARD_DIM = (
    "key {key}: Shard({dim}) on mesh dim {mesh_dim} is out of range for a leaf with shape "
    "{shape} ({ndim} dims); shard a dim in [-{ndim}, {ndim})"
)
UNKNOWN_PLACEMENT_KEY = (
    "placements name key {key}, which is not a leaf or a nested container of this {cls} "
    "(leaves: {available})"
)
MIXED_MESH = (
    "key {key} lives on {mesh} but key {first_key} lives on {first_mesh}; every DTensor leaf "
    "of one container must share one DeviceMesh (split the container by mesh first)"
)
NOT_DTENSOR = "key {key}: {op} needs DTensor leaves, got a {typ}; distribute the container first"
ALREADY_DTENSOR = (
    "key {key}: the leaf is already a DTensor; use redistribute() to change its placements"
)
NOT_IN_MESH = "rank {rank} is not part of {mesh}; only the mesh's ranks may call {op}"
SRC_NOT_IN_MESH = "src_data_rank {src} is not part of {mesh}"
NOT_A_CONTAINER = "{op} expects a TensorDict or a tensorclass, got {typ}"
LOCAL_SHAPE = (
    "key {key}: local shard of shape {local} does not fit the global shape {shape} under "
    "placements {placements} on mesh shape {mesh_shape} (expected local shape {expected})"
)
BAD_PLACEMENT_JSON = "cannot decode placement {obj!r}: expected a dict with a known 'type'"
UNENCODABLE_PLACEMENT = (
    "key {key}: placement {placement!r} of type {typ} has no structured encoding; "
    "only Shard, Replicate and Partial travel"
)
BAD_STRATEGY = "strategy must be 'auto', 'plan', 'local' or 'full', got {strategy!r}"
MESH_MISMATCH = (
    "sender rank {src} (coordinate {src_coord} in a mesh of shape {src_shape}) and receiver "
    "rank {dst} (coordinate {dst_coord} in a mesh of shape {dst_shape}) do not fit: "
    "strategy 'local' needs a receiving mesh of the same shape and the peer at the same "
    "coordinate; use strategy='full' or pair the ranks position by position"
)
NO_RECV_MESH = (
    "sender rank {src} sends DTensor shards with strategy 'local' but receiver rank {dst} "
    "gave no mesh; pass recv(..., mesh=...) on the receiving ranks"
)
RECV_NOT_IN_MESH = (
    "receiver rank {dst} is not part of the mesh given to recv(); sender rank {src} cannot "
    "deliver to it"
)
RECV_PLACEMENTS_NO_MESH = (
    "receiver rank {dst}: recv(placements=...) needs mesh=... to place the leaves on"
)
RECV_PLACEMENTS_LENGTH = (
    "receiver rank {dst}: {n} placement(s) given for a receiving mesh with {ndim} dim(s)"
)
SENDER_FAILED = "sender rank {src} rejected the transfer: {reason}"
RECEIVER_FAILED = "receiver rank {dst} rejected the transfer: {reason}"
BAD_HEADER = (
    "rank {dst} received a header from rank {src} that is not a tdfunc transfer "
    "(magic {magic}, version {version}); both sides must call tdfunc.distributed send/recv"
)
UNKNOWN_NODE_TYPE = (
    "received a container of type {name!r}, which is not registered in this process; "
    "import the module defining it before calling recv()"
)
MESH_TOO_LARGE = "meshes with more than {max} dims cannot be sent (got {ndim})"


class SpecFormatError(ValueError):
    """A container structure read from a file or a peer (pytree spec JSON) is malformed or
    holds a node kind tdfunc does not read back."""


class TransferMetadataError(ValueError):
    """What a peer of a transfer sent (a header, the JSON metadata of ``send`` / ``recv``, a
    layout, answer or verdict of a planned transfer's handshake) does not follow the transfer
    format; the message names the field at fault. Raised before anything is built from it."""


#: ``field``: where in the message (``leaves[2].shape``); ``detail``: what is wrong with it
TRANSFER_META = "{what} from rank {peer}: field {field}: {detail}"
TRANSFER_SIZE = (
    "{what} from rank {peer}: field {field}: {size} bytes announced, more than this "
    "device can hold ({limit} bytes); refusing to allocate"
)


class PlacementFormatError(ValueError):
    """An encoded placement (JSON from a file or a peer) is not one ``encode_placement``
    writes: an unknown type, a missing or extra field, a dim that is not an int >= 0, a
    ``reduce_op`` that is not one of torch's."""


BAD_REDUCE_OP = (
    "cannot decode placement {obj!r}: reduce_op {op!r} is not one of torch's reduce ops ({ops})"
)
BAD_PLACEMENTS_JSON = "cannot decode placements {obj!r}: expected a list of encoded placements"
BAD_PLACEMENT_FIELD = "cannot decode placement {obj!r}: field {field!r} {detail}"


SPEC_NODE_KIND = (
    "a container structure holds a node of kind {name!r}; only TensorDict and tensorclass "
    "nodes and tensor leaves are read back (nothing the data names is imported or looked up)"
)
SPEC_BAD = "a container structure is malformed: {detail}"
JSON_DUPLICATE_KEY = "the key {key!r} is given twice in one JSON object"

# --------------------------------------------------------------------------------------
# transfer plans (strategy "plan", Transfer, transfer_plan)
# --------------------------------------------------------------------------------------
BAD_GRID_TYPE = (
    "a mesh must be a DeviceMesh or its rank array (nested lists or an integer tensor of "
    "global ranks), got {typ}"
)
BAD_GRID = "a mesh's rank array must be non-empty with distinct ranks >= 0, got {ranks}"
PLAN_PLACEMENT = (
    "key {key}: placement {placement!r} cannot be planned; a transfer plan moves Shard, "
    "Replicate and Partial with reduce op in {ops}"
)
PLAN_SHAPES = (
    "shapes must be a mapping from key paths to shapes, a sequence of shapes, or a "
    "TensorDict / tensorclass, got {typ}"
)
PLAN_DTYPES = "{n} dtype(s) given for {leaves} leaves"
PLAN_NO_DTENSOR = (
    "{op}: a planned transfer needs DTensor leaves (their mesh is the sending mesh); "
    "distribute the container first"
)
PLAN_NOT_IN = (
    "rank {rank} is in neither mesh of the transfer {src} -> {dst}; only their ranks take part"
)
PLAN_ROLE_RECV = (
    "rank {rank} is in the receiving mesh {mesh}, so it must receive too: call "
    "recv(src_mesh, mesh=..., placements=..., source=td) (or a Transfer's __call__), which "
    "also sends its part"
)
PLAN_ROLE_SOURCE = (
    "rank {rank} is in the sending mesh {mesh} but gave no container to send; pass it "
    "(recv(..., source=td); Transfer(..., like=td), then transfer(td) or transfer.send(td))"
)
PLAN_SRC_MESH = (
    "rank {rank}: the container's DTensors live on {mesh}, not on the sending mesh {src} "
    "given to the transfer"
)
PLAN_NO_PLACEMENTS = (
    "rank {rank} receives in {op}() but gave no target placements; pass placements=..."
)
PLAN_DST_MESH = (
    "rank {rank} receives, so the receiving mesh must be a DeviceMesh (its DTensors live on "
    "it), got {typ}"
)
PLAN_MESH_DIFFERS = (
    "rank {rank} expects the transfer between meshes {mine}, but rank {leader} (the sending "
    "mesh's first rank) sends between {theirs}; every rank must name the same two meshes"
)
PLAN_LAYOUT_DIFFERS = (
    "rank {rank} sends a container that differs from rank {leader}'s in the {what}; every "
    "sending rank must pass the same keys, global shapes, dtypes and placements"
)
PLAN_REJECTED = "{op}: rank(s) {ranks} rejected the transfer: {reason}"
PLAN_DISAGREE = (
    "{op}: rank {rank} asks for placements {mine} for key {key} but rank {other} asks for "
    "{theirs}; every rank of the transfer must ask for the same target placements"
)
PLAN_NO_TARGETS = "{op}: no rank of the transfer gave target placements"
PLAN_LEADER_FAILED = (
    "{op}: rank {leader} (the sending mesh's first rank) rejected the transfer: {reason}"
)
PLAN_HINT = (
    "check that rank {peer} takes part in the same transfer (send / recv / Transfer with the "
    "same two meshes), or pass a larger timeout="
)
PLAN_OUT_OF_STEP = (
    "rank {dst} received step {got} of the transfer from rank {src} while at step {step}; "
    "every rank must run every step of a Transfer"
)
PLAN_STEP_LAYOUT = (
    "rank {rank}: the container differs from the one the transfer was planned for in the "
    "{what}; build a new Transfer for a new layout"
)
PLAN_PARTIAL_DTYPE = (
    "rank {rank}: key {key}: a Partial({op}) source is all-reduced on the sending mesh, "
    "which the {backend} backend cannot do for {dtype}; cast the leaf (e.g. to "
    "torch.int32) or redistribute it to Replicate() before the transfer"
)
PLAN_STRATEGY = (
    "strategy {strategy!r} sends to one rank (pass dst as an int); a receiving mesh takes "
    "strategy 'plan' or 'auto'"
)
PLAN_NEEDS_MESH = (
    "strategy 'plan' needs the receiving mesh: pass dst as a DeviceMesh or its rank array"
)

# --------------------------------------------------------------------------------------
# agreement between the ranks of a mesh
# --------------------------------------------------------------------------------------
DISAGREE = (
    "{op}: the ranks of {mesh} did not ask for the same thing: ranks {ranks} differ from rank "
    "{leader} in the {what}; every rank of the mesh must call {op} with a container of the "
    "same keys, global shapes and dtypes and with the same placements (on rank {rank}: {mine})"
)
PEER_REJECTED = (
    "{op}: rank(s) {ranks} of {mesh} rejected their arguments (the error on those ranks says "
    "why), so no rank of the mesh runs the collectives"
)
AGREE_HINT = (
    "every rank of {mesh} must call {op} at this point (a rank that repeats a transition the "
    "mesh agreed on before does not check again)"
)

# --------------------------------------------------------------------------------------
# send / recv: peers that do not answer
# --------------------------------------------------------------------------------------
PEER_TIMEOUT = (
    "{op}: rank {rank} waited {timeout} for rank {peer} to {step} and gave up; {hint}. With "
    "gloo, a timeout closes every connection of this rank in the process group: rebuild the "
    "group before using it again"
)
PEER_HINT = (
    "check that rank {peer} calls {other}() with rank {rank} as its peer, or pass a larger timeout="
)
PEER_LOST = (
    "{op}: rank {rank} lost rank {peer} while waiting for it to {step} ({reason}); the "
    "connection between the two ranks is closed"
)
BAD_TIMEOUT = "timeout must be a positive number of seconds or None, got {timeout!r}"

# --------------------------------------------------------------------------------------
# the test launcher
# --------------------------------------------------------------------------------------
RANK_FAILED = "rank {rank} of {world_size} failed:\n{tb}"
RANK_BAD_RESULT = "rank {rank} of {world_size} returned a result that cannot be loaded:\n{tb}"
RANK_DIED = "rank {rank} of {world_size} {how} without reporting a result{stack}"
RANK_TIMEOUT = (
    "ranks {ranks} of {world_size} did not finish within {timeout:.0f} s "
    "(reported: {done}); they were killed"
)
RANK_OTHERS = "failed after it: {ranks}"
RANK_KILLED = "still running, killed: ranks {ranks}"

# --------------------------------------------------------------------------------------
# checkpoints (save_checkpoint / load_checkpoint)
# --------------------------------------------------------------------------------------


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded (the message names the rank and the cause)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's files do not match what its manifest records (the message names the
    file): missing, truncated, flipped bytes, or not a checkpoint at all."""


class CheckpointConflictError(CheckpointError):
    """Another save committed to the same path while this one was writing; this one lost."""


class CheckpointDigestError(CheckpointCorruptError):
    """The checkpoint is not the one whose digest the caller gave to ``load_checkpoint``."""


CKPT_NOT_FOUND = "no checkpoint at {path}: {file} does not exist"
CKPT_CORRUPT = "checkpoint {path}: file {file} is corrupt: {detail}"
CKPT_NOT_TARGET = (
    "save_checkpoint: {path} exists and is not a checkpoint (no {pointer}); "
    "choose an empty or new directory"
)
CKPT_KEY_COLLISION = (
    "save_checkpoint: the key paths {a} and {b} both become the checkpoint name {name!r}; "
    "rename one of them"
)
CKPT_PARTIAL = (
    "key {key}: a Partial({op}) DTensor cannot be saved to or loaded from a checkpoint: its "
    "value is split over the ranks; use Replicate() or Shard(d) (redistribute it first)"
)
CKPT_LEAF_TYPE = "key {key}: a checkpoint leaf must be a tensor, got {typ}"
CKPT_SHAPE = (
    "load_checkpoint: key {key}: the checkpoint holds {what} {saved}, `like` has {wanted}; "
    "pass a `like` of the saved structure"
)
CKPT_BATCH = (
    "load_checkpoint: node {key}: the checkpoint's batch size is {saved}, `like` has "
    "{wanted}; pass a `like` of the saved structure"
)
CKPT_REJECTED = (
    "{op}: rank(s) {ranks} rejected the call (its own error says why); no rank wrote or "
    "read any data"
)
CKPT_DISAGREE = (
    "{op}: the ranks do not agree on {what} (rank(s) {ranks} differ from rank {first}); "
    "every rank must pass the same path and a container of the same structure"
)
CKPT_FAILED = "{op}: torch.distributed.checkpoint failed on rank(s) {ranks}: {reason}"
CKPT_CONFLICT = (
    "save_checkpoint: another save committed to {path} while this one was writing (the "
    "checkpoint now holds version {now}, this save started from {base}); this save was "
    "discarded"
)
CKPT_EXISTS_SAVE = "save_checkpoint: {path} holds a checkpoint; pass overwrite=True to replace it"
CKPT_UNKNOWN_TYPE = (
    "load_checkpoint: the checkpoint holds a container of type {name!r}, which is not "
    "registered in this process; import the module that defines it first"
)
CKPT_NOT_GRID = (
    "leaf {name!r}: the chunks overlap or do not form a grid (every dim cut at the same "
    "places for every chunk, as every save writes them)"
)
CKPT_EXISTS = "export_safetensors: {file} exists; pass overwrite=True to replace it"
CKPT_BAD_LOCK = (
    "checkpoint {path}: the lock file {file} is a symlink or not a regular file; remove it "
    "(only a regular file is used as the lock)"
)
CKPT_NO_SPACE = (
    "save_checkpoint: not enough free space for {path}: this rank writes about {need} bytes, "
    "{free} are free (no space left on device)"
)
CKPT_DISK_FULL = "no space left on device under {path} (the disk is full)"
CKPT_ITEM_LAYOUT = (
    "checkpoint {path}: the item of {file} at byte {offset} is not the raw bytes of one "
    "contiguous tensor as torch.save writes them; this torch's DCP writer is not supported"
)
CKPT_BUSY = (
    "load_checkpoint: {path} switched to a new version five times while this load opened "
    "its files; retry when the saves slow down"
)
CKPT_DIGEST = (
    "load_checkpoint: {path} holds the checkpoint {got}, not the expected {want} (its "
    "manifest was changed or replaced); refusing to read it"
)
CKPT_TOO_DEEP = (
    "save_checkpoint: key {key}: containers nested {depth} deep; a checkpoint holds at most "
    "{limit} levels (flatten the structure, e.g. with flatten_keys())"
)
CKPT_COLLECTIVE = (
    "{op}: a collective between the ranks failed (a peer died or the network failed): "
    "{reason}{committed}"
)
CKPT_BAD_DIGEST = (
    "load_checkpoint: digest must be a string 'sha256:<64 hex digits>', got {digest!r}"
)
CKPT_COMMITTED = " (the checkpoint was committed before the failure)"
CKPT_NOT_COMMITTED = " (nothing was committed; the previous checkpoint stays)"
CKPT_OLD_FORMAT = (
    "format version 1 (written by tdfunc 0.x before version 2 of the format): its metadata is "
    "a pickle, which this version never reads; load it with the version that wrote it, in a "
    "process you trust, and save it again"
)
BAD_TIMEOUT_SCALE = "{name}={value!r}: expected a number >= 1 (how many times longer to wait)"

# --------------------------------------------------------------------------------------
# sharded_step
# --------------------------------------------------------------------------------------
STEP_NO_PARAMS = "{op}: the parameter container has no leaves"
STEP_MESH_NDIM = (
    "{op}: key {key} lives on {mesh}; the sharded step needs a 1-D mesh (FSDP's Shard(0) or "
    "DDP's Replicate() along it) or a 2-D (replicate, shard) mesh (HSDP)"
)
STEP_DONATED = (
    "{what} was donated to sharded_step (call {call}): its buffers now hold that call's "
    "outputs; use the values it returned"
)
STEP_MIXED_MESH = (
    "{op}: key {key} lives on {mesh} but the first parameter lives on {first}; every "
    "parameter must share one 1-D mesh"
)
STEP_PLACEMENT = (
    "{op}: key {key} has placements {placement!r}; the sharded step takes Shard(0) (rows split "
    "across the ranks) or Replicate() parameters, on a 2-D mesh (Replicate(), Shard(0)) or "
    "(Replicate(), Replicate()): redistribute it first"
)
STEP_NOT_CALLABLE = "{op}: loss_fn must be callable (params, batch) -> scalar, got {typ}"
STEP_OPTIMIZER = (
    "{op}: optimizer must be a tdfunc.optim GradientTransformation (e.g. optim.adamw(1e-3)), "
    "got {typ}"
)
STEP_BUCKET = "{op}: bucket_mb must be a positive number of MiB, got {value!r}"
STEP_UNITS_TYPE = (
    "{op}: units must be a list or tuple of key prefixes (e.g. ['h.0', 'h.1']), got {value!r}"
)
STEP_UNITS_DUPLICATE = "{op}: unit {unit!r} is given twice in units"
STEP_UNIT_MISSING = (
    "{op}: no sharded parameter's key starts with unit {unit!r}; units are key prefixes of "
    "the parameters, e.g. 'transformer.h.0'"
)
STEP_UNIT_WRITE = (
    "{op}: the forward writes parameter {key} in place ({fn}); with units the parameters are "
    "gathered on use and cannot be written: compute a new tensor instead"
)
