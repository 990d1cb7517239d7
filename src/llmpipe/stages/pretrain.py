"""`pretrain` stage: causal-LM training of a Llama model built from ``model:`` params on packed token blocks.

Documents are tokenized, joined with eos and cut into blocks of ``max_length`` tokens (GPT-2 style
packing), so no token is padding. Trainer: the Hugging Face `Trainer` (as fast as a raw loop here, see
STACK-FACTS, and it brings checkpoint/resume of optimizer, scheduler, RNG and data position).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from llmpipe.checkpoints import ResumeRequest, open_run
from llmpipe.config import Params
from llmpipe.errors import UserError
from llmpipe.io import read_jsonl
from llmpipe.modeling import build_model, count_parameters, load_tokenizer
from llmpipe.training import tensorboard_callback, train_stage, training_kwargs

log = logging.getLogger(__name__)


class PackedBlocks:
    """Fixed-length token blocks over a tokenized corpus: item i is tokens ``[i*T, (i+1)*T)``.

    Args:
        tokens: 1-D int64 tensor of all token ids, documents separated by eos, shape (N,).
        block_size: T, tokens per block.
        max_blocks: Keep only the first this many blocks (None = all).
    """

    def __init__(self, tokens, block_size: int, max_blocks: int | None = None) -> None:
        self.blocks = tokens[: len(tokens) // block_size * block_size].view(-1, block_size)[:max_blocks]  # (B, T)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict:
        block = self.blocks[i]  # (T,)
        return {"input_ids": block, "labels": block}


def pack_ids(texts: list[str], tokenizer):
    """Token ids of `texts` (no special tokens), each document followed by eos, as one int64 tensor (N,).

    The same ids as ``tokenizer(texts, add_special_tokens=False)``, but a fast tokenizer's backend
    (`tokenizers`) encodes the batch directly, without the per-document Python lists of every field that the
    tokenizer call builds, and numpy joins the documents: ~1.3x faster on the stdlib corpus (3.2 → 4.2 MB/s,
    benchmarks/tokenize_throughput.py).
    """
    import itertools

    import numpy as np
    import torch

    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The tokenizer call turns truncation and padding off and sets how special-token text is split; a
    # backend left in another state goes through the call.
    plain = backend is not None and backend.truncation is None and backend.padding is None
    if plain and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        docs = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        docs = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    ends = np.cumsum([len(d) for d in docs], dtype=np.int64)  # (D,) where each document's eos goes
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(ends[-1]) if len(ends) else 0)
    return torch.from_numpy(np.insert(flat, ends, tokenizer.eos_token_id))


def pack(path: Path, tokenizer, block_size: int, max_blocks: int | None = None) -> PackedBlocks:
    """Tokenize the ``text`` of every row of a jsonl file and pack it into blocks.

    Raises:
        UserError: The file is missing or yields fewer tokens than one block.
    """
    if not path.exists():
        raise UserError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
    flat = pack_ids([row["text"] for row in read_jsonl(path)], tokenizer)
    blocks = PackedBlocks(flat, block_size, max_blocks)
    if len(blocks) == 0:
        raise UserError(f"{path}: {len(flat)} tokens, fewer than one block of max_length={block_size}")
    return blocks


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


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them, with the model shape): the text, the tokenizer."""
    return [Path(params.paths.data, "pretrain"), Path(params.paths.tokenizer)]


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Pretrain from random init; save models/pretrain. Returns losses, steps, tokens/s (see `train_stage`).

    Args:
        params: Validated params; reads ``paths``, ``model``, ``pretrain`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.checkpoints.open_run`).
        trust_remote_code: Load a tokenizer folder that maps to Python code (``--trust-remote-code``).
    """
    cfg = params.pretrain
    data, _ = inputs(params)
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    if cfg.max_length > params.model.max_position_embeddings:
        raise UserError(
            f"pretrain.max_length ({cfg.max_length}) exceeds model.max_position_embeddings "
            f"({params.model.max_position_embeddings}); lower one or raise the other"
        )
    valid = pack(data / "validation.jsonl", tokenizer, cfg.max_length, cfg.max_eval_samples)
    run = open_run(params, "pretrain", inputs(params), resume)
    model = build_model(params.model, tokenizer)
    log.info("pretrain: %.2f M parameters", count_parameters(model) / 1e6)
    tensorboard = tensorboard_callback(params.paths.out(params.paths.logs, "pretrain", "tensorboard"))
    if not params.data.streaming:
        train = pack(data / "train.jsonl", tokenizer, cfg.max_length, cfg.num_samples)
        log.info("pretrain: %d train blocks, %d validation blocks of %d tokens", len(train), len(valid), cfg.max_length)
        trainer = make_trainer(params, model, train, valid, run.path, [tensorboard])
        return train_stage(trainer, params, "pretrain", run, tokenizer)
    from llmpipe import stream_trainer

    with tempfile.TemporaryDirectory(prefix="llmpipe-stream-") as scratch:
        stream = stream_trainer.open_stream(params, tokenizer, run, scratch)
        trainer = stream_trainer.make_trainer(params, model, stream, valid, run.path, [tensorboard])
        return {**train_stage(trainer, params, "pretrain", run, tokenizer), **stream_trainer.counts(stream)}
