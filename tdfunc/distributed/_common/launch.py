"""Start a few local processes joined in a process group, with deadlines everywhere.

Used by the tests, the examples and the benchmarks of :mod:`tdfunc.distributed` (it is not
part of its API). Every run terminates: the process group has a timeout, the parent waits for
each rank's report until a deadline, then kills what is left and raises :class:`RankError`.

How the failing rank is found
-----------------------------
Each rank reports through its own pipe (its result, or its traceback, with the time it
failed); the parent waits on every pipe and every process handle at once, so it sees a rank
die the moment it exits. When a rank fails, the others usually fail right after it with an
error about the lost connection ("Connection closed by peer", a timeout): those are
consequences, not causes. :class:`RankError` blames the rank that failed first among the ranks
whose failure is not such a consequence (a raised exception, an exit without a report, a
signal), and falls back to the first consequence only when there is nothing else. A rank that
dies from a signal reports its Python stack through ``faulthandler``; it is shown as its
traceback.

Results travel as plain pickles made in the rank (tensors by value), so no file descriptor or
shared-memory handle outlives the process that made it.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import errors as E

#: error texts of a rank that lost its peers: the failure of another rank caused them
PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "pair closure",
    "Timed out waiting",
    "timed out",
    "Socket Timeout",
)


class RankError(RuntimeError):
    """A spawned rank raised, died or timed out; ``rank`` is the rank that failed first.

    Attributes:
        rank: the rank at fault.
        exitcode: its exit code (negative: killed by that signal; 1 after a reported
            exception), or None when it was still running at the end.
        traceback: its Python traceback (from the exception, or the stack ``faulthandler``
            dumped when a signal killed it), or None.

    Example:
        >>> from tdfunc.testing import RankError
        >>> e = RankError("rank 1 of 2 failed: ...", 1, exitcode=-9)
        >>> e.rank, e.exitcode, e.traceback
        (1, -9, None)
    """

    def __init__(
        self, message: str, rank: int, *, exitcode: int | None = None, traceback: str | None = None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.traceback = traceback


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0).

    Example:
        >>> from tdfunc.distributed._common.launch import free_port
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
    conn: Any,
    fault_path: str,
) -> None:
    # a signal (SIGSEGV, SIGABRT, ...) dumps the Python stack here for the parent
    fault_file = open(fault_path, "w")  # noqa: SIM115 - kept open for the life of the process
    faulthandler.enable(file=fault_file)
    import torch.distributed as dist

    status, payload = "ok", b""
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        # every rank is connected before any starts: a rank that returns at once and
        # leaves must not break the others' connection setup
        dist.barrier()
        # plain pickle: tensors travel by value, not as handles that die with this process
        payload = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        status, payload = "error", traceback.format_exc().encode()
    conn.send_bytes(pickle.dumps((status, payload, time.monotonic())))
    conn.close()
    if status != "ok":
        # leave now: the peers see the closed connection at once (an orderly interpreter
        # exit can block on the process group's threads while a peer waits in a collective)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    # the interpreter's exit collects every module's objects (seconds with torch and Dynamo
    # loaded, on a busy machine): frozen objects are skipped, so the rank exits in a moment,
    # its exit handlers (the named semaphores' unlinking) still run
    gc.freeze()


class _Failure(NamedTuple):
    consequence: bool  # a lost peer / timeout: caused by another rank's failure
    when: float  # time.monotonic() of the failure (or of the parent noticing the exit)
    rank: int
    message: str
    exitcode: int | None
    traceback: str | None


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def _read_text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return None
    return text or None


class _Run:
    """The parent's view of one launch: reports, exits and failures."""

    def __init__(self, world_size: int, tmp: str) -> None:
        self.world_size = world_size
        self.tmp = tmp
        self.results: dict[int, Any] = {}
        self.failures: list[_Failure] = []
        self.first_noticed: float | None = None
        self.exitcodes: dict[int, int | None] = {}

    def fault_path(self, rank: int) -> str:
        return os.path.join(self.tmp, f"rank{rank}.fault")

    def settled(self, rank: int) -> bool:
        return rank in self.results or any(f.rank == rank for f in self.failures)

    def done(self) -> bool:
        return all(self.settled(r) for r in range(self.world_size))

    def _fail(self, failure: _Failure) -> None:
        self.failures.append(failure)
        if self.first_noticed is None:
            self.first_noticed = time.monotonic()

    def report(self, rank: int, raw: bytes) -> None:
        """Record a rank's report: its result, or its traceback."""
        try:
            status, payload, when = pickle.loads(raw)
            if status == "ok":
                self.results[rank] = pickle.loads(payload)
                return
            tb = payload.decode(errors="replace")
        except Exception:
            tb = traceback.format_exc()
            msg = E.RANK_BAD_RESULT.format(rank=rank, world_size=self.world_size, tb=tb)
            self._fail(_Failure(False, time.monotonic(), rank, msg, None, tb))
            return
        consequence = any(m in tb for m in PEER_LOSS_MARKERS)
        msg = E.RANK_FAILED.format(rank=rank, world_size=self.world_size, tb=tb)
        self._fail(_Failure(consequence, when, rank, msg, None, tb))

    def exit(self, rank: int, code: int | None) -> None:
        """Record that a rank exited; without a report, that exit is its failure."""
        self.exitcodes[rank] = code
        if self.settled(rank):
            return
        tb = _read_text(self.fault_path(rank))
        msg = E.RANK_DIED.format(
            rank=rank,
            world_size=self.world_size,
            how=_exit_text(code),
            stack="" if tb is None else f"; its last Python stack:\n{tb}",
        )
        self._fail(_Failure(False, time.monotonic(), rank, msg, code, tb))

    def error(self, timeout: float) -> RankError | None:
        """The :class:`RankError` of this run (None when every rank returned a result)."""
        if self.failures:
            first = min(self.failures)
            others = [
                f"rank {f.rank}" + (" (lost its peers)" if f.consequence else "")
                for f in sorted(self.failures, key=lambda f: f.rank)
                if f is not first
            ]
            killed = [r for r in range(self.world_size) if not self.settled(r)]
            tail = ""
            if others:
                tail += "\n" + E.RANK_OTHERS.format(ranks=", ".join(others))
            if killed:
                tail += "\n" + E.RANK_KILLED.format(ranks=killed)
            return RankError(
                first.message + tail,
                first.rank,
                exitcode=self.exitcodes.get(first.rank),
                traceback=first.traceback,
            )
        missing = [r for r in range(self.world_size) if r not in self.results]
        if missing:
            return RankError(
                E.RANK_TIMEOUT.format(
                    ranks=missing,
                    world_size=self.world_size,
                    timeout=timeout,
                    done=sorted(self.results),
                ),
                missing[0],
            )
        return None


#: the environment variable that scales every launch deadline (a shared or slow machine)
TIMEOUT_SCALE_ENV = "TDFUNC_LAUNCH_TIMEOUT_SCALE"


def deadline_scale() -> float:
    """How many times longer than asked :func:`launch` waits for its ranks: the value of
    ``TDFUNC_LAUNCH_TIMEOUT_SCALE`` when it is set (a number >= 1), else the machine's load
    per core (the 1-minute load average over the number of cores) when it is above 1: on a
    machine busy with other work, starting Python and torch in every rank takes that much
    longer.

    Example:
        >>> deadline_scale() >= 1.0
        True
    """
    raw = os.environ.get(TIMEOUT_SCALE_ENV)
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value >= 1.0:  # NaN too
            raise ValueError(E.BAD_TIMEOUT_SCALE.format(name=TIMEOUT_SCALE_ENV, value=raw))
        return value
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


#: seconds the ranks get to exit on their own once every one has reported its result
EXIT_WAIT = 30.0


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
    and return a picklable value (tensors come back by value). If a rank fails (raises, exits
    without a result, or is killed by a signal), the others get ``grace`` seconds to finish,
    then every process still alive is killed and :class:`RankError` names the rank that failed
    first, with its exit code or signal and its traceback. If ranks are still running after
    ``timeout`` seconds (times :func:`deadline_scale`: longer on a loaded machine, or as
    ``TDFUNC_LAUNCH_TIMEOUT_SCALE`` says) they are killed too. The ``spawn`` start method is used, so no state
    leaks from the parent.

    Raises:
        RankError: a rank failed or did not finish in time (never a raw ``OSError`` /
            ``EOFError`` from talking to the ranks).

    Example:
        >>> import operator
        >>> from tdfunc.testing import launch
        >>> launch(operator.add, 2)  # fn(rank, world_size) on each rank  # doctest: +SKIP
        [2, 3]
    """
    timeout = timeout * deadline_scale()
    ctx = mp.get_context("spawn")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="tdfunc-launch-")
    run = _Run(world_size, tmp)
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, pg_timeout, fn, tuple(args), w, run.fault_path(r)),
            daemon=True,
        )
        for r, (_, w) in enumerate(pipes)
    ]
    readers = {reader: r for r, (reader, _) in enumerate(pipes)}
    started = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        for _, w in pipes:
            w.close()  # the ranks hold the only write ends: a dead rank gives EOF, not a hang
        _wait(run, procs, readers, timeout, grace)
        if run.done() and not run.failures:
            # every rank reported: let each exit on its own (its exit handlers unlink the
            # named semaphores it made, e.g. tqdm's lock in a compiling process; a rank killed
            # mid-exit leaves them to the resource tracker, which warns about "leaked
            # semaphore objects"), up to EXIT_WAIT seconds
            exit_by = time.monotonic() + EXIT_WAIT * deadline_scale()
            for p in started:
                p.join(timeout=max(0.0, exit_by - time.monotonic()))
    finally:
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=5.0)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    err = run.error(timeout)
    if err is not None:
        raise err
    return [run.results[r] for r in range(world_size)]


def _read(run: _Run, reader: Any, readers: dict[Any, int]) -> None:
    """Read the report waiting in ``reader`` (a rank that exited mid-report has none)."""
    rank = readers.pop(reader)
    try:
        raw = reader.recv_bytes()
    except (EOFError, OSError):  # exited without a complete report: its exit tells why
        return
    run.report(rank, raw)


def _wait(
    run: _Run, procs: Sequence[Any], readers: dict[Any, int], timeout: float, grace: float
) -> None:
    """Collect reports and exits until every rank is settled or the deadline passes."""
    deadline = time.monotonic() + timeout
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    while not run.done():
        now = time.monotonic()
        if run.first_noticed is not None:
            deadline = min(deadline, run.first_noticed + grace)
        if now >= deadline:
            return
        ready = mpc.wait([*readers, *sentinels], timeout=min(0.5, deadline - now))
        for obj in ready:  # reports first: a rank may report and exit in one wake-up
            if obj in readers:
                _read(run, obj, readers)
        for obj in ready:
            if obj in sentinels:
                r = sentinels.pop(obj)
                procs[r].join(timeout=1.0)
                for reader, rr in list(readers.items()):
                    if rr == r and reader.poll():
                        _read(run, reader, readers)
                run.exit(r, procs[r].exitcode)


__all__ = ["RankError", "free_port", "launch"]
