"""Deterministic train/validation/test assignment by a stable hash, and seeded subsampling.

Both depend only on the seed and the items' keys (never on Python's salted ``hash``), so a seed gives the
same split on every machine and run.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

SPLITS = ("train", "validation", "test")


def unit_hash(seed: int, key: str) -> float:
    """A number in [0, 1) fixed by (`seed`, `key`): the first 8 bytes of sha256, scaled."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(seed: int, key: str, validation_fraction: float, test_fraction: float) -> str:
    """The split of `key` by its unit hash alone: test below `test_fraction`, validation below
    `test_fraction + validation_fraction`, else train (what a stream decides one document at a time)."""
    return _split_at(unit_hash(seed, key), validation_fraction, test_fraction)


def _split_at(u: float, validation_fraction: float, test_fraction: float) -> str:
    return "test" if u < test_fraction else "validation" if u < test_fraction + validation_fraction else "train"


def split_by_key(
    items: Sequence[T],
    key: Callable[[T], str],
    seed: int,
    validation_fraction: float,
    test_fraction: float,
    fill_empty: bool = True,
) -> dict[str, list[T]]:
    """Assign each item to a split by the hash of its key; items with equal keys share a split.

    An item goes to test when its unit hash is below `test_fraction`, to validation when below
    `test_fraction + validation_fraction`, else to train. When validation or test would be empty and train
    keeps at least one key, the train key with the lowest hash moves there (so tiny user datasets still get
    every split) unless `fill_empty` is False (a stream's sample: the stream decides by :func:`split_of` alone).
    Order within a split is the input order.

    Args:
        items: The units to split (modules, documents, pairs).
        key: The item's identity, e.g. a module's relative path or a document's text.
        seed: `data.seed`.
        validation_fraction: Expected share of keys in validation, in (0, 0.5).
        test_fraction: Expected share of keys in test, in (0, 0.5).

    Returns:
        ``{"train": [...], "validation": [...], "test": [...]}``.
    """
    u = {k: unit_hash(seed, k) for k in dict.fromkeys(key(it) for it in items)}
    where = {k: _split_at(x, validation_fraction, test_fraction) for k, x in u.items()}  # one hash per key
    for split in ("test", "validation") if fill_empty else ():
        train_keys = [k for k, s in where.items() if s == "train"]
        if split not in where.values() and len(train_keys) > 1:
            where[min(train_keys, key=u.__getitem__)] = split
    out: dict[str, list[T]] = {s: [] for s in SPLITS}
    for it in items:
        out[where[key(it)]].append(it)
    return out


def subsample(items: Sequence[T], max_items: int, seed: int, salt: str) -> list[T]:
    """At most `max_items` of `items`, chosen by an RNG seeded with (`seed`, `salt`); input order is kept."""
    if len(items) <= max_items:
        return list(items)
    rng = random.Random(f"{seed}:{salt}")
    return [items[i] for i in sorted(rng.sample(range(len(items)), max_items))]
