"""Params → the HF `TrainingArguments` keywords of a training stage: the one place our params reach the Trainer
(and every TRL `<Method>Config`, which subclass it), and the device-dependent choice of precision."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmpipe.config import Params, TrainParams
from llmpipe.config.adapter_rules import stage_refusal
from llmpipe.config.stages import ADAPTER_TASKS, REGISTRY, TRAINING_TASKS, best_metric
from llmpipe.core.errors import UserError
from llmpipe.train.trackers import tracker_kwargs

log = logging.getLogger(__name__)


def resolve_precision(precision: str, key: str = "train.precision") -> tuple[bool, bool]:
    """Map a stage's ``precision`` to ``(bf16, fp16)`` for the device this process will train on.

    `auto` is bf16 on a CUDA device that supports it, or on a CPU with native bf16 (AVX512-BF16/AMX);
    otherwise fp32. An explicit bf16 on a CPU without native bf16 is honoured with a warning: its matmuls
    are emulated, far slower than fp32 (see docs/LOG.md).

    Args:
        precision: ``auto``, ``bf16``, ``fp16`` or ``fp32``.
        key: The params key the value was set under, for messages (`Params.source_of`).

    Raises:
        UserError: fp16 was asked for without a CUDA device, or bf16 on a GPU that lacks it.
    """
    import torch

    cuda = torch.cuda.is_available()
    if precision == "fp32":
        return False, False
    if precision == "fp16":
        if not cuda:
            raise UserError(f"{key}: fp16 needs a CUDA device; use bf16, auto or fp32 on CPU")
        return False, True
    if cuda:
        supported = torch.cuda.is_bf16_supported()
    else:
        supported = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if precision == "bf16" and cuda and not supported:
        raise UserError(f"{key}: this GPU has no bf16; use fp16, auto or fp32")
    if precision == "bf16" and not cuda and not supported:
        log.warning(
            "%s: bf16 on a CPU without native bf16 (AVX512-BF16/AMX) emulates its matmuls, "
            "about 20x slower than fp32 on a 2-core AVX2 machine; auto picks fp32 here", key
        )
    return (precision == "bf16" or supported), False


def check_device_params(params: Params, stage: str) -> None:
    """Refuse params the stage being run cannot train with before it does any work (`llm-train` calls it before the
    stage loads a model or opens its run folder): its ``precision``, ``optim`` and ``use_liger_kernel`` on this
    device, and its `peft:` with its ``optim`` (`llmpipe.config.adapter_rules.stage_refusal`, for what it inherits from
    `train:`).

    Args:
        params: Validated params.
        stage: The task being run; a stage that does not train is not checked.

    Raises:
        UserError: See :func:`resolve_precision`, `llmpipe.train.optimizers.check_optimizer`,
            :func:`check_liger` and `llmpipe.config.adapter_rules.stage_refusal`; the message names the key where the value
            was set (``dpo.precision`` under ``dpo``, ``train.precision`` when inherited).
    """
    from llmpipe.train.optimizers import check_optimizer

    if stage in TRAINING_TASKS:
        resolve_precision(params.stage(stage).precision, params.source_of(stage, "precision"))
        check_optimizer(params.stage(stage).optim, params.source_of(stage, "optim"), params.distributed.strategy)
        if params.stage(stage).use_liger_kernel:
            check_liger(stage, params.source_of(stage, "use_liger_kernel"))
    if stage in ADAPTER_TASKS and (why := stage_refusal(params, stage)):
        raise UserError(why.message)


def check_liger(stage: str, key: str) -> None:
    """Refuse ``use_liger_kernel`` where it cannot act: without a CUDA GPU (Liger's kernels are Triton GPU
    kernels), without the ``liger-kernel`` package, or in a stage whose training loop is not the HF Trainer's
    (the registry's ``hf_trainer`` trait: the Trainer applies Liger's patches to its model, our PPO loop does not).

    Raises:
        UserError: Naming `key` and what to do.
    """
    import importlib.util

    import torch

    if not REGISTRY[stage].hf_trainer:
        raise UserError(f"{key}: {stage} trains in a loop of its own, not the HF Trainer, which is what applies "
                        f"Liger's patches; set {stage}.use_liger_kernel: false")  # fmt: skip
    if not torch.cuda.is_available():
        raise UserError(f"{key}: Liger's kernels are Triton kernels for CUDA GPUs and this machine has none; set it "
                        "to false")  # fmt: skip
    if importlib.util.find_spec("liger_kernel") is None:
        raise UserError(f"{key} needs the liger-kernel package: pip install liger-kernel")


def training_kwargs(params: Params, stage: str, output_dir: Path) -> dict[str, Any]:
    """The `TrainingArguments` keywords of a stage: the one place our params reach the HF Trainer.

    Args:
        params: Validated params.
        stage: A training stage section name (one of `llmpipe.config.stages.TRAINING_TASKS`).
        output_dir: The run's checkpoint folder.

    Returns:
        Keyword arguments valid for `TrainingArguments` and every TRL `<Method>Config`.
    """
    import torch

    from llmpipe.train.optimizers import schedule_kwargs, trainer_optim

    t: TrainParams = params.stage(stage)
    metric_for_best, greater_is_better = best_metric(stage, t)
    bf16, fp16 = resolve_precision(t.precision, params.source_of(stage, "precision"))
    return {
        "output_dir": str(output_dir),
        "learning_rate": t.lr,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "per_device_eval_batch_size": t.per_device_eval_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "max_steps": t.resolved_max_steps,
        "num_train_epochs": t.num_train_epochs,
        "warmup_steps": t.warmup_steps,
        "lr_scheduler_type": t.lr_scheduler_type,
        "lr_scheduler_kwargs": schedule_kwargs(t, t.resolved_max_steps),
        "weight_decay": t.weight_decay,
        "adam_beta1": t.adam_beta1,
        "adam_beta2": t.adam_beta2,
        "max_grad_norm": t.max_grad_norm,
        "optim": trainer_optim(t),  # muon: llmpipe.train.optimizers.attach gives the Trainer its factory
        "seed": t.seed,
        "data_seed": t.seed,
        "bf16": bf16,
        "fp16": fp16,
        "logging_steps": t.logging_steps,
        "eval_strategy": "steps",
        "eval_steps": t.eval_steps,
        "save_strategy": "steps",
        "save_steps": t.save_steps,
        "save_total_limit": None,  # RotateCheckpoints keeps t.save_total_limit plus the best
        "metric_for_best_model": metric_for_best,
        "greater_is_better": greater_is_better,
        "dataloader_num_workers": t.dataloader_num_workers,
        "use_liger_kernel": t.use_liger_kernel,
        "activation_checkpointing": params.distributed.gradient_checkpointing,
        "torch_compile": params.distributed.torch_compile,
        # transformers turns torch_compile on whenever a mode is given, so the mode goes only with compile on.
        "torch_compile_mode": params.distributed.torch_compile_mode if params.distributed.torch_compile else None,
        "ddp_find_unused_parameters": False,  # every parameter of our models gets a gradient each step
        "use_cpu": not torch.cuda.is_available(),
        "include_num_input_tokens_seen": True,
        "logging_nan_inf_filter": False,  # a NaN step loss must reach NonFiniteLossGuard, not be averaged away
        "disable_tqdm": True,  # llmpipe.train.progress draws the one bar (or plain lines off a terminal)
        **tracker_kwargs(params, stage),  # report_to, run_name, project (TensorBoard: our own callback)
    }
