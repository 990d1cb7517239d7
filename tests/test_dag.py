"""dvc.yaml: each stage's deps cover every llmpipe module the stage imports, so editing code reruns it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from llmpipe import stages

from conftest import ROOT

IMPORTS = """
import json, sys
import llmpipe.cli, llmpipe.stages.{task}
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("llmpipe") and m.__file__)))
"""


@pytest.mark.parametrize("task", list(stages.TASKS))
def test_deps_cover_imported_modules(task):
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    deps = dvc["stages"][task]["deps"]
    out = subprocess.run([sys.executable, "-c", IMPORTS.format(task=task)], capture_output=True, text=True, check=True)
    for file in json.loads(out.stdout):
        rel = str(__import__("pathlib").Path(file).resolve().relative_to(ROOT))
        assert any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps), f"{task}: {rel} not in deps"
