"""Stores reached through symbolic links, what a load restores (saved values, not
``__post_init__``'s), and what a save refuses to write."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import TensorDict, load, memmap_like, save, tensorclass
from tdfunc._shapes import MAX_BYTES, SHAPE_BYTES, SHAPE_UNSAVED
from tdfunc._tensorclass import restore
from tdfunc.memmap import _errors as E


def _td(value: float) -> TensorDict:
    return TensorDict(x=torch.full((4,), value), batch_size=[4])


def test_overwrite_through_a_symlink_to_a_store(tmp_path):
    real = tmp_path / "real"
    save(_td(1.0), real)
    link = tmp_path / "link"
    os.symlink(real, link)
    with pytest.raises(FileExistsError, match="already exists; pass overwrite=True"):
        save(_td(2.0), link)  # no overwrite: refused as for any existing path
    save(_td(2.0), link, overwrite=True)
    assert os.path.islink(link)
    assert os.path.realpath(link) == str(real)
    assert load(link)["x"].tolist() == [2.0] * 4
    assert load(real)["x"].tolist() == [2.0] * 4
    # relative links and memmap_like too
    rel = tmp_path / "rel"
    os.symlink("real", rel)
    buf = memmap_like(_td(0.0), rel, overwrite=True)
    buf["x"][1] = 5.0
    assert load(real)["x"].tolist() == [0.0, 5.0, 0.0, 0.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "rel"]


@pytest.mark.parametrize("target", ["not_a_store", "missing", "file"])
def test_overwrite_through_a_symlink_to_something_else_names_both(tmp_path, target):
    dest = tmp_path / target
    if target == "not_a_store":
        dest.mkdir()
        (dest / "keep.txt").write_text("data")
    elif target == "file":
        dest.write_text("data")
    link = tmp_path / "link"
    os.symlink(dest, link)
    with pytest.raises(FileExistsError) as ei:
        save(_td(1.0), link, overwrite=True)
    msg = str(ei.value)
    assert msg == E.LINK_NOT_A_STORE_OVERWRITE.format(
        path=str(link), target=str(dest), manifest="manifest.json"
    )
    assert os.path.islink(link)
    if target == "not_a_store":
        assert (dest / "keep.txt").read_text() == "data"
    elif target == "file":
        assert dest.read_text() == "data"
    else:
        assert not dest.exists()


@tensorclass
class Normalised:
    """A ``__post_init__`` that changes values: it must not run again on load."""

    x: torch.Tensor
    scale: float = 2.0
    total: torch.Tensor | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "x", self.x * self.scale)
        object.__setattr__(self, "total", self.x.sum(-1, keepdim=True))


class _Counting:
    calls = 0


@tensorclass
class Counted:
    x: torch.Tensor

    def __post_init__(self) -> None:
        _Counting.calls += 1


def test_load_restores_the_saved_values_without_post_init(tmp_path):
    tc = Normalised(torch.ones(3, 2), batch_size=[3])
    assert tc.x.tolist() == [[2.0, 2.0]] * 3
    save(tc, tmp_path / "s")
    back = load(tmp_path / "s")
    assert type(back) is Normalised
    assert back.batch_size == (3,)
    assert back.scale == 2.0
    assert back.x.tolist() == [[2.0, 2.0]] * 3  # not 4.0: __post_init__ did not run again
    assert back.total.tolist() == [[4.0]] * 3
    _Counting.calls = 0
    save(Counted(torch.zeros(2), batch_size=[2]), tmp_path / "c")
    assert _Counting.calls == 1
    load(tmp_path / "c")
    assert _Counting.calls == 1


def test_load_safetensors_restores_the_saved_values_without_post_init(tmp_path):
    tc = Normalised(torch.ones(3, 2), batch_size=[3])
    tdfunc.save_safetensors(tc, tmp_path / "n.safetensors")
    back = tdfunc.load_safetensors(tmp_path / "n.safetensors")
    assert type(back) is Normalised
    assert back.x.tolist() == [[2.0, 2.0]] * 3  # not 4.0: __post_init__ did not run again
    assert back.total.tolist() == [[4.0]] * 3
    _Counting.calls = 0
    tdfunc.save_safetensors(Counted(torch.zeros(2), batch_size=[2]), tmp_path / "c.safetensors")
    assert _Counting.calls == 1
    tdfunc.load_safetensors(tmp_path / "c.safetensors")
    assert _Counting.calls == 1


def test_restore_checks_fields_like_the_constructor():
    with pytest.raises(TypeError, match="missing required field 'scale'"):
        restore(Normalised, {"x": torch.ones(3), "total": None}, [3], None)
    with pytest.raises(TypeError, match="unknown field 'y'"):
        restore(Normalised, {"x": torch.ones(3), "scale": 1.0, "total": None, "y": 1}, [3], None)
    with pytest.raises(ValueError, match="batch"):
        restore(Normalised, {"x": torch.ones(2), "scale": 1.0, "total": None}, [3], None)
    with pytest.raises(TypeError, match="static"):
        restore(Normalised, {"x": torch.ones(3), "scale": torch.ones(()), "total": None}, [3], None)
    with pytest.raises(TypeError, match="@tensorclass type"):
        restore(TensorDict, {}, [], None)
    ok = restore(Normalised, {"x": torch.ones(3), "scale": 5.0, "total": None}, [3], "cpu")
    assert ok.x.tolist() == [1.0] * 3
    assert ok.device == torch.device("cpu")


@tensorclass
class Scaled:
    x: torch.Tensor
    scale: dataclasses.InitVar[float] = 1.0

    def __post_init__(self, scale: float) -> None:
        object.__setattr__(self, "x", self.x * scale)


def test_init_vars_are_not_stored_and_not_needed_on_load(tmp_path):
    tc = Scaled(torch.ones(2), scale=3.0, batch_size=[2])
    save(tc, tmp_path / "s")
    back = load(tmp_path / "s", mode="c")
    assert back.x.tolist() == [3.0, 3.0]
    assert back.x.mode == "c"


def test_the_resume_snippet_compiles_its_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoints guide's resume snippet (``examples/checkpoints.py``) clones the loaded
    state: a compiled step then compiles once. Without it Dynamo sees the memory-mapped
    leaves, another tensor type (guarded like any tensor subclass), on the first call and the
    plain tensors the step returns on the next: two frames."""
    import importlib.util

    from torch._dynamo.testing import CompileCounterWithBackend

    path = Path(__file__).resolve().parents[1] / "examples" / "checkpoints.py"
    source = path.read_text()
    snippet = source.split("# --8<-- [start:checkpoint]")[1].split("# --8<-- [end:checkpoint]")[0]
    assert "resumed = tdfunc.load(path).clone()" in snippet
    spec = importlib.util.spec_from_file_location("_checkpoints_example", path)
    assert spec is not None
    assert spec.loader is not None
    ex = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ex)  # Dynamo looks its globals up there
    spec.loader.exec_module(ex)
    store = str(tmp_path / "ckpt")
    tdfunc.save(ex.train(ex.start, 2), store)

    def frames(state: Any) -> tuple[int, Any]:
        cnt = CompileCounterWithBackend("eager")
        step = torch.compile(lambda s: ex.train(s, 1), backend=cnt, fullgraph=True)
        for _ in range(3):
            state = step(state)
        return cnt.frame_count, state

    n, resumed = frames(tdfunc.load(store).clone())  # as the snippet resumes
    assert n == 1
    assert resumed.step.item() == 5
    tdfunc.testing.assert_close(resumed, ex.train(ex.start, 5))
    n, _ = frames(tdfunc.load(store))  # the cause: the mapped leaves are another type
    assert n == 2


def test_a_leaf_a_load_would_refuse_is_never_saved(tmp_path):
    """torch builds a tensor without elements whose other dims hold 2**63 bytes of float32;
    a load refuses such a shape, so a save refuses it before writing anything."""
    td = TensorDict(ok=torch.ones(2), n={"e": torch.empty(1 << 61, 0)})
    detail = SHAPE_BYTES.format(shape=[1 << 61, 0], dtype=torch.float32, limit=MAX_BYTES)
    want = SHAPE_UNSAVED.format(key="('n', 'e')", detail=detail)
    for write in (save, memmap_like):
        with pytest.raises(ValueError, match="a load would refuse it") as e:
            write(td, tmp_path / "s")
        assert str(e.value) == want
        assert os.listdir(tmp_path) == []
    edge = TensorDict(e=torch.empty(1 << 60, 0))  # 2**62 bytes: the limit itself
    save(edge, tmp_path / "s")
    assert load(tmp_path / "s")["e"].shape == (1 << 60, 0)
