"""What a merged adapter is worth: the merged model a stage saves, against the model it trained, on held-out batches.

`llmpipe.train.adapters.save` merges a trained adapter into a fresh copy of the input model (for QLoRA, one
reloaded in bf16: never into the 4-bit weights, whose rounding the merge would bake in). The two are then not the
same function: a 4-bit base dequantises to other weights than the bf16 one the adapter is merged into, and even a
full-precision merge rounds. :func:`compare` measures by how much, on the validation batches the trainer
evaluates: the largest and the mean absolute logit difference, and each model's loss on the same labelled tokens.
For QLoRA the stage's final ``eval_loss`` is the merged model's (the model it saves, and what every later stage and
evaluation reads), the trained 4-bit model's is kept beside it.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)


def compare(trainer, merged, max_batches: int | None = None) -> dict[str, float]:
    """Logits and loss of `merged` against `trainer.model` on the trainer's evaluation batches.

    Only batches of one sequence per row with next-token labels (``input_ids``, ``labels``: SFT-style) can be
    scored this way; a stage whose batches are pairs (DPO, reward) gets no figures (an empty dict, with a log
    line). Positions whose label is -100 are left out of every figure.

    Args:
        trainer: The stage's trainer after training; its `model` is the trained one (adapter over its base).
        merged: The merged model as saved, on any device (moved to the trainer's).
        max_batches: Score at most this many batches (None: the whole evaluation set, at most
            ``max_eval_samples`` rows).

    Returns:
        ``merge_logits_max_abs_diff`` and ``merge_logits_mean_abs_diff`` (over every scored position and vocabulary
        entry), ``eval_loss_merged`` and ``eval_loss_trained`` (mean next-token cross-entropy, nats per token),
        ``merge_scored_tokens``.
    """
    import torch
    import torch.nn.functional as F

    device = trainer.args.device
    merged = merged.to(device).eval()
    model = trainer.model.eval()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(trainer.args.bf16))
    max_diff, abs_sum, entries, tokens = 0.0, 0.0, 0, 0
    loss_sum = {"merged": 0.0, "trained": 0.0}
    for i, batch in enumerate(trainer.get_eval_dataloader()):
        if max_batches is not None and i >= max_batches:
            break
        # GRPO and RLOO collate nothing (a batch is a list of prompt records), DPO pairs: neither is scored here.
        if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
            shape = ", ".join(sorted(batch)) if isinstance(batch, dict) else f"a {type(batch).__name__} of records"
            log.info("merge check: the evaluation batches are not single sequences with labels (%s); not scored",
                     shape)  # fmt: skip
            return {}
        inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        labels = batch["labels"].to(device)[:, 1:]  # (B, T-1): the token each position predicts
        keep = labels != -100
        with torch.no_grad(), autocast:
            # No cache: with one, a packed row's position_ids no longer keep its samples apart (docs/LOG.md)
            logits = {"trained": model(**inputs, use_cache=False).logits,
                      "merged": merged(**inputs, use_cache=False).logits}  # fmt: skip
        for name, lg in logits.items():
            lg = lg[:, :-1].float()  # (B, T-1, V)
            loss_sum[name] += F.cross_entropy(lg[keep], labels[keep], reduction="sum").item()
        diff = (logits["trained"][:, :-1].float() - logits["merged"][:, :-1].float())[keep].abs()  # (N, V)
        if diff.numel():
            max_diff = max(max_diff, diff.max().item())
            abs_sum += diff.sum().item()
            entries += diff.numel()
        tokens += int(keep.sum())
    if not tokens:
        return {}
    return {
        "merge_logits_max_abs_diff": round(max_diff, 6),
        "merge_logits_mean_abs_diff": round(abs_sum / entries, 7),
        "eval_loss_merged": round(loss_sum["merged"] / tokens, 5),
        "eval_loss_trained": round(loss_sum["trained"] / tokens, 5),
        "merge_scored_tokens": tokens,
    }


def merged_eval(metrics: dict[str, float], figures: dict[str, float], quantized: bool) -> dict[str, float]:
    """`metrics` with the merge figures added; for a quantized (QLoRA) run its ``eval_loss`` becomes the merged
    model's and the trained 4-bit model's is kept as ``eval_loss_4bit``."""
    out = {**metrics, **figures}
    if quantized and not math.isnan(figures.get("eval_loss_merged", math.nan)):
        out["eval_loss_4bit"] = metrics["eval_loss"]
        out["eval_loss"] = figures["eval_loss_merged"]
    return out
