"""Which metrics files the report card may use: those whose recorded run identity (`llmpipe.config.identity`) is the
one the current params and inputs give. Every other stage and evaluation is "not run for these params": its
checks are skipped, its rows, figures and samples left out, and the headline omits it.

Under `dvc repro` every file the report reads is current (DVC reran what changed). The check matters for what
DVC does not order: a clone's committed files of the default run beside a user's run of a few stages, a stage
run by hand, a stage not rerun after a params edit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.config.identity import IDENTITY_KEY, differences, run_identity
from llmpipe.config.stages import METRICS_STAGES
from llmpipe.core.errors import UserError

Metrics = dict[str, dict[str, Any]]


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


def why_not_current(data: dict[str, Any], path: Path, current: dict[str, str]) -> str | None:
    """Why the metrics `data` read from `path` are not those of the run identity `current`, or None when they are."""
    recorded = data.get(IDENTITY_KEY)
    if not isinstance(recorded, dict):
        return f"{path} records no run identity (written by hand, or by an llmpipe from before it recorded one)"
    changed = differences(recorded, current)
    return f"{path} is from another run (changed since: {', '.join(changed)})" if changed else None


@dataclass(frozen=True)
class Found:
    """The metrics the card may use.

    Attributes:
        evals: ``{model: metrics}`` of every current evaluation, in ``eval.models`` order.
        stages: ``{stage: metrics}`` of every current ``metrics/<stage>.json``, in pipeline order.
        not_run: Why each other stage (by name) and evaluation (``evaluate@<model>``) is left out, in that order.
    """

    evals: Metrics
    stages: Metrics
    not_run: dict[str, str]


def _split(found: Metrics, not_run: dict[str, str], name: str, key: str, path: Path,
           current: Callable[[], dict[str, str]]) -> None:
    data = read_metrics(path)
    why = f"no {path}" if data is None else why_not_current(data, path, current())
    if why is None:
        found[name] = {k: v for k, v in data.items() if k != IDENTITY_KEY}
    else:
        not_run[key] = why


def collect(params: Params) -> Found:
    """Read every stage's and every evaluated model's metrics and keep the current ones.

    Raises:
        UserError: A metrics file is not a JSON object.
    """
    hashes: dict[str, str] = {}  # each input folder is hashed once
    metrics = Path(params.paths.metrics)
    evals: Metrics = {}
    stages: Metrics = {}
    not_run: dict[str, str] = {}
    for stage in METRICS_STAGES:
        _split(stages, not_run, stage, stage, metrics / f"{stage}.json",
               lambda s=stage: run_identity(params, s, cache=hashes))  # fmt: skip
    for model in params.eval.models:
        _split(evals, not_run, model, f"evaluate@{model}", metrics / "eval" / f"{model}.json",
               lambda m=model: run_identity(params, "evaluate", m, hashes))  # fmt: skip
    return Found(evals, stages, not_run)
