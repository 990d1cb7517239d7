"""The one registry of stages: every stage's name, kind, params section, inputs, outputs and runtime traits.

Every other list of stages derives from :data:`REGISTRY`: the tasks `llm-train` knows, the sections that
inherit ``train:`` (`llmpipe.config.loading`), the best-checkpoint metric (`llmpipe.train.arguments`), the
one-process stages (`llmpipe.distributed.launch`), the report's stages. `tests/unit/test_registry.py` checks
that the registry, :class:`~llmpipe.config.Params` and ``dvc.yaml`` agree, and says what to add where when they do
not. A stage named ``x`` is the module ``llmpipe.stages.x`` exposing ``run(params, **kwargs)``, the DVC stage
``x`` and, for a training stage, the params section ``x`` (docs/ARCHITECTURE.md, "Adding a training stage").

Only pydantic section classes are imported here, and stage modules only when their task runs, so
`llm-train --help` and `llmpipe.config` stay fast.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from llmpipe.config.rl import GRPOParams, PPOParams
from llmpipe.config.section import Section
from llmpipe.config.training import DPOParams, PretrainParams, RewardParams, SFTParams
from llmpipe.config.vlm import VLMParams

Kind = Literal["data", "training", "evaluation", "report", "hand"]

PRETRAIN_DATA_KEYS = tuple(f"data.{k}" for k in ("source", "streaming", "hf", "mixture", "validation_source", "stream",
                                                 "seed", "validation_fraction", "test_fraction",
                                                 "max_chars_per_document"))
"""What a stream reads (``data.streaming``); the rest of `data` reaches pretrain through data/tokens."""


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline.

    Attributes:
        name: The task, the DVC stage, the module ``llmpipe.stages.<name>`` and (training) the params section.
        kind: ``data`` (prepare, tokenizer, …), ``training`` (inherits ``train:``, checkpoints, resumes),
            ``evaluation``, ``report``, or ``hand`` (run by hand only, no DVC stage).
        description: One line, shown by `llm-train --help`.
        section: The params class of the stage's own section (training stages), else None.
        inputs: What the stage reads, as dvc.yaml writes its non-code deps (``${paths.data}/sft``); a training
            run's checkpoint fingerprint hashes them (:func:`input_paths`).
        output: The model folder a training stage writes (``${paths.models}/<name>``), else None.
        best_metric: The validation metric whose best checkpoint is kept, and whether higher is better.
        one_process: Why the stage cannot run under a multi-process strategy yet; None when it can.
        loads_models: Whether it loads model or tokenizer folders (``--trust-remote-code`` applies).
        kl_unit: For an RL stage, the unit of its ``kl_final`` metric (the report prints it).
        adapters: Whether the stage's section inherits ``train.peft`` (a fine-tuning stage: adapters apply).
        params: The params sections (or dotted keys) it reads besides ``paths``, as dvc.yaml lists them; its
            metrics' run identity hashes them (`llmpipe.config.identity`).
    """

    name: str
    kind: Kind
    description: str
    section: type[Section] | None = None
    inputs: tuple[str, ...] = ()
    output: str | None = None
    best_metric: tuple[str, bool] = ("eval_loss", False)
    one_process: str | None = None
    loads_models: bool = True
    kl_unit: str | None = None
    adapters: bool = False
    params: tuple[str, ...] = ()


def _training(name: str, section: type[Section], description: str, *inputs: str, **traits: Any) -> Stage:
    traits.setdefault("adapters", True)
    traits.setdefault("params", ("model.attn_implementation", "train", name, "distributed", "profile"))
    return Stage(name, "training", description, section, inputs, f"${{paths.models}}/{name}", **traits)


REGISTRY: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare", "data", "Build train/validation/test datasets (pretraining text, SFT pairs, preference pairs, "
          "eval sets).", loads_models=False, params=("data",)),
    Stage("tokenizer", "data", "Train a byte-level BPE tokenizer on the pretraining split (or load one).",
          inputs=("${paths.data}/pretrain",), params=("tokenizer", "model.init_from", "model.revision")),
    Stage("tokenize", "data", "Tokenise the pretraining splits once into memory-mappable token files "
          "(data/tokens/<split>/).", inputs=("${paths.data}/pretrain", "${paths.tokenizer}")),
    Stage("baseline", "data", "Save an untrained (random-init) model of the configured shape: the evaluation "
          "baseline.", inputs=("${paths.tokenizer}",), params=("model",)),
    _training("pretrain", PretrainParams, "Causal-LM pretraining of a Llama model on packed token blocks.",
              "${paths.data}/tokens/train", "${paths.data}/tokens/validation", "${paths.tokenizer}", adapters=False,
              params=("model", "train", "pretrain", "distributed", "profile", *PRETRAIN_DATA_KEYS)),
    _training("sft", SFTParams, "Supervised fine-tuning on chat pairs (TRL SFTTrainer), loss on assistant turns.",
              "${paths.data}/sft", "${paths.tokenizer}", "${paths.models}/pretrain"),
    _training("dpo", DPOParams, "Preference tuning from the SFT model by dpo.method: DPO, KTO, ORPO, SimPO or CPO (TRL).",
              "${paths.data}/preference", "${paths.tokenizer}", "${paths.models}/sft"),
    _training("reward", RewardParams, "Reward model (TRL RewardTrainer) from the SFT model on preference pairs; "
              "held-out pairwise accuracy.", "${paths.data}/preference", "${paths.tokenizer}", "${paths.models}/sft"),
    _training("ppo", PPOParams, "PPO (llmpipe.rl.ppo on Accelerate) of the SFT/DPO model against the reward model "
              "and reward functions.", "${paths.data}/sft", "${paths.data}/tokens/train", "${paths.tokenizer}",
              "${paths.models}/${ppo.policy}", "${paths.models}/reward", best_metric=("eval_reward", True),
              one_process="its own Accelerate loop (llmpipe.rl.ppo) is single-process for now",
              kl_unit="nats per response"),
    _training("grpo", GRPOParams, "Group relative policy optimisation (TRL GRPOTrainer) of the SFT model against "
              "verifiable rewards.", "${paths.data}/sft", "${paths.tokenizer}", "${paths.models}/${grpo.policy}",
              best_metric=("eval_reward", True), kl_unit="nats per token"),
    _training("vlm", VLMParams, "LLaVA vision-language model on the SFT model (TRL SFTTrainer) from image "
              "questions; held-out accuracy by question type.", "${paths.data}/vlm", "${paths.tokenizer}",
              "${paths.models}/sft", one_process="not yet tried under several processes", adapters=False),
    Stage("evaluate", "evaluation", "lm-evaluation-harness on one model (--model NAME).",
          inputs=("${paths.data}/eval", "${paths.models}/${item.model}"),
          params=("model.attn_implementation", "data.source", *(f"eval.{k}" for k in ("tasks", "task_options", "limit",
                                                                                     "batch_size", "max_length",
                                                                                     "max_new_tokens")))),
    Stage("report", "report", "The report card reports/report.{md,html}: checks, costs, results across stages, "
          "figures, per-stage statistics, provenance; metrics/headline.json.", loads_models=False,
          params=("data.source", "pretrain.enabled", "eval.models", "eval.tasks", "eval.limit", "ppo.policy",
                  "grpo.policy", "report")),
    Stage("regression", "hand", "Hardware smoke test: an MLP on y = Xw + noise with plain Accelerate; ranks must "
          "agree (hand run).", loads_models=False),
)}
"""Every stage, in the order of the pipeline."""

ALIASES: dict[str, str] = {"lm": "pretrain", "stream_lm": "pretrain"}


def of_kind(*kinds: Kind) -> tuple[str, ...]:
    """The names of the stages of these kinds, in pipeline order."""
    return tuple(name for name, s in REGISTRY.items() if s.kind in kinds)


TRAINING_TASKS = of_kind("training")
"""Stages whose section inherits ``train:``, that checkpoint and resume, and take the hand-run overrides."""

ADAPTER_TASKS = tuple(name for name, s in REGISTRY.items() if s.adapters)
"""Training stages that inherit ``train.peft`` (pretrain trains its model in full)."""

DVC_STAGES = tuple(name for name, s in REGISTRY.items() if s.kind != "hand")
"""Stages with a stage of their own in dvc.yaml (``evaluate`` as the matrix ``evaluate@<model>``)."""

METRICS_STAGES = of_kind("data", "training")
"""Stages whose ``metrics/<name>.json`` the report reads."""

LOADING_TASKS = tuple(name for name, s in REGISTRY.items() if s.loads_models)
"""Tasks that load a model or tokenizer folder; their ``run`` takes ``trust_remote_code`` (`--trust-remote-code`)."""

DISTRIBUTED_TASKS = of_kind("training", "hand")
"""Tasks that run under `distributed:` params (re-launched under `accelerate launch` when it asks for it)."""

_TEMPLATE = re.compile(r"\$\{([a-z_.]+)\}")


def resolve_template(template: str, params: Any) -> str:
    """A dvc.yaml-style path with every ``${a.b}`` replaced by ``params.a.b``.

    Raises:
        AttributeError: The template names a key params do not have (a registry mistake, not a user's).
    """

    def value(match: re.Match[str]) -> str:
        obj = params
        for part in match.group(1).split("."):
            obj = getattr(obj, part)
        return str(obj)

    return _TEMPLATE.sub(value, template)


def input_paths(name: str, params: Any) -> list[Path]:
    """The paths stage `name` reads, resolved against `params` (its checkpoint fingerprint hashes them)."""
    return [Path(resolve_template(t, params)) for t in REGISTRY[name].inputs]


def run_inputs(task: str, params: Any) -> list[Path]:
    """What a training run of `task` reads (its checkpoint fingerprint hashes them): the stage module's own
    ``inputs(params)`` where that depends on more than templates (pretrain, ppo), else :func:`input_paths`."""
    own = getattr(module(task), "inputs", None)
    return own(params) if own is not None else input_paths(resolve(task), params)


def resolve(task: str) -> str:
    """Canonical task name.

    Raises:
        ValueError: `task` is not registered; the message lists the registered tasks.
    """
    task = ALIASES.get(task, task)
    if task not in REGISTRY:
        raise ValueError(f"unknown task {task!r}; registered tasks: {', '.join(REGISTRY)} (aliases: lm, stream_lm → "
                         "pretrain)")
    return task


def module(task: str) -> ModuleType:
    """The module of `task`."""
    return importlib.import_module(f"llmpipe.stages.{resolve(task)}")


def runner(task: str) -> Callable[..., dict[str, float]]:
    """The ``run`` function of `task`."""
    return module(task).run
