"""Sections of the supervised training stages: `model` (the architecture), the `train` defaults, and
`pretrain`, `sft`, `reward` and `dpo`, each a `TrainParams` with its own keys."""

from __future__ import annotations

import importlib.util
import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from llmpipe.callbacks import resolve
from llmpipe.config.optim import NOT_OFFERED, DecayType, DistillParams, LossParams, OptimName, SchedulerName
from llmpipe.config.peft import PeftParams
from llmpipe.config.section import Section

BUDGET_KEYS = frozenset({"max_steps", "num_train_epochs", "steps_per_epoch"})
"""Train keys that only set how long a run lasts: raising them continues the same run."""

# The keys a stage section gives a default of its own, typed and described once here: a stage restates only the
# value (`lr: LearningRate = 3e-4`), so that `Params()` is what the shipped params.yaml says.
LearningRate = Annotated[float, Field(gt=0, description="Peak learning rate (TrainingArguments.learning_rate).")]
TrainBatchSize = Annotated[int, Field(gt=0, description="Sequences per device per micro-step.")]
MaxSteps = Annotated[int, Field(ge=-1, description="Optimizer steps; -1 = run num_train_epochs.")]
WarmupSteps = Annotated[int, Field(ge=0, description="Linear warmup, in optimizer steps.")]
WeightDecay = Annotated[float, Field(ge=0, description="AdamW decoupled weight decay.")]
MaxLength = Annotated[int, Field(gt=0, description="Sequence length in tokens (pretrain block size; SFT/DPO cap).")]
LoggingSteps = Annotated[int, Field(gt=0, description="Optimizer steps between log lines.")]
EvalSteps = Annotated[int, Field(gt=0, description="Optimizer steps between validation passes.")]
SaveSteps = Annotated[int, Field(gt=0, description="Optimizer steps between checkpoints.")]
MaxEvalSamples = Annotated[int, Field(gt=0, description="Validation examples used at each evaluation.")]


class ModelParams(Section):
    """The model the pipeline starts from: built from scratch (the architecture keys, transformers `LlamaConfig`
    names) or loaded from `init_from` (then the architecture keys are unread)."""

    init_from: str = Field(
        "scratch",
        min_length=1,
        description="scratch (a new Llama of the keys below), a local model folder, or a hub model id.",
    )
    revision: str | None = Field(None, description="Hub branch, tag or commit of init_from; null = main.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel of built and loaded models (flash_attention_2: CUDA with flash-attn)."
    )
    arch: Literal["llama"] = Field("llama", description="Model family.")
    hidden_size: int = Field(256, gt=0, description="Width of the residual stream.")
    num_hidden_layers: int = Field(4, gt=0, description="Number of decoder layers.")
    num_attention_heads: int = Field(8, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(4, gt=0, description="Key/value heads (GQA when fewer than query heads).")
    intermediate_size: int = Field(688, gt=0, description="SwiGLU hidden width.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest sequence in tokens (RoPE).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    initializer_range: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head.")
    init_seed: int = Field(0, description="Seed of the random weight init (pretrain and the baseline start from it).")

    @property
    def scratch(self) -> bool:
        """Whether the pipeline builds its model (``init_from: scratch``) rather than loading one."""
        return self.init_from == "scratch"

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelParams:
        if self.revision is not None and self.scratch:
            raise ValueError("model.revision is set but model.init_from is scratch: give a hub id in model.init_from "
                             "or remove model.revision")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must divide model.hidden_size "
                f"({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_key_value_heads ({self.num_key_value_heads}) must divide model.num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class TrainParams(Section):
    """Training defaults every training stage inherits (HF `TrainingArguments` names, except `lr`)."""

    lr: LearningRate = 2e-3
    per_device_train_batch_size: TrainBatchSize = 16
    per_device_eval_batch_size: int = Field(16, gt=0, description="Sequences per device at evaluation.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    max_steps: MaxSteps = -1
    num_train_epochs: float = Field(1.0, gt=0, description="Epochs when max_steps is -1.")
    warmup_steps: WarmupSteps = 20
    lr_scheduler_type: SchedulerName = Field("cosine", description="Schedule after warmup (transformers' names).")
    min_lr: float = Field(0.0, ge=0, description="cosine_with_min_lr / warmup_stable_decay: the floor of the rate.")
    num_cycles: int = Field(1, gt=0, description="cosine_with_restarts: hard restarts over the run.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="warmup_stable_decay: share of the steps that decay.")
    decay_type: DecayType = Field("cosine", description="warmup_stable_decay: shape of the decay.")
    weight_decay: WeightDecay = 0.0
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables.")
    optim: OptimName = Field("adamw_torch", description="Optimizer: transformers' Trainer names, or muon.")
    muon_lr: float = Field(0.02, gt=0, description="muon: peak rate of the 2-D hidden weights (lr: the AdamW rest).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="muon: momentum (Nesterov).")
    seed: int = Field(42, description="Seed of model init, data order and dropout.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Mixed precision; auto = bf16 where the device supports it, else fp32."
    )
    max_length: MaxLength = 256
    logging_steps: LoggingSteps = 10
    eval_steps: EvalSteps = 100
    save_steps: SaveSteps = 100
    save_total_limit: int = Field(2, gt=0, description="Checkpoints kept per run.")
    max_eval_samples: MaxEvalSamples = 128
    num_samples: int | None = Field(None, gt=0, description="Train on at most this many examples (None = all).")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes.")
    use_liger_kernel: bool = Field(
        False,
        description="Liger's Triton kernels (RMSNorm, SwiGLU, RoPE; fused linear cross-entropy for pretrain, where "
        "TRL's own fused LM head does not replace it) patched into the model: a CUDA GPU and liger-kernel.",
    )
    callbacks: list[str] = Field(
        [], description="Import paths 'package.module:Class' of llmpipe.callbacks.Callback subclasses to call."
    )
    eval_prompts: list[str] | None = Field(
        None,
        description="Prompts answered at every evaluation (console, TensorBoard, logs/<stage>/samples.jsonl): a "
        "user turn (a text prefix for pretrain); null = num_eval_prompts drawn from the held-out data.",
    )
    num_eval_prompts: int = Field(2, ge=0, description="Held-out prompts drawn when eval_prompts is null; 0 = none.")
    eval_max_new_tokens: int = Field(
        32, gt=0, description="Greedy tokens per sample (ppo, grpo: their generation block's settings instead)."
    )
    histogram_steps: int = Field(
        0, ge=0, description="Optimizer steps between TensorBoard histograms of weights and gradients; 0 = off."
    )
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        ["tensorboard"],
        description="Trackers the run logs to (the HF Trainer's integrations), all on this machine under paths.logs: "
        "tensorboard (always: logs/<stage>/tensorboard is a DVC output), wandb (offline, logs/wandb), mlflow "
        "(SQLite store logs/mlflow/mlflow.db), trackio (logs/trackio).",
    )
    peft: PeftParams = Field(PeftParams(), description="Adapter or full training (sft, dpo, reward, ppo, grpo).")

    @field_validator("callbacks")
    @classmethod
    def _callbacks_import(cls, value: list[str]) -> list[str]:
        for spec in value:  # imported now, so a wrong path stops the stage before any work
            resolve(spec)
        return value

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, report_to: list[str]) -> list[str]:
        if "tensorboard" not in report_to:
            raise ValueError("must list tensorboard (logs/<stage>/tensorboard is a DVC output); add the other "
                             "trackers after it, e.g. [tensorboard, mlflow]")
        missing = [name for name in dict.fromkeys(report_to) if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} not installed: pip install {' '.join(missing)} "
                             "(or leave it out of report_to)")
        return list(dict.fromkeys(report_to))

    @field_validator("optim", mode="before")
    @classmethod
    def _offered(cls, value):
        if value in NOT_OFFERED:
            raise ValueError(f"{value!r} is not offered: {NOT_OFFERED[value]}")
        return value

    @property
    def resolved_max_steps(self) -> int:
        """The optimizer-step budget handed to the trainer: `max_steps` (-1 = run `num_train_epochs`)."""
        return self.max_steps


class PretrainParams(TrainParams):
    """`pretrain`: causal-LM training on packed blocks of `max_length` tokens (documents joined by eos)."""

    enabled: bool = Field(
        True,
        description="false: no pretraining; models/pretrain is a pointer to model.init_from (needs one), so sft "
        "starts from it.",
    )
    max_steps: MaxSteps = 300
    weight_decay: WeightDecay = 0.1
    steps_per_epoch: int | None = Field(
        None,
        gt=0,
        description="Optimizer steps in one epoch of a stream (data.streaming), which has no length: with max_steps "
        "-1 the run takes steps_per_epoch × num_train_epochs steps.",
    )
    loss: LossParams = Field(LossParams(), description="Critical-token weights and label smoothing of the loss.")

    @property
    def resolved_max_steps(self) -> int:
        """`max_steps`, or ``ceil(steps_per_epoch × num_train_epochs)`` when it is -1 and `steps_per_epoch` is set."""
        if self.max_steps > 0 or self.steps_per_epoch is None:
            return self.max_steps
        return math.ceil(self.steps_per_epoch * self.num_train_epochs)

    @model_validator(mode="after")
    def _no_adapter(self) -> PretrainParams:
        if self.peft.method != "none":
            raise ValueError(
                f"pretrain.peft.method ({self.peft.method!r}): pretrain trains the base model in full; adapters apply "
                "to sft, dpo, reward, ppo and grpo (set train.peft or their own peft block); remove pretrain.peft"
            )
        return self


class SFTParams(TrainParams):
    """`sft`: TRL SFTTrainer on chat `messages` from models/pretrain."""

    lr: LearningRate = 3e-4
    per_device_train_batch_size: TrainBatchSize = 8
    max_steps: MaxSteps = 110
    assistant_only_loss: bool = Field(True, description="Loss on assistant tokens only ({% generation %} mask).")
    packing: bool = Field(
        True,
        description="Pack whole conversations into rows of max_length tokens, kept apart by position ids (exact; "
        "refused before training for a model that cannot keep them apart).",
    )
    loss: LossParams = Field(LossParams(), description="Critical-token weights and label smoothing of the loss.")
    distill: DistillParams = Field(DistillParams(), description="A teacher's logits mixed into the loss.")


class RewardParams(TrainParams):
    """`reward`: TRL RewardTrainer from models/sft on preference pairs → a scalar reward model.

    The pairwise (Bradley-Terry) loss ``-log σ(r(x, y_chosen) - r(x, y_rejected) - margin)`` of Ouyang et al.
    2022 (InstructGPT), on a new one-output score head over the SFT model's last token. Pairs longer than
    `max_length` tokens are left out of training (TRL filters them).
    """

    lr: LearningRate = 3e-4
    per_device_train_batch_size: TrainBatchSize = 8
    max_steps: MaxSteps = 600
    max_length: MaxLength = 128
    eval_steps: EvalSteps = 150
    save_steps: SaveSteps = 150
    center_rewards_coefficient: float | None = Field(
        None,
        ge=0,
        description="Weight of the mean-zero penalty E[(r_chosen + r_rejected)^2] (Eisenstein et al. 2023); null: off.",
    )


DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


PreferenceMethod = Literal["dpo", "kto", "orpo", "simpo", "cpo"]

DPO_LOSS_KEYS = ("loss_type", "loss_weights")
"""The DPO loss choice: the shipped params set it, so under another method it is left unread with a warning (by the
dpo stage) rather than refused, and `dvc exp run -S dpo.method=kto` works on the shipped file."""

METHOD_KEYS: dict[str, tuple[PreferenceMethod, ...]] = {
    "label_smoothing": ("dpo", "simpo", "cpo"),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "simpo_gamma": ("simpo",),
    "cpo_alpha": ("cpo",),
}
"""The `dpo` keys that only some methods read (``beta`` and the `train` keys apply to all; the loss choice is
:data:`DPO_LOSS_KEYS`): a key set off its default under another method would be silently ignored, so it is
refused at load."""


class DPOParams(TrainParams):
    """`dpo`: preference tuning of models/sft by `method` (TRL's names for every parameter):

    - ``dpo``: `trl.DPOTrainer`, the SFT model as frozen reference (Rafailov et al. 2023); the default loss is IPO
      (Azar et al. 2023): it raised held-out preference accuracy most in 60 steps, but greedy bodies stop parsing
      (docs/LOG.md);
    - ``kto``: `trl.KTOTrainer` on unpaired desirable/undesirable examples, with a frozen reference
      (Ethayarajh et al. 2024);
    - ``orpo``: `trl.experimental.orpo.ORPOTrainer`, NLL plus an odds-ratio term, reference-free (Hong et al. 2024);
    - ``simpo``: `trl.experimental.cpo.CPOTrainer` with ``loss_type="simpo"`` and no BC term, length-normalised
      reward with a target margin, reference-free (Meng et al. 2024);
    - ``cpo``: `trl.experimental.cpo.CPOTrainer`, sigmoid loss plus a BC (NLL) term, reference-free
      (Xu et al. 2024).
    """

    lr: LearningRate = 4e-4
    per_device_train_batch_size: TrainBatchSize = 8
    max_steps: MaxSteps = 60
    warmup_steps: WarmupSteps = 6
    method: PreferenceMethod = Field("dpo", description="Preference method: dpo, kto, orpo, simpo or cpo.")
    beta: float = Field(0.1, gt=0, description="Strength of the KL regularisation towards the reference model "
                        "(orpo: the odds-ratio weight λ; simpo/cpo: the reward scale).")  # fmt: skip
    loss_type: list[DPOLossType] = Field(
        ["ipo"],
        min_length=1,
        description="TRL DPO loss types: [sigmoid] is DPO, [sigmoid, sft] DPO + NLL (RPO), [ipo] IPO (Azar et al. "
        "2023).",
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type entry (None = all 1).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative-DPO label noise (sigmoid loss).")
    desirable_weight: float = Field(1.0, gt=0, description="kto: weight of the desirable examples' loss.")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: weight of the undesirable examples' loss.")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: target reward margin γ.")
    cpo_alpha: float = Field(1.0, ge=0, description="cpo: weight of the BC (NLL on chosen) term.")

    @model_validator(mode="after")
    def _weights_match(self) -> DPOParams:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"dpo.loss_weights has {len(self.loss_weights)} entries but dpo.loss_type has "
                f"{len(self.loss_type)}: give one weight per loss type"
            )
        return self

    @model_validator(mode="after")
    def _kto_batch(self) -> DPOParams:
        # TRL's KTOTrainer refuses it only after the models load; its KL term pairs examples within a batch
        if self.method == "kto" and self.per_device_train_batch_size < 2:
            raise ValueError(
                f"dpo.per_device_train_batch_size is {self.per_device_train_batch_size} under dpo.method kto: KTO "
                "estimates its KL term from the other examples of the same batch, so it needs at least 2 per device "
                "(raise it, in dpo: or train:)"
            )
        return self

    @model_validator(mode="after")
    def _keys_apply_to_method(self) -> DPOParams:
        for key, methods in METHOD_KEYS.items():
            default = type(self).model_fields[key].default
            if self.method not in methods and getattr(self, key) != default:
                raise ValueError(
                    f"dpo.{key} ({getattr(self, key)!r}) applies to dpo.method {' or '.join(methods)}, not "
                    f"{self.method!r}: remove it or set it to its default ({default!r})"
                )
        return self
