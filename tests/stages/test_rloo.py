"""The `rloo` stage: its params map onto TRL's RLOOConfig (grpo's shared keys and RLOO's own, none of GRPO's
alone), its section takes grpo's values for the keys they share, and a few steps on a tiny real model log the loss
and reward and train every parameter."""

from __future__ import annotations

import csv
import math

import pytest

from llmpipe.config import ParamsError, load_params, parse_params
from llmpipe.models import load_model
from llmpipe.stages import rloo


def test_params_reach_rloo_config(tmp_path):
    params = parse_params({"rloo": {"beta": 0.1, "num_generations": 4, "epsilon_high": 0.28, "normalize_advantages": True,
                                    "reward_clip_range": [-1.0, 2.0], "generation": {"max_new_tokens": 32, "top_k": 5}}})  # fmt: skip
    cfg = rloo.rloo_config(params, tmp_path)
    assert (cfg.beta, cfg.num_generations, cfg.epsilon_high, cfg.normalize_advantages) == (0.1, 4, 0.28, True)
    assert tuple(cfg.reward_clip_range) == (-1.0, 2.0)
    assert (cfg.max_completion_length, cfg.top_k, cfg.learning_rate) == (32, 5, params.rloo.lr)
    assert cfg.reward_weights == [s.weight for s in params.rloo.rewards]


def test_grpo_only_keys_are_refused_under_rloo():
    with pytest.raises(ParamsError, match=r"rloo\.loss_type: unknown key"):
        parse_params({"rloo": {"loss_type": "dapo"}})
    with pytest.raises(ParamsError, match=r"not a multiple of rloo\.num_generations \(8\)"):
        parse_params({"rloo": {"per_device_train_batch_size": 12}})


def test_rloo_takes_grpos_values_for_the_keys_it_shares():
    params = parse_params({"train": {"seed": 7}, "grpo": {"lr": 0.01, "loss_type": "dr_grpo", "beta": 0.3,
                                                          "rewards": [{"name": "python_parses"}],
                                                          "generation": {"temperature": 0.5}},
                           "rloo": {"beta": 0.1, "generation": {"top_k": 3}}})  # fmt: skip
    r = params.rloo
    assert (r.lr, r.seed, r.beta, [s.name for s in r.rewards]) == (0.01, 7, 0.1, ["python_parses"])
    assert (r.generation.temperature, r.generation.top_k) == (0.5, 3), "a block merges key by key"
    assert params.source_of("rloo", "lr") == "grpo.lr" and params.source_of("rloo", "beta") == "rloo.beta"
    with pytest.raises(ParamsError, match=r"grpo\.num_generations \(3\)"):  # named where it was set
        parse_params({"grpo": {"num_generations": 3}})


@pytest.mark.slow
def test_rloo_stage_trains_every_parameter(tiny_sft, monkeypatch):
    monkeypatch.chdir(tiny_sft)
    params = load_params("params.yaml")
    initial = {n: p.detach().clone() for n, p in load_model("models/sft", "").named_parameters()}
    metrics = rloo.run(params)

    with open("logs/rloo/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == metrics["steps"] == params.rloo.max_steps
    assert all(math.isfinite(float(r["loss"])) and r["reward"] for r in rows), "loss and reward logged"
    saved = load_model("models/rloo", "")
    unchanged = [n for n, p in saved.named_parameters() if p.requires_grad and p.equal(initial[n])]
    assert unchanged == [], f"parameters that did not train: {unchanged}"
    for key in ("reward_first", "reward_last", "kl_final", "frac_zero_std_groups", "eval_reward"):
        assert math.isfinite(metrics[key]), key
