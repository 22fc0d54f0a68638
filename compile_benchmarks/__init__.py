"""Side-by-side benchmarks: tdfunc against tensordict, plain pytrees and a flat-list floor.

The suite is a set of pytest-benchmark files ``compile_benchmarks/test_bench_*.py`` sharing the
harness in ``compile_benchmarks/conftest.py`` (the ``measure`` fixture, the ``--bench-quick``
mode, interleaved passes). ``python -m compile_benchmarks.run --full`` runs it and writes
``compile_benchmarks/RESULTS.md`` and ``ratios.png``; ``--quick`` runs every benchmark once.

Example:
    >>> from compile_benchmarks import CONTENDERS
    >>> CONTENDERS[:3]
    ('tdfunc', 'tdfunc_tc', 'tensordict')
"""

from __future__ import annotations

#: Canonical contender names, in display order. Other names are allowed: they sort after these.
CONTENDERS: tuple[str, ...] = (
    "tdfunc",
    "tdfunc_tc",
    "tensordict",
    "tensordict_tc",
    "pytree",
    "optree",
    "torch_func",
    "numpy",
    "floor",
    "floor_foreach",
)

#: Modes a benchmark can be measured in (``reduce-overhead`` only where CUDA is available).
MODES: tuple[str, ...] = ("eager", "compiled", "reduce-overhead")

#: Environment variable equivalent of the ``--bench-quick`` pytest option.
QUICK_ENV = "TDFUNC_BENCH_QUICK"

#: Kinds of stored runs (``compile_benchmarks/results/<kind>/``) and the make target of each:
#: ``make bench`` skips the compile-cost rows that ``make bench-compile`` measures.
RUN_KINDS: dict[str, str] = {"full": "make bench", "compile": "make bench-compile"}


def available_modes() -> list[str]:
    """The modes measurable here: eager, compiled, and reduce-overhead when CUDA is available.

    Example:
        >>> from compile_benchmarks import available_modes
        >>> available_modes()[:2]
        ['eager', 'compiled']
    """
    import torch

    modes = ["eager", "compiled"]
    if torch.cuda.is_available():
        modes.append("reduce-overhead")
    return modes


__all__ = ["CONTENDERS", "MODES", "QUICK_ENV", "RUN_KINDS", "available_modes"]
