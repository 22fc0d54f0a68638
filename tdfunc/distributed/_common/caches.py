"""The caches of :mod:`tdfunc.distributed`, dropped together by :func:`cache_clear`.

Each cache registers itself here when its module is loaded (:func:`register`, stacked on
``functools.lru_cache``): the redistribution plans and graphs, the agreed transitions, the
transfer plans between meshes and their compiled packing. So ``cache_clear`` reaches every
job of the package without importing any of them (the jobs import this module, not the
other way round).
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class _Cache(Protocol):
    def cache_clear(self) -> None: ...


C = TypeVar("C", bound=_Cache)

_CACHES: list[_Cache] = []


def register(cache: C) -> C:
    """Add ``cache`` (an ``functools.lru_cache`` function) to those :func:`cache_clear` drops."""
    _CACHES.append(cache)
    return cache


def cache_clear() -> None:
    """Drop the cached redistribution plans and graphs (they are rebuilt on next use).

    Example:
        >>> from tdfunc.distributed import cache_clear
        >>> cache_clear()
    """
    for cache in _CACHES:
        cache.cache_clear()
