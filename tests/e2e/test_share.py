"""Sharing a finished run through a DVC remote (docs/sharing.md): `dvc push`, then on "another
machine" a fresh `git clone` and `dvc pull` give every model, metric and report, and `dvc repro` has nothing to do.

Against a local-directory remote and against a real S3-compatible server (moto's server mode, through dvc-s3) that
this module starts on loopback and stops. The shared run is the session's trained DAG (`trained_pipeline`):
the origin repo here restores it from a copy of that run's DVC cache, so nothing is trained again.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ALL_STAGES, make_pipeline_repo, sh, stages_restored, stages_run

pytestmark = pytest.mark.slow

MODELS = ("baseline", "pretrain", "sft", "dpo", "reward", "ppo", "grpo")
BUCKET = "llmpipe-share"


@pytest.fixture(scope="module")
def env(pipeline_env, tmp_path_factory) -> dict[str, str]:
    # Dummy credentials (moto takes any) and empty AWS config files: nothing here may use a real AWS configuration.
    aws = tmp_path_factory.mktemp("aws")
    for name in ("config", "credentials"):
        (aws / name).write_text("")
    return {**pipeline_env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(aws / "config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials")}


@pytest.fixture(scope="module")
def origin(tmp_path_factory, env, trained_pipeline) -> Path:
    """A repo whose whole DAG has run (restored from the session run's cache: only the report reruns), with
    dvc.lock, metrics and report committed: what a user has after `make run` and a commit."""
    repo = make_pipeline_repo(tmp_path_factory.mktemp("origin"), env)
    shutil.copytree(trained_pipeline.cache, repo / ".dvc" / "cache", dirs_exist_ok=True)
    out = sh(repo, env, "dvc", "repro")
    assert stages_restored(out) | stages_run(out) == ALL_STAGES
    sh(repo, env, "git", "add", "-A")
    sh(repo, env, "git", "commit", "-qm", "the tiny run")
    return repo


@pytest.fixture(scope="module")
def s3_endpoint(env) -> Iterator[str]:
    """moto's S3 server on a free loopback port, with an empty bucket; stopped when the module ends."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


def share(origin: Path, where: Path, env: dict[str, str], remote: str, *config: list[str]) -> Path:
    """Make `remote` the origin's default DVC remote (plus `dvc remote modify` arguments `config`), commit, `dvc push`,
    and push the commit to a bare git repo `where/hub.git` (the shared git server); then, as a colleague, `git clone`
    it into `where/clone` and `dvc pull` there. Returns the clone."""
    hub, clone = where / "hub.git", where / "clone"
    sh(where, env, "git", "init", "-q", "--bare", str(hub))
    sh(origin, env, "dvc", "remote", "add", "--force", "-d", "storage", remote)
    for args in config:
        sh(origin, env, "dvc", "remote", "modify", "storage", *args)
    sh(origin, env, "git", "commit", "-qam", f"DVC remote {remote}")
    pushed = sh(origin, env, "dvc", "push")
    assert "pushed" in pushed, pushed
    sh(origin, env, "git", "push", "-q", str(hub), "HEAD:refs/heads/main")
    sh(where, env, "git", "clone", "-q", "-b", "main", str(hub), str(clone))
    assert not (clone / "models" / "sft").exists() and not (clone / ".dvc" / "cache").exists(), "the clone has no data"
    pulled = sh(clone, env, "dvc", "pull")
    assert "added" in pulled or "fetched" in pulled, pulled
    return clone


def assert_everything_there_and_up_to_date(origin: Path, clone: Path, env: dict[str, str]) -> None:
    for model in MODELS:
        weights = clone / "models" / model / "model.safetensors"
        assert weights.read_bytes() == (origin / "models" / model / "model.safetensors").read_bytes(), model
    for path in ("reports/report.md", "metrics/sft.json", "metrics/eval/sft.json", "data/sft/train.jsonl",
                 "artifacts/tokenizer/tokenizer.json", "logs/sft/train.csv"):
        assert (clone / path).read_bytes() == (origin / path).read_bytes(), path
    status = sh(clone, env, "dvc", "status")
    assert "Data and pipelines are up to date." in status, status
    out = sh(clone, env, "dvc", "repro")
    assert stages_run(out) == set() and stages_restored(out) == set(), out
    assert sh(clone, env, "git", "status", "--porcelain") == "", "the pull and the repro changed nothing git tracks"


def test_local_remote_round_trip_and_experiments(origin, env, tmp_path):
    clone = share(origin, tmp_path, env, str(tmp_path / "dvc-remote"))
    assert_everything_there_and_up_to_date(origin, clone, env)

    # An experiment travels by `dvc exp push`: its git ref to the git remote, its outputs to the DVC remote. An
    # orchestration-only change reruns no stage, so this costs seconds.
    sh(origin, env, "dvc", "exp", "run", "-n", "shared-exp", "-S", "orchestration.retries=3")
    sh(origin, env, "git", "checkout", "--", "params.yaml")  # `dvc exp run` applied it to the workspace
    sh(origin, env, "dvc", "exp", "push", str(tmp_path / "hub.git"), "shared-exp")
    assert "shared-exp" in sh(clone, env, "dvc", "exp", "list", "origin")
    sh(clone, env, "dvc", "exp", "pull", "origin", "shared-exp")
    assert "shared-exp" in sh(clone, env, "dvc", "exp", "show", "--csv")
    sh(clone, env, "dvc", "exp", "apply", "shared-exp")
    assert yaml.safe_load((clone / "params.yaml").read_text())["orchestration"]["retries"] == 3


def test_s3_remote_round_trip(origin, env, s3_endpoint, tmp_path):
    clone = share(origin, tmp_path, env, f"s3://{BUCKET}/cache", ["endpointurl", s3_endpoint])
    assert_everything_there_and_up_to_date(origin, clone, env)
