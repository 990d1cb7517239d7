"""`rloo` stage: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
Optimization for Learning from Human Feedback in LLMs") of models/sft (or models/dpo) with TRL's `RLOOTrainer`,
on grpo's prompts, reward functions, samples and metrics (:class:`llmpipe.stages.grpo.GRPO`).

Each completion's advantage is its reward minus the mean reward of the other completions of its prompt; the KL to
the reference is subtracted from the reward (``beta`` × the log ratios summed over the completion) rather than
added to the loss as GRPO's is.
"""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import Params
from llmpipe.stages.grpo import GRPO, group_kwargs
from llmpipe.train.checkpoints import ResumeRequest


def rloo_config(params: Params, run_dir: Path, name: str = "rloo"):
    """Our params → `trl.RLOOConfig`, field by field: :func:`~llmpipe.stages.grpo.group_kwargs` and RLOO's own."""
    from trl import RLOOConfig

    cfg = params.stage(name)
    return RLOOConfig(**group_kwargs(params, run_dir, name), normalize_advantages=cfg.normalize_advantages,
                      reward_clip_range=cfg.reward_clip_range)  # fmt: skip


class RLOO(GRPO):
    """models/<rloo.policy> → models/rloo on the SFT prompts with TRL's `RLOOTrainer` and llmpipe's rewards."""

    name = "rloo"

    def config(self, run_dir: Path):
        return rloo_config(self.params, run_dir, self.name)

    def trainer_class(self):
        from trl import RLOOTrainer

        return RLOOTrainer


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Train models/<rloo.policy> with RLOO on the SFT prompts; save models/rloo.

    Args:
        params: Validated params; reads ``paths``, ``rloo`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, those of :func:`llmpipe.stages.grpo.rl_metrics`
        (``kl_final``: the mean per-token log ratio to the reference over the last tenth, nats, the estimate RLOO
        penalises) and ``eval_reward``.

    Raises:
        UserError: The policy model, the tokenizer or an SFT split is missing, a folder is refused, or the policy
            was trained with another tokenizer.
    """
    return RLOO(params, trust_remote_code).run(resume)
