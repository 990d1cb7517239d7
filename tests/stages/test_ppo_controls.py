"""PPO's controls on tiny real models: the log-probabilities it scores are those of the distribution `generate`
sampled its tokens from, under every `generation:` key; the adaptive KL controller and the value model's own
optimizer schedule, step by step in a real run; and the params that refuse what would be ignored. The controller's
arithmetic alone: tests/unit/test_kl_control.py; the exact resume of both after SIGKILL: test_resume.py."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from llmpipe.config import GenerationParams, ParamsError, load_params, parse_params
from llmpipe.models import load_tokenizer, save_model
from llmpipe.stages import ppo

GENERATION_CASES = {
    "max_new_tokens": 12,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 5,
    "min_p": 0.9,  # the untrained model is near uniform: only a high floor drops tokens
    "repetition_penalty": 3.0,
    "suppress_tokens": list(range(4, 260)),
}
"""A value off its default for every key of `GenerationParams` (the ppo section's `generation:`)."""

HOW_NOT_WHAT = {"cache_implementation": "dynamic", "num_threads": 2}
"""Keys that change how `generate` runs, not the distribution (tests/stages/test_rl_generation.py: same tokens):
values other than the shipped ones, which every case runs with."""


def test_every_generation_key_enters_the_scored_distribution_or_is_refused():
    missing = sorted(set(GenerationParams.model_fields) - set(GENERATION_CASES) - set(HOW_NOT_WHAT))
    assert not missing, (
        f"generation keys without a case here: {missing}; make each enter llmpipe.rl.ppo.sampling.sampled_logits "
        "(and add its case) or refuse it for ppo in PPOParams, naming ppo.generation.<key>"
    )


@pytest.fixture(scope="module")
def ppo_dir(tiny_sft) -> Path:
    """`tiny_sft` with a one-label models/reward on the SFT backbone (as TRL's RewardTrainer starts)."""
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_pretrained(tiny_sft / "models" / "sft", num_labels=1)
    save_model(reward, load_tokenizer(tiny_sft / "models" / "sft"), tiny_sft / "models" / "reward")
    return tiny_sft


def _params(output_root: Path, **ppo_keys):
    return load_params("params.yaml", {"paths.output_root": str(output_root),
                                       **{f"ppo.{k}": v for k, v in ppo_keys.items()}})  # fmt: skip


@pytest.mark.slow
def test_rollout_logprobs_are_those_of_the_distribution_sampled_from(ppo_dir, tmp_path, monkeypatch):
    """Per key (and all together): the rollout's recorded log-probabilities equal those of the scores `generate`
    drew the same tokens from, and differ from the raw softmax's (the key changed the distribution)."""
    from llmpipe.rl.ppo.build import build
    from llmpipe.rl.ppo.sampling import own_settings_only
    from llmpipe.rl.prompts import load_prompts
    from llmpipe.train.samples import generation_config

    monkeypatch.chdir(ppo_dir)
    params = _params(tmp_path, precision="fp32")
    tok = load_tokenizer(params.paths.tokenizer)
    prompts = load_prompts(Path(params.paths.data, "sft", "train.jsonl"), tok, 96, 8, "test")
    run, _ = build(params, tok, prompts, prompts, None, tmp_path / "run")
    policy = run.accelerator.unwrap_model(run.policy)
    cases = {**{key: {key: value} for key, value in {**GENERATION_CASES, **HOW_NOT_WHAT}.items()},
             "all": GENERATION_CASES}  # fmt: skip
    for case, setting in cases.items():
        gen = params.ppo.generation.model_copy(update=setting)
        run.cfg = params.ppo.model_copy(update={"generation": gen})
        torch.manual_seed(0)
        data, stats = run.rollout(list(range(8)))

        mask = data["mask"].bool()
        prompt_len = data["input_ids"].shape[1] - mask.shape[1]
        torch.manual_seed(0)
        policy.eval()
        with torch.no_grad(), own_settings_only(policy):
            out = policy.generate(input_ids=data["input_ids"][:, :prompt_len],
                                  attention_mask=data["attention_mask"][:, :prompt_len],
                                  generation_config=generation_config(tok, gen.max_new_tokens, gen),
                                  output_scores=True, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        policy.train()
        tokens = out.sequences[:, prompt_len:]
        assert tokens.shape == mask.shape and torch.equal(tokens[mask], data["input_ids"][:, prompt_len:][mask]), case

        sampled, raw = (torch.stack(steps, 1).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)[mask]
                        for steps in (out.scores, out.logits))  # fmt: skip
        torch.testing.assert_close(data["logprobs"][mask], sampled, atol=1e-4, rtol=0, msg=case)
        if case not in ("max_new_tokens", *HOW_NOT_WHAT):
            assert (raw - sampled).abs().max() > 1e-3, f"{case} did not change the distribution: a weak case"
        assert math.isfinite(stats["entropy"]) and math.isfinite(stats["kl"]), case


@pytest.mark.slow
def test_adaptive_kl_and_the_value_schedule_step_by_step(ppo_dir, tmp_path, monkeypatch):
    """Every step logs the coefficient its rewards used and the KL it was then fed; the next step's coefficient is
    Ziegler et al.'s update of the two. The value model's rate follows its own warmup and schedule while the
    policy's follows its own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(ppo_dir)
    params = _params(tmp_path, max_steps=4, logging_steps=1, eval_steps=4, save_steps=4, lr=1e-4, warmup_steps=0,
                     lr_scheduler_type="cosine", kl_ctrl="adaptive", kl_coef=0.05, kl_target=0.5, kl_horizon=16.0,
                     value_lr=1e-3, value_warmup_steps=2, value_lr_scheduler_type="constant_with_warmup")  # fmt: skip
    metrics = ppo.run(params)
    rows = list(csv.DictReader((tmp_path / "logs" / "ppo" / "train.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]

    cfg = params.ppo
    responses = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches
    coef = cfg.kl_coef
    for r in rows:
        assert float(r["kl_coef"]) == pytest.approx(coef, rel=1e-12), f"step {r['step']}"
        kl = float(r["kl"])
        error = min(max(kl / cfg.kl_target - 1, -0.2), 0.2)
        coef, before = coef * (1 + error * responses / cfg.kl_horizon), coef
        assert (coef > before) == (kl > cfg.kl_target), "toward the target: up above it, down below it"
    assert metrics["kl_coef_final"] == round(coef, 6)

    # transformers' schedules, with the step index s = 0, 1, 2, 3 the rate of the s-th update:
    # constant_with_warmup over 2 steps: 1e-3 * min(1, s / 2); cosine without warmup: 1e-4 * (1 + cos(pi s / 4)) / 2
    value_rates = [float(r["value_learning_rate"]) for r in rows]
    assert value_rates == pytest.approx([0.0, 5e-4, 1e-3, 1e-3], abs=1e-12)
    policy_rates = [float(r["learning_rate"]) for r in rows]
    assert policy_rates == pytest.approx([1e-4 * (1 + math.cos(math.pi * s / 4)) / 2 for s in range(4)], abs=1e-12)

    (run_dir,) = (tmp_path / "logs" / "ppo" / "tensorboard").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: [e.value for e in events.Scalars(f"train/{tag}")] for tag in ("kl_coef", "value_learning_rate")}
    assert logged["kl_coef"] == pytest.approx([float(r["kl_coef"]) for r in rows], rel=1e-6)
    assert logged["value_learning_rate"] == pytest.approx(value_rates, abs=1e-9)


def test_params_refuse_controls_that_would_be_ignored():
    with pytest.raises(ParamsError, match=r"ppo\.kl_target applies to ppo\.kl_ctrl adaptive"):
        parse_params({"ppo": {"kl_target": 3.0}})
    with pytest.raises(ParamsError, match=r"ppo\.kl_horizon applies to ppo\.kl_ctrl adaptive"):
        parse_params({"ppo": {"kl_horizon": 100.0}})
    with pytest.raises(ParamsError, match=r"ppo\.kl_coef, which is 0 and would stay 0"):
        parse_params({"ppo": {"kl_ctrl": "adaptive", "kl_coef": 0.0}})
    with pytest.raises(ParamsError, match=r"ppo\.kl_ctrl"):
        parse_params({"ppo": {"kl_ctrl": "pid"}})
    with pytest.raises(ParamsError, match=r"ppo\.value_warmup_steps \(40\) exceeds ppo\.max_steps \(36\)"):
        parse_params({"ppo": {"value_warmup_steps": 40}})
    with pytest.raises(ParamsError, match=r"ppo\.value_lr_scheduler_type cosine_with_min_lr reads schedule keys"):
        parse_params({"ppo": {"value_lr_scheduler_type": "cosine_with_min_lr"}})
    ok = parse_params({"ppo": {"kl_ctrl": "adaptive", "kl_target": 3.0, "value_lr": 1e-3,
                               "value_lr_scheduler_type": "constant"}})  # fmt: skip
    assert (ok.ppo.kl_target, ok.ppo.value_lr, ok.ppo.value_warmup_steps) == (3.0, 1e-3, None)


def test_the_value_section_takes_the_value_keys_and_keeps_the_policys_ratios():
    from llmpipe.rl.ppo.build import value_section

    cfg = parse_params({"ppo": {"lr": 1e-4, "min_lr": 1e-5, "lr_scheduler_type": "cosine_with_min_lr",
                                "value_lr": 1e-3, "value_warmup_steps": 0}}).ppo  # fmt: skip
    value = value_section(cfg)
    assert (value.lr, value.warmup_steps, value.lr_scheduler_type) == (1e-3, 0, "cosine_with_min_lr")
    assert value.min_lr / value.lr == pytest.approx(cfg.min_lr / cfg.lr)
    default = parse_params({}).ppo  # every value key null: the policy's
    same = value_section(default)
    keys = ("lr", "warmup_steps", "lr_scheduler_type", "min_lr", "muon_lr")
    assert [getattr(same, k) for k in keys] == [getattr(default, k) for k in keys]
