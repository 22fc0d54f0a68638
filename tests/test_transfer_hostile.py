"""Hostile transfer messages: what a peer of ``send`` / ``recv`` or of a planned transfer's
handshake sends is input, not a promise.

Every reader is driven directly (a scripted link stands in for the peer, no process is
started): headers, the JSON metadata of ``send`` / ``recv`` to a rank, layouts, answers
and verdicts of the handshake, and encoded placements. Each malformed field ends in
:class:`TransferMetadataError` (or :class:`PlacementFormatError`) naming it, never a
``KeyError`` / ``TypeError`` / ``IndexError`` from inside, and no buffer is allocated for a
size that was not checked first.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import tdfunc
from tdfunc._shapes import MAX_BYTES, SHAPE_BYTES
from tdfunc._tree import leaves_with_paths
from tdfunc.distributed._common import errors as E
from tdfunc.distributed._common import placements as codec
from tdfunc.distributed._common import wire
from tdfunc.distributed._transfer import handshake as X
from tdfunc.distributed._transfer import trust
from tdfunc.distributed._transfer.plan import Grid

Bad = E.TransferMetadataError
CPU = torch.device("cpu")
PEER = 3


# --------------------------------------------------------------------------------------
# a scripted peer
# --------------------------------------------------------------------------------------
class Done:
    """A finished send."""

    def wait(self, *args: Any) -> None:
        return None


class ScriptedLink:
    """A :class:`~tdfunc.distributed._common.wire.Peer` whose peer is a script: ``recv``
    fills each buffer from the next message queued for its tag (the sizes must agree, as
    gloo's would), ``send`` / ``isend`` record what this rank sent."""

    def __init__(self, messages: dict[int, list[Tensor]], peer: int = PEER, rank: int = 0):
        self.messages = {k: list(v) for k, v in messages.items()}
        self.peer, self.rank, self.device, self.op = peer, rank, CPU, "recv"
        self.sent: list[tuple[int, Tensor]] = []
        self.received: list[tuple[int, int]] = []  # (tag, bytes of the buffer)

    def recv(self, t: Tensor, tag: int, step: str) -> None:
        msg = self.messages[tag].pop(0)
        assert msg.numel() == t.numel(), "a buffer of another size than the message"
        self.received.append((tag, t.numel() * t.element_size()))
        t.copy_(msg)

    def send(self, t: Tensor, tag: int, step: str) -> None:
        self.sent.append((tag, t.clone()))

    def isend(self, t: Tensor, tag: int) -> Done:
        self.send(t, tag, "")
        return Done()

    def finish(self, work: Any, step: str) -> None:
        work.wait()


def _text(s: str) -> Tensor:
    return torch.tensor(list(s.encode("utf-8")), dtype=torch.uint8)


# --------------------------------------------------------------------------------------
# send / recv to a rank: metadata
# --------------------------------------------------------------------------------------
def _td() -> Any:
    return tdfunc.TensorDict(
        a=torch.arange(12.0).reshape(4, 3),
        n={"i": torch.arange(4, dtype=torch.int32)},
        batch_size=[4],
    )


def _relayout(meta: dict[str, Any]) -> dict[str, Any]:
    """Offsets, byte counts and the data size from the entries' local shapes (what
    ``describe`` writes), for building valid messages by hand."""
    off = 0
    for e in meta["leaves"]:
        e["nbytes"] = math.prod(e["local_shape"]) * wire.dtype_from_name(e["dtype"]).itemsize
        e["offset"] = off
        off = wire._align(off + e["nbytes"])
    meta["data_nbytes"] = off
    return meta


def _plain_meta() -> dict[str, Any]:
    td = _td()
    pairs = leaves_with_paths(td)
    xs = [x for _, x in pairs]
    return wire.describe(td, pairs, xs, xs, "full", None).meta


def _sharded_meta() -> dict[str, Any]:
    """Rank 0 of a 2-rank mesh ships its Shard(0) half of ``a`` with strategy 'local'."""
    meta = _plain_meta()
    meta["strategy"] = "local"
    meta["mesh"] = {"shape": [2], "dim_names": None, "device_type": "cpu", "coordinate": [0]}
    a = meta["leaves"][0]
    a.update(kind="dtensor", was_dtensor=True, local_shape=[2, 3])
    a["placements"] = [{"type": "shard", "dim": 0}]
    return _relayout(meta)


def _header(meta: Any, **over: Any) -> list[int]:
    """The header a sender writes for ``meta`` (fields replaced by ``over``)."""
    meta_n = len(json.dumps(meta, separators=(",", ":")).encode())
    data = meta.get("data_nbytes", 0) if isinstance(meta, dict) else 0
    mesh = meta.get("mesh") if isinstance(meta, dict) else None
    strategy = meta.get("strategy", "full") if isinstance(meta, dict) else "full"
    leaves = meta.get("leaves", []) if isinstance(meta, dict) else []
    has_dt = any(isinstance(e, dict) and e.get("was_dtensor") for e in leaves)
    h = wire._header(
        wire.OK,
        wire.STRATEGIES.index(strategy) if strategy in wire.STRATEGIES else 0,
        meta_n,
        wire._align(meta_n) + (data if isinstance(data, int) and data >= 0 else 0),
        has_dt,
        None if not isinstance(mesh, dict) else mesh["shape"],
        None if not isinstance(mesh, dict) else mesh["coordinate"],
        CPU,
    ).tolist()
    names = ("magic", "version", "status", "strategy", "meta_n", "total", "has_dt")
    for k, v in over.items():
        h[names.index(k)] = v
    return h


def test_valid_messages_pass() -> None:
    for meta in (_plain_meta(), _sharded_meta()):
        trust.check_meta(meta, _header(meta), PEER)
        assert wire.header_problem(_header(meta), PEER, 1 << 40) is None


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set (or, for ``...``, delete) ``path`` (dots and [i]) of the metadata."""

    def edit(meta: dict[str, Any]) -> None:
        parts = path.replace("[", ".").replace("]", "").split(".")
        obj: Any = meta
        for p in parts[:-1]:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        last: Any = int(parts[-1]) if isinstance(obj, list) else parts[-1]
        if value is ...:
            del obj[last]
        else:
            obj[last] = value

    return edit


def _nested(depth: int) -> Any:
    node: Any = {"type": None, "context": None, "children_spec": []}
    for _ in range(depth):
        node = {"type": "tdfunc.TensorDict", "context": [], "children_spec": [node]}
    return [1, node]


#: (name, base, edit, field named in the error); the header is rebuilt from the edited
#: metadata, so sizes stay consistent unless the edit is about them
META_CASES: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("missing leaves", "plain", _set("leaves", ...), "field leaves: is missing"),
    ("extra field", "plain", _set("pickle", "x"), "field pickle: is not a field"),
    ("leaves a dict", "plain", _set("leaves", {"a": 1}), "field leaves: expected a list"),
    ("entry a list", "plain", _set("leaves[0]", [1, 2]), "field leaves[0]: expected an object"),
    ("missing dtype", "plain", _set("leaves[0].dtype", ...), "field leaves[0].dtype: is missing"),
    ("unknown dtype", "plain", _set("leaves[0].dtype", "float128"), "leaves[0].dtype: unknown"),
    ("dtype an int", "plain", _set("leaves[0].dtype", 7), "leaves[0].dtype: expected a string"),
    ("dtype a module path", "plain", _set("leaves[0].dtype", "os.system"), "leaves[0].dtype"),
    ("str shape", "plain", _set("leaves[0].shape", ["4", "3"]), "leaves[0].shape[0]: expected"),
    ("shape a dict", "plain", _set("leaves[0].shape", {"0": 4}), "leaves[0].shape: expected a"),
    ("negative shape", "plain", _set("leaves[0].shape", [-4, 3]), "leaves[0].shape[0]: -4"),
    ("bool dim", "plain", _set("leaves[0].shape", [True, 3]), "leaves[0].shape[0]: expected"),
    ("local != global", "plain", _set("leaves[0].local_shape", [2, 3]), "leaves[0].local_shape"),
    ("huge nbytes", "plain", _set("leaves[0].nbytes", 1 << 62), "leaves[0].nbytes"),
    ("negative nbytes", "plain", _set("leaves[0].nbytes", -48), "leaves[0].nbytes: -48"),
    ("nbytes a str", "plain", _set("leaves[0].nbytes", "48"), "leaves[0].nbytes: expected an"),
    ("shape not nbytes", "plain", _set("leaves[0].shape", [5, 3]), "leaves[0].local_shape"),
    ("offset moved", "plain", _set("leaves[1].offset", 8), "leaves[1].offset"),
    ("negative offset", "plain", _set("leaves[0].offset", -64), "leaves[0].offset"),
    ("data size", "plain", _set("data_nbytes", 1 << 40), "field data_nbytes"),
    ("duplicate key path", "plain", _set("leaves[1].path", ["a"]), "leaves[1].path: the key"),
    ("empty key path", "plain", _set("leaves[1].path", []), "leaves[1].path: an empty"),
    ("int in key path", "plain", _set("leaves[0].path", [0]), "leaves[0].path[0]: expected"),
    ("grad on ints", "plain", _set("leaves[1].requires_grad", True), "leaves[1].requires_grad"),
    ("grad a str", "plain", _set("leaves[0].requires_grad", "no"), "leaves[0].requires_grad"),
    ("kind unknown", "plain", _set("leaves[0].kind", "pickle"), "leaves[0].kind"),
    ("dtensor kind in full", "plain", _set("leaves[0].kind", "dtensor"), "leaves[0].kind"),
    ("was_dtensor a str", "plain", _set("leaves[0].was_dtensor", "yes"), "was_dtensor"),
    ("version", "plain", _set("version", True), "field version: expected 2"),
    ("format", "plain", _set("format", "tensordict"), "field format"),
    ("tree junk", "plain", _set("tree", {"a": [1, 2]}), "field tree:"),
    ("tree a dict node", "plain", _set("tree", [1, {"type": "builtins.dict"}]), "field tree:"),
    ("tree nested deep", "plain", _set("tree", _nested(400)), "field tree:"),
    ("tree leaf count", "plain", _set("tree", [1, {"type": None}]), "field tree:"),
    ("placements missing", "sharded", _set("leaves[0].placements", ...), "placements: is"),
    ("placements a dict", "sharded", _set("leaves[0].placements", {"type": "shard"}), "placem"),
    (
        "placements too many",
        "sharded",
        _set("leaves[0].placements", [{"type": "replicate"}] * 2),
        "leaves[0].placements: 2 placement(s) for a mesh with 1 dim(s)",
    ),
    (
        "shard dim past ndim",
        "sharded",
        _set("leaves[0].placements", [{"type": "shard", "dim": 2}]),
        "leaves[0].placements[0].dim: 2 is out of range",
    ),
    (
        "negative shard dim",
        "sharded",
        _set("leaves[0].placements", [{"type": "shard", "dim": -1}]),
        "leaves[0].placements: cannot decode",
    ),
    (
        "unknown reduce op",
        "sharded",
        _set("leaves[0].placements", [{"type": "partial", "reduce_op": "os.system"}]),
        "leaves[0].placements: cannot decode",
    ),
    ("local shard", "sharded", _set("leaves[0].local_shape", [4, 3]), "leaves[0].local_shape"),
    ("mesh shape", "sharded", _set("mesh.shape", [4]), "field mesh.shape: expected (2,)"),
    ("mesh a list", "sharded", _set("mesh", [2]), "field mesh: expected an object"),
    ("mesh dim names", "sharded", _set("mesh.dim_names", ["x", "y"]), "mesh.dim_names"),
    ("mesh coordinate", "sharded", _set("mesh.coordinate", [1]), "field mesh.coordinate"),
    ("mesh a str shape", "sharded", _set("mesh.shape", "2"), "field mesh.shape: expected a"),
]


@pytest.mark.parametrize(
    ("name", "base", "edit", "field"), META_CASES, ids=[c[0] for c in META_CASES]
)
def test_hostile_metadata(name: str, base: str, edit: Any, field: str) -> None:
    meta = _plain_meta() if base == "plain" else _sharded_meta()
    h = _header(meta)  # the header of the valid message: sizes as the sender announced
    edit(meta)
    with pytest.raises(Bad) as e:
        trust.check_meta(meta, h, PEER)
    assert "from rank 3" in str(e.value)
    assert field in str(e.value)


def test_metadata_disagrees_with_header() -> None:
    meta = _sharded_meta()
    for over, field in (
        ({"has_dt": 0}, "field leaves: DTensor leaves True, the header says False"),
        ({"strategy": 1}, "field strategy: expected 'full'"),
        ({"total": _header(meta)[5] + 64}, "field data_nbytes"),
    ):
        with pytest.raises(Bad, match=field):
            trust.check_meta(meta, _header(meta, **over), PEER)
    plain = _plain_meta()
    h = _header(plain)
    h[7:] = wire._mesh_fields((2,), (0,))
    with pytest.raises(Bad, match="field mesh: expected an object, got null"):
        trust.check_meta(plain, h, PEER)


@pytest.mark.parametrize("junk", [None, [], "meta", 7, [{"leaves": []}]])
def test_metadata_not_an_object(junk: Any) -> None:
    with pytest.raises(Bad, match="field \\(the message\\): expected an object"):
        trust.check_meta(junk, _header(_plain_meta()), PEER)


# --------------------------------------------------------------------------------------
# headers: every size checked before a buffer is allocated
# --------------------------------------------------------------------------------------
LIMIT = 1 << 30
HEADER_CASES = [
    ("status", {"status": 7}, "field status: 7 is not 0 or 1"),
    ("strategy", {"strategy": 9}, "field strategy: 9"),
    ("negative strategy", {"strategy": -1}, "field strategy: -1"),
    ("negative meta", {"meta_n": -5}, "field metadata bytes: a negative size"),
    ("no meta", {"meta_n": 0}, "field total bytes"),
    ("huge total", {"total": 1 << 62}, "field total bytes: 4611686018427387904 bytes announced"),
    ("negative total", {"total": -1}, "field total bytes: a negative size"),
    ("meta past total", {"meta_n": 4096, "total": 64}, "field total bytes: 64 cannot hold"),
    ("has_dt", {"has_dt": 5}, "field has_dtensor"),
]


@pytest.mark.parametrize(("name", "over", "field"), HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_hostile_header(name: str, over: dict[str, int], field: str) -> None:
    err = wire.header_problem(_header(_plain_meta(), **over), PEER, LIMIT)
    assert isinstance(err, Bad)
    assert field in str(err)


@pytest.mark.parametrize(
    ("mesh", "field"),
    [
        ([9] + [-1] * 16, "field mesh ndim: 9"),
        ([1, 0] + [-1] * 7 + [0] + [-1] * 7, "field mesh shape[0]: 0 is not >= 1"),
        ([1, 2] + [-1] * 7 + [5] + [-1] * 7, "field mesh coordinate[0]: 5 is out of range"),
        ([1, 2, 2] + [-1] * 6 + [0] + [-1] * 7, "field mesh dim 1: set past ndim 1"),
        ([-1, 4] + [-1] * 15, "field mesh field 0: set without a mesh"),
    ],
)
def test_hostile_header_mesh(mesh: list[int], field: str) -> None:
    h = _header(_plain_meta())
    h[7:] = mesh
    err = wire.header_problem(h, PEER, LIMIT)
    assert isinstance(err, Bad)
    assert field in str(err)


def _link_for(meta_text: bytes, h: list[int], data: bytes = b"") -> ScriptedLink:
    buf = meta_text + b"\0" * (wire._align(len(meta_text)) - len(meta_text)) + data
    return ScriptedLink(
        {
            wire.HEADER_TAG: [torch.tensor(h, dtype=torch.int64)],
            wire.DATA_TAG: [torch.tensor(list(buf), dtype=torch.uint8)],
        }
    )


def _check(raw: bytes, h: list[int]) -> dict[str, Any]:
    return trust.read_meta(raw, h, PEER)


def test_receive_refuses_a_huge_size_before_allocating() -> None:
    meta = _plain_meta()
    link = _link_for(b"", _header(meta, total=1 << 62))
    with pytest.raises(Bad, match="field total bytes: 4611686018427387904 bytes announced"):
        wire.receive(link, None, None, _check)  # type: ignore[arg-type]
    assert link.received == [(wire.HEADER_TAG, 8 * wire.HEADER_LEN)]  # no data buffer
    (tag, reply), (text_tag, why) = link.sent  # the sender is told why
    assert tag == wire.REPLY_TAG
    assert reply[0] == wire.FAILED
    assert text_tag == wire.TEXT_TAG
    assert b"total bytes" in bytes(why.tolist())


def test_receive_refuses_a_huge_failure_reason() -> None:
    h = _header(_plain_meta(), status=wire.FAILED, meta_n=1 << 40)
    link = _link_for(b"", h)
    with pytest.raises(Bad, match="field message bytes: 1099511627776 bytes announced"):
        wire.receive(link, None, None, _check)  # type: ignore[arg-type]
    assert link.received == [(wire.HEADER_TAG, 8 * wire.HEADER_LEN)]


def test_receive_round_trip_and_json_traps() -> None:
    td = _td()
    pairs = leaves_with_paths(td)
    xs = [x for _, x in pairs]
    meta = wire.describe(td, pairs, xs, xs, "full", None).meta
    text = json.dumps(meta, separators=(",", ":")).encode()
    data = bytearray(meta["data_nbytes"])
    for e, x in zip(meta["leaves"], xs):
        data[e["offset"] : e["offset"] + e["nbytes"]] = x.numpy().tobytes()
    inc = wire.receive(_link_for(text, _header(meta), bytes(data)), None, None, _check)  # type: ignore[arg-type]
    assert torch.equal(inc.tensors[0], xs[0])
    assert torch.equal(inc.tensors[1], xs[1])
    # a key given twice (readers disagree on which wins), bytes that are not UTF-8
    twice = text[:-1] + b',"leaves":[]}'
    deep = b"[" * 100_000 + b"]" * 100_000  # Python's decoder recurses per level
    utf16 = json.dumps(meta).encode("utf-16")  # json.loads(bytes) would take it
    for raw, what in (
        (twice, "given twice"),
        (b"\xff" + text[1:], "utf-8"),
        (deep, "nested too deep"),
        (utf16, "utf-8"),
        (b"[1, 2]", "field \\(the message\\): expected an object"),
    ):
        h = _header(meta)
        h[4], h[5] = len(raw), wire._align(len(raw)) + meta["data_nbytes"]
        with pytest.raises(Bad, match=what):
            wire.receive(_link_for(raw, h, bytes(data)), None, None, _check)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["shape", "local_shape"])
def test_a_forged_shape_never_reaches_torch(field: str) -> None:
    """A leaf without elements whose other dims hold more bytes than any tensor (torch's
    storage size computation overflows on it): refused by name, shape and limit before the
    received bytes are viewed as tensors."""
    huge = [1 << 40, 1 << 40, 0]
    meta = _plain_meta()
    meta["leaves"][0].update(shape=huge, local_shape=huge)
    _relayout(meta)
    text = json.dumps(meta, separators=(",", ":")).encode()
    if field == "local_shape":  # the check reads the global shape first
        meta["leaves"][0]["shape"] = [4, 3]
    detail = SHAPE_BYTES.format(shape=huge, dtype=torch.float32, limit=MAX_BYTES)
    want = E.TRANSFER_META.format(
        what=wire.META_WHAT, peer=PEER, field="leaves[0].shape", detail=detail
    )
    with pytest.raises(Bad) as e:
        trust.check_meta(meta, _header(meta), PEER)
    assert str(e.value) == want.replace("leaves[0].shape", f"leaves[0].{field}")
    data = bytes(meta["data_nbytes"])
    with pytest.raises(Bad) as e:
        wire.receive(_link_for(text, _header(json.loads(text)), data), None, None, _check)  # type: ignore[arg-type]
    assert str(e.value) == want


def test_sender_refuses_a_hostile_reply() -> None:
    td = _td()
    pairs = leaves_with_paths(td)
    xs = [x for _, x in pairs]
    out = wire.describe(td, pairs, xs, xs, "full", None)
    for reply, field in (
        ([wire.FAILED, 1 << 40], "field message bytes: 1099511627776 bytes announced"),
        ([5, 0], "field status: 5 is not 0 or 1"),
    ):
        r = torch.tensor(reply + [-1] * (wire.REPLY_LEN - 2), dtype=torch.int64)
        link = ScriptedLink({wire.REPLY_TAG: [r]})
        with pytest.raises(Bad, match=field):
            wire.send_outgoing(out, link)  # type: ignore[arg-type]


def test_reasons_are_cut_to_the_limit() -> None:
    long = "é" * wire.MAX_REASON
    t = wire.reason_tensor(long, CPU)
    assert t.numel() <= wire.MAX_REASON
    t.numpy().tobytes().decode("utf-8")  # cut on a character boundary


# --------------------------------------------------------------------------------------
# planned transfers: layouts, answers, verdicts
# --------------------------------------------------------------------------------------
WORLD = 4


def _layout() -> dict[str, Any]:
    """A layout as ``layout_of`` writes it: ``w`` Shard(0) over ranks [0, 1], ``b`` plain."""
    td = tdfunc.TensorDict(w=torch.ones(4, 2), b=torch.zeros(4), batch_size=[4])
    _, spec = X.pytree.tree_flatten(td)
    return {
        "format": X.FORMAT,
        "version": wire.VERSION,
        "tree": json.loads(X.pytree.treespec_dumps(spec)),
        "leaves": [
            {"path": ["b"], "shape": [4], "dtype": "float32", "placements": None,
             "requires_grad": False},
            {"path": ["w"], "shape": [4, 2], "dtype": "float32",
             "placements": [{"type": "shard", "dim": 0}], "requires_grad": True},
        ],
        "src_mesh": {"shape": [2], "ranks": [0, 1]},
        "dst_mesh": {"shape": [2], "ranks": [2, 3]},
    }  # fmt: skip


def test_valid_layout_passes() -> None:
    lay = _layout()
    assert trust.check_layout(copy.deepcopy(lay), 0, WORLD) == lay
    targets = [None, [{"type": "replicate"}]]
    assert trust.check_targets(targets, lay, 1, trust.VERDICT_WHAT, 0) == targets


LAYOUT_CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing src_mesh", _set("src_mesh", ...), "field src_mesh: is missing"),
    ("extra field", _set("code", "x"), "field code: is not a field"),
    ("grid ranks a str", _set("src_mesh.ranks", "01"), "field src_mesh.ranks: expected a list"),
    ("grid shape vs ranks", _set("dst_mesh.shape", [3]), "field dst_mesh.shape: [3] does not"),
    ("grid shape zero", _set("dst_mesh.shape", [0]), "field dst_mesh.shape[0]: 0 is not >= 1"),
    ("grid duplicate rank", _set("dst_mesh.ranks", [2, 2]), "dst_mesh.ranks: a rank is given"),
    ("grid rank past world", _set("dst_mesh.ranks", [2, 9]), "dst_mesh.ranks: rank 9 is not in"),
    ("grid negative rank", _set("src_mesh.ranks", [-1, 0]), "src_mesh.ranks[0]: -1 is not"),
    ("leaf missing shape", _set("leaves[1].shape", ...), "field leaves[1].shape: is missing"),
    ("leaf dtype", _set("leaves[1].dtype", "bfloat99"), "field leaves[1].dtype: unknown"),
    ("leaf str shape", _set("leaves[1].shape", [4, "2"]), "leaves[1].shape[1]: expected an int"),
    ("leaf negative shape", _set("leaves[0].shape", [-4]), "leaves[0].shape[0]: -4 is not"),
    (
        "leaf shape past the byte limit",
        _set("leaves[1].shape", [1 << 40, 1 << 40, 0]),
        "field leaves[1].shape: "
        + SHAPE_BYTES.format(shape=[1 << 40, 1 << 40, 0], dtype=torch.float32, limit=MAX_BYTES),
    ),
    ("duplicate path", _set("leaves[1].path", ["b"]), "leaves[1].path: the key path ['b']"),
    (
        "placements too many",
        _set("leaves[1].placements", [{"type": "replicate"}] * 3),
        "leaves[1].placements: 3 placement(s) for a mesh with 1 dim(s)",
    ),
    (
        "shard dim past ndim",
        _set("leaves[1].placements", [{"type": "shard", "dim": 5}]),
        "leaves[1].placements[0].dim: 5 is out of range for a leaf with 2 dim(s)",
    ),
    (
        "reduce op torch has not",
        _set("leaves[1].placements", [{"type": "partial", "reduce_op": "__import__"}]),
        "'__import__' is not one of torch's reduce ops",
    ),
    (
        "reduce op no plan moves",
        _set("leaves[1].placements", [{"type": "partial", "reduce_op": "product"}]),
        "leaves[1].placements[0]: P(product) cannot be planned",
    ),
    ("placements a str", _set("leaves[1].placements", "Shard(0)"), "leaves[1].placements: cann"),
    ("tree junk", _set("tree", [1, {"type": "collections.defaultdict"}]), "field tree:"),
    ("tree leaf count", _set("leaves", []), "field leaves: 0 entries for a structure of 2"),
    ("version", _set("version", "2"), "field version: expected 2, got '2'"),
]


@pytest.mark.parametrize(("name", "edit", "field"), LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_hostile_layout(name: str, edit: Any, field: str) -> None:
    lay = _layout()
    edit(lay)
    with pytest.raises(Bad) as e:
        trust.check_layout(lay, 0, WORLD)
    assert str(e.value).startswith("the layout of a planned transfer from rank 0: ")
    assert field in str(e.value)


@pytest.mark.parametrize(
    ("targets", "field"),
    [
        ({"0": None}, "field placements: expected a list"),
        ([None], "field placements: 1 entries for 2 leaves"),
        ([None, None], "field placements[1]: null exactly for the plain leaves"),
        ([[{"type": "replicate"}], [{"type": "replicate"}]], "field placements[0]: null"),
        ([None, [{"type": "shard", "dim": 2}]], "placements[1][0].dim: 2 is out of range"),
        ([None, [{"type": "shard", "dim": "0"}]], "field 'dim' must be an int, got str"),
        ([None, [{"type": "replicate"}] * 2], "2 placement(s) for a mesh with 1 dim(s)"),
        ([None, [{"type": "partial", "reduce_op": "bxor"}]], "P(bxor) cannot be planned"),
    ],
)
def test_hostile_targets(targets: Any, field: str) -> None:
    with pytest.raises(Bad) as e:
        trust.check_targets(targets, _layout(), 1, trust.VERDICT_WHAT, 0)
    assert field in str(e.value)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"placements":[],"placements":[]}', "given twice"),
        ("[1]", "field \\(the message\\): expected an object"),
        ('{"placement":[]}', "field placements: is missing"),
        ("not json", "field \\(the JSON text\\)"),
    ],
)
def test_hostile_verdict_text(text: str, field: str) -> None:
    with pytest.raises(Bad, match=field):
        X.read_targets(text, _layout(), Grid((2,), (2, 3)), trust.VERDICT_WHAT, 0)


def _head(status: int, n: int) -> Tensor:
    return torch.tensor([wire.MAGIC, wire.VERSION, status, n], dtype=torch.int64)


@pytest.mark.parametrize(
    ("status", "n", "field"),
    [
        (wire.OK, 1 << 62, "field text bytes: 4611686018427387904 bytes announced"),
        (wire.OK, -3, "field text bytes: a negative size"),
        (wire.FAILED, wire.MAX_REASON + 1, "field text bytes: 65537 bytes announced"),
        (9, 4, "field status: 9 is not 0 or 1"),
    ],
)
def test_hostile_head_is_refused_before_allocating(status: int, n: int, field: str) -> None:
    link = ScriptedLink({X.LAYOUT_HEAD_TAG: [_head(status, n)]})
    with pytest.raises(Bad, match=field):
        X._read_text(link, X.LAYOUT_HEAD_TAG, X.LAYOUT_TEXT_TAG, "send", trust.LAYOUT_WHAT)  # type: ignore[arg-type]
    assert link.received == [(X.LAYOUT_HEAD_TAG, 8 * X.HEAD_LEN)]


def _answering_side(rank: int) -> X.Side:
    lay = _layout()
    return X.Side(
        "recv", rank, Grid((2,), (0, 1)), Grid((2,), (2, 3)), lay if rank == 0 else None, None,
        lambda layout: [None, [{"type": "replicate"}]],
    )  # fmt: skip


def test_leader_rejects_a_hostile_answer() -> None:
    """Rank 2 answers with a shard dim out of range: the leader raises the typed error and
    tells every other rank (a FAILED verdict naming rank 2), instead of failing inside."""

    def answer(text: str) -> dict[int, list[Tensor]]:
        return {X.ANSWER_HEAD_TAG: [_head(wire.OK, len(text.encode()))], X.ANSWER_TEXT_TAG: [_text(text)]}  # fmt: skip

    good = json.dumps({"placements": [None, [{"type": "replicate"}]]})
    bad = json.dumps({"placements": [None, [{"type": "shard", "dim": 7}]]})
    links = [ScriptedLink(answer(good), peer=1), ScriptedLink(answer(bad), peer=2)]
    links.append(ScriptedLink(answer(good), peer=3))
    with pytest.raises(Bad) as e:
        X._lead(_answering_side(0), links)  # type: ignore[arg-type]
    assert "rank(s) 2 rejected the transfer" in str(e.value)
    assert "placements[1][0].dim: 7 is out of range" in str(e.value)
    for lk in links:  # every rank hears the verdict: FAILED
        head = next(t for tag, t in lk.sent if tag == X.VERDICT_HEAD_TAG)
        assert int(head[2]) == wire.FAILED


def test_participant_rejects_a_hostile_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's layout names a rank outside the group: the participant answers FAILED
    (so the leader does not wait) and raises the typed error naming the field."""
    lay = _layout()
    lay["dst_mesh"]["ranks"] = [2, 77]
    text = json.dumps(lay)
    link = ScriptedLink(
        {X.LAYOUT_HEAD_TAG: [_head(wire.OK, len(text))], X.LAYOUT_TEXT_TAG: [_text(text)]}, peer=0
    )
    monkeypatch.setattr(X.wire, "Peer", lambda *a, **k: link)
    monkeypatch.setattr(X.dist, "get_world_size", lambda *a: WORLD)
    with pytest.raises(Bad, match=r"field dst_mesh\.ranks: rank 77 is not in a group of 4"):
        X.handshake(_answering_side(2), None, CPU, 5.0)
    (tag, head), (_, why) = link.sent
    assert tag == X.ANSWER_HEAD_TAG
    assert int(head[2]) == wire.FAILED
    assert b"rank 77" in bytes(why.tolist())


def test_receiver_refuses_a_layout_too_large_to_hold() -> None:
    lay = _layout()
    lay["leaves"][1]["shape"] = [1 << 40, 1 << 20]
    trust.check_layout(lay, 0, WORLD)  # a valid layout: its shards are what cannot fit
    targets = [None, [{"type": "shard", "dim": 0}]]
    with pytest.raises(Bad, match=r"field leaves\[1\]\.shape: .* bytes announced"):
        trust.check_fits(lay, targets, Grid((2,), (2, 3)), 3, 0, wire.device_limit(CPU))
    lay["leaves"][1]["shape"] = [4, 2]
    trust.check_fits(lay, targets, Grid((2,), (2, 3)), 3, 0, wire.device_limit(CPU))


# --------------------------------------------------------------------------------------
# encoded placements
# --------------------------------------------------------------------------------------
def test_reduce_ops_are_torchs() -> None:
    names = {n.lower() for n in dist.ReduceOp.RedOpType.__members__} - {"premul_sum"}
    assert names == codec.REDUCE_OPS
    for op in sorted(codec.REDUCE_OPS):
        p = codec.decode_placement({"type": "partial", "reduce_op": op})
        assert codec.encode_placement(p) == {"type": "partial", "reduce_op": op}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"type": "partial", "reduce_op": "os.system"}, "reduce_op 'os.system' is not one of"),
        ({"type": "partial", "reduce_op": "premul_sum"}, "reduce_op 'premul_sum' is not one of"),
        ({"type": "partial", "reduce_op": "SUM"}, "reduce_op 'SUM' is not one of"),
        ({"type": "partial", "reduce_op": 0}, "reduce_op 0 is not one of"),
        ({"type": "partial", "reduce_op": None}, "reduce_op None is not one of"),
        ({"type": "partial"}, "field 'reduce_op' is missing"),
        ({"type": "shard"}, "field 'dim' is missing"),
        ({"type": "shard", "dim": -1}, "field 'dim' must be >= 0, got -1"),
        ({"type": "shard", "dim": 1.0}, "field 'dim' must be an int, got float"),
        ({"type": "shard", "dim": True}, "field 'dim' must be an int, got bool"),
        ({"type": "shard", "dim": "0"}, "field 'dim' must be an int, got str"),
        ({"type": "shard", "dim": 0, "extra": 1}, "field 'extra' is not a field of a shard"),
        ({"type": "replicate", "dim": 0}, "field 'dim' is not a field of a replicate"),
        ({"type": "strided_shard", "dim": 0}, "field 'split_factor' is missing"),
        ({"type": "strided_shard", "dim": 0, "split_factor": 0}, "'split_factor' must be >= 1"),
        ({"type": "strided_shard", "dim": 0, "split_factor": "2"}, "'split_factor' must be an"),
        ({"type": "strided_shard", "dim": -2, "split_factor": 2}, "field 'dim' must be >= 0"),
        ({"type": ["shard"]}, "expected a dict with a known 'type'"),
        ({"type": "Shard"}, "expected a dict with a known 'type'"),
        ([{"type": "shard", "dim": 0}], "expected a dict with a known 'type'"),
    ],
)
def test_hostile_placement(obj: Any, message: str) -> None:
    with pytest.raises(E.PlacementFormatError) as e:
        codec.decode_placement(obj)
    assert message in str(e.value)
    assert repr(obj) in str(e.value)  # the value at fault is shown


@pytest.mark.parametrize("objs", [{"type": "shard", "dim": 0}, "shard", 3, None])
def test_hostile_placement_lists(objs: Any) -> None:
    with pytest.raises(E.PlacementFormatError, match="expected a list of encoded placements"):
        codec.decode_placements(objs)
