"""Packing: the documents of a :class:`~llmpipe.data.stream.mixture.Mixture` tokenised and cut into blocks
(:class:`PackedStream`, what the trainer reads), with the cursor saved in every checkpoint, and :func:`build`, the
whole stream of one rank."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmpipe.config import DataParams
from llmpipe.core.errors import UserError
from llmpipe.data.stream.filter import StreamFilter
from llmpipe.data.stream.mixture import Mixture
from llmpipe.data.stream.source import DocumentStream, open_source, sources_of
from llmpipe.data.tokens import pack_ids

log = logging.getLogger(__name__)

CURSOR_VERSION = 1

DOC_BATCH = 64
"""Documents tokenised per `encode_batch` call when the token buffer runs short."""


@dataclass(frozen=True)
class _Snapshot:
    """Where the stream stood right after block `blocks` was cut: the documents' state at the last refill (the
    `refill`-th), the token chunk of that refill (never mutated) and the offset into it."""

    blocks: int
    refill: int
    documents: dict[str, Any]
    counts: dict[str, int]
    chunk: np.ndarray
    offset: int


class PackedStream(torch.utils.data.IterableDataset):
    """Blocks of `block_size` tokens packed from a document :class:`Mixture`, resumable at any block.

    Items are ``{"input_ids": (T,), "labels": (T,)}`` int64 tensors (T = `block_size`); labels equal inputs (the
    model shifts them). Iterate it from one process only (DataLoader ``num_workers=0``): the cursor lives here.

    Args:
        documents: The document source.
        tokenizer: The pipeline tokenizer (encoded as the tokenize stage encodes: `pack_ids`).
        block_size: T, tokens per block.
        filters: The admission filter of the documents (its counts and dedup state are part of the cursor).
        fingerprints: The sources' fingerprints (:func:`open_source`), stored in and checked against a cursor.
        history: Snapshots kept for :meth:`cursor_at` (blocks produced but maybe not yet trained on).
    """

    def __init__(self, documents: Mixture, tokenizer, block_size: int, filters: StreamFilter,
                 fingerprints: list[str], history: int = 4096) -> None:
        super().__init__()
        self.documents, self.tokenizer, self.block_size = documents, tokenizer, block_size
        self.filters, self.fingerprints = filters, fingerprints
        self.blocks = 0
        self._chunk, self._offset = np.zeros(0, dtype=np.int64), 0
        self._snapshots: deque[_Snapshot] = deque(maxlen=history)
        self._refills = 0
        self._refill_state = self._capture()

    def _capture(self) -> tuple[dict[str, Any], dict[str, int]]:
        # The dedup index is not copied here (tens of MB, every 64 documents): documents are only read at a
        # refill, so at a cursor taken before the next refill it is still as it was (`cursor_at`).
        return self.documents.state(), dict(self.filters.counts)

    def _refill(self) -> None:
        new = pack_ids([self.documents.next_document() for _ in range(DOC_BATCH)], self.tokenizer)
        self._chunk, self._offset = np.concatenate([self._chunk[self._offset :], new]), 0
        self.filters.counts["num_tokens"] += len(new)
        self._refills += 1
        self._refill_state = self._capture()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            while len(self._chunk) - self._offset < self.block_size:
                self._refill()
            block = torch.from_numpy(self._chunk[self._offset : self._offset + self.block_size].copy())  # (T,)
            self._offset += self.block_size
            self.blocks += 1
            docs, counts = self._refill_state
            self._snapshots.append(_Snapshot(self.blocks, self._refills, docs, counts, self._chunk, self._offset))
            yield {"input_ids": block, "labels": block}

    def cursor_at(self, blocks: int) -> dict[str, Any]:
        """The cursor right after the first `blocks` blocks (JSON-able): resuming from it yields block
        ``blocks + 1`` next, token for token.

        Raises:
            RuntimeError: No snapshot at `blocks` (more than `history` blocks were produced ahead of training), or,
                with a deduplicator, documents were read for blocks past `blocks` (the HF Trainer reads exactly a
                step's batches, so at a step's end nothing is read ahead).
        """
        if blocks == 0 and self.blocks == 0:
            docs, counts = self._refill_state
            snap = _Snapshot(0, self._refills, docs, counts, self._chunk, self._offset)
        else:
            snap = next((s for s in reversed(self._snapshots) if s.blocks == blocks), None)
            if snap is None:
                raise RuntimeError(f"stream cursor: no snapshot at block {blocks} (produced {self.blocks})")
        if self.filters.dedup is not None and snap.refill != self._refills:
            raise RuntimeError(f"stream cursor: documents were read past block {blocks} (produced {self.blocks}); "
                               "the dedup index is only known at the latest refill")
        return {
            "version": CURSOR_VERSION,
            "fingerprints": self.fingerprints,
            "block_size": self.block_size,
            "blocks": snap.blocks,
            "documents": snap.documents,
            "dedup": self.filters.dedup_state(),
            "counts": snap.counts,
            "tokens": snap.chunk[snap.offset :].tolist(),
        }

    def resume(self, cursor: dict[str, Any], where: str) -> None:
        """Continue from a :meth:`cursor_at` cursor.

        Raises:
            UserError: The cursor was saved against other sources (fingerprints differ) or block size; `where`
                names the checkpoint in the message.
        """
        if cursor.get("version") != CURSOR_VERSION or cursor["block_size"] != self.block_size:
            raise UserError(f"{where}: its stream cursor is of another format or block size; pass --restart")
        if cursor["fingerprints"] != self.fingerprints:
            raise UserError(
                f"{where}: saved while streaming other data (source fingerprints {cursor['fingerprints']} → "
                f"{self.fingerprints}: a file, revision, split or text column differs); resuming would read another "
                "stream, so restore the source or pass --restart"
            )
        self.documents.load_state(cursor["documents"])
        self.filters.load(cursor["dedup"], cursor["counts"])
        self.blocks = cursor["blocks"]
        self._chunk, self._offset = np.asarray(cursor["tokens"], dtype=np.int64), 0
        self._snapshots.clear()
        self._refill_state = self._capture()


def build(data: DataParams, tokenizer, block_size: int, rank: int, world_size: int, cache_dir: str,
          dedup: Any | None = None) -> PackedStream:
    """The pretraining stream of `data` for one rank.

    Args:
        data: `data` params (`source`, `hf`/`mixture`, `stream`, `seed`, split fractions, `max_chars_per_document`).
        tokenizer: The pipeline tokenizer (fast).
        block_size: Tokens per block (`pretrain.max_length`).
        rank: This process's rank; `world_size`: the number of ranks.
        cache_dir: Scratch folder for `datasets` (local sources); nothing is written to the HF cache.
        dedup: A deduplicator (``check(text)``, ``state()``, ``load_state(bytes)``) or None.

    Raises:
        UserError: A source cannot be opened.
    """
    opened = [open_source(key, src, cache_dir) for key, src, _ in sources_of(data)]
    filters = StreamFilter(data, dedup)
    streams = [
        DocumentStream(o, data.seed, rank, world_size, data.stream.shuffle_buffer, data.max_chars_per_document,
                       filters)
        for o in opened
    ]
    for o in opened:
        how = "shards" if o.num_shards % world_size == 0 else "documents (shard count not a multiple of world size)"
        log.info("stream %s: %s, %d shards; rank %d/%d reads every %d-th of the %s", o.key,
                 o.source.dataset_name, o.num_shards, rank, world_size, world_size, how)
    mixture = Mixture(streams, [w for _, _, w in sources_of(data)], data.seed)
    return PackedStream(mixture, tokenizer, block_size, filters, [o.fingerprint for o in opened])
