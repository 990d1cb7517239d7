"""The shape every Trainer stage (sft, dpo, reward, grpo) shares: a base class that owns the prologue and epilogue.

A stage subclasses :class:`TrainerStage` and states only what is its own: its ``<Method>Config`` mapping
(:meth:`~TrainerStage.config`), its datasets, its trainer, its checks and its extra metrics. The base runs them
in one order (:meth:`~TrainerStage.run`):

1. load the tokenizer (``paths.tokenizer``);
2. (``data_first`` stages) load and check the datasets;
3. load the input model (its missing folder names the stage to run), refuse one trained with another tokenizer;
   wrap it as ``peft:`` says (`llmpipe.train.adapters`: an adapter, BitFit, or as it is);
4. open the run (`llmpipe.train.checkpoints.open_run`: the checkpoint folder, hashing the registry's inputs);
5. load and check the datasets; build the trainer with the stage's callbacks (`llmpipe.train.hooks`: progress,
   TensorBoard, samples of :meth:`~TrainerStage.samples`, the users'); check the prepared data;
6. train, save and evaluate (`llmpipe.train.loop.train_stage`); add the stage's extra metrics.

The input model loads before the run opens because hashing a missing folder would give a generic error, where
loading it names the stage that makes it. pretrain (builds its model) and ppo (its own Accelerate loop) do not
use this base.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from llmpipe.config import Params
from llmpipe.config.stages import REGISTRY, input_paths
from llmpipe.models import load_model, load_tokenizer
from llmpipe.models.tokenizer_identity import check_same_tokenizer
from llmpipe.train import adapters
from llmpipe.train.checkpoints import ResumeRequest, open_run
from llmpipe.train.loop import train_stage


def model_input(name: str, params: Params) -> Path:
    """The model folder stage `name` starts from: its one registry input under ``paths.models``."""
    (path,) = [p for t, p in zip(REGISTRY[name].inputs, input_paths(name, params))
               if t.startswith("${paths.models}/")]  # fmt: skip
    return path


def data_input(name: str, params: Params) -> Path:
    """The data folder stage `name` reads: its first registry input under ``paths.data``."""
    return next(p for t, p in zip(REGISTRY[name].inputs, input_paths(name, params)) if t.startswith("${paths.data}/"))


class TrainerStage(ABC):
    """A training stage on a Hugging Face / TRL `Trainer`; subclasses set :attr:`name` and implement the
    abstract hooks (:meth:`config`, :meth:`datasets`, :meth:`make_trainer`).

    Attributes:
        name: The stage (registry name, params section, ``models/<name>`` output).
        data_first: Load and check the datasets before the input model (sft: its truncation counts need only
            the tokenizer, so a data mistake is named before minutes of model loading).
        params: Validated params.
        cfg: The stage's own section (``params.<name>``).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code.
        tokenizer: The pipeline tokenizer, set by :meth:`run` before any hook runs.
        data: The stage's data folder (``data/<kind>``, from the registry).
        base: The input model folder (``models/<stage>``, from the registry).
        peft_config: The peft config :meth:`make_trainer` passes its trainer to wrap the model itself, or None
            (`llmpipe.train.adapters.for_trainer`: AdaLoRA under a trainer that copies its reference).
    """

    name: ClassVar[str]
    data_first: ClassVar[bool] = False
    task_type: ClassVar[str] = "CAUSAL_LM"
    """peft's task type of the trained model (reward: ``SEQ_CLS``, so its score head trains in full)."""

    def __init__(self, params: Params, trust_remote_code: bool = False) -> None:
        self.params, self.cfg, self.trust_remote_code = params, params.stage(self.name), trust_remote_code
        self.data, self.base = data_input(self.name, params), model_input(self.name, params)
        self.tokenizer: Any = None
        self.peft_config: Any = None

    @property
    def missing_base(self) -> str:
        """The fix when the input model folder is missing: the stage that writes it, and the command that runs it."""
        stage = self.base.name
        if stage == "pretrain" and not self.params.pretrain.enabled:  # it trains nothing: a pointer, in seconds
            return ("pretrain.enabled is false, so the pretrain stage writes there only a pointer to model.init_from "
                    f"({self.params.model.init_from}), in seconds: run `llm-train --task pretrain` (or dvc repro "
                    "pretrain) first")
        return f"run the {stage} stage first (dvc repro {stage})"

    # --- hooks: what a stage states -------------------------------------------------------------------------------

    @abstractmethod
    def config(self, run_dir: Path):
        """Our params → the stage's `trl.<Method>Config` (or `TrainingArguments`), field by field."""

    @abstractmethod
    def datasets(self) -> tuple[Any, Any]:
        """The training and validation datasets, as the trainer takes them."""

    @abstractmethod
    def make_trainer(self, model, args, train, valid, callbacks: list):
        """The stage's trainer on `model` with `args` (:meth:`config`), the datasets and `callbacks`."""

    def check_data(self, train, valid) -> dict[str, float]:
        """Checks on the raw datasets (before any model loads when :attr:`data_first`); returns counts for the
        metrics. Raises UserError to refuse them."""
        return {}

    def check_trainer(self, trainer, num_train: int, num_valid: int) -> dict[str, float]:
        """Checks on the trainer's prepared datasets (`num_train`/`num_valid`: rows given to it); returns counts for
        the metrics. Raises UserError to refuse them."""
        return {}

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics beyond :func:`~llmpipe.train.loop.train_stage`'s, after training (`metrics`: those so far)."""
        return {}

    def samples(self):
        """The prompts answered at each evaluation and how (`llmpipe.train.hooks.StageSamples`), or None for none:
        by default ``eval_prompts`` or held-out prompts of :attr:`data`, chat-rendered, greedy."""
        from llmpipe.train.samples import generation_config, model_generate, stage_prompts

        config = generation_config(self.tokenizer, self.cfg.eval_max_new_tokens)
        prompts = stage_prompts(self.cfg, self.tokenizer, self.data / "validation.jsonl")
        return prompts, model_generate(self.tokenizer, config)

    def saved_with(self):
        """What is saved beside the model in ``models/<name>`` (the tokenizer; a processor for a model of images)."""
        return self.tokenizer

    def load_model(self, **kwargs):
        """The model to train, from :attr:`base` (raises UserError naming the stage to run when it is missing); a
        pointer there (``pretrain.enabled: false``) loads ``model.init_from``. `kwargs` go to `from_pretrained`
        (QLoRA's quantization config)."""
        return load_model(self.base, self.missing_base, trust_remote_code=self.trust_remote_code,
                          attn_implementation=self.params.model.attn_implementation, **kwargs)  # fmt: skip

    @property
    def copies_reference(self) -> bool:
        """Whether the stage's TRL trainer copies a peft model's adapter as its frozen reference (dpo, kto; grpo
        with a KL term): none by default."""
        return False

    @property
    def adapter(self) -> bool:
        """Whether the stage trains a peft adapter (its reference, where it has one, is the adapter-disabled model)."""
        return self.cfg.peft.method not in ("none", "bitfit")

    # --- the run ----------------------------------------------------------------------------------------------------

    def inputs(self) -> list[Path]:
        """What the run reads (its checkpoint fingerprint hashes them): the registry's inputs of the stage."""
        return input_paths(self.name, self.params)

    def _datasets(self) -> tuple[Any, Any, dict[str, float]]:
        train, valid = self.datasets()
        return train, valid, self.check_data(train, valid)

    def run(self, resume: ResumeRequest | None = None) -> dict[str, float]:
        """Train the stage (the order of the module docstring); save ``models/<name>``; return its metrics.

        Args:
            resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`); None resumes the
                newest whole checkpoint of the same run.

        Returns:
            The metrics of :func:`llmpipe.train.loop.train_stage`, then the counts of :meth:`check_data` and
            :meth:`check_trainer`, then :meth:`extra_metrics`.

        Raises:
            UserError: A missing or refused input, an input model trained with another tokenizer, or a refusal of
                the stage's checks.
        """
        from llmpipe.train.hooks import trainer_hooks  # imports transformers: not at stage-module import

        params = self.params
        self.tokenizer = load_tokenizer(params.paths.tokenizer, self.trust_remote_code)
        early = self._datasets() if self.data_first else None
        peft = self.cfg.peft
        model = self.load_model(**adapters.load_kwargs(peft, self.name))
        check_same_tokenizer(self.base, self.tokenizer, params.paths.tokenizer)
        model, self.peft_config = adapters.for_trainer(model, peft, self.name, self.base, self.copies_reference,
                                                       self.task_type, self.cfg.max_steps, self.cfg.seed)  # fmt: skip
        run = open_run(params, self.name, self.inputs(), resume)
        train, valid, counts = early or self._datasets()
        callbacks = [trainer_hooks(params, self.name, run.path, self.tokenizer, self.samples())]
        if peft.method == "adalora":
            callbacks.append(adapters.adalora_callback())
        trainer = self.make_trainer(model, self.config(run.path), train, valid, callbacks)
        counts |= self.check_trainer(trainer, len(train), len(valid))
        metrics = train_stage(trainer, params, self.name, run, self.saved_with(), load_base=self.load_model,
                              chat=True)  # every Trainer stage comes after sft or is it  # fmt: skip
        metrics.update(counts)
        metrics.update(self.extra_metrics(trainer, metrics))
        return metrics
