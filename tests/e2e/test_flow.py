"""The `full-pipeline` Prefect flow, served as deployment full-pipeline/full-pipeline by flows/serve.py,
against a real Prefect server on loopback, on tiny params in a temporary git + DVC repo.

The server keeps its state in SQLite, and for the tests marked `databases("sqlite", "postgresql")` (those whose
runs exercise the database: a served run, an experiment, a retry, a cancel, five runs queued on the slot) also in
a real PostgreSQL (conftest's `postgres`, one server per session, a database per module), started as
docs/service.md says. Per database one module-scoped repo, server and serve process: pytest runs every SQLite
test first, then the PostgreSQL ones, each group in file order, building on each other.
Every process started here is stopped here (SIGINT to its process group, then SIGKILL).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import ALL_STAGES, ROOT, TINY_PARAMS, free_port, make_pipeline_repo, sh, stages_restored, stages_run

sys.path.insert(0, str(ROOT / "flows"))
from full_pipeline import working_copy_path  # noqa: E402

from llmpipe.orchestration.database import SETTING  # noqa: E402
from llmpipe.orchestration.processes import stop_process_group  # noqa: E402

pytestmark = pytest.mark.slow

# Retries come quickly in tests; everything else is the tiny pipeline.
FLOW_PARAMS = TINY_PARAMS + "orchestration: {retries: 2, retry_delay_s: 1.0}\n"

# A pretrain long enough to be caught between checkpoints: 5-step checkpoints (save_steps is part of the
# checkpoint fingerprint, so these runs never resume the workspace's checkpoints).
LONG_PRETRAIN = {"pretrain.max_steps": "60", "pretrain.save_steps": "5", "pretrain.eval_steps": "1000"}

DEPLOYMENT = "full-pipeline/full-pipeline"



def production_commands() -> tuple[dict[str, str], list[str]]:
    """docs/service.md's PostgreSQL block, which these tests run: the settings it exports (database URL, pool size)
    and the server's command line."""
    text = (ROOT / "docs" / "service.md").read_text()
    lines = re.search(r"\*\*In production, PostgreSQL\*\*.*?```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    settings = dict(word.split("=", 1) for line in lines if line.startswith("export ") for word in line.split()[1:])
    assert SETTING in settings and lines[-1].startswith("python flows/server.py "), lines
    return settings, lines[-1].split()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that needs a server runs on SQLite, and also on PostgreSQL where marked `databases(...)`; one
    module-scoped server per database (test_flow_failures.py imports this hook with the fixtures)."""
    if "database" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("databases")
        metafunc.parametrize("database", marker.args if marker else ["sqlite"], indirect=True, scope="module")


def start(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `cmd` in its own process group, output to `log`."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def database(request) -> str:
    """Where the Prefect server keeps its state: "sqlite" (under PREFECT_HOME) or "postgresql"."""
    return request.param


@pytest.fixture(scope="module")
def env(pipeline_env, tmp_path_factory, database, request) -> dict[str, str]:
    env = dict(pipeline_env)
    if database == "postgresql":  # a database of this module's own on the session's server
        settings, _ = production_commands()
        settings[SETTING] = request.getfixturevalue("postgres").create_database(f"prefect_{request.module.__name__}")
        env.update(settings)
    env.update(
        PREFECT_HOME=str(tmp_path_factory.mktemp("prefect_home")),
        PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_RUNNER_POLL_FREQUENCY="2",  # serve picks up a new run within 2 s (default 10)
        # A run waiting for the repository's slot asks again within 5 s (default: up to 30 s).
        PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS="5",
        # As docs/service.md starts the server: logs streamed out, so `prefect deployment run --watch` shows them.
        PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED="true",
        PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED="true",
    )
    return env


@pytest.fixture(scope="module")
def repo(tmp_path_factory, env, trained_pipeline) -> Path:
    """The flow's own repo, with a copy of the session's trained DVC cache: its first run restores the stages
    from DVC's run cache (what the flow does is the same whether DVC trains or restores; training under the flow
    is what the retry and cancel tests below do)."""
    repo = make_pipeline_repo(tmp_path_factory.mktemp("flow_repo"), env, FLOW_PARAMS)
    shutil.copytree(trained_pipeline.cache, repo / ".dvc" / "cache", dirs_exist_ok=True)
    return repo


@pytest.fixture(scope="module")
def logs_dir(tmp_path_factory, database) -> Path:
    return tmp_path_factory.mktemp(f"process_logs_{database}")


@pytest.fixture(scope="module")
def server(env, logs_dir, repo):
    """`python flows/server.py` (`prefect server start`, its database checked first) on loopback: SQLite under its
    own PREFECT_HOME, or the PostgreSQL database of PREFECT_API_DATABASE_CONNECTION_URL."""
    _, cmd = production_commands()
    cmd[0], cmd[cmd.index("--port") + 1] = sys.executable, env["PREFECT_API_URL"].split(":")[-1].split("/")[0]
    proc = start(cmd, repo, env, logs_dir / "server.log")
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (logs_dir / "server.log").read_text()
            try:
                with urllib.request.urlopen(env["PREFECT_API_URL"] + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "server not healthy within 120 s"
            time.sleep(0.5)
        yield env["PREFECT_API_URL"]
    finally:
        stop_process_group(proc, grace_s=20)


@pytest.fixture(scope="module")
def client(server, env):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings({PREFECT_API_URL: server, PREFECT_HOME: env["PREFECT_HOME"]}):
        with get_client(sync_client=True) as c:
            yield c


@pytest.fixture(scope="module")
def served(repo, env, client, logs_dir):
    """`python flows/serve.py` in the repo, until the deployment is registered."""
    proc = start([sys.executable, "flows/serve.py"], repo, env, logs_dir / "serve.log")
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (logs_dir / "serve.log").read_text()
            try:
                client.read_deployment_by_name(DEPLOYMENT)
                break
            except Exception:
                assert time.time() < deadline, "deployment not served within 120 s"
                time.sleep(0.5)
        yield proc
    finally:
        stop_process_group(proc, grace_s=20)


def trigger(repo: Path, env: dict[str, str], **params: Any) -> str:
    """`prefect deployment run full-pipeline/full-pipeline --params …`; the flow run id."""
    out = sh(repo, env, "prefect", "deployment", "run", DEPLOYMENT, "--params", json.dumps(params))
    return re.search(r"UUID: ([0-9a-f-]{36})", out).group(1)


def wait_final(client, run_id: str, timeout_s: float = 600) -> Any:
    """The flow run once it is in a final state."""
    deadline = time.time() + timeout_s
    while True:
        run = client.read_flow_run(run_id)
        if run.state and run.state.is_final():
            return run
        assert time.time() < deadline, f"flow run {run_id} still {run.state.name} after {timeout_s} s"
        time.sleep(0.5)


def logs(client, run_id: str) -> list[Any]:
    """Every log record of a flow run (and its tasks), in time order; waits for the last one to arrive."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    deadline = time.time() + 30
    while True:
        records: list[Any] = []
        while batch := client.read_logs(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), offset=len(records), sort=LogSort.TIMESTAMP_ASC
        ):
            records += batch
        if any(r.task_run_id is None and "Finished in state" in r.message for r in records) or time.time() > deadline:
            return records
        time.sleep(0.5)


def text(records: list[Any]) -> str:
    return "\n".join(r.message for r in records)


def artifacts(client, run_id: str) -> dict[str, Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return {a.key: a for a in found}


def task_runs(client, run_id: str) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    found = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {t.name: t for t in found}


def tree_digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for root in paths:
        for f in sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]:
            h.update(str(f).encode() + f.read_bytes())
    return h.hexdigest()


def wait_for_checkpoint(run_dir: Path, client, run_id: str, timeout_s: float = 300) -> Path:
    deadline = time.time() + timeout_s
    while not (found := list(run_dir.glob("checkpoints/pretrain/*/checkpoint-*/trainer_state.json"))):
        run = client.read_flow_run(run_id)
        assert not run.state.is_final(), f"run ended {run.state.name} before a checkpoint"
        assert time.time() < deadline, f"no checkpoint under {run_dir} within {timeout_s} s"
        time.sleep(0.1)
    return found[0]


def pipeline_processes(where: Path) -> list[psutil.Process]:
    """Live `llm-train` / `dvc` processes working under `where`."""
    found = []
    for p in psutil.process_iter(["cmdline", "cwd", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        cwd = p.info["cwd"] or ""
        if p.info["status"] != psutil.STATUS_ZOMBIE and cwd.startswith(str(where)):
            if "llm-train" in cmd or re.search(r"\bdvc\b", cmd):
                found.append(p)
    return found


@pytest.mark.databases("sqlite", "postgresql")
def test_a_wrong_database_url_is_one_line_naming_the_setting_before_serving(postgres, pipeline_env, tmp_path):
    """flows/server.py and flows/serve.py (without PREFECT_API_URL it starts a temporary server of its own) refuse
    URLs the real PostgreSQL rejects: exit 2 with one line naming the setting, nothing served (unchecked, both end
    in a traceback from the server's start-up)."""
    env = {k: v for k, v in pipeline_env.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    cases = [(["server.py", "--port", str(free_port())], postgres.url("postgres", password="wrong"), "InvalidPasswordError"),
             (["serve.py"], postgres.url("no_such_database"), "InvalidCatalogNameError")]
    for (script, *args), url, cause in cases:
        proc = subprocess.run([sys.executable, f"flows/{script}", *args], cwd=ROOT, env={**env, SETTING: url},
                              capture_output=True, text=True, timeout=120)
        database = url.rpartition("/")[2]
        shown = f"{SETTING}=postgresql+asyncpg://prefect:***@127.0.0.1:{postgres.port}/{database}"
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"{script}: error: {shown}: cannot connect ({cause}"), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "serving" not in proc.stdout


@pytest.mark.databases("sqlite", "postgresql")
def test_served_deployment_runs_every_stage(repo, env, client, served, record_property):
    start_s = time.time()
    run_id = trigger(repo, env)
    run = wait_final(client, run_id)
    record_property("full_run_s", round(time.time() - start_s, 1))
    assert run.state.name == "Completed", text(logs(client, run_id))[-5000:]

    out = text(logs(client, run_id))
    # DVC's run cache restores every stage but the report, whose out (report.md, cache: false) it never restores; the
    # report reruns in seconds.
    assert stages_restored(out) == ALL_STAGES - {"report"} and stages_run(out) == {"report"}
    tasks = task_runs(client, run_id)
    assert ALL_STAGES <= set(tasks), "one task per DVC stage"
    assert all(tasks[s].state.name == "Completed" for s in ALL_STAGES)
    assert "Stage 'pretrain' is cached" in out, "a task's log shows its stage's output"

    found = artifacts(client, run_id)
    summary = found["full-pipeline-summary"].data
    for stage in ("prepare", "pretrain", "sft", "dpo", "evaluate@sft", "report"):
        assert f"| {stage} |" in summary
    assert "| pretrain | train_loss |" in summary and "wall time" in summary
    assert f"Report: `{repo / 'reports' / 'report.md'}`" in summary and f"`{repo / 'models' / 'dpo'}`" in summary
    for model in yaml.safe_load(TINY_PARAMS)["eval"]["models"]:
        table = found[f"eval-{model}"].data
        rows = json.loads(table) if isinstance(table, str) else table
        assert rows and {"metric", "value"} <= set(rows[0])
    assert (repo / "reports" / "report.md").exists() and (repo / "dvc.lock").exists()
    card = found["report-card"].data
    assert card.startswith("# llmpipe report") and "](data:image/png;base64," in card, "the card, figures embedded"


def test_second_run_does_nothing(repo, env, client, served, record_property):
    start_s = time.time()
    run_id = trigger(repo, env)
    run = wait_final(client, run_id)
    end_to_end_s = time.time() - start_s
    assert run.state.name == "Completed"
    out = text(logs(client, run_id))
    assert stages_run(out) == set(), "no stage ran"
    for stage in ALL_STAGES:
        assert f"{stage}: up to date in" in out
    flow_s = (run.end_time - run.start_time).total_seconds()
    record_property("noop_end_to_end_s", round(end_to_end_s, 1))
    record_property("noop_flow_s", round(flow_s, 1))
    print(f"\nno-op run: {end_to_end_s:.1f} s from trigger to Completed, flow run {flow_s:.1f} s")


@pytest.mark.databases("sqlite", "postgresql")
def test_set_params_saves_an_experiment_and_leaves_the_workspace(repo, env, client, served):
    before = tree_digest(repo / "params.yaml", repo / "dvc.lock", repo / "models", repo / "metrics")
    # dpo.beta reruns three stages (the pipeline test covers a train.lr experiment that reruns almost all).
    run_id = trigger(repo, env, set_params={"dpo.beta": "0.2"}, experiment_name="beta0.2")
    run = wait_final(client, run_id)
    out = text(logs(client, run_id))
    assert run.state.name == "Completed", out[-5000:]
    assert stages_run(out) == {"dpo", "evaluate@dpo", "report"}
    assert "resuming from" not in out, "the new beta never resumes another run's checkpoint"

    shown = json.loads(sh(repo, env, "dvc", "exp", "show", "--json"))
    exps = {rev["name"]: rev for baseline in shown for exp in baseline.get("experiments") or [] for rev in exp["revs"]}
    assert "beta0.2" in exps
    params = exps["beta0.2"]["data"]["params"]["params.yaml"]["data"]
    assert params["dpo"]["beta"] == 0.2
    assert "beta0.2" in sh(repo, env, "dvc", "exp", "show", "--csv")

    assert tree_digest(repo / "params.yaml", repo / "dvc.lock", repo / "models", repo / "metrics") == before
    assert sh(repo, env, "git", "status", "--porcelain", "--untracked-files=no") == ""
    assert not working_copy_path(repo, "beta0.2").exists(), "the saved experiment's copy is removed"
    assert len(sh(repo, env, "git", "worktree", "list").splitlines()) == 1
    summary = artifacts(client, run_id)["full-pipeline-summary"].data
    assert "beta0.2" in summary and "| params.yaml | dpo.beta |" in summary


@pytest.mark.databases("sqlite", "postgresql")
def test_killed_stage_is_retried_and_resumes_from_its_checkpoint(repo, env, client, served):
    run_id = trigger(repo, env, stages=["pretrain"], set_params=LONG_PRETRAIN, experiment_name="retried")
    copy = working_copy_path(repo, "retried")
    wait_for_checkpoint(copy, client, run_id)
    trainers = [p for p in pipeline_processes(copy) if "llm-train" in " ".join(p.cmdline())]
    assert trainers, "llm-train is running"
    for p in trainers:
        p.send_signal(signal.SIGKILL)

    run = wait_final(client, run_id)
    out = text(logs(client, run_id))
    assert run.state.name == "Completed", out[-5000:]
    step = re.search(r"resuming from \S+ \(step (\d+)\)", out)
    assert step and int(step.group(1)) >= 5, "the retry resumed from the checkpoint"
    assert task_runs(client, run_id)["pretrain"].run_count == 2
    assert "Retry" in out or "retry" in out


@pytest.mark.databases("sqlite", "postgresql")
def test_five_runs_queued_at_once_take_the_slot_in_turn(repo, env, client, served):
    run_ids = [trigger(repo, env, stages=["prepare"]) for _ in range(5)]
    runs = [wait_final(client, i) for i in run_ids]
    assert [r.state.name for r in runs] == ["Completed"] * 5

    spans = []
    for run_id in run_ids:
        records = logs(client, run_id)
        held = next(r.timestamp for r in records if r.message.startswith("holding the slot"))
        done = next(r.timestamp for r in records if r.message.startswith("prepare: up to date in"))
        spans.append((held, done))
    spans.sort()
    overlaps = [(a, b) for a, b in zip(spans, spans[1:]) if a[1] > b[0]]
    assert not overlaps, f"runs held the slot at the same time: {overlaps}"


@pytest.mark.databases("sqlite", "postgresql")
def test_cancel_mid_training_leaves_no_process_and_no_lock(repo, env, client, served):
    # Not the retried run's params (DVC's run cache holds them); a budget the cancel comes well before.
    params = {**LONG_PRETRAIN, "pretrain.seed": "7", "pretrain.max_steps": "1000"}
    run_id = trigger(repo, env, stages=["pretrain"], set_params=params, experiment_name="cancelled")
    copy = working_copy_path(repo, "cancelled")
    wait_for_checkpoint(copy, client, run_id)
    assert pipeline_processes(copy), "training is under way"
    sh(repo, env, "prefect", "flow-run", "cancel", run_id)
    run = wait_final(client, run_id, timeout_s=120)
    assert run.state.name == "Cancelled"

    deadline = time.time() + 30
    while (left := pipeline_processes(repo)) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, [p.info["cmdline"] for p in left]
    rwlock = json.loads((copy / ".dvc" / "tmp" / "rwlock").read_text())
    assert not rwlock.get("read") and not rwlock.get("write"), f"DVC's rwlock still holds {rwlock}"
    import zc.lockfile

    zc.lockfile.LockFile(str(copy / ".dvc" / "tmp" / "lock")).close()  # raises LockError if still held

    # The next run of the same experiment starts cleanly in the same copy and resumes its checkpoint
    # (a few steps more: max_steps is a budget, so the checkpoint's fingerprint still matches).
    last = max(int(p.parent.name[11:]) for p in copy.glob("checkpoints/pretrain/*/checkpoint-*/trainer_state.json"))
    resumed = trigger(repo, env, stages=["pretrain"], experiment_name="cancelled",
                      set_params={**params, "pretrain.max_steps": str(last + 5)})
    run = wait_final(client, resumed)
    out = text(logs(client, resumed))
    assert run.state.name == "Completed", out[-5000:]
    assert "reusing the working copy" in out and f"(step {last})" in out
    assert sh(repo, env, "git", "status", "--porcelain", "--untracked-files=no") == "", "the workspace is untouched"


def test_prefect_yaml_deploys_onto_a_process_work_pool(repo, env, client, served, logs_dir):
    """`prefect deploy` of prefect.yaml registers the same deployment on a process pool, and a worker runs it."""
    stop_process_group(served, grace_s=20)  # the served runner would take the redeployed deployment's runs too
    sh(repo, env, "prefect", "work-pool", "create", "llmpipe-process", "--type", "process")
    sh(repo, env, "prefect", "--no-prompt", "deploy", "--all")
    deployment = client.read_deployment_by_name(DEPLOYMENT)
    assert deployment.work_pool_name == "llmpipe-process"
    assert deployment.entrypoint == "flows/full_pipeline.py:full_pipeline"
    worker = start(["prefect", "worker", "start", "--pool", "llmpipe-process"], repo, env, logs_dir / "worker.log")
    try:
        run_id = trigger(repo, env, stages=["prepare"])
        run = wait_final(client, run_id, timeout_s=180)
        out = text(logs(client, run_id))
        assert run.state.name == "Completed", out[-3000:]
        assert "prepare: up to date in" in out
    finally:
        stop_process_group(worker, grace_s=20)


def test_no_telemetry_error_offline(logs_dir, served):
    for name in ("server.log", "serve.log", "worker.log"):
        log = (logs_dir / name).read_text()
        assert "telemetry" not in log.lower() and "analytics" not in log.lower(), log[-3000:]
