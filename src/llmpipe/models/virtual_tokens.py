"""Virtual-token adapters (peft's prefix and prompt tuning, which cannot merge) are made to answer the same in any
batch and when generating (:func:`fix_virtual_tokens`, applied by
`llmpipe.train.adapters.wrap` and `llmpipe.models.loading.load_adapter`).

peft 0.21 puts its virtual tokens before the batch's padding and, under transformers 5, gets generation wrong:

- Positions: the model numbers a row's tokens from the first virtual token on, pads included, so a prompt after
  left padding sits at other positions than alone. The virtual tokens are not rotated with the text (prefix
  tuning's keys never are; prompt tuning's sit at a distance that grows with the padding), so its answers depend on
  the batch (docs/LOG.md has the figures). Positions numbered from the attention mask, as transformers 4's
  generation numbered them, are the same in any batch.
- Generation: peft hands the virtual tokens over as ``past_key_values`` while transformers 5 generates with its own
  ``cache``, so prefix tuning's prefix is dropped (the base model's answers) and prompt tuning's virtual tokens are
  fed again with every new token.

:func:`fix_virtual_tokens` adds a forward pre-hook to the model inside the adapter that does both;
tests/stages/test_peft_matrix.py checks that greedy answers equal a cache-free greedy decode and a left-padded batch's
logits each prompt's alone.
"""

from __future__ import annotations

from typing import Any

_FIXED = "_llmpipe_virtual_tokens_fixed"
"""Marks the transformers model inside a virtual-token adapter that has :func:`fix_virtual_tokens`'s hook."""


def _positions(kwargs: dict[str, Any]) -> None:
    """Positions from the 2-D attention mask (virtual tokens included: peft prepends their ones), when none given."""
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or getattr(mask, "ndim", 0) != 2:
        return
    new = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if new is None:
        return
    kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new.shape[1] :]  # (B, T new)


def _hook(num_virtual_tokens: int, prefix: bool):
    def hook(module, args, kwargs):
        cache, injected = kwargs.get("cache"), kwargs.get("past_key_values")
        if cache is not None and injected is not None:  # generation: transformers' cache and peft's prefix
            del kwargs["past_key_values"]
            if prefix and cache.get_seq_length() == 0:  # the first forward: the prefix starts the cache
                for layer, kv in enumerate(injected.layers):
                    cache.update(kv.keys, kv.values, layer)
        embeds = kwargs.get("inputs_embeds")
        if not prefix and cache is not None and cache.get_seq_length() and embeds is not None:
            if embeds.shape[1] > num_virtual_tokens:  # prompt tuning's tokens again, already in the cache
                kwargs["inputs_embeds"] = embeds[:, num_virtual_tokens:]
        _positions(kwargs)
        return args, kwargs

    return hook


def fix_virtual_tokens(model):
    """`model` itself, with the hook of the module docstring when it is a prefix- or prompt-tuning `peft.PeftModel`.

    Args:
        model: Any model; only a virtual-token peft model is changed (its wrapped transformers model gets the hook).

    Returns:
        `model`.
    """
    config = getattr(model, "active_peft_config", None)
    if config is None or not config.is_prompt_learning or getattr(model.get_base_model(), _FIXED, False):
        return model
    prefix = config.peft_type.value == "PREFIX_TUNING"
    model.get_base_model().register_forward_pre_hook(_hook(config.num_virtual_tokens, prefix), with_kwargs=True)
    setattr(model.get_base_model(), _FIXED, True)  # a second hook would cut prompt tuning's tokens twice
    return model

