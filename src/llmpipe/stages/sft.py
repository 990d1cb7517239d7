"""`sft` stage: supervised fine-tuning of models/pretrain on chat `messages` with TRL's `SFTTrainer`,
the loss on assistant tokens only (the chat template's `{% generation %}` mask)."""

from __future__ import annotations

from pathlib import Path

from llmpipe.checkpoints import ResumeRequest, open_run
from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.modeling import load_model, load_tokenizer
from llmpipe.training import tensorboard_callback, train_stage, training_kwargs


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
    """Fine-tune models/pretrain on data/sft; save models/sft. Returns losses, steps, tokens/s (see `train_stage`).

    Args:
        params: Validated params.
        resume: The command line's resume choices (`llmpipe.checkpoints.open_run`); None resumes the newest
            whole checkpoint of the same run.
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).
    """
    from trl import SFTTrainer

    cfg = params.sft
    data, base, _ = inputs(params)
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    model = load_model(base, "run the pretrain stage first (dvc repro pretrain)", trust_remote_code=trust_remote_code)
    run = open_run(params, "sft", inputs(params), resume)
    trainer = SFTTrainer(
        model=model,
        args=sft_config(params, run.path),
        train_dataset=load_split(data / "train.jsonl", ("messages",), cfg.num_samples),
        eval_dataset=load_split(data / "validation.jsonl", ("messages",), cfg.max_eval_samples),
        processing_class=tokenizer,
        callbacks=[tensorboard_callback(params.paths.out(params.paths.logs, "sft", "tensorboard"))],
    )
    return train_stage(trainer, params, "sft", run, tokenizer)
