"""constraints.txt, the versions `make install` installs, pins every dependency pyproject.toml names, inside the
range pyproject.toml allows: a dependency added or a range moved without `make lock` fails here, not in a fresh
clone's install."""

from __future__ import annotations

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version; rewrite it with make lock"
            out[canonicalize_name(name)] = Version(version)
    return out


def test_every_dependency_is_pinned_within_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    pinned = pins()
    missing = [str(r) for r in wanted if canonicalize_name(r.name) not in pinned]
    assert not missing, f"constraints.txt lacks {missing}: run make lock and commit constraints.txt"
    outside = [f"{r} (pinned {pinned[canonicalize_name(r.name)]})" for r in wanted
               if not r.specifier.contains(pinned[canonicalize_name(r.name)], prereleases=True)]
    assert not outside, f"constraints.txt pins versions pyproject.toml excludes: {outside}; run make lock"


def test_no_local_build_or_llmpipe_itself():
    pinned = pins()
    assert "llmpipe" not in pinned
    local = [f"{name}=={v}" for name, v in pinned.items() if v.local]
    assert not local, f"{local}: a local build tag (+cpu) would refuse the CUDA build of the same version"
