"""From ``distributed:`` params to processes: the hardware check, the generated Accelerate (and DeepSpeed) config,
the re-execution of ``llm-train`` under ``accelerate launch``, and the world-size check every rank makes.

Accelerate is the engine; this module only writes its config and refuses what it would silently get wrong:
on CPU it trains DDP when FSDP is asked for, runs ONE process for a ``MULTI_CPU`` config with two, and fails
deep inside DeepSpeed with a batch-size assertion (Accelerate 1.15). llmpipe stops before any work instead.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

from llmpipe.config.stages import REGISTRY
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file

log = logging.getLogger(__name__)

_EXPECTED_TYPE = {"none": ("NO",), "ddp": ("MULTI_GPU", "MULTI_CPU"), "fsdp": ("FSDP",), "deepspeed": ("DEEPSPEED",)}
"""Accelerate `DistributedType` names a rank may see for each strategy (DDP on CPU is MULTI_CPU over gloo)."""


def under_launcher() -> bool:
    """True in a process started by `accelerate launch`/torchrun (they set LOCAL_RANK)."""
    return "LOCAL_RANK" in os.environ


def is_main_process() -> bool:
    """True on global rank 0, and in a process that no launcher started."""
    return int(os.environ.get("RANK", "0")) == 0


def finish() -> None:
    """End a multi-process run together: a barrier, then the process group is destroyed on every rank.

    Without it a rank that reaches the end first exits while gloo's threads still talk to the others, and its
    interpreter can abort at exit ("terminate called without an active exception"), failing the launch.
    """
    import torch.distributed as torch_dist

    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def local_world_size(dist) -> int:
    """Processes on this machine: `num_processes`, with auto resolved to the local GPU count.

    Raises:
        UserError: auto on a machine without CUDA GPUs.
    """
    import torch

    if dist.num_processes != "auto":
        return dist.num_processes
    if not torch.cuda.is_available():
        raise UserError("distributed.num_processes: auto counts local GPUs and this machine has none; give an int")
    return torch.cuda.device_count()


def needs_launch(dist) -> bool:
    """Whether a stage must run under `accelerate launch`: any sharding strategy, or more than one process."""
    return dist.strategy in ("fsdp", "deepspeed") or dist.num_machines > 1 or dist.num_processes != 1


def preflight(params, task: str) -> int:
    """Check, before any work, that this machine can run `task` the way ``distributed:`` says.

    Returns:
        Processes on this machine.

    Raises:
        UserError: FSDP or DeepSpeed without a CUDA GPU, more processes than local GPUs, `task` cannot run
            multi-process, or auto without GPUs. The message names the key to change.
    """
    import torch

    dist = params.distributed
    n = local_world_size(dist)
    one_process = REGISTRY[task].one_process
    if one_process and needs_launch(dist):
        raise UserError(
            f"{task} runs in one process ({one_process}): run it with distributed.strategy: none and "
            "num_processes: 1 (e.g. dvc exp run -S distributed.strategy=none -S distributed.num_processes=1 "
            f"{task}), or stop a multi-process experiment before it (dvc exp run … dpo)"
        )
    cuda = torch.cuda.is_available()
    if dist.strategy in ("fsdp", "deepspeed") and not cuda:
        raise UserError(
            f"distributed.strategy: {dist.strategy} needs CUDA GPUs and this machine has none (on CPU Accelerate "
            + ("silently trains DDP instead" if dist.strategy == "fsdp" else "fails inside DeepSpeed")
            + "); use strategy: ddp with an int num_processes on CPU, or none"
        )
    if cuda and n > torch.cuda.device_count():
        raise UserError(
            f"distributed.num_processes: {n} but this machine has {torch.cuda.device_count()} GPUs; "
            "lower it or use auto"
        )
    return n


def deepspeed_config(params) -> dict[str, Any]:
    """The DeepSpeed JSON config: our ``zero_optimization``, everything else ``auto``.

    ``auto`` values are filled by the HF Trainer from the stage's TrainingArguments (batch sizes, gradient
    accumulation, clipping, bf16/fp16, optimizer and scheduler), so precision and batch stay single-sourced.
    """
    ds = params.distributed.deepspeed
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    if ds.zero_stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": ds.stage3_prefetch_bucket_size,
            "stage3_gather_16bit_weights_on_model_save": True,  # models/<stage> is one consolidated directory
            "zero_quantized_weights": ds.zero_quantized_weights,
            "zero_hpz_partition_size": ds.zero_hpz_partition_size,
            "zero_quantized_gradients": ds.zero_quantized_gradients,
        }
    for key, device in (("offload_optimizer", ds.offload_optimizer), ("offload_param", ds.offload_param)):
        if device != "none":
            zero[key] = {"device": device, "pin_memory": True} | ({"nvme_path": ds.nvme_path} if device == "nvme" else {})
    return {
        "zero_optimization": zero,
        "gradient_clipping": ds.gradient_clipping,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_allow_untested_optimizer": True,
    }


def fsdp_plugin_kwargs(params) -> dict[str, Any]:
    """Keyword arguments of `accelerate.FullyShardedDataParallelPlugin` for ``strategy: fsdp`` (FSDP2).

    With transformer-based wrapping and no class named, Accelerate wraps the model's ``_no_split_modules``
    (the decoder layer class).
    """
    f = params.distributed.fsdp
    return {
        "fsdp_version": 2,
        "reshard_after_forward": f.reshard_after_forward,
        "auto_wrap_policy": f.auto_wrap_policy,
        "cpu_offload": f.cpu_offload,
        "activation_checkpointing": f.activation_checkpointing,
        "state_dict_type": f.state_dict_type,
        "cpu_ram_efficient_loading": False,
    }


def accelerate_config(params, num_processes: int, deepspeed_config_file: Path | None = None) -> dict[str, Any]:
    """The `accelerate launch --config_file` mapping for ``distributed:``.

    Args:
        params: Validated params.
        num_processes: Processes on this machine (``num_processes`` resolved).
        deepspeed_config_file: Where :func:`deepspeed_config` was written (``strategy: deepspeed`` only).

    Returns:
        A mapping Accelerate's config loader reads. On CPU, DDP is ``MULTI_GPU`` with ``use_cpu`` (a
        ``MULTI_CPU`` config with 2 processes runs only one); ``num_processes`` is the total
        over machines, as Accelerate counts it.
    """
    import torch

    dist = params.distributed
    kind = {"none": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}[dist.strategy]
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind,
        "num_processes": num_processes * dist.num_machines,
        "num_machines": dist.num_machines,
        "machine_rank": dist.machine_rank,
        "main_process_ip": dist.main_process_ip,
        "main_process_port": dist.main_process_port,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": not torch.cuda.is_available(),
        "mixed_precision": "no",  # the HF Trainer sets the stage's precision itself (train.precision)
        "gpu_ids": "all",
        "debug": False,
    }
    if dist.strategy == "fsdp":
        renamed = {"fsdp_version": "fsdp_version", "cpu_offload": "fsdp_offload_params"}  # the launcher's names
        config["fsdp_config"] = {renamed.get(k, f"fsdp_{k}"): v for k, v in fsdp_plugin_kwargs(params).items()}
    if dist.strategy == "deepspeed":
        config["deepspeed_config"] = {"deepspeed_config_file": str(deepspeed_config_file), "zero3_init_flag": False}
        del config["mixed_precision"]  # Accelerate refuses it beside a DeepSpeed config file (which says "auto")
    return config


def relaunch(params, task: str, argv: list[str], identity: dict[str, Any] | None = None) -> NoReturn:
    """Replace this process with ``accelerate launch … -m llmpipe.cli <argv>``, the same command under the launcher.

    Writes ``logs/<task>/accelerate_config.yaml`` (and ``deepspeed_config.json``) first, so the launch that
    ran can be read back; on a machine other than 0, which writes nothing of the run, they go to a temporary
    folder instead. With ``num_machines`` > 1 the machines first meet (`llmpipe.distributed.join.meet`), and
    torchrun's own rendezvous gets ``join_timeout_s`` too. The pid stays the same (exec), so DVC and Prefect
    see the launcher's exit code and their SIGINT reaches it.

    Args:
        identity: What must be alike on every machine (`llmpipe.train.checkpoints.machine_identity`); needed
            when ``num_machines`` > 1.

    Raises:
        UserError: From :func:`preflight` (on a machine other than 0, through machine 0's verdict), or
            `llmpipe.distributed.join.meet`'s.
    """
    import json
    import tempfile

    from llmpipe.distributed import join

    dist = params.distributed
    try:
        n = preflight(params, task)
        problem = None
    except UserError as err:
        if dist.num_machines == 1:
            raise
        n, problem = 0, str(err)
    if dist.num_machines > 1:
        join.meet(params, task, identity or {}, problem)
    if dist.machine_rank == 0:
        log_dir = params.paths.out(params.paths.logs, task)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix=f"llmpipe-{task}-machine{dist.machine_rank}-"))
    ds_file = None
    if dist.strategy == "deepspeed":
        ds_file = (log_dir / "deepspeed_config.json").resolve()
        with atomic_file(ds_file) as fh:
            json.dump(deepspeed_config(params), fh, indent=2)
    config_file = log_dir / "accelerate_config.yaml"
    with atomic_file(config_file) as fh:
        yaml.safe_dump(accelerate_config(params, n, ds_file), fh, sort_keys=False)
    rendezvous = ["--rdzv_conf", f"timeout={math.ceil(dist.join_timeout_s)}"] if dist.num_machines > 1 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file), *rendezvous,
           "-m", "llmpipe.cli", *argv]
    log.info("%s: strategy %s, %d process(es) here × %d machine(s): %s", task, dist.strategy, n,
             dist.num_machines, " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


def check_world(params, accelerator) -> dict[str, Any]:
    """Every rank checks that it runs the strategy and world size the params say, before training.

    Args:
        params: Validated params.
        accelerator: The `accelerate.Accelerator` the stage trains with.

    Returns:
        ``{"world_size": int, "strategy": str}`` for the stage metrics.

    Raises:
        UserError: The world size or Accelerate's distributed type differs from ``distributed:`` (e.g. a
            launcher started fewer processes, or a strategy fell back to another).
    """
    dist = params.distributed
    expected = dist.world_size if dist.world_size is not None else accelerator.num_processes
    got_type = accelerator.distributed_type.name
    if dist.strategy == "ddp" and expected == 1:
        allowed: tuple[str, ...] = ("NO",)
    else:
        allowed = _EXPECTED_TYPE[dist.strategy]
    if accelerator.num_processes != expected or got_type not in allowed:
        raise UserError(
            f"rank {accelerator.process_index}: params say distributed.strategy {dist.strategy} with world size "
            f"{expected}, but this process runs {got_type} with world size {accelerator.num_processes}; "
            "run the stage through llm-train (it launches itself), not a hand-made launcher command"
        )
    return {"world_size": accelerator.num_processes, "strategy": dist.strategy}
