"""Token files: a split of pretraining text tokenised once into raw ids on disk, read back memory-mapped.

A split's token folder (``<paths.data>/tokens/<split>/``, written by the `tokenize` stage) holds

- ``tokens.bin``: every document's ids followed by eos, back to back, as raw native-endian integers — uint16
  when every id of the vocabulary fits in one (at most 65536 tokens), else uint32 (the nanoGPT / Megatron
  ``.bin`` layout);
- ``meta.json``: ``dtype``, ``num_tokens``, ``num_documents``, ``num_text_bytes`` (UTF-8 bytes of the text),
  ``eos_token_id``, ``vocab_size``, and the SHA-256 of the tokenizer folder (``tokenizer_sha256``) and of the
  source jsonl (``source_sha256``).

Both are written into a temporary folder renamed into place at the end, so a killed run leaves no token file,
and the two always describe each other. Training reads ``tokens.bin`` through `numpy.memmap`: a block is
sliced from the map when the data loader asks for it, so resident memory does not grow with the corpus.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, hash_paths, iter_jsonl, write_json

TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"

CHUNK_CHARS = 1_000_000
"""Characters of text tokenised per batch (documents are never split). Bounds the memory of a split's
tokenisation whatever its size: the backend's encodings and the id lists of a batch cost ~150 bytes a token
while they live. On the stdlib train split (10 MB of text, 3.9 M tokens of the tests' 1k BPE) peak memory
rises by ~60 MB with 1 M-character chunks, ~90 MB with 2 M and ~420 MB in one batch, at the same speed
(±10%, run to run)."""

FIX = "rerun the tokenize stage (dvc repro tokenize)"


def pack_ids(texts: list[str], tokenizer) -> np.ndarray:
    """Token ids of `texts` (no special tokens), each document followed by eos, as one int64 array (N,).

    Special-token text in a document stays text: ``<s>`` in a regex of the corpus, ``</s>`` or ``<|user|>`` typed
    in a file are encoded as the characters they are, never as bos, eos or a role token (transformers'
    ``split_special_tokens``, `tokenizers`' ``encode_special_tokens``), so the only control ids in a token file are
    the eos this function puts between documents.

    The same ids as ``tokenizer(texts, add_special_tokens=False, split_special_tokens=True)``, but a fast
    tokenizer's backend (`tokenizers`) encodes the batch directly, without the per-document Python lists of every
    field that the tokenizer call builds, and numpy joins the documents: ~1.3x faster on the stdlib corpus
    (3.2 → 4.2 MB/s, benchmarks/tokenize_throughput.py).

    Args:
        texts: Documents.
        tokenizer: A transformers tokenizer with an eos token.

    Returns:
        int64 array of shape (N,), N = total tokens + one eos per document.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The tokenizer call turns truncation and padding off; a backend left in another state goes through the call.
    if backend is not None and backend.truncation is None and backend.padding is None:
        split = backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            docs = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        finally:
            backend.encode_special_tokens = split
    else:
        docs = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
    ends = np.cumsum([len(d) for d in docs], dtype=np.int64)  # (D,) where each document's eos goes
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int64, count=int(ends[-1]) if len(ends) else 0)
    return np.insert(flat, ends, tokenizer.eos_token_id)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when ids ``0 … vocab_size - 1`` all fit in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size - 1 <= np.iinfo(np.uint16).max else np.uint32)


def _chunks(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    """Consecutive runs of `texts` of about `max_chars` characters (at least one document each)."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        chunk.append(text)
        size += len(text)
        if size >= max_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def write_tokens(source: Path, dest: Path, tokenizer, tokenizer_dir: Path) -> dict[str, Any]:
    """Tokenise the ``text`` of every row of a jsonl file into the token folder `dest`, atomically.

    Rows are read and tokenised `CHUNK_CHARS` characters at a time and appended to ``tokens.bin``, so memory
    stays bounded however large the file.

    Args:
        source: ``<paths.data>/pretrain/<split>.jsonl`` (rows with a ``text`` field).
        dest: The token folder to write (replaced as a whole when everything is written).
        tokenizer: The pipeline tokenizer, loaded from `tokenizer_dir`.
        tokenizer_dir: ``paths.tokenizer`` (its files are hashed into the metadata).

    Returns:
        The metadata written to ``meta.json`` (see the module docstring).

    Raises:
        UserError: `source` is missing.
        ValueError: A line of `source` is not UTF-8 JSON (`llmpipe.core.io.iter_jsonl`).
    """
    if not source.exists():
        raise UserError(f"{source}: missing; run the prepare stage first (dvc repro prepare)")
    dtype = token_dtype(len(tokenizer))
    num_tokens = num_documents = num_text_bytes = 0
    with atomic_dir(dest) as tmp:
        with open(tmp / TOKENS_FILE, "wb") as fh:
            for texts in _chunks((row["text"] for row in iter_jsonl(source)), CHUNK_CHARS):
                ids = pack_ids(texts, tokenizer)  # (N,) int64
                ids.astype(dtype).tofile(fh)
                num_tokens += len(ids)
                num_documents += len(texts)
                num_text_bytes += sum(len(t.encode("utf-8")) for t in texts)
        meta = {
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": num_documents,
            "num_text_bytes": num_text_bytes,
            "eos_token_id": tokenizer.eos_token_id,
            "vocab_size": len(tokenizer),
            "tokenizer_sha256": hash_paths([tokenizer_dir]),
            "source_sha256": hash_paths([source]),
        }
        write_json(tmp / META_FILE, meta)
    return meta


def read_tokens(folder: Path, tokenizer_dir: Path) -> np.ndarray:
    """The ids of a token folder, memory-mapped read-only, once checked against the tokenizer in use.

    Args:
        folder: ``<paths.data>/tokens/<split>``.
        tokenizer_dir: ``paths.tokenizer``, the folder the stage loads its tokenizer from.

    Returns:
        A read-only `numpy.memmap` of shape (N,) and the folder's dtype (uint16 or uint32); nothing is read
        until it is indexed. An empty array when the folder holds no token.

    Raises:
        UserError: The folder is missing or its metadata unreadable, it was made with another tokenizer than
            `tokenizer_dir` (its files hash differently), or ``tokens.bin`` is not the size ``meta.json``
            declares; each names the folder and says to rerun ``dvc repro tokenize``.
    """
    meta_path, bin_path = folder / META_FILE, folder / TOKENS_FILE
    if not meta_path.exists() or not bin_path.exists():
        raise UserError(f"{folder}: no token file there; run the tokenize stage first (dvc repro tokenize)")
    try:
        meta = json.loads(meta_path.read_text())
        dtype, num_tokens, tokenizer_sha256 = np.dtype(meta["dtype"]), int(meta["num_tokens"]), meta["tokenizer_sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{meta_path}: unreadable token metadata ({type(err).__name__}: {err}); {FIX}") from None
    if tokenizer_sha256 != hash_paths([tokenizer_dir]):
        raise UserError(
            f"{folder} was tokenized with another tokenizer than {tokenizer_dir} ({META_FILE}: tokenizer_sha256 "
            f"differs): its ids would mean other text to this model; {FIX}"
        )
    size = bin_path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        raise UserError(
            f"{bin_path}: {size} bytes, but {META_FILE} declares {num_tokens} {dtype.name} tokens "
            f"({num_tokens * dtype.itemsize} bytes); {FIX}"
        )
    if num_tokens == 0:
        return np.zeros(0, dtype)  # mmap cannot map an empty file
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))


class PackedBlocks:
    """Fixed-length token blocks over a tokenized corpus: item i is tokens ``[i*T, (i+1)*T)`` (GPT-2 style
    packing, no padding).

    The blocks are a view of `tokens`, so over a `numpy.memmap` a block is read from disk only when it is
    indexed, and each item is converted to int64 on its own.

    Args:
        tokens: 1-D array of token ids, documents separated by eos, shape (N,): in memory or a `read_tokens` map.
        block_size: T, tokens per block.
        max_blocks: Keep only the first this many blocks (None = all).
    """

    def __init__(self, tokens: np.ndarray, block_size: int, max_blocks: int | None = None) -> None:
        self.blocks = tokens[: len(tokens) // block_size * block_size].reshape(-1, block_size)[:max_blocks]  # (B, T)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict:
        """``{"input_ids", "labels"}``: block `i` as one int64 tensor (T,) (labels shift inside the model)."""
        block = self.batch([i])[0]  # (T,)
        return {"input_ids": block, "labels": block}

    def batch(self, indices: Sequence[int]):
        """Blocks `indices` as one int64 tensor of shape (len(indices), T)."""
        import torch

        return torch.from_numpy(np.array(self.blocks[np.asarray(indices)], dtype=np.int64))


def token_blocks(folder: Path, tokenizer_dir: Path, block_size: int, max_blocks: int | None = None) -> PackedBlocks:
    """`PackedBlocks` over a token folder (`read_tokens`).

    Args:
        folder: ``<paths.data>/tokens/<split>``.
        tokenizer_dir: ``paths.tokenizer``.
        block_size: Tokens per block.
        max_blocks: Keep only the first this many blocks (None = all).

    Raises:
        UserError: `read_tokens`'s errors, or the split holds fewer tokens than one block.
    """
    tokens = read_tokens(folder, tokenizer_dir)
    blocks = PackedBlocks(tokens, block_size, max_blocks)
    if len(blocks) == 0:
        raise UserError(f"{folder}: {len(tokens)} tokens, fewer than one block of max_length={block_size}")
    return blocks
