"""tdfunc.distributed: DTensor containers, compiled coalesced redistribution, send/recv.

Multi-process checks run once per module in real gloo process groups (2 and 4 CPU ranks,
spawned by ``tdfunc.testing.launch``, which always terminates); the rank functions live in
``tests/_dist_workers.py`` and return plain values asserted on here. The layout math of the
coalesced buffers is also checked in-process by simulating every rank of a mesh.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any

import _dist_workers as W
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from tdfunc import TensorDict
from tdfunc import distributed as tdd
from tdfunc._compat import pytree
from tdfunc.distributed._common import errors as E
from tdfunc.distributed._common import placements as codec
from tdfunc.distributed._common import wire
from tdfunc.distributed._common.launch import free_port
from tdfunc.distributed._redistribute import plan as P
from tdfunc.testing import RankError, launch

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------
# spawned runs (once per module)
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return launch(W.run_two, 2, timeout=240, pg_timeout=60)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    # ranks 0-3 of the 6-rank launch shared with tests/test_distributed_plan.py
    return [r["four"] for r in W.six()[:4]]


# --------------------------------------------------------------------------------------
# in-process: placements JSON
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("p", "obj"),
    [
        (Shard(0), {"type": "shard", "dim": 0}),
        (Shard(3), {"type": "shard", "dim": 3}),
        (Replicate(), {"type": "replicate"}),
        (Partial(), {"type": "partial", "reduce_op": "sum"}),
        (Partial("max"), {"type": "partial", "reduce_op": "max"}),
        (_StridedShard(1, split_factor=2), {"type": "strided_shard", "dim": 1, "split_factor": 2}),
    ],
)
def test_placement_json_round_trip(p: Any, obj: dict[str, Any]) -> None:
    enc = codec.encode_placement(p)
    assert enc == obj
    assert json.loads(json.dumps(enc)) == obj  # plain JSON, no str(p)
    assert codec.decode_placement(json.loads(json.dumps(enc))) == p
    assert codec.decode_placements(codec.encode_placements([p, Replicate()])) == (p, Replicate())


@pytest.mark.parametrize("bad", [{"type": "nope"}, "Shard(0)", None])
def test_placement_json_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match="cannot decode placement") as e:
        codec.decode_placement(bad)
    assert str(e.value) == E.BAD_PLACEMENT_JSON.format(obj=bad)


def test_placement_json_rejects_unknown_kind() -> None:
    class Odd(Partial):
        pass

    with pytest.raises(TypeError) as e:
        codec.encode_placement(Odd(), ("a", "b"))
    assert str(e.value) == E.UNENCODABLE_PLACEMENT.format(
        key="('a', 'b')", placement=Odd(), typ="Odd"
    )


def test_transfer_metadata_checks() -> None:
    tree = [1, {"type": "nowhere.Type", "context": None, "children_spec": []}]
    with pytest.raises(ValueError, match="not registered in this process") as e:
        wire.spec_from_json(tree)
    assert str(e.value) == E.UNKNOWN_NODE_TYPE.format(name="nowhere.Type")
    # a container nested in a container is named in its parent's context
    td = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2])
    nested = json.loads(pytree.treespec_dumps(pytree.tree_structure(td)))
    assert wire.spec_from_json(nested) == pytree.tree_structure(td)
    back = wire.unflatten(nested, [torch.ones(2), torch.zeros(2)])
    assert back.batch_size == (2,)
    assert back["n", "b"].tolist() == [0.0, 0.0]
    ctx = nested[1]["context"]
    ctx[7][0][1] = "nowhere.Inner"
    with pytest.raises(ValueError, match="not registered in this process") as e:
        wire.spec_from_json(nested)
    assert str(e.value) == E.UNKNOWN_NODE_TYPE.format(name="nowhere.Inner")
    with pytest.raises(ValueError, match="not registered in this process"):
        pytree.treespec_loads(json.dumps(nested))  # the decoder refuses it too
    with pytest.raises(ValueError, match="cannot be sent") as e:
        wire._mesh_fields((1,) * 9, None)
    assert str(e.value) == E.MESH_TOO_LARGE.format(max=wire.MAX_MESH_DIMS, ndim=9)
    assert wire._read_mesh(wire._mesh_fields((2, 3), (1, 2))) == ((2, 3), (1, 2))
    assert wire._read_mesh(wire._mesh_fields(None, None)) == (None, None)


def test_dtype_names_round_trip() -> None:
    for dt in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64):
        assert wire.dtype_from_name(wire.dtype_name(dt)) is dt
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        wire.dtype_from_name("Tensor")


# --------------------------------------------------------------------------------------
# in-process: coalesced layout math, simulated on every rank of a mesh
# --------------------------------------------------------------------------------------
def _slices(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], ks: Any, coord: tuple[int, ...]
) -> tuple[slice, ...]:
    """DTensor's shard of ``coord``: torch.chunk per mesh dim, mesh dims in order."""
    lo, hi = [0] * len(shape), list(shape)
    for i, k in enumerate(ks):
        if k[0] == "shard":
            d = k[1]
            size = hi[d] - lo[d]
            cs = -(-size // mesh_shape[i]) if size else 0
            start = min(lo[d] + coord[i] * cs, hi[d])
            lo[d], hi[d] = start, min(start + cs, hi[d])
    return tuple(slice(a, b) for a, b in zip(lo, hi))


def simulate(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], src: tuple[Any, ...], dst: tuple[Any, ...]
) -> bool | None:
    """Move a tensor src -> dst through the group buffer of every simulated rank; True when
    every rank ends with exactly its dst shard (None: the leaf is not coalescable)."""
    ks, kd = P.kinds(src), P.kinds(dst)
    grouping = P.coalescing(shape, ks, kd, mesh_shape)
    if grouping is None:
        return None
    dims, blocks, a, b = grouping
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    coords = list(itertools.product(*[range(m) for m in mesh_shape]))
    groups = {}
    for c in coords:
        item = P.make_item(shape, ks, kd, dims, blocks, mesh_shape, c)
        groups[c] = P.make_group(True, src, dst, dims, blocks, a, b, (item,))
    numel_row = groups[coords[0]].items[0].numel_row
    gshape = (*blocks, numel_row)
    buf = torch.full(gshape, float("nan"), dtype=torch.float64)
    bsrc = P.kinds(groups[coords[0]].buf_src)
    bdst = P.kinds(groups[coords[0]].buf_dst)
    for c in coords:
        g = groups[c]
        rows = P.to_rows(full[_slices(shape, mesh_shape, ks, c)], g, g.items[0])
        buf[_slices(gshape, mesh_shape, bsrc, c)] = rows
    for c in coords:
        g = groups[c]
        piece = buf[_slices(gshape, mesh_shape, bdst, c)]
        got = P.from_rows(piece, g, g.items[0])
        if not torch.equal(got, full[_slices(shape, mesh_shape, kd, c)]):
            return False
    return True


def _placements(mesh_ndim: int, ndim: int) -> st.SearchStrategy[tuple[Any, ...]]:
    one = st.one_of(st.just(Replicate()), st.integers(0, max(ndim - 1, 0)).map(Shard))
    if ndim == 0:
        one = st.just(Replicate())
    return st.tuples(*[one] * mesh_ndim)


@st.composite
def _cases(draw: Any) -> tuple[Any, ...]:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    src = draw(_placements(len(mesh_shape), len(shape)))
    dst = draw(_placements(len(mesh_shape), len(shape)))
    return shape, mesh_shape, src, dst


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_coalesced_layout_matches_dtensor_chunks(case: tuple[Any, ...]) -> None:
    shape, mesh_shape, src, dst = case
    ok = simulate(shape, mesh_shape, src, dst)
    assume(ok is not None)
    assert ok


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "src", "dst", "expect"),
    [
        ((4, 6), (2,), (Shard(0),), (Replicate(),), True),  # even
        ((5, 3), (2,), (Shard(0),), (Replicate(),), True),  # uneven: padded
        ((3, 5), (2,), (Shard(1),), (Shard(0),), True),  # uneven both sides, one count each
        ((5, 3), (3,), (Shard(0),), (Shard(1),), True),
        ((5, 6), (2, 2), (Shard(0), Shard(0)), (Replicate(), Replicate()), None),  # nested, uneven
        ((8, 6), (2, 2), (Shard(0), Shard(0)), (Replicate(), Replicate()), True),  # nested, even
        ((5, 6), (2, 3), (Shard(0), Replicate()), (Replicate(), Shard(0)), None),  # 2 vs 3 chunks
        ((6, 6), (2, 3), (Shard(0), Replicate()), (Replicate(), Shard(0)), True),  # lcm blocks
        ((0, 3), (2,), (Shard(0),), (Replicate(),), True),
        ((), (2,), (Replicate(),), (Partial(),), True),
    ],
)
def test_coalescing_decisions(
    shape: Any, mesh_shape: Any, src: Any, dst: Any, expect: bool | None
) -> None:
    assert simulate(shape, mesh_shape, src, dst) is expect


def test_local_shape_follows_torch_chunk() -> None:
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1, 0
    sizes = [P.local_shape((5, 3), (4,), (Shard(0),), (r,))[0] for r in range(4)]
    assert sizes == [2, 2, 1, 0]
    assert sizes == [len(c) for c in torch.arange(5).chunk(4)] + [0]
    assert P.local_shape((5, 3), (2, 2), (Shard(0), Shard(1)), (1, 1)) == (2, 1)
    assert P.contiguous_stride((2, 3, 4)) == (12, 4, 1)


def test_each_transition_gets_its_own_code_object() -> None:
    """Dynamo caps the graphs per code object; one code object per plan lifts the cap."""
    plans = [P.Plan(None, ()), P.Plan(None, (P.make_group(False, (), (), (), (), (), (), ()),))]
    fns = [P.compiled(p, "eager") for p in plans]
    codes = [f._torchdynamo_orig_callable.__code__ for f in fns]
    assert codes[0] is not codes[1]
    assert codes[0] is not P.run_plan.__code__
    assert P.compiled(plans[0], "eager") is fns[0]  # cached by value
    assert P.compiled(P.Plan(None, ()), "eager") is fns[0]
    tdd.cache_clear()
    assert P.compiled.cache_info().currsize == 0


# --------------------------------------------------------------------------------------
# launcher: failures and deadlines always end the run
# --------------------------------------------------------------------------------------
def test_launcher_reports_failing_rank() -> None:
    t = time.monotonic()
    with pytest.raises(RankError) as e:
        launch(W.rank_one_fails, 2, timeout=120, pg_timeout=60, grace=1.0)
    assert e.value.rank == 1
    assert "rank 1 of 2 failed" in str(e.value)
    assert "boom on purpose" in str(e.value)
    assert "Traceback" in str(e.value)
    assert time.monotonic() - t < 100  # rank 0 was killed, not waited for (pg timeout 60 s)


def test_launcher_deadline_kills(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdfunc.distributed._common import launch as _launch

    monkeypatch.setenv(_launch.TIMEOUT_SCALE_ENV, "1")  # the deadline as given, however loaded
    t = time.monotonic()
    with pytest.raises(RankError) as e:
        launch(W.sleeps, 1, timeout=2.0)
    assert str(e.value).startswith(
        E.RANK_TIMEOUT.format(ranks=[0], world_size=1, timeout=2.0, done=[])[:40]
    )
    assert time.monotonic() - t < 30


def test_launch_deadlines_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared machine: every deadline is TDFUNC_LAUNCH_TIMEOUT_SCALE times longer (or the
    load per core when it is unset), so a busy CI machine does not fail launches."""
    from tdfunc.distributed._common import launch as _launch

    monkeypatch.setenv(_launch.TIMEOUT_SCALE_ENV, "3")
    assert _launch.deadline_scale() == 3.0
    with pytest.raises(RankError) as e:
        launch(W.sleeps, 1, timeout=1.0)
    assert str(e.value).startswith(
        E.RANK_TIMEOUT.format(ranks=[0], world_size=1, timeout=3.0, done=[])[:40]
    )
    assert "within 3 s" in str(e.value)
    for bad in ("0.5", "fast", "nan"):
        monkeypatch.setenv(_launch.TIMEOUT_SCALE_ENV, bad)
        with pytest.raises(ValueError, match="expected a number") as v:
            _launch.deadline_scale()
        assert str(v.value) == E.BAD_TIMEOUT_SCALE.format(name=_launch.TIMEOUT_SCALE_ENV, value=bad)
    monkeypatch.delenv(_launch.TIMEOUT_SCALE_ENV)
    monkeypatch.setattr(_launch.os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    monkeypatch.setattr(_launch.os, "cpu_count", lambda: 2)
    assert _launch.deadline_scale() == 4.0
    monkeypatch.setattr(_launch.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert _launch.deadline_scale() == 1.0


def test_free_port() -> None:
    assert 0 < free_port() < 65536


def test_launcher_returns_tensors_by_value(two: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(two):
        assert torch.equal(r["tensors"]["x"], torch.arange(4) + rank)
        assert torch.equal(r["tensors"]["y"], torch.full((2, 2), float(rank)))


# --------------------------------------------------------------------------------------
# 2 ranks: distribute / to_local / from_local / full_tensor
# --------------------------------------------------------------------------------------
def test_distribute(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert r["distribute_types"] == ["DTensor"] * 3
        assert r["distribute_placements"] == [
            "(Shard(dim=1),)",
            "(Shard(dim=0),)",
            "(Replicate(),)",
        ]
        assert r["distribute_batch"] == [5]
        assert r["distribute_values"] == 0.0  # rank 0's values everywhere (src_data_rank=0)
        assert r["distribute_local_a"] == [5, 2]
        assert r["input_unchanged"]
        assert r["callable_spec"] == "(Shard(dim=0),)"
        assert r["distribute_grad"] is True
    assert two[0]["own_values"] == 0.0  # src_data_rank=None keeps each rank's own values


def test_to_local_from_local_full_tensor(two: list[dict[str, Any]]) -> None:
    assert [r["to_local_batch"] for r in two] == [[3], [2]]  # 5 rows: torch.chunk 3 + 2
    for r in two:
        assert r["to_local_types"] == ["Tensor", "Tensor"]
        assert r["to_local_mixed_batch"] == []  # shards disagree on dim 0: batch dims dropped
        assert r["from_local_batch"] == [5]
        assert r["from_local_values"] == 0.0
        assert r["from_local_even_shape"] == [4, 3]
        assert r["from_local_even_batch"] == [4]
        assert r["full_tensor_even"] == [0.0, 0.0, 1.0, 1.0]
        assert r["full_tensor_batch"] == [4]


def test_local_errors(two: list[dict[str, Any]]) -> None:
    r0 = two[0]
    assert r0["from_local_bad_shape"] == [
        "ValueError",
        E.LOCAL_SHAPE.format(
            key="'x'",
            local=(3, 4),
            shape=(9, 4),
            placements=[Shard(0)],
            mesh_shape=(2,),
            expected=(5, 4),
        ),
    ]
    assert r0["from_local_dtensor"] == ["TypeError", E.ALREADY_DTENSOR.format(key="'x'")]
    assert r0["distribute_dtensor"] == ["TypeError", E.ALREADY_DTENSOR.format(key="'x'")]


# --------------------------------------------------------------------------------------
# 2 ranks: compiled, coalesced redistribution
# --------------------------------------------------------------------------------------
def test_one_graph_one_collective(two: list[dict[str, Any]]) -> None:
    for r in two:
        # 8 leaves (6 even, one uneven, one nested) -> one graph with one all_gather
        assert r["compiled_values"] == 0.0
        assert r["compiled_frames"] == 1
        assert r["compiled_collectives"] == ["all_gather_into_tensor"]
        assert r["compiled_type"] == "TensorDict"
        assert r["compiled_input_placements"] == "(Shard(dim=0),)"  # input not modified
        # new values, same structure: no recompile, and the cached function is reused
        assert r["second_call_frames"] == 1
        assert r["second_call_values"] == 0.0
        assert r["cache_hits"] >= 1


def test_new_transition_new_graph(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert r["new_transition_frames"] == 2
        assert r["new_transition_values"] == 0.0
        assert len(r["new_transition_collectives"]) == 1  # Shard(last) -> Shard(0), uneven
        assert r["partial_values"] == 0.0
        assert r["partial_collectives"] == ["all_reduce", "all_reduce"]  # one per dtype


def test_autograd_through_compiled_graph(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert r["grad_requires"] == [True, True]
        assert r["grad_values"] == 0.0  # same gradients as DTensor.redistribute leaf by leaf
        assert r["grad_placements"] == "(Shard(dim=0),)"


def test_traced_inside_user_compile(two: list[dict[str, Any]]) -> None:
    for r in two:
        assert r["outer_values"] == 0.0
        assert r["outer_frames"] == 1
        assert r["outer_collectives"] == ["all_gather_into_tensor"]
        assert r["outer_recompiles"] == 0
        assert r["to_local_compiled"]
        assert r["to_local_frames"] == 1


def test_sweep_1d_matches_dtensor(two: list[dict[str, Any]]) -> None:
    for r in two:
        s = r["sweep"]
        assert s["worst"] == 0.0
        assert s["done"] >= 9
        assert s["coalesced"] >= s["done"]


def test_redistribute_errors(two: list[dict[str, Any]]) -> None:
    r = two[0]
    assert r["err_length"] == [
        "ValueError",
        E.PLACEMENTS_LENGTH.format(
            key="'p0'", n=2, placements=[Replicate(), Replicate()], ndim=1, mesh_shape=(2,)
        ),
    ]
    assert r["err_distribute_length"] == [
        "ValueError",
        E.PLACEMENTS_LENGTH.format(key="'p0'", n=0, placements=[], ndim=1, mesh_shape=(2,)),
    ]
    assert r["err_shard_dim"] == [
        "ValueError",
        E.SHARD_DIM.format(key="('nested', 'q')", dim=1, mesh_dim=0, shape=(6,), ndim=1),
    ]
    assert r["err_distribute_dim"] == [
        "ValueError",
        E.SHARD_DIM.format(key="'p0'", dim=2, mesh_dim=0, shape=(4, 3), ndim=2),
    ]
    assert r["err_type"] == [
        "TypeError",
        E.PLACEMENT_TYPE.format(key="'p0'", value="shard", typ="str"),
    ]
    assert r["err_key"][0] == "KeyError"
    assert r["err_key"][1].startswith(
        E.UNKNOWN_PLACEMENT_KEY.format(key="'missing'", cls="TensorDict", available="")[:60]
    )
    mixed = E.MIXED_MESH.format(
        key="'z'",
        mesh="DeviceMesh(ranks=[1, 0], dim_names=None)",
        first_key="'p0'",
        first_mesh="DeviceMesh(ranks=[0, 1], dim_names=None)",
    )
    assert r["err_mixed"] == ["ValueError", mixed]
    assert r["err_mixed_full"] == ["ValueError", mixed]
    assert r["err_container"] == [
        "TypeError",
        E.NOT_A_CONTAINER.format(op="redistribute", typ="dict"),
    ]
    assert r["err_spec"] == ["TypeError", E.PLACEMENTS_SPEC.format(typ="int")]
    assert r["err_src_rank"] == [
        "ValueError",
        E.SRC_NOT_IN_MESH.format(src=7, mesh="DeviceMesh(ranks=[0, 1], dim_names=None)"),
    ]


def test_tensorclass_1d(two: list[dict[str, Any]]) -> None:
    for r in two:
        tc = r["tensorclass"]
        assert tc == {"type": "Pair", "values": 0.0, "local_type": "Pair"}


# --------------------------------------------------------------------------------------
# 4 ranks: 2-D mesh
# --------------------------------------------------------------------------------------
def test_sweep_2d_matches_dtensor(four: list[dict[str, Any]]) -> None:
    for r in four:
        s = r["sweep2d"]
        assert s["worst"] == 0.0
        assert s["done"] >= 30
        assert s["coalesced"] >= s["done"]  # every transition coalesces its even leaves
        assert s["per_leaf"] > 0  # nested uneven sharding keeps DTensor's per-leaf path


def test_distribute_2d(four: list[dict[str, Any]]) -> None:
    for r in four:
        assert r["2d_broadcast"] == 0  # rank 0's values everywhere
        assert r["2d_local_a"] == [2, 3]


def test_2d_one_graph(four: list[dict[str, Any]]) -> None:
    for r in four:
        assert r["2d_values"] == 0.0
        assert r["2d_frames"] == 1
        # (Shard(0), Shard(1)) -> replicated: one all_gather per mesh dim, for all 4 leaves
        assert r["2d_collectives"] == ["all_gather_into_tensor"] * 2


# --------------------------------------------------------------------------------------
# 4 ranks: send / recv from mesh A = [0, 1] to mesh B = [2, 3]
# --------------------------------------------------------------------------------------
def test_send_recv_local(four: list[dict[str, Any]]) -> None:
    for r in four[2:]:
        assert r["recv_types"] == {
            "w": "DTensor",
            "odd": "DTensor",
            "sub.b": "DTensor",
            "sub.col": "DTensor",
            "grad": "DTensor",
            "plain": "Tensor",
        }
        assert r["recv_placements"] == {
            "w": "(Shard(dim=0),)",
            "odd": "(Shard(dim=0),)",
            "sub.b": "(Replicate(),)",
            "sub.col": "(Shard(dim=1),)",
            "grad": "(Shard(dim=0),)",
        }
        assert r["recv_values"] == 0.0
        assert r["recv_grad"] is True
        assert r["recv_mesh"] == [2, 3]
        assert r["recv_batch"] == []
    assert four[2]["recv_plain"] == [0, 1, 2, 3]
    assert four[3]["recv_plain"] == [1, 2, 3, 4]


def test_send_recv_local_ships_only_shards(four: list[dict[str, Any]]) -> None:
    for r in four[:2]:
        # one consolidated message: metadata + this rank's shards, never the full tensors
        assert r["local_bytes"] < r["full_bytes"]
        assert r["local_shard_bytes"] < r["full_tensor_bytes"]
        assert (
            r["local_bytes"] - r["local_shard_bytes"]
            < r["full_bytes"] - r["full_tensor_bytes"] + 64 * 8
        )


def test_send_recv_full_and_2d(four: list[dict[str, Any]]) -> None:
    for r in four[2:]:
        assert r["full_types"] == ["Tensor"]
        assert r["full_values"] == 0.0
        assert r["row_values"] == 0.0  # (1, 2) mesh -> (1, 2) mesh, then replicated
        assert r["row_placements"] == "(Replicate(), Replicate())"
        assert r["row_mesh"] == [[2, 3]]


def test_recv_redistributes_in_one_graph(four: list[dict[str, Any]]) -> None:
    for r in four[2:]:
        assert r["recv_redistributed"] == 0.0
        assert r["recv_redistributed_frames"] == 1
        assert r["recv_redistributed_collectives"] == ["all_gather_into_tensor"]


def test_tensorclass_travels(four: list[dict[str, Any]]) -> None:
    for r in four[2:]:
        assert r["tc_type"] == "Pair"
        assert r["tc_values"] == 0.0


def test_bad_pairings_raise_on_both_sides(four: list[dict[str, Any]]) -> None:
    for src in (0, 1):
        dst = src + 2
        snd, rcv = four[src], four[dst]
        crossed_dst = 3 - src
        crossed = E.MESH_MISMATCH.format(
            src=src,
            src_coord=(src,),
            src_shape=(2,),
            dst=crossed_dst,
            dst_coord=(1 - src,),
            dst_shape=(2,),
        )
        assert snd["err_crossed"] == [
            "ValueError",
            E.RECEIVER_FAILED.format(dst=crossed_dst, reason=crossed),
        ]
        assert four[crossed_dst]["err_crossed"] == ["ValueError", crossed]
        shape = E.MESH_MISMATCH.format(
            src=src, src_coord=(src,), src_shape=(2,), dst=dst, dst_coord=(1, src), dst_shape=(2, 2)
        )
        assert rcv["err_shape"] == ["ValueError", shape]
        assert snd["err_shape"] == ["ValueError", E.RECEIVER_FAILED.format(dst=dst, reason=shape)]
        no_mesh = E.NO_RECV_MESH.format(src=src, dst=dst)
        assert rcv["err_no_mesh"] == ["ValueError", no_mesh]
        assert snd["err_no_mesh"] == [
            "ValueError",
            E.RECEIVER_FAILED.format(dst=dst, reason=no_mesh),
        ]
        length = E.RECV_PLACEMENTS_LENGTH.format(dst=dst, n=2, ndim=1)
        assert rcv["err_recv_len"] == ["ValueError", length]
        assert snd["err_recv_len"] == [
            "ValueError",
            E.RECEIVER_FAILED.format(dst=dst, reason=length),
        ]
        nm = E.RECV_PLACEMENTS_NO_MESH.format(dst=dst)
        assert rcv["err_recv_no_mesh"] == ["ValueError", nm]
        assert snd["err_recv_no_mesh"] == [
            "ValueError",
            E.RECEIVER_FAILED.format(dst=dst, reason=nm),
        ]
        strategy = E.BAD_STRATEGY.format(strategy="fastest")
        assert snd["err_strategy"] == ["ValueError", strategy]
        assert rcv["err_strategy"] == [
            "ValueError",
            E.SENDER_FAILED.format(src=src, reason=strategy),
        ]
        assert snd["err_send_mixed"][0] == "ValueError"
        assert snd["err_send_mixed"][1].startswith("key 'z' lives on DeviceMesh(ranks=[[0, 1]")
        assert rcv["err_send_mixed"] == [
            "ValueError",
            E.SENDER_FAILED.format(src=src, reason=snd["err_send_mixed"][1]),
        ]
        not_in = E.RECV_NOT_IN_MESH.format(dst=dst, src=src)
        assert rcv["err_recv_not_in_mesh"] == ["ValueError", not_in]
        assert snd["err_recv_not_in_mesh"] == [
            "ValueError",
            E.RECEIVER_FAILED.format(dst=dst, reason=not_in),
        ]
        assert rcv["err_bad_header"] == [
            "ValueError",
            E.BAD_HEADER.format(dst=dst, src=src, magic=0, version=0),
        ]
        assert rcv["err_not_in_mesh"] == [
            "ValueError",
            E.NOT_IN_MESH.format(
                rank=dst, mesh="DeviceMesh(ranks=[0, 1], dim_names=None)", op="distribute"
            ),
        ]
        assert rcv["err_recv_dim"] == [
            "ValueError",
            E.SHARD_DIM.format(key="'w'", dim=3, mesh_dim=0, shape=(6, 4), ndim=2),
        ]
