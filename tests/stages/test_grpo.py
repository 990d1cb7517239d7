"""The `grpo` stage: params map onto TRL's GRPOConfig for every loss type TRL accepts, checkpoints can only
fall between generation rounds, and a few steps on a tiny real model train every parameter and report the
reward trend."""

from __future__ import annotations

import csv
import math
import re
from typing import get_args

import pytest

from llmpipe.config import GRPOLossType, ParamsError, load_params, parse_params
from llmpipe.models import load_model
from llmpipe.stages import grpo


def test_loss_types_are_the_ones_trl_accepts():
    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = re.search(r"Supported values are (.*?)\.", help_text).group(1)
    assert set(get_args(GRPOLossType)) == set(re.findall(r"'(\w+)'", supported))


@pytest.mark.parametrize("loss_type", get_args(GRPOLossType))
def test_every_loss_type_reaches_grpo_config(loss_type, tmp_path):
    level = "sequence" if loss_type == "luspo" else "token"
    params = parse_params({"grpo": {"loss_type": loss_type, "importance_sampling_level": level,
                                    "epsilon_high": 0.28, "sapo_temperature_neg": 1.2, "vespo_k_neg": 2.5,
                                    "generation": {"max_new_tokens": 32, "suppress_tokens": [7], "top_k": 5}}})
    cfg = grpo.grpo_config(params, tmp_path)
    assert (cfg.loss_type, cfg.importance_sampling_level) == (loss_type, level)
    assert (cfg.epsilon_high, cfg.sapo_temperature_neg, cfg.vespo_k_neg) == (0.28, 1.2, 2.5)
    assert (cfg.max_completion_length, cfg.top_k) == (32, 5)
    assert cfg.generation_kwargs == {"suppress_tokens": [7]}
    assert cfg.reward_weights == [s.weight for s in params.grpo.rewards]


def test_save_steps_must_fall_between_generation_rounds():
    with pytest.raises(ParamsError, match=r"grpo\.save_steps \(3\).*grpo\.steps_per_generation \(2\) × "
                                          r"grpo\.num_iterations \(2\) = 4"):
        parse_params({"grpo": {"save_steps": 3, "steps_per_generation": 2, "num_iterations": 2}})
    ok = parse_params({"grpo": {"save_steps": 8, "steps_per_generation": 2, "num_iterations": 2}})
    assert ok.grpo.save_steps == 8


def test_grpo_params_that_trl_would_reject_late_fail_at_load():
    with pytest.raises(ParamsError, match=r"not a multiple of grpo\.num_generations \(8\)"):
        parse_params({"grpo": {"per_device_train_batch_size": 12}})
    with pytest.raises(ParamsError, match=r"grpo\.loss_type luspo .*grpo\.importance_sampling_level to sequence"):
        parse_params({"grpo": {"loss_type": "luspo"}})
    with pytest.raises(ParamsError, match=r"grpo\.loss_type"):
        parse_params({"grpo": {"loss_type": "ppo"}})
    with pytest.raises(ParamsError, match=r"grpo\.rewards\.0\.name"):
        parse_params({"grpo": {"rewards": [{"name": "compiles"}]}})


def test_rl_metrics_first_and_last_tenth():
    history = [{"reward": float(i), "completions/mean_length": 10.0 - i / 10, "frac_reward_zero_std": 0.25,
                "kl": i / 100} for i in range(20)] + [{"train_loss": 0.1}]
    m = grpo.rl_metrics(history)
    assert (m["reward_first"], m["reward_last"]) == (0.5, 18.5)  # steps 0-1 and 18-19
    assert m["reward_first_se"] == m["reward_last_se"] == pytest.approx(0.5)
    assert (m["response_length_first"], m["response_length_last"]) == (9.95, 8.15)
    assert m["frac_zero_std_groups"] == 0.25 and m["kl_final"] == 0.185


def test_a_run_whose_every_completion_was_clipped_says_so():
    clipped = [{"reward": 0.0, "completions/mean_length": 3.0, "frac_reward_zero_std": 1.0,
                "completions/clipped_ratio": 1.0} for _ in range(4)]
    warning = grpo.all_clipped(clipped, 3)
    assert warning.startswith("grpo: every completion of all 4 logged steps was cut at "
                              "grpo.generation.max_new_tokens (3) before its eos")
    assert grpo.rl_metrics(clipped)["frac_clipped"] == 1.0
    some = [*clipped[:3], {**clipped[3], "completions/clipped_ratio": 0.75}]
    assert grpo.all_clipped(some, 3) is None and grpo.rl_metrics(some)["frac_clipped"] == pytest.approx(0.9375)
    assert grpo.all_clipped([{"train_loss": 0.1}], 3) is None


@pytest.mark.slow
def test_grpo_stage_trains_every_parameter(tiny_sft, monkeypatch):
    monkeypatch.chdir(tiny_sft)
    params = load_params("params.yaml")
    initial = {n: p.detach().clone() for n, p in load_model("models/sft", "").named_parameters()}
    metrics = grpo.run(params)

    with open("logs/grpo/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == params.grpo.max_steps
    assert all(math.isfinite(float(r["loss"])) and r["reward"] for r in rows), "loss and reward logged"
    assert metrics["steps"] == params.grpo.max_steps

    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained("models/grpo")
    unchanged = [n for n, p in saved.named_parameters() if p.equal(initial[n])]
    assert unchanged == [], f"parameters that did not train: {unchanged}"
    for key in ("reward_first", "reward_last", "response_length_first", "response_length_last", "kl_final",
                "frac_zero_std_groups", "frac_clipped", "eval_reward"):
        assert math.isfinite(metrics[key]), key


def test_a_users_reward_function_reaches_the_logged_reward(tiny_sft, user_reward_module, monkeypatch):
    import importlib
    from pathlib import Path

    import yaml

    monkeypatch.chdir(tiny_sft)
    raw = yaml.safe_load(Path("params.yaml").read_text())
    raw["grpo"].update(max_steps=2, save_steps=2, eval_steps=2, num_eval_prompts=0, rewards=[{"name": f"{user_reward_module}:constant",
                                                                            "weight": 2.0}])  # fmt: skip
    metrics = grpo.run(parse_params(raw))

    calls = importlib.import_module(user_reward_module).CALLS
    assert calls and set(calls) == {raw["grpo"]["per_device_train_batch_size"]}, "called once per batch of completions"
    with open("logs/grpo/train.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [float(r["reward"]) for r in rows] == [0.5, 0.5], "weight 2.0 × the function's 0.25"
    assert metrics["eval_reward"] == 0.5


# ---- the reference sync (TRL's sync_ref_model; TR-DPO) -------------------------------------------------------------


def test_reference_sync_reaches_grpo_config_field_by_field(tmp_path):
    params = parse_params({"grpo": {"sync_ref_model": True, "ref_model_mixup_alpha": 0.3, "ref_model_sync_steps": 7}})
    cfg = grpo.grpo_config(params, tmp_path)
    assert (cfg.sync_ref_model, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps) == (True, 0.3, 7)
    assert grpo.grpo_config(parse_params({}), tmp_path).sync_ref_model is False


def test_reference_sync_is_refused_where_it_cannot_work_or_would_be_ignored():
    with pytest.raises(ParamsError, match=r"grpo\.sync_ref_model needs a reference, and grpo\.beta 0 loads none"):
        parse_params({"grpo": {"sync_ref_model": True, "beta": 0.0}})
    with pytest.raises(ParamsError, match=r"grpo\.sync_ref_model with grpo\.peft\.method lora: .*adapter disabled"):
        parse_params({"grpo": {"sync_ref_model": True, "peft": {"method": "lora"}}})
    with pytest.raises(ParamsError, match=r"grpo\.ref_model_mixup_alpha applies only with grpo\.sync_ref_model"):
        parse_params({"grpo": {"ref_model_mixup_alpha": 0.9}})
    with pytest.raises(ParamsError, match=r"grpo\.ref_model_sync_steps \(200\) exceeds grpo\.max_steps \(100\)"):
        parse_params({"grpo": {"sync_ref_model": True, "ref_model_sync_steps": 200}})
    with pytest.raises(ParamsError, match=r"grpo\.sync_ref_model under distributed\.strategy fsdp"):
        parse_params({"grpo": {"sync_ref_model": True}, "distributed": {"strategy": "fsdp"}})
    assert parse_params({"grpo": {"sync_ref_model": True, "peft": {"method": "bitfit"}}}).grpo.sync_ref_model


@pytest.mark.slow
def test_the_reference_moves_exactly_at_the_sync_steps_by_the_mixup_formula(tiny_sft, tmp_path, monkeypatch):
    """Weights of policy and reference after every optimizer step: between syncs the reference stays as it was;
    at each sync step it becomes alpha × policy + (1 - alpha) × previous reference; each checkpoint holds it."""
    import torch
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from llmpipe.rl.reference import REFERENCE_FILE

    def weights(model) -> dict:  # the state dict: a tied head under both its names, as the checkpoint saves one
        return {n: t.detach().clone() for n, t in model.state_dict().items()}

    class Snapshots(TrainerCallback):
        def __init__(self, trainer) -> None:
            self.trainer, self.steps = trainer, []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append((weights(self.trainer.model), weights(self.trainer.ref_model)))

    class Recorded(grpo.GRPO):
        def make_trainer(self, *args):
            trainer = super().make_trainer(*args)
            self.snapshots = Snapshots(trainer)
            trainer.add_callback(self.snapshots)  # after TRL's SyncRefModelCallback: it sees each step's sync
            return trainer

    monkeypatch.chdir(tiny_sft)
    alpha, every = 0.5, 2
    params = load_params("params.yaml", {"paths.output_root": str(tmp_path), "grpo.sync_ref_model": True,
                                         "grpo.ref_model_mixup_alpha": alpha, "grpo.ref_model_sync_steps": every})  # fmt: skip
    stage = Recorded(params)
    stage.run()

    assert len(stage.snapshots.steps) == params.grpo.max_steps == 4
    previous = weights(load_model("models/sft", ""))
    for step, (policy, reference) in enumerate(stage.snapshots.steps, start=1):
        assert reference.keys() == previous.keys()
        if step % every:
            assert all(torch.equal(reference[n], previous[n]) for n in reference), f"step {step}: moved between syncs"
        else:
            for n in reference:  # TRL's update: ref.mul_(1 - alpha).add_(policy, alpha=alpha)
                torch.testing.assert_close(reference[n], previous[n] * (1 - alpha) + alpha * policy[n], atol=1e-7,
                                           rtol=0, msg=f"step {step}: {n}")  # fmt: skip
            assert any(not torch.equal(reference[n], previous[n]) for n in reference), f"step {step}: no change"
        previous = reference
    for step in (2, 4):
        (saved,) = tmp_path.glob(f"checkpoints/grpo/*/checkpoint-{step}/{REFERENCE_FILE}")
        stored, recorded = load_file(saved), stage.snapshots.steps[step - 1][1]
        assert stored.keys() <= recorded.keys() and all(torch.equal(stored[n], recorded[n]) for n in stored)
