#!/usr/bin/env python3
"""CI: the built wheel installs and works in a clean virtual environment.

Builds the sdist and the wheel (``python -m build``; the wheel is built from the sdist, so the
sdist is checked too), then checks the wheel's contents (``py.typed``, the package and nothing
else, the dependencies ``pyproject.toml`` declares) and installs it into a fresh virtual
environment with its declared dependencies only (torch first, at the version the Makefile pins).
From outside the checkout it imports every tdfunc module, runs the README's example (the
``python`` block under the README's ``## Example`` heading, read from README.md), installs the
runtime extras and runs the code that needs each, and resolves the development extras.
Standard library only; every step prints its time.

Usage: ``python3 .ci/wheel_check.py [--keep DIR]`` (``--keep``: work in DIR and leave it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the heading of the README section whose ``python`` block CI runs
EXAMPLE_HEADING = "## Example"
#: runtime extras: installed for real, each with code that needs what it installs
RUNTIME_EXTRAS = ("progress", "safetensors", "tensordict")
#: the code run with the runtime extras installed (in the fresh venv, outside the checkout)
EXTRAS_CHECK = """
import sys, tempfile, torch, tdfunc
td = tdfunc.TensorDict(a=torch.arange(6.0).reshape(3, 2), n={"b": torch.ones(3)}, batch_size=[3])
with tempfile.TemporaryDirectory() as d:
    tdfunc.save(td, d + "/store", progress=True)  # progress: a tqdm bar
    tdfunc.testing.assert_close(tdfunc.load(d + "/store"), td)
    tdfunc.save_safetensors(td, d + "/m.safetensors")  # safetensors: the reference reader
    from safetensors.torch import load_file
    ref = load_file(d + "/m.safetensors")
    assert set(ref) == {"a", "n.b"} and torch.equal(ref["a"], td["a"]), ref
back = tdfunc.from_tensordict(tdfunc.to_tensordict(td))  # tensordict: the conversions
tdfunc.testing.assert_close(back, td)
print("extras ok:", sys.argv[1:])
"""
NO_EXAMPLE = "{path}: no ```python block under a '{heading}' heading"


def readme_example(text: str, path: Path = README) -> str:
    """The code of the first ``python`` block under the README's ``## Example`` heading.

    Example:
        >>> readme_example("# x\\n## Example\\n\\nText.\\n\\n```python\\nprint(1)\\n```\\n")
        'print(1)\\n'
    """
    head = re.search(rf"^{re.escape(EXAMPLE_HEADING)}\s*$", text, re.MULTILINE)
    if head is None:
        raise ValueError(NO_EXAMPLE.format(path=path, heading=EXAMPLE_HEADING))
    section = text[head.end() :]
    end = re.search(r"^## ", section, re.MULTILINE)
    block = re.search(
        r"^```python\n(.*?)^```", section[: end.start() if end else None], re.M | re.S
    )
    if block is None:
        raise ValueError(NO_EXAMPLE.format(path=path, heading=EXAMPLE_HEADING))
    return block.group(1)


def pinned_torch(makefile: Path = ROOT / "Makefile") -> str:
    """The torch requirement the Makefile installs (``TORCH := torch==2.13.0``)."""
    m = re.search(r"^TORCH\s*:=\s*(\S+)", makefile.read_text(encoding="utf-8"), re.MULTILINE)
    if m is None:
        raise ValueError(f"{makefile}: no 'TORCH := ...' line")
    return m.group(1)


def declared(pyproject: Path = ROOT / "pyproject.toml") -> tuple[set[str], dict[str, list[str]]]:
    """The names of the declared dependencies and the extras, as ``pyproject.toml`` says."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return {_name(d) for d in project["dependencies"]}, project["optional-dependencies"]


def _name(requirement: str) -> str:
    """The normalised project name of a requirement (``"torch>=2.13"`` -> ``"torch"``)."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    if m is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(0)).lower()


def wheel_problems(wheel: Path, dependencies: set[str]) -> list[str]:
    """What is wrong with the wheel: no ``py.typed``, files outside the package, or
    unconditional dependencies other than the declared ones."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(meta).decode()
    problems = []
    if "tdfunc/py.typed" not in names:
        problems.append("tdfunc/py.typed is not in the wheel")
    if "tdfunc/__init__.py" not in names:
        problems.append("tdfunc/__init__.py is not in the wheel")
    stray = sorted({n.split("/")[0] for n in names} - {"tdfunc", meta.split("/")[0]})
    if stray:
        problems.append(f"files outside the package: {stray}")
    requires = {
        _name(line.split(":", 1)[1])
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    if requires != dependencies:
        problems.append(f"Requires-Dist {sorted(requires)} != dependencies {sorted(dependencies)}")
    return problems


class Steps:
    """Runs commands, printing each with the seconds it took."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: list[tuple[str, float]] = []

    def run(self, what: str, cmd: Sequence[str | Path], **kw: object) -> str:
        print(f"== {what}: {' '.join(map(str, cmd))}", flush=True)
        t = time.perf_counter()
        out = subprocess.run(
            [str(c) for c in cmd], check=True, text=True, stdout=subprocess.PIPE, **kw
        ).stdout
        self.times.append((what, time.perf_counter() - t))
        print(out[-3000:], end="" if out.endswith("\n") or not out else "\n", flush=True)
        return out

    def summary(self) -> str:
        rows = [f"  {s:6.1f} s  {what}" for what, s in self.times]
        return "\n".join([*rows, f"  {time.perf_counter() - self.t0:6.1f} s  in all"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, default=None, help="work in DIR and leave it")
    args = parser.parse_args(argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="tdfunc-wheel-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    steps = Steps()
    try:
        dependencies, extras = declared()
        example = readme_example(README.read_text(encoding="utf-8"))
        (work / "readme_example.py").write_text(example, encoding="utf-8")
        (work / "extras_check.py").write_text(EXTRAS_CHECK, encoding="utf-8")
        tools, venv, dist = work / "tools", work / "venv", work / "dist"
        for d in (tools, venv, dist):
            shutil.rmtree(d, ignore_errors=True)

        steps.run("tools venv", [sys.executable, "-m", "venv", tools])
        steps.run("install build", [tools / "bin/python", "-m", "pip", "install", "-q", "build"])
        steps.run(
            "build sdist and wheel", [tools / "bin/python", "-m", "build", "--outdir", dist, ROOT]
        )
        (wheel,) = dist.glob("tdfunc-*.whl")
        (sdist,) = dist.glob("tdfunc-*.tar.gz")
        print(f"built {sdist.name} and {wheel.name}")
        problems = wheel_problems(wheel, dependencies)
        if problems:
            raise SystemExit("wheel: " + "; ".join(problems))

        py = venv / "bin/python"
        pip = [py, "-m", "pip"]
        steps.run("fresh venv", [sys.executable, "-m", "venv", venv])
        steps.run("install torch", [*pip, "install", "-q", pinned_torch()])
        steps.run("install the wheel", [*pip, "install", "-q", wheel])
        steps.run("pip check", [*pip, "check"])
        installed = json.loads(steps.run("installed", [*pip, "list", "--format=json"]))
        names = {_name(p["name"]) for p in installed} - {"pip", "setuptools", "wheel"}
        deps_of_torch = names - dependencies - {"tdfunc"}
        print(f"installed besides tdfunc and its dependencies: {sorted(deps_of_torch)}")
        steps.run(
            "import every module",
            [
                py,
                "-c",
                "import importlib, pkgutil, tdfunc; "
                "assert 'site-packages' in tdfunc.__file__, tdfunc.__file__; "
                "mods = [m.name for m in pkgutil.walk_packages(tdfunc.__path__, 'tdfunc.')]; "
                "[importlib.import_module(m) for m in mods]; "
                "print(len(mods), 'modules of', tdfunc.__file__, tdfunc.__version__)",
            ],
            cwd=work,
            env=env,
        )
        steps.run("README example", [py, work / "readme_example.py"], cwd=work, env=env)
        steps.run(
            "install the runtime extras",
            [*pip, "install", "-q", f"{wheel}[{','.join(RUNTIME_EXTRAS)}]"],
        )
        steps.run(
            "run the code of the extras",
            [py, work / "extras_check.py", *RUNTIME_EXTRAS],
            cwd=work,
            env=env,
        )
        others = sorted(set(extras) - set(RUNTIME_EXTRAS))
        steps.run(
            "resolve the other extras",
            [*pip, "install", "--dry-run", "-q", f"{wheel}[{','.join(others)}]"],
        )
    except subprocess.CalledProcessError as e:
        print(e.stdout or "", file=sys.stderr)
        print(f"wheel check failed: {e.cmd}", file=sys.stderr)
        return 1
    finally:
        print("wheel check times:\n" + steps.summary(), flush=True)
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("wheel check ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
