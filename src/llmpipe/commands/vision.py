"""Vision-language model folders for `llm-train chat --image`: load one (``models/vlm`` or any local LLaVA-style
folder) and turn a conversation plus an image into model inputs through the folder's own processor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.models import check_model_dir, load_pretrained, pretrained_kwargs, read_config

WHAT = "a vision-language model folder (models/vlm)"


def is_vision_model(path: str | Path) -> bool:
    """Whether `path` holds a model with a vision tower (its config has a ``vision_config``)."""
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in read_config(config)


def load_vision_model(path: str | Path, trust_remote_code: bool = False):
    """The model (`AutoModelForImageTextToText`, eval mode) and its processor, through the safe loaders.

    Raises:
        UserError: The folder is refused by the safe loaders or holds no processor.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    check_model_dir(path, WHAT, trust_remote_code)
    model = load_pretrained(AutoModelForImageTextToText, path, WHAT, trust_remote_code)
    if not (Path(path) / "processor_config.json").is_file():
        raise UserError(f"{path}: no processor_config.json, so images cannot be turned into model inputs; save the "
                        "model's processor beside it (processor.save_pretrained)")  # fmt: skip
    processor = AutoProcessor.from_pretrained(path, **pretrained_kwargs(trust_remote_code))
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.eval(), processor


def open_image(path: str | Path):
    """The image at `path`, as RGB.

    Raises:
        UserError: Missing or not an image; names ``--image``.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert("RGB")
    except FileNotFoundError:
        raise UserError(f"--image {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise UserError(f"--image {path}: cannot be read as an image ({err})") from None


def image_inputs(processor, messages: list[dict[str, str]], image) -> tuple[list[int], dict[str, Any]]:
    """`messages` rendered up to the assistant's turn by the processor's template, the image's placeholder expanded.

    Returns:
        The prompt's token ids and the other model inputs (``pixel_values`` when the image is still in the
        conversation; its turn may have been left out to fit the context).
    """
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with_image = image is not None and processor.image_token in prompt
    batch = processor(images=[image] if with_image else None, text=prompt, return_tensors="pt")
    return batch["input_ids"][0].tolist(), ({"pixel_values": batch["pixel_values"]} if with_image else {})
