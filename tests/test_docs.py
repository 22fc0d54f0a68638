"""The documentation site's sources (docs/, mkdocs.yml): the API reference covers every public
name, the guides show only code that runs, and the troubleshooting page says what torch does.

Runs without MkDocs (the ``docs`` extra is not part of the test set-up): the reference pages
come from ``docs/hooks.py``, which needs only the standard library. ``make docs`` builds the
site in strict mode on top of this (CI runs both).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import tdfunc
from tdfunc import _errors as E

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("tdfunc_docs_hooks", DOCS / "hooks.py")
PACKAGES = hooks.public_packages()


def _defined(cls: type, name: str) -> Any:
    """The attribute ``name`` as the class that defines it holds it (a function, property,
    classmethod)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return vars(klass)[name]
    raise AttributeError(name)


def _from_op_table(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is a method installed from the op table (generated, one docstring
    for all: covered per family by the doctested example of ``Container``'s docstring)."""
    obj = _defined(cls, name)
    return (
        getattr(obj, "__module__", None) == "tdfunc._ops._lift"
        and getattr(obj, "__qualname__", None) == f"Container.{name}"
    )


def test_reference_shows_every_public_method_of_tensordict():
    """TensorDict's entry lists its own and its inherited (Container) methods: as many as
    the class has public names (but the methods installed from the op table, which
    Container's entry describes by family)."""
    runtime = sorted(
        n
        for n in dir(tdfunc.TensorDict)
        if not n.startswith("_") and not _from_op_table(tdfunc.TensorDict, n)
    )
    shown = hooks.class_members("TensorDict")
    assert sorted(shown) == runtime
    assert len(shown) >= 59  # apply, select, reshape, to, sum, at, ... (10 without inheritance)
    page = hooks.reference_page("tdfunc")
    entry = page[page.index("::: tdfunc.TensorDict") :].split("\n\n")[0]
    assert "inherited_members: true" in entry
    for name in shown:
        doc = inspect.getdoc(getattr(tdfunc.TensorDict, name))
        assert doc, f"TensorDict.{name} has no docstring"


# --------------------------------------------------------------------------------------
# every public method has an example that a doctest runs (make test: --doctest-modules)
# --------------------------------------------------------------------------------------
def _hand_written_members() -> list[tuple[str, Any]]:
    """(qualified name, attribute) of every public method and property that tdfunc's own
    container classes define by hand: Container, TensorDict, and the base of every
    tensorclass (whose methods each tensorclass shares)."""
    from tdfunc._tensorclass._class import _TensorClass

    out = []
    for cls in (tdfunc.Container, tdfunc.TensorDict, _TensorClass):
        for name, obj in vars(cls).items():
            if name.startswith("_") or _from_op_table(cls, name):
                continue
            if isinstance(obj, (property, staticmethod, classmethod)) or inspect.isfunction(obj):
                out.append((f"{cls.__name__}.{name}", obj))
    return out


def _has_example(obj: Any) -> bool:
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return ">>>" in (inspect.getdoc(fn) or "")


def test_every_hand_written_public_method_has_a_doctested_example():
    members = _hand_written_members()
    assert len(members) >= 80
    missing = [name for name, obj in members if not _has_example(obj)]
    assert missing == [], f"public methods without an Examples: section (>>>): {missing}"


def test_every_op_table_family_has_a_doctested_example():
    # the methods installed from the op table (td.exp(), td.cumsum(0), ...) share one
    # generated docstring; Container's docstring shows one doctested call per family
    from tdfunc._ops import _batchdim, _lift, _pointwise

    installed = {n for n in dir(tdfunc.Container) if _from_op_table(tdfunc.Container, n)}
    assert installed, "no method installed from the op table"
    assert installed <= set(_lift.METHODS)
    doc = inspect.getdoc(tdfunc.Container) or ""
    called = {
        m for line in doc.splitlines() if ">>>" in line for m in re.findall(r"\.(\w+)\(", line)
    }
    for family in (_pointwise.METHODS, _batchdim.METHODS):
        assert called & installed & set(family), sorted(set(family) & installed)[:5]


def _public_docstrings() -> list[tuple[str, str]]:
    out = []
    for module_name in PACKAGES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, ModuleType):
                continue
            out.append((f"{module_name}.{name}", inspect.getdoc(obj) or ""))
            if inspect.isclass(obj) and obj.__module__.startswith("tdfunc"):
                for member in dir(obj):
                    if member.startswith("_"):
                        continue
                    doc = inspect.getdoc(getattr(obj, member, None))
                    out.append((f"{module_name}.{name}.{member}", doc or ""))
    return out


def test_reference_links_to_no_private_name():
    """No docstring the reference renders sends the reader to a private module."""
    private = re.compile(r"tdfunc(\.\w+)*\._\w")
    found = [
        f"{where}: {m.group(0)}"
        for where, doc in _public_docstrings()
        for m in [private.search(doc)]
        if m
    ]
    assert not found, found


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


# --------------------------------------------------------------------------------------
# the API reference
# --------------------------------------------------------------------------------------
def test_reference_has_a_page_for_every_public_package():
    found = ["tdfunc"]
    for info in pkgutil.iter_modules(tdfunc.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"tdfunc.{info.name}")
        if getattr(module, "__all__", None):
            found.append(module.__name__)
    assert ["tdfunc", *sorted(found[1:])] == PACKAGES
    assert {"tdfunc", "tdfunc.nn", "tdfunc.distributed", "tdfunc.testing"} <= set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_static_all_is_the_imported_all(package):
    # the build reads __all__ from the source without importing torch
    assert hooks.static_all(package) == list(importlib.import_module(package).__all__)


@pytest.mark.parametrize("package", PACKAGES)
def test_reference_page_renders_every_name_once(package):
    page = hooks.reference_page(package)
    rendered = hooks.rendered_names(page)
    expected = [f"{package}.{name}" for name in importlib.import_module(package).__all__]
    assert sorted(rendered) == sorted(expected)
    assert page.startswith(f"# `{package}`")
    assert f"::: {package}\n" in page  # the package docstring heads the page


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_function_and_class_has_a_docstring(package):
    # (constants are documented by a ``#:`` comment: checked by the strict build)
    module = importlib.import_module(package)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, ModuleType):
            continue
        if inspect.isclass(obj):
            doc = vars(obj).get("__doc__")
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            doc = obj.__doc__
        else:
            continue
        if not (doc or "").strip():
            missing.append(name)
    assert missing == []


def test_reference_page_of_a_new_package(tmp_path):
    # a public package that appears later gets its page with no edit of the hook
    pkg = tmp_path / "tdfunc" / "newpkg"
    pkg.mkdir(parents=True)
    (tmp_path / "tdfunc" / "__init__.py").write_text('__all__ = ["newpkg", "f"]\n')
    (pkg / "__init__.py").write_text('"""New."""\n__all__ = ["g", "h"]\n')
    (tmp_path / "tdfunc" / "_private.py").write_text('__all__ = ["x"]\n')
    (tmp_path / "tdfunc" / "empty.py").write_text("__all__: list[str] = []\n")
    assert hooks.public_packages(tmp_path) == ["tdfunc", "tdfunc.newpkg"]
    page = hooks.reference_page("tdfunc.newpkg", tmp_path)
    assert hooks.rendered_names(page) == ["tdfunc.newpkg.g", "tdfunc.newpkg.h"]
    top = hooks.reference_page("tdfunc", tmp_path)
    # tdfunc's page has sections; a name in no section lands under "More", a package is linked
    assert sorted(hooks.rendered_names(top)) == ["tdfunc.f", "tdfunc.newpkg"]
    assert "## More" in top
    assert "(tdfunc.newpkg.md)" in top


# --------------------------------------------------------------------------------------
# pages and navigation
# --------------------------------------------------------------------------------------
def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") : text.index("\nmarkdown_extensions:")]
    return re.findall(r":\s+(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def test_nav_lists_every_page_and_only_existing_ones():
    nav = _nav_pages()
    written = [p.relative_to(DOCS).as_posix() for p in _pages()]
    assert sorted(p for p in nav if p not in hooks.BENCHMARK_FILES) == sorted(written)
    for uri, source in hooks.BENCHMARK_FILES.items():
        assert (ROOT / source).is_file(), source
        assert uri in nav or not uri.endswith(".md")
    assert f"  - {hooks.NAV_TITLE}: []" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _snippets(page: Path) -> list[tuple[str, str]]:
    """(language, example reference) of every code block; asserts every Python block is
    inlined from an example (a ``<!-- code: examples/... -->`` marker right above it)."""
    text = page.read_text(encoding="utf-8")
    blocks = hooks.code_blocks(text)
    inlined = {code for _, _, code in blocks}
    for lang, body in _FENCE.findall(text):
        if lang in ("python", "py", "pycon", ""):
            assert body.rstrip("\n") in inlined, (
                f"{page.name}: hand-written Python in a code block: {body.splitlines()[:2]}"
            )
    return [(lang, ref) for ref, lang, _ in blocks]


def _shown_pages() -> list[Path]:
    return [*_pages(), ROOT / "README.md"]


@pytest.mark.parametrize("page", _shown_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_in_pages_is_the_code_of_examples_that_run(page):
    # every Python block is inlined (it reads on GitHub and in the clone) from an example run
    # by `make demo` (examples/*.py), whole or a marked region, and equals that code today
    text = page.read_text(encoding="utf-8")
    assert "--8<--" not in text, f"{page.name}: an include shows as text outside the site"
    for ref, _, code in hooks.code_blocks(text):
        path, _, section = ref.partition(":")
        assert re.fullmatch(r"examples/[a-z_]+\.py", path), ref
        source = (ROOT / path).read_text(encoding="utf-8")
        if section:
            assert f"# --8<-- [start:{section}]" in source, ref
            assert f"# --8<-- [end:{section}]" in source, ref
        assert code == hooks.example_code(ref), (
            f"{page.name}: the block of {ref} differs from the example: run python docs/hooks.py"
        )
    assert hooks.sync_page(text) == text


def test_every_guide_shows_running_code():
    for page in _pages():
        if page.parent.name == "guides" and page.stem != "performance":
            assert _snippets(page), f"{page.name} includes no example"


def test_readme_links_guides_that_show_their_code():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = re.findall(r"\]\((docs/guides/[a-z-]+\.md)\)", readme)
    assert len(linked) >= 8
    for rel in linked:
        page = ROOT / rel
        if page.stem != "performance":
            assert hooks.code_blocks(page.read_text(encoding="utf-8")), rel


def test_sync_inlines_an_include_and_refreshes_a_stale_block(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "demo.py").write_text(
        "import x\n\nif True:\n    # --8<-- [start:part]\n    y = 1\n    # --8<-- [end:part]\n",
        encoding="utf-8",
    )
    include = 'Text.\n\n```python\n--8<-- "examples/demo.py:part"\n```\n'
    synced = hooks.sync_page(include, tmp_path)
    marker = hooks.CODE_COMMENT.format(ref="examples/demo.py:part")
    assert synced == f"Text.\n\n{marker}\n```python\ny = 1\n```\n"
    assert hooks.code_blocks(synced) == [("examples/demo.py:part", "python", "y = 1")]
    stale = synced.replace("y = 1", "y = 2")
    assert hooks.sync_page(stale, tmp_path) == synced
    whole = hooks.sync_page('```python\n--8<-- "examples/demo.py"\n```', tmp_path)
    assert "import x" in whole
    assert "--8<--" not in whole
    with pytest.raises(ValueError, match="does not mark region 'nope'"):
        hooks.example_code("examples/demo.py:nope", tmp_path)


# --------------------------------------------------------------------------------------
# versions: every page says what pyproject.toml says
# --------------------------------------------------------------------------------------
def test_hooks_read_the_versions_pyproject_declares():
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch_req,) = [d for d in meta["dependencies"] if d.startswith("torch")]
    assert hooks.supported_versions() == (meta["requires-python"], torch_req[len("torch") :])


@pytest.mark.parametrize("page", _shown_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_pages_claim_the_versions_of_pyproject(page):
    assert hooks.version_mismatches(page.read_text(encoding="utf-8")) == []


def test_version_check_catches_a_wrong_claim():
    bad = hooks.version_mismatches(
        "needs Python 3.9 or newer and PyTorch 2.6 or newer (torch>=2.6,<2.16)"
    )
    assert len(bad) == 3
    assert hooks.version_mismatches("Python 3.11 or newer, torch>=2.13,<2.16") == []


# --------------------------------------------------------------------------------------
# what the troubleshooting page says torch does
# --------------------------------------------------------------------------------------
def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_compiled_error_reads_as_documented_and_force_eager_gives_the_plain_one():
    td = tdfunc.TensorDict(obs=torch.zeros(4, 3), batch_size=[4])

    def policy(td):
        return td["observation"].sum(-1)

    compiled = torch.compile(policy, fullgraph=True, backend="eager")
    message = E.MISSING_KEY.format(key="observation", cls="TensorDict", available=["obs"])
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        compiled(td)
    text = str(info.value)
    page = _page("troubleshooting.md")
    for phrase in ("Observed exception", "Developer debug context", "from user code"):
        assert phrase in text
        assert phrase in page
    assert text.startswith("Observed exception")
    assert f"raised exception KeyError({message!r})" in text
    assert message in str(info.value.__cause__)
    assert 'set_stance("force_eager")' in page

    with torch.compiler.set_stance("force_eager"), pytest.raises(KeyError) as plain:
        compiled(td)
    assert plain.value.args == (message,)
    # the stance ends with the block: compiled again afterwards
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compiled(td)


def test_load_state_dict_with_a_container_is_as_documented():
    model = nn.Linear(3, 2)
    params = tdfunc.from_module(model) * 0.5
    with pytest.raises(TypeError, match="Expected state_dict to be dict-like") as info:
        model.load_state_dict(params)
    assert "Expected state_dict to be dict-like" in _page("troubleshooting.md")
    assert str(info.value).startswith("Expected state_dict to be dict-like")
    model.load_state_dict(tdfunc.state_dict(model, params))
    assert torch.equal(model.weight, params["weight"])
    assert "tdfunc.state_dict(module, params)" in _page("troubleshooting.md")


# --------------------------------------------------------------------------------------
# the docstring rewriting of the reference (needs griffe: installed by the docs extra)
# --------------------------------------------------------------------------------------
def test_docstring_rewriting():
    pytest.importorskip("griffe")
    ext = _load("tdfunc_docs_griffe", DOCS / "griffe_docstrings.py")
    text = (
        "Do it.\n\n"
        "Args:\n"
        "    x: the input.\n"
        "    y: first.\n"
        "    compile, backend: for the graphs\n"
        "        (see redistribute).\n\n"
        "Raises:\n"
        "    KeyError: missing.\n"
        "    Also raised on every rank.\n\n"
        "Example:\n"
        "    >>> 1 + 1\n"
        "    2\n"
    )
    out = ext._split_entries(ext._EXAMPLE.sub(r"\1Examples:", text))
    assert out == (
        "Do it.\n\n"
        "Args:\n"
        "    x: the input.\n"
        "    y: first.\n"
        "    compile: for the graphs\n"
        "        (see redistribute).\n"
        "    backend: for the graphs\n"
        "        (see redistribute).\n\n"
        "Raises:\n"
        "    KeyError: missing.\n"
        "        Also raised on every rank.\n\n"
        "Examples:\n"
        "    >>> 1 + 1\n"
        "    2"
    )
    assert hooks.github_slug(
        "replay sampling: tdfunc time <= 1.0x numpy (rows/s >= numpy)", "-"
    ) == ("replay-sampling-tdfunc-time--10x-numpy-rowss--numpy")
