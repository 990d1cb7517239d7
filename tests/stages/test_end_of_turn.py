"""A base model whose eos is ``<|endoftext|>``, with a plain ChatML template (no markers, no copy in TRL) that ends
each turn with ``<|im_end|>``: sft trains on masks computed by rendering, saves a folder that names ``<|im_end|>`` as
an eos (tokenizer, config.json, generation_config.json), with ``use_cache`` on and a template plain Jinja2 renders;
greedy generation then stops at the end of the turn, and `llm-train generate` says why each answer stopped."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jinja2
import pytest
from user_models import END, base_chatml_tokenizer, params_at, run_stages, save_user_model

from llmpipe.cli import main
from llmpipe.models import load_tokenizer

SFT = {"max_steps": 90, "lr": 5e-3, "warmup_steps": 0, "per_device_train_batch_size": 8, "logging_steps": 20,
       "eval_steps": 90, "save_steps": 90, "eval_max_new_tokens": 24}  # fmt: skip
"""Enough steps of a tiny Qwen2 on the user's 30 rows to learn where an answer ends (~1 min on 2 busy cores)."""


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """The user's model, the data stages and a full-weights sft run on it; the sft log."""
    root = tmp_path_factory.mktemp("chatml")
    source = save_user_model(root / "user_model", "qwen2", base_chatml_tokenizer())
    params = params_at(root, str(source), sft=SFT)
    run_stages(params, "prepare", "tokenizer", "pretrain")
    handler, logger = Collect(), logging.getLogger("llmpipe")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        metrics = run_stages(params, "sft")["sft"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return params, metrics, "\n".join(handler.lines)


class Collect(logging.Handler):
    """The messages of the log records it is given (caplog is per test; the fixture runs once per module)."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow
def test_the_sft_folder_names_the_end_of_turn_token_as_an_eos(chatml):
    params, metrics, log = chatml
    sft = Path(params.paths.models, "sft")
    assert "assistant masks computed by rendering" in log and metrics["num_fully_truncated"] == 0
    assert "'<|im_end|>' ends an assistant turn" in log, "the folder's change is said"
    tok, pipeline = load_tokenizer(sft), load_tokenizer(params.paths.tokenizer)
    eot, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids(END)
    assert tok.eos_token == "<|im_end|>" and pipeline.eos_token == END, "the pipeline tokenizer keeps its eos"
    config = json.loads((sft / "config.json").read_text())
    assert config["eos_token_id"] == eot and config["use_cache"] is True
    assert json.loads((sft / "generation_config.json").read_text())["eos_token_id"] == [eot, eos], "as Qwen's"


@pytest.mark.slow
def test_greedy_generation_stops_at_the_end_of_the_turn(chatml, tmp_path):
    params, _, _ = chatml
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Add {i} to x."}) + "\n" for i in (3, 11, 27)))
    out = tmp_path / "answers.jsonl"
    argv = ["generate", "--model", str(Path(params.paths.models, "sft")), "--file", str(prompts), "--out", str(out),
            "--temperature", "0", "--max-new-tokens", "40"]  # fmt: skip
    assert main(argv) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["stop_reason"] for a in answers] == ["end_of_turn"] * 3, answers
    assert all(a["num_new_tokens"] < 40 and "return x" in a["completion"] for a in answers), answers
    # the same folder naming the base model's eos only (as sft saved it before): the answers run to the budget
    eos_only = tmp_path / "eos_only"
    shutil.copytree(Path(params.paths.models, "sft"), eos_only)
    tok = load_tokenizer(eos_only)
    tok.eos_token = END
    tok.save_pretrained(eos_only)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((eos_only / name).read_text())
        (eos_only / name).write_text(json.dumps({**config, "eos_token_id": tok.eos_token_id}))
    assert main([*argv[:2], str(eos_only), *argv[3:]]) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["stop_reason"] for a in again] == ["max_new_tokens"] * 3 and all(a["num_new_tokens"] == 40 for a in again)


@pytest.mark.slow
def test_the_saved_template_renders_in_plain_jinja2(chatml):
    params, _, _ = chatml
    sft = Path(params.paths.models, "sft")
    template = (sft / "chat_template.jinja").read_text()
    chat = [{"role": "user", "content": "Add 1 to x."}, {"role": "assistant", "content": "return x + 1"}]
    text = jinja2.Environment().from_string(template).render(messages=chat, add_generation_prompt=False)
    assert text == load_tokenizer(sft).apply_chat_template(chat, tokenize=False)
