"""The Prefect flow `full-pipeline`: every stage of the DVC DAG as a Prefect task, in DVC's order.

DVC owns the DAG, the caching and the lineage; this flow runs it as a service. It reads the stage graph
from DVC itself (`dvc.repo.Repo(root).index.graph`: dvc.yaml is the only list of stages) and runs each
stage as one task, `dvc repro --single-item <stage>`, so DVC still skips what is up to date and records
`dvc.lock`. A failed stage is retried (`orchestration.retries` in params.yaml) and a retried training
stage resumes from its checkpoint. A run with `set_params` works in an isolated git worktree of the
repository that shares its DVC cache, and saves its result as a DVC experiment; the main workspace,
params.yaml included, is not touched. Every run holds the repository's Prefect global concurrency limit
(one slot), so a second run waits instead of failing on DVC's lock.

Run it served (flows/serve.py), deployed (prefect.yaml), or by hand: `python -c "from full_pipeline
import full_pipeline; full_pipeline()"` from flows/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import flow_run as current_flow_run
from prefect.states import State

from llmpipe.config import load_params
from llmpipe.orchestration import experiments
from llmpipe.orchestration.experiments import check_experiment, dvc, working_copy_path
from llmpipe.orchestration.plan import PlannedStage, stage_plan
from llmpipe.orchestration.processes import end_marked_processes, run_command, stage_env
from llmpipe.orchestration.summary import REPORT_STAGE, PipelineResult, StageRun, eval_tables, summary_markdown
from llmpipe.report.page import markdown_with_images

__all__ = ["full_pipeline", "limit_name", "repository_root", "check_experiment", "stage_plan", "working_copy_path"]


class StageFailedError(RuntimeError):
    """`dvc repro` of one stage exited non-zero; its output is in the task's log."""


# --- where the flow runs ---------------------------------------------------------------------------------


def repository_root() -> Path:
    """The repository this flow file belongs to (flows/ sits at its root).

    Raises:
        FileNotFoundError: There is no dvc.yaml next to flows/.
    """
    root = Path(__file__).resolve().parents[1]
    if not (root / "dvc.yaml").is_file():
        raise FileNotFoundError(f"{root}/dvc.yaml not found: flows/ must sit at the root of an llmpipe checkout")
    return root


def limit_name(root: Path) -> str:
    """The Prefect global concurrency limit of a repository: its path, made a valid Prefect name, plus a hash."""
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    return f"llmpipe-repo{re.sub(r'[^A-Za-z0-9_.-]+', '-', str(root))}-{digest}"


@contextlib.contextmanager
def repository_slot(root: Path) -> Iterator[None]:
    """Hold the one slot of the repository's global concurrency limit, creating the limit (1 slot) if missing.

    Prefect skips a missing limit with only a warning, so the limit is created first and then acquired
    strictly. The slot's lease is renewed while held and expires 60 s after a process dies without
    releasing it.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    logger = get_run_logger()
    name = limit_name(root)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    logger.info("waiting for the slot of concurrency limit %s", name)
    start = time.perf_counter()
    with concurrency(name, occupy=1, strict=True, lease_duration=60):
        logger.info("holding the slot of %s (waited %.1f s)", name, time.perf_counter() - start)
        yield


def end_leftover_stage_processes(flow: Any, flow_run: FlowRun, state: State) -> None:
    """Flow hook on cancellation and crash: end any stage process of this flow run that is still alive.

    The task already ends its stage's process group when interrupted; this covers the flow process itself
    being killed before it could (the runner's SIGKILL after its grace period).
    """
    end_marked_processes(str(flow_run.id))


# --- isolated working copy for experiments ---------------------------------------------------------------


@task(cache_policy=NO_CACHE)
def make_working_copy(root: Path, experiment: str, overrides: list[str]) -> Path:
    """:func:`llmpipe.orchestration.experiments.make_working_copy` as a task."""
    return experiments.make_working_copy(root, experiment, overrides, get_run_logger())


@task(cache_policy=NO_CACHE)
def save_experiment(workdir: Path, experiment: str, stages: list[str]) -> str:
    """:func:`llmpipe.orchestration.experiments.save_experiment` as a task."""
    experiments.save_experiment(workdir, experiment, stages)
    get_run_logger().info("saved DVC experiment %s: `dvc exp show`, `dvc exp apply %s`", experiment, experiment)
    return experiment


@task(cache_policy=NO_CACHE)
def remove_working_copy(root: Path, workdir: Path) -> None:
    """Drop an experiment's working copy once it is saved (its outputs are in the DVC cache)."""
    experiments.remove_worktree(root, workdir)
    get_run_logger().info("removed the working copy %s", workdir)


# --- the stages --------------------------------------------------------------------------------------------


@task(cache_policy=NO_CACHE)
def plan_stages(workdir: Path, targets: list[str] | None) -> list[PlannedStage]:
    """:func:`stage_plan` as a task: the stages to run, in order."""
    plan = stage_plan(workdir, targets)
    get_run_logger().info("stages in order: %s", ", ".join(s.name for s in plan))
    return plan


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(workdir: Path, stage: str, force: bool) -> StageRun:
    """`dvc repro --single-item <stage>` in `workdir`, its output streamed to this task's log.

    DVC skips the stage when its deps, params and outs match dvc.lock (or restores its outputs from the
    run cache), and records dvc.lock when it runs. The process runs in its own group; a cancelled run
    ends the whole tree (dvc, llm-train, accelerate workers) and DVC releases its lock.

    Args:
        workdir: The repository or working copy.
        stage: DVC stage name, e.g. `evaluate@sft`.
        force: Run the stage even if DVC finds it up to date.

    Raises:
        StageFailedError: `dvc repro` exited non-zero (retried per `orchestration.retries`).
    """
    logger = get_run_logger()
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", *(["--force"] if force else []), stage]
    seen: list[str] = []

    def log_line(line: str) -> None:
        if line.startswith(("Running stage", "Stage '")):
            seen.append(line)
        logger.info(line)

    start = time.perf_counter()
    code = run_command(cmd, workdir, stage_env(current_flow_run.id), log_line)
    wall_s = time.perf_counter() - start
    if code:
        raise StageFailedError(f"{stage}: `dvc repro --single-item {stage}` exited with {code} after {wall_s:.1f} s")
    if any(line.startswith("Running stage") for line in seen):
        status = "ran"
    elif any("is cached - skipping run" in line for line in seen):
        status = "restored from run cache"
    else:
        status = "up to date"
    logger.info("%s: %s in %.1f s", stage, status, wall_s)
    return StageRun(name=stage, status=status, wall_s=round(wall_s, 3))


# --- artifacts ---------------------------------------------------------------------------------------------


@task(cache_policy=NO_CACHE)
def read_metrics(workdir: Path) -> dict[str, dict[str, Any]]:
    """Every metrics file of the working copy, `{path: {metric: value}}` (`dvc metrics show`)."""
    shown = json.loads(dvc(workdir, "metrics", "show", "--json") or "{}")
    files = next(iter(shown.values()), {}).get("data", {})
    return {path: found.get("data", {}) for path, found in files.items()}


@task(cache_policy=NO_CACHE)
def read_params_diff(workdir: Path) -> dict[str, dict[str, Any]]:
    """Params changed against the working copy's HEAD, `{file: {key: {"old": …, "new": …}}}` (`dvc params diff`)."""
    out = dvc(workdir, "params", "diff", "--json")
    return json.loads(out) if out.strip() else {}


@task(cache_policy=NO_CACHE)
def publish_artifacts(result: PipelineResult, plan: list[PlannedStage], metrics: dict, params_diff: dict) -> None:
    """The summary markdown artifact (`full-pipeline-summary`), the report card (`report-card`, figures embedded)
    when the run has one, and a table artifact per evaluation (`eval-<model>`, one row per metric)."""
    models_dir = load_params(Path(result.workdir) / "params.yaml").paths.models
    create_markdown_artifact(
        key="full-pipeline-summary",
        markdown=summary_markdown(result, plan, metrics, params_diff, models_dir),
        description=f"full-pipeline: {len(plan)} stages, experiment {result.experiment or '(none: the workspace)'}",
    )
    cards = [Path(result.workdir, o) for s in plan if s.name == REPORT_STAGE for o in s.outs if o.endswith(".md")]
    for card in (c for c in cards if c.exists()):
        create_markdown_artifact(key="report-card", markdown=markdown_with_images(card),
                                 description=f"the report card ({card.name}), figures embedded")
    for key, rows in eval_tables(plan, metrics).items():
        create_table_artifact(key=key, table=rows, description=f"{key}: lm-eval metrics")


# --- the flow ----------------------------------------------------------------------------------------------


@flow(name="full-pipeline", on_cancellation=[end_leftover_stage_processes], on_crashed=[end_leftover_stage_processes])
def full_pipeline(
    stages: list[str] | None = None,
    set_params: dict[str, str] | None = None,
    experiment_name: str | None = None,
    force: bool = False,
) -> PipelineResult:
    """Run the DVC pipeline of this repository, one task per stage, in topological order.

    Args:
        stages: Run these stages and the stages they need (`evaluate` means every `evaluate@<model>`);
            None: all of dvc.yaml.
        set_params: params.yaml overrides, as `dvc exp run -S` takes them: `{"train.lr": "5e-4"}`. The run
            then works in an isolated copy of the repository and is saved as a DVC experiment.
        experiment_name: Name of that experiment (default: the flow run's name). Given alone, the current
            params are run in a copy and saved as an experiment.
        force: Run every selected stage even if DVC finds it up to date.

    Returns:
        What each stage did and how long it took.
    """
    root = repository_root()
    orchestration = load_params(root / "params.yaml").orchestration  # validated before any work
    experiment = experiment_name or (current_flow_run.name if set_params is not None else None)
    overrides = check_experiment(root, experiment, set_params or {}) if experiment else []
    if stages:
        stage_plan(root, stages)  # a wrong stage name fails here, before any work
    run = run_stage.with_options(retries=orchestration.retries, retry_delay_seconds=orchestration.retry_delay_s)

    with repository_slot(root):
        start = time.perf_counter()
        workdir = make_working_copy(root, experiment, overrides) if experiment else root
        plan = plan_stages(workdir, stages)
        try:
            runs = [run(workdir, stage.name, force) for stage in plan]
        except BaseException:
            if experiment:
                get_run_logger().warning(
                    "kept the working copy %s: run again with experiment_name=%s to resume it", workdir, experiment
                )
            raise
        if experiment:
            save_experiment(workdir, experiment, [stage.name for stage in plan])
        metrics, params_diff = read_metrics(workdir), read_params_diff(workdir)
        result = PipelineResult(str(workdir), experiment, runs, round(time.perf_counter() - start, 3))
        publish_artifacts(result, plan, metrics, params_diff)
        if experiment:
            remove_working_copy(root, workdir)
    return result
