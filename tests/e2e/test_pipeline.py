"""The whole DAG with the real `dvc repro` and `dvc exp run`, on tiny params, in a temporary git repo.

One repo, trained once per session (`trained_pipeline`); the tests run in file order and build on each other, as a
user's day would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from conftest import ALL_STAGES, TINY_PARAMS, sh, stages_run

from llmpipe.config import stages as registry
from llmpipe.config.identity import IDENTITY_KEY

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def env(pipeline_env) -> dict[str, str]:
    return pipeline_env


@pytest.fixture(scope="module")
def repo(trained_pipeline) -> Path:
    """A git + DVC repo holding this project's dvc.yaml, code and tiny params, after `dvc repro`."""
    return trained_pipeline.repo


def test_repro_builds_every_artifact(repo, trained_pipeline):
    assert stages_run(trained_pipeline.repro_output) == ALL_STAGES

    from transformers import AutoModelForCausalLM, AutoTokenizer

    for stage in ("baseline", "pretrain", "sft", "dpo", "ppo", "grpo"):
        model = AutoModelForCausalLM.from_pretrained(repo / "models" / stage)
        tok = AutoTokenizer.from_pretrained(repo / "models" / stage)
        assert tok.chat_template and tok.pad_token_id != tok.eos_token_id
        assert model.config.vocab_size == len(tok)
    tokenize = json.loads((repo / "metrics" / "tokenize.json").read_text())
    assert tokenize["num_tokens_train"] > tokenize["num_tokens_validation"] > 0 and tokenize["mb_per_s"] > 0
    for stage in ("pretrain", "sft", "dpo"):
        metrics = json.loads((repo / "metrics" / f"{stage}.json").read_text())
        assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["eval_loss"]), stage
        assert metrics["steps"] == 12
        assert (repo / "logs" / stage / "train.csv").read_text().count("\n") > 1
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(repo / "models" / "reward").config.num_labels == 1
    for stage in ("reward", "ppo", "grpo"):
        metrics = json.loads((repo / "metrics" / f"{stage}.json").read_text())
        numbers = [v for k, v in metrics.items() if not isinstance(v, str) and k != IDENTITY_KEY]  # "strategy": "none"
        assert numbers and all(math.isfinite(v) for v in numbers), stage
        assert (repo / "logs" / stage / "train.csv").read_text().count("\n") > 1, stage
    for model in yaml.safe_load(TINY_PARAMS)["eval"]["models"]:
        metrics = json.loads((repo / "metrics" / "eval" / f"{model}.json").read_text())
        values = [v for k, v in metrics.items() if k not in ("wall_time_s", IDENTITY_KEY)]
        assert values and all(math.isfinite(v) for v in values), model
    report = (repo / "reports" / "report.md").read_text()
    assert "| dpo |" in report or "dpo" in report
    assert (repo / "dvc.lock").exists()


def test_nothing_was_downloaded(env):
    hub = Path(env["HF_HOME"]) / "hub"
    assert not hub.exists() or not any(hub.iterdir())


def test_second_repro_does_nothing(repo, env):
    out = sh(repo, env, "dvc", "repro")
    assert stages_run(out) == set()
    assert "up to date" in out


def test_a_train_param_reruns_the_training_stages_and_not_the_data_stages(repo, env):
    # `dvc repro --dry` names the stages whose own params changed (what follows them reruns as their outputs
    # change); a real `dvc exp run -S train.lr=…` would retrain nearly the whole DAG, the dearest test of the suite,
    # to show what the fingerprint tests (tests/stages/test_training.py) and the experiments below already show.
    sh(repo, env, "git", "add", "-A")
    sh(repo, env, "git", "commit", "-qm", "baseline run")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"]["lr"] = 5e-4
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        out = sh(repo, env, "dvc", "repro", "--dry")
    finally:
        sh(repo, env, "git", "checkout", "-q", "params.yaml")
    assert stages_run(out) == set(registry.TRAINING_TASKS)


def test_exp_run_beta_reruns_only_dpo_and_after(repo, env):
    out = sh(repo, env, "dvc", "exp", "run", "-n", "beta0.2", "-S", "dpo.beta=0.2")
    assert stages_run(out) == {"dpo", "evaluate@dpo", "report"}
    assert "resuming from" not in out


def test_exp_run_preference_method_reruns_only_dpo_and_after(repo, env):
    out = sh(repo, env, "dvc", "exp", "run", "-n", "kto", "-S", "dpo.method=kto")
    assert stages_run(out) == {"dpo", "evaluate@dpo", "report"}
    shown = sh(repo, env, "dvc", "exp", "show", "--csv", "--no-pager")
    assert "kto" in shown and "beta0.2" in shown, "dvc exp show compares the methods"


def test_exp_run_kl_target_reruns_only_ppo_and_after(repo, env):
    out = sh(repo, env, "dvc", "exp", "run", "-n", "kl-adaptive", "-S", "ppo.kl_ctrl=adaptive",
             "-S", "ppo.kl_target=2.0")  # fmt: skip
    assert stages_run(out) == {"ppo", "evaluate@ppo", "report"}
    assert "resuming from" not in out
    kl_coef = yaml.safe_load((repo / "params.yaml").read_text())["ppo"]["kl_coef"]
    assert json.loads((repo / "metrics" / "ppo.json").read_text())["kl_coef_final"] != kl_coef, "it adapted"


def test_no_checkpoint_in_git_or_experiment_refs(repo, env):
    tracked = sh(repo, env, "git", "ls-files").splitlines()
    refs = sh(repo, env, "git", "for-each-ref", "--format=%(refname)", "refs/exps").split()
    assert refs, "the experiments were saved as refs"
    for ref in refs:
        tracked += sh(repo, env, "git", "ls-tree", "-r", "--name-only", ref).splitlines()
    assert not [f for f in tracked if f.startswith("checkpoints/") or "/checkpoint-" in f]
    assert not [f for f in tracked if f.endswith(".safetensors")], "models are DVC-cached, not in git"
