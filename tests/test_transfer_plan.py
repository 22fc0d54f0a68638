"""tdfunc.distributed.transfer_plan: the pure planner of cross-mesh transfers (no processes).

Each plan is checked by simulating every rank of both meshes in this process: the sources'
local shards are cut from a full tensor with torch's own DTensor shard arithmetic
(``_compute_local_shape_and_global_offset``), every piece of the plan is copied from its
sender's shard into its receiver's, and each receiver must end with exactly its target
shard, every element written exactly once, while the bytes on the wire equal the minimum
(the target bytes each receiver does not already hold).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

import tdfunc
from tdfunc.distributed import transfer_plan
from tdfunc.distributed._common import errors as E
from tdfunc.distributed._transfer.plan import Grid, as_grid, plan_for


# --------------------------------------------------------------------------------------
# the oracle
# --------------------------------------------------------------------------------------
def _torch_box(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...], pls: Any
) -> tuple[slice, ...]:
    """The slice of the global tensor a rank holds, by torch's DTensor arithmetic."""
    plain = [Replicate() if isinstance(p, Partial) else p for p in pls]
    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), plain)
    return tuple(slice(o, o + n) for o, n in zip(offset, local))


def _coords(g: Grid) -> list[tuple[int, ...]]:
    return list(itertools.product(*[range(m) for m in g.shape]))


def check_plan(plan: Any) -> dict[str, int]:
    """Simulate ``plan`` on every rank; assert exact coverage and minimal bytes."""
    sg, dg = plan.src_mesh, plan.dst_mesh
    minimum = 0
    # messages: one per pair, never to oneself, pieces packed back to back, dtype-aligned
    pairs = [(m.src, m.dst) for m in plan.messages]
    assert len(pairs) == len(set(pairs))
    assert pairs == sorted(pairs)
    for m in plan.messages:
        assert m.src != m.dst
        assert m.src in sg.ranks
        assert m.dst in dg.ranks
        off = 0
        for p in m.pieces:
            assert (p.src, p.dst) == (m.src, m.dst)
            assert p.offset == off
            assert p.offset % plan.leaves[p.leaf].dtype.itemsize == 0
            assert p.nbytes > 0
            off += p.nbytes
        assert off == m.nbytes
    for r, ps in plan.local.items():
        assert r in sg.ranks
        assert r in dg.ranks
        assert all(p.src == p.dst == r for p in ps)
    for li, spec in enumerate(plan.leaves):
        shape = spec.shape
        full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape)
        src_pls = spec.reduced or spec.src
        src_local = {
            sg.rank_at(c): full[_torch_box(shape, sg.shape, c, src_pls)] for c in _coords(sg)
        }
        for e in _coords(dg):
            d = dg.rank_at(e)
            sl = _torch_box(shape, dg.shape, e, spec.dst)
            zero = any(
                isinstance(p, Partial) and p.reduce_op == "sum" and c != 0
                for p, c in zip(spec.dst, e)
            )
            expected = torch.zeros_like(full[sl]) if zero else full[sl]
            assert plan.target(li, d) == (tuple(expected.shape), zero)
            got = torch.zeros_like(expected)
            count = torch.zeros_like(expected)
            pieces = [p for m in plan.receives(d) for p in m.pieces] + list(plan.local.get(d, ()))
            for p in pieces:
                if p.leaf != li:
                    continue
                assert p.nbytes == math.prod(p.size) * spec.dtype.itemsize
                src = src_local[p.src][tuple(slice(a, a + n) for a, n in zip(p.src_start, p.size))]
                where = tuple(slice(a, a + n) for a, n in zip(p.dst_start, p.size))
                got[where] += src
                count[where] += 1
            if zero:
                assert count.sum().item() == 0
                continue
            assert torch.equal(count, torch.ones_like(count)), (spec, d, count)
            assert torch.equal(got, expected)
            # the minimum: what this receiver needs and does not hold as a sender
            held = 0
            own = sg.coord(d)
            if own is not None:
                mine = torch.zeros(shape, dtype=torch.bool)
                mine[_torch_box(shape, sg.shape, own, src_pls)] = True
                held = int(mine[sl].sum())
            minimum += (expected.numel() - held) * spec.dtype.itemsize
    assert plan.bytes.total == minimum
    assert plan.bytes.messages == len(plan.messages)
    assert sum(plan.bytes.sent.values()) == sum(plan.bytes.received.values()) == minimum
    return {"bytes": plan.bytes.total, "messages": plan.bytes.messages}


# --------------------------------------------------------------------------------------
# a grid of layouts
# --------------------------------------------------------------------------------------
MESHES = {
    "1": [0],
    "2": [0, 1],
    "3": [0, 1, 2],
    "4": [0, 1, 2, 3],
    "2x2": [[0, 1], [2, 3]],
    "1x3": [[0, 1, 2]],
}
SHAPES = {"even": (8, 12), "uneven": (5, 7), "tiny": (1, 3), "vec": (6,), "scalar": ()}


def _placements(ndim_mesh: int, ndim: int) -> list[tuple[Any, ...]]:
    one: list[Any] = [Replicate(), Partial()]
    one += [Shard(d) for d in range(ndim)]
    return list(itertools.product(one, repeat=ndim_mesh))


def _grid_cases() -> list[Any]:
    cases = []
    meshes = list(MESHES)
    for src_name, dst_name in itertools.product(meshes, meshes):
        for disjoint in (False, True):
            src = as_grid(MESHES[src_name])
            dst = as_grid(MESHES[dst_name])
            if disjoint:
                dst = Grid(dst.shape, tuple(r + 10 for r in dst.ranks))
            cases.append((src_name, dst_name, src, dst))
    return cases


@pytest.mark.parametrize(
    ("src_name", "dst_name", "src", "dst"),
    _grid_cases(),
    ids=[
        f"{a}-{b}-{'disjoint' if d.ranks[0] >= 10 else 'overlap'}" for a, b, _, d in _grid_cases()
    ],
)
def test_grid_of_layouts(src_name: str, dst_name: str, src: Grid, dst: Grid) -> None:
    """Every placement pair on every leaf shape: coverage exactly once, minimal bytes."""
    n = 0
    for shape in SHAPES.values():
        sp = _placements(src.ndim, len(shape))
        dp = _placements(dst.ndim, len(shape))
        # all pairs on small meshes; a deterministic sample of pairs on 2-D meshes
        combos = list(itertools.product(sp, dp))
        step = max(1, len(combos) // 40)
        for a, b in combos[::step]:
            check_plan(transfer_plan({"x": shape}, src, list(a), dst, list(b)))
            n += 1
    assert n > 0


def test_many_leaves_one_message_per_pair() -> None:
    """60 leaves of mixed dtypes: still one message per (sender, receiver) pair."""
    shapes = {f"l{i}": (4 + i % 5, 6) for i in range(60)}
    dts = [torch.float32, torch.float64, torch.int8, torch.bfloat16, torch.bool, torch.int64]
    dtypes = {k: dts[i % len(dts)] for i, k in enumerate(shapes)}
    plan = transfer_plan(
        shapes, [[0, 1], [2, 3]], [Shard(0), Shard(1)], [4, 5], [Shard(1)], dtypes=dtypes
    )
    out = check_plan(plan)
    assert out["messages"] == 4
    # pieces are ordered by decreasing element size: aligned with no padding
    for m in plan.messages:
        sizes = [plan.leaves[p.leaf].dtype.itemsize for p in m.pieces]
        assert sizes == sorted(sizes, reverse=True)


def test_weight_sync_layouts() -> None:
    """The two layouts of the benchmark: [2, 2] (S0, S1) -> [2] (S1) and [4] (S0) -> [2] (S0)."""
    a = transfer_plan({"w": (64, 32)}, [[0, 1], [2, 3]], [Shard(0), Shard(1)], [4, 5], [Shard(1)])
    assert a.bytes.total == 64 * 32 * 4  # every element once
    assert a.bytes.sent == dict.fromkeys(range(4), 64 * 32)
    assert a.bytes.received == {4: 64 * 32 * 2, 5: 64 * 32 * 2}
    b = transfer_plan({"w": (64, 32)}, [0, 1, 2, 3], [Shard(0)], [4, 5], [Shard(0)])
    assert [(m.src, m.dst) for m in b.messages] == [(0, 4), (1, 4), (2, 5), (3, 5)]
    check_plan(a)
    check_plan(b)


def test_overlapping_ranks_copy_locally() -> None:
    plan = transfer_plan({"w": (8, 4)}, [0, 1, 2, 3], [Shard(0)], [0, 1], [Shard(0)])
    check_plan(plan)
    assert plan.bytes.local == {0: 2 * 4 * 4}  # rank 0 keeps its rows 0-1
    assert plan.bytes.total == 6 * 4 * 4
    # the same mesh and placements: nothing moves
    same = transfer_plan({"w": (8, 4)}, [0, 1], [Shard(0)], [0, 1], [Shard(0)])
    assert same.messages == ()
    assert same.bytes.total == 0
    assert same.bytes.local == {0: 64, 1: 64}


def test_replicated_sources_spread_reads() -> None:
    """A leaf replicated on 4 ranks, wanted whole by 2 receivers: each replica serves a
    quarter of each receiver's copy's worth (no rank serves everything)."""
    plan = transfer_plan({"w": (16, 8)}, [0, 1, 2, 3], [Replicate()], [4, 5], [Replicate()])
    check_plan(plan)
    assert set(plan.bytes.sent.values()) == {2 * 16 * 8 * 4 // 4}
    # aligned with the receivers' sharding: each receiver reads from half of the replicas
    aligned = transfer_plan({"w": (16, 8)}, [0, 1, 2, 3], [Replicate()], [4, 5], [Shard(0)])
    check_plan(aligned)
    assert [(m.src, m.dst) for m in aligned.messages] == [(0, 4), (1, 4), (2, 5), (3, 5)]
    # many tiny leaves (smaller than the number of replicas) rotate among the replicas
    tiny = transfer_plan({f"b{i}": () for i in range(8)}, [0, 1], [Replicate()], [4], [Replicate()])
    check_plan(tiny)
    assert tiny.bytes.sent == {0: 16, 1: 16}


def test_partial_sources_are_reduced_first() -> None:
    plan = transfer_plan({"g": (4, 4)}, [[0, 1], [2, 3]], [Partial(), Shard(0)], [4], [Shard(0)])
    assert plan.leaves[0].reduced == (Replicate(), Shard(0))
    check_plan(plan)
    keep = transfer_plan({"g": (4, 4)}, [0, 1], [Shard(0)], [4], [Shard(0)])
    assert keep.leaves[0].reduced is None


def test_partial_targets() -> None:
    """Partial("sum"): coordinate 0 holds the values, the others zeros (nothing moves to
    them); "max" holds them everywhere."""
    plan = transfer_plan({"x": (4, 2)}, [0], [Replicate()], [4, 5], [Partial()])
    check_plan(plan)
    assert [(m.dst, m.nbytes) for m in plan.messages] == [(4, 32)]
    assert plan.target(0, 5) == ((4, 2), True)
    mx = transfer_plan({"x": (4, 2)}, [0], [Replicate()], [4, 5], [Partial("max")])
    check_plan(mx)
    assert mx.bytes.total == 64


def test_placement_specs_and_containers() -> None:
    td = tdfunc.TensorDict(
        a=torch.zeros(4, 6), n=tdfunc.TensorDict(b=torch.zeros(6, dtype=torch.float64))
    )
    plan = transfer_plan(td, [0, 1], {"a": [Shard(1)], "n": [Shard(0)]}, [2], [Replicate()])
    assert [s.path for s in plan.leaves] == [("a",), ("n", "b")]
    assert [s.src for s in plan.leaves] == [(Shard(1),), (Shard(0),)]
    assert [s.dtype for s in plan.leaves] == [torch.float32, torch.float64]
    assert plan.bytes.total == 4 * 6 * 4 + 6 * 8
    by_call = transfer_plan(
        [(4, 6), (3,)], [0, 1], lambda path, x: [Shard(x.ndim - 1)], [2], [Replicate()]
    )
    assert [s.src for s in by_call.leaves] == [(Shard(1),), (Shard(0),)]
    assert [s.path for s in by_call.leaves] == [("0",), ("1",)]
    neg = transfer_plan({"x": (4, 6)}, [0, 1], [Shard(-1)], [2], [Replicate()])
    assert neg.leaves[0].src == (Shard(1),)
    import torch.distributed.device_mesh as dm

    assert as_grid(torch.tensor([[3, 4]])) == Grid((1, 2), (3, 4))
    assert dm.DeviceMesh is not None  # DeviceMesh objects are read through .mesh


def test_plans_are_cached_by_layout() -> None:
    plan_for.cache_clear()
    a = transfer_plan({"x": (4, 6)}, [0, 1], [Shard(0)], [2, 3], [Shard(1)])
    b = transfer_plan({"x": (4, 6)}, torch.tensor([0, 1]), (Shard(0),), [2, 3], [Shard(1)])
    assert a is b
    assert plan_for.cache_info().hits == 1


@pytest.mark.parametrize(
    ("kwargs", "exc", "text"),
    [
        (
            {"src_placements": [Shard(0), Shard(1)]},
            ValueError,
            E.PLACEMENTS_LENGTH.format(
                key="'x'", n=2, placements=[Shard(0), Shard(1)], ndim=1, mesh_shape=(2,)
            ),
        ),
        (
            {"dst_placements": [Shard(2)]},
            ValueError,
            E.SHARD_DIM.format(key="'x'", dim=2, mesh_dim=0, shape=(4, 6), ndim=2),
        ),
        (
            {"dst_placements": [Partial("product")]},
            ValueError,
            E.PLAN_PLACEMENT.format(
                key="'x'", placement=Partial("product"), ops=("sum", "avg", "max", "min")
            ),
        ),
        ({"src_mesh": [0, 0]}, ValueError, E.BAD_GRID.format(ranks=[0, 0])),
        ({"src_mesh": []}, ValueError, E.BAD_GRID.format(ranks=[])),
        ({"dst_mesh": "ab"}, TypeError, E.BAD_GRID_TYPE.format(typ="str")),
        (
            {"dst_mesh": torch.tensor([0.0])},
            TypeError,
            E.BAD_GRID_TYPE.format(typ="tensor of torch.float32"),
        ),
        ({"shapes": 3}, TypeError, E.PLAN_SHAPES.format(typ="int")),
        ({"dtypes": [torch.float32] * 2}, ValueError, E.PLAN_DTYPES.format(n=2, leaves=1)),
        (
            {"src_placements": ["shard"]},
            TypeError,
            E.PLACEMENT_TYPE.format(key="'x'", value="shard", typ="str"),
        ),
    ],
)
def test_planner_errors(kwargs: dict[str, Any], exc: type, text: str) -> None:
    args: dict[str, Any] = {
        "shapes": {"x": (4, 6)},
        "src_mesh": [0, 1],
        "src_placements": [Shard(0)],
        "dst_mesh": [2],
        "dst_placements": [Replicate()],
    }
    args.update(kwargs)
    with pytest.raises(exc) as e:
        transfer_plan(**args)
    assert str(e.value) == text


def test_unknown_key_in_mapping() -> None:
    with pytest.raises(KeyError, match="placements name key 'nope'"):
        transfer_plan({"x": (4,)}, [0], {"nope": [Shard(0)]}, [1], [Replicate()])


# --------------------------------------------------------------------------------------
# property-based: random shapes, meshes (sharing ranks or not) and placements
# --------------------------------------------------------------------------------------
@st.composite
def _layouts(draw: Any) -> tuple[Any, ...]:
    def mesh(base: int) -> Grid:
        shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
        n = math.prod(shape)
        pool = list(range(base, base + 9))
        ranks = draw(st.permutations(pool))[:n]
        return Grid(shape, tuple(ranks))

    src = mesh(0)
    dst = mesh(draw(st.sampled_from([0, 3, 10])))  # overlapping or disjoint
    n_leaves = draw(st.integers(1, 3))
    shapes = {}
    src_p, dst_p, dtypes = {}, {}, {}
    for i in range(n_leaves):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        shapes[f"l{i}"] = shape

        def one(shape: tuple[int, ...] = shape) -> Any:
            options: list[Any] = [Replicate(), Partial(), Partial("max")]
            options += [Shard(d) for d in range(len(shape))]
            return st.sampled_from(options)

        src_p[f"l{i}"] = [draw(one()) for _ in range(src.ndim)]
        dst_p[f"l{i}"] = [draw(one()) for _ in range(dst.ndim)]
        dtypes[f"l{i}"] = draw(st.sampled_from([torch.float32, torch.int8, torch.float64]))
    return shapes, src, src_p, dst, dst_p, dtypes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts())
def test_random_layouts_cover_exactly_once_with_minimal_bytes(layout: tuple[Any, ...]) -> None:
    shapes, src, src_p, dst, dst_p, dtypes = layout
    check_plan(transfer_plan(shapes, src, src_p, dst, dst_p, dtypes=dtypes))


# --------------------------------------------------------------------------------------
# packing and unpacking, every rank simulated in this process (eager and compiled)
# --------------------------------------------------------------------------------------
def _values(spec: Any, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(spec.shape, generator=g) * 30
    if spec.dtype == torch.bool:
        return x > 0
    if spec.dtype.is_complex:
        return torch.complex(x, -x)
    return x.to(spec.dtype)


def move(plan: Any, seed: int = 0, compiled: dict[int, Any] | None = None) -> int:
    """Run ``plan``'s data path for every rank in this process; assert every receiver gets
    exactly its target shard. ``compiled``: rank -> (pack, unpack) functions to use."""
    from tdfunc.distributed._transfer import handshake as X

    fulls = [_values(s, seed + i) for i, s in enumerate(plan.leaves)]
    sg, dg = plan.src_mesh, plan.dst_mesh
    locals_ = {
        sg.rank_at(c): [
            full[_torch_box(s.shape, sg.shape, c, s.reduced or s.src)]
            for full, s in zip(fulls, plan.leaves)
        ]
        for c in _coords(sg)
    }
    inbox: dict[tuple[int, int], torch.Tensor] = {}
    for s in sg.ranks:
        side = X.send_side(plan.key, s)
        heads = [X.data_header(0, 7, 1, 0, torch.device("cpu")) for _ in side.peers]
        pack = compiled[s][0] if compiled else (lambda xs, hs, side=side: X.pack(xs, hs, side))
        for d, buf, n in zip(side.peers, pack(locals_[s], heads), side.nbytes):
            assert buf.dtype == torch.uint8
            assert buf.numel() == X.HEADER_BYTES + n
            assert X.check_header(X.read_header(buf), s, d, 7, 1) is None
            inbox[s, d] = buf
    assert len(inbox) == plan.bytes.messages
    for e in _coords(dg):
        d = dg.rank_at(e)
        side = X.recv_side(plan.key, d, "cpu")
        bufs = [inbox[s, d] for s in side.peers]
        xs = locals_.get(d, [])
        unpack = compiled[d][1] if compiled else (lambda b, x, side=side: X.unpack(b, x, side))
        got = unpack(bufs, xs)
        for full, spec, y in zip(fulls, plan.leaves, got):
            sl = _torch_box(spec.shape, dg.shape, e, spec.dst)
            zero = plan.target(plan.leaves.index(spec), d)[1]
            expected = torch.zeros_like(full[sl]) if zero else full[sl]
            assert y.dtype == spec.dtype
            assert torch.equal(y, expected), (spec.path, d)
            assert y.is_contiguous()
            for x in xs:  # a local copy never aliases the sender's shard
                assert x.numel() == 0 or y.numel() == 0 or not _shares(x, y)
    return plan.bytes.total


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.complex64]


@pytest.mark.parametrize(
    ("src", "sp", "dst", "dp"),
    [
        ([[0, 1], [2, 3]], [Shard(0), Shard(1)], [4, 5], [Shard(1)]),
        ([0, 1, 2, 3], [Shard(0)], [4, 5], [Shard(0)]),
        ([0, 1, 2, 3], [Shard(0)], [3, 4], [Shard(1)]),  # overlapping: rank 3 copies locally
        ([0, 1], [Shard(1)], [1, 0], [Shard(0)]),  # the same ranks, resharded
        ([[0, 1], [2, 3]], [Replicate(), Shard(0)], [4], [Replicate()]),  # spread reads
        ([0, 1], [Partial()], [2, 3], [Partial()]),  # reduced first; zeros off coordinate 0
        ([0], [Replicate()], [0], [Replicate()]),  # nothing moves
    ],
)
def test_pack_unpack_every_rank(src: Any, sp: Any, dst: Any, dp: Any) -> None:
    shapes = {f"l{i}": s for i, s in enumerate([(8, 6), (5, 7), (3, 1), (9, 4), (4, 4), (7, 3)])}
    dtypes = dict(zip(shapes, DTYPES))
    plan = transfer_plan(shapes, src, sp, dst, dp, dtypes=dtypes)
    move(plan)


def test_pack_unpack_compiled_one_graph_per_rank() -> None:
    """The cached compiled graphs: one frame per rank and side, equal to eager, and no
    recompile on the next step with new values."""
    from tdfunc.distributed._transfer import handshake as X

    shapes = {f"l{i}": s for i, s in enumerate([(8, 6), (5, 7), (3, 1), (9, 4), (4, 4), (7, 3)])}
    plan = transfer_plan(
        shapes,
        [[0, 1], [2, 3]],
        [Shard(0), Shard(1)],
        [3, 4],
        [Shard(1)],
        dtypes=dict(zip(shapes, DTYPES)),
    )
    counters: dict[int, Any] = {}
    fns: dict[int, Any] = {}
    for r in range(5):
        cnt = torch._dynamo.testing.CompileCounterWithBackend("eager")
        counters[r] = cnt
        fns[r] = (
            X.compiled_pack(plan.key, r, cnt) if r in plan.src_mesh.ranks else None,
            X.compiled_unpack(plan.key, r, "cpu", cnt) if r in plan.dst_mesh.ranks else None,
        )
    move(plan, seed=1, compiled=fns)
    frames = {r: c.frame_count for r, c in counters.items()}
    move(plan, seed=2, compiled=fns)  # new values, same structure
    assert {r: c.frame_count for r, c in counters.items()} == frames
    assert frames == {0: 1, 1: 1, 2: 1, 3: 2, 4: 1}  # rank 3 packs and unpacks
    assert X.compiled_pack(plan.key, 0, counters[0]) is fns[0][0]  # cached


def test_pieces_reassemble_by_guillotine_cuts() -> None:
    from tdfunc.distributed._transfer.handshake import assemble

    full = torch.arange(24.0).reshape(4, 6)
    parts = [
        ((0, 0), (2, 6), full[0:2, :]),
        ((2, 0), (2, 2), full[2:4, 0:2]),
        ((2, 2), (1, 4), full[2:3, 2:6]),
        ((3, 2), (1, 4), full[3:4, 2:6]),
    ]
    assert torch.equal(assemble((0, 0), (4, 6), parts), full)
    pinwheel = [  # no guillotine cut exists: plans never produce this
        ((0, 0), (1, 2), full[0:1, 0:2]),
        ((0, 2), (2, 1), full[0:2, 2:3]),
        ((1, 0), (2, 1), full[1:3, 0:1]),
        ((2, 1), (1, 2), full[2:3, 1:3]),
        ((1, 1), (1, 1), full[1:2, 1:2]),
    ]
    with pytest.raises(AssertionError, match="no guillotine cut"):
        assemble((0, 0), (3, 3), pinwheel)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_layouts(), st.integers(0, 3))
def test_random_layouts_move_the_right_values(layout: tuple[Any, ...], seed: int) -> None:
    shapes, src, src_p, dst, dst_p, dtypes = layout
    move(transfer_plan(shapes, src, src_p, dst, dst_p, dtypes=dtypes), seed=seed)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_cache_clear_drops_plans_and_graphs() -> None:
    from tdfunc import distributed as tdd
    from tdfunc.distributed._transfer import handshake as X

    plan = transfer_plan({"x": (4, 6)}, [0, 1], [Shard(0)], [2], [Replicate()])
    X.compiled_pack(plan.key, 0, "eager")
    X.recv_side(plan.key, 2, "cpu")
    tdd.cache_clear()
    assert plan_for.cache_info().currsize == 0
    assert X.compiled_pack.cache_info().currsize == 0
    assert X.recv_side.cache_info().currsize == 0


def test_handshake_refuses_duplicate_json_keys_from_a_peer() -> None:
    """The leader reads each rank's answer with the one JSON reader of tdfunc's formats: a
    key given twice in one object is refused, not resolved as Python's ``json`` would (last
    one wins) while another reader keeps the first."""
    from types import SimpleNamespace

    from tdfunc.distributed._transfer import handshake as H

    side = SimpleNamespace(op="send", layout=None, dst=SimpleNamespace(ranks=[1]))
    good = (H.OK, '{"placements":[null]}')
    twice = (H.OK, '{"placements":[null],"placements":[["R"]]}')
    assert H._verdict(side, {0: good, 1: good})[0] == H.OK
    with pytest.raises(ValueError, match=E.JSON_DUPLICATE_KEY.format(key="placements")):
        H._verdict(side, {0: good, 1: twice})
