"""docs/CODE_MAP.md lists every module of the package, and every path it lists exists."""

from __future__ import annotations

import re

from conftest import ROOT


def listed_paths() -> list[str]:
    """The paths of docs/CODE_MAP.md's tree (two spaces of indent per level; a name ending in / is a folder)."""
    text = (ROOT / "docs" / "CODE_MAP.md").read_text()
    block = re.search(r"^# Code map\n.*?^```\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "docs/CODE_MAP.md has no '# Code map' heading followed by a fenced tree"
    stack: list[str] = []
    paths = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        stack[depth:] = [name.rstrip("/")]
        paths.append("/".join(stack) + ("/" if name.endswith("/") else ""))
    return paths


def test_every_listed_path_exists():
    missing = [p for p in listed_paths() if not (ROOT / p).exists()]
    assert not missing, f"docs/CODE_MAP.md lists paths that do not exist: {missing}"


def test_every_module_is_listed():
    listed = set(listed_paths())
    modules = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "src" / "llmpipe").rglob("*.py")
                     if f.name != "__init__.py" and "__pycache__" not in f.parts)
    unlisted = [m for m in modules if m not in listed]
    assert not unlisted, f"add these modules to docs/CODE_MAP.md (one line each): {unlisted}"
    packages = sorted(str(f.parent.relative_to(ROOT)) + "/" for f in (ROOT / "src" / "llmpipe").rglob("__init__.py")
                      if "__pycache__" not in f.parts)
    assert not [p for p in packages if p not in listed], "every package folder has its line in docs/CODE_MAP.md"
