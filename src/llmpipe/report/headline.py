"""A run's headline: about ten numbers, each stage's target metric, in ``metrics/headline.json`` — the one file
DVC knows as metrics, so ``dvc exp show`` and ``dvc metrics diff`` compare runs on these and nothing that changes
on every run (wall times, throughput, hashes). Which numbers: each stage's ``headline`` in the registry
(`llmpipe.config.stages.HEADLINE`; every RL stage's reward among them) and every evaluated model's pass@1 on
the held-out executable tasks where it was measured."""

from __future__ import annotations

from typing import Any

from llmpipe.config.stages import HEADLINE
from llmpipe.evaluation.checks import PASS_AT_1, Check, Metrics


def headline(evals: Metrics, stage_metrics: dict[str, dict[str, Any]], checks: list[Check],
             num_not_run: int = 0) -> dict[str, float]:
    """The headline of a run: every registry headline number found and each model's pass@1 (``<model>_pass1``,
    :data:`~llmpipe.evaluation.checks.PASS_AT_1`) where present (4 decimals), the checks passed out of those run,
    and how many stages and evaluations did not run for these params.

    Args:
        evals: Evaluation metrics per model, of the current params only (:mod:`llmpipe.report.current`).
        stage_metrics: ``metrics/<stage>.json`` per stage, of the current params only.
        checks: The report's checks; skipped ones are not counted.
        num_not_run: Stages and evaluations left out as not run for these params.
    """
    sources = {"eval": evals, "stage": stage_metrics}
    out = {}
    for key, where, name, metric in HEADLINE:
        value = sources[where].get(name, {}).get(metric)
        if isinstance(value, (int, float)):
            out[key] = round(float(value), 4)
    out |= {f"{model}_pass1": round(float(m[PASS_AT_1]), 4) for model, m in evals.items() if PASS_AT_1 in m}
    out["checks_passed"] = sum(c.passed is True for c in checks)
    out["checks_run"] = sum(c.passed is not None for c in checks)
    out["not_run"] = num_not_run
    return out
