"""The report card's tables of evaluation results, as markdown lines: every model × metric per task, what each
task measures, and the summary across stages with deltas against each model's input model and the baseline."""

from __future__ import annotations

import math
from typing import Any

from llmpipe.evaluation.checks import Metrics
from llmpipe.evaluation.tasks import LOCAL_TASKS

PRIMARY_METRICS = {
    "llmpipe_perplexity": "bits_per_byte",
    "llmpipe_signature_mc": "acc_norm",
    "llmpipe_sft_chat": "bits_per_byte",
    "llmpipe_sft_plain": "bits_per_byte",
    "llmpipe_preference": "acc_norm",
    "llmpipe_generation": "score",
    "llmpipe_answers": "exact",
}
"""The one metric per llmpipe task the summary table and the headline show (another task: its first metric)."""

BASELINE = "baseline"
"""The model every delta of the summary is also taken against."""


def fmt(value: Any) -> str:
    """A number for a table: whole numbers as integers, 100 ≤ |x| < 1e6 with one decimal, else 4 significant
    digits; anything else as text; missing as –."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e9):
        return str(int(value))
    if 100 <= abs(value) < 1e6:
        return f"{value:.1f}"
    return f"{value:.4g}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def columns(task: str, evals: Metrics) -> list[str]:
    """Metric keys of `task` shown in its results table: for an llmpipe task its declared metrics, for a
    standard lm-eval task every metric found (no stderrs, no document counts)."""
    found = {key for metrics in evals.values() for key in metrics}
    if task in LOCAL_TASKS:
        names = [f"{task}.{m.name}" for m in LOCAL_TASKS[task].metrics]
    else:
        names = sorted(k for k in found if k.startswith(f"{task}.") and not k.endswith(("_stderr", ".num_docs")))
    return [name for name in names if name in found]


def primary(task: str, evals: Metrics) -> str | None:
    """The key of `task`'s summary metric (:data:`PRIMARY_METRICS`, else its first column), or None without data."""
    found = columns(task, evals)
    key = f"{task}.{PRIMARY_METRICS[task]}" if task in PRIMARY_METRICS else (found[0] if found else None)
    return key if key in found else None


def arrow(key: str) -> str:
    """" ↑" or " ↓" for a metric of an llmpipe task (which way is better), else ""."""
    task, _, metric = key.partition(".")
    for m in LOCAL_TASKS[task].metrics if task in LOCAL_TASKS else ():
        if m.name == metric:
            return " ↑" if m.higher_is_better else " ↓"
    return ""


def results_section(tasks: list[str], evals: Metrics) -> list[str]:
    """One table per task: a row per model, a column per metric."""
    lines = ["## Results per task", "", "↑: higher is better, ↓: lower is better.", ""]
    for task in tasks:
        cols = columns(task, evals)
        if not cols:
            continue
        header = ["model", *(f"{c.partition('.')[2]}{arrow(c)}" for c in cols)]
        rows = [[model, *(fmt(metrics.get(c)) for c in cols)] for model, metrics in evals.items()]
        lines += [f"### {task}", "", *table(header, rows), ""]
    return lines


def _delta(evals: Metrics, model: str, ref: str | None, key: str) -> str:
    if ref is None or ref == model or key not in evals.get(ref, {}):
        return "–"
    return f"{evals[model][key] - evals[ref][key]:+.3f}"


def summary_section(tasks: list[str], evals: Metrics, sources: dict[str, str]) -> list[str]:
    """The models across stages, one metric per task, each with its change against the model's input model (the
    stage before it) and against the baseline."""
    keys = [k for k in (primary(t, evals) for t in tasks) if k]
    if not keys:
        return []
    header = ["model", *(f"{k.removeprefix('llmpipe_').replace('.', '<br>')}{arrow(k)}" for k in keys)]
    rows = []
    for model, metrics in evals.items():
        cells = [model]
        for key in keys:
            if key not in metrics:
                cells.append("–")
                continue
            cells.append(f"{fmt(metrics[key])} ({_delta(evals, model, sources.get(model), key)} / "
                         f"{_delta(evals, model, BASELINE, key)})")
        rows.append(cells)
    note = (f"Each cell: value (change against the model's input model — {sources.get('sft', 'pretrain')} for sft, "
            f"sft for dpo, the policy for ppo and grpo — / change against {BASELINE}).")
    return ["## Results across stages", "", note, "", *table(header, rows), ""]


def tasks_section(tasks: list[str], evals: Metrics, stdlib: bool = True) -> list[str]:
    """What each task measures, in the words of the data (`stdlib`: the embedded corpus), with its document count."""
    lines = ["## Tasks", ""]
    for task in tasks:
        counts = [m[f"{task}.num_docs"] for m in evals.values() if f"{task}.num_docs" in m]
        docs = f", {fmt(max(counts))} documents" if counts else ""
        local = LOCAL_TASKS.get(task)
        if local is None:
            lines.append(f"- **{task}** (standard lm-eval task{docs}).")
            continue
        metrics = ", ".join(f"{m.name} {'↑' if m.higher_is_better else '↓'}" for m in local.metrics)
        lines.append(f"- **{task}** ({metrics}{docs}): {local.description(stdlib)}")
        too_long = max((m.get(f"{task}.num_too_long", 0) for m in evals.values()), default=0)
        if counts and max(counts) == 0 and too_long:
            lines.append(f"  *Skipped: all {fmt(too_long)} documents are longer than the evaluation context "
                         f"(`{task}.num_too_long`); raise eval.max_length (the evaluate stage's log names the "
                         "key when the model's own context caps it); no numbers.*")
        elif counts and max(counts) == 0:
            lines.append("  *Skipped: its evaluation set is empty (this data source has none); no numbers.*")
    return [*lines, ""]
