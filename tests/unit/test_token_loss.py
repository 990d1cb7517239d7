"""The critical-token / label-smoothing loss (`pretrain.loss`, `sft.loss`) against its formula on a batch small
enough to work out by hand, and the critical tokens resolved from a tokenizer's vocabulary."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from llmpipe.config.optim import LossParams
from llmpipe.core.errors import UserError
from llmpipe.train.losses import TokenWeightedLoss, critical_token_ids, token_loss

# Two-token vocabulary, every position's logits (log 3, 0): p = (3/4, 1/4), so -log p = (log 4/3, log 4).
LOGITS = torch.tensor([[[math.log(3), 0.0]] * 4])  # (B=1, T=4, V=2)
LABELS = torch.tensor([[-100, 0, 1, -100]])  # unshifted: positions 0..2 predict labels 1..3


def _by_hand(alpha: float, eps: float) -> float:
    nll = {0: math.log(4 / 3), 1: math.log(4)}
    uniform = (nll[0] + nll[1]) / 2  # ε's share: the mean of -log p over the vocabulary
    ce = {y: (1 - eps) * nll[y] + eps * uniform for y in nll}
    return (1 * ce[0] + alpha * ce[1]) / 2  # two label tokens; token 1 is critical


@pytest.mark.parametrize(("alpha", "eps"), [(1.0, 0.0), (3.0, 0.0), (3.0, 0.2), (0.5, 0.1)])
def test_weighted_loss_is_the_formula(alpha, eps):
    loss = TokenWeightedLoss(torch.tensor([1]), alpha, eps)(SimpleNamespace(logits=LOGITS), LABELS)
    assert loss.item() == pytest.approx(_by_hand(alpha, eps), abs=1e-6)


def test_plain_weights_give_the_library_loss_and_accumulation_divides_by_the_whole_count():
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, 3, 4, 5, 6], [-100, -100, 1, 2, -100]])
    plain = TokenWeightedLoss(torch.tensor([], dtype=torch.long), 1.0, 0.0)
    assert plain(SimpleNamespace(logits=logits), labels).item() == pytest.approx(
        ForCausalLMLoss(logits, labels, vocab_size=7).item(), abs=1e-6
    )
    # with the Trainer's count of a 3× larger accumulated batch, this micro-batch contributes a third as much
    assert plain(SimpleNamespace(logits=logits), labels, num_items_in_batch=18).item() == pytest.approx(
        ForCausalLMLoss(logits, labels, vocab_size=7).item() * 6 / 18, abs=1e-6
    )


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "</think>": 2, "def": 3, "return": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")


def test_critical_tokens_are_vocabulary_entries(tokenizer):
    assert critical_token_ids(tokenizer, ["</s>", "</think>", "return"], "sft.loss").tolist() == [1, 2, 4]
    with pytest.raises(UserError, match=r"sft\.loss\.critical_tokens: 'def return' is not one token .* encodes "
                                        r"to 2.*its eos '</s>'"):  # fmt: skip
        critical_token_ids(tokenizer, ["def return"], "sft.loss")


def test_token_loss_maps_the_params(tokenizer):
    loss = token_loss(LossParams(critical_tokens=["</think>"], critical_alpha=4.0, label_smoothing=0.1), tokenizer,
                      "pretrain.loss")  # fmt: skip
    assert loss.critical_ids.tolist() == [2] and loss.critical_alpha == 4.0 and loss.label_smoothing == 0.1
    assert LossParams().is_default and not LossParams(label_smoothing=0.1).is_default
