"""The ``distributed:`` section of params.yaml: one CPU process, DDP, FSDP2 or DeepSpeed ZeRO, on one or many
machines, for every training stage alike.

Key names follow what they map to: the FSDP keys are `accelerate.FullyShardedDataParallelPlugin`'s (FSDP
version 2 only), the DeepSpeed keys are the ``zero_optimization`` block of a DeepSpeed config (ZeRO++ names
from Wang et al. 2023, "ZeRO++"). :mod:`llmpipe.distributed.launch` turns them into an Accelerate config.
Precision is not here: it is the stage's ``precision`` key (``train.precision``), for every strategy.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from llmpipe.config.section import Section

Offload = Literal["none", "cpu", "nvme"]

LAUNCH_KEYS = frozenset({"machine_rank", "main_process_ip", "main_process_port", "join_timeout_s"})
"""Keys that say where a process sits and how long it waits for the others, not what it trains: left out of
checkpoint fingerprints, so every machine of a multi-node run computes the same one."""


class FSDPParams(Section):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) through Accelerate; used when ``strategy: fsdp``."""

    reshard_after_forward: bool = Field(
        True, description="Free gathered parameters after forward (ZeRO-3-like); false keeps them (ZeRO-2-like)."
    )
    auto_wrap_policy: Literal["transformer_based_wrap", "no_wrap"] = Field(
        "transformer_based_wrap",
        description="Shard unit: each decoder layer (the model's _no_split_modules, e.g. LlamaDecoderLayer) or the whole model.",
    )
    cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")
    activation_checkpointing: bool = Field(
        False, description="FSDP's own activation checkpointing per wrapped layer (instead of gradient_checkpointing)."
    )
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT",
        description="Checkpoint format (per-rank shards, or one gathered file); models/<stage> is always consolidated.",
    )


class DeepSpeedParams(Section):
    """DeepSpeed ZeRO through Accelerate; used when ``strategy: deepspeed``."""

    zero_stage: Literal[1, 2, 3] = Field(3, description="1: optimizer state, 2: + gradients, 3: + parameters sharded.")
    offload_optimizer: Offload = Field("none", description="Where optimizer state lives (ZeRO-Offload/Infinity).")
    offload_param: Offload = Field("none", description="Where parameters live (stage 3 only).")
    nvme_path: str | None = Field(None, description="Folder on an NVMe drive, needed by any nvme offload.")
    zero_quantized_weights: bool = Field(False, description="ZeRO++ qwZ: int8 weights in all-gather (stage 3).")
    zero_hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ: secondary weight partition within a node (GPUs per node; 1 = off; stage 3)."
    )
    zero_quantized_gradients: bool = Field(False, description="ZeRO++ qgZ: int4 gradient reduce-scatter (stage 3).")
    reduce_bucket_size: int = Field(500_000_000, gt=0, description="Elements per gradient reduce bucket.")
    allgather_bucket_size: int = Field(500_000_000, gt=0, description="Elements per all-gather bucket (stages 1-2).")
    stage3_prefetch_bucket_size: int = Field(50_000_000, gt=0, description="Elements prefetched ahead (stage 3).")
    gradient_clipping: float | Literal["auto"] = Field(
        "auto", description="Global gradient norm clip; auto = the stage's max_grad_norm."
    )

    @model_validator(mode="after")
    def _consistent(self) -> DeepSpeedParams:
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError("an nvme offload needs deepspeed.nvme_path (a folder on an NVMe drive)")
        stage3_only = {
            "offload_param": self.offload_param != "none",
            "zero_quantized_weights": self.zero_quantized_weights,
            "zero_hpz_partition_size": self.zero_hpz_partition_size > 1,
            "zero_quantized_gradients": self.zero_quantized_gradients,
        }
        wrong = [k for k, on in stage3_only.items() if on]
        if wrong and self.zero_stage != 3:
            raise ValueError(f"{', '.join(wrong)}: only with zero_stage: 3 (got {self.zero_stage})")
        return self


class DistributedParams(Section):
    """How training is spread over processes and machines; Accelerate is the engine.

    ``strategy: none`` is one process. Any other strategy, or more than one process, makes ``llm-train``
    re-execute itself under ``accelerate launch`` with a config generated from this section.
    """

    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = Field("none", description="Parallelism strategy.")
    num_processes: int | Literal["auto"] = Field(
        1, description="Processes per machine; auto = every local GPU (an int is required on CPU)."
    )
    num_machines: int = Field(1, gt=0, description="Machines (nodes) in the run.")
    machine_rank: int = Field(0, ge=0, description="This machine's rank, 0 … num_machines-1.")
    main_process_ip: str | None = Field(None, description="Address of machine 0 (needed when num_machines > 1).")
    main_process_port: int = Field(29500, gt=0, lt=65536, description="Rendezvous port on machine 0.")
    join_timeout_s: float = Field(
        600.0,
        gt=0,
        le=86400,
        description="Seconds a machine of a multi-machine run waits for the others (and machine 0 for all of them) "
        "before it stops with an error naming the missing machine; also torchrun's rendezvous timeout.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    torch_compile: bool = Field(False, description="Compile the model with torch.compile.")
    torch_compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile mode."
    )
    fsdp: FSDPParams = FSDPParams()
    deepspeed: DeepSpeedParams = DeepSpeedParams()

    @model_validator(mode="after")
    def _consistent(self) -> DistributedParams:
        if isinstance(self.num_processes, int) and self.num_processes < 1:
            raise ValueError(f"num_processes must be ≥ 1 or auto (got {self.num_processes})")
        if self.strategy == "none" and (self.num_processes != 1 or self.num_machines != 1):
            raise ValueError(
                "strategy none is one process on one machine; set strategy: ddp (or fsdp/deepspeed) to use "
                f"num_processes {self.num_processes} × num_machines {self.num_machines}"
            )
        if self.machine_rank >= self.num_machines:
            raise ValueError(f"machine_rank {self.machine_rank} must be below num_machines {self.num_machines}")
        if self.num_machines > 1 and not self.main_process_ip:
            raise ValueError("num_machines > 1 needs main_process_ip (the address of machine 0)")
        if self.strategy == "fsdp" and self.fsdp.activation_checkpointing and self.gradient_checkpointing:
            raise ValueError(
                "fsdp.activation_checkpointing and gradient_checkpointing both recompute activations; keep one"
            )
        return self

    @property
    def world_size(self) -> int | None:
        """Processes in the whole run (num_processes × num_machines), or None while num_processes is auto."""
        return None if self.num_processes == "auto" else self.num_processes * self.num_machines
