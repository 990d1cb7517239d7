"""The package's imports follow docs/ARCHITECTURE.md's layers: no import from a lower layer to a higher one, and no
circle, neither between top-level packages nor between modules. Every import is read from the source (function-level
ones too, which is where a hidden cycle or an upward reach would hide), so nothing is imported to check it."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from conftest import ROOT

SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def layers() -> list[set[str]]:
    """docs/ARCHITECTURE.md's ``layers`` block, bottom first: per line, the units it names (``core``, ``cli.py`` →
    ``cli``, ``__init__.py`` → ``llmpipe``, the package itself)."""
    block = re.search(r"^```layers\n(.*?)^```", ARCHITECTURE.read_text(), flags=re.S | re.M)
    assert block, f"{ARCHITECTURE}: no ```layers block (the package's layers, top first)"
    out = []
    for line in block.group(1).splitlines():
        names = re.split(r"\s{2,}", line.strip())[0].split()
        out.append({"llmpipe" if n == "__init__.py" else n.removesuffix("/").removesuffix(".py") for n in names})
    return out[::-1]


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. llmpipe.train.loop (flows.full_pipeline for flows/)
    target: str  # the imported llmpipe module, e.g. llmpipe.config.stages
    where: str  # file:line


def module_names() -> dict[str, Path]:
    names = {}
    for file in sorted((SRC / "llmpipe").rglob("*.py")):
        name = ".".join(file.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        names[name] = file
    return names


def imports_of(file: Path, name: str, modules: dict[str, Path]) -> list[Import]:
    """Every llmpipe module `file` imports, anywhere in it; ``from a import b`` names ``a.b`` when that is a module."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    shown = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import llmpipe.x.y` names x.y; an attribute names its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append(Import(name, target, f"{shown}:{node.lineno}"))
    return found


@cache
def all_imports() -> list[Import]:
    modules = module_names()
    found = [i for name, file in modules.items() for i in imports_of(file, name, modules)]
    for file in sorted((ROOT / "flows").glob("*.py")):
        found += imports_of(file, f"flows.{file.stem}", modules)
    return found


def unit(module: str) -> str:
    """The top-level package or module of `module` (``llmpipe.train.loop`` → ``train``; flows/ → ``flows``)."""
    parts = module.split(".")
    if parts[0] == "flows":
        return "flows"
    return parts[1] if len(parts) > 1 else "llmpipe"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_top_level_package_has_a_layer():
    placed = set().union(*layers())
    units = {unit(name) for name in module_names()} | {"flows"}
    assert not units - placed, f"give {sorted(units - placed)} a line in {ARCHITECTURE.name}'s ```layers block"
    assert not placed - units, f"{ARCHITECTURE.name}'s ```layers block names {sorted(placed - units)}: no such package"


def test_no_import_reaches_a_higher_layer():
    level = {u: i for i, line in enumerate(layers()) for u in line}
    upward = [f"{i.where}: {unit(i.source)} imports {i.target} (a higher layer)" for i in all_imports()
              if level[unit(i.target)] > level[unit(i.source)]]
    assert not upward, "\n".join(["imports against docs/ARCHITECTURE.md's layers (move the code down, or it up):",
                                  *upward])


@pytest.mark.parametrize("level", ["top-level packages", "modules"])
def test_no_import_cycle(level):
    name = unit if level == "top-level packages" else str
    edges: dict[str, set[str]] = {}
    for i in all_imports():
        if name(i.source) != name(i.target):
            edges.setdefault(name(i.source), set()).add(name(i.target))
    assert not cycles(edges), f"import cycles between {level}: {cycles(edges)}"


def test_the_parser_sees_function_level_and_relative_imports(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text("from . import loading\n\n\ndef f():\n"
                      "    from llmpipe.stages import base\n    import llmpipe.cli\n")
    modules = {"llmpipe.models.loading": module, "llmpipe.stages.base": module, "llmpipe.cli": module}
    found = imports_of(module, "llmpipe.models.build", modules)
    assert [i.target for i in found] == ["llmpipe.models.loading", "llmpipe.stages.base", "llmpipe.cli"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
