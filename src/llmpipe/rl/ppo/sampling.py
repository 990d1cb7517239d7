"""The distribution PPO samples its tokens from, and the same distribution when it scores them.

`generate` draws each response token from the policy's logits after transformers' logits processors, one per
``ppo.generation`` key in this order (`GenerationMixin._get_logits_processor`): the repetition penalty (on the
tokens so far, prompt included, left padding not), suppressed tokens, temperature, top-k, top-p, min-p. PPO's
ratio, its KL to the reference and its entropy must be those of that distribution, not of the raw softmax, so
:func:`sampled_logits` applies the same transformers processors, position by position, to the logits a forward
pass of the whole sequence gives; a test checks that the rollout's log-probabilities equal those of the scores
`generate` sampled from, for each key. Every key of `llmpipe.config.rl.GenerationParams` enters the distribution:
none is refused for ppo.

One departure: the token that was sampled is never filtered out. Sampled, it was inside the kept set when it was
drawn; a later forward pass (the policy a few updates on, or the reference) can rank it just outside top-k/top-p,
and a log-probability of -inf would make PPO's ratio and the KL infinite. Its logit then stays, renormalised with
the kept ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from llmpipe.config.rl import GenerationParams


@contextmanager
def own_settings_only(model) -> Iterator[None]:
    """Sample with ``ppo.generation``'s settings and no others: transformers 5 fills every setting a
    `GenerationConfig` leaves unset (``min_p: null``, ``no_repeat_ngram_size``, …) from the model's own
    ``generation_config.json``, which for a hub model may add a processor :func:`sampled_logits` does not know.
    Within the block the model's default generation config is a blank one (restored after, so it is saved as it was).
    """
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the model generate runs
    saved = inner.generation_config
    inner.generation_config = GenerationConfig()
    try:
        yield
    finally:
        inner.generation_config = saved


def _filters(gen: GenerationParams) -> list:
    """The processors that drop tokens (set their logit to -inf), those `generate` adds for `gen`, in its order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        SuppressTokensLogitsProcessor,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    filters = []
    if gen.suppress_tokens:
        filters.append(SuppressTokensLogitsProcessor(gen.suppress_tokens))
    if gen.top_k != 0:
        filters.append(TopKLogitsWarper(top_k=gen.top_k))
    if gen.top_p < 1.0:
        filters.append(TopPLogitsWarper(top_p=gen.top_p))
    if gen.min_p is not None:
        filters.append(MinPLogitsWarper(min_p=gen.min_p))
    return filters


def sampled_logits(logits: Tensor, input_ids: Tensor, attention_mask: Tensor, gen: GenerationParams) -> Tensor:
    """The logits of the distribution `generate` sampled each response token from (see the module docstring).

    Suppressing tokens commutes with the temperature (both leave -inf at -inf), so it is applied after it here,
    with the other filters; gradients flow through the repetition penalty and the temperature, not the filters'
    masks.

    Args:
        logits: ``(B, R, V)`` raw float logits; position t predicts response token t.
        input_ids: ``(B, P + R)``: the left-padded prompts, then the R response tokens.
        attention_mask: ``(B, P + R)``, 0 on the prompts' left padding.
        gen: The ``generation`` params the tokens were sampled with.

    Returns:
        ``(B, R, V)``: the penalised logits divided by the temperature, -inf where a filter drops a token (but
        never at the sampled token).
    """
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    batch, response_len, vocab = logits.shape
    prompt_len = input_ids.shape[1] - response_len
    if gen.repetition_penalty != 1.0:
        padding = (attention_mask != 0).int().argmax(1)  # as generate computes prompt_ignore_length
        penalty = RepetitionPenaltyLogitsProcessor(gen.repetition_penalty, prompt_ignore_length=padding)
        # position t saw the prompt and the response tokens before it: one call per position, as in generate
        logits = torch.stack([penalty(input_ids[:, : prompt_len + t], logits[:, t]) for t in range(response_len)], 1)
    logits = logits / gen.temperature
    filters = _filters(gen)
    if not filters:
        return logits
    with torch.no_grad():
        kept = logits.detach().reshape(batch * response_len, vocab)  # the filters take (N, V)
        for f in filters:
            kept = f(None, kept)  # none of them reads the input ids
        drop = torch.isneginf(kept).view(batch, response_len, vocab)
        drop.scatter_(2, input_ids[:, prompt_len:].unsqueeze(-1), False)
    return logits.masked_fill(drop, -torch.inf)
