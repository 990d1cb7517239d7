"""Fine-tuning a model a user already has, with the real `dvc repro` in a scratch git + DVC repo: a tiny Llama saved
in the repo (`model.init_from: user_model`), the user's Alpaca and preference files, no pretraining text.

Only the stages the claim needs run (`dvc repro evaluate@baseline evaluate@dpo`: prepare → tokenizer → tokenize →
baseline, pretrain → sft → dpo → their evaluations), each a few steps."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from conftest import TINY_PARAMS, make_pipeline_repo, sh, stages_run
from user_models import QWEN_TEMPLATE, chat_tokenizer, save_user_model

pytestmark = pytest.mark.slow

STEPS = {"max_steps": 2, "eval_steps": 2, "save_steps": 2, "warmup_steps": 0, "logging_steps": 1}


def overrides() -> dict:
    raw = yaml.safe_load(TINY_PARAMS)
    raw["data"].update(source="local", local={"sft": "raw/alpaca.json", "preference": "raw/pairs.jsonl"})
    raw["model"] = {"init_from": "user_model"}
    raw["pretrain"] = {**raw["pretrain"], **STEPS, "enabled": False, "max_length": 64}
    raw["sft"] = {**raw["sft"], **STEPS}
    raw["dpo"] = {**raw["dpo"], **STEPS}
    raw["eval"] = {**raw["eval"], "models": ["baseline", "dpo"], "limit": 4}
    return raw


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def repo(tmp_path_factory, pipeline_env) -> Path:
    repo = make_pipeline_repo(tmp_path_factory.mktemp("init_from"), pipeline_env, yaml.safe_dump(overrides()))
    save_user_model(repo / "user_model", "llama", chat_tokenizer(QWEN_TEMPLATE))
    (repo / "raw").mkdir()
    alpaca = [{"instruction": f"Add {i} to x.", "input": "", "output": f"def f(x):\n    return x + {i}\n"}
              for i in range(30)]
    (repo / "raw" / "alpaca.json").write_text(json.dumps(alpaca))
    pairs = [{"prompt": f"Add {i} to x.", "chosen": f"return x + {i}", "rejected": f"return x - {i}"} for i in range(30)]
    (repo / "raw" / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (repo / "raw" / "notes.txt").write_text("\n\n".join(f"def g{i}(x):\n    return x * {i}\n" * 24 for i in range(30)))
    return repo


def test_fine_tune_without_pretraining_points_at_the_given_model(repo, pipeline_env):
    out = sh(repo, pipeline_env, "dvc", "repro", "evaluate@baseline", "evaluate@dpo")
    assert stages_run(out) == {"prepare", "tokenizer", "tokenize", "baseline", "pretrain", "sft", "dpo",
                               "evaluate@baseline", "evaluate@dpo"}
    source = repo / "user_model" / "model.safetensors"
    for stage in ("pretrain", "baseline"):
        assert not list((repo / "models" / stage).glob("*.safetensors")), f"models/{stage} is a pointer"
        assert json.loads((repo / "models" / stage / "init_from.json").read_text())["init_from"] == "user_model"
    digest = md5(source)
    assert not (repo / ".dvc" / "cache" / "files" / "md5" / digest[:2] / digest[2:]).exists(), "no second copy"
    tokenizer = json.loads((repo / "metrics" / "tokenizer.json").read_text())
    assert tokenizer["vocab_size"] == len(chat_tokenizer(QWEN_TEMPLATE)), "adopted, not trained"
    assert json.loads((repo / "metrics" / "sft.json").read_text())["steps"] == 2
    for model in ("baseline", "dpo"):
        scores = json.loads((repo / "metrics" / "eval" / f"{model}.json").read_text())
        assert scores["llmpipe_sft_chat.num_docs"] > 0, model


def test_continued_pretraining_trains_the_given_model_first(repo, pipeline_env):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["pretrain"]["enabled"] = True
    params["data"]["local"]["pretrain"] = "raw/notes.txt"
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = sh(repo, pipeline_env, "dvc", "repro", "sft")
    assert {"prepare", "pretrain", "sft"} <= stages_run(out)
    assert json.loads((repo / "metrics" / "pretrain.json").read_text())["steps"] == 2
    pretrained = repo / "models" / "pretrain"
    assert not (pretrained / "init_from.json").exists() and (pretrained / "model.safetensors").exists()
    assert md5(pretrained / "model.safetensors") != md5(repo / "user_model" / "model.safetensors")
