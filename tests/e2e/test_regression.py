"""The `regression` hand-run task: one process through the CLI; two DDP ranks (gloo on CPU) when params say
`strategy: ddp, num_processes: 2` (llm-train launches itself), which must report world size 2 and identical
parameters on both ranks; and a launch that disagrees with params is refused on every rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, free_port


def _run(tmp_path: Path, env: dict[str, str], distributed: dict, *launcher: str) -> subprocess.CompletedProcess:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"paths": {"output_root": "."}, "distributed": distributed}))
    env = {**env, "PYTHONPATH": str(ROOT / "src")}
    cmd = [*(launcher or [sys.executable]), "-m", "llmpipe.cli", "--task", "regression"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)


def _metrics(tmp_path: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((tmp_path / "metrics" / "regression.json").read_text())


def _assert_fits(metrics: dict) -> None:
    assert metrics["steps"] == 300
    assert metrics["initial_loss"] > 10 * metrics["noise_floor"]
    assert metrics["noise_floor"] <= metrics["final_loss"] < 1.5 * metrics["noise_floor"], metrics


def test_regression_in_one_process(tmp_path, offline_env):
    metrics = _metrics(tmp_path, _run(tmp_path, offline_env, {}))
    assert (metrics["world_size"], metrics["distributed_type"], metrics["device"]) == (1, "NO", "cpu")
    assert metrics["ranks_agree"] is True
    _assert_fits(metrics)


@pytest.mark.slow
def test_regression_on_two_ranks_from_params(tmp_path, offline_env):
    metrics = _metrics(tmp_path, _run(tmp_path, offline_env, {"strategy": "ddp", "num_processes": 2,
                                                               "main_process_port": free_port()}))
    assert (metrics["world_size"], metrics["strategy"], metrics["distributed_type"]) == (2, "ddp", "MULTI_CPU")
    assert metrics["ranks_agree"] is True and metrics["checksum_max_abs_diff"] == 0.0
    _assert_fits(metrics)


@pytest.mark.slow
def test_a_launch_that_disagrees_with_params_is_refused_on_every_rank(tmp_path, offline_env):
    proc = _run(tmp_path, offline_env, {}, sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", "2", "--main_process_port", str(free_port()))
    assert proc.returncode != 0
    for rank in (0, 1):
        assert (f"rank {rank}: params say distributed.strategy none with world size 1, but this process runs "
                "MULTI_CPU with world size 2") in proc.stdout + proc.stderr
    assert not (tmp_path / "metrics" / "regression.json").exists()
