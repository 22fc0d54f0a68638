"""Deprecated aliases: the one mechanism every package uses for names that moved.

A moved name keeps working for one release: reading it emits a ``DeprecationWarning`` that
names the new home, and it is listed in ``CHANGELOG.md``.

Example:
    >>> import warnings
    >>> getattr_ = module_getattr("pkg", {"old": (lambda: 42, "pkg.new")})
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     getattr_("old"), str(w[0].message)
    (42, 'pkg.old is deprecated and will be removed in the next release; use pkg.new')
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

#: old name -> (a function returning the object, the new home to name in the warning)
Moved = Mapping[str, tuple[Callable[[], Any], str]]

MESSAGE = "{old} is deprecated and will be removed in the next release; use {new}"


def attribute(obj: object, name: str) -> Callable[[], Any]:
    """A function that reads ``obj.<name>`` when called: the late lookup of a moved name.

    Example:
        >>> import math
        >>> attribute(math, "pi")()
        3.141592653589793
    """
    return lambda: getattr(obj, name)


def module_getattr(
    module: str, moved: Moved, missing: Callable[[str], AttributeError] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the deprecated names of ``module`` (PEP 562).

    Args:
        module: the module's name.
        moved: its deprecated names.
        missing: the error of a name that is neither there nor deprecated (default: the plain
            ``AttributeError``), e.g. one that names the spelling of another library's name.
    """

    def __getattr__(name: str) -> Any:
        entry = moved.get(name)
        if entry is None:
            if missing is not None:
                raise missing(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        get, new = entry
        warnings.warn(
            MESSAGE.format(old=f"{module}.{name}", new=new), DeprecationWarning, stacklevel=2
        )
        return get()

    return __getattr__


class _AliasLoader(importlib.abc.Loader):
    """The loader of a deprecated module path: the module is the one already registered
    (``importlib.reload`` and ``importlib.util.find_spec`` see a regular module)."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the deprecated module paths, so that ``importlib.util.find_spec`` answers for
    them before their package has been imported too (it then searches the finders)."""

    modules: ClassVar[dict[str, types.ModuleType]] = {}

    @classmethod
    def find_spec(
        cls, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        mod = cls.modules.get(fullname)
        return None if mod is None else mod.__spec__


#: the one finder on ``sys.meta_path``
_FINDER = _AliasFinder()


def module_path(name: str, moved: Moved) -> None:
    """Keep ``import name`` / ``from name import x`` working for a module path that is gone.

    Registers a module object under ``name`` in ``sys.modules`` whose attributes are the
    deprecated names; it does not bind ``name`` as an attribute of its parent package (so the
    parent's attribute of the same name, if any, is not shadowed). The module has a proper
    ``__spec__`` and ``__loader__``, so tools that inspect modules
    (``importlib.util.find_spec``, ``importlib.reload``, ``pydoc``) accept it.

    Example:
        >>> import importlib.util, sys
        >>> module_path("pkg_example_old", {"x": (lambda: 1, "pkg.x")})
        >>> importlib.util.find_spec("pkg_example_old").name
        'pkg_example_old'
        >>> del sys.modules["pkg_example_old"], _AliasFinder.modules["pkg_example_old"]
    """
    mod = types.ModuleType(name, f"Deprecated module path ({', '.join(moved)}).")
    mod.__getattr__ = module_getattr(name, moved)  # type: ignore[method-assign]
    loader = _AliasLoader(mod)
    mod.__loader__ = loader
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader, origin="deprecated alias")
    sys.modules[name] = mod
    _AliasFinder.modules[name] = mod
    if _FINDER not in sys.meta_path:  # an instance: importlib calls its methods unbound
        sys.meta_path.append(_FINDER)
