"""Every package folder ships: pyproject lists packages explicitly (package-dir mapping)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


# Imported but not required: the GPU kernels load only where triton is installed
# (ftkit.kernels.triton.optional), so a CPU install runs without it; `ft-bench serve` drives the
# server with the official SDKs, which the test extra installs.
OPTIONAL = {"triton", "openai", "anthropic"}


def _imports() -> set[str]:
    found = set()
    for folder in ("ftkit", "runtime", "kernels", "tools"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "ftkit"}


def test_a_plain_install_imports_every_module():
    """What the modules import (at load time or inside a function) is a core dependency: a plain
    `pip install -e .` serves (fastapi, uvicorn and pydantic are not an extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"]
    core = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in deps}
    needed = _imports() - OPTIONAL  # each one's import name is its distribution's
    assert {"fastapi", "uvicorn", "pydantic"} <= needed
    assert needed <= core, f"imported but not a core dependency: {sorted(needed - core)}"
    assert "serve" not in project.get("optional-dependencies", {})
