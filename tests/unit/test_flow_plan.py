"""The `full-pipeline` flow's plan and input checks, without a Prefect server: the stage order comes from
DVC's graph of the shipped dvc.yaml, and bad flow parameters fail before any work with the fix named."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SHIPPED_STAGES

sys.path.insert(0, str(ROOT / "flows"))
from full_pipeline import check_experiment, limit_name, stage_plan  # noqa: E402


@pytest.fixture
def repo(tmp_path, offline_env) -> Path:
    """A committed git + DVC repo with the shipped dvc.yaml and params.yaml."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = {**offline_env, "GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    return tmp_path


def test_plan_is_every_stage_in_dependency_order(repo):
    names = [s.name for s in stage_plan(repo)]
    assert set(names) == SHIPPED_STAGES
    assert names[:7] == ["prepare", "tokenizer", "tokenize", "baseline", "pretrain", "sft", "dpo"]
    assert names[-1] == "report"
    assert names.index("evaluate@dpo") > names.index("dpo")


def test_plan_of_targets_brings_what_they_need(repo):
    assert [s.name for s in stage_plan(repo, ["sft"])] == ["prepare", "tokenizer", "tokenize", "pretrain", "sft"]
    evaluate = [s.name for s in stage_plan(repo, ["evaluate"])]
    assert {"evaluate@baseline", "evaluate@dpo", "baseline", "dpo"} <= set(evaluate) and "report" not in evaluate
    plan = {s.name: s for s in stage_plan(repo, ["evaluate@sft"])}
    assert plan["evaluate@sft"].metrics == ("metrics/eval/sft.json",)
    assert "models/pretrain" in plan["pretrain"].outs


def test_unknown_stage_names_the_stages(repo):
    with pytest.raises(ValueError, match=r"'sfft' is not a stage of dvc.yaml .*stages: prepare, tokenizer"):
        stage_plan(repo, ["sfft"])


def test_experiment_requests_are_checked_before_any_work(repo):
    assert check_experiment(repo, "lr5e-4", {"train.lr": "5e-4"}) == ["train.lr=5e-4"]
    assert check_experiment(repo, "ckpt", {"sft.save_steps": "5"}) == ["+sft.save_steps=5"], "a train key sft inherits"
    with pytest.raises(ValueError, match="experiment_name 'a/b'"):
        check_experiment(repo, "a/b", {})
    with pytest.raises(ValueError, match=r"train\.lr"):
        check_experiment(repo, "bad", {"train.lr": "fast"})
    with pytest.raises(ValueError, match="lrr"):
        check_experiment(repo, "bad", {"train.lrr": "1e-4"})
    assert list(repo.glob(".dvc/tmp/llmpipe-runs/*")) == [], "nothing written"
    shutil.rmtree(repo / ".git")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    with pytest.raises(ValueError, match="no commit"):
        check_experiment(repo, "x", {"train.lr": "5e-4"})


def test_limit_name_is_a_valid_prefect_name():
    from prefect.types.names import BANNED_CHARACTERS

    name = limit_name(Path("/work/main"))
    assert not set(name) & set(BANNED_CHARACTERS)
    assert "work-main" in name and name != limit_name(Path("/work-main"))
