"""dvc.yaml: each stage's deps cover every llmpipe module the stage imports, so editing code reruns it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT

from llmpipe import stages

IMPORTS = """
import json, sys
import llmpipe.cli, llmpipe.stages.{task}
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("llmpipe") and m.__file__)))
"""


@pytest.mark.parametrize("task", [t for t in stages.TASKS if t not in stages.HAND_TASKS])
def test_deps_cover_imported_modules(task):
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    deps = dvc["stages"][task]["deps"]
    out = subprocess.run([sys.executable, "-c", IMPORTS.format(task=task)], capture_output=True, text=True, check=True)
    for file in json.loads(out.stdout):
        rel = str(__import__("pathlib").Path(file).resolve().relative_to(ROOT))
        assert any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps), f"{task}: {rel} not in deps"


def test_every_task_has_a_stage_unless_run_by_hand():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert set(stages.TASKS) - set(stages.HAND_TASKS) == set(dvc["stages"])
    assert not set(stages.HAND_TASKS) & set(dvc["stages"])
