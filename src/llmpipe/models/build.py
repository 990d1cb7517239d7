"""Build a transformers causal LM from ``model:`` params (a random-init Llama), fit its embedding to a tokenizer,
count its parameters, and the ``attn_implementation`` every build and load passes."""

from __future__ import annotations

import logging

from llmpipe.config import ModelParams
from llmpipe.core.errors import UserError

log = logging.getLogger(__name__)


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
        **attn_kwargs(cfg.attn_implementation),
    )
    torch.manual_seed(cfg.init_seed)
    return LlamaForCausalLM(config)


def fit_embeddings(model, num_tokens: int):
    """`model` with at least `num_tokens` embedding rows: rows for the tokens the tokenizer stage added to an adopted
    tokenizer (a pad token, role tokens), initialised at the mean of the others (transformers' `mean_resizing`)."""
    if model.get_input_embeddings().num_embeddings < num_tokens:
        log.info("resizing the embedding from %d to %d rows for the tokens the pipeline tokenizer adds",
                 model.get_input_embeddings().num_embeddings, num_tokens)
        model.resize_token_embeddings(num_tokens, mean_resizing=True)
    return model


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of parameters (tied weights counted once), or of those that train; a peft model's as peft counts
    them (its `get_nb_trainable_parameters`: 4-bit weights at their full count)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
        return trainable if trainable_only else total
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def attn_kwargs(name: str) -> dict[str, str]:
    """``attn_implementation`` for a model's config or `from_pretrained`, checked against this machine.

    Raises:
        UserError: ``flash_attention_2`` without a CUDA GPU or without the flash-attn package.
    """
    if name == "flash_attention_2":
        import torch
        from transformers.utils import is_flash_attn_2_available

        if not (torch.cuda.is_available() and is_flash_attn_2_available()):
            raise UserError("model.attn_implementation: flash_attention_2 needs a CUDA GPU and the flash-attn package "
                            "(pip install flash-attn); use sdpa (the default) or eager here")
    return {"attn_implementation": name}
