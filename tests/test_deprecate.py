"""Deprecated module paths behave as modules for the tools that walk or inspect them."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pydoc
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import tdfunc
from tdfunc import _deprecate

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["tdfunc.tensorclass", "tdfunc.control"])
def test_find_spec_of_a_deprecated_module_path(name):
    spec = importlib.util.find_spec(name)
    assert spec is not None
    assert spec.name == name
    mod = sys.modules[name]
    assert mod.__spec__ is spec
    assert importlib.reload(mod) is mod
    assert "Deprecated module path" in pydoc.render_doc(mod)


def test_find_spec_before_the_package_is_imported():
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('tdfunc.tensorclass')\n"
        "print('SPEC', spec.name, type(spec.loader).__name__)\n"
        "assert importlib.util.find_spec('tdfunc.no_such_module') is None\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SPEC tdfunc.tensorclass _AliasLoader" in proc.stdout


def test_deprecated_names_still_work_and_warn():
    mod = sys.modules["tdfunc.tensorclass"]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert mod.tensorclass is tdfunc.tensorclass
        assert mod.is_tensorclass is tdfunc.is_tensorclass
    assert [type(x.message) for x in w] == [DeprecationWarning, DeprecationWarning]
    assert str(w[0].message) == _deprecate.MESSAGE.format(
        old="tdfunc.tensorclass.tensorclass", new="tdfunc.tensorclass"
    )
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = mod.nope
    # the package's own attribute of the same name is the decorator, not the module
    assert tdfunc.tensorclass is not mod


def test_importlib_invalidate_caches_works_with_tdfunc_imported() -> None:
    """The finder of deprecated module paths sits on ``sys.meta_path`` as an instance, so
    ``importlib.invalidate_caches()`` (called by pip, pytest plugins, autoreload and torch)
    can call its ``invalidate_caches()``; it used to raise ``TypeError``."""
    import importlib
    import sys

    import tdfunc  # noqa: F401  (registers the deprecated paths)
    from tdfunc import _deprecate

    assert any(isinstance(f, _deprecate._AliasFinder) for f in sys.meta_path)
    assert _deprecate._AliasFinder not in sys.meta_path
    importlib.invalidate_caches()
