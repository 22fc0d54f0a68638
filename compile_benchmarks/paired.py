"""Paired rounds: two contenders measured side by side, as a ratio, with an A/A control.

This machine's noise moves absolute times (and ratios taken from separate runs) by far more
than the 5% a target is set at. So a row is measured in *paired rounds*: a round times
``calls`` calls of contender A, then ``calls`` calls of contender B (the order alternates from
round to round), and its ratio is A/B; the row reports the median of the per-round ratios and
their range. The *A/A control* measures contender A against a second, independent copy of
itself with the same protocol: its median is the bias of the protocol (ideally 1.00) and its
range the noise of the machine for that row. One thread, CPU time
(``time.process_time``) when torch runs on one thread.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch


def clock() -> Callable[[], float]:
    """CPU time of this process on one thread (less noisy), wall time otherwise."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def _time(fn: Callable[[], Any], calls: int, now: Callable[[], float]) -> float:
    t0 = now()
    for _ in range(calls):
        fn()
    return now() - t0


def paired(a: Callable[[], Any], b: Callable[[], Any], rounds: int, calls: int) -> dict[str, float]:
    """Median (and range) of the per-round ratios A/B, and each side's median time per call.

    Example:
        >>> r = paired(lambda: sum(range(50)), lambda: sum(range(50)), rounds=3, calls=10)
        >>> sorted(r)
        ['a_us', 'b_us', 'ratio', 'ratio_max', 'ratio_min']
    """
    now = clock()
    for _ in range(2):  # warm both (caches, lazy imports, compiled code)
        a()
        b()
    ratios, ta_all, tb_all = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            ta = _time(a, calls, now)
            tb = _time(b, calls, now)
        else:
            tb = _time(b, calls, now)
            ta = _time(a, calls, now)
        ratios.append(ta / tb if tb > 0 else float("nan"))
        ta_all.append(ta / calls * 1e6)
        tb_all.append(tb / calls * 1e6)
    return {
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "a_us": statistics.median(ta_all),
        "b_us": statistics.median(tb_all),
    }


#: A/A controls already measured in this process, by ``(aa_key, rounds, calls)``: the
#: workload that measured it and its result.
_SHARED_AA: dict[Hashable, tuple[str, dict[str, float]]] = {}


def report(
    benchmark: Any,
    *,
    category: str,
    workload: str,
    mode: str,
    against: str,
    a: Callable[[], Any],
    a2: Callable[[], Any],
    b: Callable[[], Any],
    rounds: int,
    calls: int,
    contender: str = "tdfunc",
    target: float | None = None,
    extra: dict[str, Any] | None = None,
    aa_key: Hashable | None = None,
) -> dict[str, float]:
    """Paired rounds of A against B and the A/A control (A against ``a2``, an independent copy
    of A); recorded in the benchmark's ``extra_info`` and printed (``pytest -s``).

    ``aa_key``: rows of the same A (the same contender on the same data) against different
    B's share one A/A control, measured by the first of them with the same rounds and calls
    (``extra_info["aa_from"]`` names it), since the control does not depend on B.
    """
    res = paired(a, b, rounds, calls)
    key = None if aa_key is None else (aa_key, rounds, calls)
    aa_from = None
    if key is not None and key in _SHARED_AA:
        aa_from, aa = _SHARED_AA[key]
    else:
        aa = paired(a, a2, rounds, calls)
        if key is not None:
            _SHARED_AA[key] = (workload, aa)
    info = {
        "workload": workload,
        "mode": mode,
        "contender": contender,
        "category": category,
        "against": against,
        **res,
        "aa": aa["ratio"],
        "aa_min": aa["ratio_min"],
        "aa_max": aa["ratio_max"],
        "rounds": rounds,
        "calls_per_round": calls,
        "target": target,
        **({} if aa_from is None else {"aa_from": aa_from}),
        **(extra or {}),
    }
    benchmark.extra_info.update(info)
    print(
        f"\n{workload} [{mode}] {contender} / {against}: {res['ratio']:.3f} "
        f"[{res['ratio_min']:.3f}-{res['ratio_max']:.3f}] ({res['a_us']:.0f} vs "
        f"{res['b_us']:.0f} us/call); A/A {aa['ratio']:.3f} "
        f"[{aa['ratio_min']:.3f}-{aa['ratio_max']:.3f}]"
        + ("" if aa_from is None else f" (measured with {aa_from})")
        + ("" if target is None else f"; target <= {target}")
    )
    benchmark.pedantic(a, rounds=max(rounds // 3, 1), iterations=calls)
    return res
