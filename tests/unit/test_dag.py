"""dvc.yaml agrees with the code: each stage's code deps are exactly the llmpipe packages it imports (so editing code
reruns it, and only it: `llm-train dvc-yaml` reads them from the source, checked here against a real import), its
other deps are the registry's inputs, and every registered stage has a DVC stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from llmpipe.config import stages as registry
from llmpipe.orchestration import dag

IMPORTS = """
import json, sys
import llmpipe.cli, llmpipe.stages.{task}
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("llmpipe") and m.__file__)))
"""


def code_units(task: str) -> set[str]:
    """The dvc.yaml code deps `task` needs: every package it imports (a stage module, or a module at the package's
    top, by itself), plus `distributed`, which `llm-train` imports at run time for every task."""
    out = subprocess.run([sys.executable, "-c", IMPORTS.format(task=task)], capture_output=True, text=True, check=True)
    units = {"src/llmpipe/distributed"}
    for file in json.loads(out.stdout):
        rel = Path(file).resolve().relative_to(ROOT / "src" / "llmpipe")
        single = rel.parts[0] == "stages" or len(rel.parts) == 1
        units.add(str(Path("src/llmpipe", *(rel.parts if single else rel.parts[:1]))))
    return units


def dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("task", registry.DVC_STAGES)
def test_code_deps_are_exactly_the_imported_packages(task):
    rendered, expected = set(dag.code_deps(task)), code_units(task)
    assert rendered == expected, (f"llmpipe.orchestration.dag.code_deps({task!r}) reads {sorted(rendered)} from the "
                                  f"source, a real import loads {sorted(expected)}")
    deps = [d for d in dvc_stages()[task]["deps"] if d.startswith("src/")]
    assert set(deps) == expected, f"dvc.yaml stage {task}: its code deps are stale; run llm-train dvc-yaml --write"


@pytest.mark.parametrize("task", [t for t in registry.DVC_STAGES if t != "report"])
def test_data_deps_are_the_registry_inputs(task):
    deps = [d for d in dvc_stages()[task]["deps"] if not d.startswith("src/")]
    assert deps == list(registry.REGISTRY[task].inputs), (
        f"dvc.yaml stage {task} reads {deps}, the registry (llmpipe/config/stages.py) says "
        f"{list(registry.REGISTRY[task].inputs)}: make them the same"
    )


def test_report_reads_every_stage_metrics_file():
    deps = [d for d in dvc_stages()["report"]["deps"] if not d.startswith("src/")]
    expected = ["${paths.metrics}/eval", *(f"${{paths.metrics}}/{s}.json" for s in registry.METRICS_STAGES)]
    assert deps == expected, f"dvc.yaml stage report: its non-code deps must be, in the registry's order, {expected}"


@pytest.mark.parametrize("task", registry.TRAINING_TASKS)
def test_training_stage_writes_its_model_and_reads_its_section(task):
    stage = dvc_stages()[task]
    assert registry.REGISTRY[task].output in stage["outs"]
    assert {"train", task, "distributed"} <= set(stage["params"]), f"dvc.yaml stage {task}: list train, {task}, distributed"


def test_every_registered_stage_has_a_dvc_stage_and_no_other():
    dvc = set(dvc_stages())
    registered = set(registry.DVC_STAGES)
    assert not registered - dvc, f"no dvc.yaml stage for {sorted(registered - dvc)}: run llm-train dvc-yaml --write"
    assert not dvc - registered, (f"dvc.yaml stages {sorted(dvc - registered)} are not in the registry "
                                  "(llmpipe/config/stages.py): register them, or delete a renamed stage's old block")
