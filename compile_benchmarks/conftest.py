"""Harness of the side-by-side benchmark suite (pytest-benchmark).

Convention for every ``compile_benchmarks/test_bench_*.py`` file
-----------------------------------------------------------------
* One test function per workload (or one table-driven function), parametrized by
  ``contender`` (``"tdfunc"``, ``"tdfunc_tc"``, ``"tensordict"``, ``"tensordict_tc"``,
  ``"pytree"``, ``"optree"``, ``"floor"``, ``"floor_foreach"`` or any other name) and asking
  for the ``mode`` fixture, which this file parametrizes with ``"eager"`` and ``"compiled"``
  (plus ``"reduce-overhead"`` when CUDA is available) unless the test parametrizes it itself.
* The test builds the inputs and the callable of its contender, then calls
  ``measure(fn, *args, workload=..., mode=mode, contender=contender)``. ``measure`` sets
  ``benchmark.extra_info`` (``workload``, ``mode``, ``contender``, ``category``, ``pass`` and,
  for compiled modes, ``compile_s``, ``graphs``, ``graph_breaks``, ``recompiles``...), times the
  call with pytest-benchmark and returns ``fn``'s result. A test that times something by
  hand may use the ``benchmark`` fixture directly, as long as it sets
  ``benchmark.extra_info.update(workload=..., mode=..., contender=...)``.
* Each contender does exactly the same work; the workload's docstring says what it is. Skip
  cleanly with ``pytest.importorskip("tensordict")`` when a comparator is missing. Never
  assert timings.

What ``measure`` does
---------------------
* ``mode="eager"``: in the first pass it checks that the contender's result has the same
  leaves (shapes, dtypes, sums; order-insensitive) as the first contender of the workload that
  ran, so every contender provably did the same work; then pytest-benchmark times ``fn(*args)``.
* ``mode="compiled"`` (and ``"reduce-overhead"``): ``torch.compiler.reset()`` runs when a new
  workload starts. Each contender compiles its *own copy of the function's code object*
  (so no Dynamo cache entry is shared) inside a private, empty inductor cache
  (``torch._inductor.utils.fresh_cache``), with ``fullgraph=True``. Recorded in
  ``extra_info``: ``compile_s`` (wall time of the first call: cold compile), ``graphs``
  (graphs handed to the backend), ``graph_breaks`` (0, or counted by
  ``torch._dynamo.explain`` when ``fullgraph=True`` fails; the timing then uses
  ``fullgraph=False``), ``matches_eager`` (compiled result equals the eager one, asserted),
  and, when ``make_args`` is given, ``recompiles`` over the batch sizes ``--bench-sizes``
  with ``dynamic=True`` (a Dynamo-only counting backend: recompile decisions do not depend on
  the backend) with the first guard failure in ``recompile_reason``. Then the per-call
  latency of the compiled function is timed. A one-time inductor initialisation compile runs
  before the first measured one and is excluded (``inductor_warmup_s`` in the JSON).
* ``make_args(n)`` must build fresh inputs of the same structure for batch size ``n``.

Threads and clock
-----------------
* ``--bench-threads N`` (default ``TDFUNC_BENCH_THREADS`` or 1) fixes the thread setting for
  the whole run before any benchmark: ``torch.set_num_threads(N)``, one inter-op thread,
  ``torch._inductor.config.cpp.threads = N`` (the OpenMP threads of generated kernels) and
  ``OMP_NUM_THREADS`` for subprocesses. ``python -m compile_benchmarks.run`` also sets
  ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` before the interpreter starts, which is the only
  way to size an OpenMP runtime reliably. With more threads than free cores, OpenMP workers
  spin-wait for each other and one call can take 20-50x longer (measured on the 2-core
  machine); one thread is the default for that reason.
* The report prints the thread setting and the clock: ``run.py`` times with
  ``time.process_time`` (CPU time of the process) when one thread is used, so the time a
  process waits for a core on a shared machine is not counted, and with ``time.perf_counter``
  otherwise (``--clock``).

Quick mode and passes
---------------------
* ``--bench-quick`` (or the environment variable ``TDFUNC_BENCH_QUICK=1``) is the smoke-test
  mode of ``python -m compile_benchmarks.run --quick``. Every eager item runs. Compiled-mode
  items run only for tdfunc contenders (``tdfunc*``) and for every contender of the
  workloads marked ``@pytest.mark.bench_representative``; the other compiled items are
  deselected, and so is any item marked ``@pytest.mark.bench_full_only``. Compiled modes use
  the Dynamo-only ``"eager"`` backend (graph counts, graph breaks and recompiles are still
  real; inductor's one-time start-up alone can take a minute on a loaded 2-core machine). The recompile
  probe runs only for tdfunc contenders. Heavy workloads size themselves with the
  ``bench_size(full, quick)`` fixture. ``run.py --quick`` also passes
  ``--benchmark-min-rounds=1`` and a tiny ``--benchmark-max-time`` so each benchmark runs
  about once (``--benchmark-disable`` would run each once too, but writes no JSON).
* A benchmark module's ``COMPILED_IF_REPRESENTATIVE`` (a tuple of contender names) keeps the
  compiled items of those contenders only in the workloads marked representative: their
  compiled graph is another contender's (e.g. ``tree_map`` over dicts traces to the flat
  list's graph), so the other compiled rows would repeat that contender's.
* ``@pytest.mark.bench_compile`` marks the compile-cost rows (cold first calls in fresh
  processes with the caches off, the compile-by-blocks step: minutes each). ``make bench``
  (``run.py --full``) deselects them with ``--bench-compile-rows=skip``; ``make
  bench-compile`` (``run.py --compile``) runs only them (``--bench-compile-rows=only``); plain
  pytest runs them with the others.
* ``--bench-passes N`` repeats every benchmark in N passes. Items are reordered so that all
  contenders of one workload and mode run next to each other, pass after pass, in forward
  then reverse order (c1..cN, cN..c1, ...): the report combines the passes with medians,
  so slow drifts of this noisy machine cancel out. Compiled functions are compiled once (in
  pass 0) and reused by later passes.

Example (inside a ``test_bench_*.py`` file)::

    @pytest.mark.parametrize("contender", ["tdfunc", "pytree"])
    def test_add_one(measure, mode, contender):
        '''x + 1 on 50 scalars.'''
        src = {f"k{i}": torch.zeros(()) for i in range(50)}
        if contender == "tdfunc":
            fn, arg = (lambda td: td + 1), tdfunc.TensorDict(src)
        else:
            fn, arg = (lambda d: pytree.tree_map(lambda x: x + 1, d)), src
        measure(fn, arg, workload="add_one", mode=mode, contender=contender)
"""

from __future__ import annotations

import datetime
import gc
import logging
import math
import os
import platform
import sys
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import Tensor

from compile_benchmarks import CONTENDERS, QUICK_ENV, available_modes

_DEFAULT_SIZES = "6,14,22,26"
#: Environment variable giving the default of ``--bench-threads``.
THREADS_ENV = "TDFUNC_BENCH_THREADS"
_PASS_PARAM = "bench_pass"
_UNGROUPED = ("contender", _PASS_PARAM)
#: Marker of representative workloads (compiled for every contender, even in quick mode).
REPRESENTATIVE = "bench_representative"
#: Marker of benchmarks that only run in full mode (deselected by ``--bench-quick``).
FULL_ONLY = "bench_full_only"
#: Module attribute naming the contenders whose compiled items run only in the representative
#: workloads (their compiled graph is another contender's; every mode deselects the others).
COMPILED_IF_REPRESENTATIVE = "COMPILED_IF_REPRESENTATIVE"
#: Marker of the compile-cost rows measured by ``make bench-compile`` (cold first calls in
#: fresh processes with the caches off, the compile-by-blocks step); ``make bench`` skips them.
COMPILE_ROWS = "bench_compile"
#: ``--bench-compile-rows`` choices: run the marked items with the others, skip them, or only them.
COMPILE_ROWS_CHOICES = ("include", "skip", "only")


# ----------------------------------------------------------------------------- options
def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tdfunc benchmarks")
    group.addoption(
        "--bench-quick",
        action="store_true",
        default=False,
        help=f"smoke-test mode: one round, Dynamo-only backend, compiled items only for tdfunc "
        f"and representative workloads (also enabled by {QUICK_ENV}=1)",
    )
    group.addoption(
        "--bench-passes",
        type=int,
        default=1,
        help="repeat every benchmark in this many interleaved passes (default 1)",
    )
    group.addoption(
        "--bench-threads",
        type=int,
        default=None,
        help=f"intra-op and OpenMP threads for the whole run (default ${THREADS_ENV} or 1)",
    )
    group.addoption(
        "--bench-compile-rows",
        choices=COMPILE_ROWS_CHOICES,
        default="include",
        help=f"items marked {COMPILE_ROWS} (make bench-compile): run them with the others "
        "(include, the default), skip them (make bench) or run only them (make bench-compile)",
    )
    group.addoption(
        "--bench-sizes",
        default=_DEFAULT_SIZES,
        help=f"batch sizes of the dynamic=True recompile probe (default {_DEFAULT_SIZES})",
    )


def is_quick(config: pytest.Config) -> bool:
    """True in quick (smoke-test) mode: ``--bench-quick`` or ``TDFUNC_BENCH_QUICK=1``."""
    env = os.environ.get(QUICK_ENV, "")
    return bool(config.getoption("--bench-quick")) or env not in ("", "0", "false", "no")


def bench_threads(config: pytest.Config) -> int:
    """The thread count of the run: ``--bench-threads``, else ``$TDFUNC_BENCH_THREADS``, else 1."""
    opt = config.getoption("--bench-threads")
    if opt is None:
        opt = int(os.environ.get(THREADS_ENV, "") or 1)
    if opt < 1:
        raise ValueError(f"--bench-threads must be >= 1, got {opt}")
    return int(opt)


def set_threads(n: int) -> dict[str, Any]:
    """Fix the thread setting of this process (see the module docstring); return it."""
    import torch._inductor.config as inductor_config

    os.environ["OMP_NUM_THREADS"] = str(n)
    os.environ.setdefault("MKL_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    interop_set = True
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already started (e.g. by an earlier parallel call): keep it
        interop_set = False
    inductor_config.cpp.threads = n
    return {
        "threads": n,
        "torch_threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "interop_set": interop_set,
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "inductor_cpp_threads": inductor_config.cpp.threads,
        "parallel_info": torch.__config__.parallel_info().splitlines()[:6],
    }


def _explicit_params(metafunc: pytest.Metafunc) -> set[str]:
    names: set[str] = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(argnames, str):
            argnames = [a.strip() for a in argnames.split(",")]
        names.update(argnames)
    return names


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    explicit = _explicit_params(metafunc)
    if "mode" in metafunc.fixturenames and "mode" not in explicit:
        metafunc.parametrize("mode", available_modes())
    passes = metafunc.config.getoption("--bench-passes")
    if _PASS_PARAM in metafunc.fixturenames and passes > 1:
        metafunc.parametrize(_PASS_PARAM, range(passes), ids=[f"pass{i}" for i in range(passes)])


# ----------------------------------------------------------------------------- ordering
def _params(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec is not None else {}


def group_key(item: pytest.Item) -> tuple[Any, ...]:
    """Items differing only by contender and pass form one group (one workload and mode)."""
    params = _params(item)
    rest = tuple(sorted((k, repr(v)) for k, v in params.items() if k not in _UNGROUPED))
    return (str(item.path), getattr(item, "originalname", item.name), rest)


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Put the contenders of a workload side by side: group, pass, contender (ABBA order)."""
    first_seen: dict[tuple[Any, ...], int] = {}
    contender_pos: dict[tuple[Any, ...], dict[Any, int]] = {}
    for i, item in enumerate(items):
        key = group_key(item)
        first_seen.setdefault(key, i)
        c = _params(item).get("contender")
        pos = contender_pos.setdefault(key, {})
        pos.setdefault(c, len(pos))

    def sort_key(indexed: tuple[int, pytest.Item]) -> tuple[int, int, int, int]:
        i, item = indexed
        key = group_key(item)
        params = _params(item)
        p = int(params.get(_PASS_PARAM, 0))
        pos = contender_pos[key][params.get("contender")]
        return (first_seen[key], p, -pos if p % 2 else pos, i)

    items[:] = [it for _, it in sorted(enumerate(items), key=sort_key)]
    _keep(config, items, lambda it: not _compiled_repeat(it))
    if is_quick(config):
        _keep(config, items, _runs_in_quick)
    rows = config.getoption("--bench-compile-rows")
    if rows != "include":
        want = rows == "only"
        _keep(config, items, lambda it: (it.get_closest_marker(COMPILE_ROWS) is not None) == want)


def _keep(
    config: pytest.Config, items: list[pytest.Item], keep: Callable[[pytest.Item], bool]
) -> None:
    """Deselect (as pytest reports it) every item ``keep`` refuses."""
    kept = [it for it in items if keep(it)]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if not keep(it)])
        items[:] = kept


def _compiled_repeat(item: pytest.Item) -> bool:
    """A compiled item of a contender its module lists in ``COMPILED_IF_REPRESENTATIVE`` (its
    compiled graph is another contender's), outside the representative workloads."""
    names = getattr(getattr(item, "module", None), COMPILED_IF_REPRESENTATIVE, ())
    params = _params(item)
    return (
        params.get("mode", "eager") != "eager"
        and params.get("contender") in names
        and item.get_closest_marker(REPRESENTATIVE) is None
    )


def _runs_in_quick(item: pytest.Item) -> bool:
    """Quick mode keeps eager items, tdfunc contenders and representative workloads."""
    if item.get_closest_marker(FULL_ONLY) is not None:
        return False
    params = _params(item)
    if params.get("mode", "eager") == "eager":
        return True
    if str(params.get("contender", "tdfunc")).startswith("tdfunc"):
        return True
    return item.get_closest_marker(REPRESENTATIVE) is not None


def pytest_configure(config: pytest.Config) -> None:
    config._tdfunc_bench_threads = set_threads(bench_threads(config))  # type: ignore[attr-defined]
    config.addinivalue_line(
        "markers",
        f"{REPRESENTATIVE}: a workload compiled for every contender even in quick mode",
    )
    config.addinivalue_line("markers", f"{FULL_ONLY}: a benchmark deselected in quick mode")
    config.addinivalue_line(
        "markers",
        f"{COMPILE_ROWS}: a compile-cost row of make bench-compile (make bench skips it)",
    )


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def bench_quick(request: pytest.FixtureRequest) -> bool:
    """True in quick (smoke-test) mode."""
    return is_quick(request.config)


@pytest.fixture(scope="session")
def bench_size(bench_quick: bool) -> Callable[[Any, Any], Any]:
    """``bench_size(full, quick)``: the full-mode value, or the small one in quick mode."""

    def size(full: Any, quick: Any) -> Any:
        return quick if bench_quick else full

    return size


@pytest.fixture(scope="session")
def bench_device() -> torch.device:
    """The device benchmarks put their data on: CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def bench_pass(request: pytest.FixtureRequest) -> int:
    """Index of the current interleaved pass (0 when ``--bench-passes`` is 1)."""
    return int(getattr(request, "param", 0))


@pytest.fixture(scope="session")
def _bench_state(request: pytest.FixtureRequest) -> _State:
    state = _State(request.config)
    request.config._tdfunc_bench_state = state  # type: ignore[attr-defined]
    return state


@pytest.fixture
def measure(
    benchmark: Any, bench_pass: int, _bench_state: _State, request: pytest.FixtureRequest
) -> Callable[..., Any]:
    """Time ``fn(*args)`` in a mode and record its metrics; see the module docstring.

    Signature: ``measure(fn, *args, workload, mode, contender, category="other",
    make_args=None, compare=True, **extra_info)``.
    """
    key = group_key(request.node)

    def run(
        fn: Callable[..., Any],
        *args: Any,
        workload: str,
        mode: str,
        contender: str,
        category: str = "other",
        make_args: Callable[[int], tuple[Any, ...]] | None = None,
        compare: bool = True,
        **extra: Any,
    ) -> Any:
        info = benchmark.extra_info
        info.update(
            workload=workload,
            mode=mode,
            contender=contender,
            category=category,
            quick=_bench_state.quick,
            **extra,
        )
        info["pass"] = bench_pass
        doc = (request.node.function.__doc__ or "").strip()
        if doc and "doc" not in info:
            info["doc"] = doc.splitlines()[0]
        if mode == "eager":
            return _bench_state.eager(benchmark, key, fn, args, contender, bench_pass, compare)
        if mode in ("compiled", "reduce-overhead"):
            return _bench_state.compiled(
                benchmark, key, fn, args, contender, bench_pass, mode, make_args
            )
        raise ValueError(
            f"unknown benchmark mode {mode!r}; expected eager, compiled or reduce-overhead"
        )

    return run


# ----------------------------------------------------------------------------- helpers
def clone_function(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object (so Dynamo caches are never shared)."""
    if not isinstance(fn, types.FunctionType):
        target = fn

        def call(*a: Any, **k: Any) -> Any:
            return target(*a, **k)

        fn = call
    name = "".join(ch if ch.isalnum() else "_" for ch in tag)
    code = fn.__code__.replace(co_name=name)
    new = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


def signature(out: Any) -> tuple[list[tuple[tuple[int, ...], str, float]], list[str]]:
    """Order-insensitive description of a result: tensor shapes, dtypes and sums, other leaves."""
    tensors, other = [], []
    for x in pytree.tree_leaves(out):
        if isinstance(x, Tensor):
            s = float(x.detach().double().sum()) if x.numel() else 0.0
            tensors.append((tuple(x.shape), str(x.dtype), s))
        else:
            other.append(repr(x))
    return sorted(tensors), sorted(other)


def _same_signature(a: Any, b: Any) -> bool:
    (ta, oa), (tb, ob) = a, b
    if oa != ob or len(ta) != len(tb):
        return False
    for (sa, da, va), (sb, db, vb) in zip(ta, tb):
        if sa != sb or da != db or not math.isclose(va, vb, rel_tol=1e-5, abs_tol=1e-5):
            return False
    return True


def assert_same_result(expected: Any, actual: Any, what: str) -> None:
    """Leaf-by-leaf comparison (pytree order) of two results of the same contender."""
    le, la = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    assert len(le) == len(la), f"{what}: {len(la)} leaves, expected {len(le)}"
    for x, y in zip(le, la):
        if isinstance(x, Tensor):
            torch.testing.assert_close(y, x, msg=lambda m: f"{what}: {m}")
        else:
            assert x == y, f"{what}: {y!r} != {x!r}"


class _Counter:
    """A backend that counts graphs and ops, then hands the graph to ``inner``."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.graphs = 0
        self.ops = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        self.ops += sum(
            1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
        )
        return self.inner(gm, example_inputs)


def _eager_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    return gm.forward


def _inductor_backend(mode: str) -> Callable[..., Any]:
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options(mode) if mode == "reduce-overhead" else {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        return compile_fx(gm, example_inputs, config_patches=patches)

    return backend


class _RecompileLog(logging.Handler):
    """Collects Dynamo's recompile messages (first guard failure) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _RecompileLog:
        from torch._dynamo import guards

        self._log = guards.recompiles_log
        self._propagate = self._log.propagate
        torch._logging.set_logs(recompiles=True)
        self._log.propagate = False
        self._log.addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._log.removeHandler(self)
        self._log.propagate = self._propagate
        torch._logging.set_logs()

    def first_reason(self) -> str:
        for m in self.messages:
            for line in m.splitlines():
                line = line.strip()
                if line.startswith("- "):
                    return line[2:][:300]
        return ""


def _cache_entries(fn: Callable[..., Any]) -> int:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))  # type: ignore[attr-defined]


def _sync_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not torch.cuda.is_available():
        return fn

    def synced(*a: Any) -> Any:
        out = fn(*a)
        torch.cuda.synchronize()
        return out

    return synced


class _State:
    """Session state: compiled functions of the current group, reference results, warm-up."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.quick = is_quick(config)
        self.passes = int(config.getoption("--bench-passes"))
        self.sizes = tuple(int(s) for s in str(config.getoption("--bench-sizes")).split(",") if s)
        self.group: tuple[Any, ...] | None = None
        self.compiled_fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.reference: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self.inductor_warmup_s: float | None = None

    # --------------------------------------------------------------- groups
    def _enter_group(self, key: tuple[Any, ...], compiled: bool) -> None:
        if key == self.group:
            return
        self.group = key
        self.compiled_fns.clear()
        if compiled:
            torch.compiler.reset()
            gc.collect()

    def warm_inductor(self) -> None:
        """Compile one tiny function once so the one-time inductor start-up is excluded."""
        if self.inductor_warmup_s is not None:
            return
        from torch._inductor.utils import fresh_cache

        def warm(x: Tensor) -> Tensor:
            return (x * 2 + 1).sum()

        t0 = time.perf_counter()
        with fresh_cache():
            torch.compile(warm, fullgraph=True)(torch.ones(8))
        self.inductor_warmup_s = time.perf_counter() - t0
        torch.compiler.reset()

    # --------------------------------------------------------------- eager
    def eager(
        self,
        benchmark: Any,
        key: tuple[Any, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        contender: str,
        bench_pass: int,
        compare: bool,
    ) -> Any:
        self._enter_group(key, compiled=False)
        if bench_pass == 0 and compare:
            sig = signature(fn(*args))
            ref = self.reference.setdefault(key, (contender, sig))
            if not _same_signature(ref[1], sig):
                raise AssertionError(
                    f"contender {contender!r} did different work than {ref[0]!r}: "
                    f"result {sig} vs {ref[1]}"
                )
        return benchmark(_sync_wrapper(fn), *args)

    # --------------------------------------------------------------- compiled
    def _backend(self, mode: str) -> tuple[str, Callable[..., Any]]:
        if self.quick:
            return "eager", _eager_backend
        return "inductor", _inductor_backend(mode)

    def compiled(
        self,
        benchmark: Any,
        key: tuple[Any, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        contender: str,
        bench_pass: int,
        mode: str,
        make_args: Callable[[int], tuple[Any, ...]] | None,
    ) -> Any:
        info = benchmark.extra_info
        self._enter_group(key, compiled=True)
        slot = (key, contender)
        compiled = self.compiled_fns.get(slot)
        if compiled is None:
            compiled = self._compile(info, fn, args, contender, mode, make_args)
            self.compiled_fns[slot] = compiled
        counter: _Counter = compiled._bench_counter  # type: ignore[attr-defined]
        before = counter.graphs
        out = benchmark(_sync_wrapper(compiled), *args)
        info["recompiled_while_timing"] = counter.graphs - before
        return out

    def _compile(
        self,
        info: dict[str, Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        contender: str,
        mode: str,
        make_args: Callable[[int], tuple[Any, ...]] | None,
    ) -> Callable[..., Any]:
        from torch._inductor.utils import fresh_cache

        backend_name, inner = self._backend(mode)
        if backend_name == "inductor":
            self.warm_inductor()
        info["backend"] = backend_name
        tag = f"{info['workload']}_{mode}_{contender}"
        expected = fn(*args)
        counter = _Counter(inner)
        fullgraph = True
        target = clone_function(fn, tag)
        compiled = torch.compile(target, backend=counter, fullgraph=True)
        with fresh_cache():
            gc.collect()
            t0 = time.perf_counter()
            try:
                out = compiled(*args)
            except torch._dynamo.exc.Unsupported as e:
                fullgraph = False
                info["fullgraph_error"] = str(e).splitlines()[0][:300]
                explain = torch._dynamo.explain(clone_function(fn, tag + "_explain"))(*args)
                info["graph_breaks"] = explain.graph_break_count
                info["break_reasons"] = [str(r.reason)[:200] for r in explain.break_reasons][:5]
                counter = _Counter(inner)
                target = clone_function(fn, tag + "_nofullgraph")
                compiled = torch.compile(target, backend=counter, fullgraph=False)
                t0 = time.perf_counter()
                out = compiled(*args)
            info["compile_s"] = time.perf_counter() - t0
            graphs_first = counter.graphs
            out2 = compiled(*args)
        info["graphs"] = graphs_first
        info["ops"] = counter.ops
        info["frames"] = _cache_entries(target)
        info["recompiled_on_second_call"] = counter.graphs - graphs_first
        if fullgraph:
            info["graph_breaks"] = 0
        assert_same_result(expected, out, f"{tag}: compiled result differs from eager")
        assert_same_result(expected, out2, f"{tag}: second compiled call differs from eager")
        info["matches_eager"] = True
        if make_args is not None and (not self.quick or contender.startswith("tdfunc")):
            self._probe_recompiles(info, fn, make_args, tag, fullgraph)
        compiled._bench_counter = counter  # type: ignore[attr-defined]
        return compiled

    def _probe_recompiles(
        self,
        info: dict[str, Any],
        fn: Callable[..., Any],
        make_args: Callable[[int], tuple[Any, ...]],
        tag: str,
        fullgraph: bool,
    ) -> None:
        probe = clone_function(fn, tag + "_dynamic")
        counter = _Counter(_eager_backend)
        compiled = torch.compile(probe, backend=counter, fullgraph=fullgraph, dynamic=True)
        with _RecompileLog() as log:
            for n in self.sizes:
                compiled(*make_args(n))
        frames = _cache_entries(probe)
        info["recompiles"] = max(frames - 1, 0)
        info["recompile_sizes"] = list(self.sizes)
        if log.messages:
            info["recompile_reason"] = log.first_reason()


# ----------------------------------------------------------------------------- JSON metadata
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def session_metadata(config: pytest.Config) -> dict[str, Any]:
    """Machine, versions and harness settings written into the benchmark JSON."""
    state: _State | None = getattr(config, "_tdfunc_bench_state", None)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "torch_threads": torch.get_num_threads(),
        "threads": getattr(config, "_tdfunc_bench_threads", {}),
        "timer": str(config.getoption("benchmark_timer", None) or "time.perf_counter"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {
            name: _version(name)
            for name in ("torch", "tdfunc", "tensordict", "optree", "numpy", "pytest-benchmark")
        },
        "quick": is_quick(config),
        "passes": int(config.getoption("--bench-passes")),
        "probe_sizes": [int(s) for s in str(config.getoption("--bench-sizes")).split(",") if s],
        "inductor_warmup_s": None if state is None else state.inductor_warmup_s,
        "contenders_order": list(CONTENDERS),
    }


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: Iterable[Any], output_json: dict[str, Any]
) -> None:
    output_json["tdfunc_bench"] = session_metadata(config)
