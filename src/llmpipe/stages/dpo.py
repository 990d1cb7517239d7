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
from llmpipe.models import check_same_tokenizer, load_model, load_tokenizer
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest, open_run
from llmpipe.train.guards import preference_signal
from llmpipe.train.loop import tensorboard_callback, train_stage

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


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them): the preference data, models/sft, the tokenizer."""
    return [Path(params.paths.data, "preference"), Path(params.paths.models, "sft"), Path(params.paths.tokenizer)]


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
    from trl import DPOTrainer

    cfg = params.dpo
    data, base, _ = inputs(params)
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    missing = "run the sft stage first (dvc repro sft)"
    model = load_model(base, missing, trust_remote_code=trust_remote_code)  # before hashing base: names the fix
    check_same_tokenizer(base, tokenizer, params.paths.tokenizer)
    run = open_run(params, "dpo", inputs(params), resume)
    train = load_split(data / "train.jsonl", COLUMNS, cfg.num_samples)
    valid = load_split(data / "validation.jsonl", COLUMNS, cfg.max_eval_samples)
    trainer = DPOTrainer(
        model=model,
        ref_model=load_model(base, missing, trust_remote_code=trust_remote_code),
        args=dpo_config(params, run.path),
        train_dataset=train,
        eval_dataset=valid,
        processing_class=tokenizer,
        callbacks=[tensorboard_callback(params.paths.out(params.paths.logs, "dpo", "tensorboard"))],
    )
    counts = preference_signal("dpo", "train", len(train), trainer.train_dataset, cfg.max_length, truncates=True)
    counts |= preference_signal("dpo", "eval", len(valid), trainer.eval_dataset, cfg.max_length, truncates=True)
    metrics = train_stage(trainer, params, "dpo", run, tokenizer)
    metrics.update(counts)
    final = [r for r in trainer.state.log_history if "eval_rewards/accuracies" in r]
    if final:
        metrics["eval_reward_accuracy"] = round(float(final[-1]["eval_rewards/accuracies"]), 4)
        metrics["eval_reward_margin"] = round(float(final[-1]["eval_rewards/margins"]), 4)
    return metrics
