"""The package order: a module imports only from packages below its own (or from its own).

The order is the architecture's (docs/architecture.md): shared names, kernels, then the runtime
from a model's description up to its CLI, then the tools. An import that runs upward (a kernel
naming an FTW class, the prefix cache importing the engine) fails here, TYPE_CHECKING ones too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"ftkit": ROOT / "ftkit", "ftkit.runtime": ROOT / "runtime", "ftkit.kernels": ROOT / "kernels",
           "ftkit.tools": ROOT / "tools"}

# lowest first; packages on one line may not import each other
LAYERS = [
    ["ftkit", "ftkit.vocab"],
    ["ftkit.kernels"],
    ["ftkit.runtime", "ftkit.runtime.spec"],
    ["ftkit.runtime.checkpoint"],
    ["ftkit.runtime.ftw"],
    ["ftkit.runtime.models"],
    ["ftkit.runtime.profile"],
    ["ftkit.runtime.experts"],
    ["ftkit.runtime.prefix_cache"],
    ["ftkit.runtime.engine"],
    ["ftkit.runtime.server"],
    ["ftkit.runtime.random_model", "ftkit.runtime.synthetic"],
    ["ftkit.runtime.console"],
    ["ftkit.runtime.cli"],
    ["ftkit.tools", "ftkit.tools.calibrate", "ftkit.tools.convert", "ftkit.tools.diagnose"],
    ["ftkit.tools.bench"],
]
RANK = {pkg: n for n, names in enumerate(LAYERS) for pkg in names}


def owner(module: str) -> str:
    """The package of LAYERS a module belongs to: the longest name that prefixes it."""
    best = max((p for p in RANK if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} is in no layer of tests/test_layers.py: add its package"
    return best


def modules():
    for base, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            package = path.name == "__init__.py"
            name = ".".join([base, *parts[:-1]] if package else [base, *parts])
            yield name, package, path


def imports(name: str, package: bool, path: Path):
    here = name.split(".") if package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "ftkit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "ftkit":
                yield target


def test_every_import_runs_down_the_layers():
    upward = []
    for name, package, path in modules():
        mine = owner(name)
        for target in imports(name, package, path):
            theirs = owner(target)
            if theirs != mine and RANK[theirs] >= RANK[mine]:
                upward.append(f"{path.relative_to(ROOT)}: {mine} imports {target} ({theirs})")
    assert not upward, "imports against the package order:\n" + "\n".join(upward)


def test_the_vocabulary_imports_nothing_heavy():
    """ftkit.vocab is read by the header-only commands: no torch, nothing of ftkit."""
    tree = ast.parse((ROOT / "ftkit" / "vocab.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "dataclasses", "typing"}, names
