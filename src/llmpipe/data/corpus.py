"""What every data source produces (:class:`Corpus`), and the evaluation sets cut from its test split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmpipe.config import DataParams
from llmpipe.data.splits import SPLITS, subsample

EVAL_SETS = ("perplexity", "signature_mc", "sft", "preference", "tasks")
"""Files written under ``<paths.data>/eval/`` (``<name>.jsonl``); an empty one is skipped by the evaluator."""


@dataclass
class Corpus:
    """Prepared rows per split (``train``/``validation``/``test``), before they are written.

    Attributes:
        pretrain: Documents ``{"text", "source"}`` per split.
        sft: Chat rows ``{"messages": [user, assistant], "name", "source"}`` per split.
        preference: TRL conversational rows ``{"prompt", "chosen", "rejected", "corruption", "name", "source"}``,
            or TRL's unpaired ones ``{"prompt", "completion", "label", "name", "source"}`` (users' unpaired data).
        tasks: Executable function tasks per split (`llmpipe.data.tasks`: ``prompt``, ``entry_point``,
            ``canonical_solution``, ``tests``, ``source``); set by `llmpipe.data.tasks.mixing.add_tasks`.
        signature_mc: The docstring → signature multiple-choice eval set (stdlib only; empty otherwise).
        manifest: Provenance for ``pretrain/manifest.json``: ``source``, ``description``, ``num_files``,
            ``num_skipped_files``, ``content_sha256`` (hex). No absolute paths.
        num_empty_responses: Users' SFT and preference records left out for an empty response
            (``{"sft": n, "preference": n}``; see :mod:`llmpipe.data.formats`).
        num_dropped_empty: Pretraining rows of a `datasets` source left out for an empty text.
    """

    pretrain: dict[str, list[dict[str, Any]]]
    sft: dict[str, list[dict[str, Any]]]
    preference: dict[str, list[dict[str, Any]]]
    tasks: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {s: [] for s in SPLITS})
    signature_mc: list[dict[str, Any]] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    num_empty_responses: dict[str, int] = field(default_factory=lambda: {"sft": 0, "preference": 0})
    num_dropped_empty: int = 0


def eval_sets(corpus: Corpus, data: DataParams) -> dict[str, list[dict[str, Any]]]:
    """The evaluation sets, all from the test split, each at most `data.num_eval_examples` rows (seeded).

    Returns:
        ``{"perplexity": [{"text"}], "signature_mc": [...], "sft": [...], "preference": [...], "tasks": [...]}``; perplexity
        documents are cut to `data.eval_max_chars_per_document` characters.
    """
    n, seed = data.num_eval_examples, data.seed
    docs = subsample(corpus.pretrain["test"], n, seed, "eval/perplexity")
    return {
        "perplexity": [{"text": d["text"][: data.eval_max_chars_per_document]} for d in docs],
        "signature_mc": subsample(corpus.signature_mc, n, seed, "eval/signature_mc"),
        "sft": subsample(corpus.sft["test"], n, seed, "eval/sft"),
        # pairs only: unpaired rows (KTO's data) have no rejected answer beside a chosen one to compare
        "preference": subsample([r for r in corpus.preference["test"] if "chosen" in r], n, seed, "eval/preference"),
        "tasks": subsample(corpus.tasks["test"], n, seed, "eval/tasks"),
    }
