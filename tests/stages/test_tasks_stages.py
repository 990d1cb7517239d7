"""The executable function tasks through the stages on the tiny workspace: prepare writes them and mixes them into
the SFT and preference data, grpo trains on the tests_pass reward (the tests reach TRL's reward call), and
evaluate measures pass@1 on the held-out tasks."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml

from llmpipe.config import parse_params
from llmpipe.core.io import read_jsonl


def test_prepare_writes_the_tasks_and_mixes_them_into_sft_and_preference(workdir):
    data = workdir / "data"
    tasks = {s: read_jsonl(data / "tasks" / f"{s}.jsonl") for s in ("train", "validation", "test")}
    tiny = yaml.safe_load((workdir / "params.yaml").read_text())["data"]["tasks"]
    assert {s: len(v) for s, v in tasks.items()} == {"train": tiny["num_train"], "validation": tiny["num_validation"],
                                                      "test": tiny["num_test"]}  # fmt: skip
    sft = read_jsonl(data / "sft" / "train.jsonl")
    assert sum("tests" in r for r in sft) == tiny["num_train"] == len(sft) // 2  # sft_share 0.5
    kinds = {r["corruption"] for r in read_jsonl(data / "preference" / "train.jsonl")}
    assert {"constant", "off_by_one", "operator"} <= kinds
    test_prompts = {t["prompt"] for t in tasks["test"]}
    assert not test_prompts & {r["messages"][0]["content"] for r in read_jsonl(data / "sft" / "test.jsonl")}
    assert [t["prompt"] for t in read_jsonl(data / "eval" / "tasks.jsonl")] == [t["prompt"] for t in tasks["test"]]


@pytest.mark.slow
def test_grpo_trains_on_tests_pass_and_evaluate_measures_pass_at_1(tiny_sft, monkeypatch):
    from llmpipe.stages import evaluate, grpo

    monkeypatch.chdir(tiny_sft)
    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["grpo"].update(max_steps=2, save_steps=2, eval_steps=2, num_eval_prompts=0,
                       rewards=[{"name": "tests_pass", "weight": 1.0}, {"name": "python_parses", "weight": 1.0}])
    metrics = grpo.run(parse_params(raw))
    with open("logs/grpo/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and all(r["rewards/tests_pass/mean"] for r in rows), "the test reward was called"
    assert 0 <= metrics["frac_sandbox_timeouts"] <= 1 and 0 <= metrics["frac_sandbox_crashes"] <= 1

    raw["eval"].update(models=["sft"], tasks=["llmpipe_tasks"], limit=4, max_length=256, max_new_tokens=24)
    scores = evaluate.run(parse_params(raw), model="sft")
    assert scores["llmpipe_tasks.num_docs"] == 4
    for key in ("pass_at_1", "tests_pass", "distinct"):
        assert math.isfinite(scores[f"llmpipe_tasks.{key}"]) and 0 <= scores[f"llmpipe_tasks.{key}"] <= 1, key
    assert "llmpipe_tasks.pass_at_1_stderr" in scores
