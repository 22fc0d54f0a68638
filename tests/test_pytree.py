"""pytree registration (torch and optree), vmap batch-size rule, export, pickling."""

from __future__ import annotations

import copy
import io
import json
import pickle

import optree
import pytest
import torch
import torch.utils._pytree as P
from torch.export import Dim

import tdfunc
from tdfunc import TensorDict
from tdfunc.testing import assert_close


def make_td(b: int = 4) -> TensorDict:
    return TensorDict(
        {
            "a": torch.randn(b, 3, 2),
            "n": TensorDict({"c": torch.randn(b, 3, 5)}, batch_size=[b, 3, 5]),
            "e": torch.randn(b, 3),
        },
        batch_size=[b, 3],
    )


def test_flatten_unflatten_round_trip():
    td = make_td()
    leaves, spec = P.tree_flatten(td)
    assert len(leaves) == 3
    assert leaves[0] is td["a"]
    back = P.tree_unflatten(leaves, spec)
    assert_close(back, td)
    assert back["n"].batch_size == (4, 3, 5)


def test_context_is_small_hashable_json_and_size_free():
    td4, td7 = make_td(4), make_td(7)
    _, s4 = P.tree_flatten(td4)
    _, s7 = P.tree_flatten(td7)
    assert s4 == s7  # no absolute sizes in the spec
    hash(s4.context)
    json.dumps(P.treespec_dumps(s4))
    s_back = P.treespec_loads(P.treespec_dumps(s4))
    assert s_back == s4
    assert_close(P.tree_unflatten(P.tree_leaves(td7), s_back), td7)


def test_empty_tensordict_keeps_its_batch_size():
    td = TensorDict(batch_size=[2, 3])
    leaves, spec = P.tree_flatten(td)
    assert leaves == []
    assert P.tree_unflatten([], spec).batch_size == (2, 3)
    assert P.treespec_loads(P.treespec_dumps(spec)) == spec


def test_flatten_with_keys_paths():
    td = make_td()
    pairs, _ = P.tree_flatten_with_path(td)
    paths = [P.keystr(p) for p, _ in pairs]
    assert paths == ["['a']", "['n']['c']", "['e']"]


def test_tree_map_keeps_batch_size():
    td = make_td()
    out = P.tree_map(lambda x: x * 2, td)
    assert isinstance(out, TensorDict)
    assert out.batch_size == (4, 3)
    assert out["n"].batch_size == (4, 3, 5)
    assert torch.equal(out["e"], td["e"] * 2)
    # removing the same leading dim from every leaf removes it from the batch
    summed = P.tree_map(lambda x: x.sum(0), td)
    assert summed.batch_size == (3,)
    assert summed["n"].batch_size == (3, 5)


def test_optree_registration():
    td = make_td()
    leaves, spec = optree.tree_flatten(td, namespace=tdfunc.OPTREE_NAMESPACE)
    assert len(leaves) == 3
    out = optree.tree_map(lambda x: x + 1, td, namespace="tdfunc")
    assert isinstance(out, TensorDict)
    assert out.batch_size == td.batch_size
    assert_close(out, td + 1)
    paths = optree.tree_paths(td, namespace="tdfunc")
    assert paths == [("a",), ("n", "c"), ("e",)]
    assert_close(optree.tree_unflatten(spec, leaves), td)


def test_vmap_in_dims_0_batch_size_inside_and_out():
    td = make_td()
    seen = []

    def f(t):
        seen.append((t.batch_size, t["n"].batch_size))
        return t * 2

    out = torch.vmap(f)(td)
    assert seen == [(torch.Size([3]), torch.Size([3, 5]))]
    assert out.batch_size == (4, 3)
    assert out["n"].batch_size == (4, 3, 5)
    assert_close(out, td * 2)


def test_vmap_in_dims_1():
    td = make_td()
    seen = []

    def f(t):
        seen.append(t.batch_size)
        return t.sum(dim=0)

    out = torch.vmap(f, in_dims=1)(td)
    assert seen == [torch.Size([4])]
    assert out.batch_size == (3,)
    assert torch.allclose(out["e"], td["e"].sum(0))


def test_vmap_nested_and_out_dims():
    td = make_td()
    out = torch.vmap(torch.vmap(lambda t: t + 1))(td)
    assert out.batch_size == (4, 3)
    out1 = torch.vmap(lambda t: t + 1, in_dims=0, out_dims=1)(td)
    assert out1.batch_size == (3, 4)
    assert torch.equal(out1["e"], (td["e"] + 1).T)


def test_vmap_function_building_a_tensordict():
    x = torch.randn(5, 3)
    out = torch.vmap(lambda v: TensorDict(v=v, s=v.sum()))(x)
    assert out.batch_size == (5,)
    assert out["s"].shape == (5,)


def test_vmap_over_tensor_with_tensordict_unbatched():
    td = make_td()
    xs = torch.randn(6)
    out = torch.vmap(lambda x, t: t * x, in_dims=(0, None))(xs, td)
    assert out.batch_size == (6, 4, 3)
    assert torch.allclose(out["e"][2], td["e"] * xs[2])


def test_export_dynamic_batch_and_save_load():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, td: TensorDict) -> TensorDict:
            return td.set("y", self.lin(td["x"])) * 2

    m = M()
    td = TensorDict({"x": torch.randn(4, 3), "n": {"z": torch.randn(4)}}, batch_size=[4])
    b = Dim("b")
    ep = torch.export.export(m, (td,), dynamic_shapes=([{0: b}, {0: b}],))
    td7 = TensorDict({"x": torch.randn(7, 3), "n": {"z": torch.randn(7)}}, batch_size=[7])
    out = ep.module()(td7)
    assert isinstance(out, TensorDict)
    assert out.batch_size == (7,)
    assert_close(out, m(td7))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    assert_close(loaded.module()(td7), m(td7))


def test_pickle_copy_deepcopy():
    td = make_td()
    back = pickle.loads(pickle.dumps(td))
    assert_close(back, td)
    buf = io.BytesIO()
    torch.save(td, buf)
    buf.seek(0)
    assert_close(torch.load(buf, weights_only=True), td)
    c = copy.copy(td)
    assert c["a"] is td["a"]
    d = copy.deepcopy(td)
    assert d["a"] is not td["a"]
    assert_close(d, td)


@tdfunc.tensorclass
class _Inner:
    x: torch.Tensor
    label: str = "inner"


def _deep() -> TensorDict:
    return TensorDict(
        {
            "a": torch.randn(2, 3),
            "n": {"m": {"b": torch.randn(2)}, "empty": TensorDict(batch_size=[2, 4])},
            "t": _Inner(x=torch.randn(2, 5), batch_size=[2]),
        },
        batch_size=[2],
    )


def test_a_container_is_one_pytree_node_with_every_leaf() -> None:
    td = _deep()
    leaves, spec = P.tree_flatten(td)
    # one node whose children are the leaves (torch.func transforms flatten their arguments
    # about a dozen times per call; a TreeSpec per nested node cost ~35% of a grad call)
    assert spec.num_children == spec.num_leaves == 3
    assert all(c.is_leaf() for c in spec.children())
    assert [leaf is x for leaf, x in zip(leaves, (td["a"], td["n", "m", "b"], td["t"].x))] == [
        True
    ] * 3
    # key paths still name every level
    paths = [P.keystr(p) for p, _ in P.tree_flatten_with_path(td)[0]]
    assert paths == ["['a']", "['n']['m']['b']", "['t'].x"]
    back = P.tree_unflatten([x * 2 for x in leaves], spec)
    assert isinstance(back["t"], _Inner)
    assert back["t"].label == "inner"
    assert back["n", "empty"].batch_size == (2, 4)
    assert_close(back["n", "m", "b"], td["n", "m", "b"] * 2)
    # the JSON form carries the nested types by name and comes back equal
    again = P.treespec_loads(P.treespec_dumps(spec))
    assert again == spec
    assert_close(P.tree_unflatten(leaves, again), td)
    # optree (namespace "tdfunc") keeps one node per container, with its own path entries
    _, ospec = optree.tree_flatten(td, namespace=tdfunc.OPTREE_NAMESPACE)
    assert ospec.num_children == 3
    assert ospec.num_leaves == 3


def test_vmap_keeps_nested_batch_sizes_through_one_node() -> None:
    td = _deep()
    out = torch.func.vmap(lambda t: t.apply(lambda x: x + 1))(td)
    assert out.batch_size == (2,)
    assert out["n", "empty"].batch_size == (2, 4)
    assert out["t"].batch_size == (2,)
    assert out["n", "m"].batch_size == (2,)
    assert_close(out["t"].x, td["t"].x + 1)


def test_a_spec_saved_with_one_node_per_container_still_loads() -> None:
    # the earlier form: a 7-entry context and nested containers as child specs
    td = TensorDict({"a": torch.zeros(2), "n": {"b": torch.ones(2, 3)}}, batch_size=[2])
    inner = {
        "type": "tdfunc.TensorDict",
        "context": [["b"], 1, [2], None, None, [], []],
        "children_spec": [{"type": None, "context": None, "children_spec": []}],
    }
    old = [
        1,
        {
            "type": "tdfunc.TensorDict",
            "context": [["a", "n"], 1, [1, 1], None, None, [], []],
            "children_spec": [{"type": None, "context": None, "children_spec": []}, inner],
        },
    ]
    spec = P.treespec_loads(json.dumps(old))
    back = P.tree_unflatten(P.tree_leaves(td), spec)
    assert_close(back, td)
    assert back["n"].batch_size == (2,)


def test_a_spec_naming_an_unknown_nested_container_is_refused() -> None:
    td = TensorDict({"n": {"b": torch.ones(2)}}, batch_size=[2])
    dumped = json.loads(P.treespec_dumps(P.tree_structure(td)))
    dumped[1]["context"][7][0][1] = "elsewhere.Missing"
    with pytest.raises(ValueError, match=r"'elsewhere\.Missing', which is not registered"):
        P.treespec_loads(json.dumps(dumped))


def test_a_nested_container_of_an_unregistered_subclass_stays_one_child() -> None:
    class Sub(TensorDict):  # not registered with pytree: a leaf to torch, as before
        __slots__ = ()

    td = TensorDict(n=Sub(a=torch.zeros(2), batch_size=[2]), b=torch.ones(2), batch_size=[2])
    leaves, spec = P.tree_flatten(td)
    assert [type(x).__name__ for x in leaves] == ["Sub", "Tensor"]
    back = P.tree_unflatten(leaves, spec)
    assert type(back["n"]) is Sub
    assert back.batch_size == (2,)
