"""`sft` stage: supervised fine-tuning of models/pretrain on chat `messages` with TRL's `SFTTrainer`,
the loss on assistant tokens only (the chat template's `{% generation %}` mask)."""

from __future__ import annotations

from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.modeling import load_model, load_tokenizer
from llmpipe.training import checkpoint_dir, tensorboard_callback, train_stage, training_kwargs


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


def run(params: Params, trust_remote_code: bool = False) -> dict[str, float]:
    """Fine-tune models/pretrain on data/sft; save models/sft. Returns losses, steps, tokens/s.

    Args:
        params: Validated params; reads ``paths``, ``sft`` and ``distributed``.
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).
    """
    from trl import SFTTrainer

    cfg = params.sft
    data = Path(params.paths.data, "sft")
    base = Path(params.paths.models, "pretrain")
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    model = load_model(base, "run the pretrain stage first (dvc repro pretrain)", trust_remote_code=trust_remote_code)
    run_dir = checkpoint_dir(params, "sft", [data, base, Path(params.paths.tokenizer)])
    trainer = SFTTrainer(
        model=model,
        args=sft_config(params, run_dir),
        train_dataset=load_split(data / "train.jsonl", ("messages",), cfg.num_samples),
        eval_dataset=load_split(data / "validation.jsonl", ("messages",), cfg.max_eval_samples),
        processing_class=tokenizer,
        callbacks=[tensorboard_callback(params.paths.out(params.paths.logs, "sft", "tensorboard"))],
    )
    return train_stage(trainer, params, "sft", run_dir, tokenizer)
