"""`report` stage: the pipeline's report card, ``<paths.reports>/report.md`` (renders on GitHub, figures linked)
and ``report.html`` (one self-contained page, figures embedded), with its PNG figures in ``<paths.reports>/figures/``,
and the run's headline metrics ``<paths.metrics>/headline.json`` (:mod:`llmpipe.report.headline`).

Reads ``<paths.metrics>/eval/<model>.json`` for every model in ``eval.models``, ``<paths.metrics>/<stage>.json`` of
the earlier stages where present, their per-step logs ``<paths.logs>/<stage>/`` and ``dvc.lock``, and uses only the
metrics of the current params and inputs (:mod:`llmpipe.report.current`): every other stage and evaluation is shown
as not run, at the top of the card, and has no check, row, figure, sample or headline number. Writes every
file atomically: the checks (:mod:`llmpipe.evaluation.checks`, and the post-training stages' checks on the
executable tasks, :mod:`llmpipe.evaluation.task_checks`), the results across stages, figures, per-stage statistics,
samples, provenance and the estimated cost.
"""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import Params
from llmpipe.config.stages import REGISTRY, RL_TASKS, TRAINING_TASKS, resolve_template
from llmpipe.core.io import atomic_dir, atomic_file, write_json
from llmpipe.evaluation.checks import Check, run_checks
from llmpipe.evaluation.harness import answers_path
from llmpipe.evaluation.task_checks import run_task_checks
from llmpipe.evaluation.tasks import tasks_for
from llmpipe.report import card, current, figures, page, provenance, tables, vlm
from llmpipe.report.headline import headline

RL_KL_UNITS = {name: REGISTRY[name].kl_unit for name in RL_TASKS}
"""The RL stages and the unit of their ``kl_final`` (registry): our PPO sums the per-token KL over a response (the
penalty it pays); TRL's GRPO logs the mean per token."""


def input_models(params: Params) -> dict[str, str]:
    """``{training stage: the model it starts from}`` (pretrain starts from none), from the registry's inputs:
    ``${paths.models}/${ppo.policy}`` → ``sft`` (or ``dpo``); sft's is the baseline when nothing was pretrained
    (``pretrain.enabled: false``: models/pretrain points at the same weights as models/baseline)."""
    sources = {}
    for stage in TRAINING_TASKS:
        found = [Path(resolve_template(t, params)) for t in REGISTRY[stage].inputs if t.startswith("${paths.models}/")]
        if found:  # the first: ppo also reads models/reward, which is not where it starts
            sources[stage] = found[0].name
    if not params.pretrain.enabled:
        sources["sft"] = "baseline"
    return {stage: source for stage, source in sources.items() if REGISTRY[stage].causal_lm}  # not the reward model


def kl_targets(params: Params) -> dict[str, float]:
    """``{RL stage: its kl_target}`` for the RL stages whose section steers to one (ppo), in the unit of their
    ``kl_final`` (`llmpipe.config.stages.report_params` lists these keys among the report's params)."""
    return {name: params.stage(name).kl_target for name in RL_TASKS
            if "kl_target" in REGISTRY[name].section.model_fields}


def render(params: Params, found: current.Found, checks: list[Check], links: dict[str, str],
           prov: provenance.Provenance, images: dict[int, str]) -> str:
    """The report's markdown."""
    evals, stage_metrics = found.evals, found.stages
    stdlib = params.data.source == "stdlib"
    tasks = tasks_for(params.eval.tasks, stdlib)
    times = card.wall_times(stage_metrics, evals)
    logs = Path(params.paths.logs)
    ran = tuple(s for s in TRAINING_TASKS if s in stage_metrics)
    lines = [
        "# llmpipe report",
        "",
        f"Models ({', '.join(evals) or 'none'}) evaluated with lm-evaluation-harness on held-out "
        f"{'modules' if stdlib else f'records of your data (data.source: {params.data.source})'}, at most "
        f"{params.eval.limit or 'all'} documents per task. Numbers from `{params.paths.metrics}/`; "
        "rebuild with `dvc repro report`.",
        "",
        *card.not_run_section(found.not_run),
        *card.checks_section(checks),
        *tables.summary_section(tasks, evals, input_models(params)),
        *card.figures_section(links),
        *card.stages_section(stage_metrics, logs, [s for s in TRAINING_TASKS if s in found.not_run]),
        *card.rl_section(stage_metrics, RL_KL_UNITS, stdlib),
        *card.samples_section(ran, logs),
        *card.answers_section({m: answers_path(params, m) for m in evals}),
        *vlm.section(stage_metrics.get("vlm"), logs / "vlm" / "answers", images),
        *tables.results_section(tasks, evals),
        *tables.tasks_section(tasks, evals, stdlib),
        *card.wall_time_section(times),
        *card.provenance_section(prov, params.report.cost_per_hour, sum(times.values())),
    ]
    return "\n".join(lines)


def run(params: Params) -> dict[str, float]:
    """Write the report card, its figures and the headline metrics (under ``paths.output_root``).

    Returns:
        The checks' numbers (``check_<name>`` of :mod:`llmpipe.evaluation.checks` and
        :mod:`llmpipe.evaluation.task_checks`; a skipped one is absent), ``num_checks`` (run), ``num_checks_passed``
        and ``num_not_run`` (stages and evaluations left out as not run for these params).

    Raises:
        UserError: A metrics file is malformed.
    """
    found = current.collect(params)
    stdlib, sources = params.data.source == "stdlib", input_models(params)
    checks = [*run_checks(found.evals, found.stages, stdlib, sources["sft"]),
              *run_task_checks(found.evals, found.stages, sources, kl_targets(params))]
    reports = params.paths.out(params.paths.reports)
    ran = tuple(s for s in TRAINING_TASKS if s in found.stages)
    with atomic_dir(reports / "figures") as tmp:
        drawn = figures.draw_all(Path(params.paths.logs), ran, tuple(s for s in RL_KL_UNITS if s in ran), tmp)
        images = vlm.copy_images(Path(params.paths.logs, "vlm", "answers"), tmp) if "vlm" in ran else {}
    links = {name: f"figures/{path.name}" for name, path in drawn.items()}
    own = [params.paths.reports, params.paths.metrics, params.paths.logs]
    prov = provenance.collect(Path("."), own)
    text = render(params, found, checks, links, prov, images) + "\n"
    with atomic_file(reports / "report.md") as fh:
        fh.write(text)
    with atomic_file(reports / "report.html") as fh:
        fh.write(page.render(text, reports, "llmpipe report"))
    # nested under "headline": `dvc exp show` then names its columns headline.<key> (docs/experiments.md, "Compare runs")
    write_json(params.paths.out(params.paths.metrics, "headline.json"),
               {"headline": headline(found.evals, found.stages, checks, len(found.not_run))})
    done = [c for c in checks if c.passed is not None]
    return {
        **{c.metric: round(c.value, 6) for c in done if c.value is not None},
        "num_checks": len(done),
        "num_checks_passed": sum(c.passed for c in done),
        "num_not_run": len(found.not_run),
    }
