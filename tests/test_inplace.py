"""tensordict's in-place names on an immutable container raise ``InPlaceError`` (a
``TypeError``) naming the pure spelling (``tdfunc._inplace``)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import tdfunc
from tdfunc import _errors as E
from tdfunc._inplace import SPECIAL, pure_spelling

tensordict = pytest.importorskip("tensordict")


@tdfunc.tensorclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def containers() -> list[Any]:
    return [
        tdfunc.TensorDict(a=torch.ones(2), n={"b": torch.ones(2)}, batch_size=[2]),
        Pair(x=torch.ones(2), y=torch.ones(2), batch_size=[2]),
    ]


#: every public in-place name of tensordict's TensorDict (``X_``), plus item assignment
TD_INPLACE = sorted(
    n for n in dir(tensordict.TensorDict) if n.endswith("_") and not n.startswith("_")
)


def _message(obj: Any, name: str) -> str:
    hint = pure_spelling(type(obj), name)
    assert hint is not None, name
    return E.INPLACE.format(cls=type(obj).__name__, name=name, hint=hint)


@pytest.mark.parametrize("name", TD_INPLACE)
def test_every_tensordict_inplace_name_raises_with_the_pure_spelling(name: str) -> None:
    for obj in containers():
        before = [x.clone() for x in obj.leaves()]
        with pytest.raises(tdfunc.InPlaceError) as info:
            getattr(obj, name)(0)
        assert str(info.value) == _message(obj, name)
        assert isinstance(info.value, TypeError)
        assert not hasattr(obj, name)  # the container has no such method
        assert all(torch.equal(a, b) for a, b in zip(before, obj.leaves()))


def test_the_spellings_name_what_exists() -> None:
    """A derived spelling ``td.X(...)`` names a method the container has; ``apply`` is the
    fallback only while it has none."""
    for obj in containers():
        cls = type(obj)
        for name in TD_INPLACE:
            hint = pure_spelling(cls, name)
            assert hint is not None
            for m in re.findall(r"\btd\.(\w+)\(", hint):
                assert hasattr(tdfunc.TensorDict, m), (name, hint)
            if name not in SPECIAL:
                base = name[:-1]
                want = f"td.{base}(" if hasattr(cls, base) else f"x.{base}("
                assert want in hint, (name, hint)


def test_named_spellings() -> None:
    td = containers()[0]
    assert pure_spelling(type(td), "zero_") == "td = torch.zeros_like(td)"
    assert "td.set(key, value)" in str(pure_spelling(type(td), "set_"))
    assert "td.at[" in str(pure_spelling(type(td), "update_at_"))
    assert "td.rename_key(" in str(pure_spelling(type(td), "rename_key_"))
    clamp = str(pure_spelling(type(td), "clamp_"))
    assert ("td.clamp(" in clamp) == hasattr(tdfunc.TensorDict, "clamp")


def test_item_assignment_and_deletion() -> None:
    for obj in containers():
        with pytest.raises(tdfunc.InPlaceError) as info:
            obj["a"] = 1
        assert isinstance(info.value, TypeError)
        assert str(info.value) == E.MUTATION.format(
            cls=type(obj).__name__, what="item assignment", hint="td = td.set('a', value)"
        )
        with pytest.raises(tdfunc.InPlaceError, match=re.escape("td.at[index].set(value)")):
            obj[0] = obj[1]
        with pytest.raises(tdfunc.InPlaceError, match=re.escape("td.exclude('a')")):
            del obj["a"]


def test_other_missing_names_stay_attribute_errors() -> None:
    for obj in containers():
        with pytest.raises(AttributeError) as info:
            obj.no_such_thing  # noqa: B018 - the lookup is the test
        assert not isinstance(info.value, tdfunc.InPlaceError)
        assert str(info.value) == E.NO_ATTRIBUTE.format(
            cls=type(obj).__name__, name="no_such_thing"
        )
        assert not hasattr(obj, "unknown_name_")
        assert getattr(obj, "_private", None) is None


def test_compiled_call_still_refused() -> None:
    td = containers()[0]

    def f(t: Any) -> Any:
        return t.zero_()

    with pytest.raises(Exception, match="zeros_like"):
        torch.compile(f, backend="eager", fullgraph=True)(td)
