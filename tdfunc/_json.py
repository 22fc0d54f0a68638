"""JSON read from a file or a peer: one reading for every reader.

JSON readers disagree on a key given twice in one object (Python's keeps the last one,
others the first, some refuse), a classic parser-differential hole: two tools reading the
same manifest would see different data. tdfunc refuses such input wherever it parses a
format of its own (store manifests, checkpoint manifests and pointers, transfer metadata).
"""

from __future__ import annotations

import json
from typing import Any


def loads_unique(text: str | bytes, duplicate: str) -> Any:
    """``json.loads(text)``; a key given twice in one object raises ``ValueError``
    (``duplicate``, formatted with ``key``), never a ``JSONDecodeError``.

    Example:
        >>> loads_unique('{"a": 1}', "key {key!r} twice")
        {'a': 1}
        >>> loads_unique('{"a": 1, "a": 2}', "key {key!r} twice")
        Traceback (most recent call last):
        ...
        ValueError: key 'a' twice
    """

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ValueError(duplicate.format(key=k))
            out[k] = v
        return out

    return json.loads(text, object_pairs_hook=unique)
