"""Which documents a stream admits (:class:`StreamFilter`), and the stream's deduplicator."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

from llmpipe.config import DataParams


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
