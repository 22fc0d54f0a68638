"""Child-process side of tests/test_memmap.py (run as ``python tests/_memmap_helpers.py ...``)
and the datasets the DataLoader workers import.

Every scenario that may crash or is killed on purpose runs in a forked grandchild, so one run
of this script reports on all of them as one JSON line on stdout.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tdfunc
from tdfunc import MemmapFormatError, MemoryMappedTensor, load, save
from tdfunc.memmap import _store as _memmap_store

GRANDCHILD_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------ datasets
class RowDataset(torch.utils.data.Dataset):
    """Item ``i`` of a stored TensorDict; with ``mark`` it also writes ``seen[i] = 1``."""

    def __init__(self, store: Any, mark: bool) -> None:
        self.store = store
        self.mark = mark

    def __len__(self) -> int:
        return self.store.batch_size[0]

    def __getitem__(self, i: int) -> Any:
        if self.mark:
            self.store["seen"][i] = 1
        return self.store[i]


def collate(items: list[Any]) -> Any:
    """Stack the items (plain tensors come back from the workers)."""
    return tdfunc.stack(items)


# ------------------------------------------------------------------------------ isolation
def isolated(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` in a forked child; report its exit status and what it returned (as JSON)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        try:
            out = {"result": fn()}
        except BaseException as e:  # report any failure to the parent
            out = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
        os.write(w, json.dumps(out).encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + GRANDCHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.01)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    rep: dict[str, Any] = json.loads(data) if data else {}
    if os.WIFSIGNALED(status):
        rep["signal"] = os.WTERMSIG(status)
    rep["exit"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    return rep


def data_path(store: str) -> str:
    """The data file of a store (named in its manifest)."""
    with open(os.path.join(store, "manifest.json"), "rb") as f:
        return os.path.join(store, json.loads(f.read())["data_file"])


def _store_td(value: float, n_leaves: int = 4, numel: int = 4096) -> Any:
    return tdfunc.TensorDict(
        {f"k{i}": torch.full((numel,), float(value)) for i in range(n_leaves)}, batch_size=[numel]
    )


def _state(path: str) -> Any:
    """``None`` when nothing loads at ``path``; else the set of values held by the store."""
    try:
        td = load(path)
    except (FileNotFoundError, MemmapFormatError):  # a save killed before its manifest was
        return None  # whole (a temporary directory)
    vals = sorted({float(v) for leaf in td.values() for v in leaf.unique().tolist()})
    return {"values": vals, "keys": len(td.keys())}


def _old_dirs(parent: str, name: str) -> list[Any]:
    """What the hidden temporary directories of saves to ``name`` hold, for those that load."""
    states = [
        _state(os.path.join(parent, d))
        for d in sorted(os.listdir(parent))
        if d.startswith((f".{name}.old-", f".{name}.saving-"))
    ]
    return [st for st in states if st is not None]


def _hidden(parent: str, name: str) -> list[str]:
    return [d for d in os.listdir(parent) if d.startswith(f".{name}.")]


def _state_or_error(path: str) -> Any:
    try:
        return _state(path)
    except Exception as e:  # a partial store: report the error type
        return type(e).__name__


# ------------------------------------------------------------------------------ root checks
def _bypass(store: str, how: str) -> Any:
    td = load(store)  # mode="r"
    leaf = td["k0"]
    got: dict[str, Any] = {}
    if how == "numpy":
        arr = leaf.numpy()
        got["writeable"] = bool(arr.flags.writeable)
        try:
            arr[0] = 123.0
        except ValueError as e:
            got["numpy_write"] = f"ValueError: {e}"
        try:
            arr.flags.writeable = True
            arr[1] = 123.0
            got["forced_write"] = float(arr[1])
        except ValueError as e:
            got["forced_write"] = f"ValueError: {e}"
    elif how == "from_numpy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
            t = torch.from_numpy(np.asarray(leaf))
        t.add_(1000.0)  # plain tensor over the private mapping
        got["in_memory"] = float(t[0])
    elif how == "ctypes":
        inner = leaf.numpy()
        ptr = inner.__array_interface__["data"][0]
        ctypes.memset(ptr, 0xFF, 64)
        got["in_memory_bytes"] = inner.view(np.uint8)[:4].tolist()
    got["leaf_after"] = float(leaf[0])
    return got


def root_checks(work: str) -> dict[str, Any]:
    """Read-only bypass attempts and killed saves; one report for all of them."""
    out: dict[str, Any] = {}
    with open(os.path.join(work, "shared.pkl"), "rb") as f:
        shared = pickle.load(f)
    shared["k0"].fill_(7.0)
    out["unpickled"] = {
        "type": type(shared["k0"]).__name__,
        "mode": shared["k0"].mode,
        "sum": float(shared["k0"].sum()),
    }
    ro = os.path.join(work, "ro")
    save(_store_td(1.0), ro)
    data_file = data_path(ro)
    with open(data_file, "rb") as f:
        before = f.read()
    for how in ("numpy", "from_numpy", "ctypes"):
        rep = isolated(lambda how=how: _bypass(ro, how))
        with open(data_file, "rb") as f:
            rep["file_unchanged"] = f.read() == before
        out[f"bypass_{how}"] = rep

    # deterministic kills at each stage of a save
    def killer(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_during(stage: str, path: str, overwrite: bool) -> None:
        if stage == "data":  # after the first leaf
            real = _memmap_store.write_tensor
            calls = []

            def write_then_die(fd: int, t: Any, bar: Any) -> None:
                if calls:
                    killer()
                calls.append(1)
                real(fd, t, bar)

            _memmap_store.write_tensor = write_then_die
        elif stage == "before_rename":  # data and manifest written, nothing renamed
            _memmap_store.fsync_dir = killer
        elif stage == "after_exchange":  # new store in place, old one in the temporary dir
            _memmap_store._sync_after_commit = killer
        elif stage == "before_cleanup":  # new store in place, old not yet deleted
            _memmap_store.shutil.rmtree = killer
        save(_store_td(2.0), path, overwrite=overwrite)

    for stage, overwrite in (
        ("data", False),
        ("data", True),
        ("before_rename", True),
        ("after_exchange", True),
        ("before_cleanup", True),
    ):
        name = f"kill_{stage}_{'overwrite' if overwrite else 'fresh'}"
        path = os.path.join(work, name)
        if overwrite:
            save(_store_td(1.0), path)
        rep = isolated(lambda s=stage, p=path, o=overwrite: kill_during(s, p, o))
        rep["state"] = _state(path)
        rep["old"] = _old_dirs(work, name)
        save(_store_td(3.0), path, overwrite=True)  # the next save removes the leftovers
        rep["after_next_save"] = {"state": _state(path), "hidden": _hidden(work, name)}
        out[name] = rep

    # kills at random moments of a loop of overwriting saves
    loop_reports = []
    for delay in (0.05, 0.2, 0.45):
        path = os.path.join(work, f"loop{delay}")
        save(_store_td(0.0, n_leaves=8, numel=1 << 16), path)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.close(r)
            k = 1
            while True:
                save(_store_td(float(k), n_leaves=8, numel=1 << 16), path, overwrite=True)
                os.write(w, b".")
                k += 1
        os.close(w)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        saves = len(os.read(r, 1 << 16))
        os.close(r)
        st = _state(path)
        loop_reports.append({"saves": saves, "state": st, "old": _old_dirs(work, f"loop{delay}")})
    out["kill_loop"] = loop_reports
    return out


# ------------------------------------------------------------------------------ unprivileged checks
def permission_checks(store: str) -> dict[str, Any]:
    """Run without the right to write the store's files (uid 65534 or no CAP_DAC_OVERRIDE)."""
    out: dict[str, Any] = {"uid": os.getuid()}
    data_file = data_path(store)
    out["can_write_raw"] = os.access(data_file, os.W_OK)

    def attempt(fn: Callable[[], Any]) -> str:
        try:
            return f"ok: {fn()}"
        except Exception as e:  # report the exception type and message
            return f"{type(e).__name__}: {e}"

    out["load_r"] = attempt(lambda: float(load(store, mode="r")["k0"].sum()))
    out["load_c"] = attempt(lambda: _write_c(store))
    out["load_r+"] = attempt(lambda: load(store, mode="r+"))
    out["from_filename_r+"] = attempt(
        lambda: MemoryMappedTensor.from_filename(data_file, torch.float32, (4,), mode="r+")
    )
    out["from_filename_r"] = attempt(
        lambda: MemoryMappedTensor.from_filename(data_file, torch.float32, (4,)).tolist()
    )
    work = os.path.dirname(store)
    out["unreadable_data"] = attempt(lambda: load(os.path.join(work, "noread")))
    out["no_search"] = attempt(lambda: load(os.path.join(work, "nosearch")))
    return out


def _write_c(store: str) -> float:
    td = load(store, mode="c")
    td["k0"].fill_(-5.0)
    return float(td["k0"][0])


# ------------------------------------------------------------------------------ races
#: the two versions a writer alternates between: different values, dtypes and layouts
VERSIONS = {
    "a": {"value": 1.5, "n_leaves": 4, "numel": 4096, "dtype": "float32"},
    "b": {"value": 2.5, "n_leaves": 7, "numel": 1000, "dtype": "float64"},
}


def version_td(name: str) -> Any:
    v = VERSIONS[name]
    dtype = getattr(torch, v["dtype"])
    return tdfunc.TensorDict(
        {f"k{i}": torch.full((v["numel"],), v["value"], dtype=dtype) for i in range(v["n_leaves"])},
        batch_size=[v["numel"]],
    )


def writer_loop(path: str, seconds: float) -> dict[str, Any]:
    """Replace the store at ``path`` with version a, b, a, ... for ``seconds``."""
    deadline = time.monotonic() + seconds
    tds = [version_td("a"), version_td("b")]
    saves = 0
    while time.monotonic() < deadline:
        save(tds[saves % 2], path, overwrite=True)
        saves += 1
    return {"saves": saves}


def race_saves(work: str, rounds: int) -> dict[str, Any]:
    """Per round, two forked processes save different stores to one new path at the same
    moment (``overwrite=False``). Reports each round's outcomes and what the path holds."""
    out = []
    for i in range(rounds):
        path = os.path.join(work, f"race{i}")
        go_r, go_w = os.pipe()
        kids = []
        for value in (1.0, 2.0):
            res_r, res_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - child
                os.close(go_w)
                os.read(go_r, 1)
                try:
                    save(_store_td(value), path)
                    msg = f"ok {value}"
                except BaseException as e:  # report the exception type to the parent
                    msg = f"{type(e).__name__} {value}"
                os.write(res_w, msg.encode())
                os._exit(0)
            os.close(res_w)
            kids.append((pid, res_r))
        os.close(go_r)
        os.write(go_w, b"gg")  # both start together
        os.close(go_w)
        results = []
        for pid, res_r in kids:
            os.waitpid(pid, 0)
            results.append(os.read(res_r, 1000).decode())
            os.close(res_r)
        leftovers = [d for d in os.listdir(work) if d.startswith(f".race{i}.")]
        out.append({"results": sorted(results), "state": _state(path), "leftovers": leftovers})
    return {"rounds": out}


# ------------------------------------------------------------------------------ torch APIs
def _api(store: str, mode: str, what: str) -> Any:
    td = load(store, mode=mode)
    leaf = td["k0"]
    if what == "data_ptr":
        return leaf.data_ptr() == leaf._inner.data_ptr() != 0
    if what == "share_memory_":
        leaf.share_memory_()
        return float(leaf.sum())
    if what == "from_dlpack":
        t = torch.from_dlpack(leaf)
        t[0] = 9.0
        return float(leaf[0])
    if what == "from_dlpack_copy":
        return float(torch.from_dlpack(leaf.__dlpack__(copy=True)).sum())
    if what == "untyped_storage_copy":
        leaf.untyped_storage().copy_(torch.full((leaf.numel(),), 9.0).untyped_storage())
        return float(leaf[0])
    if what == "untyped_storage_read":
        s = leaf.untyped_storage()
        return [s.nbytes(), float(torch.empty(0).set_(s)[0])]
    if what == "storage_fill":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage is deprecated
            leaf.storage().fill_(0)
        return float(leaf[0])
    if what == "storage_read":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [leaf.storage().size(), float(leaf.storage()[0])]
    if what == "numpy_from_dlpack":
        return float(np.from_dlpack(leaf)[0])
    raise AssertionError(what)


API_CALLS = (
    "data_ptr",
    "share_memory_",
    "from_dlpack",
    "from_dlpack_copy",
    "untyped_storage_copy",
    "untyped_storage_read",
    "storage_fill",
    "storage_read",
    "numpy_from_dlpack",
)


def torch_apis(work: str) -> dict[str, Any]:
    """Each storage-level torch call on a loaded leaf of each mode, in its own forked process
    (a crash kills only that one), and whether the data file changed."""
    store = os.path.join(work, "s")
    save(_store_td(1.0, n_leaves=1, numel=64), store)
    data_file = data_path(store)
    out: dict[str, Any] = {}
    for mode in ("r", "r+", "c"):
        for what in API_CALLS:
            with open(data_file, "rb") as f:
                before = f.read()
            rep = isolated(lambda m=mode, w=what: _api(store, m, w))
            with open(data_file, "rb") as f:
                rep["file_changed"] = f.read() != before
            out[f"{mode} {what}"] = rep
            if rep["file_changed"]:
                save(_store_td(1.0, n_leaves=1, numel=64), store, overwrite=True)
                data_file = data_path(store)
    return out


def main() -> None:
    """``root-checks WORKDIR``, ``permission-checks STORE``, ``writer PATH SECONDS``,
    ``race-saves WORKDIR ROUNDS`` or ``torch-apis WORKDIR``: print one JSON report."""
    what, arg = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # no OpenMP pool: the forked children use torch safely
    if what == "root-checks":
        rep = root_checks(arg)
    elif what == "permission-checks":
        rep = permission_checks(arg)
    elif what == "writer":
        print("STARTED", flush=True)
        rep = writer_loop(arg, float(sys.argv[3]))
    elif what == "race-saves":
        rep = race_saves(arg, int(sys.argv[3]))
    else:
        rep = torch_apis(arg)
    print("REPORT " + json.dumps(rep), flush=True)


if __name__ == "__main__":
    main()
