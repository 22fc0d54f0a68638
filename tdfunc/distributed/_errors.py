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
BAD_STRATEGY = "strategy must be 'local' or 'full', got {strategy!r}"
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
