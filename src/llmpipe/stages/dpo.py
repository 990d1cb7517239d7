"""`dpo` stage: Direct Preference Optimization (Rafailov et al. 2023) of models/sft on preference pairs
with TRL's `DPOTrainer`; the SFT model is the frozen reference.

TRL drops pairs whose prompt fills ``dpo.max_length`` and cuts the rest to it, so a rejected body that
differs from the chosen one only after the cut becomes the same sequence: no preference left, no gradient.
The stage counts both kinds per split, reports them in its metrics, and refuses to train when they are too
many (`llmpipe.train.guards.preference_signal`).
"""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.stages.base import TrainerStage
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest
from llmpipe.train.guards import trainer_preference_signal

COLUMNS = ("prompt", "chosen", "rejected")


def dpo_config(params: Params, run_dir: Path):
    """Our params → `trl.DPOConfig`, field by field."""
    from trl import DPOConfig

    cfg = params.dpo
    return DPOConfig(
        **training_kwargs(params, "dpo", run_dir),
        beta=cfg.beta,
        loss_type=list(cfg.loss_type),
        loss_weights=cfg.loss_weights,
        label_smoothing=cfg.label_smoothing,
        max_length=cfg.max_length,
        dataset_num_proc=None,
    )


class DPO(TrainerStage):
    """models/sft → models/dpo on data/preference with TRL's `DPOTrainer`, models/sft as the frozen reference."""

    name = "dpo"

    def config(self, run_dir: Path):
        return dpo_config(self.params, run_dir)

    def datasets(self):
        train = load_split(self.data / "train.jsonl", COLUMNS, self.cfg.num_samples)
        valid = load_split(self.data / "validation.jsonl", COLUMNS, self.cfg.max_eval_samples)
        return train, valid

    def make_trainer(self, model, args, train, valid, callbacks: list):
        from trl import DPOTrainer

        return DPOTrainer(model=model, ref_model=self.load_model(), args=args, train_dataset=train,
                          eval_dataset=valid, processing_class=self.tokenizer, callbacks=callbacks)  # fmt: skip

    def check_trainer(self, trainer, num_train: int, num_valid: int) -> dict[str, float]:
        return trainer_preference_signal("dpo", trainer, num_train, num_valid, self.cfg.max_length, truncates=True)

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        final = [r for r in trainer.state.log_history if "eval_rewards/accuracies" in r]
        if not final:
            return {}
        return {"eval_reward_accuracy": round(float(final[-1]["eval_rewards/accuracies"]), 4),
                "eval_reward_margin": round(float(final[-1]["eval_rewards/margins"]), 4)}  # fmt: skip


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Preference-tune models/sft on data/preference; save models/dpo. Returns losses, reward accuracy, steps.

    Args:
        params: Validated params.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, ``eval_reward_accuracy`` and ``eval_reward_margin``,
        and per split (``_eval`` for validation) ``num_fully_truncated`` (pairs dropped: the prompt fills
        ``dpo.max_length``) and ``num_identical_pairs`` (chosen == rejected within ``dpo.max_length`` tokens).

    Raises:
        UserError: Missing or refused inputs; models/sft was trained with another tokenizer; more than half of the
            training pairs (or every validation pair) dropped or identical (names ``dpo.max_length``).
    """
    return DPO(params, trust_remote_code).run(resume)
