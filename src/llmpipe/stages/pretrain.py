"""`pretrain` stage: causal-LM training of a Llama model built from ``model:`` params — or continued pretraining of
``model.init_from`` — on packed token blocks. With ``pretrain.enabled: false`` it trains nothing and writes a pointer
to ``model.init_from`` (`llmpipe.models.source`), so sft starts from the given model without a copy of it.

The `tokenize` stage has tokenized the documents once, joined with eos, into ``<paths.data>/tokens/``; this
stage memory-maps those ids and cuts them into blocks of ``max_length`` tokens (GPT-2 style packing), so no
token is padding and a block is read from disk only when the data loader asks for it. With
``data.streaming`` the training text is read from its source and packed as it streams instead
(`llmpipe.train.stream`); validation blocks still come from the token file. Trainer: the Hugging Face
`Trainer` (as fast as a raw PyTorch loop on this model, benchmarks/pretrain_throughput.py, see docs/LOG.md; and it
brings checkpoint/resume of optimizer, scheduler, RNG and data position).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.data.tokens import PackedBlocks, token_blocks
from llmpipe.models import count_parameters, init_model, load_tokenizer
from llmpipe.models.source import write_pointer
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.callbacks import write_ledger
from llmpipe.train.checkpoints import ResumeRequest, open_run
from llmpipe.train.loop import train_stage, write_plots

log = logging.getLogger(__name__)


def make_trainer(params: Params, model, train: PackedBlocks, valid: PackedBlocks, run_dir: Path, callbacks=()):
    """The stage's Hugging Face `Trainer`: `training_kwargs` of ``pretrain`` on packed blocks.

    `run` and ``benchmarks/pretrain_throughput.py`` both build it here, so the benchmark times the stage's loop.

    Args:
        params: Validated params.
        model: The causal LM to train.
        train: Training blocks.
        valid: Validation blocks.
        run_dir: The run's checkpoint folder.
        callbacks: Extra `TrainerCallback`s.
    """
    from transformers import Trainer, TrainingArguments

    return Trainer(
        model=model,
        args=TrainingArguments(**training_kwargs(params, "pretrain", run_dir)),
        train_dataset=train,
        eval_dataset=valid,
        callbacks=list(callbacks),
    )


def samples(params: Params, tokenizer, valid: PackedBlocks):
    """The pretraining samples (`llmpipe.train.hooks.StageSamples`): ``pretrain.eval_prompts`` as text prefixes, or
    the first `llmpipe.train.samples.PREFIX_TOKENS` tokens of ``num_eval_prompts`` validation blocks; greedy."""
    from llmpipe.train.samples import PREFIX_TOKENS, SamplePrompts, generation_config, model_generate

    cfg = params.pretrain
    if cfg.eval_prompts is not None:
        ids = [tokenizer(p)["input_ids"] for p in cfg.eval_prompts]
    elif cfg.num_eval_prompts:
        ids = [b[:PREFIX_TOKENS].tolist() for b in valid.batch(range(min(cfg.num_eval_prompts, len(valid))))]
    else:  # num_eval_prompts 0: no samples (an empty index array would be float to numpy, and refused)
        ids = []
    prompts = SamplePrompts(tokenizer.batch_decode(ids, skip_special_tokens=True), ids, [""] * len(ids))
    return prompts, model_generate(tokenizer, generation_config(tokenizer, cfg.eval_max_new_tokens))


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them, with the model shape): the train token folder
    (unless the training text is streamed), the validation token folder, the tokenizer."""
    tokens = Path(params.paths.data, "tokens")
    train = [] if params.data.streaming else [tokens / "train"]
    return [*train, tokens / "validation", Path(params.paths.tokenizer)]


def skip(params: Params, tokenizer, trust_remote_code: bool = False) -> dict[str, float]:
    """``pretrain.enabled: false``: the pointer to ``model.init_from`` as models/pretrain, and the stage's other DVC
    outputs (logs) empty, as a run of no steps leaves them."""
    pointer = write_pointer(params.paths.out(params.paths.models, "pretrain"), params.model, tokenizer,
                            trust_remote_code)
    logs = params.paths.out(params.paths.logs, "pretrain")
    (logs / "tensorboard").mkdir(parents=True, exist_ok=True)
    (logs / "samples.jsonl").write_text("")
    write_plots([], logs)
    write_ledger([], logs)
    return {"steps": 0, "vocab_size": pointer["vocab_size"]}


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Pretrain from random init or ``model.init_from``; save models/pretrain. Returns losses, steps, tokens/s
    (see `train_stage`); with ``pretrain.enabled: false`` (:func:`skip`), 0 steps and the pointer's ``vocab_size``.

    Args:
        params: Validated params; reads ``paths``, ``model``, ``pretrain`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load a tokenizer folder that maps to Python code (``--trust-remote-code``).

    Raises:
        UserError: ``pretrain.max_length`` exceeds the model's context, or a token folder is missing, holds less
            than one block, or was made with another tokenizer than ``paths.tokenizer`` (`data.tokens.read_tokens`);
            ``model.init_from`` cannot be loaded or does not match the tokenizer (`llmpipe.models.init_model`).
    """
    from llmpipe.train.hooks import trainer_hooks  # imports transformers: not at stage-module import

    cfg = params.pretrain
    tokenizer_dir = Path(params.paths.tokenizer)
    tokenizer = load_tokenizer(tokenizer_dir, trust_remote_code)
    if not cfg.enabled:
        return skip(params, tokenizer, trust_remote_code)
    if params.model.scratch and cfg.max_length > params.model.max_position_embeddings:
        raise UserError(
            f"pretrain.max_length ({cfg.max_length}) exceeds model.max_position_embeddings "
            f"({params.model.max_position_embeddings}); lower one or raise the other"
        )
    tokens = Path(params.paths.data, "tokens")
    train = None  # a stream (data.streaming) is opened by stream_trainer below
    if not params.data.streaming:
        train = token_blocks(tokens / "train", tokenizer_dir, cfg.max_length, cfg.num_samples)
    valid = token_blocks(tokens / "validation", tokenizer_dir, cfg.max_length, cfg.max_eval_samples)
    from llmpipe.train.losses import token_loss  # torch: imported when the stage runs, not with the module

    loss = None if cfg.loss.is_default else token_loss(cfg.loss, tokenizer, "pretrain.loss")  # before any work
    model = init_model(params.model, tokenizer, trust_remote_code)
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and cfg.max_length > context:
        raise UserError(f"pretrain.max_length ({cfg.max_length}) exceeds the max_position_embeddings of "
                        f"model.init_from {params.model.init_from} ({context}); lower pretrain.max_length")
    run = open_run(params, "pretrain", inputs(params), resume)
    log.info("pretrain: %.2f M parameters", count_parameters(model) / 1e6)
    hooks = trainer_hooks(params, "pretrain", run.path, tokenizer, samples(params, tokenizer, valid))
    if train is not None:
        log.info("pretrain: %d train blocks, %d validation blocks of %d tokens", len(train), len(valid), cfg.max_length)
        trainer = make_trainer(params, model, train, valid, run.path, [hooks])
        trainer.compute_loss_func = loss
        return train_stage(trainer, params, "pretrain", run, tokenizer)
    from llmpipe.train import stream as stream_trainer

    with tempfile.TemporaryDirectory(prefix="llmpipe-stream-") as scratch:
        stream = stream_trainer.open_stream(params, tokenizer, run, scratch)
        trainer = stream_trainer.make_trainer(params, model, stream, valid, run.path, [hooks])
        trainer.compute_loss_func = loss
        metrics = train_stage(trainer, params, "pretrain", run, tokenizer)
        stream_trainer.save_seen(params, stream)
        return {**metrics, **stream_trainer.counts(stream)}
