"""The stage registry: task name → module `llmpipe.stages.<name>` exposing ``run(params, **kwargs)`` (training
stages also ``inputs(params)``, the paths their checkpoint fingerprint hashes).

Modules are imported only when their task runs, so `llm-train --help` stays fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

TASKS: dict[str, str] = {
    "prepare": "Build train/validation/test datasets (pretraining text, SFT pairs, preference pairs, eval sets).",
    "tokenizer": "Train a byte-level BPE tokenizer on the pretraining split (or load one).",
    "tokenize": "Tokenise the pretraining splits once into memory-mappable token files (data/tokens/<split>/).",
    "baseline": "Save an untrained (random-init) model of the configured shape: the evaluation baseline.",
    "pretrain": "Causal-LM pretraining of a Llama model on packed token blocks.",
    "sft": "Supervised fine-tuning on chat pairs (TRL SFTTrainer), loss on assistant turns.",
    "reward": "Reward model (TRL RewardTrainer) from the SFT model on preference pairs; held-out pairwise accuracy.",
    "dpo": "Direct preference optimisation (TRL DPOTrainer) from the SFT model.",
    "ppo": "PPO (llmpipe.rl.ppo on Accelerate) of the SFT/DPO model against the reward model and reward functions.",
    "grpo": "Group relative policy optimisation (TRL GRPOTrainer) of the SFT model against verifiable rewards.",
    "evaluate": "lm-evaluation-harness on one model (--model NAME).",
    "report": "reports/report.md: every model × metric, task descriptions, stage wall times.",
    "regression": "Hardware smoke test: an MLP on y = Xw + noise with plain Accelerate; ranks must agree (hand run).",
}
"""Registered tasks and their one-line descriptions (shown by `llm-train --help`)."""

ALIASES: dict[str, str] = {"lm": "pretrain", "stream_lm": "pretrain"}

TRAINING_TASKS = ("pretrain", "sft", "dpo", "reward", "ppo", "grpo")

LOADING_TASKS = ("tokenizer", "tokenize", "baseline", *TRAINING_TASKS, "evaluate")
"""Tasks that load a model or tokenizer folder; their ``run`` takes ``trust_remote_code`` (`--trust-remote-code`)."""

HAND_TASKS = ("regression",)
"""Tasks run by hand only, with no stage in dvc.yaml."""

DISTRIBUTED_TASKS = (*TRAINING_TASKS, "regression")
"""Tasks that run under `distributed:` params (re-launched under `accelerate launch` when it asks for it)."""


def resolve(task: str) -> str:
    """Canonical task name.

    Raises:
        ValueError: `task` is not registered; the message lists the registered tasks.
    """
    task = ALIASES.get(task, task)
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; registered tasks: {', '.join(TASKS)} (aliases: lm, stream_lm → pretrain)")
    return task


def module(task: str) -> ModuleType:
    """The module of `task`."""
    return importlib.import_module(f"llmpipe.stages.{resolve(task)}")


def runner(task: str) -> Callable[..., dict[str, float]]:
    """The ``run`` function of `task`."""
    return module(task).run
