"""The program fuzzer over the op table (``fuzz_table``): its op set is the table, a fixed
slice composes every op on a container made inside the program, and a seeded random run
checks every property of each program.

``make test`` runs the slice (every op of the table in a chain, all chains compiled as one
function with ``fullgraph=True``; vmap and grad over a sample) and a few random programs;
``make fuzz`` runs ``TDFUNC_FUZZ_EXAMPLES`` random programs (``TDFUNC_FUZZ_SEED`` picks
others), each checked alone: eager against compiled, vmap, compiled vmap, grad, compiled
grad and graph breaks with ``fullgraph=False``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from fuzz_table import (
    MADE_INSIDE,
    NO_FORM,
    Program,
    check_many,
    check_minimal,
    covering_programs,
    ops,
    random_programs,
)

from tdfunc._ops import _lift

#: torch's own warnings on the way (a vmap fallback without a batching rule, std over one
#: element) are not what these tests check
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_SEED = int(os.environ.get("TDFUNC_FUZZ_SEED", "0"))
_COUNT = int(os.environ.get("TDFUNC_FUZZ_EXAMPLES", "0"))


def test_the_fuzzer_ops_are_the_table() -> None:
    """Every method of the op table and every public torch function it lifts is fuzzed,
    or is one of :data:`fuzz_table.NO_FORM` (each with its reason): the op set is read from
    the library, so a new op is fuzzed with no edit (or fails here until it has a form)."""
    table, missing = ops()
    names = {op.name for op in table}
    assert {f"Tensor.{m}" for m in _lift.METHODS} <= names | set(missing)
    functions = {
        n
        for n in (_lift._public_name(f) for f in _lift.TABLE)
        if n.startswith("torch.") and not n.split(".")[-1].startswith("_")
    } - set(_lift.eager_only())
    assert functions <= names | set(missing)
    unexplained = sorted(set(missing) - set(NO_FORM))
    assert not unexplained, f"give these ops a form in fuzz_table.FORMS, or a reason: {unexplained}"
    assert len(missing) <= 16
    families = {op.family for op in table}
    assert families == {"method", "function", "operator", "structure"}


@pytest.fixture(scope="module")
def slice_programs() -> list[Program]:
    return covering_programs(seed=0)


def test_the_slice_covers_every_op_on_a_container_made_inside(
    slice_programs: list[Program],
) -> None:
    table, _ = ops()
    seen = {op for p in slice_programs for op in p.steps}
    assert not [op.name for op in table if op not in seen]
    assert all(p.start != "input" for p in slice_programs)
    assert {p.kind for p in slice_programs} == {"flat", "nested", "tensorclass"}
    assert {p.start for p in slice_programs} == set(MADE_INSIDE) - {"input"}


def test_the_slice_compiles_as_one_program(slice_programs: list[Program]) -> None:
    """Every chain of the slice, eager against ``torch.compile(fullgraph=True)``: one frame
    for all of them, no recompile on new values, inputs unchanged."""
    check_many(slice_programs, ("compile",))


def test_a_sample_of_the_slice_under_vmap_and_grad(slice_programs: list[Program]) -> None:
    rng = random.Random(_SEED)
    vm = [p for p in slice_programs if p.vmap]
    gr = [p for p in slice_programs if p.grad]
    check_many(rng.sample(vm, min(12, len(vm))), ("vmap",))
    check_many(rng.sample(gr, min(12, len(gr))), ("grad",))


@pytest.mark.parametrize(
    "prog",
    list(random_programs(_SEED, _COUNT or 3)),
    ids=lambda p: "-".join([p.kind, p.start, *(op.name for op in p.steps)])[:80],
)
def test_random_program(prog: Program) -> None:
    check_minimal(prog, vmap=prog.vmap, grad=prog.grad)


def test_a_failure_prints_a_runnable_program() -> None:
    prog = Program("flat", "add", ops()[0][:1])
    src = prog.source()
    assert "def program(x):" in src
    assert "make('flat')" in src
    ns: dict[str, object] = {}
    exec(compile(prog.body(), "<p>", "exec"), {"torch": torch, **ns}, ns)
    assert callable(ns["program"])
