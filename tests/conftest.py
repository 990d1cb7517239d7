"""Shared fixtures: the repository root, tiny params, a prepared tiny workdir, and a real git + DVC repo of this
project for end-to-end runs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from postgres import PostgresServer, start_postgres
from postgres import unavailable as postgres_unavailable

from llmpipe.config import stages as registry
from llmpipe.orchestration import scratch

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (make test: -n auto) the workers share the cores: each worker and every process it starts gets
# its share of threads, set before torch is imported and before any test copies os.environ for a subprocess, since
# OpenMP's threads spin when there are more than cores and every worker then runs slower than alone.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist: the tests needing the shared two-process DDP run (`ddp_reference`) run on one worker
    (``--dist loadgroup``), so it trains once; the tests needing the trained DAG (`trained_pipeline`) are marked
    ``dag`` — `make test` runs them in a second, serial pytest after the parallel one, in this module order (they
    go on in one repo and a Prefect server, and their order is part of what they check). Without xdist both are
    inert."""
    for item in items:
        if "trained_pipeline" in item.fixturenames:
            item.add_marker(pytest.mark.dag)
        elif "ddp_reference" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("ddp_reference"))

# Tiny but real (a 2-layer Llama, a few steps per stage): the overrides `make smoke` runs, as YAML text.
TINY_PARAMS = (ROOT / "configs" / "tiny.yaml").read_text()


@pytest.fixture(scope="module")
def workdir(prepared, tmp_path_factory) -> Path:
    """A folder of this module's own with params.yaml (tiny), prepared data, a trained tokenizer and the
    pretraining token files: a copy of `prepared`, so modules cannot see each other's changes."""
    root = tmp_path_factory.mktemp("train")
    shutil.copytree(prepared, root, dirs_exist_ok=True)
    return root


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    """prepare, tokenizer and tokenize run once per session on TINY_PARAMS (~15 s; `workdir` copies it)."""
    from llmpipe.config import parse_params
    from llmpipe.stages import prepare, tokenize, tokenizer

    root = tmp_path_factory.mktemp("prepared")
    raw = yaml.safe_load(TINY_PARAMS)
    raw["paths"] = {"output_root": "."}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    params = parse_params({**raw, "paths": {k: str(root / v) for k, v in
                                           {"data": "data", "tokenizer": "artifacts/tokenizer",
                                            "metrics": "metrics"}.items()}})
    prepare.run(params)
    tokenizer.run(params)
    tokenize.run(params)
    return root


@pytest.fixture(scope="module")
def tiny_sft(workdir) -> Path:
    """`workdir` with a randomly initialised tiny Llama of TINY_PARAMS' shape saved as models/sft (a stand-in for
    the SFT stage's output, which the RL stages start from)."""
    from llmpipe.config import load_params
    from llmpipe.models import build_model, load_tokenizer, save_model

    params = load_params(workdir / "params.yaml")
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, workdir / params.paths.models / "sft")
    return workdir


# fp32 and one loss per step, so runs compare step by step; a global batch of 4 over two ranks.
EXACT = {"train": {"precision": "fp32", "logging_steps": 1},
         "pretrain": {"max_steps": 10, "logging_steps": 1, "eval_steps": 10, "save_steps": 10,
                      "per_device_train_batch_size": 2},
         "sft": {"max_steps": 4, "logging_steps": 1, "eval_steps": 4, "save_steps": 4, "per_device_train_batch_size": 2}}
"""The params (over TINY_PARAMS) of `ddp_reference` and of the runs compared with it."""


@pytest.fixture(scope="session")
def ddp_reference(prepared, tmp_path_factory, offline_env) -> Path:
    """pretrain then sft as DDP over two processes on one machine (gloo, `EXACT`), once per session, in a copy of
    `prepared` whose ``ddp.yaml`` holds the params: the two-process run that tests/e2e/test_distributed.py and
    test_two_machines.py compare with."""
    root = tmp_path_factory.mktemp("ddp_reference")
    shutil.copytree(prepared, root, dirs_exist_ok=True)
    raw = scratch.deep_merge(yaml.safe_load((root / "params.yaml").read_text()),
                             {**EXACT, "distributed": {"strategy": "ddp", "num_processes": 2,
                                                       "main_process_port": free_port()}})  # fmt: skip
    (root / "ddp.yaml").write_text(yaml.safe_dump(raw))
    for task in ("pretrain", "sft"):
        sh(root, offline_env, sys.executable, "-m", "llmpipe.cli", "--task", task, "--config-path", "ddp.yaml")
    return root


TRAINING_AND_DATA_STAGES = set(registry.DVC_STAGES) - {"evaluate"}
SHIPPED_STAGES = TRAINING_AND_DATA_STAGES | {
    f"evaluate@{m}" for m in yaml.safe_load((ROOT / "params.yaml").read_text())["eval"]["models"]
}
"""Every stage of dvc.yaml with the shipped params.yaml."""
ALL_STAGES = TRAINING_AND_DATA_STAGES | {f"evaluate@{m}" for m in yaml.safe_load(TINY_PARAMS)["eval"]["models"]}
"""Every stage of dvc.yaml with TINY_PARAMS."""


@pytest.fixture(scope="session")
def offline_env() -> dict[str, str]:
    """Environment for subprocesses: offline hub, and any non-loopback HTTP(S) sent to a dead proxy."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HTTP_PROXY="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost,::1",
        TOKENIZERS_PARALLELISM="false",
        DVC_NO_ANALYTICS="1",
    )
    return env


def free_port() -> int:
    """A loopback port free now: a Prefect server's, or a DDP run's rendezvous port (Accelerate's default 29500 is
    taken when two xdist workers launch at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(repo: Path, env: dict[str, str], *cmd: str) -> str:
    """Run `cmd` in `repo`; assert it succeeds; return stdout + stderr."""
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout + proc.stderr


def stages_run(output: str) -> set[str]:
    """The stages `dvc repro` output says it ran."""
    return set(re.findall(r"Running stage '([^']+)'", output))


def make_pipeline_repo(dest: Path, env: dict[str, str], params_overrides: str = TINY_PARAMS) -> Path:
    """A git + DVC repo at `dest` with this project's DAG, code and flows, and the shipped params.yaml with
    `params_overrides` (YAML) merged in; everything committed once (`llmpipe.orchestration.scratch`)."""
    return scratch.make_pipeline_repo(ROOT, dest, yaml.safe_load(params_overrides), env)


@pytest.fixture(scope="session")
def pipeline_env(offline_env, tmp_path_factory) -> dict[str, str]:
    """`offline_env` plus a private HF cache, a git identity, and this checkout's `src` first on PYTHONPATH,
    so `llm-train` and the flows run the code under test even where llmpipe is installed from elsewhere."""
    env = dict(offline_env)
    env["HF_HOME"] = str(tmp_path_factory.mktemp("hf_home"))
    env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = "test"
    env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = "test@example.invalid"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


@dataclass(frozen=True)
class TrainedPipeline:
    """A pipeline repo after one real `dvc repro` of the whole DAG on TINY_PARAMS."""

    repo: Path
    repro_output: str
    cache: Path
    """A copy of the DVC cache (and run cache) as that repro left it, before any test changed the repo."""


@pytest.fixture(scope="session")
def trained_pipeline(tmp_path_factory, pipeline_env) -> TrainedPipeline:
    """The whole DAG trained once per session (the dearest thing the suite does): the pipeline tests go on in this
    repo, and the flow tests start from a copy of its cache, so DVC restores what this run trained from its run
    cache instead of training it a second time."""
    repo = make_pipeline_repo(tmp_path_factory.mktemp("repo"), pipeline_env)
    out = sh(repo, pipeline_env, "dvc", "repro")
    cache = tmp_path_factory.mktemp("dag_cache") / "cache"
    shutil.copytree(repo / ".dvc" / "cache", cache)
    return TrainedPipeline(repo, out, cache)


def stages_restored(output: str) -> set[str]:
    """The stages `dvc repro` output says it restored from the run cache instead of running."""
    return set(re.findall(r"Stage '([^']+)' is cached - skipping run", output))


def kill_after_first_checkpoint(proc: subprocess.Popen, checkpoints: Path, timeout_s: float = 300) -> None:
    """SIGKILL `proc` (a training run) as soon as a complete checkpoint appears under ``checkpoints/<fp>/``; its
    whole process group when it leads one (``start_new_session=True``: a launcher and its ranks)."""
    deadline = time.time() + timeout_s
    while not list(checkpoints.glob("*/checkpoint-*/trainer_state.json")):
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"no checkpoint within {timeout_s} s"
        time.sleep(0.1)
    if os.getpgid(proc.pid) == proc.pid:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


USER_REWARDS = """
CALLS = []

def exact_answer(prompts, completions, name, **kwargs):
    CALLS.append((prompts, completions, name, kwargs))
    return [0.25 if c[-1]["content"].strip() == "return a + b" else 0.0 for c in completions]

def constant(prompts, completions, **kwargs):
    CALLS.append(len(completions))
    return [0.25] * len(completions)

def no_kwargs(prompts, completions):
    return [0.0] * len(prompts)

async def later(prompts, completions, **kwargs):
    return [0.0] * len(prompts)

def bad_output(prompts, completions, **kwargs):
    return [None]

NOT_A_FUNCTION = 3
"""
"""A user's reward module (TRL's reward-function signature), good and bad functions; ``CALLS`` records calls."""


@pytest.fixture
def user_reward_module(tmp_path_factory, monkeypatch, request) -> str:
    """:data:`USER_REWARDS` written to a temp dir put on sys.path; returns its module name, unique per test
    (Python caches modules by name)."""
    name = "user_rewards_" + re.sub(r"\W", "_", request.node.nodeid)
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(folder))
    return name


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> Iterator[PostgresServer]:
    """One real PostgreSQL server per session on loopback (tests/postgres.py); skipped, saying why, where PostgreSQL
    is not installed. Each user creates a database of its own (`create_database`)."""
    if reason := postgres_unavailable():
        pytest.skip(reason)
    with start_postgres(tmp_path_factory.mktemp("postgres")) as server:
        yield server
