"""The heap high-water mark of compile_benchmarks/memory.py (the memory rows of
the sharded step against FSDP2 rest on it)."""

from __future__ import annotations

import pytest
import torch

from compile_benchmarks.memory import heap_bytes, heap_peak

MIB = 2**20


@pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")
def test_heap_peak_sees_memory_freed_before_the_call_returns() -> None:
    def run() -> None:
        for _ in range(3):
            t = torch.ones(16 * MIB // 4)  # 16 MiB, written, freed at the next iteration
            del t

    peak = heap_peak(run)
    assert peak is not None
    assert 15 * MIB < peak < 40 * MIB  # one buffer at a time, not three


@pytest.mark.skipif(heap_bytes() is None, reason="needs glibc's mallinfo2")
def test_heap_peak_counts_what_is_still_held() -> None:
    held: list[torch.Tensor] = []
    peak = heap_peak(lambda: held.extend(torch.ones(8 * MIB // 4) for _ in range(3)))
    assert peak is not None
    assert peak > 23 * MIB  # three 8 MiB buffers alive at the end
