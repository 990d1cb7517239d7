"""Save a model as a standard Hugging Face folder (safetensors, config, the tokenizer with its chat template),
atomically."""

from __future__ import annotations

from pathlib import Path

from llmpipe.core.io import atomic_dir


def save_model(model, tokenizer, final: str | Path, state_dict=None) -> None:
    """Save model (safetensors) and tokenizer to `final` atomically (temp dir, then rename), as other tools load it
    (`llmpipe.models.saved_folder.finish`).

    Args:
        model: The (unwrapped) model; its config and class name go into config.json.
        tokenizer: Saved beside it.
        final: The model directory.
        state_dict: Weights to save instead of ``model.state_dict()`` (a consolidated one under sharding).
    """
    from llmpipe.models.saved_folder import finish

    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        finish(tmp, tokenizer, chat=False)  # use_cache true, the plain chat template
