"""Programs drawn from the op table the library lifts, composed, and the properties they keep.

The operations are read from the library, never listed here: every container method of the
op table (:data:`tdfunc._ops._lift.METHODS`: pointwise, casts, over batch dims, aliases) in
both spellings (``x.exp()`` and the torch function of the table, ``torch.exp(x)``), the
operators, and the structure operations (``select``, ``exclude``, ``set``, ``update``,
``replace``, ``apply``, ``where``, indexing, ``stack`` / ``cat``). An operation's arguments
are found by probing: the first argument form of :data:`FORMS` that runs on a probe
container (of floats, else of integers, else of bools) is the operation's form, so an
operation added to the table is fuzzed with no edit here. Random operations (two calls on
the same input differ) are left out, found the same way.

A program starts from an input container (flat, nested, tensorclass) or one made inside the
program (``x + 0``, ``x.apply(torch.abs)``, ``torch.where(MASK, x, 0.0)``, a ``select``),
then applies 2-6 operations, each kept only when it runs eagerly on the value before it. The
properties (:func:`check`): eager equals ``torch.compile(fullgraph=True)`` (one frame, no
recompile on new values, NaN-aware), ``torch.vmap`` equals a loop and compiled vmap equals
eager vmap, ``tdfunc.value_and_grad`` of a scalar of the result equals ``torch.func`` and is
the same compiled, and ``fullgraph=False`` breaks no graph. A failure prints the program as
runnable source.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters as dynamo_counters
from torch.utils import _pytree as pytree

import tdfunc
from tdfunc import TensorDict
from tdfunc._ops import _lift

__all__ = ["MADE_INSIDE", "MASK", "Op", "Pair", "Program", "TensorDict", "make", "tdfunc", "torch"]

MASK = torch.tensor([True, False, True, False])


@tdfunc.tensorclass
class Pair:
    obs: torch.Tensor
    rew: torch.Tensor


# --------------------------------------------------------------------------------------
# containers
# --------------------------------------------------------------------------------------
def _values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * 0.8 + 0.1  # in (0.1, 0.9): most ops finite


def make(kind: str, seed: int = 0) -> Any:
    """An input container: ``flat``, ``nested`` or ``tensorclass`` (batch ``[4]``)."""
    if kind == "flat":
        return TensorDict(a=_values((4, 3), seed), d=_values((4,), seed + 1), batch_size=[4])
    if kind == "nested":
        return TensorDict(
            {"a": _values((4, 3), seed), "b": {"c": _values((4,), seed + 1)}}, batch_size=[4]
        )
    return Pair(obs=_values((4, 3), seed), rew=_values((4,), seed + 1), batch_size=[4])


INPUTS = ("flat", "nested", "tensorclass")

#: how a program makes its first container inside the compiled function
MADE_INSIDE = {
    "input": "x",
    "add": "x + 0",
    "apply": "x.apply(torch.abs)",
    "where": "torch.where(MASK, x, 0.0)",
    "clone": "x.clone()",
}


# --------------------------------------------------------------------------------------
# the operations: read from the op table, arguments found by probing
# --------------------------------------------------------------------------------------
#: argument forms tried in order (source; ``x`` is the current container)
FORMS: tuple[str, ...] = (
    "",
    "0",
    "x",
    "2",
    "0.5",
    "-0.5, 0.5",
    "x, x",
    "x, 0.5",
    "0, 1",
    "1, 0",
    "0, True",
    "[0, 1, 2, 3]",
    "(1, 0, 0)",
    "torch.zeros(4, dtype=torch.long)",
    "(0,)",
    "0, 0",
    "0, 1, 2",
    "0, torch.tensor([3, 0, 1, 1])",
    "0, torch.tensor([3, 0, 1, 2]), x",
    "0, torch.tensor([3, 0, 1, 2]), x, 'sum'",
    "(1, 1)",
    "torch.tensor([3, 0, 1, 1]), 0",
    "MASK",
)

#: table entries no form fits, each with the reason (a test keeps this list exact)
NO_FORM: dict[str, str] = {
    "Tensor.chalf": "complex32: torch has almost no CPU kernels for it",
    "Tensor.rot90": "needs two batch dims (the probe has one)",
    "torch.rot90": "needs two batch dims (the probe has one)",
    "torch.imag": "torch raises on a real tensor",
    "torch.is_complex": "returns a Python bool",
    "torch.is_floating_point": "returns a Python bool",
    "torch.log_sigmoid": "not a public torch name (the table's entry is torch._C._nn's)",
    "torch.pad_sequence": "takes a list of tensors, not one",
    "torch.polygamma": "the order n comes before the tensor",
    "torch.special.polygamma": "the order n comes before the tensor",
    "torch.empty_like": "uninitialised memory: two calls may or may not agree",
}
#: operations left out whatever the probe says (their results are not values)
_NEVER = frozenset({"torch.empty_like"})

#: the probe's dtypes, in order: an operation is fuzzed on the first its form runs on
CASTS = {"float": "", "long": ".long()", "bool": ".bool()"}


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: ``template`` is source with ``{x}`` for the current value."""

    name: str
    template: str
    family: str  # method, function, operator, structure
    vmap: bool = True  # False: torch.vmap refuses it on a plain tensor and on a container
    grad: bool = True  # False: torch has no derivative for it (plain tensor and container)

    def src(self, x: str) -> str:
        return self.template.format(x=x)


def _probe(kind: str = "nested") -> Any:
    return make(kind, 7)


def _run(src: str, x: Any) -> Any:
    return eval(src, {"torch": torch, "tdfunc": tdfunc, "MASK": MASK, "x": x, "Pair": Pair})


def _container_result(r: Any) -> bool:
    if tdfunc.is_container(r):
        return True
    return (
        isinstance(r, tuple) and bool(r) and all(tdfunc.is_container(v) for v in r)
    ) or isinstance(r, torch.Tensor)


def _same(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(la, lb)
    )


def _find_form(make_template: Callable[[str, str], str]) -> str | None:
    """The template (``{x}`` for the current value) of the first cast and form under which
    the operation runs on the probe and is not random; ``None`` when none does."""
    for cast in CASTS.values():
        for form in FORMS:
            template = make_template(cast, form)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    probe = _probe()
                    src = template.format(x="x")
                    r1 = _run(src, probe)
                    if not _container_result(r1) or not _same(r1, _run(src, probe)):
                        continue
            except Exception:
                continue
            return template
    return None


def _templ(prefix: str, cast: str, form: str, method: bool) -> str:
    xc = f"{{x}}{cast}"
    other = form.replace("x", xc)
    if method:
        return f"{xc}.{prefix}({other})"
    return f"{prefix}({xc}, {other})" if form else f"{prefix}({xc})"


_BINARY = ("+", "-", "*", "/", "//", "%", "**", "==", "!=", "<", "<=", ">", ">=")
_OPERATORS: tuple[tuple[str, str], ...] = (
    *((f"x {o} y", f"{{x}} {o} {y}") for o in _BINARY for y in ("2", "{x}")),
    ("-x", "-{x}"),
    ("abs(x)", "abs({x})"),
    ("2 - x", "2 - {x}"),
    ("2 / x", "2 / {x}"),
)
_OPERATORS += tuple((f"x {o} y", f"{{x}}.bool() {o} {{x}}.bool()") for o in ("&", "|", "^"))

#: structure operations (written against the keys every input and probe has: ``a`` and the
#: batch of 4; a step that does not apply to a value is not drawn for it)
_STRUCTURE: tuple[tuple[str, str], ...] = (
    ("select", "{x}.select(*{x}.keys()[:1])"),
    ("exclude", "{x}.exclude(*{x}.keys()[-1:])"),
    ("set", "{x}.set('z', {x}.leaves()[0] * 2)"),
    ("update", "{x}.update({{'z': {x}.leaves()[0] + 1}})"),
    ("replace", "{x}.replace(**{{{x}.keys()[0]: {x}.leaves()[0] * 3}})"),
    ("apply", "{x}.apply(lambda t: t * 2 + 1)"),
    ("where", "torch.where(MASK, {x}, {x} * 2)"),
    ("where_method", "{x}.where(MASK, 0.0)"),
    ("index_int", "{x}[1:][0:3]"),
    ("index_mask_then_stack", "tdfunc.stack([{x}[1], {x}[2]], 0)"),
    ("index_tensor", "{x}[torch.tensor([3, 0, 1, 1])]"),
    ("stack", "tdfunc.stack([{x}, {x} * 2], 1)[:, 0]"),
    ("cat", "tdfunc.cat([{x}[:2], {x}[2:]], 0)"),
)


@functools.cache
def _scalar(y: Any) -> torch.Tensor:
    fl = [t for t in pytree.tree_leaves(y) if t.is_floating_point()]
    return sum((t.float().nan_to_num().sum() for t in fl), torch.zeros(()))


def _works(f: Callable[[], Any]) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f()
    except Exception:
        return False
    return True


def _with_transforms(name: str, template: str, family: str) -> Op:
    """The op with what torch's transforms allow it: ``vmap`` / ``grad`` are False only when
    they fail on the container *and* on a plain tensor (torch's limit, not the
    container's: a failure on the container alone stays in, for the fuzzer to report)."""
    src = template.format(x="x")
    probe = _probe()
    plain = probe.leaves()[0]
    pair = tdfunc.stack([probe, probe], 0)

    def loss(z: Any) -> torch.Tensor:
        return _scalar(_run(src, z))

    vmap = _works(lambda: torch.vmap(lambda z: _run(src, z))(pair)) or _works(
        lambda: torch.vmap(lambda z: _run(src, z))(torch.stack([plain, plain]))
    )
    grad = _works(lambda: torch.func.grad(loss)(probe)) or _works(
        lambda: torch.func.grad(loss)(plain)
    )
    return Op(name, template, family, vmap, grad)


@functools.cache
def ops() -> tuple[tuple[Op, ...], tuple[str, ...]]:
    """Every operation of the table with its form, and the names none of the forms fits."""
    found: list[tuple[str, str, str]] = []
    missing: list[str] = []
    for name in sorted(_lift.METHODS):
        src = _find_form(lambda c, f, n=name: _templ(n, c, f, True))
        if src is None:
            missing.append(f"Tensor.{name}")
        else:
            found.append((f"Tensor.{name}", src, "method"))
    eager = set(_lift.eager_only())
    funcs = sorted({_lift._public_name(f) for f in _lift.TABLE} - eager)
    for pub in funcs:
        if pub.startswith("Tensor.") or pub.split(".")[-1].startswith("_"):
            continue
        if not pub.startswith("torch."):
            continue
        src = None if pub in _NEVER else _find_form(lambda c, f, n=pub: _templ(n, c, f, False))
        if src is None:
            missing.append(pub)
        else:
            found.append((pub, src, "function"))
    found += [(n, t, "operator") for n, t in _OPERATORS]
    found += [(n, t, "structure") for n, t in _STRUCTURE]
    return tuple(_with_transforms(*f) for f in found), tuple(missing)


# --------------------------------------------------------------------------------------
# programs
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
    """An input kind, how the first container is made, and the chain of operations."""

    kind: str
    start: str
    steps: tuple[Op, ...]

    def body(self) -> str:
        lines = ["def program(x):", f"    x = {MADE_INSIDE[self.start]}"]
        lines += [f"    x = {op.src('x')}" for op in self.steps]
        return "\n".join([*lines, "    return x"]) + "\n"

    def source(self) -> str:
        return (
            "import sys; sys.path.insert(0, 'tests')  # run from the repository root\n"
            "from fuzz_table import *\n\n"
            f"x = make({self.kind!r})\n\n{self.body()}\n"
            "print(torch.compile(program, fullgraph=True, backend='eager')(x))\n"
        )

    @property
    def vmap(self) -> bool:
        return all(op.vmap for op in self.steps)

    @property
    def grad(self) -> bool:
        return all(op.grad for op in self.steps)

    def function(self) -> Callable[[Any], Any]:
        ns: dict[str, Any] = {"torch": torch, "tdfunc": tdfunc, "MASK": MASK, "Pair": Pair}
        exec(compile(self.body(), f"<program {self.steps!r:.40}>", "exec"), ns)
        return ns["program"]


def _final(r: Any) -> bool:
    """A result no further operation takes: a tensor or a tuple (``x.sort()``)."""
    return isinstance(r, (torch.Tensor, tuple))


def _ok(src: str, x: Any) -> Any:
    """``src`` run on ``x`` when it gives a container with leaves, a tensor or a tuple of
    containers (else ``None``)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = _run(src, x)
    except Exception:
        return None
    if tdfunc.is_container(r):
        return r if r.leaves() else None
    return r if _container_result(r) else None


def grow(kind: str, start: str, wanted: list[Op], rng: random.Random, n: int) -> Program:
    """A program of ``n`` operations: the ``wanted`` ones first (each where it runs on the
    value before it), then random ones from the table; a tensor or tuple result ends it."""
    table, _ = ops()
    v = _run(MADE_INSIDE[start], make(kind))
    steps: list[Op] = []
    pool = list(wanted)
    deferred: set[Op] = set()
    tries = 0
    while (len(steps) < n or pool) and tries < 60:
        tries += 1
        op = pool.pop(0) if pool else rng.choice(table)
        r = _ok(op.src("x"), v)
        if r is None:
            continue
        if _final(r) and pool and op not in deferred:  # a result no operation takes: last
            deferred.add(op)
            pool.append(op)
            continue
        steps.append(op)
        v = r
        if _final(r):
            break
    return Program(kind, start, tuple(steps))


def random_programs(seed: int, count: int) -> Iterator[Program]:
    rng = random.Random(seed)
    for _ in range(count):
        yield grow(rng.choice(INPUTS), rng.choice(list(MADE_INSIDE)), [], rng, rng.randint(2, 6))


def covering_programs(seed: int = 0, per: int = 4) -> list[Program]:
    """Programs in which every operation of the table appears at least once on a container
    made inside the program (chains of up to ``per`` + 1 operations); an operation that
    did not fit where it was drawn is tried again in a later program."""
    table, _ = ops()
    rng = random.Random(seed)
    todo = list(table)
    rng.shuffle(todo)
    starts = [s for s in MADE_INSIDE if s != "input"]
    progs: list[Program] = []
    retries: dict[Op, int] = {}
    i = 0
    while todo:
        chunk, todo = todo[:per], todo[per:]
        kind, start = INPUTS[i % len(INPUTS)], starts[i % len(starts)]
        prog = grow(kind, start, chunk, rng, len(chunk) + 1)
        progs.append(prog)
        for op in chunk:
            if op not in prog.steps and retries.get(op, 0) < 6:
                retries[op] = retries.get(op, 0) + 1
                todo.append(op)
        i += 1
    return progs


# --------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------
_DDS = "Dynamic shape operator"


class Failure(AssertionError):
    pass


def _fail(prog: Program, what: str) -> None:
    raise Failure(f"{what}\n\nprogram (runnable from the repository root):\n\n{prog.source()}")


def assert_same(got: Any, want: Any, what: str) -> None:
    if tdfunc.is_container(want):
        assert type(got) is type(want), f"{what}: {type(got).__name__} != {type(want).__name__}"
        assert got.batch_size == want.batch_size, f"{what}: batch {got.batch_size}"
        assert sorted(map(str, got.keys(True, True))) == sorted(map(str, want.keys(True, True)))
    assert pytree.tree_structure(got) == pytree.tree_structure(want), f"{what}: structure"
    for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
        if w.dtype in (torch.bfloat16, torch.float16, torch.complex32):
            g, w = (
                g.to(torch.float32 if not w.is_complex() else torch.complex64),
                w.to(torch.float32 if not w.is_complex() else torch.complex64),
            )
        torch.testing.assert_close(g, w, equal_nan=True, atol=1e-5, rtol=1e-4, msg=what)


def check(prog: Program, *, vmap: bool = True, grad: bool = True, breaks: bool = True) -> None:
    """Every property of one program (see the module docstring)."""
    fn = prog.function()
    x, x2 = make(prog.kind, 0), make(prog.kind, 1)
    before = x.clone()
    want = fn(x)
    # eager == compiled (fullgraph): one frame, no recompile on new values
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("eager")
    cfn = torch.compile(fn, backend=cnt, fullgraph=True)
    try:
        got = cfn(x)
        assert_same(got, want, "compiled vs eager")
        assert cnt.frame_count == 1, f"{cnt.frame_count} frames"
        assert_same(cfn(x2), fn(x2), "compiled vs eager, new values")
        assert cnt.frame_count == 1, "recompiled on new values of the same structure"
        tdfunc.testing.assert_close(x, before, atol=0, rtol=0)
    except Exception as e:
        _fail(prog, f"compiled: {type(e).__name__}: {e}")
    if breaks:
        torch._dynamo.reset()
        dynamo_counters.clear()
        torch.compile(fn, backend="eager")(x)
        # a data-dependent output shape (masked_select, a bool mask) breaks the graph on a
        # plain tensor too unless capture_dynamic_output_shape_ops is set: torch's, not ours
        gb = {k: v for k, v in dynamo_counters["graph_break"].items() if not k.startswith(_DDS)}
        if gb:
            _fail(prog, f"graph breaks with fullgraph=False: {gb}")
    if vmap:
        xs = tdfunc.stack([x, x2], 0)
        loop = pytree.tree_map(lambda a, b: torch.stack([a, b]), fn(x), fn(x2))
        try:
            vm = torch.vmap(fn)(xs)
            assert_same(vm, loop, "vmap vs loop")
        except Exception as e:
            _fail(prog, f"vmap: {type(e).__name__}: {e}")
        try:
            torch._dynamo.reset()
            assert_same(torch.compile(torch.vmap(fn), backend="eager", fullgraph=True)(xs), vm, "")
        except Exception as e:
            if not any(map(torch_refuses_compiled_vmap, prog.steps)):
                _fail(prog, f"compiled vmap: {type(e).__name__}: {e}")
    if grad:

        def loss(z: Any) -> torch.Tensor:
            return _scalar(fn(z))

        try:
            rg, rv = torch.func.grad_and_value(loss)(x)
        except RuntimeError:  # no derivative in torch for an op on these dtypes
            return
        vg = tdfunc.value_and_grad(loss)
        try:
            v, g = vg(x)
            assert_same((v, g), (rv, rg), "value_and_grad vs torch.func")
            torch._dynamo.reset()
            cv, cg = torch.compile(vg, backend="eager", fullgraph=True)(x)
            assert_same((cv, cg), (rv, rg), "compiled value_and_grad vs torch.func")
        except Exception as e:
            _fail(prog, f"grad: {type(e).__name__}: {e}")


@functools.cache
def torch_refuses_compiled_vmap(op: Op) -> bool:
    """Whether ``torch.compile(torch.vmap(op))`` fails on a plain tensor of the batch's shape
    too (a data-dependent shape inside a compiled vmap: torch's limit, whatever the
    container does). Asked only when a program fails there."""
    plain = torch.stack([_values((4,), 3), _values((4,), 4)])
    src = op.src("x")
    if not _works(lambda: torch.vmap(lambda z: _run(src, z))(plain)):
        return False  # no plain-tensor twin (a structure op): not torch's to refuse
    torch._dynamo.reset()
    compiled = torch.compile(torch.vmap(lambda z: _run(src, z)), backend="eager", fullgraph=True)
    return not _works(lambda: compiled(plain))


def _differentiable(prog: Program) -> bool:
    """Whether torch.func can differentiate a scalar of the program's result."""
    fn = prog.function()
    return _works(lambda: torch.func.grad(lambda z: _scalar(fn(z)))(make(prog.kind)))


def _runs(prog: Program) -> bool:
    x = make(prog.kind)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog.function()(x)
    except Exception:
        return False
    return True


def check_minimal(prog: Program, **properties: bool) -> None:
    """:func:`check`; on a failure, the shortest program (steps dropped one at a time while
    it still runs eagerly and still fails) is the one reported."""
    try:
        check(prog, **properties)
    except Failure as first:
        failure = first
        shrunk = True
        while shrunk:
            shrunk = False
            for i in range(len(prog.steps)):
                cand = Program(prog.kind, prog.start, prog.steps[:i] + prog.steps[i + 1 :])
                if not cand.steps or not _runs(cand):
                    continue
                try:
                    check(cand, **properties)
                except Failure as e:
                    prog, failure, shrunk = cand, e, True
                    break
        raise failure from None


def check_many(progs: list[Program], what: tuple[str, ...] = ("compile", "vmap", "grad")) -> None:
    """The properties of :func:`check` for many programs at once: one compiled function
    runs them all (one trace), each on its own input; vmap over those torch's vmap allows,
    grad over those torch can differentiate. On a failure every program is checked alone,
    so the report names the programs that fail."""
    try:
        for w in what:
            _check_all([p for p in progs if w == "compile" or getattr(p, w)], w)
    except Exception as e:
        for p in progs:
            check_minimal(
                p, vmap=p.vmap and "vmap" in what, grad=p.grad and "grad" in what, breaks=False
            )
        raise AssertionError(f"the programs pass alone but not together: {e}") from e


def _check_all(progs: list[Program], what: str) -> None:
    fns = [p.function() for p in progs]

    def every(xs: list[Any]) -> list[Any]:
        return [f(x) for f, x in zip(fns, xs)]

    def inputs(seed: int) -> list[Any]:
        return [make(p.kind, seed) for p in progs]

    xs, xs2 = inputs(0), inputs(1)
    if what == "compile":
        before = [x.clone() for x in xs]
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("eager")
        cfn = torch.compile(every, backend=cnt, fullgraph=True)
        assert_same(cfn(xs), every(xs), "compiled vs eager")
        assert cnt.frame_count == 1, f"{cnt.frame_count} frames"
        assert_same(cfn(xs2), every(xs2), "compiled vs eager, new values")
        assert cnt.frame_count == 1, "recompiled on new values of the same structure"
        for x, b in zip(xs, before):
            tdfunc.testing.assert_close(x, b, atol=0, rtol=0)
    if what == "vmap":
        stacked = [tdfunc.stack([a, b], 0) for a, b in zip(xs, xs2)]
        loop = pytree.tree_map(lambda a, b: torch.stack([a, b]), every(xs), every(xs2))
        vm = torch.vmap(every)(stacked)
        assert_same(vm, loop, "vmap vs loop")
        torch._dynamo.reset()
        try:
            cvm = torch.compile(torch.vmap(every), backend="eager", fullgraph=True)(stacked)
        except Exception:
            keep = [p for p in progs if not any(map(torch_refuses_compiled_vmap, p.steps))]
            if len(keep) == len(progs):
                raise
            if keep:
                _check_all(keep, "vmap")  # the programs torch does not refuse, together
            return
        assert_same(cvm, vm, "compiled vmap")
    if what == "grad":

        def loss(xs: list[Any]) -> torch.Tensor:
            return sum((_scalar(y) for y in every(xs)), torch.zeros(()))

        try:
            rg, rv = torch.func.grad_and_value(loss)(xs)
        except RuntimeError:  # no derivative in torch for an op on the dtypes of some program
            keep = [p for p in progs if _differentiable(p)]
            if len(keep) < len(progs):
                _check_all(keep, "grad")
                return
            raise
        vg = tdfunc.value_and_grad(loss)
        assert_same(vg(xs), (rv, rg), "value_and_grad vs torch.func")
        torch._dynamo.reset()
        assert_same(
            torch.compile(vg, backend="eager", fullgraph=True)(xs),
            (rv, rg),
            "compiled value_and_grad",
        )
