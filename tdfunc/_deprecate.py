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

import sys
import types
import warnings
from collections.abc import Callable, Mapping
from typing import Any

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


def module_getattr(module: str, moved: Moved) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the deprecated names of ``module`` (PEP 562)."""

    def __getattr__(name: str) -> Any:
        entry = moved.get(name)
        if entry is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        get, new = entry
        warnings.warn(
            MESSAGE.format(old=f"{module}.{name}", new=new), DeprecationWarning, stacklevel=2
        )
        return get()

    return __getattr__


def module_path(name: str, moved: Moved) -> None:
    """Keep ``import name`` / ``from name import x`` working for a module path that is gone.

    Registers a module object under ``name`` in ``sys.modules`` whose attributes are the
    deprecated names; it does not bind ``name`` as an attribute of its parent package (so the
    parent's attribute of the same name, if any, is not shadowed).
    """
    mod = types.ModuleType(name, f"Deprecated module path ({', '.join(moved)}).")
    mod.__getattr__ = module_getattr(name, moved)  # type: ignore[method-assign]
    sys.modules[name] = mod
