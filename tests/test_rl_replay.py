"""Replay buffers (tdfunc.rl: init / add / sample / update_priorities / slices / episodes, the
store calls, ReplayBuffer) and the explicit store write tdfunc.write_at."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import check_compiled, snapshot
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _errors as CE
from tdfunc import rl
from tdfunc.memmap import _errors as ME
from tdfunc.rl import _replay as R
from tdfunc.rl import _replay_slices as RS
from tdfunc.rl import _replay_store as RST

ROOT = Path(__file__).resolve().parents[1]


def row(width: int = 3) -> tdfunc.TensorDict:
    return tdfunc.TensorDict(
        obs=torch.zeros(width),
        id=torch.zeros((), dtype=torch.long),
        next={"done": torch.zeros((), dtype=torch.bool)},
    )


def rows(first: int, n: int, width: int = 3, done_every: int = 0) -> tdfunc.TensorDict:
    """Rows with absolute ids ``first..first+n``: every value of a row is its id."""
    ids = torch.arange(first, first + n)
    done = (ids % done_every == done_every - 1) if done_every else torch.zeros(n, dtype=torch.bool)
    return tdfunc.TensorDict(
        obs=ids[:, None].float().expand(n, width).clone(),
        id=ids,
        next={"done": done},
        batch_size=[n],
    )


def filled(capacity: int, n: int, prioritized: bool = False, **kw: Any) -> rl.ReplayState:
    state = rl.init(row(), capacity, prioritized=prioritized, **kw)
    return rl.add(state, rows(0, n, done_every=kw.pop("done_every", 0) if False else 0))


def message(e: pytest.ExceptionInfo[BaseException]) -> str:
    return str(e.value.args[0])


# --------------------------------------------------------------------------------------
# write_at: the explicit store write
# --------------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path) -> tdfunc.TensorDict:
    spec = tdfunc.TensorDict(x=torch.zeros(6, 2), n={"y": torch.zeros(6)}, batch_size=[6])
    return tdfunc.memmap_like(spec, tmp_path / "s")


def value(n: int, v: float) -> tdfunc.TensorDict:
    return tdfunc.TensorDict(x=torch.full((n, 2), v), n={"y": torch.full((n,), v)}, batch_size=[n])


def test_write_at_rows_and_one_row_reach_the_file(store: tdfunc.TensorDict, tmp_path: Path) -> None:
    tdfunc.write_at(store, torch.tensor([1, 4]), value(2, 1.0))
    tdfunc.write_at(store, 2, value(1, 2.0)[0])  # a whole container at an index
    tdfunc.write_at(store, slice(5, 6), value(1, 3.0))
    tdfunc.write_at(store.select("x"), 0, 7.0)  # a number into every (selected) leaf
    back = tdfunc.load(tmp_path / "s")
    assert back["n", "y"].tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 3.0]
    assert back["x"][:, 1].tolist() == [7.0, 1.0, 2.0, 0.0, 1.0, 3.0]


def test_write_at_compiles_one_frame_and_writes(store: tdfunc.TensorDict, tmp_path: Path) -> None:
    cnt = CompileCounterWithBackend("eager")
    f = torch.compile(tdfunc.write_at, backend=cnt, fullgraph=True)
    f(store, torch.tensor([0, 1]), value(2, 5.0))
    f(store, torch.tensor([3, 2]), value(2, 6.0))  # new values: no recompile
    assert cnt.frame_count == 1
    assert tdfunc.load(tmp_path / "s")["n", "y"].tolist() == [5.0, 5.0, 6.0, 6.0, 0.0, 0.0]


def test_write_at_refuses_before_writing(store: tdfunc.TensorDict, tmp_path: Path) -> None:
    path = tmp_path / "s"
    ro = tdfunc.load(path)
    with pytest.raises(PermissionError) as e:
        tdfunc.write_at(ro, 0, value(1, 1.0)[0])
    assert message(e) == ME.WRITE_READ_ONLY.format(
        what="write_at", key="'x'", filename=str(path / "data.bin")
    )
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        tdfunc.write_at(tdfunc.load(path, mode="c"), 0, 1.0)
    assert message(e) == ME.WRITE_PRIVATE.format(
        what="write_at", key="'x'", filename=str(path / "data.bin")
    )
    with pytest.raises(TypeError) as e:
        tdfunc.write_at(store.clone(), 0, 1.0)
    assert message(e) == ME.WRITE_NOT_MAPPED.format(what="write_at", key="'x'", why="")
    with pytest.raises(KeyError) as e:
        tdfunc.write_at(store, 0, value(1, 1.0)[0].exclude(("n", "y")))
    assert message(e) == ME.WRITE_MISSING_KEY.format(
        what="write_at", arg="value", key="('n', 'y')", where="'n'"
    )
    with pytest.raises(KeyError) as e:
        tdfunc.write_at(store, 0, value(1, 1.0)[0].set("z", torch.ones(())))
    assert message(e) == ME.WRITE_EXTRA_KEY.format(what="write_at", arg="value", key="'z'")
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        tdfunc.write_at(store, torch.tensor([0, 1]), value(3, 1.0))
    assert message(e) == ME.WRITE_BATCH.format(
        got=(3,), index=torch.tensor([0, 1]), want=(2,), batch=(6,)
    )
    bad = tdfunc.TensorDict(x=torch.ones(2, 3), n={"y": torch.ones(2)}, batch_size=[2])
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        tdfunc.write_at(store, torch.tensor([0, 1]), bad)
    assert message(e) == ME.WRITE_SHAPE.format(
        what="write_at", arg="value", key="'x'", got=(2, 3), want=(2, 2), batch=(2,), feat=(2,)
    )
    with pytest.raises(TypeError) as e:
        tdfunc.write_at(store, 0, [1.0])
    assert message(e) == ME.WRITE_BAD_VALUE.format(typ="list")
    ints = tdfunc.memmap_like(
        tdfunc.TensorDict(i=torch.zeros(2, dtype=torch.long), batch_size=[2]), tmp_path / "i"
    )
    with pytest.raises(TypeError) as e:
        tdfunc.write_at(ints, 0, tdfunc.TensorDict(i=torch.tensor(1.5)))
    assert message(e) == ME.WRITE_DTYPE.format(
        what="write_at", arg="value", key="'i'", got=torch.float32, want=torch.int64
    )
    assert float(tdfunc.load(path)["x"].abs().sum()) == 0.0  # nothing was written


def test_item_assignment_on_a_writable_store_names_write_at(store: tdfunc.TensorDict) -> None:
    filename = store["x"].filename
    with pytest.raises(tdfunc.InPlaceError) as e:
        store[torch.tensor([0])] = value(1, 1.0)
    text = str(e.value)
    assert text == CE.MUTATION_STORE.format(
        cls="TensorDict", filename=filename, hint="tdfunc.write_at(td, index, value)"
    )
    assert "at[" not in text  # never the spelling that writes nothing
    with pytest.raises(tdfunc.InPlaceError) as e:
        store["x"] = torch.ones(6, 2)
    assert str(e.value) == CE.MUTATION_STORE.format(
        cls="TensorDict", filename=filename, hint="td['x'][...] = value"
    )
    with pytest.raises(tdfunc.InPlaceError) as e:  # an in-memory container: the pure spelling
        store.clone()[0] = 1.0
    assert "td = td.at[index].set(value)" in str(e.value)


# --------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------
def test_ring_wraps_and_samples_are_stored_rows() -> None:
    state = rl.init(row(), 5)
    for first in range(0, 12, 3):  # 12 rows into 5: wraps twice
        state = rl.add(state, rows(first, 3))
    assert (int(state.start), int(state.end), int(state.cursor), int(rl.size(state))) == (
        7,
        12,
        2,
        5,
    )
    assert state.storage["id"].tolist() == [10, 11, 7, 8, 9]
    batch, info = rl.sample(state, 64, torch.Generator().manual_seed(0))
    tdfunc.testing.assert_close(batch, state.storage[info["index"]])
    assert set(batch["id"].tolist()) == {7, 8, 9, 10, 11}


def test_functions_leave_their_inputs_as_they_were() -> None:
    state = rl.add(rl.init(row(), 6, prioritized=True), rows(0, 4))
    batch = rows(4, 3)
    before, b_before = snapshot(state), snapshot(batch)
    new = rl.add(state, batch)
    _, info = rl.sample(state, 8)
    rl.update_priorities(state, info["index"], torch.rand(8))
    rl.sample_slices(state, 2, 2, traj_key="id" if False else None)
    rl.set_beta(state, 1.0)
    tdfunc.testing.assert_close(state, before)
    tdfunc.testing.assert_close(batch, b_before)
    assert int(new.end) == 7


def test_save_and_load_like_any_container(tmp_path: Path) -> None:
    state = rl.update_priorities(
        rl.add(rl.init(row(), 4, prioritized=True, alpha=0.7), rows(0, 3)), torch.tensor([1]), 2.0
    )
    tdfunc.save(state, tmp_path / "b")
    back = tdfunc.load(tmp_path / "b")
    assert isinstance(back, rl.ReplayState)
    assert back.priorities is not None
    assert back.priorities.alpha == 0.7
    tdfunc.testing.assert_close(back.clone(), state)


# --------------------------------------------------------------------------------------
# compiled, donated
# --------------------------------------------------------------------------------------
def test_add_and_update_compile_one_frame_no_recompile() -> None:
    check_compiled(rl.add, lambda: (rl.init(row(), 8, prioritized=True), rows(0, 3)))
    check_compiled(
        rl.update_priorities,
        lambda: (filled(8, 8, prioritized=True), torch.randint(0, 8, (4,)), torch.rand(4)),
    )


@pytest.mark.parametrize("prioritized", [False, True])
def test_samplers_compile_one_frame_and_match_eager(prioritized: bool) -> None:
    def slices(state: rl.ReplayState) -> Any:
        return rl.sample_slices(state, 3, 4, traj_key="id")

    for fn in (lambda s: rl.sample(s, 16), slices):
        cnt = CompileCounterWithBackend("eager")
        cfn = torch.compile(fn, backend=cnt, fullgraph=True)
        for n in (9, 11):  # new values (counters, rows): no recompile
            state = rl.add(rl.init(row(), 12, prioritized=prioritized), rows(0, n))
            if fn is slices:
                state = rl.add(rl.init(row(), 12), rows(0, n).set("id", torch.arange(n) // 5))
            torch.manual_seed(n)
            want = fn(state)
            torch.manual_seed(n)
            got = cfn(state)
            tdfunc.testing.assert_close(got[0], want[0])
            tdfunc.testing.assert_close(got[1], want[1])
        assert cnt.frame_count == 1


def test_compiled_sampling_of_an_empty_buffer_raises_the_eager_error() -> None:
    f = torch.compile(lambda s: rl.sample(s, 2), backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        f(rl.init(row(), 4))
    assert message(e) == R.EMPTY.format(what="sample")


def test_donated_add_writes_in_place() -> None:
    step = tdfunc.compile(rl.add, donate=0, backend="eager", fullgraph=True)
    state = rl.init(row(), 16, prioritized=True)
    ptrs = [t.data_ptr() for t in tdfunc._tree.leaves(state)]
    old = state
    for first in range(0, 40, 5):
        state = step(state, rows(first, 5))
    assert [t.data_ptr() for t in tdfunc._tree.leaves(state)] == ptrs
    assert state.storage["id"].tolist() == [*range(32, 40), *range(24, 32)]
    with pytest.raises(tdfunc.DonatedError):
        old.storage  # noqa: B018
    # eagerly, add(donate=True) writes into the state's tensors too
    state2 = rl.add(rl.init(row(), 8), rows(0, 2))
    obs = state2.storage["obs"]
    state3 = rl.add(state2, rows(2, 3), donate=True)
    assert state3.storage["obs"] is obs
    assert obs[:5, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(tdfunc.DonatedError) as e:
        state2.end  # noqa: B018
    assert str(e.value) == R.DONATED.format(what="rl.add")


# --------------------------------------------------------------------------------------
# prioritised
# --------------------------------------------------------------------------------------
def test_prioritized_distribution_and_weights() -> None:
    alpha, beta, eps = 0.7, 0.5, 1e-8
    state = rl.add(rl.init(row(), 6, prioritized=True, alpha=alpha, beta=beta), rows(0, 6))
    prio = torch.tensor([0.5, 1.0, 2.0, 4.0, 0.1, 3.0])
    state = rl.update_priorities(state, torch.arange(6), prio)
    p = (prio.double() + eps) ** alpha
    n = 60_000
    _, info = rl.sample(state, n, torch.Generator().manual_seed(0))
    counts = torch.bincount(info["index"], minlength=6).double()
    expected = n * p / p.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, chi2  # 5 degrees of freedom: p = 0.001
    want = ((p[info["index"]] / p.min()) ** -beta).float()  # torchrl: (p_i / min p) ** -beta
    assert torch.equal(info["weight"], want)
    # the same as (N * P(i)) ** -beta normalised by the largest weight
    w = (6 * p / p.sum()) ** -beta
    torch.testing.assert_close(
        info["weight"].double(), w[info["index"]] / w.max(), rtol=1e-6, atol=0
    )


def test_new_rows_get_the_max_priority_and_empty_rows_are_never_drawn() -> None:
    state = rl.add(rl.init(row(), 10, prioritized=True, alpha=1.0, eps=0.0), rows(0, 3))
    state = rl.update_priorities(state, torch.tensor([0]), 9.0)
    state = rl.add(state, rows(3, 1))  # gets 9, torchrl's max priority so far
    assert state.priorities.sum_tree[16 + 3].item() == 9.0
    _, info = rl.sample(state, 2000, torch.Generator().manual_seed(0))
    assert int(info["index"].max()) <= 3


def test_priority_errors() -> None:
    state = filled(4, 3, prioritized=True)
    with pytest.raises(IndexError) as e:
        rl.update_priorities(state, torch.tensor([4]), 1.0)
    assert message(e) == R.INDEX_OUT_OF_RANGE.format(what="update_priorities", capacity=4)
    with pytest.raises(IndexError) as e:
        rl.update_priorities(state, torch.tensor([3]), 1.0)
    assert message(e) == R.INDEX_NO_DATA.format(what="update_priorities")
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.update_priorities(state, torch.tensor([0]), -1.0)
    assert message(e) == R.BAD_PRIORITY.format(what="update_priorities")
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.update_priorities(state, torch.tensor([0, 1]), torch.ones(3))
    assert message(e) == R.PRIORITY_SHAPE.format(what="update_priorities", got=(3,), want=(2,))
    with pytest.raises(TypeError) as e:
        rl.update_priorities(state, torch.tensor([0.0]), 1.0)
    assert message(e) == R.BAD_INDEX_DTYPE.format(what="update_priorities", dtype=torch.float32)
    with pytest.raises(TypeError) as e:
        rl.update_priorities(filled(4, 3), torch.tensor([0]), 1.0)
    assert message(e) == R.NOT_PRIORITIZED.format(what="update_priorities")


# --------------------------------------------------------------------------------------
# slices and episodes
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("by", ["traj", "done"])
def test_slices_are_contiguous_inside_one_episode(by: str) -> None:
    state = rl.init(row(), 20)
    # 26 rows into 20 (the oldest episode loses its start); episodes of 4 steps
    state = rl.add(state, rows(0, 13, done_every=4))
    state = rl.add(state, rows(13, 13, done_every=4))
    kw: dict[str, Any] = {"done_key": ("next", "done")} if by == "done" else {}
    if by == "traj":
        state = state.replace(storage=state.storage.set("ep", state.storage["id"] // 4))
        kw = {"traj_key": "ep"}
    batch, info = rl.sample_slices(state, 200, 3, torch.Generator().manual_seed(0), **kw)
    ids = batch["id"]
    assert batch.batch_size == (200, 3)
    assert bool((ids[:, 1:] - ids[:, :-1] == 1).all())  # consecutive steps
    assert bool((ids // 4 == ids[:, :1] // 4).all())  # one episode each
    assert int(ids.min()) >= 6  # rows that hold data
    tdfunc.testing.assert_close(batch, state.storage[info["index"]])
    # every episode of >= 3 rows is drawn (episodes uniformly, torchrl's rule); the oldest
    # (rows 6, 7: its start was replaced) and the newest (24, 25: still running) are too short
    assert set((ids[:, 0] // 4).tolist()) == {2, 3, 4, 5}
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.sample_slices(state, 1, 5, **kw)
    assert message(e) == RS.NO_TRAJECTORY.format(what="sample_slices", length=5)


def test_episodes_are_whole() -> None:
    state = rl.add(rl.init(row(), 16), rows(0, 11, done_every=4))
    batch, info = rl.sample_episodes(state, 30, torch.Generator().manual_seed(0))
    assert sorted(set(info["length"].tolist())) == [3, 4]
    for k in range(30):
        ids = batch["id"][k]
        assert ids.tolist() == list(range(int(ids[0]), int(ids[0]) + len(ids)))
        assert int(ids[0]) % 4 == 0


def test_slice_errors() -> None:
    state = filled(4, 3)
    with pytest.raises(KeyError) as e:
        rl.sample_slices(state, 1, 1, traj_key="ep")
    assert message(e).startswith(
        RS.FLAG_MISSING.format(what="sample_slices", key="'ep'", available="X", hint="").split("X")[
            0
        ]
    )
    with pytest.raises(TypeError) as e:
        rl.sample_slices(state, 1, 1, traj_key="id", done_key="id")
    assert message(e) == RS.BOTH_KEYS.format(what="sample_slices")
    with pytest.raises(TypeError) as e:
        rl.sample_slices(state, 1, 1, done_key="id")
    assert message(e) == RS.FLAG_DTYPE.format(what="sample_slices", key="'id'", dtype=torch.int64)


# --------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------
def test_add_errors() -> None:
    state = rl.init(row(), 4)
    with pytest.raises(KeyError) as e:
        rl.add(state, rows(0, 2).exclude("obs"))
    assert message(e) == ME.WRITE_MISSING_KEY.format(
        what="add", arg="batch", key="'obs'", where="<root>"
    )
    with pytest.raises(KeyError) as e:
        rl.add(state, rows(0, 2).set("extra", torch.zeros(2)))
    assert message(e) == ME.WRITE_EXTRA_KEY.format(what="add", arg="batch", key="'extra'")
    bad = rows(0, 2).set("obs", torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.add(state, bad)
    assert message(e) == ME.WRITE_SHAPE.format(
        what="add", arg="batch", key="'obs'", got=(2, 5), want=(2, 3), batch=(2,), feat=(3,)
    )
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.add(state, rows(0, 5))
    assert message(e) == R.BATCH_TOO_LARGE.format(what="add", n=5, capacity=4)
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.add(state, rows(0, 1)[0])
    assert message(e) == R.NO_BATCH_DIM.format(what="add", got=(), row="", row_bs=())
    with pytest.raises(TypeError) as e:
        rl.add(tdfunc.TensorDict(), rows(0, 1))
    assert message(e) == R.NOT_A_STATE.format(what="add", typ="TensorDict")
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.init(row(), 0)
    assert message(e) == R.BAD_CAPACITY.format(what="init", value=0)
    with pytest.raises(ValueError, match=r"\w") as e:  # the message: below
        rl.sample(state, 2)
    assert message(e) == R.EMPTY.format(what="sample")


# --------------------------------------------------------------------------------------
# on disk
# --------------------------------------------------------------------------------------
def test_store_add_writes_the_file_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    store = rl.create_store(path, row(), 5, prioritized=True)
    for first in range(0, 12, 3):
        rl.store_add(store, rows(first, 3))
    back = rl.open_store(path)
    assert (int(back.start), int(back.end)) == (7, 12)
    assert back.storage["id"].tolist() == [10, 11, 7, 8, 9]
    assert back.storage["obs"].mode == "r"
    rl.store_update_priorities(store, torch.tensor([0]), 5.0)
    batch, info = rl.store_sample(rl.open_store(path), rl.sample, 32)
    tdfunc.testing.assert_close(batch, back.storage[info["index"]].clone())
    with pytest.raises(TypeError) as e:  # the pure add would leave the file as it was
        rl.add(store, rows(0, 1))
    assert message(e) == R.WRITABLE_STORE.format(
        what="add", key="('storage', 'obs')", filename=store.end.filename
    )
    with pytest.raises(PermissionError) as e:
        rl.store_add(back, rows(0, 1))
    assert message(e) == ME.WRITE_READ_ONLY.format(
        what="store_add", key="('storage', 'obs')", filename=store.end.filename
    )
    tdfunc.save(tdfunc.TensorDict(a=torch.zeros(1)), tmp_path / "other")
    with pytest.raises(TypeError) as e:
        rl.open_store(tmp_path / "other")
    assert message(e) == RST.NOT_A_BUFFER_STORE.format(
        path=str(tmp_path / "other"), typ="TensorDict"
    )


def test_rows_written_without_their_commit_are_never_seen(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    store = rl.create_store(path, row(), 8)
    rl.store_add(store, rows(0, 6))
    # a writer killed after step 1 and 2 of the protocol: start moved, rows written, no commit
    plan_rows, start, _ = R.plan_add(store, 4)
    store.start.copy_(start)
    tdfunc.write_at(store.storage, plan_rows, rows(100, 4))
    back = rl.open_store(path)
    assert (int(back.start), int(back.end)) == (2, 6)
    batch, _ = rl.store_sample(back, rl.sample, 500)
    assert set(batch["id"].tolist()) == {2, 3, 4, 5}  # whole, committed rows only


def _run(code: str, timeout: float = 60) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env)


WRITER = """
import sys, torch, tdfunc
from tdfunc import rl
store = rl.open_store(sys.argv[1] if len(sys.argv) > 1 else {path!r}, mode="r+")
first = int(store.end)
for _ in range({adds}):
    ids = torch.arange(first, first + 7)
    batch = tdfunc.TensorDict(obs=ids[:, None].float().expand(7, 512).clone(), id=ids,
                              next={{"done": torch.zeros(7, dtype=torch.bool)}}, batch_size=[7])
    rl.store_add(store, batch)
    first += 7
"""


def _whole(batch: Any) -> bool:
    return bool((batch["obs"] == batch["id"][:, None].float()).all())


def test_a_writer_killed_mid_add_leaves_whole_rows(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    rl.create_store(path, row(512), 50)
    proc = _run(WRITER.format(path=str(path), adds=10**6))
    try:
        deadline = time.monotonic() + 60
        while int(rl.open_store(path).end) < 200:
            assert time.monotonic() < deadline
            assert proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    back = rl.open_store(path)
    start, end = int(back.start), int(back.end)
    assert end - start >= 50 - 7
    held = torch.arange(start, end)
    tdfunc.testing.assert_close(back.storage["id"][held % 50], held)
    assert _whole(back.storage[held % 50])
    store = rl.open_store(path, mode="r+")  # a new writer carries on
    rl.store_add(store, rows(end, 2, width=512))
    assert int(rl.open_store(path).end) == end + 2


def test_readers_sample_whole_rows_while_another_process_adds(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    store = rl.create_store(path, row(512), 50)
    rl.store_add(store, rows(0, 7, width=512))
    proc = _run(WRITER.format(path=str(path), adds=150))
    reader = rl.ReplayBuffer.open(path)
    samples = 0
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline
            batch, _info = reader.sample(16)
            assert _whole(batch)
            slices, _ = reader.sample_slices(2, 3, done_key=("next", "done"))
            assert bool((slices["id"][:, 1:] - slices["id"][:, :-1] == 1).all())
            samples += 1
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert samples > 0
    assert len(reader) == 50
    assert int(reader.state.end) == 7 * 151


# --------------------------------------------------------------------------------------
# the object
# --------------------------------------------------------------------------------------
def test_replay_buffer_in_memory_writes_in_place() -> None:
    buf = rl.ReplayBuffer(row(), 8, prioritized=True, alpha=1.0)
    buf.add(rows(0, 5))
    first = buf.state
    obs = first.storage["obs"]
    buf.add(rows(5, 5))
    assert buf.state.storage["obs"] is obs
    assert len(buf) == 8
    with pytest.raises(tdfunc.DonatedError):
        first.storage  # noqa: B018
    _batch, info = buf.sample(16)
    buf.update_priorities(info["index"], torch.rand(16))
    buf.set_beta(1.0)
    assert float(buf.state.priorities.beta) == 1.0
    eps, _ = buf.sample_episodes(2)
    assert eps.batch_size == (2,)
    assert repr(buf) == "ReplayBuffer(8/8 rows, in memory)"
    assert not math.isnan(float(info["weight"].sum()))
