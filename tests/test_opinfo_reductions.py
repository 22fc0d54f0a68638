"""Conformance of the reductions against torch's own op database (OpInfo ``reduction_ops``).

Each CPU float32 sample of a reduction OpInfo is wrapped in a nested container whose batch
size is the sample's shape; the leaves carry extra feature dims (and a nested container has
an extra batch dim of its own). The oracle is torch itself, on the sample as torch defines
it: when the sample names dims, feature slice ``f`` of every result leaf must equal
``op(leaf[..., f], *args, **kwargs)`` (every dim names a batch dim); when it names none, each
whole leaf is reduced (``op(leaf)``, a batch-shaped mask expanded over the leaf), except
``all``/``any``, which then give one 0-d tensor over every leaf (``td.all()``). An op lifts
when all its samples pass: all 29 do, the ``torch.masked`` reductions that divide by a plain
count tensor (``mean``, ``var``, ``std`` with a mask) included, since a plain tensor next to a
container is shaped like the batch.

Every sample of every op runs (about 6 s on one core); ``TDFUNC_OPINFO_SAMPLES=n`` runs the
first ``n`` of each op.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from typing import Any

import pytest
import torch

import tdfunc

common = pytest.importorskip(
    "torch.testing._internal.common_methods_invocations", exc_type=ImportError
)

MAX_SAMPLES = int(os.environ.get("TDFUNC_OPINFO_SAMPLES", "0")) or None

#: the family: torch's reduction OpInfos (``op_db``'s; the ``_refs.*`` entries of
#: ``reduction_ops`` are Python reference implementations, listed below)
OPS = [op for op in common.reduction_ops if not op.name.startswith("_refs.")]
REFS = [op for op in common.reduction_ops if op.name.startswith("_refs.")]

#: OpInfos that do not lift, with the reason (the test checks that they still do not): none
NOT_LIFTED: dict[str, str] = {}

#: Python reference implementations (``torch._refs``) take no part in ``__torch_function__``
#: dispatch: called with a container they read tensor attributes it does not have
REFS_REASON = "torch._refs functions do not dispatch __torch_function__"


def _container(x: torch.Tensor) -> tdfunc.TensorDict:
    s = tuple(x.shape)
    a = torch.stack([x, 2 * x - 1], -1)  # feature dims (2,)
    b = torch.stack([x, -x, x + 0.5], -1).unsqueeze(-1).expand(*s, 3, 2).clone()
    inner = tdfunc.TensorDict(b=b, batch_size=[*s, 3])  # one extra batch dim of its own
    return tdfunc.TensorDict(a=a, n=inner, batch_size=list(s))


#: the ``torch.masked`` reductions that canonicalise ``dim=None`` to every dim
_MASKED_ALL_DIMS = {
    f"masked.{n}"
    for n in ("sum", "prod", "amax", "amin", "mean", "norm", "var", "std", "logsumexp")
}


#: reductions that, without a dim, aggregate over every leaf into one tensor
_AGGREGATES = {"all", "any"}


def _dims_named(op: Any, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether the sample names dims: ``dim`` bound by the op's Python signature, else a
    ``dim`` keyword or an integer (list) argument. An explicit empty list names every dim
    (as torch reads it): every batch dim of a container.

    The ``torch.masked`` functions turn ``dim=None`` into every dim of ``input.ndim``
    before they call torch (``_canonical_dim``): on a container, every batch dim."""
    if op.name in _MASKED_ALL_DIMS:
        return True
    try:
        bound = inspect.signature(op.op).bind(x, *args, **kwargs).arguments
    except (TypeError, ValueError):  # a builtin: no Python signature
        bound = dict(kwargs)
        for a in args:
            if (isinstance(a, int) and not isinstance(a, bool)) or (
                isinstance(a, (list, tuple)) and all(isinstance(d, int) for d in a)
            ):
                bound["dim"] = a
    return bound.get("dim") is not None


def _align(t: Any, leaf: torch.Tensor, bd: int) -> Any:
    """A mask broadcast to the batch shape (as torch broadcasts it to the input), then
    expanded over the leaf's feature dims."""
    if isinstance(t, torch.Tensor) and t.ndim <= bd and leaf.ndim > bd:
        batch, feat = leaf.shape[:bd], leaf.shape[bd:]
        t = t.broadcast_to(batch)
        return t.reshape(batch + (1,) * len(feat)).expand(leaf.shape)
    return t


def _expected_leaf(op: Any, leaf: torch.Tensor, bd: int, named: bool, args: tuple, kw: dict):
    if not named:
        return op.op(
            leaf,
            *[_align(a, leaf, bd) for a in args],
            **{k: _align(v, leaf, bd) for k, v in kw.items()},
        )
    feat = leaf.shape[bd:]
    flat = leaf.reshape(*leaf.shape[:bd], math.prod(feat))
    outs = [op.op(flat[..., f], *args, **kw) for f in range(flat.shape[-1])]
    if isinstance(outs[0], torch.Tensor):
        r = torch.stack(outs, -1)
        return r.reshape(*r.shape[:-1], *feat)
    parts = []
    for j in range(len(outs[0])):
        r = torch.stack([o[j] for o in outs], -1)
        parts.append(r.reshape(*r.shape[:-1], *feat))
    return tuple(parts)


def _check_sample(op: Any, sample: Any) -> None:
    x = sample.input
    args, kw = tuple(sample.args), dict(sample.kwargs)
    td = _container(x)
    bd = x.ndim
    named = _dims_named(op, x, args, kw)
    got = op.op(td, *args, **kw)
    if op.name in _AGGREGATES and not named:
        # ``torch.all(td)`` / ``any`` without a dim: one 0-d bool tensor over every leaf
        # (``td.all()``, as tensordict's), never a Python bool
        want = op.op(torch.stack([op.op(leaf) for leaf in td.leaves()]))
        torch.testing.assert_close(got, want)
        return
    got_parts = (got,) if tdfunc.is_container(got) else tuple(got)
    for key in (("a",), ("n", "b")):
        leaf = td.get(key)
        want = _expected_leaf(op, leaf, bd, named, args, kw)
        want_parts = (want,) if isinstance(want, torch.Tensor) else tuple(want)
        assert len(got_parts) == len(want_parts)
        for g, w in zip(got_parts, want_parts):
            torch.testing.assert_close(g.get(key), w, equal_nan=True, check_dtype=True)


def _samples(op: Any, limit: int | None = MAX_SAMPLES) -> list[Any]:
    out = []
    for s in op.sample_inputs("cpu", torch.float32):
        if not isinstance(s.input, torch.Tensor):
            continue
        out.append(s)
        if limit is not None and len(out) >= limit:
            break
    return out


def _lifts(op: Any, limit: int | None = MAX_SAMPLES) -> tuple[bool, str]:
    for i, s in enumerate(_samples(op, limit)):
        try:
            with warnings.catch_warnings():  # torch's own (e.g. std with no degree of freedom)
                warnings.simplefilter("ignore", UserWarning)
                _check_sample(op, s)
        except Exception as e:  # the first failure is the reason reported
            return False, f"sample {i} (shape {tuple(s.input.shape)}, {s.args}, {s.kwargs}): {e!r}"
    return True, ""


@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.name}.{op.variant_test_name}".rstrip("."))
def test_reduction_opinfo_lifts(op: Any) -> None:
    name = f"{op.name}.{op.variant_test_name}".rstrip(".")
    if name in NOT_LIFTED:  # every sample: the failing one may be late in the list
        ok, _ = _lifts(op, None)
        assert not ok, f"{name} lifts now: remove it from NOT_LIFTED"
        return
    ok, why = _lifts(op)
    assert ok, why


def test_family_share() -> None:
    """The share of the family that lifts: all 29 (each checked above)."""
    names = {f"{op.name}.{op.variant_test_name}".rstrip(".") for op in OPS}
    assert set(NOT_LIFTED) <= names
    assert len(OPS) == 29
    assert not NOT_LIFTED


@pytest.mark.parametrize("name", ["sum", "std", "linalg.vector_norm", "argmax", "amax"])
def test_opinfo_samples_compiled(name: str) -> None:
    """A sample of the family under ``torch.compile(fullgraph=True)``: one frame, equal to
    eager, no recompile on new values."""
    from torch._dynamo.testing import CompileCounterWithBackend

    op = next(o for o in OPS if o.name == name and not o.variant_test_name)
    sample = next(
        s for s in _samples(op, None) if s.input.ndim >= 2 and s.kwargs.get("dim") is not None
    )
    args, kw = tuple(sample.args), dict(sample.kwargs)

    def fn(td: Any) -> Any:
        return op.op(td, *args, **kw)

    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    td = _container(sample.input)
    tdfunc.testing.assert_close(cfn(td), fn(td))
    td2 = _container(torch.randn_like(sample.input))
    tdfunc.testing.assert_close(cfn(td2), fn(td2))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("op", REFS, ids=lambda op: op.name)
def test_refs_do_not_dispatch(op: Any) -> None:
    """The ``torch._refs`` entries are not lifted: a container never reaches tdfunc there."""
    ok, _ = _lifts(op, 1)
    assert not ok


#: the ``torch.masked`` reductions that divide the reduced container by a plain count tensor
_COUNT_DIVIDING = ["masked.mean", "masked.var", "masked.std"]


@pytest.mark.parametrize("name", _COUNT_DIVIDING)
def test_count_dividing_masked_reductions_are_exact_with_feature_dims(name: str) -> None:
    """``torch.masked.mean`` / ``var`` / ``std`` with a mask divide the reduced container by
    a plain count tensor of the reduced batch shape (``torch.divide``, a lifted alias of
    ``div``): the count is shaped like the batch, so on a leaf ``[4, 4, 4]`` (batch
    ``[4, 4]``) it divides batch positions, not the last dim, where the sizes coincide. Each
    feature slice equals torch on that slice; a leaf of the batch shape too."""
    op = next(o for o in OPS if o.name == name)
    g = torch.Generator().manual_seed(0)
    x, m = torch.rand(4, 4, 4, generator=g), torch.rand(4, 4, generator=g) > 0.3
    td = tdfunc.TensorDict(a=x, r=x[..., 0], batch_size=[4, 4])
    before = td.clone()
    for dim in (0, 1):
        got = op.op(td, dim, mask=m)
        want = torch.stack([op.op(x[..., f], dim, mask=m) for f in range(4)], -1)
        assert got.batch_size == (4,)
        torch.testing.assert_close(got["a"], want, equal_nan=True)
        torch.testing.assert_close(got["r"], want[..., 0], equal_nan=True)
    tdfunc.testing.assert_close(td, before)
