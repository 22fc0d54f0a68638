"""Planned transfers between meshes (strategy "plan", Transfer), end to end on gloo.

One launch of 6 ranks (``tests/_dist_workers.py::run_plan``) covers 4+2 and 2+2 transfers
between disjoint and overlapping meshes on a nested TensorDict of 60 leaves of 10 dtypes,
replicated and partial sources, partial targets, a tensorclass, the mismatches that must
raise ``ValueError`` on every side and a peer that never answers; a second run starts 4
ranks with ``python -m torch.distributed.run`` (``env://``), as real programs do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _dist_workers as W
import pytest
from torch.distributed.tensor import Replicate, Shard

from tdfunc.distributed import transfer_plan
from tdfunc.distributed._common import errors as E

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def six() -> list[dict[str, Any]]:
    # one launch shared with tests/test_distributed.py (its 4-rank checks run on ranks 0-3)
    return [r["plan"] for r in W.six()]


def _ok(check: dict[str, Any]) -> None:
    assert check["wrong"] == []
    assert check["n"] == 60


def test_container_is_mixed(six: list[dict[str, Any]]) -> None:
    assert six[0]["leaves"] == 60
    assert len(six[0]["dtypes"]) == 10


def test_4_plus_2_disjoint_reusable_and_compiled(six: list[dict[str, Any]]) -> None:
    """[2, 2] (S0, S1) -> [2] (S(last)): two steps of one Transfer, one graph per rank."""
    full = W.mixed_full()
    everything = sum(x.numel() * x.element_size() for x in full.leaves())
    expected = transfer_plan(full, [[0, 1], [2, 3]], W._two_d, [4, 5], W._last)
    for r in six[4:]:
        _ok(r["A_check"])
        _ok(r["A_check2"])  # new values, same plan
        assert r["A_placements"] == "(Shard(dim=1),)"
        assert r["A_type"] == "TensorDict"
        assert r["A_full_tensor"]  # full_tensor of the received == the source
        assert r["A_frames"] == 1  # one unpack graph, no recompile on the second step
    for r in six[:4]:
        assert r["A_frames"] == 1  # one pack graph
        assert r["A_full_ok"]
    for r in six:
        total, messages, sent = r["A_bytes"]
        # every element reaches exactly one receiver: the minimum is every leaf's bytes once
        assert total == everything == expected.bytes.total
        assert messages == 8  # 4 senders x 2 receivers, one message per pair
        assert {int(k): v for k, v in sent.items()} == expected.bytes.sent
    for rank in range(4):
        # each step: this sender's payload plus one 64-byte header per receiver
        assert six[rank]["A_sent"] == [expected.bytes.sent[rank] + 2 * 64] * 2


def test_2_plus_2_disjoint_one_shot(six: list[dict[str, Any]]) -> None:
    for r in six[2:4]:
        _ok(r["B_check"])
        assert r["B_placements"] == "(Shard(dim=2),)"


def test_4_plus_2_overlapping(six: list[dict[str, Any]]) -> None:
    """[0, 1, 2, 3] (S0) -> [3, 4]: rank 3 sends, copies its own rows and receives."""
    for r in six[3:5]:
        _ok(r["C_check"])
    plan = transfer_plan(W.mixed_full(), [0, 1, 2, 3], [Shard(0)], [3, 4], W._last)
    assert plan.bytes.local.get(3, 0) > 0
    assert all(m.src != m.dst for m in plan.messages)
    assert six[0]["C_sent"] == plan.bytes.sent[0] + 64 * len(plan.sends(0))


def test_2_plus_2_overlapping_one_call_everywhere(six: list[dict[str, Any]]) -> None:
    """[0, 1] -> [1, 2], every rank calling recv(..., source=...): a sender only gets None."""
    assert six[0]["D_none_on_pure_sender"] is True
    for r in six[1:3]:
        _ok(r["D_check"])


def test_replicated_and_partial(six: list[dict[str, Any]]) -> None:
    for r in six[4:]:
        assert r["E_values"] < 1e-6  # Partial sources reduced, Partial("sum") target
        assert r["E_plain"] == [0, 1, 2, 3, 4]
        assert r["E_plain_type"] == "Tensor"
        assert r["E_grad"] == [True, True, False]  # requires_grad travels; a fresh leaf
    assert six[4]["E_partial_local"] > 0  # coordinate 0 of Partial("sum") holds the values
    assert six[5]["E_partial_local"] == 0.0  # the others hold zeros
    assert six[4]["E_tc"] == ["Pair", [4], True]


def test_mismatches_raise_on_every_side(six: list[dict[str, Any]]) -> None:
    expect = E.PLAN_DISAGREE.format(
        op="send",
        rank=0,
        other=2,
        key="'w'",
        mine="[Shard(dim=0)]",
        theirs="[Shard(dim=1)]",
    )
    disagree = E.PLAN_DISAGREE.format(
        op="send",
        rank=3,
        other=2,
        key="'w'",
        mine="[Replicate()]",
        theirs="[Shard(dim=1)]",
    )
    differs = E.PLAN_LAYOUT_DIFFERS.format(
        rank=1, leader=0, what="dtypes (key 'w': float64 vs float32)"
    )
    layout = E.PLAN_REJECTED.format(op="send", ranks="1", reason=differs)
    strategy = E.PLAN_STRATEGY.format(strategy="full")
    key_error = E.UNKNOWN_PLACEMENT_KEY.format(key="'nope'", cls="TensorDict", available="'w'")
    for rank in range(4):
        r = six[rank]
        assert r["F_expect"] == ["ValueError", expect]  # sender expected other placements
        assert r["F_disagree"] == ["ValueError", disagree]  # receivers disagree
        # senders pass different containers (the odd one raises its own error)
        assert r["F_layout"] == ["ValueError", differs if rank == 1 else layout]
        if rank == 3:
            assert r["F_key"] == ["KeyError", key_error]  # its own error, its own type
        else:
            assert r["F_key"] == [
                "ValueError",
                E.PLAN_REJECTED.format(op="send", ranks="3", reason=key_error),
            ]
        assert r["F_step_ok"]
        assert r["F_after"]  # the Transfer still works after a failed step
    for rank in (0, 1):  # the senders' own error; the receivers learn it from rank 0
        assert six[rank]["F_strategy"] == ["ValueError", strategy]
    for rank in (2, 3):
        assert six[rank]["F_strategy"] == [
            "ValueError",
            E.PLAN_LEADER_FAILED.format(op="recv", leader=0, reason=strategy),
        ]
    step = E.PLAN_STEP_LAYOUT.format(
        rank=0, what="global shape of key 'w' ((4, 7) instead of (4, 6))"
    )
    assert six[0]["F_step"] == ["ValueError", step]
    assert six[1]["F_step"] == ["", ""]
    for rank in (2, 3):  # the receivers of the failed sender learn why
        assert six[rank]["F_step"] == ["ValueError", E.SENDER_FAILED.format(src=0, reason=step)]


def test_roles_and_local_errors(six: list[dict[str, Any]]) -> None:
    role = E.PLAN_ROLE_RECV.format(rank=1, mesh=[1, 2])
    assert six[1]["F_role"] == ["ValueError", role]
    for rank in (0, 2):
        assert six[rank]["F_role"] == [
            "ValueError",
            E.PLAN_REJECTED.format(op="send", ranks="1", reason=role),
        ]
    for r in six:
        assert r["F_no_dtensor"] == ["ValueError", E.PLAN_NO_DTENSOR.format(op="send")]
    assert six[4]["F_outside"] == [
        "ValueError",
        E.PLAN_NOT_IN.format(rank=4, src=[0, 1], dst=[2, 3]),
    ]
    for rank in (0, 1):  # in the sending mesh, called recv without source=
        source = E.PLAN_ROLE_SOURCE.format(rank=rank, mesh=[0, 1])
        assert six[rank]["F_outside"] == ["ValueError", source]
    for rank in (2, 3):
        assert six[rank]["F_outside"] == [
            "ValueError",
            E.PLAN_LEADER_FAILED.format(
                op="recv", leader=0, reason=E.PLAN_ROLE_SOURCE.format(rank=0, mesh=[0, 1])
            ),
        ]


def test_silent_sender_times_out(six: list[dict[str, Any]]) -> None:
    kind, text = six[4]["G_timeout"]
    assert kind == "TimeoutError"
    assert text.startswith("recv: rank 4 waited 1 s for rank 0 to send the layout")


def test_torchrun_env_init(tmp_path: Path) -> None:
    """4 ranks started by ``python -m torch.distributed.run --standalone`` (env://)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(ROOT / "tests" / "_dist_workers.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["world"] for r in out] == [4] * 4
    full = W.mixed_full(3)
    plan = transfer_plan(full, [0, 1], [Shard(0)], [2, 3], W._last)
    for r in out[:2]:
        assert r["steps"] == [plan.bytes.sent[r["rank"]] + 2 * 64] * 3
    for r in out[2:]:
        for check in r["steps"]:
            _ok(check)
    for r in out:
        assert r["bytes"] == plan.bytes.total
    assert out[0]["overlap"] is None  # in the sending mesh only
    for r in out[1:3]:
        _ok(r["overlap"])
    assert Replicate() == Replicate()
