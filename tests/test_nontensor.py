"""Non-tensor leaves: a value shared by the container, or one Python object per batch position.

tensordict (``NonTensorData`` / ``NonTensorStack``) is the oracle for every operation it has.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import NonTensor, TensorDict
from tdfunc import _nontensor as NT
from tdfunc.memmap import _errors as ME

tensordict = pytest.importorskip("tensordict")

PROMPTS = ["a", "b", "c", "d"]


def make(prompts=PROMPTS, text="hi"):
    n = len(prompts)
    return TensorDict(
        r=torch.arange(float(n)),
        obs=torch.arange(2.0 * n).reshape(n, 2),
        text=text,
        prompt=list(prompts),
        batch_size=[n],
    )


def oracle(prompts=PROMPTS, text="hi"):
    n = len(prompts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tensordict.TensorDict(
            r=torch.arange(float(n)),
            obs=torch.arange(2.0 * n).reshape(n, 2),
            text=text,
            prompt=tensordict.NonTensorStack.from_list(list(prompts)),
            batch_size=[n],
        )


def _plain(v):
    """tensordict's non-tensor answers (LinkedList, NonTensorData) as plain nested tuples."""
    if isinstance(v, (list, tuple)) or type(v).__name__ == "LinkedList":
        return tuple(_plain(x) for x in v)
    return v


def _same(ours, theirs, keys=("text", "prompt")):
    assert ours.batch_size == theirs.batch_size
    for k in keys:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _plain(ours[k]) == _plain(theirs[k]), k
    assert torch.equal(ours["r"], theirs["r"])


# ------------------------------------------------------------------ construction
def test_shared_and_per_sample_construction():
    td = make()
    assert td["text"] == "hi"
    assert td["prompt"] == ("a", "b", "c", "d")
    items = dict(td.items())
    assert not items["text"].is_per_sample
    assert items["prompt"].is_per_sample
    assert TensorDict(n=None, batch_size=[2])["n"] is None
    # a list given in is copied into an immutable tuple
    src = ["x", "y"]
    td2 = TensorDict(p=src, batch_size=[2])
    src[0] = "changed"
    assert td2["p"] == ("x", "y")
    with pytest.raises(AttributeError, match=NT.NONTENSOR_IMMUTABLE):
        items["prompt"].value = ()
    # numbers (and lists of numbers) stay tensors, as in tensordict
    assert isinstance(TensorDict(v=[1, 2, 3], batch_size=[3])["v"], torch.Tensor)


def test_multi_dim_batch_needs_nested_lists():
    td = TensorDict(p=[["a", "b"], ["c", "d"], ["e", "f"]], batch_size=[3, 2])
    assert td[1, 0]["p"] == "c"
    assert td[:, 1]["p"] == ("b", "d", "f")
    assert td.reshape(6)["p"] == ("a", "b", "c", "d", "e", "f")
    assert td.permute(1, 0)["p"] == (("a", "c", "e"), ("b", "d", "f"))


def test_bad_per_sample_values_name_the_key():
    msg = NT.PER_SAMPLE_LENGTH.format(key="'p'", got=(2,), batch_size=(3,))
    with pytest.raises(ValueError, match=re.escape(msg)):
        TensorDict(p=["a", "b"], batch_size=[3])
    with pytest.raises(ValueError, match=re.escape(NT.PER_SAMPLE_NO_BATCH.format(key="'p'"))):
        TensorDict(p=["a", "b"])
    bad = NonTensor.per_sample(["a", "b"])
    msg = NT.NONTENSOR_SHAPE.format(key="'p'", got=(2,), batch_size=(3,))
    with pytest.raises(ValueError, match=re.escape(msg)):
        make()[:3].set("p", bad)
    # an op that cannot move a per-sample value (a reduction over the batch) names the key
    msg = NT.NONTENSOR_OP.format(key="'prompt'", op="this operation", got=(4,), batch_size=())
    with pytest.raises(TypeError, match=re.escape(msg)):
        make().sum(0)
    # an op along the batch by the tensors' values: the values could not follow
    for op, call in [("flip", lambda t: t.flip(0)), ("roll", lambda t: torch.roll(t, 1, 0))]:
        msg = NT.NONTENSOR_ALONG_BATCH.format(key="'prompt'", op=op)
        with pytest.raises(TypeError, match=re.escape(msg)):
            call(make())
    assert make().exclude("prompt").flip(0)["r"].tolist() == [3.0, 2.0, 1.0, 0.0]


# ------------------------------------------------------------------ against tensordict
@pytest.mark.parametrize(
    "idx",
    [1, -1, slice(1, 3), slice(None, None, 2), "tensor", "mask"],
    ids=["int", "neg", "slice", "step", "tensor", "mask"],
)
def test_indexing_matches_tensordict(idx):
    if idx == "tensor":
        idx = torch.tensor([3, 0, 0])
    elif idx == "mask":
        idx = torch.tensor([True, False, True, True])
    td, ref = make(), oracle()
    _same(td[idx], ref[idx])
    assert td["prompt"] == tuple(PROMPTS)  # the input is not changed


def test_stack_cat_unbind_split_reshape_match_tensordict():
    td, ref = make(), oracle()
    td2, ref2 = make(["e", "f", "g", "h"], "bye"), oracle(["e", "f", "g", "h"], "bye")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(tdfunc.stack([td, td2]), torch.stack([ref, ref2]))
        _same(tdfunc.stack([td, td2], 1), torch.stack([ref, ref2], 1))
        _same(tdfunc.stack([td, td]), torch.stack([ref, ref]))
        _same(tdfunc.cat([td, td2]), torch.cat([ref, ref2]))
        _same(tdfunc.cat([td, td]), torch.cat([ref, ref]))
        for a, b in zip(td.unbind(0), ref.unbind(0)):
            _same(a, b)
        for a, b in zip(td.split([1, 3]), ref.split([1, 3])):
            _same(a, b)
        _same(td.reshape(2, 2), ref.reshape(2, 2))
    # cat of equal shared values keeps one shared value, as tensordict
    assert not dict(tdfunc.cat([td, td]).items())["text"].is_per_sample
    assert dict(tdfunc.stack([td, td]).items())["text"].is_per_sample


def test_elementwise_ops_pass_non_tensor_leaves_through():
    td, ref = make(), oracle()
    mask = torch.tensor([True, False, True, False])
    other = make(["w", "x", "y", "z"], "other")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _same(td + 1, ref + 1)
        _same(td * 2 - td, ref * 2 - ref)
        _same(torch.where(mask, td, 0.0), torch.where(mask, ref, 0.0))
    # between two containers the first one's values pass through (tensordict picks per
    # position by the mask, which needs the mask's values: not a graph op)
    picked = torch.where(mask, td, other)
    assert picked["prompt"] == tuple(PROMPTS)
    assert picked["text"] == "hi"
    assert picked["r"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert (td.exp())["prompt"] == tuple(PROMPTS)
    assert td.apply(lambda x: x * 0)["text"] == "hi"
    assert td.clone()["prompt"] == tuple(PROMPTS)


def test_key_ops():
    td = make()
    assert td.select("text", "r").keys() == ["text", "r"]  # the order asked for
    assert td.exclude("text", "prompt").keys() == ["r", "obs"]
    assert td.set("text", "new")["text"] == "new"
    assert td.set("prompt", ["p", "q", "r", "s"])[2]["prompt"] == "r"
    up = td.update({"text": "u", "n": {"z": ["1", "2", "3", "4"]}})
    assert up["text"] == "u"
    assert up["n", "z"] == ("1", "2", "3", "4")
    assert td.get("text") == "hi"
    assert td.get(("prompt",)) == tuple(PROMPTS)
    assert "text" in td


def test_eq_matches_tensordict():
    a, b = make(), make(["a", "x", "c", "y"])
    ra, rb = oracle(), oracle(["a", "x", "c", "y"])
    assert (a == b)["prompt"].tolist() == (ra == rb)["prompt"].tolist()
    assert (a == b)["text"].tolist() == (ra == rb)["text"].tolist()
    assert (a != b)["prompt"].tolist() == [False, True, False, True]
    c = make(text="other")
    assert (a == c)["text"].tolist() == (ra == oracle(text="other"))["text"].tolist()


def test_tolist_and_repr_match_tensordict():
    td, ref = make()[:2], oracle()[:2]
    ours = td.tolist()
    theirs = ref.tolist()
    for o, t in zip(ours, theirs):
        assert o["text"] == t["text"]
        assert o["prompt"] == t["prompt"]
        assert torch.equal(o["r"], t["r"])
    text = repr(make())
    assert "text: 'hi'" in text
    assert "prompt: NonTensor(per_sample, shape=(4,))" in text
    assert repr(NonTensor("x")) == "NonTensor('x')"


def test_to_and_from_tensordict():
    td = make().set("n", TensorDict(q=[["1", "2"]] * 4, batch_size=[4, 2]))
    out = tdfunc.to_tensordict(td)
    assert isinstance(out.get("text"), tensordict.NonTensorData)
    assert isinstance(out.get("prompt"), tensordict.NonTensorStack)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert out[2]["prompt"] == "c"
        assert out["text"] == "hi"
    back = tdfunc.from_tensordict(out)
    assert back["text"] == "hi"
    assert back["prompt"] == tuple(PROMPTS)
    assert back["n", "q"] == (("1", "2"),) * 4
    assert bool((back == td).all())


# ------------------------------------------------------------------ pytree, vmap, torch.func
def test_pytree_keeps_non_tensor_leaves_in_the_structure():
    td = make()
    flat, spec = torch.utils._pytree.tree_flatten(td)
    assert all(isinstance(x, torch.Tensor) for x in flat)
    assert len(flat) == 2
    back = torch.utils._pytree.tree_unflatten(flat, spec)
    assert back["prompt"] == tuple(PROMPTS)
    assert back["text"] == "hi"
    import optree

    leaves, ospec = optree.tree_flatten(td, namespace=tdfunc.OPTREE_NAMESPACE)
    assert len(leaves) == 2
    assert optree.tree_unflatten(ospec, leaves)["prompt"] == tuple(PROMPTS)
    # the JSON form of the spec (export) keeps them
    dumped = torch.utils._pytree.treespec_dumps(spec)
    again = torch.utils._pytree.treespec_loads(dumped)
    assert torch.utils._pytree.tree_unflatten(flat, again)["prompt"] == tuple(PROMPTS)
    json.loads(dumped)


def test_vmap_and_grad_pass_non_tensor_leaves_through():
    td = make()
    out = torch.vmap(lambda t: t * 2)(td)
    assert out["prompt"] == tuple(PROMPTS)
    assert out["text"] == "hi"
    assert torch.equal(out["r"], td["r"] * 2)
    g = torch.func.grad(lambda t: (t["r"] ** 2).sum())(td)
    assert torch.equal(g["r"], 2 * td["r"])
    assert g["prompt"] == tuple(PROMPTS)


# ------------------------------------------------------------------ compile
def _compiled(fn):
    cc = CompileCounterWithBackend("eager")
    return torch.compile(fn, backend=cc, fullgraph=True), cc


MASK = torch.tensor([True, False, True, False])


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: torch.where(MASK, t, 0.0),
        lambda t: t.apply(lambda x: x * 2),
        lambda t: t.clone().to(torch.float64),
        lambda t: torch.vmap(lambda x: x.exp())(t),
        lambda t: t.set("s", t["r"] + 1),
    ],
    ids=["where", "apply", "clone_to", "vmap", "set"],
)
def test_compiled_ops_keep_one_graph_for_new_values(fn):
    torch._dynamo.reset()
    f, cc = _compiled(fn)
    for i in range(3):
        prompts = [f"q{i}{j}" for j in range(4)]
        out = f(make(prompts, text=f"t{i}"))
        assert out["prompt"] == tuple(prompts)
        assert out["text"] == f"t{i}"
    assert cc.frame_count == 1


def test_compiled_function_that_does_not_read_them_does_not_recompile():
    torch._dynamo.reset()
    f, cc = _compiled(lambda t: (t * 2 + 1).exp())
    for i in range(3):
        prompts = [f"p{i}{j}" for j in range(4)]
        td = make(prompts, text=f"text {i}")
        out = f(td)
        assert out["prompt"] == tuple(prompts)
        assert out["text"] == f"text {i}"
        assert torch.allclose(out["r"], (td["r"] * 2 + 1).exp())
    assert cc.frame_count == 1


def test_compiled_function_that_reads_them_specialises():
    torch._dynamo.reset()
    f, cc = _compiled(lambda t: t["r"] * len(t["text"]))
    for text in ("a", "bb", "a"):
        assert torch.equal(f(make(text=text)), torch.arange(4.0) * len(text))
    assert cc.frame_count == 2


def test_compiled_int_and_slice_indexing_and_stack_keep_one_graph():
    torch._dynamo.reset()
    f, cc = _compiled(lambda t: tdfunc.stack([t[1:], t[1:]]) * 2)
    out = f(make())
    assert out["prompt"] == (("b", "c", "d"),) * 2
    assert cc.frame_count == 1


# ------------------------------------------------------------------ storage
def test_save_load_round_trip(tmp_path):
    td = make().set(
        "n", TensorDict(q=[[1, None], [2.5, True], ["x", [1, 2]], [0, 0]], batch_size=[4, 2])
    )
    tdfunc.save(td, tmp_path / "s")
    back = tdfunc.load(tmp_path / "s")
    assert back["text"] == "hi"
    assert back["prompt"] == tuple(PROMPTS)
    assert back["n", "q"] == td["n", "q"]
    assert bool((back == td).all())


def test_save_refuses_what_json_cannot_hold(tmp_path):
    td = make().set("obj", NonTensor(object()))
    msg = ME.NONTENSOR_NOT_JSON.format(key="'obj'", typ="object")
    with pytest.raises(TypeError, match=re.escape(msg)):
        tdfunc.save(td, tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_json_reader_refuses_bad_values():
    with pytest.raises(ValueError, match="not a stored non-tensor value"):
        NT.from_json({"shape": [2], "value": {"__class__": "os.system"}})
    with pytest.raises(ValueError, match="not a stored non-tensor value"):
        NT.from_json({"shape": [-1], "value": None})
    with pytest.raises(ValueError, match="one entry per batch position"):
        NT.from_json({"shape": [3], "value": {"list": ["a"], "tuple": True}})


def test_safetensors_round_trip_and_refusal(tmp_path):
    pytest.importorskip("safetensors")
    from tdfunc.interop import _errors as IE

    td = make()
    tdfunc.save_safetensors(td, tmp_path / "x.safetensors")
    back = tdfunc.load_safetensors(tmp_path / "x.safetensors")
    assert back["text"] == "hi"
    assert back["prompt"] == tuple(PROMPTS)
    bad = td.set("obj", NonTensor({1, 2}))
    msg = IE.NONTENSOR_NOT_JSON.format(
        key="'obj'", filename=str(tmp_path / "y.safetensors"), typ="set"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        tdfunc.save_safetensors(bad, tmp_path / "y.safetensors")


def test_exported_program_keeps_them_through_save_and_load(tmp_path):
    class M(torch.nn.Module):
        def forward(self, td):
            return td * 2

    td = make()
    ep = torch.export.export(M(), (td,))
    torch.export.save(ep, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2").module()
    out = loaded(td)
    assert out["prompt"] == tuple(PROMPTS)
    assert out["text"] == "hi"
    assert torch.equal(out["r"], td["r"] * 2)
    # the values are part of the exported input spec (constants of the program): other
    # values are refused by torch, never silently replaced by the traced ones
    with pytest.raises(ValueError, match="tree spec"):
        loaded(make(["w", "x", "y", "z"], "new"))
