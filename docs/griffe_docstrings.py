"""A griffe extension that reads tdfunc's docstrings as they are written for ``help()``.

tdfunc's docstrings follow the Google style, with habits that read well in ``help()`` but that
griffe would reject (a warning, so a failed strict build) or mkdocstrings would render
literally:

* ``Example:`` (singular) heads the runnable examples; griffe's Google parser knows only
  ``Examples:``, and would render the doctest as quoted text. It becomes ``Examples:``.
* ``#:`` comments above a module-level constant document it (Sphinx's convention); griffe
  reads only a string below the assignment.
* One ``Args:`` entry may describe several parameters (``compile, backend: ...``); griffe
  wants one entry per parameter, so the entry is repeated for each name.
* A ``Raises:`` section may end an entry with a line of prose at the entries' indent (``All
  are raised on every rank.``); it is read as the continuation of the entry above it.
* Sphinx roles (``:func:`save```, ``:class:`~tdfunc.TensorDict```, ``:data:`X```...) become
  inline code linked to the object's reference entry when it has one (an *optional*
  cross-reference: a name that is not rendered anywhere stays plain code, without a warning).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_SECTION = re.compile(
    r"^(\s*)(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters"
    r"|Raises|Exceptions):\s*$"
)
_ENTRY = re.compile(r"^\s*[\w.*]+(?:\s*,\s*[\w.*]+)*\s*(?:\([^)]*\))?:")
_MULTI = re.compile(r"^(\s*)(\**\w+(?:\s*,\s*\**\w+)+):(.*)$")
_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj|const):`(~?)([^`<>]+)`")


def _identifier(obj: Any, target: str) -> str | None:
    """The full dotted path ``target`` names in the scope of ``obj`` (None if unknown)."""
    target = target.lstrip(".")
    if target.startswith("tdfunc.") or target == "tdfunc":
        return target
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, griffe.AliasResolutionError):
        return None
    return f"{path}.{rest}" if rest else path


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_entries(text: str) -> str:
    """Repeat an ``a, b: description`` entry of a parameter section once per name; in a
    ``Raises:`` section, a line of prose between entries continues the entry above it."""
    lines = text.splitlines()
    out: list[str] = []
    section: int | None = None  # indent of the current parameter section's title
    raises = False
    item: int | None = None  # indent of its entries
    i = 0
    while i < len(lines):
        line = lines[i]
        title = _SECTION.match(line)
        if title:
            section, item = len(title.group(1)), None
            raises = title.group(2) in ("Raises", "Exceptions")
            out.append(line)
            i += 1
            continue
        if section is not None and line.strip():
            if _indent(line) <= section:
                section, item, raises = None, None, False
            elif item is None:
                item = _indent(line)
        entry_line = item is not None and line.strip() and _indent(line) == item
        if raises and entry_line and not _ENTRY.match(line) and out:
            out.append(" " * 4 + line)  # prose in a Raises section: continues the entry above
            i += 1
            continue
        multi = _MULTI.match(line) if section is not None and not raises else None
        if multi and _indent(line) == item:
            body = [multi.group(3)]
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > item):
                body.append("\n" + lines[j])
                j += 1
            while len(body) > 1 and not body[-1].strip():  # blank lines stay after the entry
                body.pop()
                j -= 1
            for name in re.split(r"\s*,\s*", multi.group(2)):
                out.append(f"{multi.group(1)}{name}:" + "".join(body))
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _rewrite(obj: Any, text: str) -> str:
    text = _split_entries(_EXAMPLE.sub(r"\1Examples:", text))

    def role(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if tilde else target.lstrip(".")
        identifier = _identifier(obj, target)
        if identifier is None:
            return f"`{shown}`"
        return (
            f'<autoref identifier="{html.escape(identifier)}" optional>'
            f"<code>{html.escape(shown)}</code></autoref>"
        )

    return _ROLE.sub(role, text)


def _comment_above(attr: Any) -> str | None:
    """The ``#:`` comment lines right above ``attr``'s assignment, joined (None if none)."""
    if attr.lineno is None or attr.filepath is None:
        return None
    lines = attr.lines_collection[attr.filepath]
    found: list[str] = []
    i = attr.lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        found.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(found) or None


class Docstrings(griffe.Extension):
    """Rewrite ``Example:`` sections and Sphinx roles of every docstring of a loaded package."""

    def on_attribute_instance(self, *, attr: griffe.Attribute, **kwargs: Any) -> None:
        if attr.docstring is None and (comment := _comment_above(attr)):
            attr.docstring = griffe.Docstring(comment, lineno=attr.lineno, parent=attr)

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        stack: list[Any] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj, obj.docstring.value)
            stack.extend(m for m in obj.members.values() if not m.is_alias)
