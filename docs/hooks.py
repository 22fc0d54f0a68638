"""MkDocs hooks of the documentation site (``hooks:`` in ``mkdocs.yml``).

The API reference is generated, not written: one page per public package of tdfunc (the
package itself and every public subpackage or module with a non-empty ``__all__``), with one
entry per name of its ``__all__``, in that order (the top-level page groups them under the
titles of :data:`SECTIONS`). A new public package gets its page, and a new public name its
entry, with no edit here. ``__all__`` is read from the source (``ast``),
so the build imports neither torch nor tdfunc; ``tests/test_docs.py`` checks that it equals the
imported ``__all__`` and that every name has a page entry (without MkDocs installed).

At build time every rendered name must also have a docstring: a name without one is logged
as a warning, which ``mkdocs build --strict`` turns into a failure.

The benchmark report (``compile_benchmarks/RESULTS.md``, its ``README.md`` and
``ratios.png``) is added to the site as it is in the repository, under ``benchmarks/``;
heading anchors follow GitHub's rule, so its links between the two files work on the site.
"""

from __future__ import annotations

import ast
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tdfunc"
REFERENCE_DIR = "reference"
NAV_TITLE = "API reference"
#: repository files published as they are: site path -> repository path
BENCHMARK_FILES = {
    "benchmarks/README.md": "compile_benchmarks/README.md",
    "benchmarks/RESULTS.md": "compile_benchmarks/RESULTS.md",
    "benchmarks/ratios.png": "compile_benchmarks/ratios.png",
}

#: sections of the top-level page: (title, names). Names of ``tdfunc.__all__`` that are not
#: listed here are still rendered, under "More" (so a new name is never left out).
SECTIONS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    PACKAGE: (
        (
            "Containers",
            ("TensorDict", "Container", "is_container", "tensorclass", "is_tensorclass"),
        ),
        (
            "Building and combining",
            ("stack", "cat", "zeros_like", "ones_like", "empty_like", "full_like"),
        ),
        (
            "Modules and torch.func",
            ("from_module", "functional_call", "state_dict", "stack_modules"),
        ),
        ("Compiling and donation", ("compile",)),
        ("Control flow and export", ("cond", "while_loop", "scan", "dynamic_batch_shapes")),
        ("Storage on disk", ("save", "load", "memmap_like", "MemoryMappedTensor")),
        (
            "Interop",
            ("save_safetensors", "load_safetensors", "from_tensordict", "to_tensordict"),
        ),
        (
            "Errors and warnings",
            (
                "StructureError",
                "KeysDifferError",
                "DonatedError",
                "NodeTypesDifferError",
                "MemmapFormatError",
                "StoreReplacedError",
                "StoreCleanupWarning",
                "SafetensorsFormatError",
            ),
        ),
        ("Constants", ("OPTREE_NAMESPACE", "__version__")),
    ),
}

#: classes whose entry also shows the public members they inherit from tdfunc's own classes
#: (``TensorDict``'s methods are mostly ``Container``'s: without this the page shows ten)
INHERITED = frozenset({f"{PACKAGE}.TensorDict"})

log = logging.getLogger("mkdocs.plugins.tdfunc_reference")


# ----------------------------------------------------------------------------------------
# the reference pages (pure functions: used by the build and by tests/test_docs.py)
# ----------------------------------------------------------------------------------------
def source_of(module: str, root: Path = ROOT) -> Path | None:
    """The source file of ``module`` (a dotted name under ``root``), or None."""
    base = root.joinpath(*module.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def static_all(module: str, root: Path = ROOT) -> list[str] | None:
    """``module.__all__`` read from its source without importing it (None when absent)."""
    path = source_of(module, root)
    if path is None:
        return None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [str(x) for x in ast.literal_eval(value)]
    return None


def public_packages(root: Path = ROOT) -> list[str]:
    """``tdfunc`` and each public subpackage or module of it with a non-empty ``__all__``."""
    found = [PACKAGE]
    for path in sorted((root / PACKAGE).iterdir()):
        name = path.name.removesuffix(".py")
        if name.startswith(("_", ".")) or not (path.is_dir() or path.suffix == ".py"):
            continue
        module = f"{PACKAGE}.{name}"
        if static_all(module, root):
            found.append(module)
    return found


def page_path(module: str) -> str:
    """Where the reference page of ``module`` lives in the site's sources."""
    return f"{REFERENCE_DIR}/{module}.md"


def reference_page(module: str, root: Path = ROOT) -> str:
    """The Markdown of ``module``'s reference page: its docstring, then each ``__all__`` name
    (a ``::: name`` block), in the page's sections if it has some (see :data:`SECTIONS`),
    public subpackages as links to their own pages."""
    names = static_all(module, root) or []
    packages = set(public_packages(root))
    subpackages = [n for n in names if f"{module}.{n}" in packages]
    objects = [n for n in names if n not in subpackages]
    lines = [
        f"# `{module}`",
        "",
        f"::: {module}",
        "    options:",
        "      members: false",
        "      show_root_heading: false",
        "      show_root_toc_entry: false",
        "",
    ]
    sections = SECTIONS.get(module)
    if sections:
        placed = [n for _, members in sections for n in members]
        groups = [(title, [n for n in members if n in objects]) for title, members in sections]
        groups.append(("More", [n for n in objects if n not in placed]))
        for title, members in groups:
            if members:
                lines += [f"## {title}", ""]
                for name in members:
                    lines += [f"::: {module}.{name}", "    options:", "      heading_level: 3"]
                    if f"{module}.{name}" in INHERITED:
                        lines.append("      inherited_members: true")
                    lines.append("")
    else:
        for name in objects:
            lines += [f"::: {module}.{name}", ""]
    if subpackages:
        lines += ["## Subpackages", ""]
        lines += [f"- [`{module}.{n}`]({module}.{n}.md): its own page" for n in subpackages]
        lines.append("")
    return "\n".join(lines)


def _classes(root: Path = ROOT) -> dict[str, ast.ClassDef]:
    """Every class defined in the package's sources, by name (read with ``ast``)."""
    out: dict[str, ast.ClassDef] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def class_members(name: str, root: Path = ROOT) -> list[str]:
    """The public members the reference shows for class ``name``: its own methods and
    properties and, for :data:`INHERITED` classes, those of its bases defined in tdfunc."""
    classes = _classes(root)
    out: list[str] = []
    todo = [name]
    while todo:
        cls = classes.get(todo.pop(0))
        if cls is None:
            continue
        for node in cls.body:
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not node.name.startswith("_")
                and node.name not in out
            ):
                out.append(node.name)
        if f"{PACKAGE}.{name}" in INHERITED:
            todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return out


_LINK = re.compile(r"^- \[`([\w.]+)`\]\(\1\.md\)")


def rendered_names(page: str) -> list[str]:
    """The dotted names a reference page documents: its ``::: name`` blocks (but the page's
    own package) and its links to the pages of subpackages."""
    title = re.match(r"# `([\w.]+)`", page)
    own = title.group(1) if title else None
    out = []
    for line in page.splitlines():
        if line.startswith("::: ") and line[4:].strip() != own:
            out.append(line[4:].strip())
        elif link := _LINK.match(line):
            out.append(link.group(1))
    return out


def github_slug(value: str, separator: str) -> str:
    """GitHub's heading anchors: lower case, punctuation dropped, each space one ``-``."""
    value = re.sub(r"[^\w\- ]", "", value.strip().lower())
    return value.replace(" ", separator)


# ----------------------------------------------------------------------------------------
# the code the guides show: inlined from examples/ (read on GitHub too), checked in sync
# ----------------------------------------------------------------------------------------
#: the comment that names where the fenced block after it comes from: a whole example
#: (``examples/x.py``) or a marked region of it (``examples/x.py:name``, between the lines
#: ``# --8<-- [start:name]`` and ``# --8<-- [end:name]``)
CODE_MARKER = re.compile(r"^<!-- code: (examples/[a-z_]+\.py(?::[\w-]+)?) .*-->$")
CODE_COMMENT = "<!-- code: {ref} (written by `python docs/hooks.py`; do not edit the block) -->"
#: a fenced include (``--8<-- "examples/x.py:name"``) as pymdownx.snippets wrote it: ``sync``
#: turns it into an inlined block
_INCLUDE = re.compile(r'^```(\w*)\n--8<-- "([^"]+)"\n```$', re.MULTILINE)
_REGION = re.compile(r"^\s*# --8<-- \[(start|end):([\w-]+)\]\s*$")


def example_code(ref: str, root: Path = ROOT) -> str:
    """The code ``ref`` names (``examples/x.py`` or ``examples/x.py:region``) as a guide shows
    it: the region dedented, marker lines dropped, no trailing blank lines.

    Raises:
        ValueError: ``ref`` names a region the file does not mark (exactly once).
    """
    path, _, region = ref.partition(":")
    lines = (root / path).read_text(encoding="utf-8").splitlines()
    if region:
        starts = [
            i for i, line in enumerate(lines) if _REGION.match(line) and f"[start:{region}]" in line
        ]
        ends = [
            i for i, line in enumerate(lines) if _REGION.match(line) and f"[end:{region}]" in line
        ]
        if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
            raise ValueError(f"{path} does not mark region {region!r} once (start/end lines)")
        lines = lines[starts[0] + 1 : ends[0]]
    lines = [line for line in lines if not _REGION.match(line)]
    text = textwrap.dedent("\n".join(lines)).strip("\n")
    if any(line.startswith("```") for line in text.splitlines()):
        raise ValueError(f"{ref}: a line starts with ``` (it would end the guide's code block)")
    return text


def code_blocks(page: str) -> list[tuple[str, str, str]]:
    """(ref, language, code) of every inlined block of ``page`` (a marker comment, then a
    fenced block on the next line)."""
    out = []
    lines = page.splitlines()
    for i, line in enumerate(lines):
        marker = CODE_MARKER.match(line)
        if marker is None:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        if not fence.startswith("```"):
            raise ValueError(f"{marker.group(1)}: the marker is not followed by a code block")
        end = lines.index("```", i + 2)
        out.append((marker.group(1), fence[3:].strip(), "\n".join(lines[i + 2 : end])))
    return out


def sync_page(page: str, root: Path = ROOT) -> str:
    """``page`` with every inlined block rewritten from its example, and every fenced
    ``--8<--`` include turned into an inlined block (what ``python docs/hooks.py`` writes)."""

    def inline(ref: str, lang: str) -> str:
        return f"{CODE_COMMENT.format(ref=ref)}\n```{lang}\n{example_code(ref, root)}\n```"

    page = _INCLUDE.sub(lambda m: inline(m.group(2), m.group(1) or "python"), page)
    lines = page.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        marker = CODE_MARKER.match(lines[i])
        if marker is None:
            out.append(lines[i])
            i += 1
            continue
        end = lines.index("```", i + 2)
        lang = lines[i + 1][3:].strip() or "python"
        out.append(inline(marker.group(1), lang))
        i = end + 1
    return "\n".join(out)


def out_of_sync(root: Path = ROOT) -> list[str]:
    """The pages (paths relative to ``root``) whose code differs from their examples."""
    return [
        path.relative_to(root).as_posix()
        for path in markdown_pages(root)
        if sync_page(text := path.read_text(encoding="utf-8"), root) != text
    ]


def markdown_pages(root: Path = ROOT) -> list[Path]:
    """The pages that show code: the site's Markdown and the README."""
    return [*sorted((root / "docs").rglob("*.md")), root / "README.md"]


# ----------------------------------------------------------------------------------------
# versions: the pages say what pyproject.toml says
# ----------------------------------------------------------------------------------------
def supported_versions(root: Path = ROOT) -> tuple[str, str]:
    """(``requires-python``, the ``torch`` requirement) of ``pyproject.toml``, e.g.
    ``(">=3.10", ">=2.13,<2.16")``."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    python = re.search(r'^requires-python = "([^"]+)"', text, re.MULTILINE)
    torch = re.search(r'^dependencies = \[[^\]]*"torch([^"]+)"', text, re.MULTILINE)
    if python is None or torch is None:
        raise ValueError("pyproject.toml: no requires-python or no torch dependency found")
    return python.group(1), torch.group(1)


_CLAIMS = (
    # (what, pattern: group 1 is the claimed lower bound or range)
    ("torch", re.compile(r"(?:PyTorch|torch) (\d+\.\d+)(?:\.\d+)? or (?:newer|later)")),
    ("torch", re.compile(r"(?:PyTorch|torch) (>=\s*\d+\.\d+)(?:\.\d+)?(?![\d.,])")),
    ("torch range", re.compile(r"torch\s*(>=\s*[\d.]+\s*,\s*<\s*[\d.]+)")),
    ("python", re.compile(r"Python (\d+\.\d+) or (?:newer|later)")),
    ("python", re.compile(r"Python\s*(>=\s*\d+\.\d+)")),
)


def version_mismatches(text: str, root: Path = ROOT) -> list[str]:
    """The version claims in ``text`` that pyproject.toml does not make: a minimum Python or
    torch other than its lower bound, a torch range other than its own."""
    python, torch = supported_versions(root)
    lower = {"python": python.removeprefix(">="), "torch": torch.split(",")[0].removeprefix(">=")}
    bad = []
    for what, pattern in _CLAIMS:
        for match in pattern.finditer(text):
            claim = re.sub(r"\s+", "", match.group(1))
            ok = (
                claim == torch if what == "torch range" else claim.removeprefix(">=") == lower[what]
            )
            if not ok:
                bad.append(f"{match.group(0)!r} (pyproject.toml: Python {python}, torch{torch})")
    return bad


# ----------------------------------------------------------------------------------------
# MkDocs events
# ----------------------------------------------------------------------------------------
def on_config(config: Any) -> Any:
    """Fill the (empty) "API reference" entry of the nav with one page per package, and
    make heading anchors GitHub's."""
    config["mdx_configs"].setdefault("toc", {})["slugify"] = github_slug
    pages = [{module: page_path(module)} for module in public_packages()]
    for item in config["nav"] or []:
        if isinstance(item, dict) and NAV_TITLE in item:
            item[NAV_TITLE] = pages
            break
    else:
        log.warning("mkdocs.yml has no %r nav entry to fill", NAV_TITLE)
    return config


def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages and the benchmark report to the site."""
    from mkdocs.structure.files import File

    for module in public_packages():
        files.append(File.generated(config, page_path(module), content=reference_page(module)))
    for uri, source in BENCHMARK_FILES.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    _check_docstrings()
    return files


def _check_docstrings() -> None:
    """Log a warning (a failure under ``--strict``) for each public name without a docstring."""
    import griffe

    # read the docstrings as the reference reads them (mkdocs.yml loads the same extension)
    extension = f"{Path(__file__).with_name('griffe_docstrings.py')}:Docstrings"
    loader = griffe.GriffeLoader(
        search_paths=[str(ROOT)], extensions=griffe.load_extensions(extension)
    )
    loader.load(PACKAGE)
    loader.resolve_aliases(implicit=False, external=False)
    top = loader.modules_collection[PACKAGE]
    packages = set(public_packages())
    for module in packages:
        obj = top if module == PACKAGE else top[module.removeprefix(PACKAGE + ".")]
        for name in static_all(module) or []:
            if f"{module}.{name}" in packages:
                continue
            try:
                member = obj[name]
                doc = member.docstring
            except (KeyError, griffe.AliasResolutionError):
                log.warning("%s.%s: in __all__ but not found by griffe", module, name)
                continue
            if doc is None or not doc.value.strip():
                log.warning("%s.%s: public name without a docstring", module, name)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Warn (fail, under ``--strict``) when a page's code differs from its example or a page
    claims a Python or torch version other than pyproject.toml's."""
    if sync_page(markdown) != markdown:
        log.warning(
            "%s: code differs from examples/ (run `python docs/hooks.py`)", page.file.src_uri
        )
    for claim in version_mismatches(markdown):
        log.warning("%s: %s", page.file.src_uri, claim)
    return markdown


if __name__ == "__main__":  # python docs/hooks.py: rewrite the guides' code from examples/
    for path in markdown_pages():
        text = path.read_text(encoding="utf-8")
        new = sync_page(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {path.relative_to(ROOT)}")
