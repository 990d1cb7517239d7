"""A run's headline: about ten numbers, each stage's target metric, in ``metrics/headline.json`` — the one file
DVC knows as metrics, so ``dvc exp show`` and ``dvc metrics diff`` compare runs on these and nothing that changes
on every run (wall times, throughput, hashes)."""

from __future__ import annotations

from typing import Any, Literal

from llmpipe.evaluation.checks import Check, Metrics

HEADLINE: tuple[tuple[str, Literal["eval", "stage"], str, str], ...] = (
    ("pretrain_bpb", "eval", "pretrain", "llmpipe_perplexity.bits_per_byte"),
    ("sft_chat_bpb", "eval", "sft", "llmpipe_sft_chat.bits_per_byte"),
    ("dpo_pref_acc", "eval", "dpo", "llmpipe_preference.acc_norm"),
    ("dpo_bpb", "eval", "dpo", "llmpipe_perplexity.bits_per_byte"),
    ("reward_acc", "stage", "reward", "accuracy"),
    ("ppo_reward", "stage", "ppo", "eval_reward"),
    ("grpo_reward", "stage", "grpo", "eval_reward"),
    ("grpo_gen_score", "eval", "grpo", "llmpipe_generation.score"),
    ("grpo_distinct", "eval", "grpo", "llmpipe_generation.distinct"),
    ("vlm_acc", "stage", "vlm", "test_accuracy"),
)
"""``(headline key, where from, stage or model, metric)``: "eval" reads ``metrics/eval/<model>.json``, "stage"
``metrics/<stage>.json``. Short keys: ``dvc exp show`` names its columns ``headline.<key>``."""


def headline(evals: Metrics, stage_metrics: dict[str, dict[str, Any]], checks: list[Check],
             costs: list[Check], num_not_run: int = 0) -> dict[str, float]:
    """The headline of a run: every :data:`HEADLINE` number found (4 decimals), the checks passed out of those run,
    the costs flagged, and how many stages and evaluations did not run for these params.

    Args:
        evals: Evaluation metrics per model, of the current params only (:mod:`llmpipe.report.current`).
        stage_metrics: ``metrics/<stage>.json`` per stage, of the current params only.
        checks: The report's checks; skipped ones are not counted.
        costs: The report's costs (:func:`llmpipe.evaluation.checks.run_costs`).
        num_not_run: Stages and evaluations left out as not run for these params.
    """
    sources = {"eval": evals, "stage": stage_metrics}
    out = {}
    for key, where, name, metric in HEADLINE:
        value = sources[where].get(name, {}).get(metric)
        if isinstance(value, (int, float)):
            out[key] = round(float(value), 4)
    out["checks_passed"] = sum(c.passed is True for c in checks)
    out["checks_run"] = sum(c.passed is not None for c in checks)
    out["costs_flagged"] = sum(c.passed is False for c in costs)
    out["not_run"] = num_not_run
    return out
