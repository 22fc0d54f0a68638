"""tdfunc.distributed.sharded_step: a data-parallel step over sharded parameters.

Every multi-rank run (50 steps, a checkpoint after 25) is compared with one process training
the same model on the whole batch (float64; the sums run in another order, so values agree to
rounding, not bit for bit).
A 2-rank launch trains eagerly and compiled and saves a checkpoint midway; a 1-rank launch
resumes from it; a 4-rank launch trains eagerly and a 2-rank launch resumes its checkpoint;
error paths run on 2 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _dist_training as W
import pytest
import torch

from tdfunc import optim
from tdfunc.distributed import ShardedStep, sharded_step
from tdfunc.testing import RankError, launch

pytestmark = pytest.mark.slow
TOL = {"rtol": 1e-9, "atol": 1e-11}


@pytest.fixture(scope="module")
def ref() -> tuple[list[float], dict[str, list[float]]]:
    return W.reference()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    ckpt = tmp_path_factory.mktemp("train") / "ckpt"
    return launch(W.run_train, 2, args=(str(ckpt),), timeout=300, pg_timeout=60), ckpt


def _close(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(torch.tensor(got[k]), torch.tensor(want[k]), **TOL, msg=k)


def test_sharded_step_matches_one_process(two: Any, ref: Any) -> None:
    res, _ = two
    losses, params = ref
    for r in res:
        torch.testing.assert_close(torch.tensor(r["eager_losses"]), torch.tensor(losses), **TOL)
        _close(r["eager_params"], params)
    # the loss goes down: the comparison is not between two things that do nothing
    assert losses[-1] < losses[0]


def test_layout_kept_and_inputs_unchanged(two: Any) -> None:
    res, _ = two
    for r in res:
        assert r["inputs_unchanged"] is True
        assert r["placements"]["embed.weight"] == "Shard(dim=0)"
        assert r["placements"]["head.bias"] == "Replicate()"
        assert r["out_placements"] == list(r["placements"].values())


def test_small_buckets_give_the_same_values(two: Any) -> None:
    res, _ = two
    for r in res:
        b = r["buckets"]
        assert b["default_groups"] == 1  # the tiny model fits one 4 MiB bucket
        assert b["groups"] > 3  # a collective per leaf or two
        assert b["losses_equal"] is True
        assert b["params_equal"] is True


def test_units_step_matches_the_whole_model_step(two: Any, ref: Any) -> None:
    res, _ = two
    losses, params = ref
    for r in res:
        # each element's gradient is reduced over the same two ranks: bit for bit
        assert r["units_losses"] == r["eager_losses"]
        assert r["units_params"] == r["eager_params"]
        torch.testing.assert_close(torch.tensor(r["units_losses"]), torch.tensor(losses), **TOL)
        # three units gathered once each in the forward, the rest (embedding, head) once;
        # the backward gathers the three units again (the rest stays gathered)
        assert r["units_gathers"] == (4, 3)
        d = r["units_donated"]
        assert d["losses"] == r["units_losses"][: W.DONATED_STEPS]
        assert d["in_place"] is True
        # compiled with units: one frame for the 50 steps (no recompile), the same values
        assert r["units_compiled_frames"] == 1
        torch.testing.assert_close(
            torch.tensor(r["units_compiled_losses"]), torch.tensor(losses), **TOL
        )
        _close(r["units_compiled_params"], params)


def test_units_step_lets_each_unit_go_after_its_forward() -> None:
    res = launch(W.run_unit_schedule, 2, timeout=200, pg_timeout=60)
    for r in res:
        assert r["loss"] == r["whole_loss"]
        assert r["gathers"] == (4, 3)
        alive = r["alive"]
        # units 1 and 2 (self_attn, linear1) are gone by the end of the forward: nothing
        # (autograd included) holds their full values; unit 3 (linear2) is the one in use
        assert alive["end of forward"][1] == 0
        assert alive["end of forward"][2] == 0
        assert alive["end of forward"][3] > 0
        # once the forward is over, no unit's full values are alive; the rest (unit 0: the
        # embedding and the head) is, saved by autograd as FSDP2 keeps its root
        start = alive["start of backward"]
        assert start[1] == start[2] == start[3] == 0
        assert start[0] > 0
        assert r["write"].startswith("TypeError: sharded_step: the forward writes parameter")
        assert "('head', 'weight')" in r["write"]
        assert "mul_" in r["write"]
        assert r["disagree"].startswith("ValueError: sharded_step")
        assert r["good_after"] is True
    assert res[1]["missing"].startswith("KeyError")
    assert "'nope'" in res[1]["missing"]
    assert res[0]["missing"].startswith("ValueError")
    assert "rank(s) 1" in res[0]["missing"]


def test_optim_step_runs_the_fused_kernel_on_dtensor_shards() -> None:
    res = launch(W.run_fused_dtensor_step, 2, timeout=200, pg_timeout=60)
    for r in res:
        # the clip reduces over the ranks (DTensors), the fused AdamW runs on the local shards
        assert r["pure_fused"] is True
        assert r["donated_fused"] is True
        assert r["close"] is True  # the values of update + apply_updates, to rounding
        assert r["donated_equal"] is True
        assert r["in_place"] is True
        assert r["input_unchanged"] is True
        assert r["placements"] == ["Shard(dim=0)", "Replicate()"]


def test_compiled_step_is_one_graph_and_matches(two: Any, ref: Any) -> None:
    res, _ = two
    losses, params = ref
    for r in res:
        assert r["frames"] == 1  # one graph for all the steps: no graph break, no recompile
        torch.testing.assert_close(torch.tensor(r["compiled_losses"]), torch.tensor(losses), **TOL)
        _close(r["compiled_params"], params)


def test_donated_step_writes_the_same_values_into_the_given_shards(two: Any) -> None:
    res, _ = two
    n = W.DONATED_STEPS
    for r in res:
        for name, undonated in (("eager", r["eager_losses"]), ("compiled", r["compiled_losses"])):
            d = r[f"donated_{name}"]
            assert d["losses"] == undonated[:n], name  # bit for bit
            assert d["in_place"] is True, name
            # the first call writes into detached views of its inputs (they require grad)
            assert d["same_objects"] == [False] + [True] * (n - 1), name
            assert d["reuse"].startswith("DonatedError: params was donated to sharded_step"), d
            assert "(call 1)" in d["reuse"]
        assert r["donated_frames"] == 1


def test_resume_on_one_rank_continues_the_trajectory(two: Any, ref: Any) -> None:
    _res, ckpt = two
    losses, params = ref
    (resumed,) = launch(W.run_resume, 1, args=(str(ckpt),), timeout=200, pg_timeout=60)
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(losses[W.SPLIT :]), **TOL
    )
    _close(resumed["params"], params)


def test_four_ranks_match_and_resume_on_two(tmp_path: Path, ref: Any) -> None:
    losses, params = ref
    ckpt = str(tmp_path / "ckpt")
    # eager only: the compiled step is checked on 2 ranks (the graph does not depend on n)
    res = launch(W.run_train, 4, args=(ckpt, False), timeout=400, pg_timeout=90)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["eager_losses"]), torch.tensor(losses), **TOL)
        _close(r["eager_params"], params)
        torch.testing.assert_close(torch.tensor(r["units_losses"]), torch.tensor(losses), **TOL)
        _close(r["units_params"], params)
    resumed = launch(W.run_resume, 2, args=(ckpt,), timeout=200, pg_timeout=60)
    for r in resumed:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(losses[W.SPLIT :]), **TOL
        )
        _close(r["params"], params)


def test_hsdp_on_a_two_by_two_mesh_matches_one_process(tmp_path: Path, ref: Any) -> None:
    """Sharded within pairs of ranks, replicated across the pairs (HSDP): the gradients are
    reduce-scattered over the shard dim and averaged over the replicate dim."""
    losses, params = ref
    ckpt = str(tmp_path / "ckpt")
    res = launch(W.run_hsdp, 4, args=(ckpt,), timeout=400, pg_timeout=90)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["eager_losses"]), torch.tensor(losses), **TOL)
        _close(r["eager_params"], params)
        assert r["placements"] == [
            "(Replicate(), Replicate())",
            "(Replicate(), Shard(dim=0))",
        ]
        # gathered by unit, donated: the same values as the whole-model step
        assert r["units_losses"] == r["eager_losses"]
        assert r["units_params"] == r["eager_params"]
        torch.testing.assert_close(
            torch.tensor(r["compiled_losses"]), torch.tensor(losses[:10]), **TOL
        )
        assert r["frames"] == 1
    # the HSDP checkpoint resumes on 2 ranks of a 1-D mesh, on the same trajectory
    resumed = launch(W.run_resume, 2, args=(ckpt,), timeout=200, pg_timeout=60)
    for r in resumed:
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(losses[W.SPLIT :]), **TOL
        )
        _close(r["params"], params)


def test_gpt2_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    losses, params = W.reference(kind="gpt2")
    res = launch(
        W.run_train, 2, args=(str(tmp_path / "ckpt"), False, "gpt2"), timeout=400, pg_timeout=90
    )
    for r in res:
        torch.testing.assert_close(torch.tensor(r["eager_losses"]), torch.tensor(losses), **TOL)
        _close(r["eager_params"], params)
        # gathered block by block: the same values (the tied embedding and head are the rest)
        assert r["units_losses"] == r["eager_losses"]
        assert r["units_params"] == r["eager_params"]
        assert r["units_gathers"] == (3, 2)
    assert "transformer.wte.weight" in params  # the tied embedding and head: one leaf
    assert "lm_head.weight" not in params
    assert losses[-1] < losses[0]


def test_ranks_that_disagree_all_raise() -> None:
    res = launch(W.run_errors, 2, timeout=200, pg_timeout=60)
    for r in res:
        assert r["batch_shape"].startswith("ValueError: sharded_step"), r["batch_shape"]
        assert "global shapes" in r["batch_shape"]
        assert r["good_after"] is True
    # rank 1 asked for a column shard: it names the key, rank 0 hears that rank 1 rejected
    assert "ValueError" in res[1]["placement"]
    assert "('embed', 'weight')" in res[1]["placement"]
    assert "Shard(dim=1)" in res[1]["placement"]
    assert res[0]["placement"].startswith("ValueError")
    assert "rank(s) 1" in res[0]["placement"]
    # rank 0 passed plain tensors: a TypeError naming a key there, rank 1 hears of it
    assert res[0]["plain"].startswith("TypeError")
    assert "DTensor" in res[0]["plain"]
    assert res[1]["plain"].startswith("ValueError")
    assert "rank(s) 0" in res[1]["plain"]
    local = res[0]["local_errors"]
    assert local["loss_fn"].startswith("TypeError")
    assert "loss_fn" in local["loss_fn"]
    assert local["optimizer"].startswith("TypeError")
    assert "GradientTransformation" in local["optimizer"]
    assert local["container"].startswith("TypeError")
    assert "list" in local["container"]


def test_a_dead_rank_makes_the_others_fail() -> None:
    with pytest.raises(RankError) as info:
        launch(W.run_dead_rank, 2, timeout=120, pg_timeout=10)
    assert info.value.rank == 1
    assert info.value.exitcode == 3


def test_constructor_checks() -> None:
    with pytest.raises(TypeError, match="loss_fn"):
        sharded_step(None, optim.sgd(0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GradientTransformation"):
        sharded_step(lambda p, b: p, "adam")  # type: ignore[arg-type]
    for bad, error in (
        (0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("4", TypeError),
        (True, TypeError),
        (None, TypeError),
    ):
        with pytest.raises(error, match=r"bucket_mb must be a positive number of MiB, got"):
            sharded_step(lambda p, b: p, optim.sgd(0.1), bucket_mb=bad)  # type: ignore[arg-type]
    for bad_units in ("h.0", ["h.0", 3], [""], {"h.0"}):
        with pytest.raises(TypeError, match=r"units must be a list or tuple of key prefixes"):
            sharded_step(lambda p, b: p, optim.sgd(0.1), units=bad_units)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unit 'h.0' is given twice"):
        sharded_step(lambda p, b: p, optim.sgd(0.1), units=["h.0", "h.1", "h.0"])
    by_unit_compiled = sharded_step(lambda p, b: p, optim.sgd(0.1), units=["h.0"], compile=True)
    assert by_unit_compiled.compiled is True
    step = sharded_step(lambda p, b: p, optim.sgd(0.1), compile=False)
    assert step.units is None
    assert step.gathers is None
    assert sharded_step(lambda p, b: p, optim.sgd(0.1), units=("a", "b")).units == ("a", "b")
    assert step.bucket_bytes == 4 * 2**20
    assert isinstance(step, ShardedStep)
    assert step.compiled is False


def test_parameters_the_step_refuses() -> None:
    (res,) = launch(W.run_layout_errors, 1, timeout=200, pg_timeout=60)
    assert res["empty"].startswith("ValueError: sharded_step: the parameter container has no")
    assert res["mesh_2d"].startswith("ValueError: sharded_step: key ('embed', 'weight')")
    assert "(Replicate(), Shard(0))" in res["mesh_2d"]  # a 2-D mesh: HSDP's placements
    assert res["mesh_3d"].startswith("ValueError: sharded_step: key ('embed', 'weight')")
    assert "1-D mesh" in res["mesh_3d"]
    assert "2-D (replicate, shard) mesh" in res["mesh_3d"]
    assert res["mixed_mesh"].startswith("ValueError: sharded_step: key ('head', 'weight') lives on")
    assert "dim_names=('b',)" in res["mixed_mesh"]
    assert (
        "the first parameter lives on DeviceMesh(ranks=[0], dim_names=('a',))"
        in (res["mixed_mesh"])
    )
