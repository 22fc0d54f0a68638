"""Program fuzzer: random containers and random chains of public ops, checked against
compiled runs, vmap, plain-tensor oracles and the batch-size invariant.

``TDFUNC_FUZZ_EXAMPLES=N`` raises the number of programs (see :func:`example_count`).
"""

from __future__ import annotations

import os

from fuzz_programs import (
    check_compiled,
    check_eager,
    check_vmap,
    example_count,
    programs,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed

_SEED = os.environ.get("TDFUNC_FUZZ_SEED")


def _settings(n: int):
    s = settings(
        max_examples=example_count(n),
        deadline=None,
        derandomize=_SEED is None,
        database=None,
        print_blob=False,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )

    def deco(fn):
        fn = s(fn)
        return hyp_seed(int(_SEED))(fn) if _SEED is not None else fn

    return deco


@_settings(300)
@given(programs())
def test_fuzz_eager_oracles(prog):
    check_eager(prog)
    check_vmap(prog)


@_settings(40)
@given(programs())
def test_fuzz_compiled_eager_backend(prog):
    check_compiled(prog, "eager")


@_settings(5)
@given(programs(max_steps=3))
def test_fuzz_compiled_aot_eager(prog):
    check_compiled(prog, "aot_eager")
