"""What a compiled call on a container costs before its graph runs: the guards Dynamo checks.

A lifted torch function reaches its rule through one dict *hit* (a miss in a dict makes
Dynamo guard every key of it: the op table has ~470), and traced tdfunc code never reaches
one module or class through two globals (Dynamo checks such an alias with a Python guard on
every call). Measured on torch 2.13 (2 leaves): ``torch.where(mask, td, 0)`` went from 235
guards and one Python guard to 70 and none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._C._dynamo.guards import DictGuardManager
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import tdfunc


def _count(mgr: Any) -> int:
    """Leaf guards under a guard manager, dict keys and values included."""
    kids = list(mgr.get_child_managers())
    if isinstance(mgr, DictGuardManager):
        pairs = mgr.get_key_value_managers()
        for kv in pairs.values() if isinstance(pairs, dict) else pairs:
            kids.extend(x for x in (kv if isinstance(kv, (tuple, list)) else (kv,)) if x)
    return len(mgr.get_leaf_guards()) + sum(_count(c) for c in kids)


MASK = torch.tensor([True, False, True])

#: the lifted calls of every family, as a user writes them (the caller's frame reaches
#: ``torch`` through its own globals, as real code does)
CALLS: dict[str, Callable[[Any], Any]] = {
    "where": lambda td: torch.where(MASK, td, 0.0),
    "td.where": lambda td: td.where(MASK, 0.0),
    "exp": lambda td: torch.exp(td),
    "td.exp": lambda td: td.exp(),
    "relu": lambda td: F.relu(td),
    "add": lambda td: torch.add(td, 1),
    "sum": lambda td: torch.sum(td, 0),
    "td.sum": lambda td: td.sum(0),
    "cumsum": lambda td: torch.cumsum(td, 0),
    "td.cumsum": lambda td: td.cumsum(0),
    "softmax": lambda td: torch.softmax(td, 0),
    "max": lambda td: torch.max(td, 0),
    "gather": lambda td: torch.gather(td, 0, torch.zeros(3, dtype=torch.long)),
    "mix": lambda td: torch.where(MASK, td + td, 0.0).sum(0) + torch.cumsum(td, 0) * td.exp(),
}


@pytest.mark.parametrize("name", CALLS)
def test_compiled_lifted_call_has_no_python_guard_and_few_guards(name: str) -> None:
    fn = CALLS[name]
    td = tdfunc.TensorDict(a=torch.rand(3, 2), n={"b": torch.rand(3)}, batch_size=[3])

    def f(td: Any) -> Any:
        return fn(td)

    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(td)
    tdfunc.testing.assert_close(
        got[0] if isinstance(got, tuple) else got, (fn(td)[0] if isinstance(got, tuple) else fn(td))
    )
    (entry,) = _debug_get_cache_entry_list(f.__code__)
    root = entry.guard_manager.root
    python_guards = [g.verbose_code_parts() for g in root.get_epilogue_lambda_guards()]
    assert python_guards == []
    # 2 leaves: tensors, keys, batch sizes and the code objects traced (70 for where, 104 for
    # torch.sum, 184 for mix); a dict miss in the op table would add a guard per key (129 in
    # the batch-dim table alone)
    assert _count(root) < (250 if name == "mix" else 150)


def _dict_positions(mgr: Any) -> list[int]:
    """The positions at which the guards read an entry of a dict (Dynamo walks a dict up to
    the last position it guards, on every call)."""
    out: list[int] = []
    kids = list(mgr.get_child_managers())
    if isinstance(mgr, DictGuardManager):
        pairs = mgr.get_key_value_managers()
        items = pairs.items() if isinstance(pairs, dict) else enumerate(pairs)
        for i, kv in items:
            out.append(i)
            kids.extend(x for x in (kv if isinstance(kv, (tuple, list)) else (kv,)) if x)
    for c in kids:
        out.extend(_dict_positions(c))
    return out


@pytest.mark.parametrize(
    "name", ["where", "exp", "relu", "add", "sum", "cumsum", "softmax", "max", "gather"]
)
def test_compiled_lifted_call_reads_the_op_table_by_key_not_by_position(name: str) -> None:
    """A torch function reaches its rule by a guard on its key: guarding a dict keyed by
    function objects reads the entry by position, and Dynamo walks the dict up to it on every
    call (``torch.where`` sat at position 129 of ~500, ``torch.sum`` at 334: ~1 us a call).
    Only the container's own keys (2 here) are read by position."""
    fn = CALLS[name]
    td = tdfunc.TensorDict(a=torch.rand(3, 2), n={"b": torch.rand(3)}, batch_size=[3])

    def f(td: Any) -> Any:
        return fn(td)

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(td)
    (entry,) = _debug_get_cache_entry_list(f.__code__)
    assert max(_dict_positions(entry.guard_manager.root), default=0) < 4
