"""The tasks of `data.tasks` (generated, or `data.local.tasks`) added to a corpus: their own splits for
``data/tasks``, their SFT rows and preference pairs mixed into the corpus's at `sft_share` and `preference_share`.

Training rows are mixed by subsampling the corpus's rows (seeded) until the tasks make the share, then shuffling
the two together, so that any prefix of the file (``num_samples``, ``max_eval_samples``) holds both; validation
gets every validation task beside the corpus's rows. The test tasks stay out of the SFT and preference test
splits: they are the evaluation's (``llmpipe_tasks``), not the held-out loss's.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import replace
from typing import Any

from llmpipe.config import DataParams
from llmpipe.data.corpus import Corpus
from llmpipe.data.splits import SPLITS, split_by_key, subsample
from llmpipe.data.tasks import families
from llmpipe.data.tasks.records import COLUMNS, Task, load_local, preference_row, sft_row

CORRUPTIONS = ("constant", "off_by_one", "operator")
"""The rejected-body kinds of the tasks' preference pairs, in round-robin order."""


def build_tasks(data: DataParams) -> dict[str, list[Task]]:
    """The tasks per split: a user's `data.local.tasks` (checked, split by the hash of the prompt), or the
    generated families (:mod:`.families`) with the stdlib corpus, or none (`data.tasks.enabled` false, or users'
    own corpus without tasks of their own: Python tasks do not belong in a chat fine-tune's data)."""
    cfg = data.tasks
    if not cfg.enabled or (data.source != "stdlib" and data.local.tasks is None):
        return {s: [] for s in SPLITS}
    if data.local.tasks is not None:
        with tempfile.TemporaryDirectory(prefix="llmpipe-datasets-") as cache:
            tasks = load_local(data.local.tasks, cache)
        half = cfg.held_out_fraction / 2
        return split_by_key(tasks, lambda t: t["prompt"], data.seed, half, half)
    combos = families.split_combinations(data.seed, cfg.held_out_fraction)
    counts = {"train": cfg.num_train, "validation": cfg.num_validation, "test": cfg.num_test}
    return {s: families.generate(combos[s], counts[s], data.seed, s, cfg.num_tests) for s in SPLITS}


def task_pairs(tasks: list[Task], seed: int, split: str) -> list[dict[str, Any]]:
    """One preference pair per generated task, the rejected kinds balanced (the least used kind that fails a
    test); a user's tasks (no known operations to vary) give none."""
    rng = random.Random(f"{seed}:tasks/preference/{split}")
    counts = dict.fromkeys(CORRUPTIONS, 0)
    rows = []
    for i, task in enumerate(t for t in tasks if "steps" in t):
        found = families.variants(task, rng)
        order = sorted(found, key=lambda k: (counts[k], (CORRUPTIONS.index(k) - i) % len(CORRUPTIONS)))
        if order:
            counts[order[0]] += 1
            rows.append(preference_row(task, found[order[0]], order[0]))
    return rows


def _mix(own: list[dict[str, Any]], added: list[dict[str, Any]], share: float | None, seed: int, salt: str
         ) -> list[dict[str, Any]]:
    """`added` beside as many of `own` as leave `added` `share` of the whole (all of `own` when too few, or when
    `share` is None), shuffled together."""
    keep = len(own) if not added or share is None else min(len(own), round(len(added) * (1 - share) / share))
    rows = subsample(own, keep, seed, f"tasks/{salt}/kept") + added
    random.Random(f"{seed}:tasks/{salt}/order").shuffle(rows)
    return rows


def add_tasks(corpus: Corpus, data: DataParams) -> Corpus:
    """`corpus` with its ``tasks`` splits set and their SFT rows and preference pairs mixed in (module docstring);
    the corpus as it was when `data.tasks.enabled` is false.

    Raises:
        UserError: A user's task record is malformed, has no tests, or its reference fails them
            (:func:`llmpipe.data.tasks.records.load_local`).
    """
    tasks = build_tasks(data)
    if not any(tasks.values()):
        return replace(corpus, tasks={s: [] for s in SPLITS})
    cfg, seed = data.tasks, data.seed
    sft, preference = dict(corpus.sft), dict(corpus.preference)
    sft["train"] = _mix(corpus.sft["train"], [sft_row(t) for t in tasks["train"]], cfg.sft_share, seed, "sft")
    sft["validation"] = _mix(corpus.sft["validation"], [sft_row(t) for t in tasks["validation"]], None, seed,
                             "sft/validation")
    for split, share in (("train", cfg.preference_share), ("validation", None)):
        pairs = task_pairs(tasks[split], seed, split)
        preference[split] = _mix(corpus.preference[split], pairs, share, seed, f"preference/{split}")
    written = {s: [{c: t[c] for c in (*COLUMNS, "source")} for t in tasks[s]] for s in SPLITS}
    return replace(corpus, sft=sft, preference=preference, tasks=written)
