"""What a `full-pipeline` run did, as data and as the markdown of its Prefect artifact."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmpipe.config.identity import IDENTITY_KEY
from llmpipe.orchestration.plan import PlannedStage

EVALUATE_STAGE = "evaluate"
"""The DVC matrix stage whose instances (`evaluate@<model>`) each get a table artifact."""

REPORT_STAGE = "report"
"""The DVC stage whose output is the report card (reports/report.md)."""


@dataclass(frozen=True)
class StageRun:
    """What running one stage did."""

    name: str
    status: Literal["ran", "up to date", "restored from run cache"]
    wall_s: float
    """Seconds the stage's `dvc repro` took, retries excluded."""


@dataclass(frozen=True)
class PipelineResult:
    """What a `full-pipeline` run did: returned by the flow, summarised in its markdown artifact."""

    workdir: str
    """Where the stages ran: the repository, or the isolated copy of an experiment (removed at the end)."""
    experiment: str | None
    """The DVC experiment the run was saved as, or None for a run in the workspace."""
    stages: list[StageRun]
    wall_s: float
    """Seconds from the slot being acquired to the last metrics being read."""


def _flatten(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
        if key == IDENTITY_KEY:  # hashes of the params and inputs the metrics came from: no figure to show
            continue
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_markdown(
    result: PipelineResult, plan: list[PlannedStage], metrics: dict, params_diff: dict, models_dir: str
) -> str:
    """The run's summary: where the report and models are, stages with status, wall time and outputs, the
    params diff, every stage's metrics. `models_dir` is `paths.models`."""
    runs = {r.name: r for r in result.stages}
    # An experiment's copy is removed once saved: its outputs are named relative to the repository.
    where = (lambda out: f"`{out}`") if result.experiment else (lambda out: f"`{Path(result.workdir) / out}`")
    report = [where(o) for s in plan if s.name == REPORT_STAGE for o in s.outs]
    models = [where(o) for s in plan for o in s.outs if Path(o).parts[0] == models_dir]
    lines = ["# full-pipeline", ""]
    if result.experiment:
        lines.append(
            f"Saved as DVC experiment **{result.experiment}** (`dvc exp show`); its outputs are in the DVC cache: "
            f"`dvc exp apply {result.experiment}` puts them in the workspace.\n"
        )
    lines += [f"- Report: {', '.join(report) or '(report not run)'}", f"- Models: {', '.join(models) or '-'}", ""]
    lines += ["## Stages", "", "| stage | status | wall time (s) | outputs |", "|---|---|---:|---|"]
    for stage in plan:
        run = runs[stage.name]
        lines.append(f"| {stage.name} | {run.status} | {run.wall_s:.1f} | {', '.join(map(where, stage.outs)) or '-'} |")
    lines += ["", f"Total wall time: {result.wall_s:.1f} s.", "", "## Params diff against HEAD", ""]
    changes = [(f, k, v) for f, keys in params_diff.items() for k, v in sorted(keys.items())]
    if changes:
        lines += ["| file | key | old | new |", "|---|---|---|---|"]
        lines += [f"| {f} | {k} | {_fmt(v.get('old'))} | {_fmt(v.get('new'))} |" for f, k, v in changes]
    else:
        lines.append("No params changed.")
    lines += ["", "## Metrics (`dvc metrics show`)", "", "| stage | metric | value |", "|---|---|---:|"]
    for stage in plan:
        for path in stage.metrics:
            for key, value in _flatten(metrics.get(path, {})):
                lines.append(f"| {stage.name} | {key} | {_fmt(value)} |")
    return "\n".join(lines) + "\n"


def eval_tables(plan: list[PlannedStage], metrics: dict) -> dict[str, list[dict[str, Any]]]:
    """One table per evaluation stage: ``{"eval-<model>": [{"metric", "value"}, …]}``."""
    tables = {}
    for stage in plan:
        group, _, model = stage.name.partition("@")
        if group == EVALUATE_STAGE:
            key = "eval-" + re.sub(r"[^a-z0-9-]+", "-", model.lower())
            tables[key] = [
                {"metric": k, "value": v} for path in stage.metrics for k, v in _flatten(metrics.get(path, {}))
            ]
    return tables
