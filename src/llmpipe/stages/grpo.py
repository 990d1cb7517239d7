"""`grpo` stage: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) of models/sft (or
models/dpo) with TRL's `GRPOTrainer`, against the verifiable rewards of :mod:`llmpipe.rl.rewards`.

The prompts are the user turns of the SFT data (a function's signature and docstring); a completion is the
body the policy writes. For each prompt `num_generations` completions are sampled, scored by the weighted
reward functions, and each one's advantage is its reward relative to its group. A group whose rewards are
all equal has zero advantage and gives no gradient, so the stage measures the share of such groups and
warns when it is large.
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.rl.progress import first_last_tenths
from llmpipe.rl.prompts import load_prompts
from llmpipe.rl.rewards import trl_reward_functions
from llmpipe.stages.base import TrainerStage
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest

log = logging.getLogger(__name__)

ZERO_STD_WARN_FRACTION = 0.5
"""Warn when at least this share of groups had all-equal rewards (and so no gradient)."""


def group_kwargs(params: Params, run_dir: Path, name: str) -> dict[str, Any]:
    """Our params → the keyword arguments `trl.GRPOConfig` and `trl.RLOOConfig` share, from section `name`
    (`generation.max_new_tokens` → `max_completion_length`, `generation.suppress_tokens` → `generation_kwargs`)."""
    cfg = params.stage(name)
    gen = cfg.generation
    return dict(
        **training_kwargs(params, name, run_dir),
        num_generations=cfg.num_generations,
        beta=cfg.beta,
        epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        num_iterations=cfg.num_iterations,
        steps_per_generation=cfg.steps_per_generation,
        mask_truncated_completions=cfg.mask_truncated_completions,
        sync_ref_model=cfg.sync_ref_model,
        ref_model_mixup_alpha=cfg.ref_model_mixup_alpha,
        ref_model_sync_steps=cfg.ref_model_sync_steps,
        reward_weights=[spec.weight for spec in cfg.rewards],
        max_completion_length=gen.max_new_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        min_p=gen.min_p,
        repetition_penalty=gen.repetition_penalty,
        generation_kwargs={"suppress_tokens": list(gen.suppress_tokens)} if gen.suppress_tokens else None,
        cache_implementation=gen.cache_implementation,
    )


def grpo_config(params: Params, run_dir: Path, name: str = "grpo"):
    """Our params → `trl.GRPOConfig`, field by field, from section `name`: :func:`group_kwargs` and GRPO's own."""
    from trl import GRPOConfig

    cfg = params.stage(name)
    return GRPOConfig(
        **group_kwargs(params, run_dir, name),
        loss_type=cfg.loss_type,
        importance_sampling_level=cfg.importance_sampling_level,
        sapo_temperature_pos=cfg.sapo_temperature_pos,
        sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos,
        vespo_lambda_pos=cfg.vespo_lambda_pos,
        vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg,
        scale_rewards=cfg.scale_rewards,
    )


def prompt_dataset(path: Path, tokenizer, max_length: int, limit: int | None = None, key: str = "grpo.max_length"):
    """GRPO prompts from SFT rows (:func:`llmpipe.rl.prompts.load_prompts`, the same selection as PPO's) as the
    conversational dataset TRL's GRPOTrainer takes.

    Args:
        path: ``data/sft/<split>.jsonl`` (rows with ``messages`` and ``name``).
        tokenizer: Renders the prompt with its chat template and generation prompt, to measure it.
        max_length: Prompts longer than this many tokens are left out.
        limit: Keep at most this many prompts (after the length filter).
        key: The params key of `max_length`, named when no prompt fits.

    Returns:
        A `datasets.Dataset` with columns ``prompt`` (the turns up to the first user turn), ``name`` and ``tests``
        (an executable task's hidden tests, ``[]`` for a stdlib function; TRL passes both to the reward functions).

    Raises:
        UserError: The file is missing or malformed, a row has no user turn, or no prompt fits `max_length`.
    """
    from datasets import Dataset

    prompts = load_prompts(path, tokenizer, max_length, limit, key)
    return Dataset.from_dict({"prompt": prompts.turns, "name": prompts.names, "tests": prompts.tests})


def rl_metrics(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """Learning-progress figures of a GRPO run from the trainer's logged training steps.

    Args:
        log_history: `trainer.state.log_history` (each training entry averages `logging_steps` steps).

    Returns:
        ``reward_first``/``reward_last`` (mean summed reward over the first/last 10% of logged steps) with
        ``reward_first_se``/``reward_last_se`` (their standard errors over those steps; the report's check
        divides the gain by them), ``response_length_first``/``_last`` (completion tokens; the same names as
        the ppo stage's), ``kl_final`` (mean per-token KL to the reference over the last 10%, nats; only when
        ``beta`` > 0), and
        ``frac_zero_std_groups``: the mean share of groups whose rewards were all equal (TRL's
        ``frac_reward_zero_std``; with ``scale_rewards: batch`` TRL measures the whole batch instead), and
        ``frac_clipped``: the mean share of completions cut at ``grpo.generation.max_new_tokens`` before their eos
        (TRL's ``completions/clipped_ratio``), and with a test reward ``frac_sandbox_timeouts`` and
        ``frac_sandbox_crashes`` (the mean share of programs killed at the sandbox's timeout, or that died). Empty
        when no training step was logged.
    """
    rows = [r for r in log_history if "reward" in r]
    if not rows:
        return {}
    first, first_se, last, last_se = first_last_tenths([r["reward"] for r in rows])
    lengths = first_last_tenths([r["completions/mean_length"] for r in rows])
    metrics = {
        "reward_first": first,
        "reward_first_se": first_se,
        "reward_last": last,
        "reward_last_se": last_se,
        "response_length_first": lengths.first,
        "response_length_last": lengths.last,
        "frac_zero_std_groups": statistics.fmean(r["frac_reward_zero_std"] for r in rows),
    }
    clipped = [r["completions/clipped_ratio"] for r in rows if r.get("completions/clipped_ratio") is not None]
    if clipped:
        metrics["frac_clipped"] = statistics.fmean(clipped)
    for status in ("timeouts", "crashes"):  # logged by the test rewards (llmpipe.rl.rewards.TEST_REWARDS)
        shares = [r[f"sandbox/{status}"] for r in rows if r.get(f"sandbox/{status}") is not None]
        if shares:
            metrics[f"frac_sandbox_{status}"] = statistics.fmean(shares)
    kls = [r["kl"] for r in rows if r.get("kl") is not None]
    if kls:
        metrics["kl_final"] = first_last_tenths(kls).last
    return {k: round(v, 5) for k, v in metrics.items() if math.isfinite(v)}  # DVC metrics must be numbers


def all_clipped(log_history: list[dict[str, float]], max_new_tokens: int) -> str | None:
    """The warning for a run in which every completion of every logged step was cut at `max_new_tokens` before
    its eos (TRL's ``completions/clipped_ratio`` 1.0 throughout), else None: the rewards then scored cut-off text
    only, and the policy never learned from an answer it finished."""
    ratios = [r["completions/clipped_ratio"] for r in log_history if "completions/clipped_ratio" in r]
    if not ratios or min(ratios) < 1.0:
        return None
    return (f"grpo: every completion of all {len(ratios)} logged steps was cut at grpo.generation.max_new_tokens "
            f"({max_new_tokens}) before its eos (completions/clipped_ratio 1.0): the rewards scored cut-off text only; "
            "raise grpo.generation.max_new_tokens, or start from a policy that ends its answers (sft)")


class GRPO(TrainerStage):
    """models/<grpo.policy> → models/grpo on the SFT prompts with TRL's `GRPOTrainer` and llmpipe's rewards."""

    name = "grpo"

    def config(self, run_dir: Path):
        return grpo_config(self.params, run_dir, self.name)

    def datasets(self):
        cfg, key = self.cfg, f"{self.name}.max_length"
        train = prompt_dataset(self.data / "train.jsonl", self.tokenizer, cfg.max_length, cfg.num_samples, key)
        valid = prompt_dataset(self.data / "validation.jsonl", self.tokenizer, cfg.max_length, cfg.max_eval_samples,
                               key)
        return train, valid

    def samples(self):
        """The default prompts, sampled with the section's ``generation`` and scored by its ``rewards``."""
        from llmpipe.rl.rewards import compute_rewards
        from llmpipe.train.samples import generation_config, model_generate, stage_prompts

        cfg = self.cfg

        def reward(prompts, completions: list[str]) -> list[float]:
            return compute_rewards(cfg.rewards, prompts.texts, completions, prompts.names).tolist()

        config = generation_config(self.tokenizer, cfg.eval_max_new_tokens, cfg.generation)
        prompts = stage_prompts(cfg, self.tokenizer, self.data / "validation.jsonl")
        return prompts, model_generate(self.tokenizer, config, reward)

    def trainer_class(self):
        """The TRL trainer (a stage on the same prompts and rewards, rloo: its own, which takes the same arguments)."""
        from trl import GRPOTrainer

        return GRPOTrainer

    @property
    def copies_reference(self) -> bool:
        return self.cfg.beta != 0  # TRL's GRPO loads no reference without a KL term

    def make_trainer(self, model, args, train, valid, callbacks: list):
        from llmpipe.rl.generation import limit_generation_threads

        reward_funcs, _ = trl_reward_functions(self.cfg.rewards)  # weights reach TRL through the config
        trainer = self.trainer_class()(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train,
                                       eval_dataset=valid, processing_class=self.tokenizer, callbacks=callbacks,
                                       peft_config=self.peft_config)  # fmt: skip
        limit_generation_threads(trainer, self.cfg.generation.num_threads)
        if self.cfg.sync_ref_model:
            from llmpipe.rl.reference import checkpoint_reference

            checkpoint_reference(trainer)  # TRL syncs it; its checkpoints would not hold it
        return trainer

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        """:func:`rl_metrics` and ``eval_reward``; warns when most groups gave no gradient, and when every
        completion was clipped (:func:`all_clipped`)."""
        if clipped := all_clipped(trainer.state.log_history, self.cfg.generation.max_new_tokens):
            log.warning(clipped)
        extra = rl_metrics(trainer.state.log_history)
        final = [r for r in trainer.state.log_history if "eval_reward" in r]
        if final:
            extra["eval_reward"] = round(float(final[-1]["eval_reward"]), 5)
        frac = extra.get("frac_zero_std_groups", 0.0)
        if frac >= ZERO_STD_WARN_FRACTION:
            log.warning(
                "%s: %.0f%% of groups had all-equal rewards, so zero advantage and no gradient from them; add a "
                "graded reward (e.g. parsable_prefix) to %s.rewards, or raise %s.num_generations or "
                "%s.generation.temperature",
                self.name, 100 * frac, self.name, self.name, self.name,
            )
        return extra


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Train models/<grpo.policy> with GRPO on the SFT prompts; save models/grpo.

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, those of :func:`rl_metrics`, and ``eval_reward``
        (mean reward on the validation prompts at the end).

    Args:
        params: Validated params; reads ``paths``, ``grpo`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Raises:
        UserError: The policy model, the tokenizer or an SFT split is missing, a folder is refused, or the policy
            was trained with another tokenizer.
    """
    return GRPO(params, trust_remote_code).run(resume)
