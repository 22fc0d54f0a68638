"""Tensorclasses side by side: ``@tdfunc.tensorclass``, tensordict's ``@tensorclass`` and a plain
frozen dataclass registered with ``torch.utils._pytree`` (the compiled floor of a typed record).

Contenders: ``tdfunc_tc``, ``tensordict_tc`` and ``pytree`` (``@dataclass(frozen=True)`` +
``torch.utils._pytree.register_dataclass``). Every field is a ``[16, 4]`` float tensor (batch
size ``[16]`` for the two tensorclasses); all contenders get the same tensors and return the
same leaves (checked by the harness in the first pass).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from functools import reduce
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from tdfunc import tensorclass

CATEGORY = "tensorclass"
CONTENDERS = ("tdfunc_tc", "tensordict_tc", "pytree")
BATCH = 16
FEAT = 4

Fn = Callable[..., Any]
Built = tuple[Fn, tuple[Any, ...]]

_CLASSES: dict[tuple[str, int], type] = {}


def _names(k: int) -> tuple[str, ...]:
    return tuple(f"f{i}" for i in range(k))


def record_class(contender: str, k: int) -> type:
    """The ``k``-field record type of a contender (one ``torch.Tensor`` field per name)."""
    key = (contender, k)
    if key not in _CLASSES:
        ns = {"__annotations__": dict.fromkeys(_names(k), torch.Tensor), "__module__": __name__}
        raw = type(f"Rec{k}_{contender}", (), ns)
        if contender == "tdfunc_tc":
            cls = tensorclass(raw)
        elif contender == "tensordict_tc":
            td = pytest.importorskip("tensordict", reason="tensordict is not installed")
            cls = td.tensorclass(raw)
        else:
            cls = dataclasses.dataclass(frozen=True)(raw)
            pytree.register_dataclass(cls)
        _CLASSES[key] = cls
    return _CLASSES[key]


def _tensors(k: int, n: int | None, offset: float = 0.0) -> list[torch.Tensor]:
    b = BATCH if n is None else n
    g = torch.Generator().manual_seed(k)
    return [torch.randn(b, FEAT, generator=g) + offset for _ in range(k)]


def _make(contender: str, cls: type, values: list[torch.Tensor]) -> Any:
    if contender == "pytree":
        return cls(*values)
    return cls(*values, batch_size=values[0].shape[:1])


def _record(contender: str, k: int, n: int | None) -> Any:
    return _make(contender, record_class(contender, k), _tensors(k, n))


def _replacer(contender: str, name: str) -> Fn:
    if contender == "pytree":
        return lambda r, v: dataclasses.replace(r, **{name: v})
    return lambda r, v: r.replace(**{name: v})


def build_create(contender: str, n: int | None) -> Built:
    """Create a 5-field record from 5 tensors passed positionally (batch size given as the
    first tensor's leading dim for the tensorclasses)."""
    cls = record_class(contender, 5)
    if contender == "pytree":

        def create(a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
            return cls(a, b, c, d, e)
    else:

        def create(a: Any, b: Any, c: Any, d: Any, e: Any) -> Any:
            return cls(a, b, c, d, e, batch_size=a.shape[:1])

    return create, tuple(_tensors(5, n))


def build_create_keyword(contender: str, n: int | None) -> Built:
    """Create a 5-field record from 5 tensors passed by keyword."""
    cls = record_class(contender, 5)
    if contender == "pytree":

        def create(vals: list[Any]) -> Any:
            return cls(f0=vals[0], f1=vals[1], f2=vals[2], f3=vals[3], f4=vals[4])
    else:

        def create(vals: list[Any]) -> Any:
            return cls(
                f0=vals[0],
                f1=vals[1],
                f2=vals[2],
                f3=vals[3],
                f4=vals[4],
                batch_size=vals[0].shape[:1],
            )

    return create, (_tensors(5, n),)


def build_read_20(contender: str, n: int | None) -> Built:
    """Read the 20 fields of a 20-field record as attributes and sum them."""
    names = _names(20)

    def read(r: Any) -> Any:
        return reduce(operator.add, [getattr(r, k) for k in names])

    return read, (_record(contender, 20, n),)


def build_replace_one(contender: str, n: int | None) -> Built:
    """Replace one field of a 5-field record with a new tensor (a new record)."""
    rep = _replacer(contender, "f0")
    return (lambda r, v: rep(r, v)), (_record(contender, 5, n), _tensors(1, n, 100.0)[0])


def build_replace_chain10(contender: str, n: int | None) -> Built:
    """A chain of 10 single-field replaces on a 5-field record (fields f0..f4 in turn)."""
    reps = [_replacer(contender, f"f{i % 5}") for i in range(10)]

    def chain(r: Any, vals: list[torch.Tensor]) -> Any:
        for rep, v in zip(reps, vals):
            r = rep(r, v)
        return r

    return chain, (_record(contender, 5, n), _tensors(10, n, 100.0))


WORKLOADS: dict[str, Callable[[str, int | None], Built]] = {
    "tc_create": build_create,
    "tc_create_keyword": build_create_keyword,
    "tc_read_20": build_read_20,
    "tc_replace_one": build_replace_one,
    "tc_replace_chain10": build_replace_chain10,
}


@pytest.mark.parametrize("contender", CONTENDERS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_tensorclass_op(
    measure: Callable[..., Any], workload: str, mode: str, contender: str
) -> None:
    """One tensorclass workload (see its ``build_*`` docstring) for one contender and mode."""
    build = WORKLOADS[workload]
    fn, args = build(contender, None)
    measure(
        fn,
        *args,
        workload=workload,
        mode=mode,
        contender=contender,
        category=CATEGORY,
        make_args=lambda n: build(contender, n)[1],
        doc=(build.__doc__ or "").split("\n")[0],
    )
