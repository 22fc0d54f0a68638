"""Cold first call of a training step of N identical blocks (LayerNorm -> Linear 64->256 ->
GELU -> Linear 256->64, batch 32, AdamW): tdfunc's ``value_and_grad`` routes (compiled
blocks; scan over stacked blocks, in a compiled loss or as one compiled step) against the
joint-graph step, ``torch.compile(model)`` + ``loss.backward()`` and torch's regional recipe. Each contender in a fresh process with
torch's caches disabled (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) and inductor compiling in
process (``TORCHINDUCTOR_COMPILE_THREADS=1``). Ratios use the wall time of the first call
(the process's CPU time, also recorded, misses what inductor runs in other processes; on a
shared machine the wall time counts the waits for a core too: run the rows on a quiet one).

``extra_info``: ``cold_wall_s`` / ``cold_cpu_s`` per contender, ``step_ms`` (median of 30
steps after the first), ``graphs`` (Dynamo graphs compiled), and the target ratios.

``test_by_blocks_step_paired``: the steady step of the by-blocks route against torch's
regional recipe in one process, in paired rounds with the A/A control, and where its time
goes: each part (``value_and_grad``, ``functional_call``, ``optim.step``) against its torch
twin, in µs per parameter (``compile_benchmarks/blocks_step.py``); and the same step eagerly
(no block compiled) against ``torch.func`` + the bare fused kernel (target <= 1.05)."""

from __future__ import annotations

from typing import Any

import pytest

CATEGORY = "compile_regions"
#: every row here is a compile-cost row: ``make bench-compile`` measures them, ``make bench``
#: skips them
pytestmark = pytest.mark.bench_compile
KINDS = ("vg_blockc", "vg_scan", "scan_joint", "regional", "compiled_model", "joint")


@pytest.mark.bench_full_only
@pytest.mark.parametrize("blocks", ["2", "8", "24", "gpt2"])
def test_cold_first_call_by_depth(benchmark: Any, blocks: str) -> None:
    stacked_only = ("vg_scan", "scan_joint")
    kinds = KINDS if blocks != "gpt2" else tuple(k for k in KINDS if k not in stacked_only)
    if blocks == "gpt2":
        pytest.importorskip("transformers")
    import json
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }

    def run(kind: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-m", "compile_benchmarks._regions_step", kind, str(blocks)],
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
            env=env,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    got = {k: run(k) for k in kinds}
    cpu = {k: v["first_s"] for k, v in got.items()}  # wall (the CPU time misses compile workers)
    info = {
        "workload": f"cold_step_{blocks}" + ("" if blocks == "gpt2" else "_blocks"),
        "mode": "compiled",
        "contender": "tdfunc",
        "category": CATEGORY,
        "cold_wall_s": cpu,
        "cold_cpu_s": {k: v["cpu_s"] for k, v in got.items()},
        "step_ms": {k: v["step_ms"] for k, v in got.items()},
        "graphs": {k: v["frames"] for k, v in got.items()},
        # the guards of each compiled frame (checked on every call of that frame: the block
        # frame of vg_blockc / regional once per block and step)
        "guards": {k: v["guards"] for k, v in got.items()},
        # targets: <= 1.0x regional (8, 24 blocks), <= 1.0x torch.compile(model) (2 blocks),
        # steady state <= 1.05x the joint step
        "blockc_over_regional": cpu["vg_blockc"] / cpu["regional"],
        "blockc_over_compiled_model": cpu["vg_blockc"] / cpu["compiled_model"],
        "joint_over_blockc": cpu["joint"] / cpu["vg_blockc"],
        "step_blockc_over_joint": got["vg_blockc"]["step_ms"] / got["joint"]["step_ms"],
        **(
            {
                "scan_joint_over_regional": cpu["scan_joint"] / cpu["regional"],
                "step_scan_joint_over_joint": got["scan_joint"]["step_ms"]
                / got["joint"]["step_ms"],
            }
            if "scan_joint" in got
            else {}
        ),
    }
    benchmark.extra_info.update(info)
    print(
        f"\ncold first call, model {blocks} (wall s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
        + "; steady step (ms): "
        + ", ".join(f"{k} {v['step_ms']:.2f}" for k, v in got.items())
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


@pytest.mark.bench_full_only
@pytest.mark.parametrize("blocks", ["8", "24", "gpt2"])
def test_by_blocks_step_paired(benchmark: Any, blocks: str) -> None:
    """The steady step of the by-blocks route (compiled block class, ``value_and_grad`` over
    ``functional_call``, ``optim.step(..., donate=True)``) against torch's regional recipe in
    one process, paired rounds with the A/A control, and each part against its torch twin
    in µs per parameter (``compile_benchmarks/blocks_step.py``). Target: <= 1.05x."""
    if blocks == "gpt2":
        pytest.importorskip("transformers")
    from compile_benchmarks.blocks_step import EAGER, PARTS, measure

    r = measure(blocks, rounds=15, calls=20 if blocks != "24" else 8)
    step, aa = r["step"], r["aa"]
    info = {
        "workload": f"by_blocks_step_{blocks}" + ("" if blocks == "gpt2" else "_blocks"),
        "mode": "compiled",
        "contender": "tdfunc",
        "category": CATEGORY,
        "against": "torch_regional",
        **step,
        "aa": aa["ratio"],
        "aa_min": aa["ratio_min"],
        "aa_max": aa["ratio_max"],
        "target": 1.05,
        "params": r["params"],
        "us_per_param": {
            "step": r["step_us_per_param"],
            **{p: r[p]["us_per_param"] for p in PARTS},
            "rest": r["rest_us_per_param"],
        },
        "parts": {p: {k: r[p][k] for k in ("ratio", "a_us", "b_us")} for p in (*PARTS, EAGER)},
    }
    benchmark.extra_info.update(info)
    print(
        f"\nby-blocks step, model {blocks}: {step['ratio']:.3f} regional "
        f"[{step['ratio_min']:.2f}-{step['ratio_max']:.2f}], A/A {aa['ratio']:.3f}; "
        + ", ".join(f"{p} {r[p]['us_per_param']:.2f}" for p in PARTS)
        + f", rest {r['rest_us_per_param']:.2f} µs/param over the twins; eager step "
        + f"{r[EAGER]['ratio']:.3f} torch.func + fused kernel (target <= 1.05)"
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
