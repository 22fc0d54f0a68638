"""Start a few local processes joined in a gloo process group, with deadlines everywhere.

Used by the tests, the examples and the benchmarks of :mod:`tdfunc.distributed`. Every run
terminates: the process group has a timeout, the parent waits for each rank's report until a
deadline, then kills what is left and raises an error naming the rank that failed, with its
traceback.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

RANK_FAILED = "rank {rank} of {world_size} failed:\n{tb}"
RANK_TIMEOUT = (
    "ranks {ranks} of {world_size} did not finish within {timeout:.0f} s "
    "(reported: {done}); they were killed"
)
RANK_DIED = "rank {rank} of {world_size} exited with code {code} without reporting a result"


class RankError(RuntimeError):
    """A spawned rank raised, died or timed out. ``rank`` is the first rank at fault.

    Example:
        >>> from tdfunc.distributed import RankError
        >>> RankError("rank 1 of 2 failed: ...", 1).rank
        1
    """

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).

    Example:
        >>> from tdfunc.distributed import free_port
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    out: Any,
) -> None:
    import torch.distributed as dist

    status, payload = "ok", None
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        payload = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        status, payload = "error", traceback.format_exc()
    out.put((rank, status, payload))
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    backend: str = "gloo",
    grace: float = 3.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return the results.

    Each process joins a ``backend`` process group on 127.0.0.1 (a free port) whose collectives
    time out after ``pg_timeout`` seconds. ``fn`` must be importable (defined at module level)
    and return a picklable value. If a rank raises, the others get ``grace`` seconds to finish,
    then every process still alive is killed and :class:`RankError` names the failing rank and
    shows its traceback. If ranks are still running after ``timeout`` seconds they are killed
    too. The ``spawn`` start method is used, so no state leaks from the parent.

    Example:
        >>> import operator
        >>> from tdfunc.distributed import launch
        >>> launch(operator.add, 2)  # fn(rank, world_size) on each rank  # doctest: +SKIP
        [2, 3]
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, pg_timeout, fn, tuple(args), out),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            if failure is not None:
                deadline = min(deadline, time.monotonic() + grace)
            try:
                rank, status, payload = out.get(timeout=0.1)
            except queue_mod.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in results and p.exitcode is not None and p.exitcode != 0
                ]
                if dead and failure is None:
                    # drain once more: a report may have arrived just before the exit
                    time.sleep(0.2)
                    if out.empty():
                        r = dead[0]
                        failure = (
                            r,
                            RANK_DIED.format(rank=r, world_size=world_size, code=procs[r].exitcode),
                        )
                continue
            results[rank] = payload
            if status != "ok" and failure is None:
                failure = (rank, RANK_FAILED.format(rank=rank, world_size=world_size, tb=payload))
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic() + 2.0)))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        out.close()
    if failure is not None:
        raise RankError(failure[1], failure[0])
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankError(
            RANK_TIMEOUT.format(
                ranks=missing, world_size=world_size, timeout=timeout, done=sorted(results)
            ),
            missing[0],
        )
    return [results[r] for r in range(world_size)]


__all__ = ["RankError", "free_port", "launch"]
