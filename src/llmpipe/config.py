"""Typed, validated view of ``params.yaml``: the single source of every hyperparameter and path.

Every section is a pydantic v2 model with ``extra="forbid"``, so a mistyped key is an error that
names the key path and, where one is close, the key that was meant. The ``train`` section holds
training defaults; each training stage section (``pretrain``, ``sft``, ``dpo``, ``reward``, ``ppo``,
``grpo``) may override any of them and adds its own keys. :func:`load_params` merges ``train`` under each
stage section before validation, so ``params.sft.lr`` is the value SFT really uses.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from llmpipe import presets
from llmpipe.distributed.params import DistributedParams
from llmpipe.errors import UserError
from llmpipe.io import decode_line
from llmpipe.section import Section

STAGE_SECTIONS = ("pretrain", "sft", "dpo", "reward", "ppo", "grpo")
"""Training stages whose sections inherit the ``train`` defaults."""

BUDGET_KEYS = frozenset({"max_steps", "num_train_epochs", "steps_per_epoch"})
"""Train keys that only set how long a run lasts: raising them continues the same run."""


class ParamsError(UserError):
    """A mistake in params.yaml: the message names the file, the key path or line, and the fix."""


class PathsParams(Section):
    """Where every stage reads and writes, relative to the repository root (dvc.yaml templates these)."""

    data: str = Field("data", description="Prepared datasets: data/{pretrain,sft,preference,eval,tokens}/.")
    tokenizer: str = Field("artifacts/tokenizer", description="Tokenizer directory (save_pretrained).")
    models: str = Field("models", description="Final model directories: models/<stage>/.")
    metrics: str = Field("metrics", description="DVC metrics: metrics/<stage>.json, metrics/eval/<model>.json.")
    logs: str = Field("logs", description="Per-step logs for dvc plots and TensorBoard: logs/<stage>/.")
    checkpoints: str = Field(
        "checkpoints", description="Training checkpoints: checkpoints/<stage>/<fingerprint>/ (git-ignored)."
    )
    reports: str = Field("reports", description="reports/report.md.")
    runs: str = Field("runs", description="Hand runs with CLI overrides write under runs/<task>-<time>/.")
    output_root: str = Field(
        ".",
        description="Root under which a stage writes its outputs; '.' for DVC runs, runs/<task>-<time> for hand runs.",
    )

    def out(self, *parts: str) -> Path:
        """Path a stage writes to: ``output_root/<parts>`` (inputs use the plain fields)."""
        return Path(self.output_root, *parts)


class StdlibSourceParams(Section):
    """How the embedded default corpus (the running interpreter's standard library) is cut."""

    min_body_lines: int = Field(2, ge=1, description="Functions with shorter bodies are not used as SFT pairs.")
    max_body_lines: int = Field(30, ge=1, description="Functions with longer bodies are not used as SFT pairs.")
    max_sft_pairs: int = Field(20000, gt=0, description="Cap on training SFT pairs.")
    max_preference_pairs: int = Field(10000, gt=0, description="Cap on training preference pairs.")


SFTFormat = Literal["auto", "messages", "prompt_completion", "alpaca", "sharegpt"]
"""Shapes of SFT records (`llmpipe.data.formats`); ``auto`` reads the shape from the columns."""

PreferenceFormat = Literal["auto", "explicit_prompt", "implicit_prompt"]
"""Shapes of preference records (`llmpipe.data.formats`); ``auto`` reads the shape from the columns."""


class LocalSourceParams(Section):
    """Users' own files (a file, or a folder of one format: .jsonl, .json, .parquet, .csv, and .txt for pretraining
    text) per dataset kind; null = none.

    `sft` and `preference` are read whenever `data.source` is not 'stdlib' (which brings its own).
    """

    pretrain: str | None = Field(None, description="Text documents: .txt files, or records with a `text` column.")
    sft: str | None = Field(None, description="SFT records in one of the shapes of `sft_format`.")
    preference: str | None = Field(None, description="Preference records in one of the shapes of `preference_format`.")
    sft_format: SFTFormat = Field("auto", description="Shape of the `sft` records; auto = from the columns.")
    preference_format: PreferenceFormat = Field(
        "auto", description="Shape of the `preference` records; auto = from the columns."
    )


class HFRecordsParams(Section):
    """SFT or preference records from ``datasets.load_dataset(dataset_name, dataset_config, split=split)``; a local
    dataset folder (or file) as `dataset_name` works the same, offline. Read whenever `data.source` is not 'stdlib'."""

    dataset_name: str | None = Field(None, description="A hub dataset name, or a local dataset folder; null = none.")
    dataset_config: str | None = Field(None, description="Dataset configuration name.")
    split: str = Field("train", description="Split to read; `datasets` slices work, e.g. train[:1000].")


class HFSFTParams(HFRecordsParams):
    """`data.hf_sft`: SFT records from a hub dataset."""

    format: SFTFormat = Field("auto", description="Shape of the records; auto = from the columns.")


class HFPreferenceParams(HFRecordsParams):
    """`data.hf_preference`: preference records from a hub dataset."""

    format: PreferenceFormat = Field("auto", description="Shape of the records; auto = from the columns.")


class HFSourceParams(Section):
    """A pretraining text source read through `datasets.load_dataset` (a hub name, or a local file or folder).

    `preset` fills `dataset_name`, `dataset_config` and `text_column` where they are not given
    (``llm-train --list-presets``); fields given directly win.
    """

    preset: str | None = Field(None, description="A named hub corpus (llm-train --list-presets).")
    dataset_name: str | None = Field(None, description="Dataset name on the hub, or a local dataset file or folder.")
    dataset_config: str | None = Field(None, description="Dataset configuration name.")
    split: str = Field("train", description="Split to read.")
    text_column: str = Field("text", description="Column holding the document text (null: the preset's, or text).")
    max_documents: int | None = Field(
        None, gt=0, description="prepare reads at most this many documents (streamed, so nothing else is downloaded)."
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("preset") is not None:
            preset = presets.resolve(data["preset"])
            for key in ("dataset_name", "dataset_config", "text_column"):
                if data.get(key) is None:
                    data[key] = getattr(preset, key)
        if data.get("text_column") is None:
            data["text_column"] = "text"
        return data


class MixtureSourceParams(HFSourceParams):
    """One source of `data.mixture`: an `HFSourceParams` with its sampling weight."""

    weight: float = Field(1.0, gt=0, description="Relative share of documents drawn from this source.")


class StreamParams(Section):
    """How `pretrain` reads a stream (`data.streaming: true`): order, shuffling and the sample `prepare` keeps."""

    shuffle_buffer: int = Field(
        1000, ge=0, description="Documents in the seeded shuffle buffer (saved in every checkpoint); 0 = stream order."
    )
    sample_documents: int = Field(
        2000, gt=0, description="Documents prepare reads from the stream for the tokenizer and validation/test splits."
    )


class DedupParams(Section):
    """Document-level deduplication and decontamination of the pretraining text (:mod:`llmpipe.data.dedup`).

    `prepare` drops from the training split, keeping the first of each group in corpus order: documents whose
    normalised text was seen (`exact`), documents whose word shingles overlap a seen one's by about
    `threshold` Jaccard similarity or more (`near`, MinHash + LSH), and, with `decontaminate`, documents that
    match a validation or test document either way. Validation and test are left whole.
    """

    exact: bool = Field(
        True, description="Drop documents whose normalised text (NFKC, case-folded, whitespace collapsed) was seen."
    )
    near: bool = Field(True, description="Drop near duplicates: MinHash signatures of word shingles, LSH bands.")
    threshold: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="Jaccard similarity of shingle sets the LSH bands are tuned to cut at; a soft cut: at the "
        "defaults a pair at 0.8 is caught 40% of the time, at 0.9 93%.",
    )
    num_perm: int = Field(128, ge=2, description="MinHash permutations (signature length): sharper cut-off, slower.")
    shingle_size: int = Field(5, gt=0, description="Words per shingle (word n-gram).")
    capacity: int = Field(
        1_000_000,
        gt=0,
        description="Documents the Bloom filters of seen documents are sized for (memory ≈ 31 bytes per document at "
        "the defaults, fixed); past it, false drops exceed false_positive_rate.",
    )
    false_positive_rate: float = Field(
        1e-4,
        gt=0,
        lt=1,
        description="Chance that a document unlike every seen one is dropped anyway (Bloom false positive), while at "
        "most capacity documents were kept.",
    )
    decontaminate: bool = Field(
        True, description="Drop training documents that duplicate or near-duplicate a validation or test document."
    )
    seen_hashes_path: str | None = Field(
        None,
        description="File of the documents earlier runs kept: read first when it exists, written after; a later run "
        "drops them as duplicates. null = every run starts empty. Not a DVC dep or out.",
    )

    @property
    def enabled(self) -> bool:
        """Whether any document is compared at all."""
        return self.exact or self.near

    @model_validator(mode="after")
    def _decontaminate_needs_a_match(self) -> DedupParams:
        if self.decontaminate and not self.enabled:
            raise ValueError("data.dedup.decontaminate is true but data.dedup.exact and data.dedup.near are both "
                             "false: set one of them to true (it says how a reference is matched) or decontaminate "
                             "to false")
        return self


class DataParams(Section):
    """The `prepare` stage: which corpus, and how it is split into train/validation/test (by document)."""

    source: Literal["stdlib", "local", "hf", "mixture"] = Field("stdlib", description="Corpus to prepare.")
    streaming: bool = Field(
        False, description="pretrain reads data.hf or data.mixture on the fly instead of prepare's train split."
    )
    seed: int = Field(1234, description="Seed of the split and of the corruptions; same seed → same data.")
    validation_fraction: float = Field(0.05, gt=0, lt=0.5, description="Fraction of modules held out for validation.")
    test_fraction: float = Field(0.05, gt=0, lt=0.5, description="Fraction of modules held out for evaluation.")
    num_eval_examples: int = Field(400, gt=0, description="Max examples per evaluation set.")
    max_chars_per_document: int = Field(
        200_000, gt=0, description="Longer documents are cut (keeps one huge module from dominating)."
    )
    eval_max_chars_per_document: int = Field(
        4000, gt=0, description="Perplexity-eval documents are cut to this many characters (keeps evaluation fast)."
    )
    stdlib: StdlibSourceParams = StdlibSourceParams()
    local: LocalSourceParams = LocalSourceParams()
    hf: HFSourceParams = HFSourceParams()
    hf_sft: HFSFTParams = HFSFTParams()
    hf_preference: HFPreferenceParams = HFPreferenceParams()
    mixture: list[MixtureSourceParams] = Field([], description="Sources interleaved by weight (source: mixture).")
    validation_source: HFSourceParams | None = Field(
        None,
        description="Pretraining validation documents from this source (e.g. a dataset's validation split) instead "
        "of the hash split, whose validation share then goes to train.",
    )
    stream: StreamParams = StreamParams()
    dedup: DedupParams = DedupParams()

    @model_validator(mode="after")
    def _source_configured(self) -> DataParams:
        if self.stdlib.min_body_lines > self.stdlib.max_body_lines:
            raise ValueError(
                f"data.stdlib.min_body_lines ({self.stdlib.min_body_lines}) exceeds data.stdlib.max_body_lines "
                f"({self.stdlib.max_body_lines})"
            )
        if self.source == "local" and self.local.pretrain is None:
            raise ValueError("data.source is 'local' but data.local.pretrain is not set: give a file or folder path")
        if self.source == "hf" and self.hf.dataset_name is None:
            raise ValueError(
                "data.source is 'hf' but neither data.hf.dataset_name nor data.hf.preset is set: give a dataset name, "
                "a local folder or a preset"
            )
        if self.source == "mixture":
            if not self.mixture:
                raise ValueError("data.source is 'mixture' but data.mixture is empty: list sources with weights")
            if not self.streaming:
                raise ValueError("data.source 'mixture' is read as a stream: set data.streaming: true")
            for i, source in enumerate(self.mixture):
                if source.dataset_name is None:
                    raise ValueError(f"data.mixture[{i}]: give dataset_name or preset")
        capped = [k for k, src in [("data.hf", self.hf), *((f"data.mixture[{i}]", m) for i, m in enumerate(self.mixture))]
                  if src.max_documents is not None]
        if self.streaming and capped:
            raise ValueError(
                f"{capped[0]}.max_documents is set but data.streaming is true: a stream's length is pretrain.max_steps "
                "(prepare's sample is data.stream.sample_documents); set it to null"
            )
        if self.streaming and self.source not in ("hf", "mixture"):
            raise ValueError(
                f"data.streaming is true but data.source is {self.source!r}: streaming reads data.hf or data.mixture "
                "(a local file or folder works as data.hf.dataset_name)"
            )
        for kind, hub in (("sft", self.hf_sft), ("preference", self.hf_preference)):
            if getattr(self.local, kind) is not None and hub.dataset_name is not None:
                raise ValueError(f"data.local.{kind} and data.hf_{kind}.dataset_name are both set: give one (set the "
                                 "other to null)")
        return self


class TokenizerParams(Section):
    """The `tokenizer` stage: train a byte-level BPE, or load an existing tokenizer."""

    kind: Literal["train", "pretrained"] = Field("train", description="Train a BPE, or load `name_or_path`.")
    name_or_path: str | None = Field(None, description="Hub name or local folder when kind is 'pretrained'.")
    vocab_size: int = Field(4096, ge=260, description="BPE vocabulary size in tokens (256 bytes + specials + merges).")
    min_frequency: int = Field(2, ge=1, description="Minimum pair count for a BPE merge.")
    model_max_length: int = Field(512, gt=0, description="Longest sequence in tokens the tokenizer reports.")

    @model_validator(mode="after")
    def _pretrained_named(self) -> TokenizerParams:
        if self.kind == "pretrained" and not self.name_or_path:
            raise ValueError("tokenizer.kind is 'pretrained' but tokenizer.name_or_path is not set")
        return self


class ModelParams(Section):
    """Architecture of the model `pretrain` builds (transformers `LlamaConfig` names)."""

    arch: Literal["llama"] = Field("llama", description="Model family.")
    hidden_size: int = Field(256, gt=0, description="Width of the residual stream.")
    num_hidden_layers: int = Field(4, gt=0, description="Number of decoder layers.")
    num_attention_heads: int = Field(8, gt=0, description="Query heads.")
    num_key_value_heads: int = Field(4, gt=0, description="Key/value heads (GQA when fewer than query heads).")
    intermediate_size: int = Field(688, gt=0, description="SwiGLU hidden width.")
    max_position_embeddings: int = Field(512, gt=0, description="Longest sequence in tokens (RoPE).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    rms_norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon.")
    initializer_range: float = Field(0.02, gt=0, description="Std of the normal weight init.")
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head.")
    init_seed: int = Field(0, description="Seed of the random weight init (pretrain and the baseline start from it).")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelParams:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must divide model.hidden_size "
                f"({self.hidden_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.num_key_value_heads ({self.num_key_value_heads}) must divide model.num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class TrainParams(Section):
    """Training defaults every training stage inherits (HF `TrainingArguments` names, except `lr`)."""

    lr: float = Field(1e-3, gt=0, description="Peak learning rate (TrainingArguments.learning_rate).")
    per_device_train_batch_size: int = Field(16, gt=0, description="Sequences per device per micro-step.")
    per_device_eval_batch_size: int = Field(16, gt=0, description="Sequences per device at evaluation.")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-steps per optimizer step.")
    max_steps: int = Field(-1, ge=-1, description="Optimizer steps; -1 = run num_train_epochs.")
    num_train_epochs: float = Field(1.0, gt=0, description="Epochs when max_steps is -1.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr"] = Field(
        "cosine", description="Schedule after warmup."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables.")
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd", "adafactor"] = Field("adamw_torch", description="Optimizer.")
    seed: int = Field(42, description="Seed of model init, data order and dropout.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Mixed precision; auto = bf16 where the device supports it, else fp32."
    )
    max_length: int = Field(256, gt=0, description="Sequence length in tokens (pretrain block size; SFT/DPO cap).")
    logging_steps: int = Field(10, gt=0, description="Optimizer steps between log lines.")
    eval_steps: int = Field(100, gt=0, description="Optimizer steps between validation passes.")
    save_steps: int = Field(100, gt=0, description="Optimizer steps between checkpoints.")
    save_total_limit: int = Field(2, gt=0, description="Checkpoints kept per run.")
    max_eval_samples: int = Field(256, gt=0, description="Validation examples used at each evaluation.")
    num_samples: int | None = Field(None, gt=0, description="Train on at most this many examples (None = all).")
    dataloader_num_workers: int = Field(0, ge=0, description="DataLoader worker processes.")

    @property
    def resolved_max_steps(self) -> int:
        """The optimizer-step budget handed to the trainer: `max_steps` (-1 = run `num_train_epochs`)."""
        return self.max_steps


class PretrainParams(TrainParams):
    """`pretrain`: causal-LM training on packed blocks of `max_length` tokens (documents joined by eos)."""

    steps_per_epoch: int | None = Field(
        None,
        gt=0,
        description="Optimizer steps in one epoch of a stream (data.streaming), which has no length: with max_steps "
        "-1 the run takes steps_per_epoch × num_train_epochs steps.",
    )

    @property
    def resolved_max_steps(self) -> int:
        """`max_steps`, or ``ceil(steps_per_epoch × num_train_epochs)`` when it is -1 and `steps_per_epoch` is set."""
        if self.max_steps > 0 or self.steps_per_epoch is None:
            return self.max_steps
        return math.ceil(self.steps_per_epoch * self.num_train_epochs)


class SFTParams(TrainParams):
    """`sft`: TRL SFTTrainer on chat `messages` from models/pretrain."""

    assistant_only_loss: bool = Field(True, description="Loss on assistant tokens only ({% generation %} mask).")
    packing: bool = Field(False, description="Pack several conversations into one sequence.")


class RewardParams(TrainParams):
    """`reward`: TRL RewardTrainer from models/sft on preference pairs → a scalar reward model.

    The pairwise (Bradley-Terry) loss ``-log σ(r(x, y_chosen) - r(x, y_rejected) - margin)`` of Ouyang et al.
    2022 (InstructGPT), on a new one-output score head over the SFT model's last token. Pairs longer than
    `max_length` tokens are left out of training (TRL filters them).
    """

    center_rewards_coefficient: float | None = Field(
        None,
        ge=0,
        description="Weight of the mean-zero penalty E[(r_chosen + r_rejected)^2] (Eisenstein et al. 2023); null: off.",
    )


DPOLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


class DPOParams(TrainParams):
    """`dpo`: TRL DPOTrainer from models/sft, the SFT model as frozen reference (Rafailov et al. 2023)."""

    beta: float = Field(0.1, gt=0, description="Strength of the KL regularisation towards the reference model.")
    loss_type: list[DPOLossType] = Field(
        ["sigmoid"], min_length=1, description="TRL DPO loss types; [sigmoid, sft] is DPO + NLL (RPO)."
    )
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type entry (None = all 1).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative-DPO label noise (sigmoid loss).")

    @model_validator(mode="after")
    def _weights_match(self) -> DPOParams:
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"dpo.loss_weights has {len(self.loss_weights)} entries but dpo.loss_type has "
                f"{len(self.loss_type)}: give one weight per loss type"
            )
        return self


class GenerationParams(Section):
    """Sampling of completions by the RL stages (ppo, grpo): `transformers.GenerationConfig` names."""

    max_new_tokens: int = Field(64, gt=0, description="Tokens generated per completion at most.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature of sampling.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0 = off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Drop tokens below min_p × the top probability.")
    repetition_penalty: float = Field(1.0, gt=0, description="CTRL repetition penalty (1 = off).")
    suppress_tokens: list[int] = Field([], description="Token ids never generated.")


RewardName = Literal["python_parses", "defines_function", "uses_arguments", "parsable_prefix"]
"""The keys of `llmpipe.rewards.REWARDS` (a test keeps the two equal). Spelled out here rather than imported,
so that validating params does not import the reward code and editing it reruns only the stages that use it."""


class RewardSpec(Section):
    """One named reward function of `llmpipe.rewards.REWARDS` and its weight in the summed reward."""

    name: RewardName = Field(description="A reward function of llmpipe.rewards.REWARDS.")
    weight: float = Field(1.0, description="Multiplier of this reward in the sum.")


class PPOParams(TrainParams):
    """`ppo`: PPO of models/<policy> against a reward model and/or reward functions (llmpipe.rl.ppo, on Accelerate).

    Batches (TRL's PPOTrainer semantics): a micro-batch is `per_device_train_batch_size` sequences and a
    mini-batch (one optimizer step) `gradient_accumulation_steps` micro-batches. Each PPO step samples one
    completion for each of `num_mini_batches` mini-batches of prompts (the rollout batch), then makes
    `num_ppo_epochs` passes over it, each pass `num_mini_batches` optimizer steps. `max_steps` (or
    `num_train_epochs` over the prompts), `warmup_steps`, `logging_steps`, `eval_steps` and `save_steps` count PPO
    steps; `max_length` caps prompt + completion in tokens (longer prompts are skipped); `num_samples` caps
    the training prompts; `max_eval_samples` validation prompts are scored every `eval_steps`.
    """

    policy: Literal["sft", "dpo"] = Field("sft", description="Policy and frozen reference start from models/<policy>.")
    num_ppo_epochs: int = Field(4, gt=0, description="Passes over each rollout batch.")
    num_mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass over a rollout batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per generated token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    cliprange_value: float = Field(0.2, gt=0, description="How far a value prediction may move per rollout.")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss.")
    kl_coef: float = Field(0.05, ge=0, description="Weight of the per-token KL-to-reference penalty in the reward.")
    kl_estimator: Literal["k1", "k3"] = Field("k1", description="Per-token KL estimator (Schulman 2020).")
    normalize_rewards: bool = Field(True, description="Standardise sequence scores before use.")
    normalize_method: Literal["running", "batch"] = Field(
        "running", description="Standardise with running (checkpointed) or per-batch mean/std."
    )
    whiten_rewards: bool = Field(False, description="Rescale per-token rewards to unit variance (mean kept).")
    whiten_advantages: bool = Field(True, description="Standardise advantages over each rollout batch.")
    reward_clip: float | None = Field(None, gt=0, description="Clip scores to ±reward_clip after normalising; null = off.")
    missing_eos_penalty: float = Field(0.0, ge=0, description="Subtracted from the score of completions without eos.")
    ptx_coef: float = Field(0.0, ge=0, description="Weight of an LM loss on data/tokens/train blocks (PPO-ptx); 0 = off.")
    reward_model: bool = Field(True, description="Score completions with models/reward (last token of prompt+completion).")
    rewards: list[RewardSpec] = Field([], description="Reward functions added to the score, by name and weight.")
    generation: GenerationParams = GenerationParams()

    @model_validator(mode="after")
    def _rewarded_and_fits(self) -> PPOParams:
        if not self.reward_model and not self.rewards:
            raise ValueError("ppo has no reward: set ppo.reward_model to true or list ppo.rewards")
        if self.generation.max_new_tokens >= self.max_length:
            raise ValueError(
                f"ppo.generation.max_new_tokens ({self.generation.max_new_tokens}) leaves no room for a prompt in "
                f"ppo.max_length ({self.max_length}); raise max_length or lower max_new_tokens"
            )
        return self


GRPOLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
"""The `GRPOConfig.loss_type` values TRL 1.16 accepts (a test builds a GRPOConfig with each)."""


class GRPOParams(TrainParams):
    """`grpo`: TRL GRPOTrainer from models/sft (or models/dpo) against the verifiable rewards of `llmpipe.rewards`.

    Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath): `num_generations` completions per
    prompt, each one's advantage its reward minus the group mean (divided by a std, see `scale_rewards`), a
    clipped PPO-style ratio objective, and a `beta`-weighted KL to the frozen starting policy. The loss
    types differ in how token terms are weighted and normalised:

    - ``grpo``: per-sequence mean, then batch mean (Shao et al. 2024); biased towards short right answers.
    - ``dr_grpo``: sum over tokens / a constant (max completion length) — "Understanding R1-Zero-Like
      Training: A Critical Perspective" (Liu et al. 2025).
    - ``dapo``: sum over tokens / active tokens of the accumulated batch — "DAPO: An Open-Source LLM
      Reinforcement Learning System at Scale" (Yu et al. 2025); TRL's default.
    - ``bnpo``: as dapo over the local batch only — "BNPO: Beta Normalization Policy Optimization" (2025).
    - ``cispo``: clips the importance weight itself (upper bound `epsilon_high`) and keeps every token's
      gradient — MiniMax-M1 (MiniMax 2025).
    - ``sapo``: a smooth sigmoid gate instead of hard clipping, temperatures `sapo_temperature_pos/neg` —
      "Soft Adaptive Policy Optimization" (arXiv 2511.20347).
    - ``luspo``: sequence-level loss scaled by each sequence's length; needs
      ``importance_sampling_level: sequence`` — "Length-Unbiased Sequence Policy Optimization" (arXiv 2602.05261).
    - ``vespo``: a Gamma-shaped weight of the sequence importance ratio (`vespo_k_*`, `vespo_lambda_*`) —
      "VESPO: Variational Sequence-Level Soft Policy Optimization" (arXiv 2602.10693).

    Sequence-level importance sampling is GSPO ("Group Sequence Policy Optimization", Zheng et al. 2025).
    Prompts longer than `max_length` tokens (chat-rendered) are left out.
    """

    policy: Literal["sft", "dpo"] = Field("sft", description="Starting (and reference) policy: models/<policy>.")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group size G).")
    loss_type: GRPOLossType = Field("dapo", description="How token losses are weighted and normalised (see above).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or one per sequence (GSPO)."
    )
    beta: float = Field(0.04, ge=0, description="Weight of the KL to the reference policy; 0 loads no reference.")
    epsilon: float = Field(0.2, gt=0, description="Lower clipping range of the importance ratio (1 - epsilon).")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clipping range (1 + epsilon_high; cispo: the weight cap); null = epsilon."
    )
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for non-positive advantages.")
    vespo_k_pos: float = Field(2.0, gt=0, description="vespo: power exponent for positive advantages.")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="vespo: decay factor for positive advantages.")
    vespo_k_neg: float = Field(3.0, gt=0, description="vespo: power exponent for negative advantages.")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo: decay factor for negative advantages.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."
    )
    num_iterations: int = Field(1, ge=1, description="Optimisation passes over each generated batch (mu).")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Micro-steps fed by one generation round; null = gradient_accumulation_steps."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions cut at max_new_tokens out of the loss (DAPO)."
    )
    rewards: list[RewardSpec] = Field(
        [
            RewardSpec(name="parsable_prefix", weight=1.0),
            RewardSpec(name="defines_function", weight=2.0),
            RewardSpec(name="uses_arguments", weight=0.5),
        ],
        min_length=1,
        description="Reward functions of llmpipe.rewards and their weights; the reward is the weighted sum.",
    )
    generation: GenerationParams = GenerationParams()

    @property
    def resolved_steps_per_generation(self) -> int:
        """`steps_per_generation`, or TRL's default for it: `gradient_accumulation_steps`."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @model_validator(mode="after")
    def _checkpoints_between_generations(self) -> GRPOParams:
        steps_per_generation = self.resolved_steps_per_generation
        cycle = steps_per_generation * self.num_iterations
        if (self.save_steps * self.gradient_accumulation_steps) % cycle:
            raise ValueError(
                f"grpo.save_steps ({self.save_steps}) × grpo.gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) micro-steps must be a multiple of grpo.steps_per_generation "
                f"({steps_per_generation}) × grpo.num_iterations ({self.num_iterations}) = {cycle}: GRPOTrainer "
                "does not checkpoint its buffer of generated completions, so a checkpoint must fall between "
                "generation rounds; change grpo.save_steps"
            )
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError(
                "grpo.loss_type luspo is a sequence-level loss: set grpo.importance_sampling_level to sequence"
            )
        return self


class ProfileParams(Section):
    """`torch.profiler` over a few optimizer steps of every training stage (llmpipe.profiling).

    Schedule: skip `wait` steps, trace `warmup` steps and discard them, record `active` steps; then
    ``logs/<stage>/profile/`` gets ``trace.json`` (Chrome trace) and ``ops.txt`` (top operators by self time).
    A profiled run is a run of its own (its checkpoint fingerprint differs), so it trains from step 0.
    """

    enabled: bool = Field(False, description="Profile the training stages.")
    wait: int = Field(1, ge=0, description="Optimizer steps skipped before tracing.")
    warmup: int = Field(1, ge=0, description="Optimizer steps traced and discarded (profiler start-up).")
    active: int = Field(3, gt=0, description="Optimizer steps recorded.")


class RegressionParams(Section):
    """`regression`: a hand-run hardware smoke test (not a DVC stage): a small MLP fitted to y = Xw + noise with
    plain Accelerate, in one process or under `accelerate launch`.

    Every rank draws the same data from `seed`; the batches are split across ranks (DDP).
    """

    num_samples: int = Field(4096, gt=0, description="Rows of X.")
    num_features: int = Field(16, gt=0, description="Columns of X.")
    hidden_size: int = Field(64, gt=0, description="Width of the MLP's hidden layer.")
    noise_std: float = Field(0.5, gt=0, description="Std of the Gaussian noise on y; the loss floor is its square.")
    max_steps: int = Field(300, gt=0, description="Optimizer steps.")
    lr: float = Field(0.01, gt=0, description="Adam learning rate.")
    per_device_batch_size: int = Field(64, gt=0, description="Rows per device per step.")
    seed: int = Field(0, description="Seed of the data, the weights and the batch order.")


EVAL_TASKS = (
    "llmpipe_perplexity",
    "llmpipe_signature_mc",
    "llmpipe_sft_chat",
    "llmpipe_sft_plain",
    "llmpipe_preference",
    "llmpipe_generation",
)


class EvalParams(Section):
    """`evaluate`: lm-evaluation-harness on each model in `models`, and the `report`."""

    models: list[str] = Field(
        ["baseline", "pretrain", "sft", "dpo"], min_length=1, description="Model dirs under paths.models to evaluate."
    )
    tasks: list[str] = Field(list(EVAL_TASKS), min_length=1, description="llmpipe tasks and/or standard lm-eval tasks.")
    limit: int | None = Field(200, gt=0, description="Documents per task (None = all).")
    batch_size: int = Field(16, gt=0, description="lm-eval batch size.")
    max_length: int = Field(512, gt=0, description="Context window in tokens for scoring.")
    max_new_tokens: int = Field(128, gt=0, description="Tokens the generation task may generate (greedy).")


_CRON_FIELD = re.compile(r"^[0-9A-Za-z*,/?-]+$")


class OrchestrationParams(Section):
    """The Prefect flow `full-pipeline` (flows/full_pipeline.py): retries of a failed stage, optional schedule.

    No DVC stage reads this section, so changing it reruns nothing.
    """

    retries: int = Field(2, ge=0, description="Retries of a failed stage (a training stage resumes its checkpoint).")
    retry_delay_s: float = Field(10.0, ge=0, description="Seconds between a stage failing and its retry.")
    cron: str | None = Field(
        None, description="Schedule of the served deployment as a 5-field cron string, e.g. '0 3 * * *'; null = none."
    )

    @model_validator(mode="after")
    def _cron_has_five_fields(self) -> OrchestrationParams:
        if self.cron is not None:
            fields = self.cron.split()
            if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
                raise ValueError(
                    f"orchestration.cron {self.cron!r} is not a 5-field cron string "
                    "(minute hour day-of-month month day-of-week, e.g. '0 3 * * *'); use null for no schedule"
                )
        return self


class Params(Section):
    """The whole of params.yaml."""

    paths: PathsParams = PathsParams()
    data: DataParams = DataParams()
    tokenizer: TokenizerParams = TokenizerParams()
    model: ModelParams = ModelParams()
    train: TrainParams = TrainParams()
    pretrain: PretrainParams = PretrainParams()
    sft: SFTParams = SFTParams()
    reward: RewardParams = RewardParams()
    dpo: DPOParams = DPOParams()
    ppo: PPOParams = PPOParams()
    grpo: GRPOParams = GRPOParams()
    distributed: DistributedParams = DistributedParams()
    profile: ProfileParams = ProfileParams()
    regression: RegressionParams = RegressionParams()
    eval: EvalParams = EvalParams()
    orchestration: OrchestrationParams = OrchestrationParams()

    @model_validator(mode="after")
    def _warmup_within_max_steps(self) -> Params:
        # Here rather than in TrainParams: a section does not know its own name, and the message must say which.
        for name in ("train", *STAGE_SECTIONS):
            t = self.stage(name)
            if t.max_steps > 0 and t.warmup_steps > t.max_steps:
                raise ValueError(
                    f"{name}.warmup_steps ({t.warmup_steps}) exceeds {name}.max_steps ({t.max_steps}), so the "
                    f"learning rate would never reach {name}.lr; lower {name}.warmup_steps or raise {name}.max_steps"
                )
        return self

    @model_validator(mode="after")
    def _stream_has_budget(self) -> Params:
        if self.data.streaming and self.pretrain.resolved_max_steps <= 0:
            raise ValueError(
                "data.streaming is true, and a stream has no length: set pretrain.max_steps, or "
                "pretrain.steps_per_epoch (with pretrain.num_train_epochs)"
            )
        return self

    @model_validator(mode="after")
    def _grpo_fits(self) -> Params:
        g, processes = self.grpo, self.distributed.world_size
        if processes is None:  # num_processes: auto; the launcher knows the world size, GRPOConfig checks it then
            return self
        generation_batch = g.per_device_train_batch_size * processes * g.resolved_steps_per_generation
        if generation_batch % g.num_generations:
            raise ValueError(
                f"grpo: one generation round holds grpo.per_device_train_batch_size ({g.per_device_train_batch_size})"
                f" × world size ({processes}) × grpo.steps_per_generation (default: "
                f"gradient_accumulation_steps) = {generation_batch} completions, not a multiple of grpo.num_generations ({g.num_generations}): "
                "every prompt's group must fit in one round"
            )
        if (g.per_device_eval_batch_size * processes) % g.num_generations:
            raise ValueError(
                f"grpo.per_device_eval_batch_size ({g.per_device_eval_batch_size}) × world size "
                f"({processes}) must be a multiple of grpo.num_generations ({g.num_generations})"
            )
        return self

    def stage(self, name: str) -> TrainParams:
        """The merged training params of stage `name` (one of :data:`STAGE_SECTIONS`, or ``train`` itself)."""
        return getattr(self, name)


def _suggest(key: str, model: type[BaseModel]) -> str:
    close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(model.model_fields)}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Params
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


def _format_errors(err: ValidationError, source: str, origin: dict[str, str]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc)
        if loc and loc[0] in origin and len(loc) > 1:
            key = f"{origin[loc[0]].get(loc[1], loc[0])}.{'.'.join(str(p) for p in loc[1:])}"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = _suggest(str(loc[-1]), parent) if parent else ""
            lines.append(f"  {key}: unknown key{hint}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            # a cross-field rule's input is its whole section (or file): its message names the values itself
            got = f" (got {e.get('input')!r})" if loc and not isinstance(e.get("input"), dict) else ""
            # a cross-field rule names its keys itself: no "model: model.num_key_value_heads …"
            named = not key or (isinstance(e.get("input"), dict) and msg.startswith((f"{key}.", f"{key} ")))
            lines.append(f"  {msg}" if named else f"  {key}: {msg}{got}")
    return f"{source}: invalid params:\n" + "\n".join(dict.fromkeys(lines))


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    """Validate a raw params mapping, merging `train` defaults under each training stage.

    Args:
        raw: The mapping read from params.yaml.
        source: File name used in error messages.

    Returns:
        The validated, frozen :class:`Params`.

    Raises:
        ParamsError: A key is unknown, a value has the wrong type or range, or a cross-field rule fails.
            The message names each key path (e.g. ``sft.lrr``) and suggests the fix.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: the top level must be a mapping of sections, got {type(raw).__name__}")
    merged = dict(raw)
    train = raw.get("train") or {}
    origin: dict[str, dict[str, str]] = {}
    if isinstance(train, dict):
        for name in STAGE_SECTIONS:
            own = raw.get(name) or {}
            if not isinstance(own, dict):
                continue
            merged[name] = {**train, **own}
            origin[name] = {k: ("train" if k not in own else name) for k in merged[name]}
    try:
        return Params.model_validate(merged)
    except ValidationError as err:
        raise ParamsError(_format_errors(err, source, origin)) from None


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw["a"]["b"] = value`` for ``key="a.b"``, creating mappings on the way."""
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ParamsError(f"cannot set {key}: {part} is not a section")
        node = child
    node[leaf] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (plain PyYAML keeps the last silently,
    so a second ``sft:`` section would replace the first whole)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {seen[key]}); keep one", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read and validate params.yaml, with optional dotted-key overrides applied before validation.

    Args:
        path: The params file.
        overrides: ``{"sft.lr": 1e-4, ...}``; validated exactly like values in the file.

    Raises:
        ParamsError: The file is missing, is not valid YAML (the message gives its line), or fails validation.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file; pass --config-path or run from the repository root") from None
    except IsADirectoryError:
        raise ParamsError(f"{path}: a folder, not a params file; pass --config-path PATH/params.yaml") from None
    try:
        text = "\n".join(decode_line(raw, path, n) for n, raw in enumerate(data.split(b"\n"), 1))
    except ValueError as err:  # names the line, byte and column
        raise ParamsError(str(err)) from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        if context is not None and getattr(err, "context", None) and (mark is None or context.line != mark.line):
            # an unclosed bracket or quote is noticed lines later; say where it opened
            problem += f" ({err.context} at line {context.line + 1}, column {context.column + 1})"
        raise ParamsError(f"{path}:{where}: YAML syntax error: {problem}") from None
    if isinstance(raw, dict):
        for key, value in (overrides or {}).items():
            set_dotted(raw, key, value)
    return parse_params(raw, str(path))
