"""Build a transformers causal LM from ``model:`` params, or load a saved one; save models as standard
Hugging Face directories (safetensors + config + tokenizer with its chat template)."""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import ModelParams
from llmpipe.errors import UserError
from llmpipe.guards import check_pad_token
from llmpipe.io import atomic_dir


def build_model(cfg: ModelParams, tokenizer):
    """A randomly initialised `LlamaForCausalLM` (RoPE, SwiGLU, RMSNorm; GQA via `num_key_value_heads`).

    Args:
        cfg: Architecture and `init_seed` (same seed → same weights).
        tokenizer: Gives the vocabulary size and the bos/eos/pad ids.

    Returns:
        The model in fp32, on CPU.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.init_seed)
    return LlamaForCausalLM(config)


def load_model(path: str | Path, what: str, num_labels: int | None = None):
    """Load a saved model from a directory: a causal LM, or with `num_labels` a sequence classifier.

    Args:
        path: A `save_pretrained` directory.
        what: The fix to name when it is missing, e.g. "run the sft stage first (dvc repro sft)".
        num_labels: Load `AutoModelForSequenceClassification` with this many outputs (1 for a reward model);
            from a causal LM the score head is new and initialised from the torch RNG, so seed first.

    Raises:
        UserError: The directory is missing (names the stage that makes it).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = Path(path)
    if not (path / "config.json").exists():
        raise UserError(f"{path}: no model there; {what}")
    if num_labels is None:
        return AutoModelForCausalLM.from_pretrained(path)
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels)


def load_tokenizer(path: str | Path):
    """Load the pipeline's tokenizer (or a model directory's), checked for a pad token distinct from eos.

    Raises:
        UserError: The tokenizer directory is missing, or its pad token is missing or is the eos token
            (`llmpipe.guards.check_pad_token`).
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer_config.json").exists():
        raise UserError(f"{path}: no tokenizer there; run the tokenizer stage first (dvc repro tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(path)
    check_pad_token(tokenizer, path)
    return tokenizer


def save_model(model, tokenizer, final: str | Path, state_dict=None) -> None:
    """Save model (safetensors) and tokenizer to `final` atomically (temp dir, then rename).

    Args:
        model: The (unwrapped) model; its config and class name go into config.json.
        tokenizer: Saved beside it.
        final: The model directory.
        state_dict: Weights to save instead of ``model.state_dict()`` (a consolidated one under sharding).
    """
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)


def count_parameters(model) -> int:
    """Number of parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
