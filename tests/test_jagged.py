"""Jagged leaves (``torch.nested``, ``layout=torch.jagged``): every op torch defines on them
works through a container; what torch does not define raises ``JaggedOpError`` naming the key."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import JaggedOpError, TensorDict
from tdfunc import _ragged as R

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


def test_vmap_over_a_container_with_a_jagged_leaf_is_refused_by_torch():
    # torch.vmap has no rule for jagged inputs; tdfunc adds none
    with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
        torch.vmap(lambda t: t * 2)(make())
