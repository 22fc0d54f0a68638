"""The migration table (``tests/migration_table.py``, shown in docs/guides/migrating.md)
cannot drift: it covers every public name of ``tensordict.TensorDict``, every tdfunc name a
spelling uses exists, the guide shows the generated table, and the in-place rows say what the
``InPlaceError`` of that name says."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc._inplace import SPECIAL, pure_spelling

pytest.importorskip("tensordict")

import migration_table as mt

NAMES = mt.tensordict_names()
ROWS = mt.table(NAMES)

PENDING = mt.PENDING


def test_covers_every_public_tensordict_name() -> None:
    assert len(NAMES) > 300  # the enumeration itself works
    assert list(ROWS) == NAMES
    stale = sorted(set(mt._T) - set(NAMES))
    assert not stale, f"rows for names tensordict's TensorDict does not have: {stale}"


def test_guide_shows_the_generated_table() -> None:
    text = mt.GUIDE.read_text()
    assert mt.guide_block(text) == mt.render(ROWS), (
        "docs/guides/migrating.md is out of date: run .venv/bin/python tests/migration_table.py"
    )


def _resolve(root: Any, dotted: str) -> bool:
    obj = root
    for i, part in enumerate(dotted.split(".")):
        if not hasattr(obj, part) and root is tdfunc and i == 0:
            return False
        if not hasattr(obj, part):
            # a subpackage loaded on first use (tdfunc.distributed)
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except (ImportError, AttributeError):
                return False
            continue
        obj = getattr(obj, part)
    return True


def names_used(spelling: str) -> list[tuple[Any, str]]:
    """``(root, dotted name)`` for every ``td.X``, ``tdfunc.X.Y`` and ``torch.X.Y`` of a
    spelling."""
    out: list[tuple[Any, str]] = []
    out += [(tdfunc.TensorDict, m) for m in re.findall(r"\btd\.(\w+)", spelling)]
    out += [(tdfunc, m) for m in re.findall(r"\btdfunc\.([\w.]*\w)", spelling)]
    out += [(torch, m) for m in re.findall(r"\btorch\.([\w.]*\w)", spelling)]
    return out


def _exists(root: Any, dotted: str) -> bool:
    if root is tdfunc:
        return hasattr(tdfunc, dotted.split(".")[0]) and _resolve(tdfunc, dotted)
    return _resolve(root, dotted)


WITH_SPELLING = [n for n, r in ROWS.items() if r.spelling is not None]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=PENDING[n]))
        if n in PENDING
        else n
        for n in WITH_SPELLING
    ],
)
def test_every_name_a_spelling_uses_exists(name: str) -> None:
    spelling = ROWS[name].spelling
    assert spelling is not None
    missing = [
        f"{getattr(r, '__name__', r)}.{d}" for r, d in names_used(spelling) if not _exists(r, d)
    ]
    assert not missing, f"{name}: {spelling!r} uses {missing}, which do not exist"


def test_rows_without_a_spelling_say_why() -> None:
    for n, r in ROWS.items():
        if r.spelling is None:
            assert len(r.note) > 15, n


def test_inplace_rows_agree_with_the_error() -> None:
    for n in NAMES:
        if not n.endswith("_"):
            continue
        hint = pure_spelling(tdfunc.TensorDict, n)
        assert hint is not None, n
        row = ROWS[n]
        if n in SPECIAL:
            assert row.spelling in (hint, None), n
            continue
        base = n[:-1]
        if hasattr(tdfunc.TensorDict, base):
            assert hint == f"td = td.{base}(...)", n
        if base in ROWS and ROWS[base].spelling is not None:  # the table: X_ is "td = <X's>"
            assert row.spelling == f"td = {ROWS[base].spelling}", n


def test_guide_shows_the_generated_package_table() -> None:
    text = mt.GUIDE.read_text()
    assert mt.guide_block(text, mt.MODULE_BEGIN, mt.MODULE_END) == mt.render(mt.MODULE_TABLE), (
        "docs/guides/migrating.md is out of date: run .venv/bin/python tests/migration_table.py"
    )


def _named(name: str) -> str:
    """The text an error of the row ``name`` must contain: the row's spelling (for ``X_``
    the pure spelling :mod:`tdfunc._inplace` gives, which the row agrees with), or the note
    of a row without one."""
    if name.endswith("_"):
        hint = pure_spelling(tdfunc.TensorDict, name)
        assert hint is not None
        return hint
    row = ROWS[name]
    return row.spelling if row.spelling is not None else row.note


def _replayable(name: str) -> Any:
    """The oracle's tensordict call of ``name`` when it is a method call on the container
    (``x.name(...)``), which can be replayed on a tdfunc container; else ``None``."""
    import test_tensordict_oracle as oracle

    case = oracle.case_for(name)
    spec = getattr(case.ref, "spec", None) if case is not None else None
    if spec is None and not (case is not None and name.endswith("_")):
        return None
    return case


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", NAMES)
def test_the_tensordict_spelling_on_a_tdfunc_container(name: str) -> None:
    """Every tensordict name, as a tensordict user writes it, on a tdfunc container: it gives
    tensordict's result (tensordict as the oracle) or raises an error that names the row's
    tdfunc spelling. A name tdfunc lacks is looked up; a method call the oracle knows is
    called with tensordict's arguments."""
    import test_tensordict_oracle as oracle

    d, o = oracle._data(0), oracle._data(1)
    x, y = oracle._tf(d), oracle._tf(o)
    before = x.clone()
    expected = _named(name)
    if not hasattr(x, name):
        with pytest.raises(AttributeError) as e:
            getattr(x, name)
        assert expected in str(e.value), f"{name}: {e.value} does not name {expected!r}"
        return
    case = _replayable(name)
    if case is None:
        return  # a property or a call with tdfunc arguments: test_tensordict_oracle runs it
    error: Exception | None = None
    try:
        got = case.ref(x, y)
    except Exception as e:  # the message is what is checked
        error = e
    if error is not None:
        assert expected in str(error), f"{name}: {error!r} does not name {expected!r}"
        return
    ref = oracle._plain(case.ref(oracle._td(d), oracle._td(o)))
    if case.norm is not None:
        ref, got = case.norm(ref), case.norm(got)
    oracle.check(ref, got, name)
    tdfunc.testing.assert_close(x, before)
