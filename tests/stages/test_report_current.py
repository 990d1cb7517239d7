"""The report card of a user's own run beside a clone's committed metrics: docs/finetune.md's one params change
(a local model, LoRA SFT and DPO on the user's files, three evaluations, then `llm-train --task report`) run
through the real CLI on a tiny model built here, with the repository's committed files of the default run in
metrics/. The card and the headline show only what this run produced, and grade it in the words of the user's data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY_PARAMS
from user_models import QWEN_TEMPLATE, STEPS, chat_tokenizer, save_user_model, user_data

from llmpipe import cli
from llmpipe.config.identity import IDENTITY_KEY
from llmpipe.report import card

LORA = {"method": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
OWN_RUN = ("prepare", "tokenizer", "baseline", "pretrain", "sft", "dpo")
EVALUATED = ("baseline", "sft", "dpo")


def user_params(root: Path) -> dict:
    """TINY_PARAMS with every path in `root`, the README's fine-tune change, LoRA in sft and dpo."""
    raw = yaml.safe_load(TINY_PARAMS)
    raw["paths"] = {k: str(root / k) for k in ("data", "models", "metrics", "logs", "checkpoints", "runs", "reports")}
    raw["paths"]["tokenizer"] = str(root / "artifacts" / "tokenizer")
    source = save_user_model(root / "user_model", "llama", chat_tokenizer(QWEN_TEMPLATE))
    raw["data"] = {**raw["data"], "source": "local", "local": user_data(root)}
    raw["model"] = {"init_from": str(source)}
    raw["pretrain"] = {**raw["pretrain"], "enabled": False}
    raw["sft"] = {**raw["sft"], **STEPS, "peft": LORA}
    raw["dpo"] = {**raw["dpo"], **STEPS, "peft": LORA}
    raw["eval"] = {**raw["eval"], "models": ["baseline", "pretrain", "sft", "dpo", "ppo", "grpo"], "limit": 3,
                   "max_new_tokens": 8}  # every shipped task: the ones that grade stdlib code must drop out
    return raw


@pytest.fixture(scope="module")
def users_run(tmp_path_factory) -> Path:
    """The user's run, in process: six stages and three evaluations, then the report."""
    tmp_path = tmp_path_factory.mktemp("own")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(tmp_path)
        run_all(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def users_card(users_run) -> tuple[Path, str, dict]:
    """The root, the card's text and the evaluations' metrics of :func:`users_run`."""
    evals = {m: json.loads((users_run / "metrics" / "eval" / f"{m}.json").read_text()) for m in EVALUATED}
    return users_run, (users_run / "reports" / "report.md").read_text(), evals


def run_all(tmp_path: Path) -> None:
    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump(user_params(tmp_path)))
    shutil.copytree(ROOT / "metrics", tmp_path / "metrics")  # the clone's committed files of the default run
    (tmp_path / "logs" / "ppo").mkdir(parents=True)  # and a default run's samples in logs/ (a `dvc pull`)
    (tmp_path / "logs" / "ppo" / "samples.jsonl").write_text(
        json.dumps({"step": 4, "prompt": "Add 1 to x.", "completion": "DEFAULT-RUN-PPO"}) + "\n")
    for task in OWN_RUN:
        assert cli.main(["--task", task, "--config-path", str(config)]) == 0, task
    for model in EVALUATED:
        assert cli.main(["--task", "evaluate", "--model", model, "--config-path", str(config)]) == 0, model
    assert cli.main(["--task", "report", "--config-path", str(config)]) == 0


@pytest.mark.slow  # ~2 min under load (the module's run): six stages and three evaluations of a tiny model
def test_card_of_a_users_run_shows_only_what_ran(users_run):
    tmp_path = users_run
    sft = json.loads((tmp_path / "metrics" / "sft.json").read_text())
    assert sft[IDENTITY_KEY]["params sft"] and f"input {tmp_path / 'data' / 'sft'}" in sft[IDENTITY_KEY]
    text = (tmp_path / "reports" / "report.md").read_text()
    head, rest = text.split("## Checks", 1)
    for name in ("tokenize", "reward", "ppo", "grpo", "rloo", "vlm", "evaluate@pretrain", "evaluate@ppo",
                 "evaluate@grpo"):
        assert f"- **{name}**: " in head, name
    for name in (*OWN_RUN, *(f"evaluate@{m}" for m in EVALUATED)):
        assert f"- **{name}**: " not in head, name
    checks = [line for line in rest.split("\n## ")[0].splitlines() if line.startswith("- ")]
    assert not [line for line in checks if line[2] in "✓✗" and any(s in line for s in ("ppo", "grpo", "reward"))]
    assert "DEFAULT-RUN-PPO" not in text
    table = rest.split("## Training stages")[1].split("\n## ")[0]
    for stage in ("reward", "ppo", "grpo", "vlm"):
        assert f"| {stage} | {card.NOT_RUN} |" in table, stage
    assert "| sft | " in table and f"| sft | {card.NOT_RUN}" not in table
    assert "## RL stages" not in text
    headline = json.loads((tmp_path / "metrics" / "headline.json").read_text())["headline"]
    assert not {"ppo_reward", "grpo_reward", "reward_acc", "vlm_acc", "grpo_gen_score"} & headline.keys()
    listed = [line for line in head.split("## ⚠ Not run for these params")[1].splitlines() if line.startswith("- **")]
    assert "sft_chat_bpb" in headline and headline["not_run"] == len(listed)


@pytest.mark.slow  # the module's run
def test_card_of_a_users_run_grades_their_data(users_card):
    """No Python-code task or stdlib wording on Alpaca data: response loss, preference accuracy on their pairs, sft
    against the model it started from, and every evaluated model's greedy answers side by side."""
    root, text, evals = users_card
    for stdlib_words in ("parses and define", "real body", "corrupted", "held-out module", "function body",
                         "llmpipe_generation", "llmpipe_signature_mc", "distinct bodies"):
        assert stdlib_words not in text, stdlib_words
    assert not any(k.startswith(("llmpipe_generation.", "llmpipe_signature_mc.")) for m in evals.values() for k in m)
    assert {"llmpipe_answers.exact", "llmpipe_answers.distinct"} <= evals["sft"].keys()
    checks = text.split("## Checks")[1].split("\n## ")[0]
    assert "dpo prefers the chosen response of held-out pairs more often than sft" in checks
    assert "sft's response bits per byte in the chat format is below baseline's" in checks
    assert "chat format: baseline " in checks  # it ran: the model sft started from was evaluated
    assert "skipped: pretrain.enabled is false" in checks
    assert "skipped: no llmpipe_tasks.pass_at_1 in any evaluation (this data has no executable tasks" in checks
    answers = text.split("## Greedy answers")[1].split("\n## ")[0]
    shown = min(3, len((root / "data" / "eval" / "sft.jsonl").read_text().splitlines()))
    assert shown and answers.count("### Prompt ") == shown and "Add " in answers  # the user's held-out instructions
    for model in EVALUATED:
        assert answers.count(f"| {model} | ") == shown, model
    assert "Loss on the held-out SFT responses given their prompt in the chat format" in text
