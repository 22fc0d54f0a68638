"""The replay buffer on disk (tdfunc.rl.store_add, ReplayBuffer.create/open): the rows and
counters an add writes (against the in-memory buffer), the checks made before anything is
written, and writers in several processes taking turns."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import rl
from tdfunc.memmap import _errors as ME

ROOT = Path(__file__).resolve().parents[1]


def row(width: int = 3, batch: tuple[int, ...] = ()) -> tdfunc.TensorDict:
    return tdfunc.TensorDict(
        obs=torch.zeros((*batch, width)),
        id=torch.zeros(batch, dtype=torch.long),
        next={"done": torch.zeros(batch, dtype=torch.bool)},
        batch_size=batch,
    )


def rows(first: int, n: int, width: int = 3, batch: tuple[int, ...] = ()) -> tdfunc.TensorDict:
    """Rows with absolute ids ``first..first+n``: every value of a row is its id."""
    ids = torch.arange(first, first + n).reshape(n, *(1,) * len(batch)).expand(n, *batch)
    return tdfunc.TensorDict(
        obs=ids[..., None].float().expand(*ids.shape, width).clone(),
        id=ids.clone(),
        next={"done": (ids % 4 == 3).clone()},
        batch_size=[n, *batch],
    )


def message(e: pytest.ExceptionInfo[BaseException]) -> str:
    return str(e.value.args[0])


def counters(state: rl.ReplayState) -> tuple[int, int]:
    return int(state.start), int(state.end)


def file_bytes(store: rl.ReplayState) -> bytes:
    with open(store.end.filename, "rb") as f:  # type: ignore[attr-defined]  # a store leaf
        return f.read()


# --------------------------------------------------------------------------------------
# the rows and counters of an add
# --------------------------------------------------------------------------------------
SIZES = [3, 5, 8, 1, 7, 2, 6, 8, 4, 5, 1, 1, 8]  # capacity 8: adds that wrap, fill, repeat


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)], ids=["rows", "row-batch"])
def test_store_adds_write_what_the_in_memory_add_writes(
    tmp_path: Path, prioritized: bool, batch: tuple[int, ...]
) -> None:
    mem = rl.init(row(batch=batch), 8, prioritized=prioritized)
    store = rl.create_store(tmp_path / "buf", row(batch=batch), 8, prioritized=prioritized)
    buf = rl.ReplayBuffer.open(tmp_path / "buf", mode="r+")
    first = 0
    for i, n in enumerate(SIZES):
        new = rows(first, n, batch=batch)
        mem = rl.add(mem, new)
        if i % 2:
            rl.store_add(store, new)
        else:
            buf.add(new)
        first += n
        back = rl.open_store(tmp_path / "buf")
        assert counters(back) == counters(mem), f"after add {i}"
        tdfunc.testing.assert_close(back.storage.clone(), mem.storage)
        if prioritized:
            assert back.priorities is not None
            assert mem.priorities is not None
            tdfunc.testing.assert_close(back.priorities.clone(), mem.priorities)


def test_store_add_casts_dtypes_up_within_their_kind(tmp_path: Path) -> None:
    store = rl.create_store(tmp_path / "buf", row(), 4)
    new = rows(0, 3)
    cast = new.replace(
        obs=new["obs"].double(), id=new["id"].int(), next={"done": new["next", "done"]}
    )
    rl.store_add(store, cast)
    back = rl.open_store(tmp_path / "buf")
    assert back.storage["obs"].dtype == torch.float32
    assert back.storage["id"].tolist() == [0, 1, 2, 0]
    tdfunc.testing.assert_close(back.storage[:3].clone(), new)


def test_keys_in_another_order_are_written_by_key(tmp_path: Path) -> None:
    buf = rl.ReplayBuffer.create(tmp_path / "buf", row(), 6)
    new = rows(0, 3)
    buf.add(new)
    later = rows(3, 3)
    other_order = tdfunc.TensorDict(
        next={"done": later["next", "done"]},
        id=later["id"],
        obs=later["obs"],
        batch_size=[3],
    )
    buf.add(other_order)
    buf.add(new)  # the first order again
    back = rl.open_store(tmp_path / "buf")
    assert back.storage["id"].tolist() == [0, 1, 2, 3, 4, 5]
    tdfunc.testing.assert_close(back.storage[3:].clone(), later)


def test_each_batch_is_written_by_its_own_keys(tmp_path: Path) -> None:
    """One buffer object, batches of one structure whose leaves change: the same tensor under
    two keys, then different tensors; other sizes and dtypes; more structures than a few."""
    buf = rl.ReplayBuffer.create(tmp_path / "buf", row(), 64)
    mem = rl.init(row(), 64)
    flags = torch.tensor([True, False])  # one tensor under two keys (a bool casts to long)
    shared = tdfunc.TensorDict(
        obs=torch.zeros(2, 3), id=flags, next={"done": flags}, batch_size=[2]
    )
    apart = tdfunc.TensorDict(
        obs=torch.ones(2, 3),
        id=torch.tensor([False, True]),
        next={"done": torch.tensor([True, True])},
        batch_size=[2],
    )
    batches = [shared, apart, rows(2, 2), rows(4, 5), rows(9, 2)]
    batches.append(rows(11, 2).replace(obs=rows(11, 2)["obs"].double()))
    first_id = 13
    for extra in range(12):  # twelve more structures: other row counts, keys in other orders
        n = 1 + extra // 2
        b = rows(first_id, n)
        first_id += n
        batches.append(
            tdfunc.TensorDict(next=b["next"], obs=b["obs"], id=b["id"], batch_size=[n])
            if extra % 2
            else b
        )
    batches.append(rows(first_id, 3))
    for b in batches:
        buf.add(b)
        mem = rl.add(mem, b)
        back = rl.open_store(tmp_path / "buf")
        assert counters(back) == counters(mem)
        tdfunc.testing.assert_close(back.storage.clone(), mem.storage)


# --------------------------------------------------------------------------------------
# checked before anything is written
# --------------------------------------------------------------------------------------
def _refused(buf: rl.ReplayBuffer, batch: Any, error: type[Exception]) -> str:
    before, data = counters(buf.state), file_bytes(buf.state)
    with pytest.raises(error) as e:
        buf.add(batch)
    assert counters(buf.state) == before
    assert file_bytes(buf.state) == data
    return message(e)


def test_a_batch_that_no_longer_fits_is_refused_after_good_ones(tmp_path: Path) -> None:
    buf = rl.ReplayBuffer.create(tmp_path / "buf", row(), 16)
    buf.add(rows(0, 3))
    buf.add(rows(3, 2))
    buf.add(rows(5, 2))  # the structure, row count, shapes and dtypes of the batches below
    good = rows(7, 2)
    got = _refused(buf, good.exclude("obs"), KeyError)
    assert got == ME.WRITE_MISSING_KEY.format(
        what="store_add", arg="batch", key="'obs'", where="<root>"
    )
    got = _refused(buf, good.set("extra", torch.zeros(2)), KeyError)
    assert got == ME.WRITE_EXTRA_KEY.format(what="store_add", arg="batch", key="'extra'")
    got = _refused(buf, good.set(("next", "more"), torch.zeros(2)), KeyError)
    assert got == ME.WRITE_EXTRA_KEY.format(what="store_add", arg="batch", key="('next', 'more')")
    got = _refused(buf, good.set("next", torch.zeros(2)), KeyError)
    assert got == ME.WRITE_NOT_A_LEAF.format(
        what="store_add", arg="batch", key="'next'", got="tensor", want="container"
    )
    got = _refused(buf, good.set("obs", torch.zeros(2, 5)), ValueError)
    assert got == ME.WRITE_SHAPE.format(
        what="store_add", arg="batch", key="'obs'", got=(2, 5), want=(2, 3), batch=(2,), feat=(3,)
    )
    got = _refused(buf, good.set("id", torch.zeros(2)), TypeError)
    assert got == ME.WRITE_DTYPE.format(
        what="store_add", arg="batch", key="'id'", got=torch.float32, want=torch.int64
    )
    _refused(buf, rows(0, 17), ValueError)  # more rows than the capacity
    buf.add(good)  # still takes a batch that fits
    back = rl.open_store(tmp_path / "buf")
    assert counters(back) == (0, 9)
    assert back.storage["id"][:9].tolist() == list(range(9))


def test_a_non_tensor_value_is_compared_on_every_add(tmp_path: Path) -> None:
    buf = rl.ReplayBuffer.create(tmp_path / "buf", row().set("tag", tdfunc.NonTensor("a")), 4)

    def tagged(first: int, tag: str) -> tdfunc.TensorDict:
        return rows(first, 2).set("tag", tdfunc.NonTensor(tag))

    buf.add(tagged(0, "a"))
    buf.add(tagged(2, "a"))
    got = _refused(buf, tagged(4, "b"), TypeError)
    assert got == ME.WRITE_NONTENSOR.format(what="store_add", arg="batch", key="'tag'")
    assert rl.open_store(tmp_path / "buf").storage["id"].tolist() == [0, 1, 2, 3]


def test_a_read_only_buffer_refuses_to_add_naming_the_file(tmp_path: Path) -> None:
    writer = rl.ReplayBuffer.create(tmp_path / "buf", row(), 4)
    writer.add(rows(0, 2))
    reader = rl.ReplayBuffer.open(tmp_path / "buf")
    for add in (reader.add, lambda b: rl.store_add(reader.state, b)):
        before = file_bytes(reader.state)
        with pytest.raises(PermissionError) as e:
            add(rows(2, 1))
        assert message(e) == ME.WRITE_READ_ONLY.format(
            what="store_add",
            key="('storage', 'obs')",
            filename=reader.state.end.filename,  # type: ignore[attr-defined]
        )
        assert file_bytes(reader.state) == before


# --------------------------------------------------------------------------------------
# writers in several processes
# --------------------------------------------------------------------------------------
WRITER = """
import os, sys, time, torch, tdfunc
from tdfunc import rl
path, tag, adds, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if how == "object":
    buf = rl.ReplayBuffer.open(path, mode="r+")
    add = buf.add
else:
    store = rl.open_store(path, mode="r+")
    add = lambda batch: rl.store_add(store, batch)
open(os.path.join(os.path.dirname(path), f"ready-{tag}"), "w").close()
while not os.path.exists(os.path.join(os.path.dirname(path), "go")):
    time.sleep(0.001)
for i in range(adds):
    ids = torch.arange(7) + tag * 100000 + i * 7
    batch = tdfunc.TensorDict(obs=ids[:, None].float().expand(7, 64).clone(), id=ids,
                              next={"done": torch.zeros(7, dtype=torch.bool)}, batch_size=[7])
    add(batch)
"""


def test_writers_in_two_processes_take_turns(tmp_path: Path) -> None:
    adds = 300
    path = tmp_path / "buf"
    rl.create_store(path, row(64), 2 * 7 * adds)  # room for every row of both writers
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    code = textwrap.dedent(WRITER)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(path), str(tag), str(adds), how], env=env)
        for tag, how in ((1, "object"), (2, "function"))
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{tag}").exists() for tag in (1, 2)):
            assert time.monotonic() < deadline
            assert all(p.poll() is None for p in procs)
            time.sleep(0.01)
        (tmp_path / "go").touch()
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    back = rl.open_store(path)
    assert counters(back) == (0, 2 * 7 * adds)  # no add lost to the other writer
    ids = back.storage["id"]
    want = [tag * 100000 + i for tag in (1, 2) for i in range(7 * adds)]
    assert sorted(ids.tolist()) == want
    assert bool((back.storage["obs"] == ids[:, None].float()).all())  # whole rows
    for tag in (1, 2):  # each writer's rows in its own order, 7 at a time
        mine = ids[(ids // 100000) == tag] % 100000
        assert mine.tolist() == list(range(7 * adds))


def test_a_saved_replay_state_loads_after_import_tdfunc_alone(tmp_path: Path) -> None:
    """``import tdfunc`` does not import ``tdfunc.rl``; ``load`` imports it (and only
    tdfunc's own modules) when the file holds one of its types."""
    code1 = (
        "import torch, tdfunc, tdfunc.rl as rl\n"
        "st = rl.init(tdfunc.TensorDict(x=torch.zeros(3)), 8)\n"
        f"tdfunc.save(rl.add(st, tdfunc.TensorDict(x=torch.ones(2, 3), batch_size=[2])), {str(tmp_path / 'buf')!r})\n"
    )
    code2 = (
        "import sys, tdfunc\n"
        "assert 'tdfunc.rl' not in sys.modules\n"
        f"st = tdfunc.load({str(tmp_path / 'buf')!r})\n"
        "print(type(st).__name__, st.storage['x'][:2].sum().item())\n"
    )
    for code in (code1, code2):
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ReplayState", "6.0"]


def test_every_container_type_of_tdfunc_is_found_by_load() -> None:
    """Each serialized type name tdfunc registers lives in ``tdfunc`` itself (imported with
    it) or in a module ``load`` imports on demand."""
    from torch.utils import _pytree as pytree

    import tdfunc.distributed
    import tdfunc.nn
    import tdfunc.optim
    import tdfunc.rl  # noqa: F401
    from tdfunc.memmap._store import OWN_MODULES

    names = [n for n in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE if n.startswith("tdfunc.")]
    assert names
    for name in names:
        module = name.rpartition(".")[0]
        assert module == "tdfunc" or module in OWN_MODULES, name
