"""dvc.yaml's llmpipe blocks are what the registry renders (`llm-train dvc-yaml`), a user's own stages, charts and
comments survive a re-render, and configs/tiny.yaml sizes every training stage."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT, TINY_PARAMS

from llmpipe.cli import main
from llmpipe.config import ParamsError, parse_params
from llmpipe.config import stages as registry
from llmpipe.config.rl import check_groups_fit
from llmpipe.orchestration import dvc_yaml, scratch
from llmpipe.orchestration.dag import plots_block, stage_block

USER_STAGE = """\
  # my own stage, after sft
  lint_sft:
    cmd: python my_lint.py ${paths.models}/sft   # a comment inside it
    deps:
      - my_lint.py
      - ${paths.models}/sft
    outs:
      - lint/sft.txt
"""

USER_CHART = """\
  - my chart:
      x: step
      y:
        lint/sft.csv: score
"""


def test_dvc_yaml_is_as_the_registry_renders_it():
    diff = dvc_yaml.difference(ROOT / "dvc.yaml")
    assert not diff, f"dvc.yaml differs from its rendering: run `llm-train dvc-yaml --write`\n{diff}"


def test_a_users_own_stage_chart_and_comments_survive_a_rerender(tmp_path):
    text = dvc_yaml.render((ROOT / "dvc.yaml").read_text())  # as rendered, whether or not the file is yet
    text = text.replace("\n  dpo:\n", f"\n{USER_STAGE}\n  dpo:\n", 1).rstrip("\n") + "\n" + USER_CHART
    text = text.replace("  sft:\n", "  # a note of mine above sft\n  sft:\n", 1)
    edited = text.replace("      - sft\n", "      - sft\n      - my.own.key\n", 1)  # a hand edit of llmpipe's block
    rendered = dvc_yaml.render(edited)
    assert USER_STAGE in rendered and USER_CHART in rendered and "  # a note of mine above sft\n  sft:\n" in rendered
    assert rendered == text, "the hand edit of an llmpipe block is rendered away, nothing else changes"
    stages = list(yaml.safe_load(rendered)["stages"])
    assert stages.index("lint_sft") == stages.index("sft") + 1, "a user's stage stays after the stage it followed"
    assert dvc_yaml.render(rendered) == rendered


def test_a_registered_stage_missing_from_dvc_yaml_is_written_at_its_place(tmp_path):
    parsed = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    without = {"stages": {k: v for k, v in parsed["stages"].items() if k != "grpo"}}
    path = tmp_path / "dvc.yaml"
    path.write_text(yaml.safe_dump(without, sort_keys=False))
    assert dvc_yaml.write(path) and not dvc_yaml.difference(path)
    written = yaml.safe_load(path.read_text())
    assert list(written["stages"]) == list(registry.DVC_STAGES) and written["stages"]["grpo"] == stage_block("grpo")
    assert written["plots"] == plots_block()


def test_the_command_checks_and_writes(tmp_path, capsys):
    path = tmp_path / "dvc.yaml"
    path.write_text((ROOT / "dvc.yaml").read_text().replace("      - grpo\n", "", 1))
    assert main(["dvc-yaml", "--path", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "+      - grpo" in out and "--write" in err
    assert main(["dvc-yaml", "--path", str(path), "--write"]) == 0
    assert main(["dvc-yaml", "--path", str(path)]) == 0


def test_every_training_stage_has_a_tiny_section_that_fits_its_rules():
    tiny = yaml.safe_load(TINY_PARAMS)
    inherited = {name for name in registry.TRAINING_TASKS if registry.REGISTRY[name].inherits in tiny}
    missing = [name for name in registry.TRAINING_TASKS if name not in tiny and name not in inherited]
    assert not missing, (f"configs/tiny.yaml: add a section for {missing} with a tiny budget (max_steps, batch sizes, "
                         "eval and save steps, as the other stages' there), or make smoke trains it at full size")
    try:
        params = parse_params(scratch.merged_params(ROOT, tiny))  # what make smoke and the tests run
    except ParamsError as err:
        pytest.fail(f"configs/tiny.yaml over params.yaml: {err}")
    for name in registry.GROUPED_TASKS:  # one process, where the shipped params leave the world size to the launcher
        try:
            check_groups_fit(name, params.stage(name), 1)
        except ValueError as err:
            pytest.fail(f"configs/tiny.yaml: {err}; set {name}'s batch sizes there (as grpo's)")
