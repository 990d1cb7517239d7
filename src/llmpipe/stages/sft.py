"""`sft` stage: supervised fine-tuning of models/pretrain on chat `messages` with TRL's `SFTTrainer`,
the loss on assistant tokens only (the chat template's `{% generation %}` mask).

A sample whose prompt fills ``sft.max_length`` keeps no assistant token, so no label: TRL leaves it out (or,
with packing, packs it as dead weight) without a word. The stage counts them per split, reports the counts
in its metrics, and refuses to train when they are too many (`llmpipe.train.guards.check_no_signal`) or when a batch
has no label at all (`llmpipe.train.guards.MaskedBatchGuard`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.models import check_same_tokenizer, load_model, load_tokenizer
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest, open_run
from llmpipe.train.guards import MaskedBatchGuard, check_no_signal, count_fully_truncated
from llmpipe.train.loop import tensorboard_callback, train_stage

log = logging.getLogger(__name__)


def sft_config(params: Params, run_dir: Path):
    """Our params → `trl.SFTConfig`, field by field."""
    from trl import SFTConfig

    cfg = params.sft
    return SFTConfig(
        **training_kwargs(params, "sft", run_dir),
        max_length=cfg.max_length,
        assistant_only_loss=cfg.assistant_only_loss,
        packing=cfg.packing,
        dataset_num_proc=None,
    )


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them): the SFT data, models/pretrain, the tokenizer."""
    return [Path(params.paths.data, "sft"), Path(params.paths.models, "pretrain"), Path(params.paths.tokenizer)]


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Fine-tune models/pretrain on data/sft; save models/sft.

    Args:
        params: Validated params.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`); None resumes the newest
            whole checkpoint of the same run.
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, plus ``num_fully_truncated`` and
        ``num_fully_truncated_eval``: training / validation samples with no assistant token within
        ``sft.max_length`` tokens (left out of training by TRL).

    Raises:
        UserError: Missing or refused inputs; models/pretrain was trained with another tokenizer; more than half
            of the training samples (or every validation sample) are fully truncated, or a batch has no label
            (both name ``sft.max_length``).
    """
    from trl import SFTTrainer

    cfg = params.sft
    data, base, _ = inputs(params)
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    train = load_split(data / "train.jsonl", ("messages",), cfg.num_samples)
    valid = load_split(data / "validation.jsonl", ("messages",), cfg.max_eval_samples)
    counts = {}
    for key, split, training in (("num_fully_truncated", train, True), ("num_fully_truncated_eval", valid, False)):
        counts[key] = count_fully_truncated(split["messages"], tokenizer, cfg.max_length, cfg.assistant_only_loss)
        kind = "training" if training else "validation"
        what = f"sft: {kind} samples with no completion token within sft.max_length={cfg.max_length}"
        log.info("%s: %d of %d", what, counts[key], len(split))
        check_no_signal(counts[key], len(split), what, "raise sft.max_length", training)
    model = load_model(base, "run the pretrain stage first (dvc repro pretrain)", trust_remote_code=trust_remote_code)
    check_same_tokenizer(base, tokenizer, params.paths.tokenizer)
    run = open_run(params, "sft", inputs(params), resume)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(params, run.path),
        train_dataset=train,
        eval_dataset=valid,
        processing_class=tokenizer,
        callbacks=[tensorboard_callback(params.paths.out(params.paths.logs, "sft", "tensorboard"))],
    )
    trainer.data_collator = MaskedBatchGuard(trainer.data_collator, "sft.max_length")
    return {**train_stage(trainer, params, "sft", run, tokenizer), **counts}
