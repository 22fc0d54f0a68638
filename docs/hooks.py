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
