"""The `reward` stage on a tiny real model: it trains (finite logged loss, every parameter moves), saves a
standard one-label sequence-classification directory, and reports held-out accuracy per corruption type."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from llmpipe.config import load_params
from llmpipe.data.loading import load_split
from llmpipe.models import load_model
from llmpipe.stages import reward


@pytest.mark.slow
def test_reward_stage_trains_saves_and_scores_held_out_pairs(tiny_sft, monkeypatch):
    monkeypatch.chdir(tiny_sft)
    params = load_params("params.yaml")
    metrics = reward.run(params)

    with open("logs/reward/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert rows and all(math.isfinite(float(r["loss"])) for r in rows), "loss logged and finite"
    assert metrics["steps"] == params.reward.max_steps
    # The stdlib pairs differ token for token; reward.max_length (128) leaves the longer ones out, and says how many.
    assert metrics["num_identical_pairs"] == 0 and metrics["num_too_long"] > 0

    from transformers import AutoModelForSequenceClassification, set_seed

    saved = AutoModelForSequenceClassification.from_pretrained("models/reward")
    assert saved.config.num_labels == 1
    assert saved.config.pad_token_id is not None
    set_seed(params.reward.seed)  # the stage's initial model: SFT body + the same seeded score head
    initial = dict(load_model("models/sft", "", num_labels=1).named_parameters())
    unchanged = [n for n, p in saved.named_parameters() if p.equal(initial[n])]
    assert unchanged == [], f"parameters that did not train: {unchanged}"

    kinds = set(load_split(Path(params.paths.data, "preference", "test.jsonl"), ("corruption",))["corruption"])
    assert kinds == {"swap", "truncate", "syntax"}
    for key in ["accuracy", "mean_margin"] + [f"accuracy_{k}" for k in kinds]:
        assert math.isfinite(metrics[key]), key
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["num_pairs"] > 0


def test_margin_column_is_kept_when_the_data_has_one(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 0.5, "name": "f"}\n')
    ds = load_split(path, reward.COLUMNS, optional=("margin",))
    assert ds.column_names == ["prompt", "chosen", "rejected", "margin"]
    path.write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    assert load_split(path, reward.COLUMNS, optional=("margin",)).column_names == list(reward.COLUMNS)
