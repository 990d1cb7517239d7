"""The one registry of stages: every stage's name, kind, params section, inputs, outputs and runtime traits.

Every other list of stages derives from :data:`REGISTRY`: the tasks `llm-train` knows, the sections that
inherit ``train:`` (`llmpipe.config.loading`), the best-checkpoint metric (`llmpipe.train.arguments`), the
one-process stages (`llmpipe.distributed.launch`), the report's stages. `tests/unit/test_registry.py` checks
that the registry, :class:`~llmpipe.config.Params` and ``dvc.yaml`` agree, and says what to add where when they do
not. A stage named ``x`` is the module ``llmpipe.stages.x`` exposing ``run(params, **kwargs)`` (found by
`llmpipe.stages.module`), the DVC stage ``x`` and, for a training stage, the params section ``x``
(docs/ARCHITECTURE.md, "Adding a training stage").

It lives in the config layer, below everything that asks about stages (config's own rules, train/, distributed/,
evaluation, the report), and imports only pydantic section classes, so `llm-train --help` and `llmpipe.config`
stay fast.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmpipe.config.curves import BARE, PPO, TRAINER, TRL_RL, Curves
from llmpipe.config.rl import GroupParams, GRPOParams, PPOParams, RLOOParams
from llmpipe.config.section import Section
from llmpipe.config.training import DPOParams, PretrainParams, RewardParams, SFTParams
from llmpipe.config.vlm import VLMParams

Kind = Literal["data", "training", "evaluation", "report", "hand"]


@dataclass(frozen=True)
class Headline:
    """One number of ``metrics/headline.json``: ``<stage>_<key>``, read from the stage's model's evaluation
    (``eval``: ``metrics/eval/<stage>.json``) or from the stage's own metrics (``stage``: ``metrics/<stage>.json``)."""

    key: str
    source: Literal["eval", "stage"]
    metric: str


RL_HEADLINE = (Headline("reward", "stage", "eval_reward"),)
"""What every RL stage's headline holds: its mean reward on the validation prompts at the end."""

VERIFIABLE_HEADLINE = (Headline("gen_score", "eval", "llmpipe_generation.score"),
                       Headline("distinct", "eval", "llmpipe_generation.distinct"))
"""What an RL stage on verifiable rewards adds: its generation score and share of distinct bodies."""


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
        best_metric: The validation metric whose best checkpoint is kept, and whether higher is better (an RL
            stage rewarded by running the tasks' tests keeps the best by that reward: :func:`best_metric`).
        one_process: Why the stage cannot run under a multi-process strategy yet; None when it can.
        loads_models: Whether it loads model or tokenizer folders (``--trust-remote-code`` applies).
        kl_unit: For an RL stage, the unit of its ``kl_final`` metric (the report prints it); what makes a stage
            RL (:attr:`rl`): its RL figure and table row, its reward in the headline, its best checkpoint by a
            validation reward.
        adapters: Whether the stage's section inherits ``train.peft`` (a fine-tuning stage: adapters apply).
        hf_trainer: Whether a training stage trains through the HF Trainer (or a TRL trainer on it), so every
            `TrainingArguments` switch acts (``use_liger_kernel``); False for a loop of its own (ppo).
        evaluated: Whether its model is in ``eval.models`` by default (lm-eval runs on it, the report compares it).
        causal_lm: Whether its model is a causal LM (the reward model is a sequence classifier: no alignment tax).
        grouped: Whether it samples a group of ``num_generations`` completions per prompt (GRPO's family; an RL
            stage whose section is a `GroupParams` is): a group must fit one generation round and one evaluation
            batch, and a checkpoint fall between rounds.
        verifiable: Whether an RL stage trains on verifiable rewards: the headline adds its generation score and
            share of distinct bodies.
        headline: Its numbers in ``metrics/headline.json`` (an RL stage's come from :func:`_rl`).
        params: The params sections and keys it reads (dvc.yaml's ``params:``; a training stage's by default:
            :func:`training_params`).
        outs: What it writes, as dvc.yaml lists its ``outs`` (a training stage: besides its model and logs).
        samples: Whether a training stage writes ``logs/<stage>/samples.jsonl`` (its ``samples`` hook answers).
        curves: What a training stage logs per step and how dvc.yaml plots it (`llmpipe.config.curves`).
        inherits: The training stage whose section's values this one's takes before its own, for the keys its
            class has (`llmpipe.config.loading.parse_params`): rloo runs on grpo's prompts, rewards, sampling and
            budget unless its own section says otherwise. Its :attr:`params` then list that section too.
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
    evaluated: bool = False
    causal_lm: bool = True
    grouped: bool = False
    verifiable: bool = False
    headline: tuple[Headline, ...] = ()
    params: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()
    samples: bool = True
    curves: Curves | None = None
    hf_trainer: bool = True
    inherits: str | None = None

    @property
    def rl(self) -> bool:
        """Whether the stage is reinforcement learning (it has a KL to its reference, :attr:`kl_unit`)."""
        return self.kl_unit is not None


def training_params(name: str, inherits: str | None = None) -> tuple[str, ...]:
    """What a training stage reads by default: paths, the attention choice, ``train``, the section it inherits (if
    any) and its own, and the launch and profiler sections (a profiled run logs the profiler's overhead in its
    tokens/s)."""
    return ("paths", "model.attn_implementation", "train", *filter(None, (inherits, name)), "distributed", "profile")


def _training(name: str, section: type[Section], description: str, *inputs: str, **traits: Any) -> Stage:
    traits.setdefault("adapters", True)
    traits.setdefault("evaluated", True)
    traits.setdefault("params", training_params(name, traits.get("inherits")))
    traits.setdefault("curves", TRAINER)
    return Stage(name, "training", description, section, inputs, f"${{paths.models}}/{name}", **traits)


def _rl(name: str, section: type[Section], description: str, *inputs: str, kl_unit: str, **traits: Any) -> Stage:
    """An RL training stage: the best checkpoint by validation reward, the RL headline (and, ``verifiable``, the
    generation score's); ``grouped`` when its section is a `GroupParams`."""
    headline = RL_HEADLINE + (VERIFIABLE_HEADLINE if traits.get("verifiable") else ())
    traits.setdefault("curves", TRL_RL)
    traits.setdefault("grouped", issubclass(section, GroupParams))
    return _training(name, section, description, *inputs, best_metric=("eval_reward", True), kl_unit=kl_unit,
                     headline=headline, **traits)


REGISTRY: dict[str, Stage] = {s.name: s for s in (
    Stage("prepare", "data", "Build train/validation/test datasets (pretraining text, SFT pairs, preference pairs, "
          "executable function tasks, eval sets).", loads_models=False, params=("paths", "data"),
          outs=tuple(f"${{paths.data}}/{kind}" for kind in ("pretrain", "sft", "preference", "tasks", "eval", "vlm"))),
    Stage("tokenizer", "data", "Train a byte-level BPE tokenizer on the pretraining split (or load one).",
          inputs=("${paths.data}/pretrain",), params=("paths", "tokenizer", "model.init_from", "model.revision"),
          outs=("${paths.tokenizer}",)),
    Stage("tokenize", "data", "Tokenise the pretraining splits once into memory-mappable token files "
          "(data/tokens/<split>/).", inputs=("${paths.data}/pretrain", "${paths.tokenizer}"), params=("paths",),
          outs=("${paths.data}/tokens/train", "${paths.data}/tokens/validation")),
    Stage("baseline", "data", "Save an untrained (random-init) model of the configured shape: the evaluation "
          "baseline.", inputs=("${paths.tokenizer}",), evaluated=True, params=("paths", "model"),
          outs=("${paths.models}/baseline",)),
    _training("pretrain", PretrainParams, "Causal-LM pretraining of a Llama model on packed token blocks.",
              "${paths.data}/tokens/train", "${paths.data}/tokens/validation", "${paths.tokenizer}", adapters=False,
              headline=(Headline("bpb", "eval", "llmpipe_perplexity.bits_per_byte"),),
              # the whole model section (it builds the model), and what a stream reads (data.streaming); the rest
              # of `data` reaches pretrain through data/tokens
              params=("paths", "model", "train", "pretrain", "distributed", "profile", "data.source",
                      "data.streaming", "data.hf", "data.mixture", "data.validation_source", "data.stream",
                      "data.seed", "data.validation_fraction", "data.test_fraction", "data.max_chars_per_document")),
    _training("sft", SFTParams, "Supervised fine-tuning on chat pairs (TRL SFTTrainer), loss on assistant turns.",
              "${paths.data}/sft", "${paths.tokenizer}", "${paths.models}/pretrain",
              headline=(Headline("chat_bpb", "eval", "llmpipe_sft_chat.bits_per_byte"),)),
    _training("dpo", DPOParams, "Preference tuning from the SFT model by dpo.method: DPO, KTO, ORPO, SimPO or CPO "
              "(TRL).", "${paths.data}/preference", "${paths.tokenizer}", "${paths.models}/sft",
              headline=(Headline("pref_acc", "eval", "llmpipe_preference.acc_norm"),
                        Headline("bpb", "eval", "llmpipe_perplexity.bits_per_byte"))),
    _training("reward", RewardParams, "Reward model (TRL RewardTrainer) from the SFT model on preference pairs; "
              "held-out pairwise accuracy.", "${paths.data}/preference", "${paths.tokenizer}", "${paths.models}/sft",
              evaluated=False, causal_lm=False, headline=(Headline("acc", "stage", "accuracy"),), samples=False),
    _rl("ppo", PPOParams, "PPO (llmpipe.rl.ppo on Accelerate) of the SFT/DPO model against the reward model and "
        "reward functions.", "${paths.data}/sft", "${paths.data}/tokens/train", "${paths.tokenizer}",
        "${paths.models}/${ppo.policy}", "${paths.models}/reward", kl_unit="nats per response",
        one_process="its own Accelerate loop (llmpipe.rl.ppo) is single-process for now", curves=PPO,
        hf_trainer=False),
    _rl("grpo", GRPOParams, "Group relative policy optimisation (TRL GRPOTrainer) of the SFT model against "
        "verifiable rewards.", "${paths.data}/sft", "${paths.tokenizer}", "${paths.models}/${grpo.policy}",
        kl_unit="nats per token", verifiable=True),
    _rl("rloo", RLOOParams, "REINFORCE leave-one-out (TRL RLOOTrainer) of the SFT model on grpo's prompts and "
        "verifiable rewards.", "${paths.data}/sft", "${paths.tokenizer}", "${paths.models}/${rloo.policy}",
        kl_unit="nats per token", verifiable=True, inherits="grpo"),
    _training("vlm", VLMParams, "LLaVA vision-language model on the SFT model (TRL SFTTrainer) from image "
              "questions; held-out accuracy by question type.", "${paths.data}/vlm", "${paths.tokenizer}",
              "${paths.models}/sft", one_process="not yet tried under several processes", adapters=False,
              evaluated=False, headline=(Headline("acc", "stage", "test_accuracy"),), samples=False,
              outs=("${paths.logs}/vlm/answers",), curves=BARE),
    Stage("evaluate", "evaluation", "lm-evaluation-harness on one model (--model NAME).",
          inputs=("${paths.data}/eval", "${paths.models}/${item.model}"),
          # data.source: which tasks apply (no Python-code task on users' own data)
          params=("paths", "model.attn_implementation", "data.source", "eval.tasks", "eval.task_options",
                  "eval.limit", "eval.batch_size", "eval.max_length", "eval.max_new_tokens"),
          outs=("${paths.logs}/evaluate/${item.model}/answers.jsonl",)),  # greedy answers, side by side on the card
    # the report also reads the keys its stages' inputs are templated by (ppo.policy: where ppo started) and the
    # RL stages' kl_target (ppo's KL check), which `report_params` adds before `report`
    Stage("report", "report", "The report card reports/report.{md,html}: checks, results across stages, "
          "figures, per-stage statistics, provenance; metrics/headline.json.", loads_models=False,
          # data.source: the words and checks that fit the data; pretrain.enabled false: sft starts from the baseline
          params=("paths", "data.source", "pretrain.enabled", "eval.models", "eval.tasks", "eval.limit", "report"),
          outs=("${paths.reports}/report.md", "${paths.reports}/report.html", "${paths.reports}/figures")),
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

RL_TASKS = tuple(name for name, s in REGISTRY.items() if s.rl)
"""The RL stages: an RL figure and table row (the training reward shown, not checked), the reward in the headline,
the post-training checks on the tasks against their policy (`llmpipe.evaluation.task_checks`)."""

GROUPED_TASKS = tuple(name for name, s in REGISTRY.items() if s.grouped)
"""Stages that sample a group of completions per prompt (the group-size rules of `llmpipe.config.params`)."""

VERIFIABLE_TASKS = tuple(name for name, s in REGISTRY.items() if s.rl and s.verifiable)
"""RL stages on verifiable rewards: each has its generation score and distinct share in the headline."""

EVALUATED_BY_DEFAULT = tuple(name for name, s in REGISTRY.items() if s.evaluated)
"""The default ``eval.models``: every model lm-eval runs on unless params say otherwise."""

HEADLINE: tuple[tuple[str, Literal["eval", "stage"], str, str], ...] = tuple(
    (f"{name}_{h.key}", h.source, name, h.metric) for name, s in REGISTRY.items() for h in s.headline)
"""``(headline key, where from, stage, metric)`` of every stage's :class:`Headline`, in pipeline order. Short keys:
``dvc exp show`` names its columns ``headline.<key>``."""

_TEMPLATE = re.compile(r"\$\{([a-z_.]+)\}")


def templated_keys() -> tuple[str, ...]:
    """The params keys that training stages' inputs are templated by (``${ppo.policy}``), in pipeline order: the
    report reads them to know where each stage started."""
    keys = (m for name in TRAINING_TASKS for t in REGISTRY[name].inputs for m in _TEMPLATE.findall(t))
    return tuple(dict.fromkeys(k for k in keys if not k.startswith("paths.")))


def report_params() -> tuple[str, ...]:
    """The report's params: its own, with :func:`templated_keys` and the ``kl_target`` of every RL stage whose
    section has one (its KL check) before its ``report`` section."""
    *own, last = REGISTRY["report"].params
    targets = (f"{name}.kl_target" for name in RL_TASKS if "kl_target" in REGISTRY[name].section.model_fields)
    return (*own, *templated_keys(), *targets, last)


SELECTION_REWARD = "tests_pass"
"""The reward whose mean on the validation prompts picks an RL stage's best checkpoint when the stage's rewards
list it (:func:`best_metric`): the share of a task's hidden tests the completion passes, run in
the sandbox. Named here, not taken from `RewardName`, so that a stage whose rewards lack it keeps selecting by its
summed validation reward."""


def best_metric(name: str, section: Section) -> tuple[str, bool]:
    """The validation metric whose best checkpoint stage `name` keeps, and whether higher is better: for an RL
    stage whose rewards (`section.rewards`) list :data:`SELECTION_REWARD`, that reward's mean
    on the validation prompts (``eval_rewards/<name>/mean``, as TRL's GRPO and RLOO log it and the ppo stage
    does too); else the registry's :attr:`Stage.best_metric`."""
    if REGISTRY[name].rl and any(spec.name == SELECTION_REWARD for spec in getattr(section, "rewards", ())):
        return f"eval_rewards/{SELECTION_REWARD}/mean", True
    return REGISTRY[name].best_metric


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
