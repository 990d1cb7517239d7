"""The Trainer side of streaming pretraining (`data.streaming: true`): the DataLoader over the stream, its cursor
in every checkpoint, and the resume from it (the stream itself is `llmpipe.data.stream`).

The HF Trainer resumes a map-style dataset by skipping batches in index space, but for an iterable dataset it
would replay the stream from its start; here ``ignore_data_skip`` is on and the stream is put back at its cursor
instead. The cursor for optimizer step s is the stream's state right after the s × batch × accumulation blocks
this rank trained on (the DataLoader may have produced more); it rides in the checkpoint's ``trainer_state.json``
(``stateful_callbacks["StreamCursor"]``, one entry per rank, gathered to rank 0, which writes the file), so a
checkpoint either has its cursor or is not whole.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback, TrainingArguments

from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.core.io import iter_jsonl
from llmpipe.data.stream import packing
from llmpipe.data.stream.filter import deduplicator
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import Run

log = logging.getLogger(__name__)

KEY = "StreamCursor"


def _rank_world() -> tuple[int, int]:
    """(global rank, world size) as the launcher set them (before any process group exists)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def open_stream(params: Params, tokenizer, run: Run, scratch: str) -> packing.PackedStream:
    """This rank's pretraining stream, put back at `run.resume`'s cursor when the run resumes.

    Raises:
        UserError: A source cannot be opened, or the checkpoint's cursor is missing or was saved against other
            sources.
    """
    rank, world = _rank_world()
    dedup = _deduplicator(params, run, rank)
    stream = packing.build(params.data, tokenizer, params.pretrain.max_length, rank, world, scratch, dedup)
    if run.resume is not None:
        state = json.loads((run.resume / "trainer_state.json").read_text())
        cursors = (state.get("stateful_callbacks") or {}).get(KEY)
        if not cursors or len(cursors["ranks"]) != world:
            raise UserError(f"{run.resume}: no stream cursor for {world} rank(s) in its trainer_state.json; "
                            "pass --restart")
        stream.resume(cursors["ranks"][rank], str(run.resume))
        log.info("pretrain: stream resumes after block %d of rank %d", stream.blocks, rank)
    return stream


def _deduplicator(params: Params, run: Run, rank: int):
    """The stream's deduplicator as the run started: prepare's held-out documents as references and what
    `seen_hashes_path` held then; None when dedup is off.

    The start state is kept in the run folder (``dedup-base-rank<r>.bin``): a run continued after it wrote
    `seen_hashes_path` itself (a raised step budget) must restart each pass from the same index, not from one
    holding its own documents.
    """
    from llmpipe.core.io import atomic_file
    from llmpipe.data.dedup import Deduplicator

    base = run.path / f"dedup-base-rank{rank}.bin"
    if params.data.dedup.enabled and run.resume is not None and base.exists():
        return Deduplicator.from_state(base.read_bytes(), params.data.dedup)
    held_out = (row["text"] for split in ("validation", "test")
                for row in iter_jsonl(Path(params.paths.data, "pretrain", f"{split}.jsonl")))
    dedup = deduplicator(params.data, held_out)
    if dedup is not None:
        with atomic_file(base, "wb") as fh:
            fh.write(dedup.state())
    return dedup


def save_seen(params: Params, stream: packing.PackedStream) -> None:
    """Write what the stream admitted to `data.dedup.seen_hashes_path` (rank 0's part in a multi-process run:
    each rank deduplicates the documents it reads), so a later run does not re-admit it."""
    path = params.data.dedup.seen_hashes_path
    if path is not None and stream.filters.dedup is not None and _rank_world()[0] == 0:
        stream.filters.dedup.save(path)


class _StreamTrainer(Trainer):
    """A Trainer whose training DataLoader reads the stream in this process, unsharded: each rank's stream is
    already its own part of the data (Accelerate's preparation would shard or dispatch it again)."""

    def get_train_dataloader(self):
        from torch.utils.data import DataLoader

        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size, num_workers=0)


class StreamCursor(TrainerCallback):
    """At each step that will save, put every rank's cursor into the trainer state the checkpoint writes."""

    def __init__(self, stream: packing.PackedStream, blocks_per_step: int) -> None:
        self._stream, self._blocks_per_step = stream, blocks_per_step

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_save:  # DefaultFlowCallback, which runs first, has decided
            return
        cursor = self._stream.cursor_at(state.global_step * self._blocks_per_step)
        rank, world = _rank_world()
        cursors: list[Any] = [cursor]
        if world > 1:
            import torch.distributed as dist

            cursors = [None] * world
            dist.all_gather_object(cursors, cursor)
        state.stateful_callbacks[KEY] = {"ranks": cursors}


def make_trainer(params: Params, model, stream: packing.PackedStream, valid, run_dir: Path, callbacks=()) -> Trainer:
    """The pretrain stage's Trainer over a stream: `training_kwargs` of ``pretrain`` with ``ignore_data_skip``
    (the stream resumes at its cursor, nothing is skipped by replay) and the cursor callback.

    Args:
        params: Validated params (``pretrain.resolved_max_steps`` > 0: a stream has no length).
        model: The causal LM to train.
        stream: This rank's stream (:func:`open_stream`).
        valid: Validation blocks (prepare's held-out documents, from the tokenize stage's token file).
        run_dir: The run's checkpoint folder.
        callbacks: Extra `TrainerCallback`s.
    """
    cfg = params.pretrain
    if cfg.dataloader_num_workers:
        log.warning("pretrain.dataloader_num_workers=%d ignored: the stream's cursor lives in the main process, "
                    "so it is read there (workers could not hand their position back exactly)",
                    cfg.dataloader_num_workers)  # fmt: skip
    kwargs = {**training_kwargs(params, "pretrain", run_dir), "ignore_data_skip": True}
    blocks_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return _StreamTrainer(
        model=model,
        args=TrainingArguments(**kwargs),
        train_dataset=stream,
        eval_dataset=valid,
        callbacks=[*callbacks, StreamCursor(stream, blocks_per_step)],
    )


def counts(stream: packing.PackedStream) -> dict[str, float]:
    """Rank 0's stream counts for metrics/pretrain.json, prefixed ``stream_`` (documents admitted, dropped by
    reason, tokens read)."""
    return {f"stream_{k}": v for k, v in stream.filters.counts.items()}
