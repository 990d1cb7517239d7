"""Streaming pretraining text (`data.streaming: true`): documents read, filtered, shuffled, tokenised and packed on
the fly, with a cursor that resumes at exactly the next token.

Pipeline, per rank::

    datasets streaming shard (IterableDataset.shard) → cut to data.max_chars_per_document → drop empty
    → drop documents whose hash puts them in validation/test (the split prepare made from its sample)
    → dedup (optional) → seeded shuffle buffer (per source) → mixture by weight → tokenise → eos → blocks

Why our own order and buffer: `datasets`' shuffle buffer loses its contents on resume and its batched arrow
`map` may skip a batch, so the resumable path keeps `datasets` to what it resumes exactly — one un-shuffled,
un-mapped shard at a time, whose ``state_dict()`` is its example position (on resume `datasets` re-reads that
shard's Arrow tables up to the position without decoding them into rows; nothing downstream is replayed). The
order is a seeded permutation of the shards per epoch plus a seeded buffer of `data.stream.shuffle_buffer`
documents whose contents are part of the cursor.

Ranks read disjoint data: whole shards when the shard count divides by the world size (rank r takes every
world-th shard of the epoch's permutation), otherwise every world-th document of the same order.

Packing: GPT-2 style — each document is followed by eos and blocks are cut across document boundaries;
attention is the model's plain causal mask, so it does cross document boundaries inside a block.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmpipe.config import DataParams, HFSourceParams
from llmpipe.data.tokens import pack_ids
from llmpipe.errors import UserError, root_cause

log = logging.getLogger(__name__)

CURSOR_VERSION = 1

DOC_BATCH = 64
"""Documents tokenised per `encode_batch` call when the token buffer runs short."""


def sources_of(data: DataParams) -> list[tuple[str, HFSourceParams, float]]:
    """``(params key, source, weight)`` of each source the stream reads: `data.hf`, or each `data.mixture` entry."""
    if data.source == "mixture":
        return [(f"data.mixture[{i}]", s, s.weight) for i, s in enumerate(data.mixture)]
    return [("data.hf", data.hf, 1.0)]


@dataclass
class OpenedSource:
    """A source opened for streaming: the un-sharded `datasets.IterableDataset`, and what identifies its data."""

    key: str
    source: HFSourceParams
    dataset: Any
    num_shards: int
    fingerprint: str


def open_source(key: str, source: HFSourceParams, cache_dir: str) -> OpenedSource:
    """Resolve `source` with `datasets.load_dataset_builder` and open its split as a stream (nothing downloaded).

    A local file is read by its format's packaged loader (.jsonl/.json → json, .parquet, .csv, .txt → one document
    per file), a local folder or hub name by `datasets`' own rules. The fingerprint hashes the name, config, split,
    text column and the resolved data files (a hub file's address carries the repository revision; a local file
    counts by its path under the source, its size and its first and last 64 KiB — not its mtime, so a copy or a
    `touch` still resumes), so a cursor saved against other data is refused on resume.

    Raises:
        UserError: The dataset cannot be resolved (the message names the params key).
    """
    from datasets import load_dataset_builder

    from llmpipe.data.files import FORMATS

    path = Path(source.dataset_name)
    kwargs: dict[str, Any] = {}
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in FORMATS:
            raise UserError(f"{key}.dataset_name: {path} has an unsupported suffix; use one of {', '.join(FORMATS)}")
        args, kwargs = (FORMATS[suffix],), {"data_files": {source.split: str(path)}}
    else:
        args = (source.dataset_name, source.dataset_config)
    if FORMATS.get(path.suffix.lower()) == "text" or (path.is_dir() and any(path.glob("**/*.txt"))):
        kwargs["sample_by"] = "document"
    try:
        builder = load_dataset_builder(*args, cache_dir=cache_dir if path.exists() else None, **kwargs)
        dataset = builder.as_streaming_dataset(split=source.split)
    except Exception as err:  # noqa: BLE001 — any failure here is about the user's source; say which
        raise UserError(
            f"{key}: could not open {source.dataset_name!r} (config {source.dataset_config!r}, split "
            f"{source.split!r}) as a stream: {root_cause(err)}; a hub name needs the network or the HF cache"
        ) from None
    files = [str(f) for f in (builder.config.data_files or {}).get(source.split, [])]
    digest = hashlib.sha256(json.dumps([source.dataset_name, source.dataset_config, source.split,
                                        source.text_column]).encode())
    root = path if path.is_dir() else path.parent
    for f in sorted(files):
        if os.path.exists(f):  # a local file: where it sits under the source (the checkout may move), its size
            digest.update(f"{os.path.relpath(f, root)}\0{os.path.getsize(f)}\0".encode())
            digest.update(_ends(f))
        else:
            digest.update(f"{f}\n".encode())
    return OpenedSource(key, source, dataset, dataset.num_shards, digest.hexdigest()[:16])


def _ends(file: str, size: int = 65536) -> bytes:
    """The first and last `size` bytes of `file` (the whole file when shorter than twice that)."""
    with open(file, "rb") as fh:
        head = fh.read(size)
        fh.seek(max(fh.tell(), os.path.getsize(file) - size))
        return head + fh.read()


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(rng: random.Random, state: list[Any]) -> None:
    rng.setstate((state[0], tuple(state[1]), state[2]))


@dataclass
class DocumentStream:
    """The documents of one source for one rank, in a seeded, resumable order.

    Args:
        opened: From :func:`open_source`.
        seed: Seeds the shard permutation (per epoch) and the shuffle buffer.
        rank: This process's rank.
        world_size: Number of processes reading the source.
        shuffle_buffer: Documents held in the buffer (0 = stream order).
        max_chars: Documents are cut to this many characters (as prepare cuts them).
        keep: Decides whether a (cut) document is admitted, and counts why not; told of each new pass.
    """

    opened: OpenedSource
    seed: int
    rank: int
    world_size: int
    shuffle_buffer: int
    max_chars: int
    keep: StreamFilter
    epoch: int = 0
    pos: int = 0
    shard_state: dict[str, Any] | None = None
    counter: int = 0
    buffer: list[str] = field(default_factory=list)
    rng: random.Random = field(init=False)
    _shard: Any = field(default=None, init=False, repr=False)
    _rows: Iterator[dict[str, Any]] | None = field(default=None, init=False, repr=False)
    admitted_this_epoch: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:buffer:{self.opened.key}:{self.rank}")
        self.by_shard = self.opened.num_shards % self.world_size == 0
        self.order = self._order(self.epoch)

    def _order(self, epoch: int) -> list[int]:
        shards = list(range(self.opened.num_shards))
        random.Random(f"{self.seed}:shards:{self.opened.key}:{epoch}").shuffle(shards)
        return shards[self.rank :: self.world_size] if self.by_shard else shards

    def _next_raw(self) -> str:
        """The next admitted document, before the shuffle buffer; cycles epochs (a stream has no end)."""
        col = self.opened.source.text_column
        while True:
            if self._rows is None:
                if self.pos >= len(self.order):
                    if self.admitted_this_epoch == 0:
                        raise UserError(
                            f"{self.opened.key}: a whole pass over {self.opened.source.dataset_name!r} gave rank "
                            f"{self.rank} no training document (all empty, held out for validation/test, or "
                            "duplicates of what data.dedup.seen_hashes_path records); give a larger source"
                        )
                    self.epoch, self.pos, self.shard_state = self.epoch + 1, 0, None
                    self.order, self.admitted_this_epoch = self._order(self.epoch), 0
                    self.keep.new_pass()
                    continue
                shard = self.opened.dataset.shard(num_shards=self.opened.num_shards, index=self.order[self.pos])
                if self.shard_state is not None:
                    shard.load_state_dict(self.shard_state)
                self._shard, self._rows = shard, iter(shard)
            try:
                row = next(self._rows, None)
            except Exception as err:  # noqa: BLE001 — a bad shard (not UTF-8, broken JSON, other columns)
                raise UserError(
                    f"{self.opened.key}: {self.opened.source.dataset_name!r} shard {self.order[self.pos] + 1} of "
                    f"{self.opened.num_shards} (in the source's file order) cannot be read near document "
                    f"{self.counter + 1}: {root_cause(err)}; fix or remove that file"
                ) from None
            if row is None:
                self.pos, self.shard_state, self._rows = self.pos + 1, None, None
                continue
            self.shard_state = self._shard.state_dict()  # resumes at the next example
            index, self.counter = self.counter, self.counter + 1
            if not self.by_shard and index % self.world_size != self.rank:
                continue
            if col not in row:
                raise UserError(f"{self.opened.key}.text_column: {self.opened.source.dataset_name!r} has no column "
                                f"`{col}` (found: {', '.join(row)}); set it to the column holding the text")
            text = row[col]
            if not isinstance(text, str):
                raise UserError(f"{self.opened.key}: `{col}` of document {index + 1} (shard {self.order[self.pos] + 1}) "
                                f"is {type(text).__name__}, not a string; a file without that column, or with "
                                "another type in it, is mixed into the source")
            if self.keep(text[: self.max_chars]):
                self.admitted_this_epoch += 1
                return text[: self.max_chars]

    def next_document(self) -> str:
        """The next document of this rank's stream, through the shuffle buffer."""
        while True:
            text = self._next_raw()
            if not self.shuffle_buffer:
                return text
            if len(self.buffer) < self.shuffle_buffer:
                self.buffer.append(text)
                continue
            i = self.rng.randrange(self.shuffle_buffer)
            out, self.buffer[i] = self.buffer[i], text
            return out

    def state(self) -> dict[str, Any]:
        """The cursor: epoch, position in the epoch's shard order, the shard's own position, the document
        counter, the buffer's documents and the buffer RNG (JSON-able)."""
        return {
            "epoch": self.epoch,
            "pos": self.pos,
            "shard_state": json.loads(json.dumps(self.shard_state)),
            "counter": self.counter,
            "admitted_this_epoch": self.admitted_this_epoch,
            "buffer": list(self.buffer),
            "rng": _rng_state(self.rng),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        self.epoch, self.pos, self.shard_state = state["epoch"], state["pos"], state["shard_state"]
        self.counter, self.buffer = state["counter"], list(state["buffer"])
        self.admitted_this_epoch = state["admitted_this_epoch"]
        _set_rng_state(self.rng, state["rng"])
        self.order, self._shard, self._rows = self._order(self.epoch), None, None


class Mixture:
    """Documents drawn from several :class:`DocumentStream` by weight with a seeded RNG (one stream: its own
    documents). Each draw takes the next document of the chosen source."""

    def __init__(self, streams: list[DocumentStream], weights: list[float], seed: int) -> None:
        self.streams, self.weights = streams, weights
        self.rng = random.Random(f"{seed}:mixture")
        self.last = streams[0]

    def next_document(self) -> str:
        """The next document of the mixture (`last` is the stream it came from)."""
        if len(self.streams) > 1:
            (self.last,) = self.rng.choices(self.streams, self.weights)
        return self.last.next_document()

    def state(self) -> dict[str, Any]:
        """The sources' cursors and the mixing RNG."""
        return {"rng": _rng_state(self.rng), "sources": [s.state() for s in self.streams]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        _set_rng_state(self.rng, state["rng"])
        for stream, s in zip(self.streams, state["sources"], strict=True):
            stream.load_state(s)


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

    def __init__(self, documents: Mixture, tokenizer, block_size: int, filters: "StreamFilter",
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


class StreamFilter:
    """Which documents a stream admits, with counts: non-empty, in the training split (by the hash prepare's
    split uses; unless `heldout` is False, as for prepare's own sample), and not a duplicate when a
    deduplicator is given.

    The deduplicator's index restarts (from what it held when given: an earlier run's seen documents and the
    held-out references) whenever a source starts a new pass, so a multi-epoch stream repeats its documents once
    per pass instead of running dry; within a pass, and against earlier runs and the held-out splits, duplicates
    are dropped. (In a mixture, a restart for one source lets a later duplicate of another source's document of
    that pass through.)
    """

    def __init__(self, data: DataParams, dedup: Any | None = None, heldout: bool = True) -> None:
        from llmpipe.data.splits import split_of

        self._split = lambda text: split_of(data.seed, text, data.validation_fraction, data.test_fraction)
        # With a validation source, prepare moved the hash split's validation share into train.
        self._trained = ("train", "validation") if data.validation_source is not None else ("train",)
        self._heldout = heldout
        self.dedup = dedup
        self._base = None if dedup is None else dedup.state()
        self.counts = {"num_documents": 0, "num_dropped_empty": 0, "num_dropped_heldout": 0, "num_tokens": 0}

    def new_pass(self) -> None:
        """A source starts another pass: the dedup index goes back to what it held when given."""
        if self.dedup is not None:
            from llmpipe.data.dedup import Deduplicator

            self.dedup = Deduplicator.from_state(self._base, self.dedup.params)

    def __call__(self, text: str) -> bool:
        if not text.strip():
            self.counts["num_dropped_empty"] += 1
            return False
        if self._heldout and self._split(text) not in self._trained:
            self.counts["num_dropped_heldout"] += 1
            return False
        if self.dedup is not None:
            reason = self.dedup.check(text)
            if reason is not None:
                key = f"num_dropped_{reason}"
                self.counts[key] = self.counts.get(key, 0) + 1
                return False
        self.counts["num_documents"] += 1
        return True

    def dedup_state(self) -> str | None:
        """The deduplicator's state (base64), or None without one."""
        return None if self.dedup is None else base64.b64encode(self.dedup.state()).decode()

    def load(self, dedup: str | None, counts: dict[str, int]) -> None:
        """Restore the deduplicator's state (seen index, references, counts) and the counts."""
        if self.dedup is not None and dedup is not None:
            from llmpipe.data.dedup import Deduplicator

            self.dedup = Deduplicator.from_state(base64.b64decode(dedup), self.dedup.params)
        self.counts = dict(counts)


def deduplicator(data: DataParams, references: Iterable[str]):
    """The stream's `llmpipe.data.dedup.Deduplicator` (`data.dedup`, with the documents `seen_hashes_path` holds)
    and, with `data.dedup.decontaminate`, `references` (the held-out documents) registered; None when off."""
    from llmpipe.data.dedup import from_params

    dedup = from_params(data.dedup)
    if dedup is not None and data.dedup.decontaminate:
        for text in references:
            dedup.add_reference(text)
    return dedup


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


def sample(data: DataParams, num_documents: int, cache_dir: str) -> list[dict[str, Any]]:
    """The first `num_documents` non-empty documents of the stream as one process reads it (no split, dedup or
    buffer): prepare's sample, which gives the tokenizer its text and the validation/test splits.

    Returns:
        Documents ``{"text", "source"}`` (text cut to `data.max_chars_per_document`), fewer when the source is
        shorter.
    """
    opened = [open_source(key, src, cache_dir) for key, src, _ in sources_of(data)]
    non_empty = StreamFilter(data, heldout=False)
    streams = [DocumentStream(o, data.seed, 0, 1, 0, data.max_chars_per_document, non_empty) for o in opened]
    mixture = Mixture(streams, [w for _, _, w in sources_of(data)], data.seed)
    out: list[dict[str, Any]] = []
    while len(out) < num_documents and not any(s.epoch for s in streams):
        text = mixture.next_document()
        if not any(s.epoch for s in streams):  # stop at the first source's end: one pass, no repeats
            source = mixture.last.opened.source
            out.append({"text": text, "source": f"{source.dataset_name}:{source.split}"})
    if len(out) < num_documents:
        ended = next(s.opened for s in streams if s.epoch)
        log.warning("prepare's sample of the stream has %d documents, not data.stream.sample_documents=%d: %s "
                    "(%s) ended first", len(out), num_documents, ended.key, ended.source.dataset_name)
    return out
