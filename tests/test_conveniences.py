"""tensordict's everyday conveniences (``tdfunc._ops._conveniences``): values, shapes, batch
sizes, the input left as it was, on TensorDict and tensorclass, eager and compiled."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import check_compiled, compare, snapshot

import tdfunc
from tdfunc import TensorDict


@tdfunc.tensorclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def nested() -> TensorDict:
    return TensorDict(
        a=torch.randn(2, 3),
        n={"b": torch.randn(2), "m": TensorDict(c=torch.randn(2, 4, 1), batch_size=[2, 4])},
        batch_size=[2],
    )


def pair() -> Pair:
    return Pair(x=torch.randn(2, 3), y=torch.randn(2), batch_size=[2])


MAKERS = {"tensordict": nested, "tensorclass": pair}


# ------------------------------------------------------------------------------ dtype
def test_dtype_common_or_none() -> None:
    assert nested().dtype == torch.float32
    assert pair().dtype == torch.float32
    mixed = nested().set("i", torch.zeros(2, dtype=torch.int64))
    assert mixed.dtype is None
    assert TensorDict(batch_size=[3]).dtype is None
    assert TensorDict(n={}).dtype is None


@pytest.mark.parametrize("kind", MAKERS)
def test_dtype_compiled(kind: str) -> None:
    def f(td: Any) -> Any:
        return td.new_zeros(3, dtype=td.dtype) + 1

    cnt = check_compiled(f, lambda: (MAKERS[kind](),))
    assert cnt.frame_count == 1


# ------------------------------------------------------------------------------ tolist / numpy
def test_tolist_over_batch_dims() -> None:
    td = nested()
    got = td.tolist()
    assert isinstance(got, list)
    assert len(got) == 2
    assert list(got[0]) == ["a", "n"]
    assert torch.equal(got[1]["a"], td["a"][1])
    # as tensordict: lists over the root's batch dims only; a nested node's extra dims stay
    assert torch.equal(got[1]["n"]["m"]["c"], td["n", "m", "c"][1])
    plain = td.tolist(convert_tensors=True)
    assert plain[0]["a"] == td["a"][0].tolist()
    assert TensorDict(a=torch.tensor(1.0)).tolist(convert_tensors=True) == {"a": 1.0}
    assert pair().tolist()[0].keys() == {"x", "y"}


def test_numpy_nested_dict() -> None:
    td = nested()
    got = td.numpy()
    assert isinstance(got["a"], np.ndarray)
    np.testing.assert_array_equal(got["n"]["m"]["c"], td["n", "m", "c"].numpy())
    assert pair().numpy()["x"].shape == (2, 3)


# ------------------------------------------------------------------------------ emptiness
def test_is_empty_empty_filter_empty() -> None:
    td = nested().set("e", TensorDict(z=TensorDict(batch_size=[2]), batch_size=[2]))
    before = snapshot(td)
    assert not td.is_empty()
    assert TensorDict(n={"e": {}}).is_empty()
    e = td.empty()
    assert e.keys() == []
    assert e.batch_size == td.batch_size
    r = td.empty(recurse=True)
    assert r.keys(include_nested=True) == [("n", "m"), "n", ("e", "z"), "e"]
    assert r["n", "m"].batch_size == torch.Size([2, 4])
    assert r.is_empty()
    f = td.filter_empty()
    assert f.keys() == ["a", "n"]
    assert td.keys() == ["a", "n", "e"]
    compare(td, before)
    assert nested().filter_empty().keys(include_nested=True) == nested().keys(include_nested=True)
    with pytest.raises(TypeError, match="fixed fields"):
        pair().empty()


# ------------------------------------------------------------------------------ new_*
@pytest.mark.parametrize("kind", MAKERS)
def test_new_constructors(kind: str) -> None:
    td = MAKERS[kind]()
    z = td.new_zeros(4, 5)
    assert z.batch_size == torch.Size([4, 5])
    for a, b in zip(td.leaves(), z.leaves()):
        assert b.shape == (4, 5, *a.shape[1:])
        assert b.dtype == a.dtype
        assert bool((b == 0).all())
    assert td.new_zeros((4,)).batch_size == torch.Size([4])
    assert bool((td.new_ones(3).leaves()[0] == 1).all())
    full = td.new_full((3,), 7.0)
    assert all(bool((x == 7).all()) for x in full.leaves())
    assert td.new_empty(3, dtype=torch.float64).dtype == torch.float64
    t = td.new_tensor([1.5, 2.5])
    assert t.batch_size == torch.Size([2])
    assert t.leaves()[0].tolist() == [1.5, 2.5]


def test_new_zeros_keeps_feature_dims_and_nested_extra_dims() -> None:
    td = nested()
    z = td.new_zeros(6)
    assert z["a"].shape == (6, 3)
    assert z["n", "m"].batch_size == torch.Size([6, 4])
    assert z["n", "m", "c"].shape == (6, 4, 1)
    i = TensorDict(i=torch.zeros(2, dtype=torch.int64), batch_size=[2])
    assert i.new_full((3,), 7)["i"].dtype == torch.int64
    assert i.new_tensor([1.5, 2.5])["i"].tolist() == [1, 2]
    other = TensorDict(i=torch.tensor([3.0, 4.0, 5.0]), batch_size=[3])
    nt = i.new_tensor(other)
    assert nt.batch_size == torch.Size([3])
    assert nt["i"].tolist() == [3, 4, 5]


@pytest.mark.parametrize("name", ["new_zeros", "new_ones", "new_empty"])
@pytest.mark.parametrize("kind", MAKERS)
def test_new_compiled(name: str, kind: str) -> None:
    def f(td: Any) -> Any:
        out = getattr(td, name)(3)
        return out.new_full((2,), 1.5) if name == "new_empty" else out

    cnt = check_compiled(f, lambda: (MAKERS[kind](),))
    assert cnt.frame_count == 1


# ------------------------------------------------------------------------------ keys
def test_get_at() -> None:
    td = nested()
    assert torch.equal(td.get_at("a", 1), td["a"][1])
    assert torch.equal(td.get_at(("n", "m", "c"), (0, slice(1, 3))), td["n", "m", "c"][0, 1:3])
    assert td.get_at("zz", 0, default=None) is None
    with pytest.raises(KeyError, match="zz"):
        td.get_at("zz", 0)
    p = pair()
    assert torch.equal(p.get_at("y", 0), p.y[0])


def test_pop_is_in_place_in_tensordict_so_it_raises_naming_popped() -> None:
    td = nested()
    before = snapshot(td)
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("value, td = td.popped(key)")):
        td.pop("a")
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("td.popped(td.keys()[-1])")):
        td.popitem()
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("td = td.empty()")):
        td.clear()
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("td.set(key, value)")):
        td.setdefault("a", torch.zeros(4))
    assert not hasattr(td, "pop")
    compare(td, before)


def test_popped_is_pure() -> None:
    td = nested()
    before = snapshot(td)
    value, rest = td.popped(("n", "b"))
    assert torch.equal(value, td["n", "b"])
    assert rest.keys(include_nested=True, leaves_only=True) == ["a", ("n", "m", "c")]
    assert ("n", "b") in td  # the input still holds it
    compare(td, before)
    d, same = td.popped("zz", 5)
    assert d == 5
    assert same is td
    with pytest.raises(KeyError, match="zz"):
        td.popped("zz")
    with pytest.raises(TypeError, match="fixed fields"):
        pair().popped("x")


def test_split_keys_rename_keys_sorted_keys() -> None:
    td = nested()
    a, b, rest = td.split_keys(["a"], [("n", "b")])
    assert a.keys() == ["a"]
    assert b.keys(include_nested=True) == [("n", "b"), "n"]
    assert rest.keys(include_nested=True, leaves_only=True) == [("n", "m", "c")]
    with pytest.raises(KeyError, match="zz"):
        td.split_keys(["zz"])
    assert td.split_keys(["a", "zz"], strict=False)[0].keys() == ["a"]
    r = td.rename_keys({"a": "z", ("n", "b"): ("n", "c")})
    assert r.keys() == ["z", "n"]
    assert torch.equal(r["n", "c"], td["n", "b"])
    s = td.rename_keys({"a": "n", "n": "a"})
    assert torch.equal(s["n"], td["a"])
    assert torch.equal(s["a", "b"], td["n", "b"])
    with pytest.raises(KeyError, match="already exists"):
        td.rename_keys({"a": "n"})
    assert td.rename_keys({"zz": "y"}, strict=False) is td
    assert td.sorted_keys == ["a", "n"]
    assert pair().sorted_keys == ["x", "y"]


def test_split_keys_sets_in_order_mapping_predicate() -> None:
    td = nested()
    before = snapshot(td)
    # each set takes from what the earlier ones left: a key named twice goes to the first
    with pytest.raises(KeyError, match="'a'"):
        td.split_keys(["a"], ["a"])
    first, second, rest = td.split_keys(["a"], ["a"], strict=False)
    assert first.keys() == ["a"]
    assert second.keys() == []
    assert "a" not in rest
    whole, child, rest = td.split_keys(["n"], [("n", "b")], strict=False)
    assert whole.keys(include_nested=True)[0] == ("n", "b")
    assert child.keys() == []
    assert rest.keys() == ["a"]
    # a mapping renames in its output
    (z, rest) = td.split_keys({"a": "z", ("n", "b"): ("q", "b")})
    assert z.keys(include_nested=True) == ["z", ("q", "b"), "q"]
    assert torch.equal(z["z"], td["a"])
    assert torch.equal(z["q", "b"], td["n", "b"])
    assert z.batch_size == td.batch_size == rest.batch_size
    assert rest.keys(include_nested=True, leaves_only=True) == [("n", "m", "c")]
    # a predicate sees the path and the leaf of every leaf left
    seen: list[Any] = []

    def two_d(path: tuple[str, ...], leaf: torch.Tensor) -> bool:
        seen.append(path)
        return leaf.ndim == 2

    vec, rest = td.split_keys(["a"], two_d)[1:]
    assert seen == [("n", "b"), ("n", "m", "c")]  # "a" was taken by the first set
    assert vec.keys(include_nested=True, leaves_only=True) == []
    assert rest.keys(include_nested=True, leaves_only=True) == [("n", "b"), ("n", "m", "c")]
    nb = td.batch_dims
    scalars, rest = td.split_keys(lambda p, v: v.ndim == nb)
    assert scalars.keys(include_nested=True, leaves_only=True) == [("n", "b")]
    compare(td, before)


def test_split_keys_default() -> None:
    td = nested()
    before = snapshot(td)
    fill = torch.full((2,), 7.0)
    picked, rest = td.split_keys(["a", "zz", ("n", "q")], strict=False, default=fill)
    assert picked.keys(include_nested=True) == ["a", "zz", ("n", "q"), "n"]
    assert td.split_keys([("n", "q")], strict=False)[0].keys() == []
    assert picked["zz"].tolist() == [7.0, 7.0]
    assert picked["n", "q"].tolist() == [7.0, 7.0]
    assert torch.equal(picked["a"], td["a"])
    assert picked.batch_size == (2,)
    assert "zz" not in rest
    # a mapping puts the default at the new key
    (z, _) = td.split_keys({"zz": "y"}, strict=False, default=fill)
    assert z.keys() == ["y"]
    assert z["y"].tolist() == [7.0, 7.0]
    # strict ignores default; None skips the key
    with pytest.raises(KeyError, match="zz"):
        td.split_keys(["zz"], default=fill)
    assert td.split_keys(["zz"], strict=False, default=None)[0].keys() == []
    # a default that does not fit the batch is refused like any value at that key
    with pytest.raises(ValueError, match="zz"):
        td.split_keys(["zz"], strict=False, default=torch.zeros(3))
    compare(td, before)


def test_split_keys_reproduce_struct() -> None:
    td = nested().set("e", TensorDict(batch_size=[2]))
    before = snapshot(td)
    # by default the rest drops nested containers that hold no leaf (emptied or empty)
    a, rest = td.split_keys(["a", ("n", "b")])
    assert a.keys(include_nested=True) == ["a", ("n", "b"), "n"]
    assert rest.keys(include_nested=True) == [("n", "m", "c"), ("n", "m"), "n"]
    _, rest = td.split_keys([("n", "m", "c")])
    assert rest.keys(include_nested=True) == ["a", ("n", "b"), "n"]
    # reproduce_struct: every output has the whole tree, with each node's batch size
    a, c, rest = td.split_keys(["a"], [("n", "m", "c")], reproduce_struct=True)
    assert a.keys(include_nested=True) == [("n", "m"), "n", "e", "a"]  # the tree first
    assert c.keys(include_nested=True) == [("n", "m", "c"), ("n", "m"), "n", "e"]
    assert rest.keys(include_nested=True) == [("n", "b"), ("n", "m"), "n", "e"]
    for part in (a, c, rest):
        assert part.batch_size == (2,)
        assert part["n", "m"].batch_size == (2, 4)
        assert part["e"].batch_size == (2,)
    assert torch.equal(c["n", "m", "c"], td["n", "m", "c"])
    compare(td, before)


def test_split_keys_inplace_names_the_pure_spelling() -> None:
    td = nested()
    with pytest.raises(tdfunc.InPlaceError, match=r"split_keys\(inplace=True\)") as info:
        td.split_keys(["a"], inplace=True)
    assert "*parts, td = td.split_keys(" in str(info.value)
    assert isinstance(info.value, TypeError)
    assert td.keys() == ["a", "n"]
    assert td.split_keys(["a"], inplace=False)[0].keys() == ["a"]


def test_split_keys_tensorclass() -> None:
    # a tensorclass cannot lose a field: an output without all of them is refused
    with pytest.raises(TypeError, match="fixed fields"):
        pair().split_keys(["x"])


@pytest.mark.parametrize(
    "op",
    [
        lambda td: td.popped("a")[1] * 2,
        lambda td: td.split_keys(["a"])[1] * 2,
        lambda td: tuple(
            p * 2
            for p in td.split_keys(
                {"a": "z"},
                lambda p, v: v.ndim == 3,
                ["zz"],
                strict=False,
                default=td["n", "b"],
                reproduce_struct=True,
            )
        ),
        lambda td: td.rename_keys({"a": "z"}) * 2,
        lambda td: td.get_at("a", 1) * 2,
        lambda td: td.empty(recurse=True).set("k", td["a"] * 2),
        lambda td: td.filter_empty() * 2,
        lambda td: td.select(*td.sorted_keys) * 2 if not td.is_empty() else td,
        lambda td: (td.new_full((4,), 0.5) * 2, td.new_tensor([1.0, 2.0]) * 2),
    ],
    ids=[
        "popped",
        "split_keys",
        "split_keys_options",
        "rename_keys",
        "get_at",
        "empty",
        "filter_empty",
        "sorted_keys_is_empty",
        "new_full_new_tensor",
    ],
)
def test_key_conveniences_compiled(op: Callable[[Any], Any]) -> None:
    cnt = check_compiled(op, lambda: (nested(),))
    assert cnt.frame_count == 1


# ------------------------------------------------------------------------------ apply
@pytest.mark.parametrize("kind", MAKERS)
def test_apply_over_several_containers(kind: str) -> None:
    a, b, c = MAKERS[kind](), MAKERS[kind](), MAKERS[kind]()
    got = a.apply(lambda x, y, z: x + y * z, b, c)
    for x, y, z, g in zip(a.leaves(), b.leaves(), c.leaves(), got.leaves()):
        torch.testing.assert_close(g, x + y * z)
    cnt = check_compiled(
        lambda a, b: a.apply(torch.maximum, b), lambda: (MAKERS[kind](), MAKERS[kind]())
    )
    assert cnt.frame_count == 1


def test_apply_structures_must_match() -> None:
    with pytest.raises(tdfunc.StructureError):
        nested().apply(torch.add, nested().exclude("a"))
    with pytest.raises(tdfunc.StructureError):
        nested().named_apply(lambda k, x, y: x, nested().exclude("a"))


def test_named_apply_nested_keys() -> None:
    td = nested()
    seen: dict[Any, list[Any]] = {None: [], True: [], False: []}
    for nk in seen:
        td.named_apply(lambda k, x, nk=nk: (seen[nk].append(k), x)[1], nested_keys=nk)
    assert seen[None] == [("a",), ("n", "b"), ("n", "m", "c")]
    assert seen[True] == ["a", ("n", "b"), ("n", "m", "c")]
    assert seen[False] == ["a", "b", "c"]
    got = td.named_apply(lambda k, x, y: x + y + len(k), td, nested_keys=True)
    torch.testing.assert_close(got["n", "b"], 2 * td["n", "b"] + 2)
    summed = td.named_apply(lambda k, x: x.sum(0), batch_size=[])
    assert summed.batch_size == torch.Size([])
    assert summed["a"].shape == (3,)


@pytest.mark.parametrize("nk", [None, True, False])
def test_named_apply_compiled(nk: bool | None) -> None:
    def f(a: Any, b: Any) -> Any:
        return a.named_apply(lambda k, x, y: x * y + len(k), b, nested_keys=nk)

    cnt = check_compiled(f, lambda: (nested(), nested()))
    assert cnt.frame_count == 1


def test_vmap_sample() -> None:
    td = nested()
    got = torch.vmap(lambda t: t.new_zeros(3) + t.get_at("a", 0).sum())(td)
    assert got["a"].shape == (2, 3, 3)
    torch.testing.assert_close(got["a"][:, 0, 0], td["a"][:, 0])
