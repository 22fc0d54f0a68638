"""tdfunc.distributed under faults: ranks that disagree, peers that never answer, messages that
are not ours, ranks that die; and the public surface of the package.

Every multi-process check runs in real gloo groups spawned by ``tdfunc.testing.launch``
with short deadlines, so each one terminates even when the code
under test hangs (the launcher then kills the ranks and the test fails with a ``RankError``).
"""

from __future__ import annotations

import importlib
import pickle
import warnings
from typing import Any

import _dist_workers as W
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tdfunc import distributed as tdd
from tdfunc.distributed._common import errors as E
from tdfunc.distributed._common import wire
from tdfunc.testing import RankError, launch

pytestmark = pytest.mark.slow

MESH2 = "DeviceMesh(ranks=[0, 1], dim_names=None)"


# --------------------------------------------------------------------------------------
# ranks that ask for different things: ValueError on every rank, never mixed data
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disagree() -> list[dict[str, Any]]:
    return launch(W.run_disagree, 2, timeout=120, pg_timeout=20)


def _disagree_text(op: str, what: str, rank: int, mine: str) -> str:
    return E.DISAGREE.format(
        op=op, mesh=MESH2, ranks="1", leader=0, what=what, rank=rank, mine=mine
    )


def test_redistribute_placements_must_agree(disagree: list[dict[str, Any]]) -> None:
    mine = [
        "{'a': ('Replicate()',), 'b': ('Replicate()',)}",
        "{'a': ('Shard(dim=0)',), 'b': ('Shard(dim=0)',)}",
    ]
    for rank, r in enumerate(disagree):
        assert r["placements"] == [
            "ValueError",
            _disagree_text("redistribute", "target placements", rank, mine[rank]),
        ]


def test_a_rank_that_rejects_its_arguments_stops_the_others(
    disagree: list[dict[str, Any]],
) -> None:
    for op in ("redistribute", "distribute"):
        key = "rejected" if op == "redistribute" else "rejected_distribute"
        assert disagree[0][key] == [
            "ValueError",
            E.PEER_REJECTED.format(op=op, mesh=MESH2, ranks="1"),
        ]
        assert disagree[1][key] == [
            "ValueError",
            E.SHARD_DIM.format(key="'b'", dim=1, mesh_dim=0, shape=(4,), ndim=1),
        ]


def test_structures_must_agree(disagree: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(disagree):
        keys = "keys ['a', 'b']" if rank == 0 else "keys ['a', 'b', 'c']"
        what = "key paths and the global shapes and the dtypes and the source placements and the target placements"
        assert r["keys"] == ["ValueError", _disagree_text("redistribute", what, rank, keys)]
        assert r["full_keys"] == ["ValueError", _disagree_text("full_tensor", what, rank, keys)]


def test_distribute_must_agree(disagree: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(disagree):
        kind, text = r["distribute_shapes"]
        assert kind == "ValueError"
        assert "differ from rank 0 in the global shapes" in text
        shape_b = "(4,)" if rank == 0 else "(6,)"
        assert f"'b': {shape_b}" in text
        assert r["distribute_dtypes"][0] == "ValueError"
        assert "differ from rank 0 in the dtypes" in r["distribute_dtypes"][1]
        assert r["distribute_src"][0] == "ValueError"
        assert "differ from rank 0 in the operation" in r["distribute_src"][1]
        assert f"distribute(src_data_rank={rank})" in r["distribute_src"][1]


def test_group_still_works_after_disagreement(disagree: list[dict[str, Any]]) -> None:
    for r in disagree:
        assert r["after_values"] == 0.0
        assert r["cached"] == ["", ""]


# --------------------------------------------------------------------------------------
# send / recv: timeouts that name the peer, messages that are not ours
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def silent() -> list[dict[str, Any]]:
    # pg_timeout (60 s) is far above the timeouts used: a wait that ignored timeout= would
    # run into the launcher's deadline and fail the test
    return launch(W.run_silent_peers, 4, timeout=60, pg_timeout=60)


def test_stray_message_is_not_received(silent: list[dict[str, Any]]) -> None:
    """A plain dist.send larger than our header used to abort the receiver inside gloo."""
    hint = E.PEER_HINT.format(peer=0, other="send", rank=1)
    assert silent[1]["stray_recv"] == [
        "TimeoutError",
        E.PEER_TIMEOUT.format(
            op="recv", rank=1, peer=0, timeout="1 s", step="send a transfer header", hint=hint
        ),
    ]
    assert silent[0]["stray"] == "not delivered"


def test_recv_from_a_silent_peer_times_out(silent: list[dict[str, Any]]) -> None:
    hint = E.PEER_HINT.format(peer=2, other="send", rank=0)
    assert silent[0]["recv_silent"] == [
        "TimeoutError",
        E.PEER_TIMEOUT.format(
            op="recv", rank=0, peer=2, timeout="1.5 s", step="send a transfer header", hint=hint
        ),
    ]


def test_send_to_a_silent_peer_times_out(silent: list[dict[str, Any]]) -> None:
    hint = E.PEER_HINT.format(peer=2, other="recv", rank=3)
    assert silent[3]["send_silent"] == [
        "TimeoutError",
        E.PEER_TIMEOUT.format(
            op="send",
            rank=3,
            peer=2,
            timeout="1 s",
            step="accept the transfer (call recv)",
            hint=hint,
        ),
    ]


def test_bad_timeout_is_refused_before_any_message(silent: list[dict[str, Any]]) -> None:
    for r in silent:
        assert r["bad_timeout"] == ["ValueError", E.BAD_TIMEOUT.format(timeout=-1.0)]


def test_transfer_tags_are_distinct() -> None:
    tags = [wire.HEADER_TAG, wire.REPLY_TAG, wire.TEXT_TAG, wire.DATA_TAG]
    from tdfunc.distributed._common import agree as _agree

    tags += [_agree.AGREE_TAG, _agree.VERDICT_TAG]
    assert len(set(tags)) == len(tags)
    assert all(0 < t < 2**31 for t in tags)  # gloo slots take 32-bit tags
    assert 0 not in tags  # the default tag of dist.send never reaches our receivers


# --------------------------------------------------------------------------------------
# the launcher blames the rank that failed first
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("how", "code", "text"),
    [
        ("exit", 3, "exited with code 3 without reporting a result"),
        ("SIGKILL", -9, "was killed by SIGKILL (exit code -9)"),
        ("SIGSEGV", -11, "was killed by SIGSEGV (exit code -11)"),
    ],
)
def test_launcher_blames_the_rank_that_died(how: str, code: int, text: str) -> None:
    with pytest.raises(RankError) as e:
        launch(W.rank_one_exits, 2, args=(how,), timeout=60, pg_timeout=30, grace=3.0)
    assert e.value.rank == 1
    assert e.value.exitcode == code
    assert str(e.value).startswith(f"rank 1 of 2 {text}")
    assert "failed after it: rank 0 (lost its peers)" in str(e.value)
    if how == "SIGSEGV":  # faulthandler's stack of the dead rank
        assert e.value.traceback is not None
        assert "in rank_one_exits" in e.value.traceback


def test_launcher_reports_a_result_that_cannot_travel() -> None:
    with pytest.raises(RankError) as e:
        launch(W.returns_unpicklable, 2, timeout=60, pg_timeout=30)
    assert e.value.rank == 1
    assert str(e.value).startswith("rank 1 of 2 failed:")
    assert "pickle" in str(e.value)


# --------------------------------------------------------------------------------------
# the public surface: operations only; the old names warn for one release
# --------------------------------------------------------------------------------------
def test_public_api_is_the_operations() -> None:
    assert sorted(tdd.__all__) == [
        "CheckpointConflictError",
        "CheckpointCorruptError",
        "CheckpointDigestError",
        "CheckpointError",
        "DEFAULT_BACKEND",
        "DEFAULT_TIMEOUT",
        "PendingSave",
        "ShardedStep",
        "Traffic",
        "Transfer",
        "TransferMetadataError",
        "TransferPlan",
        "cache_clear",
        "checkpoint_digest",
        "distribute",
        "export_safetensors",
        "from_local",
        "full_tensor",
        "load_checkpoint",
        "recv",
        "redistribute",
        "save_checkpoint",
        "send",
        "sharded_step",
        "to_local",
        "transfer_plan",
    ]
    for name in tdd.__all__:  # every public name is importable from the package itself
        assert getattr(tdd, name) is not None
    assert tdd.DEFAULT_TIMEOUT == 120.0


@pytest.mark.parametrize(
    ("name", "home"),
    [
        ("launch", "tdfunc.testing"),
        ("free_port", "tdfunc.distributed._common.launch"),
        ("RankError", "tdfunc.testing"),
        ("encode_placement", "tdfunc.distributed._common.placements"),
        ("encode_placements", "tdfunc.distributed._common.placements"),
        ("decode_placement", "tdfunc.distributed._common.placements"),
        ("decode_placements", "tdfunc.distributed._common.placements"),
    ],
)
def test_moved_names_are_deprecated_aliases(name: str, home: str) -> None:
    with pytest.warns(DeprecationWarning, match=f"tdfunc.distributed.{name} is deprecated") as w:
        value = getattr(tdd, name)
    assert f"{home}.{name}" in str(w[0].message)  # the warning names the new home
    assert value is getattr(importlib.import_module(home), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from tdfunc.distributed import redistribute  # the API itself does not warn

        assert callable(redistribute)


def test_unknown_names_still_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        _ = tdd.nothing_here


def test_placement_spec_keys_use_the_core_key_rules() -> None:
    from tdfunc._keys import as_path
    from tdfunc.distributed._common.placements import resolve

    pairs = [(("a",), torch.zeros(2)), (("n", "b"), torch.zeros(2))]
    got = resolve(
        pairs, {"a": [Shard(0)], ("n",): [Replicate()]}, [("a",), ("n",), ("n", "b")], "TD"
    )
    assert got == [[Shard(0)], [Replicate()]]
    with pytest.raises(TypeError) as e:
        resolve(pairs, {3: [Shard(0)]}, [("a",)], "TD")
    with pytest.raises(TypeError) as core:
        as_path(3)
    assert str(e.value) == str(core.value)


# --------------------------------------------------------------------------------------
# batch sizes when leaves change size (local shards <-> global tensors)
# --------------------------------------------------------------------------------------
def _td() -> Any:
    import tdfunc

    inner = tdfunc.TensorDict(c=torch.zeros(4, 3, 7), batch_size=[4, 3])
    return tdfunc.TensorDict(a=torch.zeros(4, 5), n=inner, batch_size=[4])


@pytest.mark.parametrize(
    ("a", "c", "root", "nested"),
    [
        ((2, 5), (2, 3, 7), [2], [2, 3]),  # sharded along the batch dim: both keep their dims
        ((2, 5), (2, 1, 7), [2], [2]),  # the nested extra dim no longer fits: dropped
        ((2, 5), (3, 3, 7), [], []),  # the leaves disagree on the batch dim
        ((4, 5), (4, 3, 2), [4], [4, 3]),  # a feature dim changed: batch sizes unchanged
    ],
)
def test_rebatch_keeps_every_node_valid(
    a: tuple[int, ...], c: tuple[int, ...], root: list[int], nested: list[int]
) -> None:
    from tdfunc.distributed._common.mesh import rebatch

    td = _td()
    out = rebatch(td, [torch.ones(a), torch.ones(c)])
    assert list(out.batch_size) == root
    assert list(out["n"].batch_size) == nested
    assert out["n", "c"].shape == c
    assert list(td.batch_size) == [4]  # input not modified
    assert list(td["n"].batch_size) == [4, 3]


def test_launcher_reports_arguments_that_cannot_reach_the_ranks() -> None:
    """The spawn start method pickles ``args``: that error is the one raised (the launcher
    used to hide it behind an AssertionError while cleaning up ranks it never started)."""
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)) as e:
        launch(W.sleeps, 2, args=(lambda: 0,), timeout=30)
    assert "pickle" in str(e.value).lower()
