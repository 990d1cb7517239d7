"""`peft:` — parameter-efficient fine-tuning of a training stage through the `peft` library, in peft's own names.

A `peft:` block under `train:` is every adapter stage's default (sft, dpo, reward, ppo, grpo); a stage's own
`peft:` block overrides it key by key, or, naming another `method`, replaces it (`llmpipe.config.loading`).

What a method cannot do in a given stage, or with a given `optim`, is :func:`stage_refusal`: checked at load for a
stage whose own section writes a key the rule reads, and for every stage when it runs (`llmpipe.train.arguments.
check_device_params`), so a `train.peft` that one stage cannot take refuses that stage only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

from pydantic import Field, model_validator

from llmpipe.config.section import Section

if TYPE_CHECKING:
    from llmpipe.config.params import Params

PeftMethod = Literal["none", "lora", "adalora", "ia3", "prefix_tuning", "prompt_tuning", "bitfit"]

PROMPT_LEARNING = frozenset({"prefix_tuning", "prompt_tuning"})
"""Methods whose adapter is virtual tokens, not a change of the weights: nothing to merge."""

METHOD_KEYS: dict[str, tuple[str, ...]] = {
    "r": ("lora",),
    "lora_alpha": ("lora", "adalora"),
    "lora_dropout": ("lora", "adalora"),
    "use_dora": ("lora",),
    "use_rslora": ("lora",),
    "target_modules": ("lora", "adalora", "ia3"),
    "init_r": ("adalora",),
    "target_r": ("adalora",),
    "tinit": ("adalora",),
    "tfinal": ("adalora",),
    "deltaT": ("adalora",),
    "beta1": ("adalora",),
    "beta2": ("adalora",),
    "orth_reg_weight": ("adalora",),
    "feedforward_modules": ("ia3",),
    "num_virtual_tokens": ("prefix_tuning", "prompt_tuning"),
    "prefix_projection": ("prefix_tuning",),
    "encoder_hidden_size": ("prefix_tuning",),
    "prompt_tuning_init": ("prompt_tuning",),
    "prompt_tuning_init_text": ("prompt_tuning",),
    "load_in_4bit": ("lora", "adalora"),
    "bnb_4bit_quant_type": ("lora", "adalora"),
    "modules_to_save": ("lora", "adalora", "ia3", "prefix_tuning", "prompt_tuning", "bitfit"),
}
"""The keys only some methods read (``method`` and ``merge`` apply to all): one set off its default under another
method would be silently ignored, so it is refused at load."""


class PeftParams(Section):
    """How a stage trains its model: in full (``none``) or through an adapter (Hu et al. 2021 LoRA, Liu et al. 2024
    DoRA, Kalajdzievski 2023 rsLoRA, Zhang et al. 2023 AdaLoRA, Liu et al. 2022 IA³, Li & Liang 2021 prefix tuning,
    Lester et al. 2021 prompt tuning: the `peft` library's configs, field for field), or the biases only (BitFit,
    Ben Zaken et al. 2022, which peft has no method for)."""

    method: PeftMethod = Field("none", description="none (train every weight), lora, adalora, ia3, prefix_tuning, "
                               "prompt_tuning or bitfit (biases only).")  # fmt: skip
    merge: bool = Field(True, description="Write models/<stage> as the merged full model (the adapter in its "
                        "adapter/ subfolder); false: models/<stage> is the adapter.")  # fmt: skip
    r: int = Field(8, gt=0, description="lora: rank of the update matrices.")
    lora_alpha: int = Field(16, gt=0, description="lora, adalora: scale alpha (update × alpha / r; rsLoRA: / √r).")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="lora, adalora: dropout on the adapter's input.")
    use_dora: bool = Field(False, description="lora: weight-decomposed LoRA (DoRA).")
    use_rslora: bool = Field(False, description="lora: rank-stabilised scaling alpha / √r.")
    target_modules: list[str] | Literal["all-linear"] | None = Field(
        None, description="lora, adalora, ia3: module names to adapt, or all-linear; null: peft's default for the "
        "architecture.",
    )  # fmt: skip
    modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full beside the adapter (e.g. [lm_head]); reward's score head always is."
    )
    init_r: int = Field(12, gt=0, description="adalora: initial rank of every adapted matrix.")
    target_r: int = Field(8, gt=0, description="adalora: mean rank the budget schedule ends at.")
    tinit: int = Field(0, ge=0, description="adalora: steps at full rank before the budget shrinks.")
    tfinal: int = Field(0, ge=0, description="adalora: steps at the final budget at the end of the run.")
    deltaT: int = Field(1, gt=0, description="adalora: steps between rank reallocations.")
    beta1: float = Field(0.85, ge=0, lt=1, description="adalora: EMA of the sensitivity scores.")
    beta2: float = Field(0.85, ge=0, lt=1, description="adalora: EMA of their uncertainty.")
    orth_reg_weight: float = Field(0.5, ge=0, description="adalora: weight of the orthogonality penalty.")
    feedforward_modules: list[str] | None = Field(
        None, description="ia3: the target modules scaled at their input (null: peft's default)."
    )
    num_virtual_tokens: int = Field(8, gt=0, description="prefix_tuning, prompt_tuning: virtual tokens learnt.")
    prefix_projection: bool = Field(False, description="prefix_tuning: reparametrise the prefix through an MLP.")
    encoder_hidden_size: int | None = Field(None, gt=0, description="prefix_tuning: that MLP's width (null: hidden).")
    prompt_tuning_init: Literal["RANDOM", "TEXT"] = Field(
        "RANDOM", description="prompt_tuning: start the virtual tokens random or from prompt_tuning_init_text."
    )
    prompt_tuning_init_text: str | None = Field(None, description="prompt_tuning: the text of TEXT init.")
    load_in_4bit: bool = Field(False, description="lora, adalora: QLoRA, the base in 4 bits (bitsandbytes, CUDA).")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="lora, adalora: 4-bit data type.")

    @model_validator(mode="after")
    def _keys_apply_to_method(self) -> PeftParams:
        for key, methods in METHOD_KEYS.items():
            default = type(self).model_fields[key].default
            if self.method not in methods and getattr(self, key) != default:
                raise ValueError(
                    f"peft.{key} ({getattr(self, key)!r}) applies to peft.method {' or '.join(methods)}, not "
                    f"{self.method!r}: remove it or set it to its default ({default!r})"
                )
        return self

    @model_validator(mode="after")
    def _consistent(self) -> PeftParams:
        if self.method in PROMPT_LEARNING and self.merge:
            raise ValueError(
                f"peft.method {self.method} learns virtual tokens, which cannot be merged into the weights: set "
                "peft.merge: false (models/<stage> then holds the adapter, which later stages and evaluation load)"
            )
        if self.prompt_tuning_init == "TEXT" and not self.prompt_tuning_init_text:
            raise ValueError("peft.prompt_tuning_init TEXT needs peft.prompt_tuning_init_text")
        return self


NOT_FOR_MUON: dict[str, str] = {
    "ia3": "per-channel scale vectors",
    "prefix_tuning": "virtual-token embeddings (AdamW's, like every embedding)",
    "prompt_tuning": "virtual-token embeddings (AdamW's, like every embedding)",
    "bitfit": "biases",
}
"""Methods that train no weight matrix, so ``optim: muon`` would have nothing to step: what they train instead."""


class Refusal(NamedTuple):
    """Why a stage cannot train as its section says (:func:`stage_refusal`)."""

    message: str
    """Names the keys where the values were set and the fix."""
    keys: frozenset[str]
    """The section's keys the rule reads (``peft``, ``optim``): written in the stage's own section, the refusal
    comes at load; all inherited from `train:`, when the stage runs."""


def stage_refusal(params: Params, stage: str) -> Refusal | None:
    """Why `stage` cannot train with its merged `peft:` and `optim`, or None.

    The rules: ppo's own loop takes no virtual tokens (it reads the value model position by position), no AdaLoRA
    (its rank schedule runs on the Trainer's optimizer-step hook) and no schedule-free optimizer (it does not switch
    one between its training and averaged weights, as the Trainer does); reward takes no virtual tokens (peft 0.21
    cannot prefix-tune a transformers 5 classifier, and gives a prompt-tuned one no token ids, so it scores the
    last position, a pad in a right-padded batch); dpo's ORPO, SimPO and CPO take no prompt tuning (TRL pairs
    their logits with the labels position by position); AdaLoRA needs a step budget; Muon needs a trainable weight
    matrix (:data:`NOT_FOR_MUON`; LoRA of rank 1 has vectors only).

    Args:
        params: Validated params.
        stage: An adapter stage (`llmpipe.stages.ADAPTER_TASKS`).
    """
    t = params.stage(stage)
    cfg, where, optim = t.peft, params.source_of(stage, "peft"), params.source_of(stage, "optim")
    inherited = where != f"{stage}.peft"
    method = f"{stage}.peft.method {cfg.method}" + (f" (from {where})" if inherited else "")
    use = (f"give {stage} a peft: block of its own with method" if inherited else f"set {stage}.peft.method to")
    peft, both = frozenset({"peft"}), frozenset({"peft", "optim"})
    if stage == "ppo" and cfg.method in PROMPT_LEARNING:
        return Refusal(f"{method}: ppo's own loop reads the value model's hidden states position by position, which "
                       f"virtual tokens would shift; {use} lora or ia3", peft)  # fmt: skip
    if stage == "ppo" and cfg.method == "adalora":
        return Refusal(f"{method}: its rank schedule runs on the Trainer's optimizer-step hook, which ppo's own loop "
                       f"does not have; {use} lora or ia3", peft)  # fmt: skip
    if stage == "ppo" and t.optim.startswith("schedule_free"):
        return Refusal(f"{optim} {t.optim}: ppo's own loop does not switch a schedule-free optimizer between its "
                       "training and averaged weights (the Trainer stages do); set ppo.optim to adamw_torch or muon",
                       frozenset({"optim"}))  # fmt: skip
    if stage == "reward" and cfg.method in PROMPT_LEARNING:
        why = ("looks for the model's past_key_values argument, which transformers 5 calls cache, and fails"
               if cfg.method == "prefix_tuning" else "gives the classifier no token ids, so it scores the last "
               "position, a pad in a right-padded batch")  # fmt: skip
        return Refusal(f"{method}: peft 0.21's virtual tokens in a sequence classifier {why}; {use} lora or ia3", peft)
    if stage == "dpo" and cfg.method == "prompt_tuning" and t.method in ("orpo", "simpo", "cpo"):
        return Refusal(f"{method} with dpo.method {t.method}: TRL's ORPO and CPO trainers pair the logits with the "
                       "labels position by position, and prompt tuning's virtual tokens add positions (a size error "
                       f"inside TRL); {use} prefix_tuning, lora or ia3, or set dpo.method to dpo or kto",
                       frozenset({"peft", "method"}))  # fmt: skip
    if cfg.method == "adalora" and (t.max_steps <= 0 or cfg.tinit + cfg.tfinal >= t.max_steps):
        return Refusal(f"{method} schedules its rank budget over {stage}.max_steps: set it (> 0, now {t.max_steps}) "
                       f"above peft.tinit + peft.tfinal ({cfg.tinit} + {cfg.tfinal})", peft)  # fmt: skip
    rank = {"lora": cfg.r, "adalora": cfg.init_r}.get(cfg.method, 2)
    if t.optim == "muon" and (cfg.method in NOT_FOR_MUON or rank < 2):
        trains = NOT_FOR_MUON.get(cfg.method, "rank-1 matrices, which are vectors")
        return Refusal(f"{optim} muon steps weight matrices, and {method} trains {trains} only, which leaves Muon "
                       f"nothing to step; set {stage}.optim to adamw_torch (or another optimizer), or "
                       f"{stage}.peft.method to lora (rank 2 or more), adalora or none", both)  # fmt: skip
    return None
