"""A PPO run assembled on an `Accelerator`: policy and frozen reference from models/<policy>, value and reward
models from models/reward, an optimizer and a schedule for each trained model, and the KL controller. With a `ppo.peft` adapter, policy and value model each train
their own adapter (the value model's `score` head in full) and the reference is the policy with its adapter
disabled: one copy of the policy's weights.

The value model and the reward model are one-label `AutoModelForSequenceClassification` models from
models/reward, whose backbone and `score` head run on every position (a value per token; the reward is the score
of the last real token). The models share no parameters, so the one loss ``pg + vf_coef * vf`` gives each its
own gradient; each has its own optimizer and schedule (``ppo.value_lr``, ``value_warmup_steps``,
``value_lr_scheduler_type``, each the policy's when null, as `llm_trainer`'s ``value_optim_config``), where TRL's
PPOTrainer had one for both; gradients are clipped per model, so a large value gradient never shrinks the
policy's step.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from llmpipe.config import Params, PPOParams
from llmpipe.core.errors import UserError
from llmpipe.data.tokens import PackedBlocks
from llmpipe.distributed.launch import check_world
from llmpipe.models import load_model, load_pretrained
from llmpipe.models.folders import ADAPTER_CONFIG
from llmpipe.models.tokenizer_identity import check_same_tokenizer
from llmpipe.rl.ppo.kl_control import KLController
from llmpipe.rl.ppo.loop import PPORun, prompts_per_step
from llmpipe.rl.ppo.losses import RunningMeanStd
from llmpipe.rl.prompts import IndexStream, Prompts
from llmpipe.train import adapters
from llmpipe.train.arguments import resolve_precision, training_kwargs
from llmpipe.train.optimizers import muon_with_adamw, schedule_kwargs

REWARD_MISSING = "run the reward stage first (dvc repro reward)"


def load_value_model(path: Path, trust_remote_code: bool = False):
    """A one-label `AutoModelForSequenceClassification` with a `score` head (what the reward stage saves).

    Args:
        path: The reward model folder.
        trust_remote_code: Let pickled weights or ``auto_map`` code load (see `llmpipe.models`).

    Raises:
        UserError: The folder is missing or refused, or the model has more than one label or no `score` head.
    """
    from transformers import AutoModelForSequenceClassification

    if (Path(path) / ADAPTER_CONFIG).exists():  # a reward adapter (reward.peft.merge: false) over its base
        model = load_model(path, REWARD_MISSING, num_labels=1, trust_remote_code=trust_remote_code)
    else:
        model = load_pretrained(AutoModelForSequenceClassification, path, REWARD_MISSING, trust_remote_code)
    if model.config.num_labels != 1 or not hasattr(model, "score"):
        raise UserError(f"{path}: expected a one-label sequence-classification model with a `score` head")
    return model


def value_section(cfg: PPOParams) -> PPOParams:
    """The ``ppo`` section as the value model's optimizer and schedule read it: ``value_lr``,
    ``value_warmup_steps`` and ``value_lr_scheduler_type`` in place of ``lr``, ``warmup_steps`` and
    ``lr_scheduler_type`` (each null: the policy's). ``min_lr`` and ``muon_lr`` scale with the rate, so the value
    model keeps the policy's floor and Muon-to-AdamW ratios."""
    lr = cfg.value_lr or cfg.lr
    scale = lr / cfg.lr
    warmup = cfg.warmup_steps if cfg.value_warmup_steps is None else cfg.value_warmup_steps
    return cfg.model_copy(update={"lr": lr, "min_lr": cfg.min_lr * scale, "muon_lr": cfg.muon_lr * scale,
                                  "warmup_steps": warmup,
                                  "lr_scheduler_type": cfg.value_lr_scheduler_type or cfg.lr_scheduler_type})  # fmt: skip


def make_optimizer(params: Params, run_dir: Path, model, cfg: PPOParams) -> torch.optim.Optimizer:
    """The `train.optim` optimizer over `model`'s trainable parameters at peak rate ``cfg.lr`` (HF Trainer's
    mapping of our params); weight decay on matrices and embeddings only (parameters of 2+ dimensions), as in
    GPT-2/nanoGPT. ``muon``: Muon on the hidden weight matrices, AdamW on the rest
    (`llmpipe.train.optimizers.muon_with_adamw`).

    Args:
        params: Validated params (the optimizer's name and its keys).
        run_dir: The run's checkpoint folder (`TrainingArguments` wants one).
        model: The policy or the value model.
        cfg: ``params.ppo`` for the policy, :func:`value_section` of it for the value model.
    """
    from transformers import Trainer, TrainingArguments

    if cfg.optim == "muon":
        return muon_with_adamw(cfg, [model])
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(**training_kwargs(params, "ppo", run_dir)))
    weights = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in weights if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in weights if p.ndim < 2], "weight_decay": 0.0},
    ]
    return cls(groups, **{**kwargs, "lr": cfg.lr})


def make_scheduler(cfg: PPOParams, optimizer, num_steps: int):
    """transformers' `get_scheduler` of ``cfg.lr_scheduler_type`` with ``cfg.warmup_steps`` over `num_steps`."""
    from transformers import get_scheduler

    return get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.warmup_steps, num_steps,
                         scheduler_specific_kwargs=schedule_kwargs(cfg, num_steps))  # fmt: skip


def total_steps(cfg: PPOParams, num_prompts: int) -> int:
    """`max_steps`, or as many PPO steps as `num_train_epochs` passes over the prompts take."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * num_prompts / prompts_per_step(cfg)))


def build(
    params: Params,
    tokenizer,
    train: Prompts,
    valid: Prompts,
    ptx: PackedBlocks | None,
    run_dir: Path,
    trust_remote_code: bool = False,
) -> tuple[PPORun, int]:
    """Models, optimizer and schedule on an `Accelerator`, and the checkpointed state objects registered.

    Args:
        params: Validated params.
        tokenizer: The pipeline tokenizer.
        train: Training prompts.
        valid: Validation prompts.
        ptx: Pretraining blocks for the ptx loss (None when ``ppo.ptx_coef`` is 0).
        run_dir: The run's checkpoint folder.
        trust_remote_code: Let model folders with pickled weights or ``auto_map`` code load.

    Returns:
        The run and its number of PPO steps.

    Raises:
        UserError: A model is missing or was trained with another tokenizer than ``paths.tokenizer``, or
            ``ppo.max_length`` exceeds the policy's context.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    cfg, paths = params.ppo, params.paths
    set_seed(cfg.seed)
    policy_dir = Path(paths.models, cfg.policy)
    missing = f"run the {cfg.policy} stage first (dvc repro {cfg.policy})"
    peft, attn = cfg.peft, params.model.attn_implementation
    policy = load_model(policy_dir, missing, trust_remote_code=trust_remote_code, attn_implementation=attn,
                        **adapters.load_kwargs(peft, "ppo"))  # fmt: skip
    adapter = peft.method not in ("none", "bitfit")  # the reference is then the policy with its adapter disabled
    ref_policy = None if adapter else load_model(policy_dir, missing, trust_remote_code=trust_remote_code,
                                                 attn_implementation=attn)  # fmt: skip
    if cfg.max_length > policy.config.max_position_embeddings:
        raise UserError(
            f"ppo.max_length ({cfg.max_length}) exceeds the max_position_embeddings of {policy_dir} "
            f"({policy.config.max_position_embeddings}); lower it"
        )
    value_model = load_value_model(Path(paths.models, "reward"), trust_remote_code)
    for model_dir in (policy_dir, Path(paths.models, "reward")):
        check_same_tokenizer(model_dir, tokenizer, paths.tokenizer)
    policy = adapters.wrap(policy, peft, "ppo", policy_dir, "CAUSAL_LM", seed=cfg.seed)
    value_model = adapters.wrap(value_model, peft, "ppo", Path(paths.models, "reward"), "SEQ_CLS", seed=cfg.seed)
    reward_model = load_value_model(Path(paths.models, "reward"), trust_remote_code) if cfg.reward_model else None
    if params.distributed.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        value_model.gradient_checkpointing_enable()
    num_steps = total_steps(cfg, len(train.ids))
    optimizers, schedulers = [], []
    for model, section in ((policy, cfg), (value_model, value_section(cfg))):
        optimizers.append(make_optimizer(params, run_dir, model, section))  # before the Accelerator: it resets state
        schedulers.append(make_scheduler(section, optimizers[-1], num_steps))

    bf16, fp16 = resolve_precision(cfg.precision, params.source_of("ppo", "precision"))
    mixed_precision = "bf16" if bf16 else "fp16" if fp16 else "no"
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    check_world(params, accelerator)  # a hand-made launcher must not run N unsynchronised copies
    for frozen in (ref_policy, reward_model):
        if frozen is not None:
            frozen.eval().requires_grad_(False).to(accelerator.device)
    policy, value_model, *prepared = accelerator.prepare(policy, value_model, *optimizers, *schedulers)
    optimizer, value_optimizer, scheduler, value_scheduler = prepared
    if adapter:
        ref_policy = adapters.DisabledAdapter(policy, accelerator)
    run = PPORun(
        cfg=cfg, accelerator=accelerator, tokenizer=tokenizer, policy=policy, ref_policy=ref_policy,
        value_model=value_model, reward_model=reward_model, optimizer=optimizer, scheduler=scheduler,
        value_optimizer=value_optimizer, value_scheduler=value_scheduler, train=train, valid=valid,
        stream=IndexStream(len(train.ids), cfg.seed), running=RunningMeanStd(),
        kl_ctrl=KLController(cfg.kl_ctrl, cfg.kl_coef, cfg.kl_target, cfg.kl_horizon),
    )  # fmt: skip
    if ptx is not None:
        run.ptx_blocks, run.ptx_stream = ptx, IndexStream(len(ptx), cfg.seed)
    return run, num_steps
