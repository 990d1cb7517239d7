"""The causal-LM loss of `pretrain` and `sft` reshaped by params (`<stage>.loss`): critical tokens up-weighted,
label smoothing. The formula is :class:`llmpipe.config.optim.LossParams`'s.

Written here, not taken from the library: transformers' `LabelSmoother` smooths but weights no token, and TRL
deprecates label smoothing in `SFTTrainer`; both Trainers call a `compute_loss_func` with the model's outputs,
which is where this goes (:func:`token_loss`; `llmpipe.train.distill` uses it as its SFT term).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmpipe.config.optim import LossParams
from llmpipe.core.errors import UserError

IGNORE_INDEX = -100


def weighted_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    critical_ids: torch.Tensor,
    critical_alpha: float,
    label_smoothing: float = 0.0,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Sum over label tokens of ``w_t · CE_ls(t)``, divided by the number of label tokens.

    Args:
        logits: ``(B, T, V)``, position t predicting ``labels[:, t]`` (already shifted).
        labels: ``(B, T)`` token ids, `IGNORE_INDEX` where no loss is taken.
        critical_ids: ``(K,)`` ids weighted `critical_alpha` (the rest weigh 1).
        critical_alpha: Weight of the critical tokens.
        label_smoothing: ε of `torch.nn.functional.cross_entropy`.
        num_items_in_batch: Label tokens of the whole accumulated batch (the Trainer's count, so gradient
            accumulation sums to the same loss); None: this batch's.

    Returns:
        A scalar tensor.
    """
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none", label_smoothing=label_smoothing)  # fmt: skip  # (B·T,)
    weights = torch.where(torch.isin(labels.flatten(), critical_ids.to(labels.device)), critical_alpha, 1.0)
    count = num_items_in_batch if num_items_in_batch is not None else (labels != IGNORE_INDEX).sum()
    return (ce * weights).sum() / torch.as_tensor(count, device=ce.device).clamp(min=1)


class TokenWeightedLoss:
    """A Trainer `compute_loss_func`: ``(outputs, labels, num_items_in_batch) → loss`` with the unshifted labels
    the causal-LM collators give (the model predicts token t + 1 at position t).

    Args:
        critical_ids: ``(K,)`` ids of the critical tokens.
        critical_alpha: Their weight.
        label_smoothing: ε.
    """

    def __init__(self, critical_ids: torch.Tensor, critical_alpha: float, label_smoothing: float) -> None:
        self.critical_ids, self.critical_alpha, self.label_smoothing = critical_ids, critical_alpha, label_smoothing

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        return weighted_token_loss(outputs.logits[:, :-1, :], labels[:, 1:], self.critical_ids, self.critical_alpha,
                                   self.label_smoothing, num_items_in_batch)  # fmt: skip


def critical_token_ids(tokenizer, tokens: list[str], key: str) -> torch.Tensor:
    """The ids of `tokens`: each a vocabulary entry, or text that encodes to exactly one token.

    Raises:
        UserError: A token that is neither (the message names `key` and the tokenizer's eos as an example).
    """
    vocab, ids = tokenizer.get_vocab(), []
    for token in tokens:
        found = [vocab[token]] if token in vocab else tokenizer.encode(token, add_special_tokens=False)
        if len(found) != 1:
            raise UserError(f"{key}.critical_tokens: {token!r} is not one token of the tokenizer (it encodes to "
                            f"{len(found)}): name tokens of its vocabulary, e.g. its eos {tokenizer.eos_token!r}")  # fmt: skip
        ids.extend(found)
    return torch.tensor(ids, dtype=torch.long)


def token_loss(cfg: LossParams, tokenizer, key: str) -> TokenWeightedLoss:
    """The loss `cfg` asks for (a plain cross-entropy when `cfg.is_default`, which the Trainers compute as well
    themselves: callers give it to one only when not).

    Args:
        cfg: ``<stage>.loss``.
        tokenizer: The pipeline tokenizer (resolves the critical tokens).
        key: ``pretrain.loss`` or ``sft.loss``, for messages.

    Raises:
        UserError: See :func:`critical_token_ids`.
    """
    return TokenWeightedLoss(critical_token_ids(tokenizer, cfg.critical_tokens, key), cfg.critical_alpha,
                             cfg.label_smoothing)  # fmt: skip
