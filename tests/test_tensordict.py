"""TensorDict construction, reading, functional updates, immutability and error paths."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tdfunc
from tdfunc import TensorDict
from tdfunc import _errors as E
from tdfunc.testing import assert_close


def make_td(b: int = 4) -> TensorDict:
    return TensorDict(
        {"a": torch.randn(b, 3), "b": {"c": torch.randn(b, 2), "d": torch.arange(b)}},
        batch_size=[b],
    )


# ------------------------------------------------------------------ construction
def test_construction_basic_attributes():
    td = make_td()
    assert td.batch_size == torch.Size([4])
    assert td.shape == td.batch_size
    assert td.batch_dims == 1
    assert td.ndim == 1
    assert td.device is None
    assert len(td) == 4
    assert td.numel() == 4
    assert isinstance(td["b"], TensorDict)
    assert td["b"].batch_size == torch.Size([4])


def test_len_and_iteration_agree_on_unbatched_containers():
    """Like a 0-d tensor: no length and no iteration without a batch dim."""
    td = TensorDict(a=torch.ones(3))
    with pytest.raises(TypeError, match=r"len\(\) of a TensorDict with batch_size=\(\)"):
        len(td)
    with pytest.raises(TypeError, match=r"iteration over a TensorDict with batch_size=\(\)"):
        iter(td)
    assert len(td.expand(2)) == 2
    assert [x["a"].shape for x in td.expand(2)] == [torch.Size([3])] * 2


def test_construction_kwargs_numbers_numpy():
    td = TensorDict(x=1.5, y=np.arange(3, dtype=np.float32), z=True)
    assert td["x"].dtype == torch.float32
    assert td["x"].item() == 1.5
    assert torch.equal(td["y"], torch.arange(3, dtype=torch.float32))
    assert td["z"].dtype == torch.bool
    assert td.batch_size == torch.Size([])


def test_construction_device_moves_leaves():
    td = TensorDict({"a": torch.zeros(2), "n": {"b": torch.ones(2)}}, batch_size=[2], device="cpu")
    assert td.device == torch.device("cpu")
    assert td["n"].device == torch.device("cpu")
    assert td["n", "b"].device.type == "cpu"


def test_construction_batch_size_int_and_size():
    assert TensorDict(a=torch.zeros(3), batch_size=3).batch_size == torch.Size([3])
    assert TensorDict(a=torch.zeros(3, 2), batch_size=torch.Size([3, 2])).batch_dims == 2


def test_construction_does_not_copy_tensors():
    x = torch.zeros(3)
    td = TensorDict(a=x, batch_size=[3])
    assert td["a"] is x


def test_from_dict_batch_dims_and_batch_size():
    d = {"a": torch.zeros(2, 3, 4), "b": {"c": torch.zeros(2, 3)}}
    assert TensorDict.from_dict(d, batch_dims=2).batch_size == torch.Size([2, 3])
    assert TensorDict.from_dict(d, batch_size=[2]).batch_size == torch.Size([2])
    assert TensorDict.from_dict(d).batch_size == torch.Size([])
    assert TensorDict.from_dict(d, batch_dims=1)["b"].batch_size == torch.Size([2])


def test_from_dict_errors():
    with pytest.raises(ValueError, match="batch_dims=3"):
        TensorDict.from_dict({"a": torch.zeros(2, 3)}, batch_dims=3)
    with pytest.raises(ValueError, match="at least one tensor leaf"):
        TensorDict.from_dict({}, batch_dims=1)


def test_leaf_shape_mismatch_names_key():
    expected = E.LEAF_SHAPE.format(key="('n', 'bad')", shape=(3,), batch_size=(4,))
    with pytest.raises(ValueError, match=re.escape(expected)) as ei:
        TensorDict({"a": torch.zeros(4, 2), "n": {"bad": torch.zeros(3)}}, batch_size=[4])
    msg = str(ei.value)
    assert "('n', 'bad')" in msg
    assert "(3,)" in msg
    assert "(4,)" in msg
    assert msg.startswith(E.LEAF_SHAPE.split("{")[0])


def test_nested_batch_mismatch():
    inner = TensorDict(c=torch.zeros(3), batch_size=[3])
    with pytest.raises(ValueError, match="nested batch_size"):
        TensorDict(n=inner, batch_size=[4])


def test_non_tensor_value_type_error():
    with pytest.raises(TypeError, match=r"key 'bad'.*object"):
        TensorDict(bad=object())
    with pytest.raises(TypeError, match="keys must be strings"):
        TensorDict({1: torch.zeros(1)})
    with pytest.raises(TypeError, match="must be a mapping"):
        TensorDict([("a", torch.zeros(1))])  # type: ignore[arg-type]


# ------------------------------------------------------------------ reading
def test_getitem_and_nested_keys():
    td = make_td()
    assert td["b", "c"].shape == (4, 2)
    assert td[("b", "d")] is td["b"]["d"]
    assert td.get("missing") is None
    assert td.get(("b", "missing"), 5) == 5
    assert td.get(("a", "x"), "dflt") == "dflt"


def test_missing_key_errors():
    td = make_td()
    with pytest.raises(KeyError, match=r"'zz' not found.*available keys"):
        td["zz"]
    with pytest.raises(KeyError, match="not found"):
        td["b", "zz"]
    with pytest.raises(KeyError, match="not a nested container"):
        td["a", "x"]


def test_contains_with_tuple_keys():
    td = make_td()
    assert "a" in td
    assert ("b", "c") in td
    assert "c" not in td
    assert ("b", "x") not in td
    assert ("a", "x") not in td
    with pytest.raises(TypeError):
        _ = 3 in td


def test_keys_values_items():
    td = make_td()
    assert td.keys() == ["a", "b"]
    assert td.keys(include_nested=True) == ["a", ("b", "c"), ("b", "d"), "b"]
    assert td.keys(include_nested=True, leaves_only=True) == ["a", ("b", "c"), ("b", "d")]
    assert td.keys(leaves_only=True) == ["a"]
    vals = td.values(include_nested=True, leaves_only=True)
    assert vals[1] is td["b", "c"]
    items = td.items(True, True)
    assert [k for k, _ in items] == td.keys(True, True)


def test_iteration_over_first_batch_dim():
    td = make_td(3)
    rows = list(td)
    assert len(rows) == 3
    assert all(r.batch_size == torch.Size([]) for r in rows)
    assert torch.equal(rows[1]["a"], td["a"][1])
    with pytest.raises(TypeError, match="iteration"):
        iter(TensorDict(a=torch.zeros(2)))
    with pytest.raises(TypeError, match="len"):
        len(TensorDict(a=torch.zeros(2)))


def test_repr_readable():
    r = repr(make_td())
    assert "TensorDict(" in r
    assert "a: Tensor(shape=(4, 3), dtype=torch.float32)" in r
    assert "batch_size=(4,)" in r


def test_bool_is_ambiguous():
    with pytest.raises(RuntimeError, match="ambiguous"):
        bool(make_td())


# ------------------------------------------------------------------ functional updates
def test_set_returns_new_and_keeps_input():
    td = make_td()
    before = td.clone()
    td2 = td.set("x", torch.ones(4))
    assert "x" in td2
    assert "x" not in td
    assert_close(td, before)
    td3 = td.set(("new", "deep", "leaf"), torch.ones(4, 2))
    assert td3["new", "deep"].batch_size == torch.Size([4])
    assert td3.keys()[-1] == "new"
    td4 = td.set(("b", "c"), torch.zeros(4, 7))
    assert td4["b", "c"].shape == (4, 7)
    assert td["b", "c"].shape == (4, 2)


def test_set_errors():
    td = make_td()
    with pytest.raises(ValueError, match=r"'x'.*\(3,\)"):
        td.set("x", torch.zeros(3))
    with pytest.raises(TypeError, match="not a nested container"):
        td.set(("a", "x"), torch.zeros(4))
    with pytest.raises(TypeError, match="keys must be strings"):
        td.set(3, torch.zeros(4))  # type: ignore[arg-type]


def test_update_merges_recursively():
    td = make_td()
    new_c = torch.ones(4, 2)
    td2 = td.update({"b": {"c": new_c}, "z": torch.zeros(4)})
    assert td2["b", "c"] is new_c
    assert td2["b", "d"] is td["b", "d"]
    assert "z" in td2
    assert "z" not in td
    td3 = td.update(TensorDict(a=torch.zeros(4, 3), batch_size=[4]))
    assert torch.equal(td3["a"], torch.zeros(4, 3))
    with pytest.raises(TypeError, match="update expects"):
        td.update([1, 2])  # type: ignore[arg-type]


def test_replace():
    td = make_td()
    td2 = td.replace(a=torch.zeros(4, 3))
    assert torch.equal(td2["a"], torch.zeros(4, 3))
    assert not torch.equal(td["a"], torch.zeros(4, 3))
    with pytest.raises(KeyError, match=r"use td\.set"):
        td.replace(nope=torch.zeros(4))
    with pytest.raises(
        ValueError, match=re.escape(E.LEAF_SHAPE.format(key="'a'", shape=(2,), batch_size=(4,)))
    ):
        td.replace(a=torch.zeros(2))


def test_select_exclude_rename():
    td = make_td()
    s = td.select("a", ("b", "c"))
    assert s.keys(True, True) == ["a", ("b", "c")]
    assert s["b"].batch_size == td["b"].batch_size
    with pytest.raises(KeyError, match="'zz' not found"):
        td.select("zz")
    assert td.select("zz", "a", strict=False).keys() == ["a"]
    e = td.exclude("a", ("b", "d"), "missing")
    assert e.keys(True, True) == [("b", "c")]
    r = td.rename_key("a", "z")
    assert r.keys() == ["z", "b"]
    assert r["z"] is td["a"]
    r2 = td.rename_key(("b", "c"), ("q", "c2"))
    assert ("q", "c2") in r2
    assert ("b", "c") not in r2
    with pytest.raises(KeyError):
        td.rename_key("nope", "x")


def test_at_set_and_add():
    td = make_td()
    before = td.clone()
    out = td.at[1:3].set(0.0)
    assert torch.all(out["a"][1:3] == 0)
    assert torch.equal(out["a"][0], td["a"][0])
    assert_close(td, before)
    added = td.at[0].add(1)
    assert torch.equal(added["b", "d"], td["b", "d"] + torch.tensor([1, 0, 0, 0]))
    other = tdfunc.zeros_like(td[:2])
    out2 = td.at[:2].set(other)
    assert torch.equal(out2["b", "c"][:2], torch.zeros(2, 2))
    assert_close(td.at[2].get(), td[2])
    with pytest.raises(KeyError, match="missing keys"):
        td.at[:2].set(other.exclude("a"))


def test_flatten_unflatten_keys_and_to_dict():
    td = make_td()
    f = td.flatten_keys()
    assert f.keys() == ["a", "b.c", "b.d"]
    assert f["b.c"] is td["b", "c"]
    assert_close(f.unflatten_keys(), td)
    assert td.flatten_keys("/").keys() == ["a", "b/c", "b/d"]
    d = td.to_dict()
    assert isinstance(d["b"], dict)
    assert d["b"]["c"] is td["b", "c"]


@pytest.mark.parametrize(
    ("action", "hint"),
    [
        (lambda td: td.__setitem__("a", 1), "td.set('a'"),
        (lambda td: td.__setitem__(("b", "c"), 1), "td.set(('b', 'c')"),
        (lambda td: td.__setitem__(0, 1), "at[index].set"),
        (lambda td: td.__setitem__(slice(None), 1), "at[index].set"),
        (lambda td: td.__delitem__("a"), "exclude"),
        (lambda td: setattr(td, "batch_size", [2]), "tdfunc.TensorDict(dict(td.items()), "),
        (lambda td: setattr(td, "foo", 1), "replace"),
        (lambda td: delattr(td, "_data"), "exclude"),
    ],
)
def test_mutation_raises_type_error(action, hint):
    td = make_td()
    before = td.clone()
    with pytest.raises(TypeError, match="immutable") as ei:
        action(td)
    assert hint in str(ei.value)
    assert_close(td, before)


def test_empty_tensordict():
    td = TensorDict(batch_size=[3, 2])
    assert td.keys() == []
    assert td.batch_size == (3, 2)
    assert td[0].batch_size == (2,)
    assert td.reshape(6).batch_size == (6,)
    assert tdfunc.stack([td, td]).batch_size == (2, 3, 2)
    assert td.unbind(1)[0].batch_size == (3,)
    assert td.all().item() is True
    assert td.any().item() is False


def test_assert_close_names_first_differing_path():
    td = make_td()
    with pytest.raises(AssertionError, match="key \\('b', 'c'\\)"):
        assert_close(td.set(("b", "c"), td["b", "c"] + 1), td)
    with pytest.raises(AssertionError, match="keys differ: missing \\['a'\\]"):
        assert_close(td.exclude("a"), td)
    with pytest.raises(AssertionError, match="batch_size \\(2,\\) != \\(4,\\)"):
        assert_close(td[:2], td)
    with pytest.raises(AssertionError, match="expected a TensorDict, got a Tensor"):
        assert_close(td["a"], td)
    assert_close(td, td.clone())


def test_copy_is_shallow_and_new():
    td = make_td()
    c = td.copy()
    assert c is not td
    assert c["a"] is td["a"]
    assert c["b"] is not td["b"]
    assert_close(c, td)
