"""Every public module of tdfunc shows exactly its API: ``dir()`` lists the names of its
``__all__`` (and a documented subpackage it loads on first use), never what the module
imported for its own use (``annotations`` from ``from __future__ import annotations``,
``torch``, ``Any``, a private module of tdfunc)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tdfunc

ROOT = Path(tdfunc.__file__).resolve().parent

#: subpackages a package loads on first use (not in ``__all__``, so that ``import *`` does
#: not load them), listed by its ``dir()``: tdfunc.distributed imports torch.distributed.tensor
LAZY = {"tdfunc": {"distributed"}}


def public_modules() -> dict[str, bool]:
    """``tdfunc`` and every module or package under it with no private part in its name
    (read from the source tree), each with whether it is a package."""
    found = {"tdfunc": True}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        package = rel.name == "__init__"
        parts = rel.parts[:-1] if package else rel.parts
        if parts and not any(p.startswith("_") for p in parts):
            found[".".join(("tdfunc", *parts))] = package
    return found


def _documented() -> set[str]:
    """The modules with a page in the API reference (``docs/hooks.py``)."""
    path = ROOT.parent / "docs" / "hooks.py"
    spec = importlib.util.spec_from_file_location("tdfunc_docs_hooks", path)
    assert spec is not None
    assert spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, hooks)
    spec.loader.exec_module(hooks)
    return set(hooks.public_packages())


PUBLIC = list(public_modules())
PACKAGES = [m for m, package in public_modules().items() if package]


def test_the_walk_finds_the_public_packages():
    assert {
        "tdfunc",
        "tdfunc.distributed",
        "tdfunc.interop",
        "tdfunc.memmap",
        "tdfunc.nn",
        "tdfunc.optim",
        "tdfunc.testing",
    } <= set(PUBLIC)
    assert not [m for m in PUBLIC if "._" in m]
    assert {"tdfunc.testing", "tdfunc.tensordict"}.isdisjoint(PACKAGES)


@pytest.mark.parametrize("name", PUBLIC)
def test_dir_shows_exactly_the_names_of_all(name):
    module = importlib.import_module(name)
    assert "__all__" in vars(module), f"{name} declares no __all__"
    names = module.__all__
    assert all(isinstance(n, str) for n in names)
    assert len(set(names)) == len(names)
    shown = {n for n in dir(module) if not n.startswith("_")}
    listed = {n for n in names if not n.startswith("_")}
    assert shown == listed | LAZY.get(name, set()), (
        f"{name}: dir() shows {sorted(shown - listed)} beyond __all__, "
        f"misses {sorted(listed - shown)}"
    )
    for n in names:
        getattr(module, n)  # every listed name resolves


@pytest.mark.parametrize("name", PACKAGES)
def test_no_package_keeps_the_future_import_as_an_attribute(name):
    # ``from __future__ import annotations`` binds the name ``annotations`` in the module; a
    # package's __init__ is its public face and needs no postponed annotations (a module with
    # code, tdfunc.tensordict or tdfunc.testing, may: its __dir__ leaves it out)
    assert "annotations" not in vars(importlib.import_module(name))


@pytest.mark.parametrize("name", PUBLIC)
def test_the_only_modules_dir_shows_are_documented_subpackages(name):
    module = importlib.import_module(name)
    documented = _documented()
    shown = {
        n: getattr(module, n)
        for n in dir(module)
        if not n.startswith("_") and isinstance(getattr(module, n), ModuleType)
    }
    for n, sub in shown.items():
        assert sub.__name__ == f"{name}.{n}", f"{name}.{n} is {sub.__name__}"
        assert sub.__name__ in documented, f"{name}.{n} has no page in the API reference"
