"""A failing stage and a stage past its time limit under the served `full-pipeline` flow, against a real Prefect
server on loopback: the flow run's state message (and `prefect deployment run --watch`) says why it failed, and a
stage that runs too long is stopped with SIGINT, retried, and leaves no process and no held concurrency slot.

No training: the repo's dvc.yaml holds two tiny stages under registry names (a stage's time limit is keyed by
one): `prepare` sleeps, and `tokenizer` is the real `llm-train --task tokenizer`, which fails with a UserError
because nothing was prepared. The server, the client and the serve process are test_flow.py's fixtures, here
serving this module's repo.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import make_pipeline_repo, sh
from test_flow import (  # noqa: F401 (fixtures and the hook that gives them their database)
    DEPLOYMENT,
    client,
    database,
    env,
    logs_dir,
    pytest_generate_tests,
    served,
    server,
    task_runs,
    trigger,
    wait_final,
)

# isort: split
from full_pipeline import limit_name  # flows/ is on sys.path through test_flow

pytestmark = pytest.mark.slow

TIME_LIMIT_S = 15  # DVC itself takes seconds to start on 2 busy cores
OVERRIDES = {"orchestration": {"retries": 1, "retry_delay_s": 0.0, "stage_timeout_s": {"prepare": TIME_LIMIT_S}}}

# SIGINT is held while "started" is written: on busy cores the stop can land right as the try starts, and an
# interrupt between the two writes would leave a started try that seems never to have been stopped.
SLEEPER = """\
import pathlib, signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
record = pathlib.Path("sleeper.txt")
with record.open("a") as fh:
    fh.write("started\\n")
try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    time.sleep(600)
except KeyboardInterrupt:  # the stop's SIGINT: record it, exit like an interrupted stage
    with record.open("a") as fh:
        fh.write("interrupted\\n")
    sys.exit(1)
"""

USER_ERROR = "llm-train: error: data/pretrain/train.jsonl: missing; run the prepare stage first (dvc repro prepare)"


@pytest.fixture(scope="module")
def repo(tmp_path_factory, env) -> Path:  # noqa: F811 (test_flow's `repo` is the trained pipeline; this one is not)
    repo = make_pipeline_repo(tmp_path_factory.mktemp("failing_repo"), env, yaml.safe_dump(OVERRIDES))
    (repo / "sleeper.py").write_text(SLEEPER)
    stages = {"prepare": {"cmd": "python sleeper.py"}, "tokenizer": {"cmd": "llm-train --task tokenizer"}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    with (repo / ".gitignore").open("a") as fh:
        fh.write("/sleeper.txt\n")
    sh(repo, env, "git", "add", "-A")
    sh(repo, env, "git", "commit", "-qm", "a sleeping and a failing stage")
    return repo


def one_line(text: str) -> str:
    """`text` with every run of whitespace one space (rich wraps long lines to the console's width)."""
    return " ".join(text.split())


def test_failed_stage_says_why(repo, env, client, served):  # noqa: F811 (fixtures imported above)
    cmd = ["prefect", "deployment", "run", DEPLOYMENT, "--params", json.dumps({"stages": ["tokenizer"]}), "--watch"]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    watched = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Flow run finished in state 'Failed'" in one_line(watched), watched[-3000:]
    assert USER_ERROR in one_line(watched), "--watch shows the stage's own error, not only `Failed`"

    run = client.read_flow_run(re.search(r"UUID: ([0-9a-f-]{36})", watched).group(1))
    assert run.state.name == "Failed"
    message = run.state.message
    assert "tokenizer: `dvc repro --single-item tokenizer` exited with" in message and USER_ERROR in message, message
    assert "ERROR: failed to reproduce" not in message, "DVC's closing line repeats the exit code; it is left out"
    assert task_runs(client, str(run.id))["tokenizer"].run_count == 2, "failed, then retried once (retries: 1)"


def test_stage_past_its_time_limit_is_stopped_retried_and_frees_the_slot(repo, env, client, served):  # noqa: F811
    start = time.time()
    run = wait_final(client, trigger(repo, env, stages=["prepare"]), timeout_s=300)
    wall_s = time.time() - start
    assert run.state.name == "Failed"
    assert f"prepare: stopped after its time limit of {TIME_LIMIT_S} s" in run.state.message, run.state.message
    assert task_runs(client, str(run.id))["prepare"].run_count == 2, "timed out, then retried once (retries: 1)"
    record = (repo / "sleeper.txt").read_text().splitlines()
    assert record and record == ["started", "interrupted"] * (len(record) // 2), "each try that started got SIGINT"
    assert wall_s < 2 * TIME_LIMIT_S + 90, f"two {TIME_LIMIT_S} s tries took {wall_s:.0f} s"

    left = [p for p in psutil.process_iter(["cmdline"]) if "sleeper.py" in " ".join(p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]
    limit = client.read_global_concurrency_limit_by_name(limit_name(repo))
    assert limit.active_slots == 0, "the failed run released the repository's slot"
