"""A source opened as a stream (:func:`open_source`), and its documents for one rank in a seeded order that
resumes from its state (:class:`DocumentStream`): a seeded permutation of the shards per epoch, then a seeded
shuffle buffer whose contents are part of the state."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmpipe.config import DataParams, HFSourceParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.data.files import FORMATS

if TYPE_CHECKING:
    from llmpipe.data.stream.filter import StreamFilter


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


def rng_state(rng: random.Random) -> list[Any]:
    """`rng`'s state as JSON-able lists (for a cursor)."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: list[Any]) -> None:
    """Put `rng` back at a :func:`rng_state`."""
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
            "rng": rng_state(self.rng),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        self.epoch, self.pos, self.shard_state = state["epoch"], state["pos"], state["shard_state"]
        self.counter, self.buffer = state["counter"], list(state["buffer"])
        self.admitted_this_epoch = state["admitted_this_epoch"]
        set_rng_state(self.rng, state["rng"])
        self.order, self._shard, self._rows = self._order(self.epoch), None, None
