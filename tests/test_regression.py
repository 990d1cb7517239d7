"""The `regression` hand-run task: one process through the CLI, and two DDP ranks (gloo on CPU) under
`accelerate launch`, which must report world size 2 and identical parameters on both ranks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, env: dict[str, str], *launcher: str) -> dict:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"paths": {"output_root": "."}}))
    env = {**env, "PYTHONPATH": str(ROOT / "src")}
    cmd = [*launcher, "-m", "llmpipe.cli", "--task", "regression"] if launcher else [
        sys.executable, "-m", "llmpipe.cli", "--task", "regression"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "metrics" / "regression.json").read_text())


def _assert_fits(metrics: dict) -> None:
    assert metrics["steps"] == 300
    assert metrics["initial_loss"] > 10 * metrics["noise_floor"]
    assert metrics["noise_floor"] <= metrics["final_loss"] < 1.5 * metrics["noise_floor"], metrics


def test_regression_in_one_process(tmp_path, offline_env):
    metrics = _run(tmp_path, offline_env)
    assert (metrics["world_size"], metrics["strategy"], metrics["device"]) == (1, "NO", "cpu")
    assert metrics["ranks_agree"] is True
    _assert_fits(metrics)


@pytest.mark.slow
def test_regression_on_two_ranks_under_accelerate_launch(tmp_path, offline_env):
    metrics = _run(
        tmp_path, offline_env, sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
        "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
        str(_free_port()),
    )  # fmt: skip
    assert (metrics["world_size"], metrics["strategy"]) == (2, "MULTI_CPU")
    assert metrics["ranks_agree"] is True and metrics["checksum_max_abs_diff"] == 0.0
    _assert_fits(metrics)
