"""torch's aliases lift as the function they name: ``torch.divide`` as ``torch.div``.

torch documents each alias in its docstring (``Alias for :func:`torch.div`.`` on
``torch.divide``; ``torch.arccos``, ``torch.greater``, ``torch.clip``, ``torch.swapaxes``,
``torch.special.psi`` ...), and each ``Tensor`` method points at its function (``See
:func:`torch.divide```). ATen registers most aliases as compositions without the pointwise
tag, so the tag rule alone misses them. Read once at import from those docstrings (never a
hand list): an alias takes the rule of the function it names, whatever its family.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

_ALIAS = re.compile(r"Alias for :(?:func|meth):`~?(?:torch\.)?([\w.]+)`")
_SEE = re.compile(r"^\s*See :func:`~?torch\.([\w.]+)`\.?\s*$", re.MULTILINE)


def _resolve(path: str) -> Any:
    """``torch.<path>`` (``"div"``, ``"special.expit"``, ``"nn.functional.softmax"``), or
    ``None``."""
    obj: Any = torch
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _doc(f: Any) -> str:
    d = getattr(f, "__doc__", None)
    return d if isinstance(d, str) else ""


def target_of(f: Any) -> Any:
    """The function ``f`` is an alias of, as torch documents it, or ``None``: a ``Tensor``
    method follows its ``See :func:`torch.x``` first, then each ``Alias for`` in turn.

    Example:
        >>> import torch
        >>> target_of(torch.divide) is torch.div, target_of(torch.Tensor.arccos) is torch.acos
        (True, True)
        >>> target_of(torch.exp) is None
        True
    """
    seen: set[int] = set()
    cur, found = f, None
    while id(cur) not in seen:
        seen.add(id(cur))
        doc = _doc(cur)
        m = _ALIAS.search(doc)
        if m is None:
            see = _SEE.search(doc)
            nxt = _resolve(see.group(1)) if see is not None else None
            if nxt is None or nxt is cur:
                return found
            cur = nxt
            continue
        nxt = _resolve(m.group(1))
        if nxt is None:
            return found
        cur = found = nxt
    return found


def alias_rules(
    table: Mapping[Any, Callable[..., Any]],
) -> tuple[dict[Any, Callable[..., Any]], dict[str, Any]]:
    """Rules for the aliases of the functions of ``table``, and the ``Tensor`` methods among
    them (name -> method), for the container's method table.

    Example:
        >>> import torch
        >>> rules, methods = alias_rules({torch.div: "the rule of div"})
        >>> rules[torch.divide], "divide" in methods
        ('the rule of div', True)
    """
    from ._pointwise import _candidates  # the public torch callables, by namespace

    rules: dict[Any, Callable[..., Any]] = {}
    methods: dict[str, Any] = {}
    for name, f, method in _candidates():
        if f in table or f in rules:
            continue
        target = target_of(f)
        rule = table.get(target) if target is not None else None
        if rule is None:
            continue
        rules[f] = rule
        if method:
            methods[name] = f
    return rules, methods
