"""Packing of the sft stage: several conversations in one sequence, kept apart by their positions alone.

TRL packs (``SFTConfig(packing=True)``, best-fit decreasing: whole conversations, each cut to ``max_length`` as
unpacked, into rows of at most ``max_length`` tokens with their ``seq_lengths``). Each pack is one row of the batch,
``position_ids`` restarting at every conversation and no attention mask, so transformers builds a mask that keeps
the conversations of a row apart (``masking_utils.find_packed_sequence_indices``). That holds only when the batch
has no 2-D attention mask (even all ones: then the position ids are not read for the mask) and the forward has
``use_cache=False`` (TRL's ``compute_loss`` sets it), and only for models whose mask is built that way: a packed
OPT lets its samples see each other (docs/LOG.md). :func:`check_keeps_apart` tries the trained model on one packed
row before training; :class:`PackingFill` measures how much of each batch is real tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from llmpipe.core.errors import UserError

log = logging.getLogger(__name__)

PROBE_LENGTHS = (7, 11)
"""Token counts of the two samples of :func:`check_keeps_apart`'s packed row."""

TOLERANCE = 1e-5
"""Largest log-probability difference of a sample packed against alone that counts as the same with fp32 weights
(the loss tolerance of the exactness test). Kept apart, the two agree to the bit in fp32 and bf16 alike with sdpa
and eager; letting the samples meet, they differed by 0.09-0.16 (docs/LOG.md)."""
HALF_TOLERANCE = 2e-2
""":data:`TOLERANCE` of 16-bit weights: room for another kernel's rounding (bf16's step near 1 is 7.8e-3)."""


class PackedRows:
    """Data collator of packed rows: TRL's `DataCollatorForLanguageModeling` with position ids that restart at
    every sample (from the rows' ``seq_lengths``; an unpacked row is one sample), without its attention mask, and
    the label of each sample's first token masked (it is not predicted from the sample before it).

    TRL's own padding-free collator (what ``packing=True`` selects) joins the whole batch into one row of B·T
    tokens: a kernel without variable-length attention (sdpa and eager; flash-attn is CUDA only) then computes a
    (B·T)² masked score matrix per head, which made a packed step slower than an unpacked one on CPU (docs/LOG.md).
    One row per pack keeps attention at B·T² as unpacked.

    Args:
        pad_token_id: The token rows are right-padded with (position 0 and label -100 there).
        pad_to_multiple_of: Pad the batch length to a multiple of this (``SFTConfig.pad_to_multiple_of``).

    Returns (when called on a list of examples with ``input_ids``, optional ``labels`` and ``seq_lengths``):
        ``input_ids``, ``labels`` and ``position_ids``, each (B, T) with T the longest row.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        self.pad_token_id = pad_token_id
        self.collator = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, return_position_ids=True,
                                                        pad_to_multiple_of=pad_to_multiple_of)  # fmt: skip

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(examples)
        del batch["attention_mask"]  # with a 2-D mask transformers ignores the restarts: the samples would meet
        batch["labels"][batch["position_ids"] == 0] = -100
        return batch


def check_keeps_apart(model, collator, key: str, what: str) -> float:
    """Refuse packing with a model that lets the samples of a packed row attend to each other, or reads their
    positions other than from ``position_ids``.

    Two random samples packed into one row by `collator`, and the second alone: the second's next-token
    log-probabilities must agree within :data:`TOLERANCE` (eval mode, no gradient, ``use_cache=False`` as TRL
    trains). Costs two forwards of 18 tokens.

    Args:
        model: The model to train (a peft model too), on its device.
        collator: The trainer's collator (:class:`PackedRows`).
        key: The params key that turns packing off, e.g. ``"sft.packing"``.
        what: The model set-up the refusal names, e.g. ``"the model (llama, attention sdpa)"``.

    Returns:
        The largest absolute log-probability difference found.

    Raises:
        UserError: The difference exceeds the tolerance; names `key`.
    """
    import torch

    first, second = PROBE_LENGTHS
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (first + second,), generator=gen).tolist()
    packed = collator([{"input_ids": ids, "seq_lengths": [first, second]}])
    alone = collator([{"input_ids": ids[first:], "seq_lengths": [second]}])
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logprobs = [model(**{k: v.to(device) for k, v in batch.items() if k != "labels"}, use_cache=False)
                        .logits[0, -second:].float().log_softmax(-1) for batch in (packed, alone)]  # fmt: skip
    finally:
        model.train(training)
    diff = float((logprobs[0] - logprobs[1]).abs().max())
    tolerance = HALF_TOLERANCE if dtype.itemsize < 4 else TOLERANCE
    if not diff <= tolerance:
        raise UserError(
            f"{key}: {what} does not keep packed samples apart (a sample packed after another gives log-probabilities "
            f"{diff:.3g} away from the sample alone, more than {tolerance:g}): its attention mask is not built from "
            f"position_ids; set {key}: false, or use a model and attention implementation that is (llama, qwen2, "
            "mistral with sdpa or eager are)"
        )
    return diff


class PackingFill(TrainerCallback):
    """The share of the training batches' positions that hold a sample's token rather than padding, over every
    micro-batch this process trains (all ranks summed), and the tokens themselves; install with :meth:`attach`.

    A position is padding where the batch's attention mask is 0, or, in a packed batch (no mask), where the pad
    token sits at position 0 (TRL pads ``position_ids`` with 0; a sample starts with a pad token only when the pad
    is also its bos). TRL's own ``num_tokens`` log counts one row of a batch without an attention mask (it expects
    its one-row padding-free batches), so :meth:`on_log` replaces it with :attr:`tokens`.

    Args:
        pad_token_id: The collator's pad token.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id
        self.tokens = 0
        self.positions = 0

    @property
    def fill(self) -> float:
        """Tokens over positions, in [0, 1]; 0.0 before any batch."""
        return self.tokens / self.positions if self.positions else 0.0

    def attach(self, trainer) -> None:
        """Wrap `trainer.training_step` (every micro-batch, on every rank) to count its batch; add this callback."""
        step = trainer.training_step

        def counted(model, inputs, *args, **kwargs):
            self.count(inputs, trainer.accelerator)
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = counted
        trainer.add_callback(self)

    def count(self, inputs: dict[str, Any], accelerator) -> None:
        """Add one micro-batch (``input_ids`` (B, T), with ``attention_mask`` or ``position_ids`` (B, T))."""
        import torch

        ids = inputs["input_ids"]
        if "attention_mask" in inputs:
            real = int(inputs["attention_mask"].sum())
        else:
            real = ids.numel() - int(((ids == self.pad_token_id) & (inputs["position_ids"] == 0)).sum())
        both = accelerator.gather(torch.tensor([[real, ids.numel()]], device=accelerator.device))
        tokens, positions = both.sum(0).tolist()
        self.tokens, self.positions = self.tokens + int(tokens), self.positions + int(positions)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and "num_tokens" in logs:
            logs["num_tokens"] = float(self.tokens)
            if state.log_history and "num_tokens" in state.log_history[-1]:
                state.log_history[-1]["num_tokens"] = float(self.tokens)
