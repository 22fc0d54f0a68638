"""Memory measurements shared by the benchmark rows: the high-water mark of the C heap while
a function runs (glibc's ``mallinfo2``, sampled by a thread)."""

from __future__ import annotations

import time
from typing import Any


def heap_bytes() -> Any:
    """A function giving the bytes the C heap holds now (glibc's ``mallinfo2``: in-use bytes
    of every arena plus mapped blocks; torch's CPU allocator takes its memory there), or
    None where it is missing."""
    import ctypes
    import ctypes.util

    class Info(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = Info

    def used() -> int:
        m = info()
        return int(m.uordblks + m.hblkhd)

    return used


def heap_peak(run: Any, interval: float = 1e-4) -> int | None:
    """The high-water mark of the bytes the heap holds while ``run()`` runs, above what it
    held before (None without ``mallinfo2``). A thread samples :func:`heap_bytes` every
    ``interval`` seconds (torch releases the GIL inside its kernels; the switch interval is
    lowered meanwhile so that Python code does not hold it for long): every allocation and
    free counts, whoever makes it, eager or compiled, and the figure is the live total, not
    a sum of events."""
    import sys
    import threading

    used = heap_bytes()
    if used is None:
        return None
    stop = threading.Event()
    peak = [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], used())
            time.sleep(interval)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    base = used()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        run()
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    return max(peak[0], used()) - base
