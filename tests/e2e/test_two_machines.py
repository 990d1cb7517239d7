"""Two machines as one training world, on this machine: two launches of `llm-train` with ``num_machines: 2`` and
their own ``machine_rank`` (one process each, gloo over 127.0.0.1), each in a folder of its own as on two hosts
with the same prepared inputs; exactly docs/distributed.md's two-machine recipe. Pretrain and sft train as one
DDP world whose ranks agree, machine 0 writes the outputs, and the weights equal a two-process run on one machine
with the same params. A machine that never comes, two launches claiming rank 0, and launches whose params differ
each end with one error on every machine, before anything is written."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import EXACT, free_port

from llmpipe.config import ParamsError, parse_params
from llmpipe.orchestration.scratch import deep_merge

WORLD = {"strategy": "ddp", "num_processes": 1, "num_machines": 2, "main_process_ip": "127.0.0.1"}


def _write_params(machine: Path, name: str, over: dict) -> str:
    """`EXACT` and `over` merged over `machine`'s params.yaml, as ``<name>.yaml`` there (`ddp_reference`'s way)."""
    raw = deep_merge(yaml.safe_load((machine / "params.yaml").read_text()), deep_merge(EXACT, over))
    (machine / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    return f"{name}.yaml"


def _launch(machine: Path, env: dict, task: str, config: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmpipe.cli", "--task", task, "--config-path", config],
                            cwd=machine, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def _together(launches: list[subprocess.Popen]) -> list[tuple[int, str, float]]:
    """Wait for every launch: (exit code, output, seconds from the first start to its end)."""
    start, out = time.monotonic(), []
    for proc in launches:
        text, _ = proc.communicate(timeout=600)
        out.append((proc.returncode, text, round(time.monotonic() - start, 1)))
    return out


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _losses(root: Path, task: str) -> list[float]:
    with open(root / "logs" / task / "train.csv") as fh:
        return [float(row["loss"]) for row in csv.DictReader(fh)]


def _weights(root: Path, task: str) -> dict:
    from safetensors.torch import load_file

    return load_file(root / "models" / task / "model.safetensors")


@pytest.fixture(scope="module")
def worlds(prepared, tmp_path_factory, offline_env, ddp_reference):
    """pretrain then sft as two machines (folders m0 and m1), beside the session's `ddp_reference` (ref): the
    same params on one machine with two processes."""
    base = tmp_path_factory.mktemp("two_machines")
    roots = {"ref": ddp_reference, "m0": base / "m0", "m1": base / "m1"}
    port = free_port()
    configs = []
    for r in (0, 1):
        shutil.copytree(prepared, roots[f"m{r}"])
        configs.append(_write_params(roots[f"m{r}"], "two-machines", {"distributed": {**WORLD, "machine_rank": r,
                                                                                       "main_process_port": port}}))
    logs, written = {}, {}
    for task in ("pretrain", "sft"):
        if task == "sft":  # the second host's inputs: the same prepared data and machine 0's models/pretrain
            shutil.copytree(roots["m0"] / "models" / "pretrain", roots["m1"] / "models" / "pretrain")
        before = _files(roots["m1"])
        ran = _together([_launch(roots[f"m{r}"], offline_env, task, configs[r]) for r in (0, 1)])
        for r, (code, out, seconds) in enumerate(ran):
            assert code == 0, f"machine {r}:\n{out[-6000:]}"
            shown = [line for line in out.splitlines() if "llmpipe" in line and any(
                w in line for w in ("distributed", "done in", "fresh run", "first step"))]  # fmt: skip
            print(f"{task}, machine {r} ({seconds} s):\n  " + "\n  ".join(shown))
        logs[task] = [out for _, out, _ in ran]
        written[task] = _files(roots["m1"]) - before
    return {**roots, "logs": logs, "m1_written": written}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_two_machines_train_one_world_whose_ranks_agree(worlds, task):
    metrics = json.loads((worlds["m0"] / "metrics" / f"{task}.json").read_text())
    assert metrics["world_size"] == 2 and metrics["strategy"] == "ddp" and metrics["ranks_agree"] is True
    config = yaml.safe_load((worlds["m0"] / "logs" / task / "accelerate_config.yaml").read_text())
    assert config["num_machines"] == 2 and config["num_processes"] == 2 and config["machine_rank"] == 0
    for r, out in enumerate(worlds["logs"][task]):
        assert f"machine {r} of 2: every machine joined" in out, out[-3000:]
    assert "rank 1; rank 0 (machine 0) writes the outputs" in worlds["logs"][task][1]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_machine_0_writes_the_outputs_and_machine_1_only_its_rank_state(worlds, task):
    assert (worlds["m0"] / "models" / task / "model.safetensors").exists()
    assert (worlds["m0"] / "metrics" / f"{task}.json").exists()
    assert list((worlds["m0"] / "checkpoints" / task).glob("*/checkpoint-*/rng_state_1.pth")) == [], \
        "machine 1's rank state stays on machine 1 without a shared filesystem"  # fmt: skip
    # The HF Trainer saves every rank's RNG state in the checkpoint it makes (what that rank resumes from).
    written = worlds["m1_written"][task]
    assert written and all(f.startswith(f"checkpoints/{task}/") and f.endswith("/rng_state_1.pth") for f in written), written


@pytest.mark.slow
@pytest.mark.parametrize("task", ["pretrain", "sft"])
def test_two_machines_equal_two_processes_on_one_machine(worlds, task):
    ref, two = _losses(worlds["ref"], task), _losses(worlds["m0"], task)
    assert len(ref) == len(two) == EXACT[task]["max_steps"]
    for step, (a, b) in enumerate(zip(ref, two, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step}: one machine {a}, two machines {b}"
    ref_w, two_w = _weights(worlds["ref"], task), _weights(worlds["m0"], task)
    assert ref_w.keys() == two_w.keys()
    diff = max((ref_w[k] - two_w[k]).abs().max().item() for k in ref_w)
    loss_diff = max(abs(a - b) for a, b in zip(ref, two, strict=True))
    print(f"{task}: two machines vs one: max |weight difference| {diff:.3g}, max |loss difference| {loss_diff:.3g}; "
          f"losses {two}")
    assert diff <= 1e-5


def test_join_timeout_is_validated():
    node = {**WORLD, "machine_rank": 0}
    for bad in (0, -1, 10**6):
        with pytest.raises(ParamsError, match=r"distributed\.join_timeout_s"):
            parse_params({"distributed": {**node, "join_timeout_s": bad}})
    assert parse_params({"distributed": {**node, "join_timeout_s": 2.5}}).distributed.join_timeout_s == 2.5


def _failure(tmp_path: Path, prepared: Path, env: dict, name: str, launches: list[dict]) -> list[tuple[int, str, float]]:
    """Launch pretrain on each of `launches` (distributed overrides, one folder each) at once; nothing may be written."""
    procs, machines, before = [], [], []
    for i, dist in enumerate(launches):
        machines.append(tmp_path / f"{name}-{i}")
        shutil.copytree(prepared, machines[i])
        config = _write_params(machines[i], name, {"distributed": {**WORLD, "join_timeout_s": 5, **dist}})
        before.append(_files(machines[i]))
        procs.append(_launch(machines[i], env, "pretrain", config))
    ran = _together(procs)
    for i, (code, out, seconds) in enumerate(ran):
        print(f"{name}, launch {i}: exit {code} after {seconds} s: {out[out.find('llm-train: error:'):].strip()}")
        assert code == 2, out[-4000:]
        assert out.count("llm-train: error:") == 1, out[-4000:]
        assert _files(machines[i]) == before[i], "nothing written"
    return ran


@pytest.mark.slow
def test_a_machine_that_never_comes_ends_after_join_timeout(tmp_path, prepared, offline_env):
    port = free_port()
    (code0, out0, _), (code1, out1, _) = _failure(tmp_path, prepared, offline_env, "alone", [
        {"machine_rank": 0, "main_process_port": port}, {"machine_rank": 1, "main_process_port": free_port()}])
    assert "machine(s) 1 of 2 never joined" in out0 and "join_timeout_s (5 s)" in out0
    assert "no machine 0 answered" in out1 and "join_timeout_s (5 s)" in out1


@pytest.mark.slow
def test_two_launches_claiming_rank_0_both_stop(tmp_path, prepared, offline_env):
    port = free_port()
    ran = _failure(tmp_path, prepared, offline_env, "two-zeros", [{"machine_rank": 0, "main_process_port": port}] * 2)
    for _, out, _ in ran:
        assert "two launches claim distributed.machine_rank 0" in out


@pytest.mark.slow
def test_launches_whose_world_and_strategy_differ_both_stop_naming_them(tmp_path, prepared, offline_env):
    port = free_port()
    ran = _failure(tmp_path, prepared, offline_env, "differ", [
        {"machine_rank": 0, "main_process_port": port},
        {"machine_rank": 1, "main_process_port": port, "num_processes": 2, "strategy": "fsdp"}])
    for _, out, _ in ran:
        assert "machine 1's launch of pretrain differs from machine 0's" in out
        assert "world size (num_processes × num_machines): 1 × 2 on machine 0, 2 × 2 on machine 1" in out
        assert "distributed.strategy: 'ddp' on machine 0, 'fsdp' on machine 1" in out


def _meet_in_threads(identities: list[dict]) -> list[str]:
    """`join.meet` of machines 0 and 1 at once, in threads of this process over a real TCPStore: each one's outcome."""
    import threading

    from llmpipe.core.errors import UserError
    from llmpipe.distributed import join

    port, outcome = free_port(), ["", ""]

    def machine(rank: int) -> None:
        params = parse_params({"distributed": {**WORLD, "machine_rank": rank, "main_process_port": port,
                                               "join_timeout_s": 30}})  # fmt: skip
        try:
            join.meet(params, "pretrain", identities[rank], None)
            outcome[rank] = "ok"
        except UserError as err:
            outcome[rank] = str(err)

    threads = [threading.Thread(target=machine, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcome


def test_machines_meet_and_agree_or_get_one_verdict_naming_the_difference():
    same = {"distributed.num_processes": 1, "distributed.num_machines": 2, "pretrain.lr": 1e-3, "input data": "a"}
    assert _meet_in_threads([same, dict(same)]) == ["ok", "ok"]
    other = {**same, "pretrain.lr": 2e-3, "input data": "b"}
    zero, one = _meet_in_threads([same, other])
    assert zero == one and "pretrain.lr: 0.001 on machine 0, 0.002 on machine 1" in zero and "input data differs" in zero
