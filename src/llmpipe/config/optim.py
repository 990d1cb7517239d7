"""The optimiser and learning-rate schedule keys every training section inherits from `train:` (`optim`,
`lr_scheduler_type` and the keys only some of them read), and the loss-shaping sections of `pretrain` and `sft`
(`loss:`) and the teacher of `sft` (`distill:`).

Pure data and validation: no torch. What an optimiser needs from the machine (a package, a CUDA GPU) is checked
by `llmpipe.train.optimizers.check_optimizer` before a stage does any work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from llmpipe.config.section import Section

OptimName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
    "adagrad",
    "rmsprop",
    "schedule_free_adamw",
    "schedule_free_radam",
    "schedule_free_sgd",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "ademamix",
    "ademamix_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "lion_32bit",
    "lion_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "grokadamw",
    "stable_adamw",
    "muon",
]
"""`train.optim`: transformers' `OptimizerNames` (Trainer builds each), less :data:`NOT_OFFERED`, plus ``muon``
(`torch.optim.Muon` on the 2-D hidden weights, AdamW on the rest: `llmpipe.train.optimizers`).
tests/unit/test_optim_params.py keeps this list equal to the installed transformers' names."""

_LOW_RANK = ("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
             "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise", "apollo_adamw", "apollo_adamw_layerwise")
_BITSANDBYTES = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "ademamix", "ademamix_8bit",
                 "paged_ademamix_32bit", "paged_ademamix_8bit", "lion_32bit", "lion_8bit", "paged_lion_32bit",
                 "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")  # fmt: skip

NOT_OFFERED: dict[str, str] = {
    "adamw_torch_xla": "a TPU (torch_xla) optimiser; llmpipe trains on CPUs and CUDA GPUs",
    "adamw_torch_npu_fused": "an Ascend NPU optimiser; llmpipe trains on CPUs and CUDA GPUs",
    "adamw_anyprecision": "it needs torchdistx, which has no build for the pinned torch",
    **dict.fromkeys(_LOW_RANK, "a low-rank projection over optim_target_modules, which llmpipe does not expose; "
                    "train low-rank adapters with peft instead"),
    **dict.fromkeys(("lomo", "adalomo"), "it updates the weights inside backward, so the non-finite-gradient guard "
                    "(which refuses a step before the optimizer applies it) and gradient accumulation cannot work"),
}
"""transformers optimisers `train.optim` refuses, with the reason its error gives."""

OPTIM_REQUIRES: dict[str, tuple[str | None, bool]] = {
    **dict.fromkeys(("schedule_free_adamw", "schedule_free_radam", "schedule_free_sgd"), ("schedulefree", False)),
    **dict.fromkeys(_BITSANDBYTES, ("bitsandbytes", True)),
    **dict.fromkeys(("adamw_torch_4bit", "adamw_torch_8bit"), ("torchao", True)),
    "grokadamw": ("grokadamw", False),
    "stable_adamw": ("optimi", False),
}
"""Per optimiser that needs more than torch: the module to import and whether it needs a CUDA GPU."""

SchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "cosine_with_min_lr",
    "constant",
    "constant_with_warmup",
    "warmup_stable_decay",
]

DecayType = Literal["linear", "cosine", "1-sqrt"]

SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "min_lr": ("cosine_with_min_lr", "warmup_stable_decay"),
    "num_cycles": ("cosine_with_restarts",),
    "decay_fraction": ("warmup_stable_decay",),
    "decay_type": ("warmup_stable_decay",),
}
"""The schedule keys only some `lr_scheduler_type`s read: set off their default under another, they would be
silently ignored, so that is an error."""

OPTIM_KEYS: dict[str, tuple[str, ...]] = {"muon_lr": ("muon",), "muon_momentum": ("muon",)}
"""The optimiser keys only some `optim`s read (the same rule as :data:`SCHEDULE_KEYS`)."""


def check_optim_keys(name: str, section: Any, defaults: dict[str, Any]) -> None:
    """The cross-field rules of a training section's optimiser and schedule keys.

    Args:
        name: The section (``train``, ``sft``, …), for messages.
        section: A validated `TrainParams`.
        defaults: Each key's code default (a key at its default is "not set").

    Raises:
        ValueError: A key set off its default under an `optim`/`lr_scheduler_type` that does not read it;
            ``cosine_with_min_lr`` without `min_lr`; `min_lr` not below `lr`; ``warmup_stable_decay`` on a stage
            without a step budget (`max_steps`).
    """
    for keys, chosen, what in ((SCHEDULE_KEYS, section.lr_scheduler_type, "lr_scheduler_type"),
                               (OPTIM_KEYS, section.optim, "optim")):  # fmt: skip
        for key, readers in keys.items():
            if chosen not in readers and getattr(section, key) != defaults[key]:
                raise ValueError(
                    f"{name}.{key} ({getattr(section, key)!r}) applies to {name}.{what} {' or '.join(readers)}, not "
                    f"{chosen!r}: remove it or set it to its default ({defaults[key]!r})"
                )
    if section.lr_scheduler_type == "cosine_with_min_lr" and section.min_lr == 0:
        raise ValueError(f"{name}.lr_scheduler_type cosine_with_min_lr needs {name}.min_lr > 0 (else use cosine)")
    if section.min_lr >= section.lr:
        raise ValueError(f"{name}.min_lr ({section.min_lr}) must be below {name}.lr ({section.lr})")


class LossParams(Section):
    """`pretrain.loss` / `sft.loss`: the token-level cross-entropy, reshaped (`llmpipe.train.losses`).

    Per label token t: ``w_t · CE_ls(t)``, with ``w_t = critical_alpha`` when the label is one of `critical_tokens`
    (else 1) and ``CE_ls`` the cross-entropy with label smoothing ε (Szegedy et al. 2016): ``(1 - ε) · -log p(y)
    + ε · mean over the vocabulary of -log p(v)``; summed and divided by the number of label tokens (not by the sum
    of weights, so an up-weighted token really weighs more).
    """

    critical_tokens: list[str] = Field(
        [], description="Tokens whose loss is multiplied by critical_alpha, as the tokenizer spells them (one token "
        "each, e.g. its eos text or '</think>')."
    )  # fmt: skip
    critical_alpha: float = Field(1.0, gt=0, description="Loss weight of the critical tokens (1 = no change).")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Label smoothing ε of the cross-entropy (0 = off).")

    @model_validator(mode="after")
    def _tokens_and_alpha_go_together(self) -> LossParams:
        if len(set(self.critical_tokens)) != len(self.critical_tokens):
            raise ValueError(f"critical_tokens lists a token twice: {self.critical_tokens}")
        if self.critical_tokens and self.critical_alpha == 1:
            raise ValueError("critical_tokens are set but critical_alpha is 1, so they change nothing: set it")
        if not self.critical_tokens and self.critical_alpha != 1:
            raise ValueError(f"critical_alpha is {self.critical_alpha} but critical_tokens is empty: name the tokens")
        return self

    @property
    def is_default(self) -> bool:
        """Whether the loss is the library's plain cross-entropy (no critical tokens, no smoothing)."""
        return not self.critical_tokens and self.label_smoothing == 0


class DistillParams(Section):
    """`sft.distill`: knowledge distillation from a teacher's logits mixed with the SFT loss
    (`llmpipe.train.distill`): ``loss = (1 - alpha) · SFT + alpha · T² · D(teacher_T ‖ student_T)`` on the
    completion tokens, with D TRL's generalized Jensen-Shannon divergence (Agarwal et al. 2024; ``beta`` 0 is the
    forward KL of Hinton et al. 2015) at temperature T."""

    teacher: str | None = Field(
        None, description="A stage that runs before sft (pretrain) or a model folder; null: no distillation."
    )
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of the distillation term (1 - alpha: the SFT loss).")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature T of both distributions.")
    beta: float = Field(0.0, ge=0, le=1, description="TRL's JSD interpolation: 0 = KL(teacher‖student), 1 = reverse KL.")

    @model_validator(mode="after")
    def _keys_need_a_teacher(self) -> DistillParams:
        if self.teacher is None:
            changed = [k for k in ("alpha", "temperature", "beta") if getattr(self, k) != type(self).model_fields[k].default]
            if changed:
                raise ValueError(f"{', '.join(changed)} set but teacher is null, so nothing is distilled: set teacher")
        return self
