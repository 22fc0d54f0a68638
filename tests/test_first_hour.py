"""A tensordict user's first calls on tdfunc: positional ``batch_size``, tensordict's names
that tdfunc spells differently (each error names the tdfunc spelling), tensordict's keyword
names (``separator=``, ``inplace=``, ``consolidate``'s options), the order of
``keys(include_nested=True)``, anonymous memory maps and ``memmap_like`` without a path.
tensordict is the oracle where it is installed."""

from __future__ import annotations

import copy
import glob
import os
import pickle
import re
import tempfile

import pytest
import torch
from helpers import check_compiled
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import _migration


def nested() -> tdfunc.TensorDict:
    return tdfunc.TensorDict(
        {
            "a": torch.rand(3, 2),
            "n": {"b": torch.rand(3), "m": {"c": torch.rand(3, 4)}},
            "z": torch.rand(3),
        },
        [3],
    )


# ---------------------------------------------------------------------------- construction
def test_batch_size_is_the_second_positional_argument_as_in_tensordict() -> None:
    T = pytest.importorskip("tensordict")
    d = {"a": torch.rand(4, 3), "n": {"b": torch.rand(4)}}
    ours = tdfunc.TensorDict(d, [4])
    ref = T.TensorDict(d, [4])
    assert ours.batch_size == ref.batch_size == torch.Size([4])
    assert ours["n"].batch_size == torch.Size([4])
    assert tdfunc.TensorDict(d, [4], "cpu").device == T.TensorDict(d, [4], "cpu").device
    assert tdfunc.TensorDict(d, 4).batch_size == torch.Size([4])
    # existing calls keep their meaning
    assert tdfunc.TensorDict(d, batch_size=[4]).batch_size == torch.Size([4])
    assert tdfunc.TensorDict(a=torch.zeros(2)).keys() == ["a"]
    assert tdfunc.TensorDict(d).batch_size == torch.Size([])
    with pytest.raises(ValueError, match=r"key 'a'.*\(4, 3\).*\(5,\)"):
        tdfunc.TensorDict(d, [5])


def test_positional_batch_size_compiles_fullgraph_without_recompiles() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        td = tdfunc.TensorDict({"x": x, "y": x * 2}, [x.shape[0]])
        return (td * 2)["y"]

    cnt = CompileCounterWithBackend("eager")
    g = torch.compile(f, fullgraph=True, backend=cnt)
    x, y = torch.rand(4, 3), torch.rand(4, 3)
    torch.testing.assert_close(g(x), f(x))
    torch.testing.assert_close(g(y), f(y))  # new values: no recompile
    assert cnt.frame_count == 1


def test_tensorclass_keeps_batch_size_keyword_only_as_tensordict() -> None:
    T = pytest.importorskip("tensordict")

    @T.tensorclass
    class Ref:
        x: torch.Tensor

    @tdfunc.tensorclass
    class Ours:
        x: torch.Tensor

    with pytest.raises(TypeError):
        Ref(torch.zeros(3), [3])
    assert (
        Ours(torch.zeros(3), batch_size=[3]).batch_size
        == Ref(torch.zeros(3), batch_size=[3]).batch_size
    )


# ---------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    ("get", "spelling"),
    [
        (lambda td: td.setdefault, "td if key in td else td.set(key, value)"),
        (lambda td: td.to_module, "tdfunc.functional_call(module, td, args)"),
        (lambda td: td.memmap, "tdfunc.save(td, path)"),
        (lambda td: td.memmap_like, "tdfunc.memmap_like(td, path)"),
        (lambda td: td.save, "tdfunc.save(td, path)"),
        (lambda td: tdfunc.TensorDict.from_module, "tdfunc.from_module(module)"),
        (lambda td: tdfunc.TensorDict.load_memmap, "tdfunc.load(path)"),
        (lambda td: tdfunc.lazy_stack, "tdfunc.stack(tds, dim)"),
    ],
)
def test_a_renamed_name_raises_naming_its_spelling(get, spelling) -> None:
    td = nested()
    with pytest.raises(AttributeError, match=re.escape(spelling)):
        get(td)


def test_the_hint_costs_nothing_when_the_name_exists_and_keeps_protocols() -> None:
    td = nested()
    assert not hasattr(td, "memmap")
    assert not hasattr(tdfunc.TensorDict, "from_module")
    assert not hasattr(tdfunc, "lazy_stack")
    assert hasattr(td, "set")
    assert hasattr(tdfunc.TensorDict, "from_dict")
    assert "_migration" not in type(tdfunc.TensorDict).__dict__  # a plain metaclass hook
    assert type(tdfunc.TensorDict).__getattr__ is not None
    tdfunc.testing.assert_close(copy.deepcopy(td), td)
    tdfunc.testing.assert_close(pickle.loads(pickle.dumps(td)), td)
    assert getattr(tdfunc.TensorDict, "__no_such_protocol__", None) is None
    leaves, spec = torch.utils._pytree.tree_flatten(td)
    tdfunc.testing.assert_close(torch.utils._pytree.tree_unflatten(leaves, spec), td)


def test_every_package_row_names_a_spelling_that_exists_or_says_why() -> None:
    for name, row in _migration.MODULE_TABLE.items():
        assert not hasattr(tdfunc, name), name
        with pytest.raises(AttributeError) as e:
            getattr(tdfunc, name)
        assert (row.spelling or row.note) in str(e.value), name


# ---------------------------------------------------------------------------- keywords
def test_separator_is_accepted_as_tensordict_spells_it() -> None:
    T = pytest.importorskip("tensordict")
    td = nested()
    ref = tdfunc.to_tensordict(td)
    flat = td.flatten_keys(separator="/")
    assert flat.keys() == list(ref.flatten_keys(separator="/").keys())
    assert flat.keys() == td.flatten_keys("/").keys() == td.flatten_keys(sep="/").keys()
    back = flat.unflatten_keys(separator="/")
    tdfunc.testing.assert_close(back, td)
    assert isinstance(ref, T.TensorDict)


@pytest.mark.parametrize(
    ("call", "spelling"),
    [
        (lambda td: td.select("a", inplace=True), "td = td.select(*keys)"),
        (lambda td: td.exclude("a", inplace=True), "td = td.exclude(*keys)"),
        (lambda td: td.apply(torch.exp, inplace=True), "td = td.apply(fn, *others)"),
        (lambda td: td.named_apply(lambda k, x: x, inplace=True), "td = td.named_apply(fn"),
        (lambda td: td.contiguous(inplace=True), "td = td.contiguous()"),
        (lambda td: td.consolidate(inplace=True), "td = td.consolidate()"),
        (lambda td: td.flatten(0, 0, inplace=True), "td = td.flatten(start_dim, end_dim)"),
        (lambda td: td.unflatten(0, (3, 1), inplace=True), "td = td.unflatten(dim, sizes)"),
        (lambda td: td.flatten_keys(".", True), "td = td.flatten_keys(separator)"),
        (lambda td: td.unflatten_keys(".", True), "td = td.unflatten_keys(separator)"),
        (lambda td: td.set("q", torch.zeros(3), inplace=True), "td = td.set(key, value)"),
        (lambda td: td.update({"q": torch.zeros(3)}, inplace=True), "td = td.update(other)"),
    ],
)
def test_inplace_true_raises_naming_the_pure_spelling(call, spelling) -> None:
    td = nested()
    before = td.clone()
    with pytest.raises(tdfunc.InPlaceError, match=re.escape(spelling)):
        call(td)
    tdfunc.testing.assert_close(td, before)


def test_update_inplace_false_is_not_a_key() -> None:
    td = tdfunc.TensorDict(a=torch.zeros(()))
    out = td.update({"b": torch.ones(())}, inplace=False)
    assert out.keys() == ["a", "b"]


def test_consolidate_takes_num_threads_and_names_save_for_a_filename() -> None:
    td = nested()
    c = td.consolidate(num_threads=2)
    tdfunc.testing.assert_close(c, td)
    with pytest.raises(TypeError, match=re.escape("tdfunc.save(td, path)")):
        td.consolidate(filename="x.bin")
    with pytest.raises(TypeError, match=re.escape("td.consolidate().to(device)")):
        td.consolidate(device="cpu")


# ---------------------------------------------------------------------------- keys order
def test_nested_keys_list_a_container_after_its_keys_as_tensordict() -> None:
    pytest.importorskip("tensordict")
    td = nested()
    ref = tdfunc.to_tensordict(td)
    for args in [(True,), (True, True), (False,), (False, True)]:
        assert td.keys(*args) == list(ref.keys(*args)), args
    assert [k for k, _ in td.items(True)] == td.keys(True)
    assert len(td.values(True)) == len(td.keys(True))


# ---------------------------------------------------------------------------- memmap
def _leftovers(prefix: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*"))


def test_memory_mapped_tensor_empty_without_a_filename_is_anonymous() -> None:
    before = _leftovers("tdfunc-anonymous-")
    t = tdfunc.MemoryMappedTensor.empty((2, 3), torch.float32)
    assert t.shape == (2, 3)
    assert t.dtype == torch.float32
    assert t.mode == "r+"
    t[0] = 1.0
    assert t.sum().item() == 3.0
    assert tdfunc.MemoryMappedTensor.zeros(4, torch.int64).tolist() == [0, 0, 0, 0]
    assert _leftovers("tdfunc-anonymous-") == before  # nothing left on disk
    with pytest.raises(tdfunc.StoreReplacedError, match="no longer exists"):
        pickle.loads(pickle.dumps(t))


def test_memmap_like_without_a_path_uses_a_temporary_folder() -> None:
    T = pytest.importorskip("tensordict")
    before = _leftovers("tdfunc-memmap-like-")
    td = nested()
    buf = tdfunc.memmap_like(td)
    ref = tdfunc.to_tensordict(td).memmap_like()
    assert isinstance(ref, T.TensorDict)
    assert buf.batch_size == ref.batch_size
    assert buf.keys(True, True) == list(ref.keys(True, True))
    for k in buf.keys(True, True):
        assert buf[k].shape == ref[k].shape
        assert buf[k].dtype == ref[k].dtype
        assert isinstance(buf[k], tdfunc.MemoryMappedTensor)
        assert buf[k].mode == "r+"
    buf["a"][1] = 5.0
    assert buf["a"].sum().item() == 10.0
    assert _leftovers("tdfunc-memmap-like-") == before


# ---------------------------------------------------------------------------- DataLoader
@pytest.mark.parametrize("collate_fn", [None, lambda x: x], ids=["default", "identity"])
def test_dataloader_over_a_container_batches_as_tensordict(collate_fn) -> None:
    """tensordict's tutorials pass ``collate_fn=lambda x: x`` to a DataLoader over a container:
    a batch is read in one gather (``__getitems__``), and either collate gives it whole."""
    T = pytest.importorskip("tensordict")
    data = tdfunc.TensorDict({"x": torch.arange(8.0), "n": {"y": torch.rand(8, 2)}}, [8])
    kw = {} if collate_fn is None else {"collate_fn": collate_fn}
    ours = list(torch.utils.data.DataLoader(data, batch_size=3, **kw))
    theirs = list(torch.utils.data.DataLoader(tdfunc.to_tensordict(data), batch_size=3, **kw))
    assert [type(b) for b in ours] == [tdfunc.TensorDict] * 3
    assert [b.batch_size for b in ours] == [b.batch_size for b in theirs]
    for a, b in zip(ours, theirs):
        assert isinstance(b, T.TensorDict)
        tdfunc.testing.assert_close(a, tdfunc.from_tensordict(b, copy=True))
    shuffled = next(iter(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, **kw)))
    assert sorted(shuffled["x"].tolist()) == data["x"].tolist()
    for i, x in enumerate(shuffled["x"].long().tolist()):
        torch.testing.assert_close(shuffled["n", "y"][i], data["n", "y"][x])


def test_getitems_is_one_gather() -> None:
    td = nested()
    got = td.__getitems__([2, 0])
    tdfunc.testing.assert_close(got, td[torch.tensor([2, 0])])
    with pytest.raises(IndexError):
        td.__getitems__([5])


# ---------------------------------------------------------------------------- more keywords
def test_keys_sort_as_tensordict() -> None:
    pytest.importorskip("tensordict")
    td = tdfunc.TensorDict(
        {"z": torch.zeros(3), "b": {"y": torch.zeros(3), "a": torch.zeros(3)}, "a": torch.zeros(3)},
        [3],
    )
    ref = tdfunc.to_tensordict(td)
    for args in [(), (True,), (True, True)]:
        assert td.keys(*args, sort=True) == list(ref.keys(*args, sort=True)), args
        assert [k for k, _ in td.items(*args, sort=True)] == td.keys(*args, sort=True)
        assert len(td.values(*args, sort=True)) == len(td.keys(*args, sort=True))


def test_clone_recurse_false_shares_the_leaves_as_tensordict() -> None:
    td = nested()
    shallow = td.clone(recurse=False)
    assert shallow["a"] is td["a"]
    assert shallow["n", "m", "c"] is td["n", "m", "c"]
    pytest.importorskip("tensordict")
    ref = tdfunc.to_tensordict(td)
    assert ref.clone(recurse=False)["a"] is ref["a"]
    assert td.clone()["a"] is not td["a"]


def test_update_takes_tensordict_options_and_never_makes_them_keys() -> None:
    td = tdfunc.TensorDict(a=torch.zeros(()))
    x = torch.ones(())
    out = td.update({"b": x, "n": {"c": x}}, clone=True, non_blocking=True)
    assert out.keys(True) == ["a", "b", ("n", "c"), "n"]
    assert out["b"] is not x
    assert out["n", "c"] is not x
    assert torch.equal(out["b"], x)
    assert td.update({"b": x})["b"] is x
    for option, spelling in [
        ("keys_to_update", "other.select(*keys, strict=False)"),
        ("ignore_lock", "never locked"),
        ("update_batch_size", "batch_size=new"),
        ("is_leaf", "td.update(other)"),
    ]:
        with pytest.raises(TypeError, match=re.escape(spelling)):
            td.update({"b": x}, **{option: True})


# ---------------------------------------------------------------------------- ported tutorials
def _dataset(n: int = 6) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.rand(1, 4, 4, generator=g), i % 3) for i in range(n)]


def test_tensorclass_fashion_tutorial_port_gives_tensordict_values() -> None:
    """tensordict's tensorclass_fashion tutorial, ported with the guide's one-line changes:
    ``MemoryMappedTensor.empty(shape, dtype=...)`` without a file, then ``data[i] = ...``
    spelled as a write into the memory-mapped leaves (the container itself is a value)."""
    T = pytest.importorskip("tensordict")
    dataset = _dataset()

    @T.tensorclass
    class Theirs:
        images: torch.Tensor
        targets: torch.Tensor

    ref = Theirs(
        images=T.MemoryMappedTensor.empty((len(dataset), 4, 4), dtype=torch.float32),
        targets=T.MemoryMappedTensor.empty((len(dataset),), dtype=torch.int64),
        batch_size=[len(dataset)],
    )
    for i, (image, target) in enumerate(dataset):
        ref[i] = Theirs(images=image.squeeze(), targets=torch.tensor(target), batch_size=[])

    @tdfunc.tensorclass
    class Ours:
        images: torch.Tensor
        targets: torch.Tensor

    data = Ours(
        images=tdfunc.MemoryMappedTensor.empty((len(dataset), 4, 4), dtype=torch.float32),
        targets=tdfunc.MemoryMappedTensor.empty((len(dataset),), dtype=torch.int64),
        batch_size=[len(dataset)],
    )
    with pytest.raises(tdfunc.InPlaceError, match=re.escape("tdfunc.write_at(td, index, value)")):
        data[0] = Ours(images=dataset[0][0].squeeze(), targets=torch.tensor(0), batch_size=[])
    for i, (image, target) in enumerate(dataset):
        data.images[i] = image.squeeze()  # the leaves are files opened "r+": writes go there
        data.targets[i] = target
    torch.testing.assert_close(data.images * 1, ref.images * 1)
    torch.testing.assert_close(data.targets * 1, ref.targets * 1)
    batch = next(iter(torch.utils.data.DataLoader(data, batch_size=4)))
    assert isinstance(batch, Ours)
    torch.testing.assert_close(batch.images * 1, ref[:4].images * 1)


def test_keys_and_shapes_tutorial_port_gives_tensordict_values() -> None:
    """tensordict's keys / shapes / slicing tutorials, ported with the guide's changes (the
    in-place writes rebind the name)."""
    T = pytest.importorskip("tensordict")
    g = torch.Generator().manual_seed(1)
    d = {"key 1": torch.rand(3, 4, 5, generator=g), "key 2": torch.zeros(3, 4, 5, dtype=torch.bool)}
    ref = T.TensorDict(d, [3, 4])
    td = tdfunc.TensorDict(d, [3, 4])
    ref["key 3"] = torch.ones(3, 4)
    td = td.set("key 3", torch.ones(3, 4))
    ref.set(("nested", "x"), torch.rand(3, 4, 2, generator=g))
    td = td.set(("nested", "x"), ref["nested", "x"])
    ref.rename_key_("key 1", "key 4")
    td = td.rename_key("key 1", "key 4")
    ref.del_("key 2")
    td = td.exclude("key 2")
    # a renamed key keeps its place here (tensordict moves it last: the table's note)
    assert sorted(map(str, td.keys(True))) == sorted(map(str, ref.keys(True)))
    assert td.keys(True, sort=True) == list(ref.keys(True, sort=True))
    for got, want in [
        (td[0], ref[0]),
        (td[:, 1], ref[:, 1]),
        (td.reshape(-1), ref.reshape(-1)),
        (td.unsqueeze(0), ref.unsqueeze(0)),
        (td.permute(1, 0), ref.permute(1, 0)),
        (torch.stack([td, td], 0), torch.stack([ref, ref], 0)),
        (torch.cat([td, td], 0), torch.cat([ref, ref], 0)),
        (td.flatten_keys(separator="."), ref.flatten_keys(separator=".")),
    ]:
        assert got.batch_size == want.batch_size
        assert got.keys(True, sort=True) == list(want.keys(True, sort=True))
        for k in got.keys(True, True):
            torch.testing.assert_close(got[k], want[k])
    value, td = td.popped("key 3")
    torch.testing.assert_close(value, ref.pop("key 3"))
    assert td.keys(True, sort=True) == list(ref.keys(True, sort=True))


@pytest.mark.parametrize(
    "fn",
    [
        lambda td: td.flatten_keys(separator="/").unflatten_keys(separator="/") * 2,
        lambda td: td.popped("a")[1].update({"c": td["a"]}, clone=True, non_blocking=True),
        lambda td: td.clone(recurse=False).select("a", inplace=False).exclude("a") + 1,
        lambda td: [v * 2 for v in td.values(True, True, sort=True)],
        lambda td: td.consolidate(num_threads=2) * 1,
        lambda td: tdfunc.TensorDict({"x": td["a"] + 1, "n": td["n"]}, td.batch_size) * 2,
    ],
    ids=[
        "separator",
        "popped_update_clone",
        "clone_recurse_select",
        "sort",
        "consolidate",
        "positional",
    ],
)
def test_tensordict_keywords_compile_fullgraph_without_recompiles(fn) -> None:
    """The tensordict spellings, on an input and on a container made inside the function:
    one frame, eager values, no recompile on new values."""
    check_compiled(fn, lambda: (nested(),))


def test_tensordict_constructor_options_are_not_keys() -> None:
    """``names``, ``non_blocking`` and ``lock`` are tensordict's constructor options (its
    fourth to sixth arguments), never keys: ``lock`` and ``non_blocking`` are accepted,
    ``names`` is a TypeError naming the way to keep a key of that name."""
    T = pytest.importorskip("tensordict")
    d = {"a": torch.zeros(3)}
    ours = tdfunc.TensorDict(d, [3], "cpu", None, True, True)
    ref = T.TensorDict(d, [3], "cpu", None, True, True)
    assert ours.keys() == list(ref.keys()) == ["a"]
    assert tdfunc.TensorDict(d, [3], lock=True, non_blocking=False).keys() == ["a"]
    with pytest.raises(TypeError, match=re.escape("TensorDict({'names': x})")):
        tdfunc.TensorDict(d, [3], names=["batch"])
    assert tdfunc.TensorDict({"names": torch.zeros(3), "lock": torch.ones(3)}, [3]).keys() == [
        "names",
        "lock",
    ]


def test_setting_batch_size_or_device_names_the_pure_spelling() -> None:
    td = tdfunc.TensorDict({"a": torch.zeros(3, 4), "n": {"b": torch.zeros(3, 4, 2)}}, [3, 4])
    with pytest.raises(TypeError, match=re.escape("td = tdfunc.TensorDict(dict(td.items()), ")):
        td.batch_size = [3]
    with pytest.raises(TypeError, match=re.escape("td = td.to(device)")):
        td.device = "cpu"
    with pytest.raises(TypeError, match="dim names are not supported"):
        td.names = ["x", None]
    assert td.batch_size == torch.Size([3, 4])
    pytest.importorskip("tensordict")
    ref = tdfunc.to_tensordict(td)
    ref.batch_size = [3]
    new = tdfunc.TensorDict(dict(td.items()), [3])  # the spelling the error names
    assert new.batch_size == ref.batch_size
    assert new["n"].batch_size == ref["n"].batch_size  # a nested container keeps its own
    tdfunc.testing.assert_close(new, tdfunc.from_tensordict(ref, copy=True))
