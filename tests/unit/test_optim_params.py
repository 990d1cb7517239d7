"""Optimiser, schedule, loss and distillation params: the offered optimisers follow the installed transformers, each
bad value has its own error naming the key, and what the machine cannot run is refused before any work."""

from __future__ import annotations

import typing

import pytest
import torch

from llmpipe.config import ParamsError, parse_params
from llmpipe.config.optim import NOT_OFFERED, OPTIM_REQUIRES, OptimName
from llmpipe.core.errors import UserError
from llmpipe.train.arguments import check_device_params


def test_offered_optimisers_are_the_installed_transformers_names():
    from transformers.training_args import OptimizerNames

    installed = {o.value for o in OptimizerNames}
    offered = set(typing.get_args(OptimName))
    assert offered - installed == {"muon"}, "every offered name but muon is a transformers name"
    assert installed - offered == set(NOT_OFFERED), (
        "a transformers optimiser is neither offered (OptimName) nor refused with a reason (NOT_OFFERED): "
        f"{sorted(installed - offered - set(NOT_OFFERED))}"
    )
    assert set(OPTIM_REQUIRES) <= offered


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"train": {"optim": "adamw"}}, r"train\.optim: Input should be 'adamw_torch'"),
        ({"sft": {"optim": "lomo"}}, r"sft\.optim: 'lomo' is not offered: it updates the weights inside backward"),
        ({"sft": {"optim": "galore_adamw"}}, r"sft\.optim: 'galore_adamw' is not offered: .*peft"),
        ({"sft": {"muon_lr": 0.05}}, r"sft\.muon_lr \(0\.05\) applies to sft\.optim muon, not 'adamw_torch'"),
        ({"train": {"optim": "muon", "muon_momentum": 1.0}}, r"train\.muon_momentum: Input should be less than 1"),
        ({"dpo": {"min_lr": 1e-5}}, r"dpo\.min_lr \(1e-05\) applies to dpo\.lr_scheduler_type cosine_with_min_lr or w"),
        ({"train": {"lr_scheduler_type": "cosine_with_min_lr"}}, r"cosine_with_min_lr needs train\.min_lr > 0"),
        ({"sft": {"lr_scheduler_type": "cosine_with_min_lr", "min_lr": 0.01}},
         r"sft\.min_lr \(0\.01\) must be below sft\.lr \(0\.0003\)"),
        ({"sft": {"num_cycles": 3}}, r"sft\.num_cycles \(3\) applies to sft\.lr_scheduler_type cosine_with_restarts"),
        ({"sft": {"lr_scheduler_type": "cosine_with_restarts", "num_cycles": 0}}, r"sft\.num_cycles: .*greater than 0"),
        ({"sft": {"lr_scheduler_type": "warmup_stable_decay", "decay_fraction": 0}},
         r"sft\.decay_fraction: Input should be greater than 0"),
        ({"sft": {"lr_scheduler_type": "warmup_stable_decay", "decay_type": "exp"}}, r"sft\.decay_type: Input should"),
        ({"sft": {"decay_fraction": 0.5}}, r"sft\.decay_fraction \(0\.5\) applies to sft\.lr_scheduler_type warm"),
        ({"sft": {"lr_scheduler_type": "warmup_stable_decay", "max_steps": -1}},
         r"sft\.lr_scheduler_type warmup_stable_decay places its decay by the step budget: set sft\.max_steps"),
        ({"train": {"lr_scheduler_type": "polynomial"}}, r"train\.lr_scheduler_type: Input should be 'linear'"),
        ({"sft": {"loss": {"critical_tokens": ["</s>"]}}}, r"sft\.loss: critical_tokens are set but critical_alpha"),
        ({"pretrain": {"loss": {"critical_alpha": 3.0}}}, r"pretrain\.loss: critical_alpha is 3\.0 but critical_tok"),
        ({"sft": {"loss": {"critical_tokens": ["a", "a"], "critical_alpha": 2}}}, r"lists a token twice"),
        ({"sft": {"loss": {"label_smoothing": 1.0}}}, r"sft\.loss\.label_smoothing: Input should be less than 1"),
        ({"train": {"loss": {"label_smoothing": 0.1}}}, r"train\.loss: unknown key"),
        ({"dpo": {"loss": {"label_smoothing": 0.1}}}, r"dpo\.loss: unknown key"),
        ({"sft": {"distill": {"temperature": 2.0}}}, r"sft\.distill: temperature set but teacher is null"),
        ({"sft": {"distill": {"teacher": "pretrain", "alpha": 1.5}}}, r"sft\.distill\.alpha: .*less than or equal"),
        ({"sft": {"distill": {"teacher": "pretrain", "beta": -1}}}, r"sft\.distill\.beta: .*greater than or equal"),
    ],
)
def test_each_bad_value_has_its_own_error(raw, message):
    with pytest.raises(ParamsError, match=message):
        parse_params(raw)


def test_each_schedule_and_optimiser_key_validates_where_it_applies():
    params = parse_params({
        "train": {"optim": "muon", "muon_lr": 0.01},
        "sft": {"lr_scheduler_type": "cosine_with_min_lr", "min_lr": 1e-5},
        "dpo": {"lr_scheduler_type": "warmup_stable_decay", "decay_fraction": 0.3, "decay_type": "1-sqrt"},
        "reward": {"lr_scheduler_type": "cosine_with_restarts", "num_cycles": 3},
        "pretrain": {"loss": {"critical_tokens": ["</s>"], "critical_alpha": 2.0, "label_smoothing": 0.1}},
    })  # fmt: skip
    assert params.ppo.optim == "muon" and params.sft.muon_lr == 0.01
    assert params.reward.num_cycles == 3 and params.dpo.decay_type == "1-sqrt"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_an_optimiser_the_machine_cannot_run_is_refused_before_work():
    with pytest.raises(UserError, match=r"dpo\.optim: lion_8bit runs on a CUDA GPU only|dpo\.optim: lion_8bit needs"):
        check_device_params(parse_params({"dpo": {"optim": "lion_8bit"}}), "dpo")
    with pytest.raises(UserError, match=r"train\.optim: stable_adamw needs the optimi package"):
        check_device_params(parse_params({"train": {"optim": "stable_adamw"}}), "sft")
    check_device_params(parse_params({"train": {"optim": "schedule_free_adamw"}}), "sft")  # installed: accepted


def test_muon_is_refused_under_a_sharding_strategy():
    from llmpipe.train.optimizers import check_optimizer

    with pytest.raises(UserError, match=r"sft\.optim: muon .* distributed\.strategy fsdp; use ddp or none"):
        check_optimizer("muon", "sft.optim", "fsdp")
    check_optimizer("muon", "sft.optim", "ddp")


def test_liger_is_refused_where_it_cannot_act():
    # ppo's own loop is refused on any machine; the name is the stage's own key, whether set there or inherited
    with pytest.raises(UserError, match=r"ppo\.use_liger_kernel: ppo trains in a loop of its own"):
        check_device_params(parse_params({"ppo": {"use_liger_kernel": True}}), "ppo")
    with pytest.raises(UserError, match=r"train\.use_liger_kernel: ppo trains in a loop of its own"):
        check_device_params(parse_params({"train": {"use_liger_kernel": True}}), "ppo")
    check_device_params(parse_params({"ppo": {"use_liger_kernel": True}}), "sft")  # sft does not inherit ppo's


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_liger_without_a_gpu_is_refused_before_work():
    with pytest.raises(UserError, match=r"sft\.use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs"):
        check_device_params(parse_params({"sft": {"use_liger_kernel": True}}), "sft")
