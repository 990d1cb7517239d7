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
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import flow_run as current_flow_run
from prefect.states import State

from llmpipe.config import load_params, parse_params, set_dotted

EXPERIMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""A DVC experiment name that is also a valid git ref component and folder name."""

RUN_MARKER_ENV = "LLMPIPE_FLOW_RUN_ID"
"""Set on every stage process (and so inherited by its children): how a cancelled run's leftovers are found."""

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""Terminal control sequences (progress bars' cursor moves), dropped from the logged output."""

EVALUATE_STAGE = "evaluate"
"""The DVC matrix stage whose instances (`evaluate@<model>`) each get a table artifact."""

REPORT_STAGE = "report"
"""The DVC stage whose output is the report card (reports/report.md)."""


class StageFailedError(RuntimeError):
    """`dvc repro` of one stage exited non-zero; its output is in the task's log."""


@dataclass(frozen=True)
class PlannedStage:
    """One DVC stage to run, with what it writes."""

    name: str
    """DVC addressing, e.g. `pretrain` or `evaluate@sft`."""
    outs: tuple[str, ...]
    """Output paths (models, data, report), relative to the working copy."""
    metrics: tuple[str, ...]
    """Metrics files, relative to the working copy."""


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


def stage_env(flow_run_id: str | None) -> dict[str, str]:
    """Environment of a stage process: this one, this interpreter's bin/ first on PATH (so `dvc` and
    `llm-train` come from the flow's environment), and the flow run's id as a marker for cleanup."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env[RUN_MARKER_ENV] = flow_run_id or ""
    return env


def run_command(cmd: list[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None]) -> int:
    """Run `cmd` in its own process group, passing each output line to `on_line`; return its exit code.

    Whatever interrupts the wait (cancellation raises in this thread) ends the whole process tree first.
    """
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            # Progress bars redraw with \r and move the cursor: keep the last state of a line, without escapes.
            line = ANSI_ESCAPE.sub("", raw.decode(errors="replace").rstrip("\n").split("\r")[-1]).rstrip()
            if line:
                on_line(line)
        return proc.wait()
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End every process of `proc`'s group: SIGINT (DVC then releases its locks), SIGTERM, then SIGKILL.

    Args:
        proc: A process started with `start_new_session=True` (its pid is its group id).
        grace_s: Seconds to wait after SIGINT and after SIGTERM before escalating.
    """
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s / 2), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.1)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reaps the leader once it exits
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc.returncode is None or _group_has_live_member(proc.pid)


def _group_has_live_member(pgid: int) -> bool:
    import psutil

    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def end_leftover_stage_processes(flow: Any, flow_run: FlowRun, state: State) -> None:
    """Flow hook on cancellation and crash: end any stage process of this flow run that is still alive.

    The task already ends its stage's process group when interrupted; this covers the flow process itself
    being killed before it could (the runner's SIGKILL after its grace period).
    """
    import psutil

    marker = str(flow_run.id)
    leftovers = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(RUN_MARKER_ENV) == marker:
                leftovers.append(p)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(leftovers, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


# --- isolated working copy for experiments ---------------------------------------------------------------


def git(cwd: Path, *args: str) -> str:
    """`git <args>` in `cwd`; its stdout.

    Raises:
        RuntimeError: git failed; the message holds its stderr.
    """
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()}")
    return proc.stdout


def dvc(cwd: Path, *args: str) -> str:
    """`dvc <args>` in `cwd` with this interpreter; its stdout.

    Raises:
        RuntimeError: DVC failed; the message holds its output.
    """
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"dvc {' '.join(args)} failed in {cwd}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc.stdout


def working_copy_path(root: Path, experiment: str) -> Path:
    """Where an experiment's isolated copy lives: under .dvc/tmp (ignored by git and by DVC's stage search)."""
    return root / ".dvc" / "tmp" / "llmpipe-runs" / experiment


def check_experiment(root: Path, experiment: str, set_params: dict[str, str]) -> list[str]:
    """Validate an experiment request before any work; return the overrides as `dvc exp run -S` takes them
    (`key=value`, or `+key=value` for a valid key the file does not write out).

    The overrides are applied to a scratch copy of params.yaml with DVC's own `-S` parser and the result
    is validated like any params.yaml.

    Raises:
        ValueError: The name is invalid or taken, the repository has no commit, or the params are invalid
            (the message names the key and the fix).
    """
    from dvc.utils.hydra import apply_overrides

    if not EXPERIMENT_NAME.match(experiment):
        raise ValueError(
            f"experiment_name {experiment!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit)"
        )
    if subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root, capture_output=True).returncode:
        raise ValueError(f"{root} has no commit: an experiment is saved on top of a commit; `git commit` first")
    taken = git(root, "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps").split()
    if experiment in taken:
        raise ValueError(
            f"experiment {experiment!r} exists: choose another experiment_name or `dvc exp remove {experiment}`"
        )
    source = f"{root / 'params.yaml'} with set_params"
    raw = yaml.safe_load((root / "params.yaml").read_text())
    overrides = []
    for key, value in set_params.items():
        node = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) and part in node else KeyError
        if node is KeyError:  # not written in the file (e.g. a `train` default a stage inherits): the schema decides
            set_dotted(raw, key, value)
            parse_params(raw, source)  # an unknown key: ParamsError names it and suggests the right one
        overrides.append(f"{key}={value}" if node is not KeyError else f"+{key}={value}")
    with tempfile.TemporaryDirectory() as scratch:
        params_file = Path(scratch, "params.yaml")
        shutil.copy(root / "params.yaml", params_file)
        try:
            apply_overrides(params_file, overrides)
        except Exception as err:  # DVC/hydra: the value does not parse
            raise ValueError(f"set_params {set_params}: {err.__cause__ or err}") from None
        parse_params(yaml.safe_load(params_file.read_text()), source)  # ParamsError names the key and the fix
    return overrides


@task(cache_policy=NO_CACHE)
def make_working_copy(root: Path, experiment: str, overrides: list[str]) -> Path:
    """A git worktree of `root` at HEAD that shares its DVC cache and starts from the workspace's dvc.lock,
    with `overrides` applied to its params.yaml.

    No output is checked out: `dvc repro` of a stage whose lock entry still holds restores its outputs
    from the shared run cache, and DVC git-ignores them as it does so.

    A copy left by an earlier failed or cancelled run of the same experiment at the same commit is reused,
    so its checkpoints are resumed.
    """
    from dvc.repo import Repo
    from dvc.utils.hydra import apply_overrides

    logger = get_run_logger()
    path = working_copy_path(root, experiment)
    head = git(root, "rev-parse", "HEAD").strip()
    if git(root, "status", "--porcelain", "--untracked-files=no").strip():
        logger.warning("%s has uncommitted changes: the experiment starts from the last commit, without them", root)
    if path.exists() and git(path, "rev-parse", "HEAD").strip() == head:
        logger.info("reusing the working copy %s left by an earlier run (its checkpoints are resumed)", path)
        git(path, "checkout", "--", "params.yaml")
    else:
        if path.exists():
            remove_worktree(root, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        git(root, "worktree", "add", "--detach", str(path), "HEAD")
        with Repo(str(root)) as repo:
            cache_dir = repo.cache.local_cache_dir
        dvc(path, "config", "--local", "cache.dir", str(Path(cache_dir).resolve()))
        if (root / "dvc.lock").exists():
            shutil.copy(root / "dvc.lock", path / "dvc.lock")
        logger.info("made the working copy %s (git worktree at %s, DVC cache %s)", path, head[:8], cache_dir)
    apply_overrides(path / "params.yaml", overrides)
    logger.info("applied %s to %s", overrides, path / "params.yaml")
    return path


@task(cache_policy=NO_CACHE)
def save_experiment(workdir: Path, experiment: str, stages: list[str]) -> str:
    """`dvc exp save -n <experiment> <stages>` in the working copy; the experiment's name.

    The stages' outputs go to the shared cache; the files DVC does not git-ignore (dvc.lock, `cache: false`
    metrics and plots, .gitignore files) go into the experiment's commit, as `dvc exp run` does. Stages that
    did not run keep their lock entries from the workspace.
    """
    untracked = git(workdir, "ls-files", "--others", "--exclude-standard").split()
    include = [arg for path in untracked for arg in ("--include-untracked", path)]
    dvc(workdir, "exp", "save", "-n", experiment, *include, *stages)
    get_run_logger().info("saved DVC experiment %s: `dvc exp show`, `dvc exp apply %s`", experiment, experiment)
    return experiment


def remove_worktree(root: Path, path: Path) -> None:
    """Remove the git worktree at `path` (files included) and git's record of it."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    git(root, "worktree", "prune")


@task(cache_policy=NO_CACHE)
def remove_working_copy(root: Path, workdir: Path) -> None:
    """Drop an experiment's working copy once it is saved (its outputs are in the DVC cache)."""
    remove_worktree(root, workdir)
    get_run_logger().info("removed the working copy %s", workdir)


# --- the stages --------------------------------------------------------------------------------------------


def stage_plan(workdir: Path, targets: list[str] | None = None) -> list[PlannedStage]:
    """The stages to run, in topological order, read from DVC's stage graph.

    Args:
        workdir: The repository (or working copy) whose dvc.yaml is read.
        targets: Stage names (`pretrain`, `evaluate@sft`, or a matrix group like `evaluate`); each brings
            the stages it needs. None: every stage.

    Raises:
        ValueError: A target is not a stage of dvc.yaml (the message lists the stages).
    """
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    workdir = workdir.resolve()
    with Repo(str(workdir)) as repo:
        graph = repo.index.graph  # an edge points from a stage to a stage it depends on
        position = {stage: i for i, stage in enumerate(graph.nodes)}  # dvc.yaml order breaks ties
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=False), key=position.__getitem__))
        if targets:
            wanted = set()
            for target in targets:
                try:
                    wanted.update(repo.stage.collect(f"{workdir / 'dvc.yaml'}:{target}", with_deps=True, graph=graph))
                except DvcException as err:
                    known = ", ".join(_stage_name(s, workdir) for s in order)
                    raise ValueError(f"stages: {target!r} is not a stage of dvc.yaml ({err}); stages: {known}") from err
            order = [s for s in order if s in wanted]
        return [
            PlannedStage(
                name=_stage_name(s, workdir),
                outs=tuple(str(o.def_path) for o in s.outs if not o.metric and not o.plot),
                metrics=tuple(str(o.def_path) for o in s.outs if o.metric),
            )
            for s in order
        ]


def _stage_name(stage: Any, workdir: Path) -> str:
    """`pretrain`, `evaluate@sft`; `sub/dvc.yaml:name` for a stage of a dvc.yaml below the root."""
    dvcfile = Path(stage.path)
    return stage.name if dvcfile.parent == workdir else f"{dvcfile.relative_to(workdir)}:{stage.name}"


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


def _flatten(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in values.items():
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


@task(cache_policy=NO_CACHE)
def publish_artifacts(result: PipelineResult, plan: list[PlannedStage], metrics: dict, params_diff: dict) -> None:
    """The summary markdown artifact (`full-pipeline-summary`), and a table artifact per evaluation
    (`eval-<model>`, one row per metric)."""
    models_dir = load_params(Path(result.workdir) / "params.yaml").paths.models
    create_markdown_artifact(
        key="full-pipeline-summary",
        markdown=summary_markdown(result, plan, metrics, params_diff, models_dir),
        description=f"full-pipeline: {len(plan)} stages, experiment {result.experiment or '(none: the workspace)'}",
    )
    for stage in plan:
        group, _, model = stage.name.partition("@")
        if group != EVALUATE_STAGE:
            continue
        rows = [
            {"metric": key, "value": value}
            for path in stage.metrics
            for key, value in _flatten(metrics.get(path, {}))
        ]
        key = "eval-" + re.sub(r"[^a-z0-9-]+", "-", model.lower())
        create_table_artifact(key=key, table=rows, description=f"{stage.name}: lm-eval metrics of models/{model}")


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
