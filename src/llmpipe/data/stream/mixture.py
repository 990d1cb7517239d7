"""Documents drawn from several sources by weight (:class:`Mixture`), and prepare's sample of the stream."""

from __future__ import annotations

import logging
import random
from typing import Any

from llmpipe.config import DataParams
from llmpipe.data.stream.filter import StreamFilter
from llmpipe.data.stream.source import DocumentStream, open_source, rng_state, set_rng_state, sources_of

log = logging.getLogger(__name__)


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
        return {"rng": rng_state(self.rng), "sources": [s.state() for s in self.streams]}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state`."""
        set_rng_state(self.rng, state["rng"])
        for stream, s in zip(self.streams, state["sources"], strict=True):
            stream.load_state(s)


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
