"""`distributed:` params: the generated Accelerate/FSDP/DeepSpeed configs, the refusal of what this machine cannot
run, and real 2-process DDP runs of pretrain and sft on CPU (gloo) through `llm-train`, which launches itself."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import EXACT, free_port

from llmpipe.config import ParamsError, parse_params
from llmpipe.distributed import launch
from llmpipe.orchestration.scratch import deep_merge

# Every FSDP and DeepSpeed option away from its default, one combination per row.
VALID = [
    {"strategy": "ddp", "num_processes": 2},
    {"strategy": "fsdp", "fsdp": {"reshard_after_forward": False, "cpu_offload": True, "state_dict_type": "FULL_STATE_DICT"}},
    {"strategy": "fsdp", "fsdp": {"auto_wrap_policy": "no_wrap", "activation_checkpointing": True}},
    {"strategy": "deepspeed", "deepspeed": {"zero_stage": 1, "offload_optimizer": "cpu"}},
    {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "reduce_bucket_size": 1000, "gradient_clipping": 0.5}},
    {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                            "nvme_path": "/nvme"}},
    {"strategy": "deepspeed", "num_machines": 2, "main_process_ip": "10.0.0.1",
     "deepspeed": {"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}},
]


@pytest.mark.parametrize("dist", VALID)
def test_generated_configs_pass_the_libraries_own_validation(dist, tmp_path):
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    params = parse_params({"distributed": dist})
    plugin = FullyShardedDataParallelPlugin(**launch.fsdp_plugin_kwargs(params))
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == params.distributed.fsdp.reshard_after_forward
    zero = DeepSpeedZeroConfig(**launch.deepspeed_config(params)["zero_optimization"])
    assert zero.stage == params.distributed.deepspeed.zero_stage
    if params.distributed.deepspeed.offload_param != "none":
        assert zero.offload_param.device == params.distributed.deepspeed.offload_param
    config = tmp_path / "accelerate_config.yaml"
    config.write_text(yaml.safe_dump(launch.accelerate_config(params, 2, tmp_path / "ds.json")))
    loaded = load_config_from_file(str(config))
    assert loaded.distributed_type.name == {"ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}[dist["strategy"]]
    assert loaded.num_processes == 2 * params.distributed.num_machines
    if dist["strategy"] == "fsdp":
        assert loaded.fsdp_config["fsdp_version"] == 2
        assert loaded.fsdp_config["fsdp_offload_params"] == params.distributed.fsdp.cpu_offload


# What Accelerate's YAML loader takes without a word, and which library constructor rejects it.
BAD = [
    ({"fsdp": {"sharding_strategy": "EVERYWHERE"}}, "distributed.fsdp.sharding_strategy: unknown key",
     lambda: __import__("accelerate").FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="EVERYWHERE")),
    ({"deepspeed": {"zero_stage": 7}}, "distributed.deepspeed.zero_stage",
     lambda: _zero_config(stage=7)),
    ({"deepspeed": {"offload_optimizer": "tape"}}, "distributed.deepspeed.offload_optimizer",
     lambda: _zero_config(stage=3, offload_optimizer={"device": "tape"})),
]


def _zero_config(**kwargs):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**kwargs)


@pytest.mark.parametrize(("dist", "key", "library"), BAD, ids=["sharding_strategy", "zero_stage", "offload"])
def test_bad_values_are_params_errors_as_the_libraries_would_reject_them(dist, key, library, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        parse_params({"distributed": {"strategy": "deepspeed", **dist}})
    with pytest.raises((ValueError, Exception)):
        library()
    # Accelerate's own loader accepts the same nonsense, which is why params validate before it is written.
    nonsense = {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 7,
                "offload_optimizer_device": "tape"}, "fsdp_config": {"fsdp_sharding_strategy": "EVERYWHERE"}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(nonsense))
    assert load_config_from_file(str(tmp_path / "c.yaml")).deepspeed_config["zero_stage"] == 7


def test_cross_field_rules():
    for dist, message in [
        ({"num_processes": 2}, "strategy none is one process"),
        ({"strategy": "ddp", "num_machines": 2}, "main_process_ip"),
        ({"strategy": "ddp", "num_machines": 2, "machine_rank": 2, "main_process_ip": "h"}, "machine_rank 2"),
        ({"strategy": "deepspeed", "deepspeed": {"zero_stage": 2, "zero_quantized_weights": True}}, "zero_stage: 3"),
        ({"strategy": "deepspeed", "deepspeed": {"offload_optimizer": "nvme"}}, "nvme_path"),
    ]:
        with pytest.raises(ParamsError, match=message):
            parse_params({"distributed": dist})


def test_fingerprint_is_the_same_on_every_machine_of_a_multinode_run(workdir):
    from llmpipe.train.checkpoints import fingerprint

    inputs = [workdir / "data" / "pretrain"]
    node = {"strategy": "ddp", "num_processes": 2, "num_machines": 2, "main_process_ip": "10.0.0.1"}
    rank0 = parse_params({"distributed": node})
    rank1 = parse_params({"distributed": {**node, "machine_rank": 1}})
    more = parse_params({"distributed": {**node, "num_processes": 4}})
    assert fingerprint(rank0, "pretrain", inputs) == fingerprint(rank1, "pretrain", inputs)
    assert fingerprint(rank0, "pretrain", inputs) != fingerprint(more, "pretrain", inputs)


def _params_file(workdir: Path, name: str, over: dict) -> Path:
    raw = deep_merge(yaml.safe_load((workdir / "params.yaml").read_text()), over)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _llm_train(workdir: Path, env: dict, task: str, config: Path, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmpipe.cli", "--task", task, "--config-path", str(config)],
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharding_strategy_without_gpu_stops_before_any_work(workdir, offline_env, strategy):
    config = _params_file(workdir, f"no-gpu-{strategy}", {"paths": {"output_root": f"runs/{strategy}"},
                                                          "distributed": {"strategy": strategy}})
    proc = _llm_train(workdir, offline_env, "pretrain", config)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"distributed.strategy: {strategy} needs CUDA GPUs" in out
    assert not (workdir / "runs" / strategy).exists(), "nothing written"


def test_ppo_is_refused_under_ddp_before_launch(workdir, offline_env):
    config = _params_file(workdir, "ppo-ddp", {"distributed": {"strategy": "ddp", "num_processes": 2}})
    proc = _llm_train(workdir, offline_env, "ppo", config)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "ppo runs in one process" in out, out


def ddp2() -> dict:
    """DDP over 2 local processes, on a rendezvous port of its own."""
    return {"strategy": "ddp", "num_processes": 2, "main_process_port": free_port()}


@pytest.fixture(scope="module")
def ddp_pretrain(workdir, offline_env, ddp_reference):
    """pretrain with one global batch of 4: one process × 4 here, and the session's DDP 2 processes × 2
    (`ddp_reference`, copied into `workdir`: ddp.yaml, models/pretrain, its logs and metrics)."""
    one = _params_file(workdir, "one", deep_merge(EXACT, {"paths": {"output_root": "runs/one"},
                                                          "pretrain": {"per_device_train_batch_size": 4}}))
    _finish(_llm_train(workdir, offline_env, "pretrain", one))
    shutil.copytree(ddp_reference, workdir, dirs_exist_ok=True)
    return {"one": workdir / "runs" / "one", "ddp": workdir}


def _losses(root: Path) -> list[float]:
    with open(root / "logs" / "pretrain" / "train.csv") as fh:
        return [float(row["loss"]) for row in csv.DictReader(fh)]


@pytest.mark.slow
def test_ddp_pretrain_runs_two_ranks_that_agree(ddp_pretrain):
    root = ddp_pretrain["ddp"]
    metrics = json.loads((root / "metrics" / "pretrain.json").read_text())
    assert metrics["world_size"] == 2 and metrics["strategy"] == "ddp" and metrics["ranks_agree"] is True
    config = yaml.safe_load((root / "logs" / "pretrain" / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU" and config["use_cpu"] and config["num_processes"] == 2
    assert (root / "models" / "pretrain" / "model.safetensors").exists()
    assert len(list((root / "logs" / "pretrain" / "tensorboard").glob("*/events.*"))) == 1, "rank 0 writes alone"


@pytest.mark.slow
def test_ddp_loss_matches_one_process_with_the_same_global_batch(ddp_pretrain):
    one, ddp = _losses(ddp_pretrain["one"]), _losses(ddp_pretrain["ddp"])
    assert len(one) == len(ddp) == 10
    for step, (a, b) in enumerate(zip(one, ddp, strict=True), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: one process {a}, DDP {b}"


@pytest.mark.slow
def test_ddp_ranks_read_disjoint_halves_of_each_epoch(workdir, offline_env, ddp_pretrain):
    """The pretrain stage's own Trainer set-up under a 2-process launch: every block once per epoch, no overlap."""
    probe = workdir / "probe.py"
    probe.write_text(PROBE)
    out_dir = workdir / "probe"
    config = workdir / "logs" / "pretrain" / "accelerate_config.yaml"  # the one the DDP pretrain run generated
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                    str(probe), str(workdir / "ddp.yaml"), str(out_dir)],
                   cwd=workdir, env=offline_env, check=True, timeout=300)
    seen = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = json.loads((out_dir / "total.json").read_text())
    assert seen[0] and seen[1]
    assert not set(seen[0]) & set(seen[1]), "a block read by both ranks"
    assert sorted(seen[0] + seen[1]) == list(range(total)), "every block exactly once"


PROBE = """
import json, sys
from pathlib import Path
from transformers import Trainer, TrainingArguments
from llmpipe.config import load_params
from llmpipe.train.arguments import training_kwargs

class Indexed:  # stands in for PackedBlocks: item i is block i
    def __len__(self): return 32
    def __getitem__(self, i): return {"input_ids": [i] * 4, "labels": [i] * 4}

params = load_params(sys.argv[1])
kwargs = training_kwargs(params, "pretrain", Path(sys.argv[2]) / "ckpt")
args = TrainingArguments(**kwargs, remove_unused_columns=False)  # a Linear's forward has no input_ids to keep
trainer = Trainer(model=__import__("torch").nn.Linear(1, 1), args=args, train_dataset=Indexed(), eval_dataset=Indexed())
seen = [int(i) for batch in trainer.get_train_dataloader() for i in batch["input_ids"][:, 0]]
out = Path(sys.argv[2]); out.mkdir(exist_ok=True)
(out / f"rank{trainer.args.process_index}.json").write_text(json.dumps(seen))
(out / "total.json").write_text(json.dumps(len(Indexed())))
"""


@pytest.mark.slow
def test_ddp_sft_runs_two_ranks_that_agree(ddp_reference):
    metrics = json.loads((ddp_reference / "metrics" / "sft.json").read_text())
    assert metrics["world_size"] == 2 and metrics["ranks_agree"] is True and metrics["steps"] == EXACT["sft"]["max_steps"]


@pytest.mark.slow
def test_killed_ddp_pretrain_resumes(workdir, offline_env, ddp_pretrain):
    config = _params_file(workdir, "ddp-resume", {
        "paths": {"output_root": "runs/ddp-resume"},
        "pretrain": {"max_steps": 10, "save_steps": 5, "eval_steps": 10, "logging_steps": 5,
                     "per_device_train_batch_size": 2},
        "distributed": ddp2()})
    root = workdir / "runs" / "ddp-resume"
    # Every rank SIGKILLs itself right after step 7, between the checkpoints of steps 5 and 10.
    crash = _llm_train(workdir, {**offline_env, "LLMPIPE_KILL_AT_STEP": "7"}, "pretrain", config, start_new_session=True)
    crash.communicate(timeout=600)
    assert crash.returncode != 0 and list((root / "checkpoints" / "pretrain").glob("*/checkpoint-5/trainer_state.json"))
    out = _finish(_llm_train(workdir, offline_env, "pretrain", config))
    metrics = json.loads((root / "metrics" / "pretrain.json").read_text())
    assert metrics["resumed_from_step"] == 5 and metrics["steps"] == 10 and metrics["world_size"] == 2, out[-3000:]
    assert os.path.exists(root / "models" / "pretrain" / "model.safetensors")
