"""`report` stage: ``<paths.reports>/report.md``, the pipeline's report card.

Reads ``<paths.metrics>/eval/<model>.json`` for every model in ``eval.models`` and, where present,
``<paths.metrics>/<stage>.json`` of the earlier stages; writes one markdown file (atomically): every model ×
metric, what each task measures, the three checks (:mod:`llmpipe.evaluation.checks`), the training metrics
and every stage's wall time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file
from llmpipe.evaluation.checks import Check, Metrics, run_checks
from llmpipe.evaluation.tasks import LOCAL_TASKS
from llmpipe.stages import METRICS_STAGES, REGISTRY

TRAINING_COLUMNS = (
    "train_loss", "eval_loss", "steps", "tokens_per_s", "mfu", "peak_memory_gb", "world_size", "num_parameters"
)
"""Columns of the training table (keys of a training stage's metrics; mfu only where the device's peak is known)."""

MARKS = {True: "✓", False: "✗", None: "–"}


def read_metrics(path: Path) -> dict[str, Any] | None:
    """A metrics JSON, or None when the file does not exist.

    Raises:
        UserError: The file is not a JSON object.
    """
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(
            f"{path}: not valid JSON ({err.msg}, line {err.lineno}); rerun the stage that writes it"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object of metrics; rerun the stage that writes it") from None
    return data


def eval_metrics(params: Params) -> Metrics:
    """``{model: metrics}`` for every model in ``eval.models``, in that order.

    Raises:
        UserError: A model has not been evaluated yet (names the DVC stage to run).
    """
    evals = {}
    for model in params.eval.models:
        path = Path(params.paths.metrics, "eval", f"{model}.json")
        data = read_metrics(path)
        if data is None:
            raise UserError(f"{path}: missing; evaluate {model} first (dvc repro evaluate@{model})")
        evals[model] = data
    return evals


def columns(task: str, evals: Metrics) -> list[str]:
    """Metric keys of `task` shown in its results table: for an llmpipe task its declared metrics, for a
    standard lm-eval task every metric found (no stderrs, no document counts)."""
    found = {key for metrics in evals.values() for key in metrics}
    if task in LOCAL_TASKS:
        names = [f"{task}.{m.name}" for m in LOCAL_TASKS[task].metrics]
    else:
        names = sorted(k for k in found if k.startswith(f"{task}.") and not k.endswith(("_stderr", ".num_docs")))
    return [name for name in names if name in found]


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


def _arrow(key: str) -> str:
    task, _, metric = key.partition(".")
    for m in LOCAL_TASKS[task].metrics if task in LOCAL_TASKS else ():
        if m.name == metric:
            return " ↑" if m.higher_is_better else " ↓"
    return ""


def results_section(tasks: list[str], evals: Metrics) -> list[str]:
    """One table per task: a row per model, a column per metric."""
    lines = ["## Results", "", "↑: higher is better, ↓: lower is better.", ""]
    for task in tasks:
        cols = columns(task, evals)
        if not cols:
            continue
        header = ["model", *(f"{c.partition('.')[2]}{_arrow(c)}" for c in cols)]
        rows = [[model, *(fmt(metrics.get(c)) for c in cols)] for model, metrics in evals.items()]
        lines += [f"### {task}", "", *table(header, rows), ""]
    return lines


def tasks_section(tasks: list[str], evals: Metrics) -> list[str]:
    lines = ["## Tasks", ""]
    for task in tasks:
        counts = [m[f"{task}.num_docs"] for m in evals.values() if f"{task}.num_docs" in m]
        docs = f", {fmt(max(counts))} documents" if counts else ""
        local = LOCAL_TASKS.get(task)
        if local is None:
            lines.append(f"- **{task}** (standard lm-eval task{docs}).")
            continue
        metrics = ", ".join(f"{m.name} {'↑' if m.higher_is_better else '↓'}" for m in local.metrics)
        lines.append(f"- **{task}** ({metrics}{docs}): {local.measures}")
        too_long = max((m.get(f"{task}.num_too_long", 0) for m in evals.values()), default=0)
        if counts and max(counts) == 0 and too_long:
            lines.append(f"  *Skipped: all {fmt(too_long)} documents are longer than the evaluation context "
                         f"(`{task}.num_too_long`); raise eval.max_length (the evaluate stage's log names the "
                         "key when the model's own context caps it); no numbers.*")
        elif counts and max(counts) == 0:
            lines.append("  *Skipped: its evaluation set is empty (this data source has none); no numbers.*")
    return [*lines, ""]


def checks_section(checks: list[Check]) -> list[str]:
    lines = ["## Checks", ""]
    for check in checks:
        lines.append(f"- {MARKS[check.passed]} {check.claim}: {check.detail}")
    return [*lines, ""]


def training_section(stage_metrics: dict[str, dict[str, Any]]) -> list[str]:
    rows = [[stage, *(fmt(m.get(c)) for c in TRAINING_COLUMNS)]
            for stage, m in stage_metrics.items() if any(c in m for c in TRAINING_COLUMNS[:4])]
    if not rows:
        return []
    return ["## Training", "", *table(["stage", *TRAINING_COLUMNS], rows), ""]


RL_KL_UNITS = {name: s.kl_unit for name, s in REGISTRY.items() if s.kl_unit}
"""The RL stages and the unit of their ``kl_final`` (registry): our PPO sums the per-token KL over a response (the
penalty it pays); TRL's GRPO logs the mean per token."""


def rl_section(stage_metrics: dict[str, dict[str, Any]]) -> list[str]:
    """The RL stages' drift from where they started: reward, KL to the reference, response length."""
    header = ["stage", "reward first 10%", "reward last 10%", "KL to reference (end)", "response tokens first → last"]
    rows = []
    for stage, kl_unit in RL_KL_UNITS.items():
        m = stage_metrics.get(stage)
        if m is None or "reward_first" not in m:
            continue
        rows.append([
            stage,
            f"{fmt(m['reward_first'])} ± {fmt(m.get('reward_first_se'))}",
            f"{fmt(m.get('reward_last'))} ± {fmt(m.get('reward_last_se'))}",
            f"{fmt(m.get('kl_final'))} {kl_unit}" if "kl_final" in m else "–",
            f"{fmt(m.get('response_length_first'))} → {fmt(m.get('response_length_last'))}",
        ])
    if not rows:
        return []
    note = ("Reward hacking shows as reward up while the generation task's score stays flat, the share of trivial "
            "bodies (llmpipe_generation.trivial) rises, the share of distinct bodies (llmpipe_generation.distinct) "
            "falls (one body written for every prompt), or responses shrink or grow far from where they started.")
    return ["## RL stages", "", *table(header, rows), "", note, ""]


def wall_time_section(stage_metrics: dict[str, dict[str, Any]], evals: Metrics) -> list[str]:
    times = {stage: m["wall_time_s"] for stage, m in stage_metrics.items() if "wall_time_s" in m}
    times |= {f"evaluate@{model}": m["wall_time_s"] for model, m in evals.items() if "wall_time_s" in m}
    if not times:
        return []
    rows = [[name, f"{t:.1f}"] for name, t in times.items()] + [["**total**", f"**{sum(times.values()):.1f}**"]]
    return ["## Wall time", "", *table(["stage", "wall time (s)"], rows), ""]


def render(params: Params, evals: Metrics, stage_metrics: dict[str, dict[str, Any]], checks: list[Check]) -> str:
    """The report's markdown."""
    tasks = list(dict.fromkeys(params.eval.tasks))
    lines = [
        "# llmpipe report",
        "",
        f"Models ({', '.join(evals)}) evaluated with lm-evaluation-harness on held-out modules, at most "
        f"{params.eval.limit or 'all'} documents per task. Numbers from `{params.paths.metrics}/`; "
        "rebuild with `dvc repro report`.",
        "",
        *checks_section(checks),
        *results_section(tasks, evals),
        *tasks_section(tasks, evals),
        *training_section(stage_metrics),
        *rl_section(stage_metrics),
        *wall_time_section(stage_metrics, evals),
    ]
    return "\n".join(lines)


def run(params: Params) -> dict[str, float]:
    """Write ``<paths.reports>/report.md`` (under ``paths.output_root``).

    Returns:
        The checks' numbers (``check_<name>`` of :mod:`llmpipe.evaluation.checks`; a skipped check is absent),
        ``num_checks`` (run) and ``num_checks_passed``.

    Raises:
        UserError: A model in ``eval.models`` has no evaluation metrics, or a metrics file is malformed.
    """
    evals = eval_metrics(params)
    stage_metrics = {}
    for stage in METRICS_STAGES:
        data = read_metrics(Path(params.paths.metrics, f"{stage}.json"))
        if data is not None:
            stage_metrics[stage] = data
    checks = run_checks(evals, stage_metrics)
    with atomic_file(params.paths.out(params.paths.reports, "report.md")) as fh:
        fh.write(render(params, evals, stage_metrics, checks) + "\n")
    done = [c for c in checks if c.passed is not None]
    return {
        **{c.metric: round(c.value, 6) for c in done},
        "num_checks": len(done),
        "num_checks_passed": sum(c.passed for c in done),
    }
