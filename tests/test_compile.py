"""Every public op under ``torch.compile(fullgraph=True)``: equal to eager, one frame at most,
no recompile on new values, no recompile across batch sizes with ``dynamic=True``."""

from __future__ import annotations

import pytest
import torch
from corpus import CONTAINERS, FLOAT_ONLY, KEYED, OPS, nested
from helpers import check_compiled, compare
from torch._dynamo.testing import CompileCounterWithBackend

import tdfunc
from tdfunc import TensorDict

CASES = [(c, o) for c in CONTAINERS for o in OPS]
CASES += [(c, o) for c in ("nested",) for o in FLOAT_ONLY]
CASES += [(c, o) for c, ops in KEYED.items() for o in ops]

# bool masks give data-dependent shapes: Dynamo needs capture_dynamic_output_shape_ops
NEEDS_DYNAMIC_OUTPUT = {"bool_mask_2d"}


def _op(name):
    return OPS.get(name) or FLOAT_ONLY.get(name) or KEYED["nested"][name]


@pytest.mark.parametrize(("container", "op"), CASES, ids=[f"{c}-{o}" for c, o in CASES])
def test_op_compiles_fullgraph(container, op):
    fn = _op(op)
    make = CONTAINERS[container]
    snap = make()
    before = snap.clone()
    check_compiled(fn, lambda: (make(),))
    # the op never changes its input
    fn(snap)
    tdfunc.testing.assert_close(snap, before)


@pytest.mark.parametrize(
    "op",
    [
        "add_scalar",
        "index_slice",
        "reshape",
        "stack",
        "cat",
        "sum_dim",
        "apply",
        "at_set",
        "expand",
        "to_dtype",
        "all_dim",
    ],
)
def test_no_recompile_across_batch_sizes_dynamic(op):
    """unbind / split produce a number of outputs that depends on the batch size, so they
    specialise on it by nature and are not in this list."""
    fn = OPS[op]
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True, dynamic=True)
    for b in (4, 6, 8, 10):
        td = TensorDict({"a": torch.randn(b, 3), "n": {"c": torch.randn(b, 2)}}, batch_size=[b])
        compare(cfn(td), fn(td))
    assert cnt.frame_count == 1


def test_automatic_dynamic_after_one_recompile():
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(lambda t: t * 2, backend=cnt, fullgraph=True)
    for b in (4, 5, 6, 7):
        cfn(TensorDict(a=torch.randn(b, 3), batch_size=[b]))
    assert cnt.frame_count == 2  # static, then automatic dynamic


def test_same_keys_other_insertion_order_is_a_new_structure():
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(lambda t: t + 1, backend=cnt, fullgraph=True)
    cfn(TensorDict(a=torch.zeros(2), b=torch.zeros(2)))
    cfn(TensorDict(a=torch.ones(2), b=torch.ones(2)))
    assert cnt.frame_count == 1


def test_bool_mask_with_dynamic_output_shapes():
    fn = KEYED["nested"]["bool_mask_2d"]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        cnt = check_compiled(fn, lambda: (nested(),))
    assert cnt.frame_count == 1


def test_construction_inside_compiled_function():
    def f(x, y):
        td = TensorDict({"x": x, "n": {"y": y}}, batch_size=[x.shape[0]])
        return (td * 2).set("z", td["x"] + td["n", "y"])

    check_compiled(f, lambda: (torch.randn(3), torch.randn(3)))


def test_errors_raise_the_same_under_compile():
    td = nested()

    def index(t):
        return t[0, 0, 0]

    def add(t):
        return t + t.exclude("a")

    for fn, exc, msg in (
        (index, IndexError, "too many indices"),
        (add, ValueError, "missing keys"),
    ):
        with pytest.raises(exc, match=msg):
            fn(td)
        # with fullgraph=True Dynamo reports the error as Unsupported, keeping the message
        with pytest.raises(torch._dynamo.exc.Unsupported, match=msg):
            torch.compile(fn, backend="eager", fullgraph=True)(td)
        torch._dynamo.reset()  # forget the failed frame, so the next compile traces again
        # without fullgraph the caller sees the eager type and message
        with pytest.raises(exc, match=msg):
            torch.compile(fn, backend="eager")(td)


@pytest.mark.slow
def test_inductor_real_compiled_execution():
    def f(td):
        return (td * 2 + 1).sum(dim=0).set("s", td["a"].sum(-1).mean(0))

    td = TensorDict({"a": torch.randn(8, 3), "n": {"b": torch.randn(8)}}, batch_size=[8])
    cnt = CompileCounterWithBackend("inductor")
    cf = torch.compile(f, backend=cnt, fullgraph=True)
    compare(cf(td), f(td))
    td2 = TensorDict({"a": torch.randn(8, 3), "n": {"b": torch.randn(8)}}, batch_size=[8])
    compare(cf(td2), f(td2))
    assert cnt.frame_count == 1
