"""MB/s of the tokenize stage's tokenise-and-pack path against raw `tokenizers` `encode_batch` on the same text.

    python benchmarks/tokenize_throughput.py               # builds data + tokenizer in a temp dir (~1 min on 2 cores)
    python benchmarks/tokenize_throughput.py --workdir DIR # a folder whose params.yaml paths already hold them
    python benchmarks/tokenize_throughput.py --rounds 7

Text: the pretraining split (``data/pretrain/train.jsonl``) that the prepare stage builds from the
interpreter's stdlib, tokenized with the BPE the tokenizer stage trains on it (both run here with the
shipped params.yaml into a temporary folder, unless `--workdir` names one that has them).

Stage path: `llmpipe.data.tokens.pack_ids` (what `write_tokens` calls on each chunk of the jsonl): tokenize
every document, append eos to each, one flat int64 array. Raw: `tokenizers.Tokenizer.from_file(tokenizer.json)`
`.encode_batch(texts, add_special_tokens=False)`, nothing more. The two alternate for `--rounds` rounds
after one warm-up each; MB are UTF-8 bytes of text (10^6), medians are printed, and the stage's token ids are
asserted equal to the raw ones with eos after each document. `write_tokens` as a whole (the tokenize stage
on one split: jsonl read in chunks, tokenize, write ``tokens.bin`` and ``meta.json``) is timed once for
reference. Target: stage/raw ≥ 0.8.

Memory, for reference: how much the anonymous resident memory (``RssAnon``: what a memory map's file pages,
shared and reclaimable page cache, do not count in) grows while the pretrain stage's training blocks are
built from the token file (`token_blocks`, what the stage does) and every block is read, against the bytes
the same blocks hold in memory as one int64 array (`pack_ids`, what the stage held for a whole run before
the tokenize stage existed; its RSS is not measured, as this process's allocator reuses the memory the
timed rounds freed).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TARGET = 0.8


def rss_anon_mb() -> float:
    """This process's anonymous resident memory in MB (10^6 bytes), from /proc/self/status (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no RssAnon in /proc/self/status")


def read_all(blocks, batch: int = 256) -> int:
    """Read every block of `blocks` (`PackedBlocks`) as a training epoch would; returns a checksum."""
    return sum(int(blocks.batch(range(i, min(i + batch, len(blocks)))).sum()) for i in range(0, len(blocks), batch))


def prepared_params(workdir: Path | None, tmp: Path):
    """Params whose data and tokenizer paths hold the pretraining split and tokenizer (built in `tmp` if needed)."""
    from llmpipe.config import load_params

    if workdir is not None:
        params = load_params(workdir / "params.yaml")
        absolute = {k: str(workdir / getattr(params.paths, k)) for k in ("data", "tokenizer")}
        return load_params(workdir / "params.yaml", {f"paths.{k}": v for k, v in absolute.items()})
    from llmpipe.stages import prepare, tokenizer

    params = load_params(
        ROOT / "params.yaml", {"paths.data": str(tmp / "data"), "paths.tokenizer": str(tmp / "tokenizer")}
    )
    start = time.perf_counter()
    prepare.run(params)
    tokenizer.run(params)
    print(f"prepare + tokenizer stages: {time.perf_counter() - start:.1f} s")
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, help="a folder with params.yaml whose data and tokenizer exist")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each path")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import numpy as np
    import torch
    from tokenizers import Tokenizer

    from llmpipe.core.io import read_jsonl
    from llmpipe.data.tokens import PackedBlocks, pack_ids, token_blocks, write_tokens
    from llmpipe.models import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        params = prepared_params(args.workdir, Path(tmp))
        train = Path(params.paths.data, "pretrain", "train.jsonl")
        texts = [row["text"] for row in read_jsonl(train)]
        megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        tokenizer = load_tokenizer(params.paths.tokenizer)
        raw = Tokenizer.from_file(str(Path(params.paths.tokenizer, "tokenizer.json")))
        print(
            f"text: {len(texts)} documents, {megabytes:.2f} MB; vocab {len(tokenizer)}; "
            f"{torch.get_num_threads()} threads"
        )

        stage_s, raw_s = [], []
        for i in range(args.rounds + 1):  # round 0 is warm-up
            start = time.perf_counter()
            flat = pack_ids(texts, tokenizer)
            t_stage = time.perf_counter() - start
            start = time.perf_counter()
            encodings = raw.encode_batch(texts, add_special_tokens=False)
            t_raw = time.perf_counter() - start
            if i:
                stage_s.append(t_stage)
                raw_s.append(t_raw)
            else:
                eos = tokenizer.eos_token_id
                expected = [t for e in encodings for t in (*e.ids, eos)]
                assert flat.dtype == np.int64 and flat.tolist() == expected, "pack_ids differs from encode_batch"
                print(
                    f"token ids identical: {len(expected):,} tokens ({megabytes * 1e6 / len(expected):.2f} bytes/token)"
                )
            del flat, encodings

        start = time.perf_counter()
        meta = write_tokens(train, Path(tmp, "tokens", "train"), tokenizer, Path(params.paths.tokenizer))
        write_s = time.perf_counter() - start

        block_size = params.pretrain.max_length
        before = rss_anon_mb()
        mapped = token_blocks(Path(tmp, "tokens", "train"), Path(params.paths.tokenizer), block_size)
        checksum = read_all(mapped)
        mapped_mb = rss_anon_mb() - before
        in_memory = PackedBlocks(pack_ids(texts, tokenizer), block_size)
        assert read_all(in_memory) == checksum, "memory-mapped blocks differ from in-memory ones"
        in_memory_mb = in_memory.blocks.nbytes / 1e6

    stage_mbs = statistics.median(megabytes / s for s in stage_s)
    raw_mbs = statistics.median(megabytes / s for s in raw_s)
    ratio = stage_mbs / raw_mbs
    print(f"\nstage pack_ids:      {stage_mbs:6.2f} MB/s  (rounds, s: {' '.join(f'{s:.2f}' for s in stage_s)})")
    print(f"raw encode_batch:    {raw_mbs:6.2f} MB/s  (rounds, s: {' '.join(f'{s:.2f}' for s in raw_s)})")
    print(
        f"write_tokens (jsonl read, tokenize, write; once): {megabytes / write_s:.2f} MB/s, {write_s:.2f} s, "
        f"{meta['num_tokens']:,} {meta['dtype']} tokens"
    )
    print(
        f"training blocks ({len(mapped)} of {block_size} tokens, every one read): memory-mapped {mapped_mb:+.1f} MB "
        f"anonymous resident; in memory as int64 they hold {in_memory_mb:.1f} MB"
    )
    print(f"\n{'PASS' if ratio >= TARGET else 'FAIL'} pack_ids / encode_batch = {ratio:.3f} (target >= {TARGET})")


if __name__ == "__main__":
    main()
