"""`report` stage: the pipeline's report card, ``<paths.reports>/report.md`` (renders on GitHub, figures linked)
and ``report.html`` (one self-contained page, figures embedded), with its PNG figures in ``<paths.reports>/figures/``,
and the run's headline metrics ``<paths.metrics>/headline.json`` (:mod:`llmpipe.report.headline`).

Reads ``<paths.metrics>/eval/<model>.json`` for every model in ``eval.models``, ``<paths.metrics>/<stage>.json`` of
the earlier stages where present, their per-step logs ``<paths.logs>/<stage>/`` and ``dvc.lock``; writes every
file atomically: the checks and what post-training cost (:mod:`llmpipe.evaluation.checks`), the results across
stages, figures, per-stage statistics, samples, provenance and the estimated cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.config.stages import METRICS_STAGES, REGISTRY, RL_TASKS, TRAINING_TASKS, resolve_template
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, atomic_file, write_json
from llmpipe.evaluation.checks import Check, Metrics, run_checks, run_costs
from llmpipe.report import card, figures, page, provenance, tables, vlm
from llmpipe.report.headline import headline

RL_KL_UNITS = {name: REGISTRY[name].kl_unit for name in RL_TASKS}
"""The RL stages and the unit of their ``kl_final`` (registry): our PPO sums the per-token KL over a response (the
penalty it pays); TRL's GRPO logs the mean per token."""


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


def input_models(params: Params) -> dict[str, str]:
    """``{training stage: the model it starts from}`` (pretrain starts from none), from the registry's inputs:
    ``${paths.models}/${ppo.policy}`` → ``sft`` (or ``dpo``)."""
    sources = {}
    for stage in TRAINING_TASKS:
        found = [Path(resolve_template(t, params)) for t in REGISTRY[stage].inputs if t.startswith("${paths.models}/")]
        if found:  # the first: ppo also reads models/reward, which is not where it starts
            sources[stage] = found[0].name
    return {stage: source for stage, source in sources.items() if REGISTRY[stage].causal_lm}  # not the reward model


def render(params: Params, evals: Metrics, stage_metrics: dict[str, dict[str, Any]], checks: list[Check],
           costs: list[Check], links: dict[str, str], prov: provenance.Provenance, images: dict[int, str]) -> str:
    """The report's markdown."""
    tasks = list(dict.fromkeys(params.eval.tasks))
    times = card.wall_times(stage_metrics, evals)
    logs = Path(params.paths.logs)
    lines = [
        "# llmpipe report",
        "",
        f"Models ({', '.join(evals)}) evaluated with lm-evaluation-harness on held-out modules, at most "
        f"{params.eval.limit or 'all'} documents per task. Numbers from `{params.paths.metrics}/`; "
        "rebuild with `dvc repro report`.",
        "",
        *card.checks_section(checks, costs),
        *tables.summary_section(tasks, evals, input_models(params)),
        *card.figures_section(links),
        *card.stages_section(stage_metrics, logs),
        *card.rl_section(stage_metrics, RL_KL_UNITS),
        *card.samples_section(TRAINING_TASKS, logs),
        *vlm.section(stage_metrics.get("vlm"), logs / "vlm" / "answers", images),
        *tables.results_section(tasks, evals),
        *tables.tasks_section(tasks, evals),
        *card.wall_time_section(times),
        *card.provenance_section(prov, params.report.cost_per_hour, sum(times.values())),
    ]
    return "\n".join(lines)


def run(params: Params) -> dict[str, float]:
    """Write the report card, its figures and the headline metrics (under ``paths.output_root``).

    Returns:
        The checks' and costs' numbers (``check_<name>``, ``cost_<stage>_<what>`` of
        :mod:`llmpipe.evaluation.checks`; a skipped one is absent), ``num_checks`` (run) and ``num_checks_passed``.

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
    costs = run_costs(evals, input_models(params), tuple(RL_KL_UNITS))
    reports = params.paths.out(params.paths.reports)
    with atomic_dir(reports / "figures") as tmp:
        drawn = figures.draw_all(Path(params.paths.logs), TRAINING_TASKS, tuple(RL_KL_UNITS), tmp)
        images = vlm.copy_images(Path(params.paths.logs, "vlm", "answers"), tmp)
    links = {name: f"figures/{path.name}" for name, path in drawn.items()}
    own = [params.paths.reports, params.paths.metrics, params.paths.logs]
    prov = provenance.collect(Path("."), own)
    text = render(params, evals, stage_metrics, checks, costs, links, prov, images) + "\n"
    with atomic_file(reports / "report.md") as fh:
        fh.write(text)
    with atomic_file(reports / "report.html") as fh:
        fh.write(page.render(text, reports, "llmpipe report"))
    # nested under "headline": `dvc exp show` then names its columns headline.<key> (docs/experiments.md, "Compare runs")
    write_json(params.paths.out(params.paths.metrics, "headline.json"),
               {"headline": headline(evals, stage_metrics, checks, costs)})
    done = [c for c in checks if c.passed is not None]
    return {
        **{c.metric: round(c.value, 6) for c in [*done, *costs] if c.value is not None},
        "num_checks": len(done),
        "num_checks_passed": sum(c.passed for c in done),
    }
