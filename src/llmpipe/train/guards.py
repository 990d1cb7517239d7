"""Checks that turn silent training failures into errors (or loud warnings) naming the key or file to fix.

Each failure here trains or evaluates without any crash, and shows only as a number that is quietly wrong:

- a sample whose prompt fills ``max_length`` keeps no completion token, so no label (TRL drops it from SFT and
  DPO without a word; a batch of only such samples has a loss of 0/0): :func:`count_fully_truncated`,
  :func:`check_no_signal`, :class:`MaskedBatchGuard`;
- preference pairs whose chosen and rejected sequences are the same tokens after truncation (no preference
  left to learn): :func:`count_identical_pairs`.

A pad token equal to eos and an input model trained with another tokenizer are refused where models and
tokenizers load (`llmpipe.models`). NaN/inf losses are caught by `llmpipe.train.callbacks.NonFiniteLossGuard` (Trainer stages) and in the ppo stage's loop;
lm-eval's silent truncation of long inputs is counted by `llmpipe.evaluation.counting`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from llmpipe.core.errors import UserError

log = logging.getLogger(__name__)

MAX_NO_SIGNAL_FRACTION = 0.5
"""Largest share of a training split that may carry no learning signal (no completion token left after
truncation, or chosen == rejected) before a stage refuses to train.

Some such samples are normal: a few prompts of real data are longer than any sensible ``max_length`` (3% of
the default stdlib SFT pairs at ``max_length`` 256; 26% with the tests' tiny tokenizer at 128), and they cost
only their share of the data, so below the limit the stage trains and warns with the count. Above it, most of
the run would learn nothing: ``max_length`` is far below the data's lengths, a misconfiguration to fix, not
to train through. Validation splits are small (``max_eval_samples``), so for them only "every sample" is an
error (the validation loss would be undefined or meaningless)."""

def count_fully_truncated(conversations: Iterable[list[dict]], tokenizer, max_length: int | None,
                          assistant_only_loss: bool, source: str = "sample") -> int:
    """Number of chat samples with no label left in their first `max_length` tokens.

    Renders each conversation as the sft stage gives it to TRL's `SFTTrainer` (the chat template, with the
    assistant mask of `llmpipe.data.chat_turns.assistant_masks` when `assistant_only_loss`: the template's
    ``{% generation %}`` markers, or else rendering turn by turn); a sample is fully truncated when no assistant
    token is among its first `max_length` tokens (TRL truncates with ``keep_start``), so every label is -100.
    Without `assistant_only_loss` every token is a label and only an empty sample counts.

    Args:
        conversations: ``messages`` lists.
        tokenizer: The stage's tokenizer (with its chat template).
        max_length: The stage's ``max_length`` in tokens; None = no truncation.
        assistant_only_loss: The stage's ``assistant_only_loss``.
        source: Where the conversations come from (the split's file), named with the row in an error.

    Raises:
        UserError: `assistant_only_loss` with a template without markers that renders a conversation's earlier
            turns differently once a later one follows (its assistant tokens cannot be told); names the sample and
            the fix.
    """
    from llmpipe.data.chat_turns import assistant_masks

    count = 0
    for i, messages in enumerate(conversations, 1):
        if not assistant_only_loss:
            count += not tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            continue
        try:
            labels = assistant_masks(tokenizer, messages)["assistant_masks"]
        except ValueError as err:
            raise UserError(f"{source}:{i}: {err}, so the assistant's tokens cannot be told from the prompt's; add "
                            "{% generation %}…{% endgeneration %} around each assistant message and its end-of-turn "
                            "token in the model's chat template, or set sft.assistant_only_loss: false") from None
        count += 1 not in labels[:max_length]
    return count


def check_no_signal(count: int, total: int, what: str, fix: str, training: bool = True) -> None:
    """Warn about `count` of `total` samples that carry no learning signal; refuse too many.

    The rule (see :data:`MAX_NO_SIGNAL_FRACTION`): a training split may hold up to half such samples
    (a warning with the count and `fix`); more, or all of a validation split, is an error.

    Args:
        count: Samples without signal.
        total: Samples in the split.
        what: What they are, e.g. ``"sft: training samples with no completion token within sft.max_length=64"``.
        fix: The key to change and how, e.g. ``"raise sft.max_length"``.
        training: A training split (else a validation split).

    Raises:
        UserError: Too many (the message gives the counts and `fix`).
    """
    if count == 0:
        return
    message = f"{what}: {count} of {total} ({count / total:.0%})"
    too_many = count > MAX_NO_SIGNAL_FRACTION * total if training else count == total
    if too_many:
        limit = f"more than {MAX_NO_SIGNAL_FRACTION:.0%}" if training else "all"
        raise UserError(f"{message}, {limit} of the split, would train or validate on nothing; {fix}")
    log.warning("%s; they teach nothing (TRL leaves them out or they count as zero); %s", message, fix)


class MaskedBatchGuard:
    """A data collator wrapper that refuses a batch whose labels are all masked (-100).

    Such a batch has a loss of 0/0 (NaN, or 0 where a trainer guards the division) and no gradient: nothing
    fails, the step is wasted and the logged loss is wrong. With packing, a pack of samples whose prompts
    filled ``max_length`` is such a batch.

    Args:
        collator: The trainer's collator; returns a batch with ``labels`` of shape (B, T).
        key: The params key to name, e.g. ``"sft.max_length"``.
    """

    def __init__(self, collator: Callable[[list[dict]], dict], key: str) -> None:
        self.collator, self.key = collator, key

    def __call__(self, examples: list[dict]) -> dict:
        """Collate `examples`; raises UserError when no label of the batch is unmasked."""
        batch = self.collator(examples)
        labels = batch.get("labels")
        if labels is not None and not (labels != -100).any():
            raise UserError(
                f"a batch of {len(examples)} sample(s) has every label masked (-100): their prompts fill "
                f"{self.key}, leaving no completion token to learn from; raise {self.key} or drop the longest prompts"
            )
        return batch


def count_identical_pairs(pairs, max_length: int | None) -> int:
    """Number of tokenized preference pairs whose chosen and rejected sequences are the same tokens.

    Such a pair has r(chosen) = r(rejected) whatever the model (DPO's and the reward model's losses are
    constant there: no gradient), and counts as a miss in accuracy. Truncation makes them: a rejected body
    that is the chosen one's first half, or differs only after `max_length` tokens.

    Args:
        pairs: A TRL-prepared `datasets.Dataset` in one of three shapes: ``chosen_ids`` and ``rejected_ids`` (token
            id lists), with ``prompt_ids`` prepended when present (DPO keeps the prompt apart; the reward trainer
            does not); ``chosen_input_ids`` and ``rejected_input_ids``, whole sequences TRL's CPO and ORPO trainers
            already cut to their ``max_length`` (pairs with no completion token left go first, see
            :func:`drop_no_completion`); or unpaired ``prompt_ids``, ``completion_ids`` and a boolean ``label``
            (KTO), where an undesirable example with the same tokens as a desirable one is such a pair.
        max_length: Both sequences are cut to their first `max_length` tokens (TRL's ``keep_start``), as the
            DPO and KTO collators do; None = compared whole.
    """
    columns = pairs.column_names
    if "label" in columns:
        sequences = [tuple((p + c)[:max_length]) for p, c in zip(pairs["prompt_ids"], pairs["completion_ids"])]
        desirable = {s for s, label in zip(sequences, pairs["label"]) if label}
        return sum(s in desirable for s, label in zip(sequences, pairs["label"]) if not label)
    if "chosen_input_ids" in columns:
        return sum(c == r and any(t != -100 for t in labels) for c, r, labels
                   in zip(pairs["chosen_input_ids"], pairs["rejected_input_ids"], pairs["chosen_labels"]))  # fmt: skip
    prompts = pairs["prompt_ids"] if "prompt_ids" in columns else [[]] * len(pairs)
    return sum((p + c)[:max_length] == (p + r)[:max_length]
               for p, c, r in zip(prompts, pairs["chosen_ids"], pairs["rejected_ids"]))


def drop_no_completion(pairs):
    """`pairs` without those TRL's CPO/ORPO trainers keep with no completion token (the prompt filled ``max_length``,
    so every label of the chosen or the rejected sequence is -100): their length-normalised log-probability is 0/0,
    a NaN loss. DPO and KTO drop such rows themselves, so :func:`preference_signal` counts them alike.

    Args:
        pairs: A CPO/ORPO-prepared `datasets.Dataset` (``chosen_labels``, ``rejected_labels``); other shapes are
            returned as they are.
    """
    if "chosen_labels" not in pairs.column_names:
        return pairs
    return pairs.filter(lambda row: any(t != -100 for t in row["chosen_labels"])
                        and any(t != -100 for t in row["rejected_labels"]))  # fmt: skip


def preference_signal(stage: str, split: str, num_rows: int, prepared, max_length: int | None,
                      truncates: bool) -> dict[str, int]:
    """Count a preference split's pairs without signal after TRL's preparation; warn or refuse them
    (:func:`check_no_signal`).

    Paired data (``chosen``/``rejected``) and unpaired data (KTO: ``completion`` and a desirable/undesirable
    ``label``) alike; for unpaired data the rows are examples, and an identical pair is an undesirable example
    with a desirable one's tokens (its share is of the undesirable examples, as a pair's is of the pairs).

    Args:
        stage: ``dpo`` or ``reward`` (names the keys in messages).
        split: ``train`` or ``eval``.
        num_rows: Pairs (or unpaired examples) given to the trainer.
        prepared: The trainer's prepared dataset (``trainer.train_dataset`` / ``eval_dataset``), in a shape of
            :func:`count_identical_pairs`.
        max_length: The stage's ``max_length``.
        truncates: True for DPO, KTO, CPO and ORPO, which cut sequences to `max_length` and drop the rows whose
            prompt fills it (CPO and ORPO through :func:`drop_no_completion`); False for the reward trainer, which
            leaves out pairs longer than `max_length` instead.

    Returns:
        ``num_identical_pairs`` and ``num_fully_truncated`` (truncating trainers) or ``num_too_long`` (reward), with
        an ``_eval`` suffix for the validation split.

    Raises:
        UserError: See :func:`check_no_signal`.
    """
    suffix = "" if split == "train" else "_eval"
    training = split == "train"
    unpaired = "label" in prepared.column_names
    dropped = num_rows - len(prepared)
    identical = count_identical_pairs(prepared, max_length if truncates else None)
    where = f"{stage}: {'training' if training else 'validation'} {'examples' if unpaired else 'pairs'}"
    if truncates:
        what = f"{where} whose prompt fills {stage}.max_length={max_length} (TRL drops them)"
        check_no_signal(dropped, num_rows, what, f"raise {stage}.max_length", training)
    elif dropped:
        log.info("%s longer than %s.max_length=%s, left out by TRL: %d of %d", where, stage, max_length, dropped,
                 num_rows)
    cut = f" within {stage}.max_length={max_length}" if truncates else ""
    same = ("undesirable ones with a desirable one's tokens" if unpaired
            else "whose chosen and rejected are the same tokens")  # fmt: skip
    num_pairs = len(prepared) - sum(prepared["label"]) if unpaired else len(prepared)
    check_no_signal(identical, num_pairs, f"{where}: {same}{cut}" if unpaired else f"{where} {same}{cut}",
                    f"raise {stage}.max_length or fix the preference data" if truncates else "fix the preference data",
                    training)
    return {f"num_identical_pairs{suffix}": identical,
            f"{'num_fully_truncated' if truncates else 'num_too_long'}{suffix}": dropped}


def trainer_preference_signal(stage: str, trainer, num_train: int, num_valid: int, max_length: int | None,
                              truncates: bool) -> dict[str, int]:
    """:func:`preference_signal` of both splits of a preference trainer (`num_train`/`num_valid`: rows given to it)."""
    counts = preference_signal(stage, "train", num_train, trainer.train_dataset, max_length, truncates)
    return counts | preference_signal(stage, "eval", num_valid, trainer.eval_dataset, max_length, truncates)
