"""Sections of the reinforcement-learning stages `ppo`, `grpo` and `rloo`: their `TrainParams` plus sampling
(`GenerationParams`) and the reward functions they are scored with (`RewardSpec`: built-in by name, or a user's
by import path)."""

from __future__ import annotations

import inspect
from typing import Annotated, Literal, get_args

from pydantic import Field, field_validator, model_validator

from llmpipe.config.optim import SCHEDULE_KEYS, SchedulerName
from llmpipe.config.section import Section
from llmpipe.config.training import (
    EvalSteps,
    LearningRate,
    LoggingSteps,
    MaxEvalSamples,
    MaxLength,
    MaxSteps,
    SaveSteps,
    TrainParams,
    WarmupSteps,
)
from llmpipe.core.imports import import_object

Temperature = Annotated[float, Field(gt=0, description="Softmax temperature of sampling.")]


class GenerationParams(Section):
    """Sampling of completions by the RL stages (ppo, grpo, rloo): `transformers.GenerationConfig` names."""

    max_new_tokens: int = Field(64, gt=0, description="Tokens generated per completion at most.")
    temperature: Temperature = 1.0
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0 = off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Drop tokens below min_p × the top probability.")
    repetition_penalty: float = Field(1.0, gt=0, description="CTRL repetition penalty (1 = off).")
    suppress_tokens: list[int] = Field([], description="Token ids never generated.")
    cache_implementation: Literal["dynamic", "static"] = Field(
        "dynamic", description="transformers' KV cache while sampling: dynamic grows per token, static is allocated "
        "once for prompt + max_new_tokens (no effect on the tokens)."
    )
    num_threads: int | None = Field(
        1, gt=0, description="torch intra-op threads while sampling (training keeps all); null = torch's default."
    )


RewardName = Literal["python_parses", "defines_function", "uses_arguments", "parsable_prefix", "tests_pass",
                     "tests_pass_all"]
"""The keys of `llmpipe.rl.rewards.REWARDS` and `TEST_REWARDS` (a test keeps them equal). Spelled out here rather than imported,
so that validating params does not import the reward code and editing it reruns only the stages that use it."""

REWARD_KWARGS = ("prompts", "completions", "completion_ids", "name", "tests", "trainer_state", "log_extra",
                 "log_metric")
"""The keyword arguments a reward function is called with: those TRL 1.16's `GRPOTrainer._calculate_rewards`
passes (``name`` and ``tests`` are the prompt dataset's columns), and the ones the ppo stage passes too."""


def check_reward_function(path: str) -> None:
    """Import a user's reward function and check that TRL's call can bind to it.

    Args:
        path: ``"module.path:function"``.

    Raises:
        ValueError: The import fails (`llmpipe.core.imports.import_object`), the object is not a plain function
            or callable, it is a coroutine function, or its signature cannot take :data:`REWARD_KWARGS` as keywords
            (TRL's reward functions are ``def f(prompts, completions, **kwargs) -> list[float]``).
    """
    fn = import_object(path)
    if not callable(fn):
        raise ValueError(f"{path!r} is a {type(fn).__name__}, not a function")  # noqa: TRY004 (pydantic wants ValueError)
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"{path!r} is an async function; make it a plain def (the ppo stage calls it directly)")
    try:
        inspect.signature(fn).bind(**dict.fromkeys(REWARD_KWARGS))
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"{path!r} cannot be called as a reward function ({err}): it is called with the keywords "
            f"{', '.join(REWARD_KWARGS)}; write it as def {path.rpartition(':')[2].rpartition('.')[2]}"
            "(prompts, completions, **kwargs) -> list[float]"
        ) from None


class RewardSpec(Section):
    """One reward function and its weight in the summed reward: a built-in of `llmpipe.rl.rewards.REWARDS` by
    name, or a user's function by import path (TRL's reward-function signature), checked when params load."""

    name: str = Field(
        description="A built-in reward (python_parses, defines_function, uses_arguments, parsable_prefix, tests_pass: "
        "the share of an executable task's hidden tests passed, tests_pass_all: 1 when all pass) or a "
        "user's function 'module.path:function' taking (prompts, completions, **kwargs) -> list[float]."
    )
    weight: float = Field(1.0, description="Multiplier of this reward in the sum.")

    @field_validator("name")
    @classmethod
    def _builtin_or_importable(cls, name: str) -> str:
        if name in get_args(RewardName):
            return name
        if ":" not in name:
            raise ValueError(
                f"{name!r} is neither a built-in reward ({', '.join(get_args(RewardName))}) nor an import path "
                "'module.path:function'"
            )
        check_reward_function(name)
        return name


class PPOParams(TrainParams):
    """`ppo`: PPO of models/<policy> against a reward model and/or reward functions (llmpipe.rl.ppo.losses, on Accelerate).

    Batches (TRL's PPOTrainer semantics): a micro-batch is `per_device_train_batch_size` sequences and a
    mini-batch (one optimizer step) `gradient_accumulation_steps` micro-batches. Each PPO step samples one
    completion for each of `num_mini_batches` mini-batches of prompts (the rollout batch), then makes
    `num_ppo_epochs` passes over it, each pass `num_mini_batches` optimizer steps. `max_steps` (or
    `num_train_epochs` over the prompts), `warmup_steps`, `logging_steps`, `eval_steps` and `save_steps` count PPO
    steps; `max_length` caps prompt + completion in tokens (longer prompts are skipped); `num_samples` caps
    the training prompts; `max_eval_samples` validation prompts are scored every `eval_steps`.
    """

    lr: LearningRate = 1.5e-4
    max_steps: MaxSteps = 36
    warmup_steps: WarmupSteps = 2
    logging_steps: LoggingSteps = 2
    eval_steps: EvalSteps = 12
    save_steps: SaveSteps = 12
    max_eval_samples: MaxEvalSamples = 32
    policy: Literal["sft", "dpo"] = Field("sft", description="Policy and frozen reference start from models/<policy>.")
    num_ppo_epochs: int = Field(2, gt=0, description="Passes over each rollout batch.")
    num_mini_batches: int = Field(1, gt=0, description="Optimizer steps per pass over a rollout batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount per generated token.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    cliprange_value: float = Field(0.2, gt=0, description="How far a value prediction may move per rollout.")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss.")
    kl_coef: float = Field(
        0.05, ge=0, description="Weight of the per-token KL-to-reference penalty in the reward (adaptive: its start)."
    )
    kl_ctrl: Literal["fixed", "adaptive"] = Field(
        "fixed", description="Keep kl_coef, or adapt it after every step toward kl_target (Ziegler et al. 2019)."
    )
    kl_target: float = Field(6.0, gt=0, description="adaptive: the KL to steer to, nats per response (TRL's target).")
    kl_horizon: float = Field(
        512.0, gt=0, description="adaptive: responses over which the coefficient closes its error (TRL's horizon)."
    )
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
    rewards: list[RewardSpec] = Field(
        [RewardSpec(name="parsable_prefix", weight=1.0)],
        description="Reward functions added to the score: built-in names or 'module:function' paths, with weights.",
    )
    value_lr: float | None = Field(
        None, gt=0, description="Peak learning rate of the value model (muon: its AdamW rate, muon_lr scaled alike); "
        "null = lr."
    )
    value_warmup_steps: int | None = Field(
        None, ge=0, description="Linear warmup of the value model's rate, in PPO steps; null = warmup_steps."
    )
    value_lr_scheduler_type: SchedulerName | None = Field(
        None, description="Schedule of the value model's rate after warmup; null = lr_scheduler_type."
    )
    generation: GenerationParams = GenerationParams()

    @model_validator(mode="after")
    def _controls_are_read(self) -> PPOParams:
        if self.kl_ctrl == "fixed":
            changed = [k for k in ("kl_target", "kl_horizon") if getattr(self, k) != type(self).model_fields[k].default]
            if changed:
                raise ValueError(f"ppo.{changed[0]} applies to ppo.kl_ctrl adaptive, not fixed: set ppo.kl_ctrl: "
                                 f"adaptive, or remove ppo.{changed[0]}")  # fmt: skip
        elif self.kl_coef == 0:
            raise ValueError("ppo.kl_ctrl adaptive multiplies ppo.kl_coef, which is 0 and would stay 0: set it > 0")
        if self.max_steps > 0 and (self.value_warmup_steps or 0) > self.max_steps:
            raise ValueError(f"ppo.value_warmup_steps ({self.value_warmup_steps}) exceeds ppo.max_steps "
                             f"({self.max_steps}); lower it")  # fmt: skip
        kind = self.value_lr_scheduler_type
        if kind not in (None, self.lr_scheduler_type) and any(kind in r for r in SCHEDULE_KEYS.values()):
            raise ValueError(
                f"ppo.value_lr_scheduler_type {kind} reads schedule keys (min_lr, num_cycles, decay_*) the value "
                f"model shares with the policy, whose ppo.lr_scheduler_type is {self.lr_scheduler_type}: use the "
                "same type for both, or one that reads none (linear, cosine, constant, constant_with_warmup)"
            )
        return self

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


class GRPOGenerationParams(GenerationParams):
    """The group stages' sampling (grpo, rloo): cooler than PPO's, so that its groups collapse less onto one body (see docs/LOG.md)."""

    temperature: Temperature = 0.7


GRPOLossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
"""The `GRPOConfig.loss_type` values TRL 1.16 accepts (a test builds a GRPOConfig with each)."""


class GroupParams(TrainParams):
    """What TRL's group-sampling trainers share, under the names `GRPOConfig` and `RLOOConfig` both give it:
    `num_generations` completions per prompt from models/<policy>, scored by the weighted reward functions, each
    one's advantage its reward against its group's, a clipped importance ratio over `num_iterations` passes, and a
    `beta`-weighted KL to the frozen starting policy. Each method's section subclasses it (`GRPOParams`,
    `RLOOParams`). Prompts longer than `max_length` tokens (chat-rendered) are left out."""

    lr: LearningRate = 1e-4
    max_steps: MaxSteps = 100
    warmup_steps: WarmupSteps = 5
    max_length: MaxLength = 192
    logging_steps: LoggingSteps = 1
    eval_steps: EvalSteps = 1000
    save_steps: SaveSteps = 50
    max_eval_samples: MaxEvalSamples = 16
    policy: Literal["sft", "dpo"] = Field("sft", description="Starting (and reference) policy: models/<policy>.")
    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group size G).")
    epsilon: float = Field(0.2, gt=0, description="Lower clipping range of the importance ratio (1 - epsilon).")
    epsilon_high: float | None = Field(
        None, gt=0, description="Upper clipping range (1 + epsilon_high; grpo's cispo: the weight cap); null = epsilon."
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
            RewardSpec(name="uses_arguments", weight=2.0),
        ],
        min_length=1,
        description="Built-in reward names or 'module:function' paths, and their weights; the reward is the weighted sum.",
    )
    sync_ref_model: bool = Field(
        False, description="Move the reference toward the policy every ref_model_sync_steps (TR-DPO; needs beta > 0)."
    )
    ref_model_mixup_alpha: float = Field(
        0.6, ge=0, le=1, description="sync: each reference weight becomes alpha × policy + (1 - alpha) × reference."
    )
    ref_model_sync_steps: int = Field(50, gt=0, description="sync: optimizer steps between reference updates.")
    generation: GRPOGenerationParams = GRPOGenerationParams()

    @property
    def resolved_steps_per_generation(self) -> int:
        """`steps_per_generation`, or TRL's default for it: `gradient_accumulation_steps`."""
        return self.steps_per_generation or self.gradient_accumulation_steps


class GRPOParams(GroupParams):
    """`grpo`: TRL GRPOTrainer from models/sft (or models/dpo) against the verifiable rewards of `llmpipe.rl.rewards`.

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
    """

    loss_type: GRPOLossType = Field("dapo", description="How token losses are weighted and normalised (see above).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or one per sequence (GSPO)."
    )
    beta: float = Field(0.2, ge=0, description="Weight of the KL to the reference policy; 0 loads no reference.")
    sapo_temperature_pos: float = Field(1.0, gt=0, description="sapo: gate temperature for positive advantages.")
    sapo_temperature_neg: float = Field(1.05, gt=0, description="sapo: gate temperature for non-positive advantages.")
    vespo_k_pos: float = Field(2.0, gt=0, description="vespo: power exponent for positive advantages.")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="vespo: decay factor for positive advantages.")
    vespo_k_neg: float = Field(3.0, gt=0, description="vespo: power exponent for negative advantages.")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="vespo: decay factor for negative advantages.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)."
    )


class RLOOParams(GroupParams):
    """`rloo`: TRL RLOOTrainer from models/sft (or models/dpo) on grpo's prompts and verifiable rewards.

    REINFORCE Leave-One-Out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs"): each completion's advantage is its reward minus the
    mean reward of the other `num_generations` - 1 completions of its prompt, and the KL to the reference is a
    `beta`-weighted penalty in the reward (per-token log ratios summed over the completion), not a loss term.
    """

    beta: float = Field(0.05, ge=0, description="Weight of the KL penalty subtracted from each completion's reward "
                        "(log ratios summed over its tokens); 0 loads no reference.")  # fmt: skip
    normalize_advantages: bool = Field(False, description="Standardise advantages over each generation batch.")
    reward_clip_range: tuple[float, float] | None = Field(
        None, description="Clip the summed reward to [min, max] before the baseline; null = off."
    )


# The rules of a grouped section take its name (`Params` calls them per registry stage with ``grouped``), so a
# stage whose section subclasses GroupParams is named in its own messages.
def check_rounds(name: str, g: GroupParams) -> None:
    """Refuse a checkpoint inside a generation round, and a sequence-level loss on token-level ratios.

    Raises:
        ValueError: ``<name>.save_steps`` does not fall between generation rounds (GRPOTrainer does not checkpoint
            its buffer of generated completions), or ``loss_type: luspo`` without sequence-level sampling.
    """
    steps_per_generation = g.resolved_steps_per_generation
    cycle = steps_per_generation * g.num_iterations
    if (g.save_steps * g.gradient_accumulation_steps) % cycle:
        raise ValueError(
            f"{name}.save_steps ({g.save_steps}) × {name}.gradient_accumulation_steps "
            f"({g.gradient_accumulation_steps}) micro-steps must be a multiple of {name}.steps_per_generation "
            f"({steps_per_generation}) × {name}.num_iterations ({g.num_iterations}) = {cycle}: GRPOTrainer "
            "does not checkpoint its buffer of generated completions, so a checkpoint must fall between "
            f"generation rounds; change {name}.save_steps"
        )
    if isinstance(g, GRPOParams) and g.loss_type == "luspo" and g.importance_sampling_level != "sequence":
        raise ValueError(
            f"{name}.loss_type luspo is a sequence-level loss: set {name}.importance_sampling_level to sequence"
        )


def check_groups_fit(name: str, g: GroupParams, processes: int) -> None:
    """Refuse batches a group of ``num_generations`` completions does not fit, over `processes` ranks.

    Raises:
        ValueError: One generation round, or one evaluation batch, is not a multiple of ``<name>.num_generations``.
    """
    generation_batch = g.per_device_train_batch_size * processes * g.resolved_steps_per_generation
    if generation_batch % g.num_generations:
        raise ValueError(
            f"{name}: one generation round holds {name}.per_device_train_batch_size "
            f"({g.per_device_train_batch_size}) × world size ({processes}) × {name}.steps_per_generation (default: "
            f"gradient_accumulation_steps) = {generation_batch} completions, not a multiple of "
            f"{name}.num_generations ({g.num_generations}): every prompt's group must fit in one round"
        )
    if (g.per_device_eval_batch_size * processes) % g.num_generations:
        raise ValueError(
            f"{name}.per_device_eval_batch_size ({g.per_device_eval_batch_size}) × world size "
            f"({processes}) must be a multiple of {name}.num_generations ({g.num_generations})"
        )


def check_reference_sync(name: str, g: GRPOParams) -> None:
    """Refuse a reference sync TRL's GRPOTrainer would refuse (beta 0: no reference; a peft adapter: the reference is
    the adapter-disabled policy, no model of its own to move) or silently ignore, before any work.

    Raises:
        ValueError: ``<name>.ref_model_*`` set without ``sync_ref_model``, or a sync with beta 0, an adapter, or
            sync steps past ``max_steps``.
    """
    if not g.sync_ref_model:
        changed = [k for k in ("ref_model_mixup_alpha", "ref_model_sync_steps")
                   if getattr(g, k) != type(g).model_fields[k].default]  # fmt: skip
        if changed:
            raise ValueError(f"{name}.{changed[0]} applies only with {name}.sync_ref_model: true; set it or remove "
                             f"{name}.{changed[0]}")  # fmt: skip
        return
    if g.beta == 0:
        raise ValueError(f"{name}.sync_ref_model needs a reference, and {name}.beta 0 loads none: set beta > 0")
    if g.peft.method not in ("none", "bitfit"):
        raise ValueError(
            f"{name}.sync_ref_model with {name}.peft.method {g.peft.method}: the reference is then the policy with "
            "its adapter disabled, so there is no reference model to move (TRL's GRPOTrainer refuses it too); use "
            "peft.method none or bitfit, or sync_ref_model: false"
        )
    if 0 < g.max_steps < g.ref_model_sync_steps:
        raise ValueError(f"{name}.ref_model_sync_steps ({g.ref_model_sync_steps}) exceeds {name}.max_steps "
                         f"({g.max_steps}), so the reference would never move; lower it")  # fmt: skip
