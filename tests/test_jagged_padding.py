"""Fixed shapes from variable lengths: to_padded / collate_jagged with a fixed length, a
multiple, truncation and a padding side, and LengthGroupedSampler; values against a per-row
oracle, every bad option, and the number of compiles over an epoch of random lengths."""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.data import DataLoader

import tdfunc
from tdfunc._jagged import _batch as B
from tdfunc._jagged import _sampler as S

LENGTHS = (5, 1, 9, 3)


def batch_of(lengths: tuple[int, ...] = LENGTHS) -> tdfunc.TensorDict:
    """Tokens (2-d rows) and features (3-d rows), each row numbered so a wrong pick shows."""
    return tdfunc.as_jagged(
        [
            tdfunc.TensorDict(
                tok=torch.arange(1, n + 1) + 100 * i,
                feat=(torch.arange(1, n + 1, dtype=torch.float32) + 100 * i)[:, None].repeat(1, 2),
                label=torch.tensor(i),
            )
            for i, n in enumerate(lengths)
        ],
        keys=["tok", "feat"],
    )


def oracle(
    rows: list[torch.Tensor],
    value: float,
    length: int | None,
    multiple: int | None,
    max_length: int | None,
    cut: str,
    side: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row in Python: truncate, then pad to the width."""
    kept = []
    for r in rows:
        if max_length is not None and len(r) > max_length:
            r = r[:max_length] if cut == "right" else r[len(r) - max_length :]
        kept.append(r)
    width = max(len(r) for r in kept) if length is None else length
    if multiple is not None:
        width = -(-width // multiple) * multiple
    out, masks = [], []
    for r in kept:
        pad = r.new_full((width - len(r), *r.shape[1:]), value)
        m = torch.zeros(width, dtype=torch.bool)
        if side == "right":
            out.append(torch.cat([r, pad]))
            m[: len(r)] = True
        else:
            out.append(torch.cat([pad, r]))
            m[width - len(r) :] = True
        masks.append(m)
    return torch.stack(out), torch.stack(masks)


OPTIONS = [
    {"length": None, "multiple": None, "max_length": None},
    {"length": 12, "multiple": None, "max_length": None},
    {"length": None, "multiple": 4, "max_length": None},
    {"length": None, "multiple": None, "max_length": 4},
    {"length": 6, "multiple": None, "max_length": 6},
    {"length": 5, "multiple": 4, "max_length": 4},
    {"length": None, "multiple": 8, "max_length": 3},
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize(("cut", "side"), list(itertools.product(["right", "left"], repeat=2)))
def test_values_and_masks_match_a_row_by_row_oracle(
    opts: dict[str, Any], cut: str, side: str
) -> None:
    jb = batch_of()
    before = [x.values().clone() for x in (jb["tok"], jb["feat"])]
    out = tdfunc.to_padded(
        jb,
        -1,
        length=opts["length"],
        pad_to_multiple_of=opts["multiple"],
        max_length=opts["max_length"],
        truncation_side=cut,
        padding_side=side,
    )
    for key in ("tok", "feat"):
        want, mask = oracle(
            list(jb[key].unbind()),
            -1,
            opts["length"],
            opts["multiple"],
            opts["max_length"],
            cut,
            side,
        )
        assert torch.equal(out[key], want), key
        assert torch.equal(out["masks", key], mask), key
    assert torch.equal(out["label"], jb["label"])
    assert out.batch_size == jb.batch_size == torch.Size([4])
    # the input is left as it was, and from_padded gives the (truncated) rows back
    assert all(torch.equal(b, x.values()) for b, x in zip(before, (jb["tok"], jb["feat"])))
    back = tdfunc.from_padded(out)
    for key in ("tok", "feat"):
        want, mask = oracle(
            list(jb[key].unbind()), -1, None, None, opts["max_length"], cut, "right"
        )
        rows = [w[m] for w, m in zip(want, mask)]
        assert [r.tolist() for r in back[key].unbind()] == [r.tolist() for r in rows]


def test_rows_made_by_narrow_keep_their_own_starts() -> None:
    """A jagged leaf with lengths (holes between rows, as torch.nested.narrow makes them)."""
    values = torch.arange(20.0).reshape(4, 5)
    nt = torch.nested.narrow(
        values, 1, torch.tensor([0, 1, 2, 0]), torch.tensor([3, 2, 3, 5]), layout=torch.jagged
    )
    td = tdfunc.TensorDict(x=nt, batch_size=[4])
    out = tdfunc.to_padded(
        td, 0.0, length=6, max_length=4, truncation_side="left", padding_side="left"
    )
    rows = [values[0, 0:3], values[1, 1:3], values[2, 2:5], values[3, 1:5]]
    want = torch.stack([torch.cat([torch.zeros(6 - len(r)), r]) for r in rows])
    assert torch.equal(out["x"], want)
    assert out["masks", "x"].sum(1).tolist() == [3, 2, 3, 4]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"length": 0}, B.PAD_POSITIVE.format(fn="to_padded", name="length", got=0)),
        ({"length": -3}, B.PAD_POSITIVE.format(fn="to_padded", name="length", got=-3)),
        ({"length": 2.5}, B.PAD_POSITIVE.format(fn="to_padded", name="length", got=2.5)),
        ({"length": True}, B.PAD_POSITIVE.format(fn="to_padded", name="length", got=True)),
        (
            {"pad_to_multiple_of": 0},
            B.PAD_POSITIVE.format(fn="to_padded", name="pad_to_multiple_of", got=0),
        ),
        ({"max_length": 0}, B.PAD_POSITIVE.format(fn="to_padded", name="max_length", got=0)),
        (
            {"padding_side": "middle"},
            B.PAD_SIDE.format(fn="to_padded", name="padding_side", got="middle"),
        ),
        (
            {"truncation_side": "start"},
            B.PAD_SIDE.format(fn="to_padded", name="truncation_side", got="start"),
        ),
    ],
)
def test_bad_options_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        tdfunc.to_padded(batch_of(), **kw)
    assert str(e.value) == message


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_row_longer_than_length_is_refused_naming_the_key(compiled: bool) -> None:
    """Never a silent truncation: ``max_length`` is how to cut (torch's to_padded_tensor
    with an output size cuts without a word)."""
    message = B.PAD_TOO_LONG.format(key="'tok'", length=8)

    def pad(td: tdfunc.TensorDict) -> tdfunc.TensorDict:
        return tdfunc.to_padded(td.exclude("feat"), 0, length=8)

    fn = torch.compile(pad, backend="eager", fullgraph=True) if compiled else pad
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        fn(batch_of())
    assert type(e.value) is ValueError
    assert str(e.value) == message
    assert torch.equal(
        fn(batch_of((3, 8)))["tok"], torch.tensor([[1, 2, 3, 0, 0, 0, 0, 0], list(range(101, 109))])
    )


def test_collate_options_need_pad_and_mask_key_stays_checked() -> None:
    data = [tdfunc.TensorDict(tok=torch.arange(n)) for n in (3, 1)]
    for name, v in (
        ("length", 4),
        ("max_length", 2),
        ("padding_side", "left"),
        ("pad_to_multiple_of", 8),
    ):
        with pytest.raises(ValueError, match=re.escape(B.PAD_NEEDS_PAD.format(name=name))) as e:
            tdfunc.collate_jagged(data, **{name: v})
        assert str(e.value) == B.PAD_NEEDS_PAD.format(name=name)
    with pytest.raises(KeyError, match=re.escape(B.MASK_KEY_TAKEN.format(key="'tok'"))):
        tdfunc.collate_jagged(data, pad=True, mask_key="tok", keys=["tok"], length=4)
    for name in ("length", "pad_to_multiple_of"):
        with pytest.raises(ValueError, match=re.escape(B.PAD_NEEDS_KEYS.format(name=name))) as e:
            tdfunc.collate_jagged(data, pad=True, **{name: 4})
        assert str(e.value) == B.PAD_NEEDS_KEYS.format(name=name)
    out = tdfunc.collate_jagged(
        data, pad=True, value=-1, keys=["tok"], length=4, padding_side="left"
    )
    assert out["tok"].tolist() == [[-1, 0, 1, 2], [-1, -1, -1, 0]]
    # rows of one length are padded too (keys=): every batch has the fixed shape
    same = [tdfunc.TensorDict(tok=torch.arange(2)) for _ in range(3)]
    out = tdfunc.collate_jagged(same, pad=True, keys=["tok"], length=4)
    assert out["tok"].tolist() == [[0, 1, 0, 0]] * 3
    assert out["masks", "tok"].sum(1).tolist() == [2, 2, 2]


def test_padding_inside_grad_and_compiled_gives_eagers_values() -> None:
    """The jagged batch padded inside the differentiated function (the leaf is not
    differentiated), eager and compiled: the values and gradient of the eager call."""
    jb = batch_of()

    def loss(w: torch.Tensor, jb: tdfunc.TensorDict) -> torch.Tensor:
        pb = tdfunc.to_padded(jb, 0.0, length=12, max_length=6, padding_side="left")
        return (pb["feat"] * w).sum() + pb["masks", "feat"].sum()

    w = torch.tensor([1.0, 2.0])
    want = (w * batch_of((5, 1, 6, 3))["feat"].values().sum(0)).sum() + 15
    g_eager, v_eager = torch.func.grad_and_value(loss)(w, jb)
    torch.testing.assert_close(v_eager, want)
    cnt = CompileCounterWithBackend("eager")
    compiled = torch.compile(torch.func.grad_and_value(loss), backend=cnt, fullgraph=True)
    g, v = compiled(w, jb)
    torch.testing.assert_close((g, v), (g_eager, v_eager))
    assert cnt.frame_count == 1


def epoch(seed: int, n: int = 96) -> list[tdfunc.TensorDict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 65, (n,), generator=gen).tolist()
    return [tdfunc.TensorDict(tok=torch.arange(m) % 50) for m in lengths]


def compiles_over_an_epoch(
    loader: DataLoader, dynamic: bool | None = False
) -> tuple[int, set[int]]:
    torch._dynamo.reset()  # no shapes remembered from another epoch (automatic dynamic)
    emb = torch.randn(50, 4)
    cnt = CompileCounterWithBackend("eager")

    @torch.compile(backend=cnt, fullgraph=True, dynamic=dynamic)
    def step(tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (emb[tok] * mask[..., None]).sum() / mask.sum()

    widths = set()
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=256):
        batches = [(b, step(b["tok"], b["masks", "tok"])) for b in loader]
    for b, out in batches:
        widths.add(b["tok"].shape[1])
        torch.testing.assert_close(
            out, (emb[b["tok"]] * b["masks", "tok"][..., None]).sum() / b["masks", "tok"].sum()
        )
    return cnt.frame_count, widths


def test_compiles_over_an_epoch_of_random_lengths() -> None:
    """One compile per padded shape: a fixed length gives one over the epoch, a multiple of
    16 with batches grouped by length a handful, padding to the longest row one per width
    (a static compile; torch's automatic dynamic shapes make that two, at the price of a
    shape-generic graph)."""
    data = epoch(0)
    longest = functools.partial(tdfunc.collate_jagged, pad=True)
    fixed = functools.partial(tdfunc.collate_jagged, pad=True, keys=["tok"], length=64)
    multiple = functools.partial(
        tdfunc.collate_jagged, pad=True, keys=["tok"], pad_to_multiple_of=16
    )
    sampler = tdfunc.LengthGroupedSampler([len(d["tok"]) for d in data], batch_size=8, group_size=4)

    n_longest, w_longest = compiles_over_an_epoch(
        DataLoader(data, batch_size=8, collate_fn=longest)
    )
    n_fixed, w_fixed = compiles_over_an_epoch(DataLoader(data, batch_size=8, collate_fn=fixed))
    n_multi, w_multi = compiles_over_an_epoch(
        DataLoader(data, batch_sampler=sampler, collate_fn=multiple)
    )
    n_dyn, _ = compiles_over_an_epoch(
        DataLoader(data, batch_size=8, collate_fn=longest), dynamic=None
    )
    assert (n_fixed, w_fixed) == (1, {64})
    assert n_multi == len(w_multi) <= 4
    assert w_multi <= {16, 32, 48, 64}
    assert n_longest == len(w_longest) >= 5
    assert n_dyn == 2


def test_sampler_groups_similar_lengths_and_visits_each_sample_once() -> None:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 500, (203,), generator=gen)
    sampler = tdfunc.LengthGroupedSampler(lengths, batch_size=8, group_size=5, seed=3)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 26
    assert sorted(i for b in batches for i in b) == list(range(203))
    assert [len(b) for b in batches].count(8) == 25
    # within a batch, the spread of lengths is far below the dataset's
    spread = [int(lengths[b].max() - lengths[b].min()) for b in batches]
    random_spread = [
        int(lengths[i : i + 8].max() - lengths[i : i + 8].min()) for i in range(0, 200, 8)
    ]
    assert sum(spread) < sum(random_spread) / 3
    # reproducible per (seed, epoch), another order next epoch
    assert list(tdfunc.LengthGroupedSampler(lengths, 8, group_size=5, seed=3)) == batches
    sampler.set_epoch(1)
    assert list(sampler) != batches
    assert sorted(i for b in sampler for i in b) == list(range(203))


def test_sampler_without_shuffle_and_with_drop_last() -> None:
    lengths = [1, 5, 2, 4, 3]
    sampler = tdfunc.LengthGroupedSampler(lengths, batch_size=2, group_size=1, shuffle=False)
    assert list(sampler) == [[1, 0], [3, 2], [4]]
    dropped = tdfunc.LengthGroupedSampler(
        lengths, batch_size=2, group_size=10, shuffle=False, drop_last=True
    )
    assert list(dropped) == [[1, 3], [4, 2]]
    assert len(dropped) == 2


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([1, 2], 0), {}, S.SAMPLER_POSITIVE.format(name="batch_size", got=0)),
        (([1, 2], 2), {"group_size": 0}, S.SAMPLER_POSITIVE.format(name="group_size", got=0)),
        (([1, 2], True), {}, S.SAMPLER_POSITIVE.format(name="batch_size", got=True)),
        (([1, -2], 2), {}, S.SAMPLER_LENGTHS.format(got="a negative or bool entry")),
        (([1.5, 2.0], 2), {}, S.SAMPLER_LENGTHS.format(got="shape (2,), torch.float32")),
        (([[1], [2]], 2), {}, S.SAMPLER_LENGTHS.format(got="shape (2, 1), torch.int64")),
        ((["a", "b"], 2), {}, S.SAMPLER_LENGTHS.format(got="list")),
    ],
)
def test_sampler_refuses_bad_input(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        tdfunc.LengthGroupedSampler(*args, **kwargs)
    assert str(e.value) == message
