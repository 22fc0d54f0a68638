"""Property-based tests: flatten/unflatten round-trips and "no op changes its input"."""

from __future__ import annotations

import optree
import torch
import torch.utils._pytree as P
from hypothesis import given, settings
from hypothesis import strategies as st

import tdfunc
from tdfunc import TensorDict
from tdfunc.testing import assert_close

KEYS = st.text(alphabet="abcdefgh", min_size=1, max_size=3)
DTYPES = st.sampled_from([torch.float32, torch.float64, torch.int64])


@st.composite
def containers(draw, depth: int = 2):
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    return draw(_node(batch, depth))


@st.composite
def _node(draw, batch, depth):
    keys = draw(st.lists(KEYS, min_size=0, max_size=4, unique=True))
    data = {}
    for k in keys:
        if depth > 0 and draw(st.booleans()):
            extra = tuple(draw(st.lists(st.integers(1, 2), max_size=1)))
            data[k] = draw(_node(batch + extra, depth - 1))
        else:
            feat = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
            dtype = draw(DTYPES)
            seed = draw(st.integers(0, 2**16))
            g = torch.Generator().manual_seed(seed)
            data[k] = (torch.randn(batch + feat, generator=g) * 10).to(dtype)
    return TensorDict(data, batch_size=batch)


@settings(max_examples=40, deadline=None)
@given(containers())
def test_flatten_unflatten_round_trip(td):
    leaves, spec = P.tree_flatten(td)
    back = P.tree_unflatten(leaves, spec)
    assert_close(back, td)
    assert P.treespec_loads(P.treespec_dumps(spec)) == spec
    oleaves, ospec = optree.tree_flatten(td, namespace="tdfunc")
    assert_close(optree.tree_unflatten(ospec, oleaves), td)
    assert len(oleaves) == len(leaves) == len(td.leaves())


OPS = [
    lambda t: t + 1,
    lambda t: t * t,
    lambda t: -t,
    lambda t: t.clone(),
    lambda t: t.to(torch.float64),
    lambda t: t.apply(lambda x: x * 0),
    lambda t: tdfunc.zeros_like(t),
    lambda t: t.consolidate(),
    lambda t: t.set("zz", torch.zeros(t.batch_size)),
    lambda t: t.exclude(*t.keys()[:1]),
    lambda t: t.flatten_keys().unflatten_keys(),
    lambda t: t.sum(),
    lambda t: t.unsqueeze(0),
    lambda t: tdfunc.stack([t, t]),
    lambda t: t.reshape(-1) if t.batch_dims else t,
    lambda t: t[0] if t.batch_dims else t,
    lambda t: t.at[0].set(0) if t.batch_dims else t,
    lambda t: t.at[0].add(1) if t.batch_dims else t,
    lambda t: t.unbind(0) if t.batch_dims else t,
    lambda t: tdfunc.cat([t, t]) if t.batch_dims else t,
]


@settings(max_examples=60, deadline=None)
@given(containers(), st.sampled_from(range(len(OPS))))
def test_no_op_modifies_its_input(td, op_index):
    before = td.clone()
    keys = td.keys(True)
    out = OPS[op_index](td)
    assert_close(td, before)
    assert td.keys(True) == keys
    if tdfunc.is_container(out):
        for x in out.leaves():
            assert isinstance(x, torch.Tensor)
