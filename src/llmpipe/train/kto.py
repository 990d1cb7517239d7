"""KTO's data in the `dpo` stage (``dpo.method: kto``): unpaired rows from a preference split, in an order that
mixes pairs, and the mismatched completions its KL term is estimated from.

`trl.KTOTrainer` estimates the KL term of a batch (Ethayarajh et al. 2024, eq. 3) from each example's prompt with
another example's completion, and builds them by rotating the completions by one within each batch of
``per_device_train_batch_size`` rows, in dataset order (its sampling is sequential). Rows made two per pair (chosen,
then rejected) would then give half the examples the completion of their own prompt, and a tail batch of one row
its own completion: the "mismatched" pair is a matched one and the estimate is biased towards the implied reward.
So the rows are shuffled (seeded) and, after TRL's preparation, every row's KL completion is taken from the nearest
row of its batch with another prompt (:func:`mismatched_kl`), a permutation of the batch's completions where
each prompt is there once, as TRL intends, and from a neighbouring batch where none is.
"""

from __future__ import annotations

from itertools import chain
from pathlib import Path

from llmpipe.core.errors import UserError
from llmpipe.data.loading import load_split

COLUMNS = ("prompt", "completion", "label")


def unpaired_split(path: Path, limit: int | None, seed: int):
    """KTO's unpaired rows (``prompt``, ``completion``, boolean ``label``) from a preference split, shuffled.

    Args:
        path: ``data/preference/<split>.jsonl``: pairs (``prompt``, ``chosen``, ``rejected``) or unpaired rows.
        limit: Keep at most this many rows of the file (``num_samples`` / ``max_eval_samples``).
        seed: Seed of the shuffle (``dpo.seed``).

    Returns:
        A `datasets.Dataset`: the file's rows when they have ``completion`` and ``label``, else two per pair (the
        chosen completion with ``label`` True, the rejected one False), in a seeded random order.

    Raises:
        UserError: The file is missing or empty, or a row lacks a column of its shape.
    """
    from datasets import Dataset

    rows = load_split(path, ("prompt",), limit, optional=("completion", "label", "chosen", "rejected"))
    if {"completion", "label"} <= set(rows.column_names):
        return rows.select_columns(list(COLUMNS)).shuffle(seed=seed).flatten_indices()
    if not {"chosen", "rejected"} <= set(rows.column_names):
        raise UserError(f"{path}: dpo.method kto needs pairs (prompt, chosen, rejected) or unpaired rows "
                        f"(prompt, completion, label); its first row has {rows.column_names}")  # fmt: skip
    unpaired = Dataset.from_list([{"prompt": r["prompt"], "completion": r[key], "label": key == "chosen"}
                                  for r in rows for key in ("chosen", "rejected")])  # fmt: skip
    return unpaired.shuffle(seed=seed).flatten_indices()


def _next_in_batch(prompts: list[list[int]], i: int, batch: range) -> int | None:
    """The next row after `i` in `batch`, cyclically, whose prompt differs from row `i`'s."""
    after = chain(range(i + 1, batch.stop), range(batch.start, i))
    return next((j for j in after if prompts[j] != prompts[i]), None)


def _nearest(prompts: list[list[int]], i: int) -> int | None:
    """The row nearest to `i` (later first) whose prompt differs from row `i`'s."""
    for d in range(1, len(prompts)):
        for j in (i + d, i - d):
            if 0 <= j < len(prompts) and prompts[j] != prompts[i]:
                return j
    return None


def mismatched_kl(dataset, batch_size: int):
    """`dataset` (TRL-prepared KTO rows: ``prompt_ids``, ``completion_ids``, ``KL_completion_ids``) with each row's
    KL completion taken from another prompt: the next row of its batch (cyclically) whose prompt differs, else the
    nearest such row of the dataset (a batch of one row, or of one prompt).

    Args:
        dataset: ``trainer.train_dataset`` or ``eval_dataset`` of a `trl.KTOTrainer`.
        batch_size: The rows per batch its dataloader takes in order (per device).

    Raises:
        UserError: Every row has the same prompt: no mismatched completion exists.
    """
    if "KL_completion_ids" not in dataset.column_names:  # a loss without the KL term
        return dataset
    prompts, completions = dataset["prompt_ids"], dataset["completion_ids"]
    n = len(prompts)
    kl = []
    for i in range(n):
        start = i - i % batch_size
        j = _next_in_batch(prompts, i, range(start, min(start + batch_size, n)))
        if j is None:
            j = _nearest(prompts, i)
        if j is None:
            raise UserError("dpo.method kto: every preference example has the same prompt, so KTO's KL term has no "
                            "mismatched completion to estimate from; give examples of at least two prompts")
        kl.append(completions[j])
    return dataset.remove_columns("KL_completion_ids").add_column("KL_completion_ids", kl)


def label_counts(dataset) -> dict[str, int]:
    """``num_desirable`` and ``num_undesirable`` examples of a KTO split (its ``label`` column)."""
    labels = [bool(x) for x in dataset["label"]]
    return {"num_desirable": sum(labels), "num_undesirable": len(labels) - sum(labels)}
