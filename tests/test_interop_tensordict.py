"""Conversion between tdfunc containers and the ``tensordict`` package (shared tensors)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tdfunc
from tdfunc import TensorDict, from_tensordict, to_tensordict
from tdfunc.interop import _errors as E

tensordict = pytest.importorskip("tensordict")


@tdfunc.tensorclass
class Inner:
    v: torch.Tensor


@tdfunc.tensorclass
class Obs:
    x: torch.Tensor
    inner: Inner
    extra: TensorDict | None = None
    label: str = "none"
    scale: float = 1.0


@tensordict.tensorclass
class TDInner:
    v: torch.Tensor


@tensordict.tensorclass
class TDObs:
    x: torch.Tensor
    inner: TDInner
    extra: tensordict.TensorDict = None
    label: str = "none"
    scale: float = 1.0


def leaves_shared(a, b) -> None:
    """Every leaf of the tdfunc container ``a`` is the very tensor of ``b`` (no copy)."""
    for path, leaf in a.items(include_nested=True, leaves_only=True):
        assert leaf is b.get(path), path


# ================================================================== tensordict -> tdfunc
def test_nested_tensordict_converts_without_copy():
    src = tensordict.TensorDict(
        a=torch.randn(4, 2),
        n={"b": torch.ones(4, 3), "m": {"c": torch.zeros(4, dtype=torch.int64)}},
        batch_size=[4],
    )
    td = from_tensordict(src)
    assert isinstance(td, TensorDict)
    assert td.batch_size == torch.Size([4])
    assert td.keys(True, True) == [("a"), ("n", "b"), ("n", "m", "c")]
    leaves_shared(td, src)
    assert isinstance(td["n", "m"], TensorDict)


def test_device_batch_dims_and_names_dropped():
    src = tensordict.TensorDict(
        a=torch.randn(2, 3, 5), batch_size=[2, 3], device="cpu", names=["env", "time"]
    )
    td = from_tensordict(src)
    assert td.batch_size == torch.Size([2, 3])
    assert td.device == torch.device("cpu")
    assert td["a"] is src["a"]


def test_mixed_dtypes_zero_dim_and_empty_leaves():
    src = tensordict.TensorDict(
        f16=torch.randn(()).half(),
        b=torch.tensor(True),
        e=torch.zeros(0, 3),
        i=torch.tensor(7, dtype=torch.int8),
    )
    td = from_tensordict(src)
    for k in ("f16", "b", "e", "i"):
        assert td[k] is src[k]
    back = to_tensordict(td)
    for k in ("f16", "b", "e", "i"):
        assert back[k] is src[k]


def test_lazy_stack_is_materialised():
    a = tensordict.TensorDict(x=torch.zeros(3), batch_size=[3])
    b = tensordict.TensorDict(x=torch.ones(3), batch_size=[3])
    lazy = tensordict.LazyStackedTensorDict.lazy_stack([a, b])
    td = from_tensordict(lazy)
    assert td.batch_size == torch.Size([2, 3])
    assert td["x"].tolist() == [[0.0] * 3, [1.0] * 3]


def test_memory_mapped_tensordict_leaves_stay_mapped(tmp_path):
    src = tensordict.TensorDict(a=torch.arange(4.0), batch_size=[4]).memmap(str(tmp_path))
    td = from_tensordict(src)
    assert isinstance(td["a"], tensordict.MemoryMappedTensor)
    assert td["a"] is src["a"]


def test_tdfunc_memory_mapped_leaves_stay_mapped(tmp_path):
    tdfunc.save(TensorDict(a=torch.arange(4.0), batch_size=[4]), str(tmp_path / "s"))
    stored = tdfunc.load(str(tmp_path / "s"))
    out = to_tensordict(stored)
    assert isinstance(out["a"], tdfunc.MemoryMappedTensor)
    assert out["a"].mode == "r"
    with pytest.raises(PermissionError):
        out["a"].add_(1)


def test_non_tensor_data_is_a_non_tensor_leaf():
    src = tensordict.TensorDict(x=torch.zeros(2), batch_size=[2])
    src["label"] = tensordict.NonTensorData("hi")
    td = from_tensordict(src)
    assert td["label"] == "hi"
    assert not td.items()[1][1].is_per_sample


def test_not_a_tensordict_input():
    with pytest.raises(TypeError, match=re.escape(E.NOT_A_TENSORDICT_INPUT.format(typ="dict"))):
        from_tensordict({"a": torch.zeros(1)})
    with pytest.raises(TypeError, match=re.escape(E.NOT_A_TDFUNC_INPUT.format(typ="TensorDict"))):
        to_tensordict(tensordict.TensorDict())
    with pytest.raises(TypeError, match="is not a tdfunc @tensorclass"):
        from_tensordict(tensordict.TensorDict(), TDObs)
    with pytest.raises(TypeError, match="is not a tensordict @tensorclass"):
        to_tensordict(TensorDict(), Obs)


# ================================================================== tdfunc -> tensordict
def test_tdfunc_to_tensordict_without_copy_and_back():
    td = TensorDict(
        a=torch.randn(3, 2), n={"b": torch.ones(3), "m": {"c": torch.zeros(3, 1)}}, batch_size=[3]
    )
    before = td.clone()
    out = to_tensordict(td)
    assert isinstance(out, tensordict.TensorDict)
    assert out.batch_size == torch.Size([3])
    leaves_shared(td, out)
    again = from_tensordict(out)
    leaves_shared(again, out)
    tdfunc.testing.assert_close(again, td)
    tdfunc.testing.assert_close(td, before)


def test_device_is_kept():
    td = TensorDict(a=torch.zeros(2), batch_size=[2], device="cpu")
    assert to_tensordict(td).device == torch.device("cpu")
    assert from_tensordict(to_tensordict(td)).device == torch.device("cpu")


# ================================================================== tensorclasses
def make_obs() -> Obs:
    return Obs(
        torch.randn(4, 2),
        Inner(torch.arange(4.0), batch_size=[4]),
        extra=TensorDict(r=torch.ones(4), batch_size=[4]),
        label="cam",
        scale=0.5,
        batch_size=[4],
    )


def test_tensorclass_round_trip_through_a_tensordict_tensorclass():
    obs = make_obs()
    out = to_tensordict(obs, TDObs)
    assert isinstance(out, TDObs)
    assert isinstance(out.inner, TDInner)
    assert out.label == "cam"
    assert out.scale == 0.5
    assert out.x is obs.x
    assert out.inner.v is obs.inner.v
    assert out.batch_size == torch.Size([4])
    back = from_tensordict(out, Obs)
    assert isinstance(back, Obs)
    assert isinstance(back.inner, Inner)
    assert back.label == "cam"
    assert back.scale == 0.5
    assert back.x is obs.x
    assert back.inner.v is obs.inner.v
    assert back.extra["r"] is obs.extra["r"]


def test_tensorclass_none_fields_and_defaults():
    src = TDObs(x=torch.zeros(2), inner=TDInner(v=torch.ones(2), batch_size=[2]), batch_size=[2])
    back = from_tensordict(src, Obs)
    assert back.extra is None
    assert back.label == "none"


def test_tensorclass_without_target_class_gives_tensordicts():
    obs = make_obs()
    out = to_tensordict(obs)
    assert isinstance(out, tensordict.TensorDict)
    assert sorted(out.keys()) == ["extra", "inner", "x"]
    td = from_tensordict(out)
    assert isinstance(td, TensorDict)
    assert td["inner", "v"] is obs.inner.v


def test_tensorclass_without_target_keeps_static_values_as_non_tensor_leaves():
    src = TDObs(x=torch.zeros(2), inner=TDInner(v=torch.ones(2), batch_size=[2]), batch_size=[2])
    td = from_tensordict(src)
    assert isinstance(td, TensorDict)
    assert td["label"] == src.label


# ------------------------------------------------------------------ what cannot convert
def test_lazy_stack_with_different_keys_is_refused():
    a = tensordict.TensorDict(x=torch.zeros(3), batch_size=[3])
    b = tensordict.TensorDict(y=torch.ones(3), batch_size=[3])
    lazy = tensordict.lazy_stack([a, b])
    assert list(lazy.keys()) == []  # tensordict keeps only the keys every member has
    msg = E.LAZY_STACK_KEYS.format(where="<root>", key="'x'", have=1, total=2)
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(lazy)


@pytest.mark.parametrize(
    ("y", "what"),
    [
        (torch.ones(4), "tensors of different shapes (torch.Size([3]), torch.Size([4]))"),
        (
            torch.ones(3, dtype=torch.int64),
            "tensors of different dtypes (torch.float32, torch.int64)",
        ),
    ],
)
def test_lazy_stack_with_different_shapes_or_dtypes_is_refused(y, what):
    lazy = tensordict.lazy_stack(
        [tensordict.TensorDict(x=torch.zeros(3)), tensordict.TensorDict(x=y)]
    )
    msg = E.LAZY_STACK_VALUES.format(where="<root>", what=what, key="'x'")
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(lazy)


def test_nested_lazy_stacks_are_checked_at_every_level():
    a = tensordict.TensorDict(x=torch.zeros(3), n=tensordict.TensorDict(z=torch.zeros(3)))
    b = tensordict.TensorDict(x=torch.ones(3), n=tensordict.TensorDict(w=torch.zeros(3)))
    msg = E.LAZY_STACK_KEYS.format(where="'n'", key="('n', 'z')", have=1, total=2)
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(tensordict.lazy_stack([a, b]))
    inner = tensordict.lazy_stack(
        [tensordict.TensorDict(x=torch.zeros(3)), tensordict.TensorDict(y=torch.zeros(3))]
    )
    outer = tensordict.TensorDict(s=inner, batch_size=[2])
    msg = E.LAZY_STACK_KEYS.format(where="'s'", key="('s', 'x')", have=1, total=2)
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(outer)
    # a stack of stacks: the members' own members are checked too
    deep = tensordict.lazy_stack([inner, inner.clone()])
    with pytest.raises(ValueError, match="do not have the same keys"):
        from_tensordict(deep)
    mixed = tensordict.lazy_stack(
        [tensordict.TensorDict(x=torch.zeros(3)), tensordict.TensorDict(x={"k": torch.zeros(3)})]
    )
    msg = E.LAZY_STACK_VALUES.format(
        where="<root>", what="a tensor in some members and not in others", key="'x'"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(mixed)


def test_lazy_stack_that_agrees_converts_with_every_key():
    a = tensordict.TensorDict(x=torch.zeros(3), n=tensordict.TensorDict(z=torch.zeros(3, 2)))
    b = tensordict.TensorDict(x=torch.ones(3), n=tensordict.TensorDict(z=torch.ones(3, 2)))
    td = from_tensordict(tensordict.lazy_stack([a, b]))
    assert td.keys(True, True) == ["x", ("n", "z")]
    assert td.batch_size == torch.Size([2])
    assert td["n", "z"].shape == (2, 3, 2)
    assert td["n", "z"][1].tolist() == [[1.0, 1.0]] * 3


def test_non_tensor_data_in_a_lazy_stack_is_per_sample():
    a = tensordict.TensorDict(x=torch.zeros(3))
    b = tensordict.TensorDict(x=torch.zeros(3))
    a["label"] = "a"
    b["label"] = "b"
    td = from_tensordict(tensordict.lazy_stack([a, b]))
    assert td["label"] == ("a", "b")
    assert td[1]["label"] == "b"


def test_tensordict_errors_do_not_escape(monkeypatch):
    src = tensordict.TensorDict(x=torch.zeros(3), batch_size=[3])

    def broken(self, key, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(src), "get", broken)
    msg = E.CANNOT_READ.format(key="'x'", reason="boom")
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(src)


def test_lazy_stack_of_tensorclasses_is_checked():
    members = [TDInner(v=torch.zeros(3)), TDInner(v=torch.zeros(4))]
    lazy = tensordict.lazy_stack(members)
    msg = E.LAZY_STACK_VALUES.format(
        where="<root>",
        what="tensors of different shapes (torch.Size([3]), torch.Size([4]))",
        key="'v'",
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        from_tensordict(lazy, Inner)
    ok = tensordict.lazy_stack([TDInner(v=torch.zeros(3)), TDInner(v=torch.ones(3))])
    back = from_tensordict(ok, Inner)
    assert type(back) is Inner
    assert back.v.tolist() == [[0.0] * 3, [1.0] * 3]


# the first import of tensordict after a compile (to_tensordict imports it lazily): tensordict
# registers pytree nodes and replaces functions of torch.vmap's internals, which Dynamo's
# guards of compiled functions that traced them check; importing it before the first compile
# (the guide's one-line remedy) leaves every compiled function as it was
_FIRST_IMPORT = """
import json, sys
import torch
from torch._dynamo.testing import CompileCounter
import tdfunc
if sys.argv[1] == "imported-first":
    import tensordict
assert ("tensordict" in sys.modules) == (sys.argv[1] == "imported-first")
td = tdfunc.TensorDict(a=torch.ones(3), b={"c": torch.zeros(3, 2)}, batch_size=[3])
programs = {
    "arithmetic": lambda td: td * 2 + 1,
    "vmap": lambda td: torch.vmap(lambda t: t * 2)(td),
    "cond": lambda td: tdfunc.cond(td["a"].sum() > 0, lambda t: t + 1, lambda t: t - 1, (td,)),
}
compiled = {}
for name, fn in programs.items():
    counter = CompileCounter()
    compiled[name] = (torch.compile(fn, backend=counter, fullgraph=True), counter)
    compiled[name][0](td)
    compiled[name][0](td)
before = {name: counter.frame_count for name, (_, counter) in compiled.items()}
assert set(before.values()) == {1}, before
tdfunc.to_tensordict(td)
assert "tensordict" in sys.modules
for fn, _ in compiled.values():
    fn(td)
print(json.dumps({n: counter.frame_count - before[n] for n, (_, counter) in compiled.items()}))
"""


def _recompiles_after_to_tensordict(order: str) -> dict[str, int]:
    """The frames each program compiles once tensordict is imported, in a new process (so that
    its import really is the first): by ``to_tensordict`` after the programs were compiled,
    or ``imported-first``, before."""
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_IMPORT, order],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_tensordict_after_a_compile_recompiles_what_traced_vmap_or_pytree_once():
    got = _recompiles_after_to_tensordict("imported-by-to_tensordict")
    assert got["arithmetic"] == 0
    assert got["vmap"] <= 1
    assert got["cond"] <= 1
    assert got["vmap"] + got["cond"] > 0  # as docs/guides/migrating.md says


def test_importing_tensordict_before_the_first_compile_recompiles_nothing():
    got = _recompiles_after_to_tensordict("imported-first")
    assert got == {"arithmetic": 0, "vmap": 0, "cond": 0}
