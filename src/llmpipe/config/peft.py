"""`peft:` — parameter-efficient fine-tuning of a training stage through the `peft` library, in peft's own names.

A `peft:` block under `train:` is every adapter stage's default (sft, dpo, reward, ppo, grpo); a stage's own
`peft:` block overrides it key by key, or, naming another `method`, replaces it (`llmpipe.config.loading`).

What a method cannot do in a given stage, or with a given `optim`, is :func:`stage_refusal`: checked at load for a
stage whose own section writes a key the rule reads, and for every stage when it runs (`llmpipe.train.arguments.
check_device_params`), so a `train.peft` that one stage cannot take refuses that stage only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmpipe.config.section import Section

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
