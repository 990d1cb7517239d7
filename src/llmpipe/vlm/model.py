"""The LLaVA model and processor of the `vlm` stage, built with transformers' own classes so that
``models/vlm`` loads with `AutoModelForImageTextToText` and `AutoProcessor` as it is.

LLaVA (Liu et al. 2023, "Visual Instruction Tuning"): a vision tower encodes the image into patch features, a
projector maps them to the language model's width, and they replace the ``<image>`` placeholder's tokens in the
text (one token per patch). Here the language model is the pipeline's SFT model, the tower is a SigLIP vision
transformer built small from params, or a SigLIP or CLIP tower loaded from ``vlm.vision.path`` (checked against the
params' image and patch sizes), the projector is new.
"""

from __future__ import annotations

from typing import Any

from llmpipe.config.vlm import VisionParams, VLMParams
from llmpipe.core.errors import UserError
from llmpipe.data.image_records import IMAGE_TAG

# Turns the typed content parts of an image record into the string content a text chat template renders (an
# image part becomes <image>, which the processor expands into one token per patch); prepended to the
# tokenizer's own template, so any template of string contents serves images unchanged.
_FLATTEN = (
    "{%- set ns = namespace(messages=[]) -%}"
    "{%- for m in messages -%}"
    "{%- if m['content'] is string -%}{%- set text = m['content'] -%}"
    "{%- else -%}{%- set text = namespace(s='') -%}"
    "{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{%- set text.s = text.s + '" + IMAGE_TAG + "' -%}"
    "{%- elif p['type'] == 'text' -%}{%- set text.s = text.s + p['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- set text = text.s -%}{%- endif -%}"
    "{%- set ns.messages = ns.messages + [{'role': m['role'], 'content': text}] -%}"
    "{%- endfor -%}"
    "{%- set messages = ns.messages -%}"
)


def vlm_chat_template(text_template: str) -> str:
    """The processor's chat template: the text model's, after flattening typed parts (see the comment above)."""
    return _FLATTEN + text_template


def tower_layout(vision_config) -> dict[str, Any]:
    """How a tower's patch features become image tokens: CLIP adds a class token that LLaVA drops (its ``default``
    strategy), SigLIP has none (``full``); the processor and the model must agree."""
    cls_token = vision_config.model_type.startswith("clip")
    return {"vision_feature_select_strategy": "default" if cls_token else "full",
            "num_additional_image_tokens": int(cls_token)}  # fmt: skip


def tower_config(vision: VisionParams):
    """The vision tower's config: built from params, or ``vlm.vision.path``'s (a full SigLIP/CLIP model's
    ``vision_config``), checked to make the image tokens params say.

    Raises:
        UserError: The folder has no vision config transformers reads, or its image or patch size differs from
            ``vlm.vision.image_size`` / ``patch_size`` (the image tokens would not match the tower's features).
    """
    if vision.path is None:
        from transformers import SiglipVisionConfig

        return SiglipVisionConfig(image_size=vision.image_size, patch_size=vision.patch_size,
                                  hidden_size=vision.hidden_size, num_hidden_layers=vision.num_hidden_layers,
                                  num_attention_heads=vision.num_attention_heads,
                                  intermediate_size=vision.intermediate_size, vision_use_head=False)  # fmt: skip
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(vision.path)
    except (OSError, ValueError) as err:
        raise UserError(f"vlm.vision.path: {vision.path} is not a vision model folder transformers reads ({err}); "
                        "give a saved SigLIP or CLIP (vision) model") from None
    config = getattr(config, "vision_config", config)
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if (size, patch) != (vision.image_size, vision.patch_size):
        raise UserError(
            f"vlm.vision.image_size ({vision.image_size}) and vlm.vision.patch_size ({vision.patch_size}) make "
            f"{vision.num_image_tokens} tokens per image, but the tower in {vision.path} takes {size}-pixel images in "
            f"{patch}-pixel patches; set vlm.vision.image_size: {size} and vlm.vision.patch_size: {patch}"
        )
    return config


def _image_processor(vision: VisionParams):
    """The tower folder's own image processor, checked to give images of the tower's size.

    Raises:
        UserError: The folder has no image processor, or it gives images of another size than the tower takes.
    """
    from PIL import Image
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(vision.path)
    except (OSError, ValueError) as err:
        raise UserError(f"vlm.vision.path: {vision.path} has no image processor ({err}); save the tower's image "
                        "processor beside it (image_processor.save_pretrained)") from None
    shape = tuple(processor(Image.new("RGB", (7, 5)), return_tensors="pt")["pixel_values"].shape[-2:])
    if shape != (vision.image_size, vision.image_size):
        raise UserError(f"vlm.vision.path: the image processor in {vision.path} makes {shape[0]}x{shape[1]} images but "
                        f"the tower takes {vision.image_size}x{vision.image_size}; save the processor the tower was "
                        "trained with beside it")  # fmt: skip
    return processor


def build_processor(tokenizer, vision: VisionParams):
    """A `LlavaProcessor`: the pipeline tokenizer plus the ``<image>`` token, and an image processor.

    Args:
        tokenizer: The pipeline tokenizer (a copy gains ``<image>`` as a special token; it is not changed).
        vision: The tower's params; with `vision.path`, that folder's own image processor is used.

    Returns:
        The processor; ``processor.tokenizer`` has one more token than `tokenizer`.
    """
    import copy

    from transformers import LlavaProcessor

    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([IMAGE_TAG], special_tokens=True)
    if vision.path is not None:
        image_processor = _image_processor(vision)
    else:
        # The PIL image processor: the default (torchvision-backed) one needs torchvision, which this CPU torch lacks.
        from transformers.models.siglip import SiglipImageProcessorPil

        image_processor = SiglipImageProcessorPil(size={"height": vision.image_size, "width": vision.image_size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=vision.patch_size,
                          **tower_layout(tower_config(vision)), image_token=IMAGE_TAG,
                          chat_template=vlm_chat_template(tokenizer.chat_template))  # fmt: skip


def _tower_weights(vision: VisionParams):
    """The loaded tower's vision transformer (a full SigLIP/CLIP model's ``vision_model``), or None when built."""
    if vision.path is None:
        return None
    from transformers import AutoModel

    tower = AutoModel.from_pretrained(vision.path)
    return getattr(tower, "vision_model", tower)  # transformers 5's vision-only models are that transformer itself


def build_vlm(lm, processor, cfg: VLMParams):
    """A `LlavaForConditionalGeneration` whose language model is `lm` (its embeddings grown by the ``<image>``
    token), whose vision tower is built or loaded per `cfg.vision`, and whose projector is new.

    Args:
        lm: The SFT causal LM (a `LlamaForCausalLM` or any decoder transformers' LLaVA accepts as text model).
        processor: From :func:`build_processor` (gives the vocabulary and the image token id).
        cfg: The `vlm` section.

    Returns:
        The model in fp32, on CPU; same params → same weights (`cfg.vision.init_seed`).
    """
    import torch
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    tok = processor.tokenizer
    torch.manual_seed(cfg.vision.init_seed)
    lm.resize_token_embeddings(len(tok), mean_resizing=False)
    vision_config, tower = tower_config(cfg.vision), _tower_weights(cfg.vision)
    config = LlavaConfig(vision_config=vision_config, text_config=lm.config,
                         image_token_id=tok.convert_tokens_to_ids(IMAGE_TAG),
                         projector_hidden_act="gelu" if cfg.projector == "mlp2x_gelu" else "linear",
                         vision_feature_select_strategy=tower_layout(vision_config)["vision_feature_select_strategy"],
                         # a tower trained here: its last layer; a pretrained one: the penultimate, as LLaVA-1.5
                         vision_feature_layer=-1 if tower is None else -2,
                         image_seq_length=cfg.vision.num_image_tokens)  # fmt: skip
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    if tower is not None:
        model.model.vision_tower.load_state_dict(tower.state_dict())
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


PARTS = {"vision_tower": "vision_tower", "projector": "multi_modal_projector", "language_model": "language_model"}
"""`vlm.freeze_<part>` → the submodule of `LlavaModel` it freezes (the LM head goes with the language model)."""


def freeze(model, cfg: VLMParams) -> dict[str, int]:
    """Set ``requires_grad`` per `cfg.freeze_*`; return the trainable parameter count per part
    (``trainable_<part>``)."""
    modules = {part: getattr(model.model, attr) for part, attr in PARTS.items()}
    for part, module in modules.items():
        frozen = getattr(cfg, f"freeze_{part}")
        for p in module.parameters():
            p.requires_grad_(not frozen)
    model.lm_head.weight.requires_grad_(not cfg.freeze_language_model)  # tied to the embeddings when they are
    return {f"trainable_{part}": sum(p.numel() for p in m.parameters() if p.requires_grad)
            for part, m in modules.items()}  # fmt: skip
