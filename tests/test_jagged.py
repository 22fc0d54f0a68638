"""Jagged leaves (``torch.nested``, ``layout=torch.jagged``): every op torch defines on them
works through a container; what torch does not define raises ``JaggedOpError`` naming the key."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import JaggedOpError, TensorDict
from tdfunc._jagged import _layout as R
from tdfunc.memmap import _errors as ME

LENS = (4, 2, 3)


def njt(lens=LENS, feat=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda n: (n,)) if feat is None else (lambda n: (n, feat))
    return torch.nested.nested_tensor(
        [torch.randn(*shape(n), generator=g) for n in lens], layout=torch.jagged
    )


def make(lens=LENS, seed=0):
    return TensorDict(
        tok=njt(lens, 2, seed), r=torch.arange(float(len(lens))), batch_size=[len(lens)]
    )


def rows(x):
    return [r.tolist() for r in x.unbind()]


def test_pointwise_and_arithmetic_fall_back_from_foreach():
    td = make()
    x = td["tok"]
    for got, want in [
        ((td + 1)["tok"], x + 1),
        ((td * td)["tok"], x * x),
        ((td - td)["tok"], x - x),
        (td.exp()["tok"], x.exp()),
        (torch.sin(td)["tok"], torch.sin(x)),
        ((-td)["tok"], -x),
        (td.clamp(min=0)["tok"], x.clamp(min=0)),
    ]:
        assert got.is_nested
        assert got.layout == torch.jagged
        assert rows(got) == rows(want)
    assert torch.equal((td + 1)["r"], td["r"] + 1)
    assert rows(td["tok"]) == rows(x)  # the input is not changed


def test_indexing_over_the_batch():
    td = make()
    x = td["tok"]
    assert torch.equal(td[1]["tok"], x[1])
    assert rows(td[1:]["tok"]) == rows(x)[1:]
    assert rows(td[::2]["tok"]) == rows(x)[::2]
    assert rows(td[torch.tensor([2, 0, 2])]["tok"]) == [rows(x)[i] for i in (2, 0, 2)]
    assert rows(td[torch.tensor([True, False, True])]["tok"]) == [rows(x)[0], rows(x)[2]]
    assert td[torch.tensor([2, 0])].batch_size == (2,)


def test_cat_split_unbind_chunk_along_the_batch():
    a, b = make(), make((1, 5), seed=1)
    c = tdfunc.cat([a, b])
    assert c.batch_size == (5,)
    assert rows(c["tok"]) == rows(a["tok"]) + rows(b["tok"])
    parts = c.split([2, 3])
    assert [rows(p["tok"]) for p in parts] == [rows(c["tok"])[:2], rows(c["tok"])[2:]]
    assert [p["tok"].tolist() for p in c.unbind(0)] == rows(c["tok"])
    assert sum(p.batch_size[0] for p in c.chunk(2)) == 5


def test_to_clone_apply():
    td = make()
    assert td.to(torch.float64)["tok"].dtype == torch.float64
    cl = td.clone()
    assert cl["tok"] is not td["tok"]
    assert rows(cl["tok"]) == rows(td["tok"])
    assert rows(td.apply(lambda t: t * 2)["tok"]) == rows(td["tok"] * 2)


def test_where_with_a_batch_mask():
    td = make()
    m = torch.tensor([True, False, True])
    x = td["tok"]
    want = [r if keep else [[0.0, 0.0]] * len(r) for r, keep in zip(rows(x), m.tolist())]
    assert rows(torch.where(m, td, 0.0)["tok"]) == want
    assert rows(td.where(m, 0.0)["tok"]) == want
    other = td * 10
    got = rows(torch.where(m, td, other)["tok"])
    assert got == [r if keep else o for r, o, keep in zip(rows(x), rows(x * 10), m.tolist())]


def test_what_torch_does_not_define_names_the_key_and_the_op():
    td = make()
    msg = R.JAGGED_OP.format(key="'tok'", op="sum", detail="")
    with pytest.raises(JaggedOpError, match=re.escape(msg)):
        td.sum(0)
    with pytest.raises(JaggedOpError, match=re.escape(msg)):
        torch.sum(td, 0)
    with pytest.raises(JaggedOpError, match="key 'tok': cumsum"):
        torch.cumsum(td, 0)
    with pytest.raises(JaggedOpError, match="key 'tok': stack"):
        tdfunc.stack([td, td])
    with pytest.raises(JaggedOpError, match=re.escape("batch shape (3, 1)")):
        td.reshape(3, 1)
    nested = TensorDict(n={"tok": njt()}, batch_size=[3])
    with pytest.raises(JaggedOpError, match=re.escape("key ('n', 'tok'): amax")):
        nested.amax(0)
    last = TensorDict(
        x=torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(2, 5)], layout=torch.jagged),
        batch_size=[2],
    )
    with pytest.raises(JaggedOpError, match=re.escape("key 'x': a batch op")):
        last[torch.tensor([1, 0])]
    with pytest.raises(JaggedOpError, match=re.escape("key 'x': cat")):
        tdfunc.cat([last, last])
    # the whole leaf reduced (batch and ragged dims) is torch's own
    assert torch.allclose(td.sum()["tok"], td["tok"].values().sum())


def _frames(fn, inputs):
    torch._dynamo.reset()
    cc = CompileCounterWithBackend("eager")
    f = torch.compile(fn, backend=cc, fullgraph=True)
    counts = []
    for x in inputs:
        f(x)
        counts.append(cc.frame_count)
    return counts


LENGTHS = [(4, 2, 3), (5, 1, 7), (2, 2, 9)]


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: (t + 1).exp() * 2,
        lambda t: torch.where(torch.tensor([True, False, True]), t, 0.0),
    ],
    ids=["pointwise", "where"],
)
def test_compiled_recompiles_no_more_than_torch_on_new_lengths(fn):
    bare = _frames(lambda x: (x + 1).exp() * 2, [njt(lens, 2) for lens in LENGTHS])
    ours = _frames(fn, [make(lens) for lens in LENGTHS])
    assert ours == bare  # torch 2.13: one recompile, at the second length, then none
    assert ours[-1] == ours[1]
    td = make(LENGTHS[-1])
    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager", fullgraph=True)(td)
    assert rows(got["tok"]) == rows(fn(td)["tok"])


def test_functional_call_passes_jagged_inputs():
    m = torch.nn.Linear(2, 3)
    params = tdfunc.from_module(m)
    td = make()
    out = tdfunc.functional_call(m, params, (td["tok"],))
    assert out.is_nested
    assert rows(out) == rows(m(td["tok"]))


@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_vmap_over_the_batch_dim_of_a_jagged_leaf():
    # torch.vmap maps a jagged tensor over its batch dim (one row per call) and returns what
    # it makes of the rows as a nested tensor of the strided layout, without sizes: a row
    # reduced to one shape comes back; a container cannot hold the rows, and an op that
    # needs them raises JaggedOpError naming the key (whatever the leaf's position)
    for td in (make(), TensorDict(r=make()["r"], tok=make()["tok"], batch_size=[3])):
        got = torch.vmap(lambda t: t["tok"].sum(0) * t["r"])(td)
        want = torch.stack([row.sum(0) * r for row, r in zip(td["tok"].unbind(), td["r"])])
        assert torch.allclose(torch.stack(got.unbind()), want)
        with pytest.raises(JaggedOpError, match=r"key 'tok': torch\.vmap over the batch dim"):
            torch.vmap(lambda t: t * 2)(td)
        with pytest.raises(JaggedOpError, match=r"key 'tok': to_padded of a jagged .* torch\.vmap"):
            torch.vmap(tdfunc.to_padded)(td)


# ------------------------------------------------------------------ storage
def _manifest(p):
    return json.loads((p / "manifest.json").read_text())


def _poke_offsets(p, new):
    """Write ``new`` (int64) over the stored offsets of key 'tok'."""
    m = _manifest(p)
    entry = m["root"]["children"]["tok"]["offsets"]
    with open(p / m["data_file"], "r+b") as f:
        f.seek(entry["offset"])
        f.write(torch.tensor(new, dtype=torch.int64).numpy().tobytes())


def test_save_load_round_trip_bit_for_bit(tmp_path):
    td = make().set("p", ["x", "y", "z"])
    tdfunc.save(td, tmp_path / "s")
    back = tdfunc.load(tmp_path / "s")
    assert back["tok"].is_nested
    assert torch.equal(back["tok"].values(), td["tok"].values())
    assert torch.equal(back["tok"].offsets(), td["tok"].offsets())
    assert back["p"] == ("x", "y", "z")
    entry = _manifest(tmp_path / "s")["root"]["children"]["tok"]
    assert entry["kind"] == "jagged"
    assert entry["lengths"] is None
    # with lengths (rows that do not cover the values)
    base = torch.arange(12.0).reshape(3, 4)
    holes = torch.nested.narrow(
        base, 1, torch.tensor([0, 1, 0]), torch.tensor([2, 3, 1]), layout=torch.jagged
    )
    tdfunc.save(TensorDict(x=holes, batch_size=[3]), tmp_path / "h")
    got = tdfunc.load(tmp_path / "h")["x"]
    assert rows(got) == rows(holes)
    assert torch.equal(got.lengths(), holes.lengths())


@pytest.mark.parametrize(
    ("offsets", "problem"),
    [
        ([0, 4, 2, 9], "offsets decrease"),
        ([0, 4, 6, 99], "are not within the 9 value rows"),
        ([-1, 4, 6, 9], "are not within the 9 value rows"),
    ],
)
def test_reader_checks_offsets_before_building(tmp_path, offsets, problem):
    tdfunc.save(make(), tmp_path / "s")
    _poke_offsets(tmp_path / "s", offsets)
    with pytest.raises(tdfunc.MemmapFormatError, match=re.escape(problem)) as e:
        tdfunc.load(tmp_path / "s")
    assert "'tok'" in str(e.value)


def test_reader_checks_offsets_match_the_batch(tmp_path):
    p = tmp_path / "s"
    tdfunc.save(TensorDict(n={"tok": njt()}, batch_size=[3]), p)
    m = _manifest(p)
    m["root"]["batch_size"] = [2]
    m["root"]["children"]["n"]["batch_size"] = [2]
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(tdfunc.MemmapFormatError, match=re.escape("4 offsets do not match")):
        tdfunc.load(p)


# a file's jagged leaf is one of the layouts torch builds, both formats, or a format error naming
# the key: without lengths the offsets split the values whole (0 first, the values' length
# last, never decreasing); with lengths (torch.nested.narrow, or offsets and lengths given
# together) each row lies in its slot between its offset and the next
def holes(lengths_dtype=torch.int64, start=(0, 1, 0), length=(2, 3, 1)):
    """A jagged leaf with lengths as torch.nested.narrow builds it: 12 values, offsets
    [0, 5, 8, 9] and lengths [2, 3, 1] by default."""
    base = torch.arange(24.0).reshape(3, 4, 2)
    x = torch.nested.narrow(
        base, 1, torch.tensor(start), torch.tensor(length, dtype=lengths_dtype), layout=torch.jagged
    )
    return TensorDict(tok=x, batch_size=[3])


def _forge_store(p, part, t):
    """Store ``t`` as the ``part`` (values / offsets / lengths) of the jagged key 'tok' of the
    store at ``p``: its bytes over the stored ones, its dtype and shape in the manifest."""
    m = _manifest(p)
    entry = m["root"]["children"]["tok"][part]
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(raw) == entry["nbytes"]
    with open(p / m["data_file"], "r+b") as f:
        f.seek(entry["offset"])
        f.write(raw)
    entry.update(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
    (p / "manifest.json").write_text(json.dumps(m))


def _forge_safetensors(f, part, t):
    """Write ``t`` as the tensor ``tok.<part>`` of the safetensors file ``f`` (with the
    safetensors package: a well-formed file whose tdfunc structure is unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(f), "pt") as r:
        meta = r.metadata()
        tensors = {k: r.get_tensor(k) for k in r.keys()}  # noqa: SIM118 (no __iter__)
    tensors[f"tok.{part}"] = t
    save_file(tensors, str(f), metadata=meta)


def _forged(fmt, tmp_path, td, part, t):
    """``td`` saved in format ``fmt`` with part ``part`` of key 'tok' replaced by ``t``; the
    function that loads it and the error type it must raise."""
    if fmt == "store":
        tdfunc.save(td, tmp_path / "s")
        _forge_store(tmp_path / "s", part, t)
        return lambda: tdfunc.load(tmp_path / "s"), tdfunc.MemmapFormatError
    pytest.importorskip("safetensors")
    f = tmp_path / "x.safetensors"
    tdfunc.save_safetensors(td, f)
    _forge_safetensors(f, part, t)
    return lambda: tdfunc.load_safetensors(f), tdfunc.SafetensorsFormatError


FORGED = [
    # no lengths: 9 values, offsets [0, 4, 6, 9]
    ("plain", "offsets", torch.tensor([1, 4, 6, 9]), "start at 0 and end at 9"),
    ("plain", "offsets", torch.tensor([0, 4, 6, 8]), "start at 0 and end at 9"),
    ("plain", "offsets", torch.tensor([1, 4, 6, 8]), "start at 0 and end at 9"),
    ("plain", "offsets", torch.tensor([0, 4, 2, 9]), "offsets decrease"),
    ("plain", "offsets", torch.tensor([0, 6, 4, 9]), "offsets decrease"),
    ("plain", "offsets", torch.tensor([0, 4, 6, 99]), "are not within the 9 value rows"),
    ("plain", "offsets", torch.tensor([-1, 4, 6, 9]), "are not within the 9 value rows"),
    ("plain", "offsets", torch.tensor([0.0, 4, 6, 9], dtype=torch.float64), "int64 or int32"),
    ("plain", "offsets", torch.tensor([0, 4, 6, 9] * 4, dtype=torch.int16), "int64 or int32"),
    ("plain", "offsets", torch.tensor([[0, 4], [6, 9]]), "offsets must be 1-D"),
    # with lengths: 12 values, offsets [0, 5, 8, 9], lengths [2, 3, 1]
    ("holes", "lengths", torch.tensor([2, 3, 2]), "runs past the next row's offset"),
    ("holes", "lengths", torch.tensor([2, 3, 5]), "runs past the next row's offset"),
    ("holes", "lengths", torch.tensor([6, 3, 1]), "runs past the next row's offset"),
    ("holes", "lengths", torch.tensor([-1, 3, 1]), "a length is negative"),
    ("holes", "lengths", torch.tensor([2.0, 3, 1], dtype=torch.float64), "lengths must be 1-D"),
    ("holes", "lengths", torch.tensor([[2, 3, 1]]), "lengths must be 1-D"),
    ("holes", "offsets", torch.tensor([0, 5, 8, 13]), "are not within the 12 value rows"),
    ("holes", "offsets", torch.tensor([-1, 5, 8, 9]), "are not within the 12 value rows"),
    ("holes", "offsets", torch.tensor([0, 5, 3, 9]), "offsets decrease"),
    ("holes", "offsets", torch.tensor([0, 5, 8, 9], dtype=torch.float64), "int64 or int32"),
]


@pytest.mark.parametrize("fmt", ["store", "safetensors"])
@pytest.mark.parametrize(("base", "part", "t", "problem"), FORGED)
def test_a_forged_jagged_leaf_is_a_format_error_naming_the_key(
    tmp_path, fmt, base, part, t, problem
):
    td = make() if base == "plain" else holes()
    load, error = _forged(fmt, tmp_path, td, part, t)
    with pytest.raises(error, match=re.escape(problem)) as e:
        load()
    assert "jagged leaf 'tok'" in str(e.value)


LAYOUTS = {
    "plain": make,
    "holes": holes,
    "narrow-after-0": lambda: holes(start=(1, 1, 1), length=(2, 2, 2)),  # offsets [1, 5, 9, 11]
    "int32-lengths": lambda: holes(lengths_dtype=torch.int32),  # narrow keeps their dtype
    "empty-holes": lambda: holes(start=(0, 0, 0), length=(0, 4, 0)),
    "empty-rows": lambda: TensorDict(tok=njt((0, 3, 0)), batch_size=[3]),
    "no-rows": lambda: TensorDict(tok=R.take_rows(njt(), torch.arange(0)), batch_size=[0]),
    # torch's documented tensor with holes: its offsets end at the values' length
    "documented-holes": lambda: TensorDict(
        tok=torch.nested.nested_tensor_from_jagged(
            torch.arange(6.0), torch.tensor([0, 2, 3, 6]), torch.tensor([1, 1, 2])
        ),
        batch_size=[3],
    ),
    "int32-offsets": lambda: TensorDict(
        tok=torch.nested.nested_tensor_from_jagged(
            torch.arange(6.0), torch.tensor([0, 2, 3, 6], dtype=torch.int32)
        ),
        batch_size=[3],
    ),
}


@pytest.mark.parametrize("fmt", ["store", "safetensors"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_torch_builds_loads_back(tmp_path, fmt, layout):
    td = LAYOUTS[layout]()
    if fmt == "store":
        tdfunc.save(td, tmp_path / "s")
        back = tdfunc.load(tmp_path / "s")
    else:
        pytest.importorskip("safetensors")
        tdfunc.save_safetensors(td, tmp_path / "x.safetensors")
        back = tdfunc.load_safetensors(tmp_path / "x.safetensors")
    x, got = td["tok"], back["tok"]
    assert rows(got) == rows(x)
    for a, b in zip(R.jagged_parts(got), R.jagged_parts(x), strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    if x.shape[0]:
        assert rows(back[0]["tok"]) == rows(x[0])  # an int index reads the first row


@pytest.mark.parametrize(
    ("offsets", "problem"),
    [([1, 4, 6, 9], "start at 0 and end at 9"), ([0, 4, 2, 9], "offsets decrease")],
)
def test_save_refuses_a_jagged_leaf_a_load_would_refuse(tmp_path, offsets, problem):
    # torch builds these without a check (and fails later, in unbind or split_with_sizes)
    x = torch.nested.nested_tensor_from_jagged(torch.arange(9.0), torch.tensor(offsets))
    td = TensorDict(tok=x, batch_size=[3])
    with pytest.raises(ValueError, match=re.escape(problem)) as e:
        tdfunc.save(td, tmp_path / "s")
    assert "key 'tok'" in str(e.value)
    assert not (tmp_path / "s").exists()
    pytest.importorskip("safetensors")
    with pytest.raises(ValueError, match=re.escape(problem)) as e:
        tdfunc.save_safetensors(td, tmp_path / "x.safetensors")
    assert "key 'tok'" in str(e.value)
    assert not (tmp_path / "x.safetensors").exists()


def test_memmap_like_refuses_jagged_leaves(tmp_path):
    msg = ME.JAGGED_LIKE.format(key="'tok'")
    with pytest.raises(TypeError, match=re.escape(msg)):
        tdfunc.memmap_like(make(), tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_save_refuses_a_ragged_dim_after_dim_1(tmp_path):
    x = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(2, 5)], layout=torch.jagged)
    msg = ME.JAGGED_RAGGED_DIM.format(key="'x'", dim=2)
    with pytest.raises(TypeError, match=re.escape(msg)):
        tdfunc.save(TensorDict(x=x, batch_size=[2]), tmp_path / "s")


# ------------------------------------------------------------------ conversions and collate
def episodes(lens=(4, 2, 3)):
    return [
        TensorDict(
            obs=torch.arange(n * 3.0).reshape(n, 3) + i,
            reward=torch.full((n,), float(i)),
            task=f"task{i}",
            batch_size=[n],
        )
        for i, n in enumerate(lens)
    ]


def test_as_jagged_batches_episodes_of_different_lengths():
    eps = episodes()
    batch = tdfunc.as_jagged(eps)
    assert batch.batch_size == (3,)
    assert batch["obs"].is_nested
    assert batch["reward"].is_nested
    assert batch["task"] == ("task0", "task1", "task2")
    for ep, row in zip(eps, batch.unbind(0)):
        assert torch.equal(row["obs"], ep["obs"])
        assert torch.equal(row["reward"], ep["reward"])
        assert row["task"] == ep["task"]
    assert eps[0]["obs"].shape == (4, 3)  # the samples are not changed


def test_as_jagged_stacks_leaves_of_one_shape_unless_named():
    samples = [TensorDict(tok=torch.arange(n), label=torch.tensor(n)) for n in (3, 1)]
    batch = tdfunc.as_jagged(samples)
    assert batch["tok"].is_nested
    assert not batch["label"].is_nested
    assert batch["label"].tolist() == [3, 1]
    same = [TensorDict(tok=torch.arange(2)) for _ in range(2)]
    assert not tdfunc.as_jagged(same)["tok"].is_nested
    assert tdfunc.as_jagged(same, keys=["tok"])["tok"].is_nested


def test_as_jagged_errors():
    with pytest.raises(ValueError, match=re.escape(tdfunc._jagged._batch.AS_JAGGED_EMPTY)):
        tdfunc.as_jagged([])
    bad = [TensorDict(x=torch.zeros(2, 3)), TensorDict(x=torch.zeros(2, 4))]
    msg = tdfunc._jagged._batch.AS_JAGGED_SHAPE.format(key="'x'", got=(2, 4), index=1, want=(2, 3))
    with pytest.raises(ValueError, match=re.escape(msg)):
        tdfunc.as_jagged(bad)
    with pytest.raises(ValueError, match=re.escape("sample 0 has batch_size (2, 2)")):
        tdfunc.as_jagged([TensorDict(x=torch.zeros(2, 2), batch_size=[2, 2])])
    with pytest.raises(ValueError, match="key 'x' is 0-d"):
        tdfunc.as_jagged([TensorDict(x=torch.tensor(1.0))], keys=["x"])
    with pytest.raises(tdfunc.KeysDifferError):
        tdfunc.as_jagged([TensorDict(x=torch.zeros(1)), TensorDict(y=torch.zeros(1))])


def test_to_padded_and_back():
    batch = tdfunc.as_jagged(episodes())
    padded = tdfunc.to_padded(batch, -1.0)
    assert padded["obs"].shape == (3, 4, 3)
    assert padded["masks", "obs"].tolist() == [
        [True] * 4,
        [True, True, False, False],
        [True, True, True, False],
    ]
    assert padded["obs"][1, 2:].eq(-1).all()
    assert padded["task"] == ("task0", "task1", "task2")
    back = tdfunc.from_padded(padded)
    assert back.keys() == batch.keys()
    assert rows(back["obs"]) == rows(batch["obs"])
    assert rows(back["reward"]) == rows(batch["reward"])
    with pytest.raises(KeyError, match="already an entry"):
        tdfunc.to_padded(padded)


def test_collate_jagged_with_a_dataloader():
    from functools import partial

    from torch.utils.data import DataLoader

    data = [TensorDict(tok=torch.arange(n) + 10 * n, text=f"s{n}") for n in (3, 1, 2, 5)]
    batches = list(DataLoader(data, batch_size=2, collate_fn=tdfunc.collate_jagged))
    assert [b["tok"].offsets().tolist() for b in batches] == [[0, 3, 4], [0, 2, 7]]
    assert batches[1]["text"] == ("s2", "s5")
    # the round trip: every sample comes back from its batch
    got = [row for b in batches for row in b.unbind(0)]
    assert all(
        torch.equal(g["tok"], d["tok"]) and g["text"] == d["text"] for g, d in zip(got, data)
    )
    padded = list(
        DataLoader(data, batch_size=2, collate_fn=partial(tdfunc.collate_jagged, pad=True))
    )
    assert padded[0]["tok"].tolist() == [[30, 31, 32], [10, 0, 0]]
    assert padded[0]["masks", "tok"].sum(1).tolist() == [3, 1]


def test_safetensors_round_trip_and_checked_offsets(tmp_path):
    pytest.importorskip("safetensors")
    td = make().set("n", TensorDict(q=make()["tok"] * 2, batch_size=[3]))
    f = tmp_path / "x.safetensors"
    tdfunc.save_safetensors(td, f)
    back = tdfunc.load_safetensors(f)
    assert torch.equal(back["tok"].values(), td["tok"].values())
    assert torch.equal(back["n", "q"].offsets(), td["tok"].offsets())
    assert rows(back["n", "q"]) == rows(td["n", "q"])
    # a reader never builds a jagged tensor from offsets that do not fit its values
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    start = 8 + n + header["tok.offsets"]["data_offsets"][0]
    bad = raw[:start] + torch.tensor([0, 4, 2, 9]).numpy().tobytes() + raw[start + 32 :]
    f.write_bytes(bad)
    with pytest.raises(tdfunc.SafetensorsFormatError, match="offsets decrease"):
        tdfunc.load_safetensors(f)


def test_consolidate_keeps_jagged_leaves_in_the_one_buffer():
    td = make().set("n", TensorDict(q=njt(), batch_size=[3]))
    out = td.consolidate()
    assert out["tok"].is_nested
    assert rows(out["tok"]) == rows(td["tok"])
    assert rows(out["n", "q"]) == rows(td["n", "q"])
    ptr = out["r"].untyped_storage().data_ptr()
    assert out["tok"].values().untyped_storage().data_ptr() == ptr


def test_compiled_to_padded_recompiles_no_more_than_torch():
    bare = _frames(lambda x: x.to_padded_tensor(0.0), [njt(lens, 2) for lens in LENGTHS])
    ours = _frames(lambda t: tdfunc.to_padded(t, 0.0), [make(lens) for lens in LENGTHS])
    assert ours == bare
    out = torch.compile(lambda t: tdfunc.to_padded(t, 0.0), backend="eager", fullgraph=True)(
        make(LENGTHS[-1])
    )
    assert out["masks", "tok"].sum(1).tolist() == list(LENGTHS[-1])
