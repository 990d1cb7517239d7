"""Training stages on tiny real models: fingerprints keep runs apart, a killed pretrain resumes from its
checkpoint, and the final model is a standard HF directory written atomically."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_PARAMS, kill_after_first_checkpoint

from llmpipe.checkpoints import fingerprint
from llmpipe.config import load_params, parse_params
from llmpipe.io import atomic_dir


def test_fingerprint_ignores_budgets_but_not_hyperparameters(workdir):
    inputs = [workdir / "data" / "pretrain"]
    base = parse_params(yaml.safe_load(TINY_PARAMS))
    longer = parse_params({**yaml.safe_load(TINY_PARAMS), "pretrain": {"max_steps": 500}})
    other_lr = parse_params({**yaml.safe_load(TINY_PARAMS), "train": {"lr": 5e-4}})
    assert fingerprint(base, "pretrain", inputs) == fingerprint(longer, "pretrain", inputs)
    assert fingerprint(base, "pretrain", inputs) != fingerprint(other_lr, "pretrain", inputs)
    assert fingerprint(base, "sft", inputs) != fingerprint(base, "pretrain", inputs)


def test_pack_ids_gives_the_tokenizer_calls_ids_with_eos_after_each_document(workdir):
    from llmpipe.io import read_jsonl
    from llmpipe.modeling import load_tokenizer
    from llmpipe.stages.pretrain import pack_ids

    tok = load_tokenizer(workdir / "artifacts" / "tokenizer")
    texts = [row["text"] for row in read_jsonl(workdir / "data" / "pretrain" / "validation.jsonl")]
    texts += ["", "special tokens in text: <s> </s> <|user|>"]

    def expected() -> list[int]:
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return [t for doc in ids for t in (*doc, tok.eos_token_id)]

    assert pack_ids(texts, tok).tolist() == expected()
    tok.backend_tokenizer.enable_truncation(8)  # a backend left truncating: pack_ids goes through the call
    assert pack_ids(texts, tok).tolist() == expected()
    assert pack_ids([], tok).tolist() == []


def test_atomic_dir_keeps_the_old_folder_on_failure(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "weights").write_text("half")
        raise RuntimeError("killed mid-save")
    assert (final / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no temp folder left behind"


def _llm_train(workdir: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "llmpipe.cli", "--task", "pretrain", *args],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.slow
def test_killed_pretrain_resumes_from_its_checkpoint(workdir, offline_env):
    """SIGKILL after the first checkpoint; the rerun continues from it and ends at max_steps."""
    raw = yaml.safe_load((workdir / "params.yaml").read_text())
    raw["pretrain"] = {"max_steps": 40, "save_steps": 5, "eval_steps": 20, "logging_steps": 5}
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))
    kill_after_first_checkpoint(_llm_train(workdir, offline_env), workdir / "checkpoints" / "pretrain")
    assert not (workdir / "models" / "pretrain").exists(), "killed before the end: no final model"

    rerun = _llm_train(workdir, offline_env)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    step = int(out.split("resuming from ")[1].split("(step ")[1].split(")")[0])
    assert step > 0
    metrics = json.loads((workdir / "metrics" / "pretrain.json").read_text())
    assert metrics["resumed_from_step"] == step
    assert metrics["steps"] == 40
    assert math.isfinite(metrics["eval_loss"])
    history = (workdir / "logs" / "pretrain" / "train.csv").read_text().splitlines()
    assert history[0].startswith("step,") and int(history[-1].split(",")[0]) == 40
    assert int(history[1].split(",")[0]) == 5, "the plot keeps the steps before the kill"

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(workdir / "models" / "pretrain")
    assert model.config.num_hidden_layers == load_params(workdir / "params.yaml").model.num_hidden_layers
    assert (workdir / "models" / "pretrain" / "model.safetensors").exists()
