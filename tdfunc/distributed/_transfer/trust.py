"""Checks of what a peer of a transfer sends: the JSON metadata of ``send`` / ``recv`` to a
rank, and the layout, answers and verdict of a planned transfer's handshake.

A peer's message is input, not a promise: every field is checked against what the sending
side writes (:func:`~.._common.wire.describe`, :func:`~.handshake.layout_of`) before a
tensor, a spec or a plan is built from it (a leaf's shape by the shared
:func:`tdfunc._shapes.shape_problem`, before torch sees it), and a field that does not fit
raises :class:`~.._common.errors.TransferMetadataError` naming it
(``leaves[2].local_shape``), never a ``KeyError`` / ``TypeError`` / ``IndexError`` from
deep inside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from ..._compat import StridedShard
from ..._shapes import shape_problem
from .._common import errors as E
from .._common import placements as codec
from .._common import wire
from .._redistribute import plan as plan_mod
from .plan import Grid, kind_of

LAYOUT_WHAT = "the layout of a planned transfer"
ANSWER_WHAT = "the answer to a planned transfer's layout"
VERDICT_WHAT = "the verdict of a planned transfer"

#: the fields of a ``send`` / ``recv`` metadata message, of its mesh and of each leaf entry
META_FIELDS = ("format", "version", "strategy", "mesh", "tree", "leaves", "data_nbytes")
MESH_FIELDS = ("shape", "dim_names", "device_type", "coordinate")
ENTRY_FIELDS = (
    "path",
    "kind",
    "was_dtensor",
    "dtype",
    "shape",
    "local_shape",
    "requires_grad",
    "offset",
    "nbytes",
)
#: the fields of a planned transfer's layout, of its meshes and of each leaf
LAYOUT_FIELDS = ("format", "version", "tree", "leaves", "src_mesh", "dst_mesh")
GRID_FIELDS = ("shape", "ranks")
LAYOUT_LEAF_FIELDS = ("path", "shape", "dtype", "placements", "requires_grad")


class _Reader:
    """Field checks of one message (``what``) from rank ``peer``."""

    def __init__(self, what: str, peer: int) -> None:
        self.what = what
        self.peer = peer

    def fail(self, field: str, detail: str) -> E.TransferMetadataError:
        return wire.meta_error(self.what, self.peer, field, detail)

    def as_obj(self, x: Any, field: str, fields: Sequence[str]) -> dict[str, Any]:
        """``x`` as a JSON object with exactly ``fields``."""
        if not isinstance(x, dict):
            raise self.fail(field or "(the message)", f"expected an object, got {_kind(x)}")
        for name in fields:
            if name not in x:
                raise self.fail(_sub(field, name), "is missing")
        for name in x:
            if name not in fields:
                raise self.fail(_sub(field, str(name)[:80]), "is not a field of the format")
        return x

    def as_list(self, x: Any, field: str) -> list[Any]:
        if not isinstance(x, list):
            raise self.fail(field, f"expected a list, got {_kind(x)}")
        return x

    def as_int(self, x: Any, field: str, low: int = 0) -> int:
        if type(x) is not int:
            raise self.fail(field, f"expected an int, got {_kind(x)}")
        if x < low:
            raise self.fail(field, f"{x} is not >= {low}")
        return x

    def as_bool(self, x: Any, field: str) -> bool:
        if type(x) is not bool:
            raise self.fail(field, f"expected true or false, got {_kind(x)}")
        return x

    def as_str(self, x: Any, field: str) -> str:
        if not isinstance(x, str):
            raise self.fail(field, f"expected a string, got {_kind(x)}")
        return x

    def equal(self, x: Any, want: Any, field: str) -> None:
        if type(x) is not type(want) or x != want:
            raise self.fail(field, f"expected {want!r}, got {_short(x)}")

    def ints(self, x: Any, field: str, low: int = 0) -> tuple[int, ...]:
        return tuple(
            self.as_int(v, f"{field}[{i}]", low) for i, v in enumerate(self.as_list(x, field))
        )

    def shape(self, x: Any, field: str, dtype: torch.dtype) -> tuple[int, ...]:
        """A leaf's shape of ``dtype``, checked before torch sees it
        (:func:`tdfunc._shapes.shape_problem`: the non-zero dims hold at most ``2**62``
        bytes)."""
        shape = self.ints(x, field)
        problem = shape_problem(shape, dtype)
        if problem is not None:
            raise self.fail(field, problem)
        return shape

    def dtype(self, x: Any, field: str) -> torch.dtype:
        name = self.as_str(x, field)
        try:
            return wire.dtype_from_name(name)
        except ValueError:
            raise self.fail(field, f"unknown dtype {name[:80]!r}") from None

    def path(self, x: Any, field: str, seen: set[tuple[str, ...]]) -> tuple[str, ...]:
        items = self.as_list(x, field)
        if not items:
            raise self.fail(field, "an empty key path")
        path = tuple(self.as_str(k, f"{field}[{i}]") for i, k in enumerate(items))
        if path in seen:
            raise self.fail(field, f"the key path {list(path)} is given twice")
        seen.add(path)
        return path

    def placements(
        self, x: Any, field: str, mesh_ndim: int, shape: Sequence[int], planned: bool
    ) -> tuple[Placement, ...]:
        """Decoded placements: one per mesh dim, shard dims inside the leaf's ndim (and, for a
        planned transfer, placements a plan moves)."""
        try:
            ps = codec.decode_placements(x)
        except E.PlacementFormatError as e:
            raise self.fail(field, str(e)) from None
        if len(ps) != mesh_ndim:
            raise self.fail(field, f"{len(ps)} placement(s) for a mesh with {mesh_ndim} dim(s)")
        for i, p in enumerate(ps):
            if isinstance(p, (Shard, StridedShard)) and p.dim >= len(shape):
                raise self.fail(
                    f"{field}[{i}].dim",
                    f"{p.dim} is out of range for a leaf with {len(shape)} dim(s)",
                )
            if planned:
                try:
                    kind_of(p, ())
                except ValueError:
                    raise self.fail(f"{field}[{i}]", f"{p} cannot be planned") from None
        return ps

    def grad(self, x: Any, field: str, dtype: torch.dtype) -> bool:
        flag = self.as_bool(x, field)
        if flag and not (dtype.is_floating_point or dtype.is_complex):
            raise self.fail(field, f"a {dtype} leaf cannot require grad")
        return flag

    def tree(self, x: Any, n_leaves: int) -> None:
        """The container structure: tdfunc's checked decoder, then its leaf count."""
        try:
            spec = wire.spec_from_json(x)
        except E.SpecFormatError as e:
            raise self.fail("tree", str(e)) from None
        if spec.num_leaves != n_leaves:
            raise self.fail(
                "leaves", f"{n_leaves} entries for a structure of {spec.num_leaves} leaves"
            )


def _sub(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def _kind(x: Any) -> str:
    return "null" if x is None else type(x).__name__


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------------------
# send / recv to a rank
# --------------------------------------------------------------------------------------
def read_meta(raw: bytes, h: Sequence[int], peer: int) -> dict[str, Any]:
    """The metadata bytes of a ``send`` to this rank, parsed (:func:`read_json`) and checked
    (:func:`check_meta`)."""
    meta = read_json(raw, wire.META_WHAT, peer)
    check_meta(meta, h, peer)
    return cast(dict[str, Any], meta)


def check_meta(meta: Any, h: Sequence[int], peer: int) -> None:
    """Check the metadata of a ``send`` to this rank against the format and against its
    header ``h`` (checked by :func:`~.._common.wire.header_problem`): sizes, offsets and
    shapes that account for every byte of the message, dtypes of this torch, placements of
    one per mesh dim with shard dims in range, local shapes that fit the global shapes at
    the sender's coordinate, and a structure of as many leaves."""
    r = _Reader(wire.META_WHAT, peer)
    m = r.as_obj(meta, "", META_FIELDS)
    r.equal(m["format"], "tdfunc.transfer", "format")
    r.equal(m["version"], wire.VERSION, "version")
    r.equal(m["strategy"], wire.STRATEGIES[h[3]], "strategy")
    s_shape, s_coord = wire._read_mesh(h[7:])
    mesh = m["mesh"]
    if mesh is not None or s_shape is not None:
        mesh = r.as_obj(mesh, "mesh", MESH_FIELDS)
        r.equal(r.ints(mesh["shape"], "mesh.shape", 1), s_shape, "mesh.shape")
        names = mesh["dim_names"]
        if names is not None:
            got = [
                r.as_str(n, f"mesh.dim_names[{i}]")
                for i, n in enumerate(r.as_list(names, "mesh.dim_names"))
            ]
            if len(got) != len(s_shape or ()):
                raise r.fail("mesh.dim_names", f"{len(got)} names for {len(s_shape or ())} dims")
        r.as_str(mesh["device_type"], "mesh.device_type")
        coord = mesh["coordinate"]
        r.equal(
            None if coord is None else r.ints(coord, "mesh.coordinate"), s_coord, "mesh.coordinate"
        )
    strategy = m["strategy"]
    start = wire._align(h[4])
    data = r.as_int(m["data_nbytes"], "data_nbytes")
    if start + data != h[5]:
        raise r.fail("data_nbytes", f"{data} data bytes after {start} do not make the {h[5]} sent")
    leaves = r.as_list(m["leaves"], "leaves")
    seen: set[tuple[str, ...]] = set()
    offset = 0
    any_dt = False
    for i, raw in enumerate(leaves):
        at = f"leaves[{i}]"
        if not isinstance(raw, dict):
            raise r.fail(at, f"expected an object, got {_kind(raw)}")
        was_dt = r.as_bool(raw.get("was_dtensor"), f"{at}.was_dtensor")
        e = r.as_obj(raw, at, ENTRY_FIELDS + (("placements",) if was_dt else ()))
        any_dt = any_dt or was_dt
        r.path(e["path"], f"{at}.path", seen)
        dtype = r.dtype(e["dtype"], f"{at}.dtype")
        shape = r.shape(e["shape"], f"{at}.shape", dtype)
        local = r.shape(e["local_shape"], f"{at}.local_shape", dtype)
        r.grad(e["requires_grad"], f"{at}.requires_grad", dtype)
        kind = e["kind"]
        if kind not in ("tensor", "dtensor"):
            raise r.fail(f"{at}.kind", f"expected 'tensor' or 'dtensor', got {_short(kind)}")
        if kind == "dtensor" and not (was_dt and strategy == "local"):
            raise r.fail(f"{at}.kind", "'dtensor' needs was_dtensor and strategy 'local'")
        if was_dt:
            if s_shape is None:
                raise r.fail(f"{at}.was_dtensor", "a DTensor leaf without a mesh")
            ps = r.placements(e["placements"], f"{at}.placements", len(s_shape), shape, False)
        if kind == "dtensor":
            if s_shape is None or s_coord is None:
                raise r.fail("mesh.coordinate", "local shards from a rank outside its mesh")
            want = plan_mod.local_shape(shape, s_shape, ps, s_coord)
        else:
            want = shape
        if local != want:
            raise r.fail(f"{at}.local_shape", f"{list(local)} does not fit {list(want)}")
        r.equal(r.as_int(e["offset"], f"{at}.offset"), offset, f"{at}.offset")
        r.equal(
            r.as_int(e["nbytes"], f"{at}.nbytes"), math.prod(local) * dtype.itemsize, f"{at}.nbytes"
        )
        offset = wire._align(offset + e["nbytes"])
    if offset != data:
        raise r.fail("data_nbytes", f"{data}, but the leaves take {offset}")
    if any_dt != bool(h[6]):
        raise r.fail("leaves", f"DTensor leaves {any_dt}, the header says {bool(h[6])}")
    r.tree(m["tree"], len(leaves))


# --------------------------------------------------------------------------------------
# planned transfers: layout, answers, verdict
# --------------------------------------------------------------------------------------
def check_grid(r: _Reader, x: Any, field: str, world: int) -> Grid:
    """A mesh's rank array: a shape of dims >= 1 holding exactly its distinct ranks, each
    a rank of the process group."""
    g = r.as_obj(x, field, GRID_FIELDS)
    shape = r.ints(g["shape"], f"{field}.shape", 1)
    ranks = r.ints(g["ranks"], f"{field}.ranks")
    if not shape or math.prod(shape) != len(ranks):
        raise r.fail(f"{field}.shape", f"{list(shape)} does not hold {len(ranks)} ranks")
    if len(set(ranks)) != len(ranks):
        raise r.fail(f"{field}.ranks", "a rank is given twice")
    if max(ranks) >= world:
        raise r.fail(f"{field}.ranks", f"rank {max(ranks)} is not in a group of {world}")
    return Grid(shape, ranks)


def check_layout(layout: Any, peer: int, world: int) -> dict[str, Any]:
    """Check a layout the sending mesh's first rank sent (see :func:`~.handshake.layout_of`);
    return it."""
    r = _Reader(LAYOUT_WHAT, peer)
    lay = r.as_obj(layout, "", LAYOUT_FIELDS)
    r.equal(lay["format"], "tdfunc.transfer_plan", "format")
    r.equal(lay["version"], wire.VERSION, "version")
    src = check_grid(r, lay["src_mesh"], "src_mesh", world)
    check_grid(r, lay["dst_mesh"], "dst_mesh", world)
    leaves = r.as_list(lay["leaves"], "leaves")
    seen: set[tuple[str, ...]] = set()
    for i, raw in enumerate(leaves):
        at = f"leaves[{i}]"
        x = r.as_obj(raw, at, LAYOUT_LEAF_FIELDS)
        r.path(x["path"], f"{at}.path", seen)
        dtype = r.dtype(x["dtype"], f"{at}.dtype")
        shape = r.shape(x["shape"], f"{at}.shape", dtype)
        if x["placements"] is not None:
            r.placements(x["placements"], f"{at}.placements", src.ndim, shape, True)
        r.grad(x["requires_grad"], f"{at}.requires_grad", dtype)
    r.tree(lay["tree"], len(leaves))
    return lay


def check_targets(
    targets: Any, layout: dict[str, Any], dst_ndim: int, what: str, peer: int
) -> list[Any]:
    """Check target placements (an answer's or the verdict's) against a checked layout: one
    entry per leaf, None exactly for its plain leaves, else one plannable placement per
    receiving mesh dim."""
    r = _Reader(what, peer)
    ts = r.as_list(targets, "placements")
    leaves = layout["leaves"]
    if len(ts) != len(leaves):
        raise r.fail("placements", f"{len(ts)} entries for {len(leaves)} leaves")
    for i, (t, x) in enumerate(zip(ts, leaves)):
        if (t is None) != (x["placements"] is None):
            raise r.fail(f"placements[{i}]", "null exactly for the plain leaves")
        if t is not None:
            r.placements(t, f"placements[{i}]", dst_ndim, x["shape"], True)
    return ts


def _json(text: str | bytes, r: _Reader) -> Any:
    try:
        return wire.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except ValueError as e:  # not JSON, a key given twice
        raise r.fail("(the JSON text)", str(e)) from None
    except RecursionError:  # Python's JSON decoder recurses once per nesting level
        raise r.fail("(the JSON text)", "nested too deep to decode") from None


def read_json(text: str | bytes, what: str, peer: int) -> Any:
    """JSON text from rank ``peer`` (``what``, for errors): not JSON, not UTF-8, a key given
    twice or nesting too deep for the decoder raise :class:`TransferMetadataError`."""
    return _json(text, _Reader(what, peer))


def read_layout(text: str, peer: int, world: int) -> dict[str, Any]:
    """A layout's JSON text from rank ``peer``, checked (:func:`check_layout`)."""
    return check_layout(_json(text, _Reader(LAYOUT_WHAT, peer)), peer, world)


def read_message(text: str, what: str, peer: int) -> dict[str, Any]:
    """An answer's or the verdict's JSON text: ``{"placements": ...}``."""
    r = _Reader(what, peer)
    return r.as_obj(_json(text, r), "", ("placements",))


def check_fits(
    layout: dict[str, Any], targets: Sequence[Any], dst: Grid, rank: int, peer: int, limit: int
) -> None:
    """This receiving rank's shards of a checked layout (from rank ``peer``) under
    ``targets`` fit in ``limit`` bytes: nothing is allocated for a layout whose shapes would
    not."""
    coord = dst.coord(rank)
    if coord is None:
        return
    total = 0
    for i, (x, t) in enumerate(zip(layout["leaves"], targets)):
        ps = (Replicate(),) * dst.ndim if t is None else codec.decode_placements(t)
        local = plan_mod.local_shape(tuple(x["shape"]), dst.shape, ps, coord)
        total += math.prod(local) * wire.dtype_from_name(x["dtype"]).itemsize
        if total > limit:
            raise E.TransferMetadataError(
                E.TRANSFER_SIZE.format(
                    what=LAYOUT_WHAT,
                    peer=peer,
                    field=f"leaves[{i}].shape",
                    size=total,
                    limit=limit,
                )
            )
