"""The `vlm` section: a LLaVA-style vision-language model built on the SFT model (`llmpipe.stages.vlm`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmpipe.config.section import Section
from llmpipe.config.training import EvalSteps, LearningRate, MaxLength, MaxSteps, SaveSteps, TrainBatchSize, TrainParams


class VisionParams(Section):
    """The vision tower: built from these keys (transformers `SiglipVisionConfig` names, random init), or loaded
    from `path` (a local folder of a SigLIP or CLIP vision model, or of a full model holding one)."""

    path: str | None = Field(None, description="Local folder of a pretrained vision tower; null = build from the "
                             "keys below (random init).")
    image_size: int = Field(32, gt=0, description="Input side in pixels (images are resized to it).")
    patch_size: int = Field(8, gt=0, description="Side of a patch in pixels: (image_size / patch_size)² image tokens.")
    hidden_size: int = Field(64, gt=0, description="Width of the vision transformer.")
    num_hidden_layers: int = Field(2, gt=0, description="Vision transformer layers.")
    num_attention_heads: int = Field(4, gt=0, description="Vision attention heads.")
    intermediate_size: int = Field(128, gt=0, description="Vision MLP width.")
    init_seed: int = Field(0, description="Seed of the random init of a built tower and of the new projector.")

    @model_validator(mode="after")
    def _shape(self) -> VisionParams:
        if self.image_size % self.patch_size:
            raise ValueError(f"vlm.vision.patch_size ({self.patch_size}) must divide vlm.vision.image_size "
                             f"({self.image_size})")  # fmt: skip
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vlm.vision.num_attention_heads ({self.num_attention_heads}) must divide "
                             f"vlm.vision.hidden_size ({self.hidden_size})")  # fmt: skip
        return self

    @property
    def num_image_tokens(self) -> int:
        """Tokens one image becomes in the language model's input (one per patch)."""
        return (self.image_size // self.patch_size) ** 2


class VLMParams(TrainParams):
    """`vlm`: LLaVA (Liu et al. 2023) on models/sft — vision tower → projector → the SFT language model, trained
    with TRL's SFTTrainer on image question/answer records, the loss on the answers only.

    Inherits `train:` like every training stage; its own keys are the parts to freeze, the projector and the
    vision tower.
    """

    lr: LearningRate = 2e-3
    per_device_train_batch_size: TrainBatchSize = 16
    max_steps: MaxSteps = 400
    max_length: MaxLength = 128
    eval_steps: EvalSteps = 200
    save_steps: SaveSteps = 200
    projector: Literal["mlp2x_gelu", "linear"] = Field(
        "mlp2x_gelu", description="LLaVA-1.5's two-layer GELU MLP, or linear (the two layers with no activation).")
    freeze_vision_tower: bool = Field(False, description="Keep the vision tower's weights as built or loaded.")
    freeze_projector: bool = Field(False, description="Keep the projector's (new, random) weights.")
    freeze_language_model: bool = Field(False, description="Keep the SFT language model's weights (embeddings and "
                                        "head included): only what sees the image trains.")
    vision: VisionParams = VisionParams()

    @model_validator(mode="after")
    def _no_adapter(self) -> VLMParams:
        if self.peft.method != "none":
            raise ValueError(f"vlm.peft.method ({self.peft.method!r}): vlm trains its parts in full (vlm.freeze_* "
                             "chooses which); adapters on its language model are not built yet; remove vlm.peft")
        return self

    @model_validator(mode="after")
    def _something_trains(self) -> VLMParams:
        if self.freeze_vision_tower and self.freeze_projector and self.freeze_language_model:
            raise ValueError("vlm: freeze_vision_tower, freeze_projector and freeze_language_model are all true, so "
                             "nothing would train; set one of them to false")
        return self
