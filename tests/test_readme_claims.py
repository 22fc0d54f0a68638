"""The value-model, storage and migration statements of the guides (``docs/guides``), each
run: what immutability covers (the container, not its tensors), state dicts, and every row of
the table "Migrating from tensordict"."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc import MemoryMappedTensor, TensorDict, tensorclass
from tdfunc.nn import TensorDictModule as Mod
from tdfunc.nn import TensorDictSequential as Seq


def _td() -> TensorDict:
    return TensorDict(a=torch.zeros(3, 2), n={"b": torch.ones(3)}, batch_size=[3])


# ------------------------------------------------------------------------ what immutable means
def test_changing_the_container_raises_type_error_naming_the_functional_form():
    td = _td()
    with pytest.raises(TypeError, match=r"td.set\('a', value\)"):
        td["a"] = torch.ones(3, 2)
    with pytest.raises(TypeError, match=r"td.exclude\('a'\)"):
        del td["a"]
    with pytest.raises(TypeError, match="replace"):
        td.x = 1  # type: ignore[attr-defined]
    assert td.keys() == ["a", "n"]


def test_the_tensors_are_shared_not_protected():
    td = _td()
    td2 = td.set("c", torch.ones(3))  # a new container sharing every leaf it did not compute
    assert td2["a"] is td["a"]
    assert td2["n", "b"] is td["n", "b"]
    td["a"].add_(1)  # a tensor method that writes in place still writes
    assert td2["a"].tolist() == [[1.0, 1.0]] * 3
    own = td.clone()  # tensors of its own
    td["a"].add_(1)
    assert own["a"].tolist() == [[1.0, 1.0]] * 3
    assert td["a"].tolist() == [[2.0, 2.0]] * 3


def test_from_module_shares_the_module_tensors():
    m = nn.Linear(2, 1)
    params = tdfunc.from_module(m)
    assert params["weight"].untyped_storage().data_ptr() == m.weight.untyped_storage().data_ptr()


def test_read_only_store_leaves_refuse_writes(tmp_path):
    tdfunc.save(_td(), tmp_path / "s")
    td = tdfunc.load(tmp_path / "s")
    with pytest.raises(PermissionError):
        td["a"].add_(1)
    with pytest.raises(PermissionError):
        td["n", "b"][0] = 5.0
    assert float(td["a"].sum()) == 0.0


def test_state_dict_hand_off_and_len_iter_follow_the_batch():
    td = _td()
    sd = td.to_state_dict()
    assert list(sd) == ["a", "n.b"]
    assert sd["a"] is td["a"]
    assert len(td) == 3
    assert [row.batch_size for row in td] == [torch.Size([])] * 3


# ------------------------------------------------------------------------ storage section
def test_leaf_attributes_and_modes(tmp_path):
    tdfunc.save(_td(), tmp_path / "s")
    for mode in ("r", "r+", "c"):
        leaf = tdfunc.load(tmp_path / "s", mode=mode)["a"]
        assert isinstance(leaf, MemoryMappedTensor)
        assert leaf.mode == mode
        assert leaf.filename == str(tmp_path / "s" / "data.bin")


# ------------------------------------------------------------------------ migration table
def test_row_set_and_update():
    td = _td()
    x = torch.full((3,), 7.0)
    td2 = td.set("a", x)
    assert td2["a"] is x
    assert td["a"].shape == (3, 2)  # the old value is unchanged
    td3 = td.update({"c": x, "d": x})
    assert td3.keys() == ["a", "n", "c", "d"]


def test_row_in_place_copy_still_writes_into_the_tensor():
    td = _td()
    other = td.select("a")
    td["a"].copy_(torch.ones(3, 2))
    assert other["a"].tolist() == [[1.0, 1.0]] * 3


def test_row_pop():
    td = _td()
    x, rest = td.pop("a")  # pure: the value and the container without it
    assert x.shape == (3, 2)
    assert rest.keys() == ["n"]
    assert td.keys() == ["a", "n"]
    assert td.exclude("a").keys() == ["n"]


@tensorclass
class Rec:
    x: torch.Tensor
    y: torch.Tensor


def test_row_tensorclass_replace():
    tc = Rec(torch.zeros(2), torch.ones(2), batch_size=[2])
    tc2 = tc.replace(x=torch.full((2,), 3.0))
    assert tc2.x.tolist() == [3.0, 3.0]
    assert tc.x.tolist() == [0.0, 0.0]
    with pytest.raises(AttributeError, match=r"replace\(x=\.\.\.\)"):  # FrozenInstanceError
        tc.x = torch.ones(2)


def test_row_functional_call():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    params = tdfunc.from_module(model).apply(torch.zeros_like)
    x = torch.randn(4, 3)
    out = tdfunc.functional_call(model, params, (x,))
    assert out.tolist() == [[0.0, 0.0]] * 4
    assert model.weight.abs().sum() > 0  # the module's own tensors are untouched


def test_row_from_module_and_load_state_dict():
    src, dst = nn.Linear(3, 2), nn.Linear(3, 2)
    params = tdfunc.from_module(src)
    dst.load_state_dict(params.to_state_dict())
    torch.testing.assert_close(dst.weight, src.weight)
    dst2 = nn.Linear(3, 2)
    dst2.load_state_dict(dict(params.flatten_keys().items()))  # the longer form still works
    torch.testing.assert_close(dst2.bias, src.bias)
    # tied weights: one leaf per tie in the container, every name in tdfunc.state_dict
    lin = nn.Linear(2, 2)
    tied = nn.Sequential(lin, lin)
    params = tdfunc.from_module(tied) * 0
    assert sorted(params.to_state_dict()) == ["0.bias", "0.weight"]
    result = tied.load_state_dict(tdfunc.state_dict(tied, params))
    assert result.missing_keys == []
    assert lin.weight.abs().sum() == 0


def test_row_modules_return_the_outputs():
    td = TensorDict(obs=torch.randn(5, 4), batch_size=[5])
    mod = Mod(nn.Linear(4, 2), in_keys="obs", out_keys="logits")
    out = mod(td)
    assert out.keys() == ["obs", "logits"]
    assert td.keys() == ["obs"]  # the input is not written


def test_row_keyword_tensors():
    mod = Mod(lambda x, y: x + y, in_keys={"x": "a", "y": "b"}, out_keys="c")
    got = mod(a=torch.ones(2), b=torch.ones(2))  # keywords named after the in keys
    assert got.tolist() == [2.0, 2.0]


def test_row_plain_callable_in_a_sequential():
    seq = Seq(
        Mod(lambda x: x * 2, in_keys="a", out_keys="b"),
        lambda td: td.set("c", td["b"] + 1),
    )
    out = seq(TensorDict(a=torch.ones(2), batch_size=[2]))
    assert out["c"].tolist() == [3.0, 3.0]


def test_row_nested_tuple_keys_are_flattened():
    mod = Mod(lambda x: x + 1, in_keys=[(("a",), "b")], out_keys=[(("c",), "d")])
    out = mod(TensorDict(a={"b": torch.zeros(2)}, batch_size=[2]))
    assert out["c", "d"].tolist() == [1.0, 1.0]


def test_row_memmap_save_load(tmp_path):
    td = _td()
    tdfunc.save(td, tmp_path / "s")
    tdfunc.testing.assert_close(tdfunc.load(tmp_path / "s"), td)


def test_row_safetensors(tmp_path):
    td = _td()
    tdfunc.save_safetensors(td, tmp_path / "m.safetensors")
    tdfunc.testing.assert_close(tdfunc.load_safetensors(tmp_path / "m.safetensors"), td)


def test_row_from_tensordict_shares_or_copies(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    src = tensordict.TensorDict(a=torch.zeros(3, 2), n={"b": torch.ones(3)}, batch_size=[3])
    shared = tdfunc.from_tensordict(src)
    copied = tdfunc.from_tensordict(src, copy=True)
    assert shared["a"] is src["a"]
    assert copied["a"] is not src["a"]
    src["a"].add_(1)  # tensordict-era in-place code
    src["n"]["b"].mul_(5)
    assert shared["a"].tolist() == [[1.0, 1.0]] * 3  # the shared value changed
    assert copied["a"].tolist() == [[0.0, 0.0]] * 3  # the copy did not
    assert copied["n", "b"].tolist() == [1.0] * 3
    assert copied.batch_size == (3,)
    # memory-mapped tensordict leaves are copied into memory
    mm = src.memmap(tmp_path / "ttd")
    back = tdfunc.from_tensordict(mm, copy=True)
    assert type(back["a"]) is torch.Tensor
    torch.testing.assert_close(back["a"], torch.ones(3, 2))
    assert tdfunc.to_tensordict(shared)["a"] is shared["a"]
