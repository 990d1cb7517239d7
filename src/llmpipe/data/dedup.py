"""Document-level deduplication and decontamination: exact hashes and MinHash-LSH near duplicates, with the index
of seen documents in fixed-size Bloom filters so that memory stays flat however long the stream.

Why: duplicated training text is memorised, wastes compute and inflates held-out scores when it leaks into the
evaluation splits (Lee et al. 2022, "Deduplicating Training Data Makes Language Models Better").

What counts as the same document (:func:`normalise`): the text in Unicode NFKC, then ``str.casefold()``, then
every run of Unicode whitespace replaced by one space and the ends stripped.

- **Exact**: the 128-bit blake2b digest of the normalised text's UTF-8 bytes.
- **Near**: the normalised text's words (split on the single spaces), word n-grams of ``shingle_size`` words
  (the whole text when it has fewer words) as shingles, a MinHash signature of ``num_perm`` values over them
  (Broder 1997, "On the resemblance and containment of documents"; datasketch's ``affine32`` scheme over
  sha1-32 shingle hashes, seed 1, filled by the vectorised ``MinHash.update_batch``), cut into ``b`` bands of
  ``r`` rows (Leskovec, Rajaraman and Ullman, "Mining of Massive Datasets", ch. 3.4). Two documents of Jaccard
  similarity ``s`` share a band with probability ``1 - (1 - s^r)^b``; ``(b, r)`` is datasketch's own choice
  for ``threshold`` and ``num_perm`` (the pair minimising the equally weighted false-positive and
  false-negative areas of that curve): ``b=9, r=13`` at the defaults 0.8 / 128, so pairs at s = 0.7 are caught
  with probability 0.08, at 0.8 with 0.40, at 0.9 with 0.93 (a soft cut, half-way at 0.845). A band key is the
  blake2b-128 digest of the band index and the band's values.
- **Contaminated**: the document matches a *reference* (a validation or test document registered with
  :meth:`Deduplicator.add_reference`) by either rule above that is on.

A document that matches nothing is *admitted*: its exact key and band keys are recorded as seen. Dropped
documents are not recorded, so a chain of near duplicates does not grow its cluster.

Throughput of :meth:`Deduplicator.check` at the defaults (``benchmarks/dedup_throughput.py``, 10 MB of this
interpreter's stdlib, one process on a 2-core machine): about 385 documents/s and 6.3 MB/s on whole modules
(16 KB each), 4,000 documents/s and 7.5 MB/s on 2,000-character pieces. Normalising and shingling take 20% of
that; the rest is mostly datasketch's ``update_batch`` (one sha1 per shingle in Python, then the numpy
permutations). Memory: 30.9 MB of filters for
the default capacity of 10^6 documents, whatever the number of documents checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import unicodedata
from pathlib import Path
from typing import Any, Literal

from datasketch import MinHash, MinHashLSH
from rbloom import Bloom

from llmpipe.config import DedupParams
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file

log = logging.getLogger(__name__)

Verdict = Literal["exact", "near", "contaminated"]
"""Why :meth:`Deduplicator.check` drops a document (None: it was admitted)."""

COUNTERS = ("num_kept", "num_dropped_exact", "num_dropped_near", "num_dropped_contaminated")
"""The per-run counts of :class:`Deduplicator` (attributes of the same names)."""

MATCH_KEYS = ("exact", "near", "threshold", "num_perm", "shingle_size", "capacity", "false_positive_rate")
"""`data.dedup` keys a saved index or state depends on; loading it under other values is an error."""

FORMAT = "llmpipe-dedup/1 blake2b-128 datasketch-2 affine32 sha1_hash32 seed=1 rbloom-1"
"""Written into every file: the hashing and serialisation a saved index was made with."""

MAGIC = b"llmpipe-dedup\n"
KEY_BYTES = 16
MINHASH_SEED = 1
MINHASH_SCHEME = "affine32"


def normalise(text: str) -> str:
    """`text` in Unicode NFKC, case-folded (``str.casefold``), whitespace runs collapsed to one space, stripped."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def shingles(normalised: str, size: int) -> list[bytes]:
    """The word `size`-grams of a :func:`normalise`-d text, UTF-8 encoded: the whole text when it has at most
    `size` words, none when it is empty. Repeats are kept: a MinHash is a minimum, so they change nothing."""
    words = normalised.split(" ") if normalised else []
    if len(words) <= size:
        return [normalised.encode()] if words else []
    return [" ".join(words[i : i + size]).encode() for i in range(len(words) - size + 1)]


def _key(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def _hit(index: dict[str, Any], keys: dict[str, list[bytes]], kind: str) -> bool:
    """Whether any of the `kind` keys of a document is in ``index[kind]`` (a Bloom filter or a set)."""
    return kind in keys and any(k in index[kind] for k in keys[kind])


def _blooms(blobs: dict[str, bytes]) -> dict[str, Bloom]:
    """The seen-index filters among a saved file's blobs (``seen_<kind>``), by kind."""
    return {name.removeprefix("seen_"): Bloom.load_bytes(blob, _bloom_hash) for name, blob in blobs.items()
            if name.startswith("seen_")}


def _bloom_hash(key: bytes) -> int:
    """rbloom's hash of a key: the key is already a uniform 128-bit digest, so read it as a signed int.

    A named module-level function, not Python's salted ``hash``: a saved filter is only usable when it is
    loaded with the same hash (rbloom's persistence rule).
    """
    return int.from_bytes(key, "little", signed=True)


def lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    """Bands and rows per band that datasketch's `MinHashLSH` picks for `threshold` and `num_perm`.

    Raises:
        UserError: Fewer than 2 bands fit (a threshold near 1 with few permutations).
    """
    try:
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)  # its constructor runs the optimisation
    except ValueError as err:
        raise UserError(
            f"data.dedup.threshold {threshold} with data.dedup.num_perm {num_perm}: datasketch finds no LSH banding "
            f"({err}); lower the threshold or raise num_perm"
        ) from None
    return lsh.b, lsh.r


class Deduplicator:
    """Decides, one document at a time, whether a document is new, a duplicate of a seen one, or contaminated.

    Memory is fixed when it is made: two Bloom filters (rbloom) over the exact keys and the band keys of
    admitted documents, sized for `params.capacity` documents. We do not keep seen documents in datasketch's
    `MinHashLSH`: it stores every signature and a bucket per band key in dicts, so it grows with each document
    and cannot follow a stream larger than memory; its `MinHashLSHBloom` keeps one file-backed filter per band
    through pybloomfiltermmap3 and has no in-memory state to put into a training checkpoint. Here a band filter
    holds all ``b`` band keys (the index is part of the key), and the `false_positive_rate` budget is split
    evenly between the filters that are on, the band filter's share again over its ``b`` lookups, so that a
    new document is dropped by mistake with at most that probability (union bound) while the filters hold at
    most `capacity` documents.

    References (validation/test documents) are few, so their keys sit in exact sets of 16-byte digests: no
    false positives and no size to guess. datasketch's `MinHashLSH` would serve too, but it keeps signatures
    and keys we never ask for; sets use the same band keys as the seen index, so a train/reference pair is
    judged exactly like a train/train pair.

    Attributes:
        params: The `data.dedup` section.
        bands: LSH bands ``b`` (0 when `params.near` is off).
        rows: MinHash values per band ``r`` (0 when `params.near` is off).
        num_seen: Documents recorded in the seen index, including those of a loaded index.
        num_references: Reference documents registered.
        num_kept, num_dropped_exact, num_dropped_near, num_dropped_contaminated: This run's decisions.
    """

    def __init__(self, params: DedupParams) -> None:
        """Make an empty index for `params`.

        Raises:
            UserError: `params` turn every comparison off, or no LSH banding fits `threshold` and `num_perm`.
        """
        if not params.enabled:
            raise UserError("data.dedup.exact and data.dedup.near are both false: there is nothing to compare")
        self.params = params
        self.bands, self.rows = lsh_bands(params.threshold, params.num_perm) if params.near else (0, 0)
        budget = params.false_positive_rate / (params.exact + params.near)
        self._seen: dict[str, Bloom] = {}
        if params.exact:
            self._seen["exact"] = Bloom(params.capacity, budget, _bloom_hash)
        if params.near:
            self._seen["bands"] = Bloom(params.capacity * self.bands, budget / self.bands, _bloom_hash)
            self._minhash = MinHash(num_perm=params.num_perm, seed=MINHASH_SEED, scheme=MINHASH_SCHEME)
        self._references: dict[str, set[bytes]] = {kind: set() for kind in self._seen}
        self.num_seen = 0
        self.num_references = 0
        self.num_kept = self.num_dropped_exact = self.num_dropped_near = self.num_dropped_contaminated = 0

    # --- decisions ----------------------------------------------------------------------------------------

    def index_keys(self, text: str) -> dict[str, list[bytes]]:
        """The index keys of `text` (raw; normalised here).

        Returns:
            ``{"exact": [digest]}`` when `params.exact`, ``{"bands": [b digests]}`` when `params.near`; each
            digest is 16 bytes.
        """
        normalised = normalise(text)
        out = {}
        if self.params.exact:
            out["exact"] = [_key(normalised.encode())]
        if self.params.near:
            signature = self._minhash.copy()
            signature.update_batch(shingles(normalised, self.params.shingle_size))
            values = signature.hashvalues[: self.bands * self.rows].astype("<u4").reshape(self.bands, self.rows)
            out["bands"] = [_key(i.to_bytes(4, "little") + band.tobytes()) for i, band in enumerate(values)]
        return out

    def add_reference(self, text: str) -> None:
        """Register a validation/test document: training documents matching it are dropped as contaminated."""
        for kind, found in self.index_keys(text).items():
            self._references[kind].update(found)
        self.num_references += 1

    def check(self, text: str) -> Verdict | None:
        """Decide on one training document, in stream order.

        Checked in this order: a reference match (``"contaminated"``), an exact match with a seen document
        (``"exact"``), a shared LSH band with a seen document (``"near"``). A document matching none is
        recorded as seen.

        Args:
            text: The document, raw (it is normalised here).

        Returns:
            Why it is dropped, or None when it is admitted (and recorded).
        """
        keys = self.index_keys(text)
        if _hit(self._references, keys, "exact") or _hit(self._references, keys, "bands"):
            self.num_dropped_contaminated += 1
            return "contaminated"
        if _hit(self._seen, keys, "exact"):
            self.num_dropped_exact += 1
            return "exact"
        if _hit(self._seen, keys, "bands"):
            self.num_dropped_near += 1
            return "near"
        for kind, found in keys.items():
            self._seen[kind].update(found)
        self.num_kept += 1
        self.num_seen += 1
        if self.num_seen == self.params.capacity + 1:
            self._warn_full()
        return None

    @property
    def counts(self) -> dict[str, int]:
        """This run's decisions, ``{name: count}`` for each of :data:`COUNTERS`."""
        return {name: getattr(self, name) for name in COUNTERS}

    def _warn_full(self) -> None:
        log.warning(
            "data.dedup: %d documents are recorded as seen, more than data.dedup.capacity (%d): new documents are now "
            "dropped by mistake more often than data.dedup.false_positive_rate; raise capacity (a new index)",
            self.num_seen,
            self.params.capacity,
        )

    # --- persistence --------------------------------------------------------------------------------------

    def state(self) -> bytes:
        """Everything, for a training checkpoint: the seen index, the references and the counts.

        Returns:
            Bytes for :meth:`from_state`; their size is fixed by the params plus 16 bytes per reference key.
        """
        blobs = {f"references_{kind}": b"".join(sorted(found)) for kind, found in self._references.items()}
        return self._pack({"contents": "state", "num_references": self.num_references, **self.counts}, blobs)

    @classmethod
    def from_state(cls, state: bytes, params: DedupParams) -> Deduplicator:
        """The deduplicator that :meth:`state` saved: later decisions equal the saved one's.

        Args:
            state: What :meth:`state` returned.
            params: The `data.dedup` section; :data:`MATCH_KEYS` must equal the saved ones.

        Returns:
            A deduplicator with the saved seen index, references and counts.

        Raises:
            UserError: `state` is not a dedup state, or was made with other values of :data:`MATCH_KEYS`.
        """
        dedup = cls(params)
        header, blobs = dedup._unpack(state, "the dedup state")
        if header["contents"] != "state":
            raise UserError("the dedup state: holds a seen index only (Deduplicator.save), not a Deduplicator.state")
        dedup._seen, dedup.num_seen = _blooms(blobs), header["num_seen"]
        for kind in dedup._references:
            found = blobs[f"references_{kind}"]
            dedup._references[kind] = {found[i : i + KEY_BYTES] for i in range(0, len(found), KEY_BYTES)}
        for name in ("num_references", *COUNTERS):
            setattr(dedup, name, header[name])
        return dedup

    def save(self, path: str | Path) -> None:
        """Write the seen index (not the references, not the counts) to `path`, atomically (temp file, rename)."""
        with atomic_file(path, "wb") as fh:
            fh.write(self._pack({"contents": "seen"}, {}))

    def load(self, path: str | Path) -> None:
        """Add the documents of the seen index saved at `path` (by :meth:`save`) to this one: a Bloom filter union.

        Args:
            path: A file :meth:`save` wrote (or a :meth:`state`, whose seen index is taken).

        Raises:
            UserError: `path` is not a dedup index, is damaged, or was saved with other values of
                :data:`MATCH_KEYS` (the message names the key).
            FileNotFoundError: `path` does not exist.
        """
        header, blobs = self._unpack(Path(path).read_bytes(), str(path))
        for kind, bloom in _blooms(blobs).items():
            self._seen[kind] |= bloom
        before, self.num_seen = self.num_seen, self.num_seen + header["num_seen"]
        if before <= self.params.capacity < self.num_seen:
            self._warn_full()

    def _pack(self, fields: dict[str, Any], blobs: dict[str, bytes]) -> bytes:
        """:data:`MAGIC`, the header's length (8 bytes, big-endian), the JSON header, then the seen filters and
        `blobs`, in the order of the header's ``blobs`` (sorted by name); the header holds their blake2b."""
        named = sorted({**{f"seen_{kind}": bloom.save_bytes() for kind, bloom in self._seen.items()}, **blobs}.items())
        header = {
            "format": FORMAT,
            "params": self.params.model_dump(include=set(MATCH_KEYS)),
            "num_seen": self.num_seen,
            **fields,
            "blobs": [[name, len(blob)] for name, blob in named],
            "blobs_blake2b": hashlib.blake2b(b"".join(blob for _, blob in named)).hexdigest(),
        }
        encoded = json.dumps(header).encode()
        return b"".join([MAGIC, struct.pack(">Q", len(encoded)), encoded, *(blob for _, blob in named)])

    def _unpack(self, data: bytes, where: str) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The header and blobs of :meth:`_pack`'s bytes, checked against this deduplicator's params.

        Raises:
            UserError: Not this format, damaged or cut short, or made with other values of :data:`MATCH_KEYS`.
        """
        start = len(MAGIC) + 8
        if not data.startswith(MAGIC) or len(data) < start:
            raise UserError(f"{where}: not a dedup index written by llmpipe.data.dedup; point to one, or remove it")
        (length,) = struct.unpack(">Q", data[len(MAGIC) : start])
        try:
            header = json.loads(data[start : start + length])
        except ValueError:
            header = None
        body = data[start + length :]
        if not isinstance(header, dict) or hashlib.blake2b(body).hexdigest() != header.get("blobs_blake2b"):
            raise UserError(f"{where}: damaged (its contents do not match the checksum it was written with); "
                            "remove it to start a new index")
        if header["format"] != FORMAT:
            raise UserError(f"{where}: written as {header['format']!r}, this llmpipe reads {FORMAT!r}; "
                            "remove it to start a new index")
        ours = self.params.model_dump(include=set(MATCH_KEYS))
        for key in MATCH_KEYS:
            if header["params"][key] != ours[key]:
                raise UserError(
                    f"{where}: made with data.dedup.{key}={header['params'][key]!r}, but data.dedup.{key} is "
                    f"{ours[key]!r}; set it back, or use another data.dedup.seen_hashes_path for these params"
                )
        blobs, offset = {}, 0
        for name, size in header["blobs"]:
            blobs[name], offset = body[offset : offset + size], offset + size
        return header, blobs


def from_params(params: DedupParams) -> Deduplicator | None:
    """The deduplicator of `params` holding what `params.seen_hashes_path` recorded (when that file exists); None
    when `params` compares nothing.

    Raises:
        UserError: The seen-hashes file was made with other params or is not an index (see `Deduplicator.load`).
    """
    if not params.enabled:
        return None
    out = Deduplicator(params)
    if params.seen_hashes_path is not None and Path(params.seen_hashes_path).exists():
        out.load(params.seen_hashes_path)
    return out
