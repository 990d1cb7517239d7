"""The streaming data path at two corpus sizes: peak memory, time to first batch, throughput, cache files.

Runs the whole path of `data.streaming: true` — read (datasets streaming) → held-out filter → dedup → shuffle
buffer → tokenise → pack → DataLoader — with no model, over a generated jsonl corpus of each size, each size in
a fresh process (so peak RSS is that size's alone), reading the corpus once to its end. It prints per size:
peak RSS (MB), time to first batch (s), MB/s, tokens, and the files `datasets` left in its cache folder; then
the 2 GB / 200 MB ratios the streaming design promises (RSS within 10%, first batch within 1.2×).

    python benchmarks/stream_memory.py                       # 200 MB and 2000 MB, in /tmp/llmpipe-stream-bench
    python benchmarks/stream_memory.py --sizes-mb 20 200     # a quicker look

The corpus is synthetic English-like text (Zipf-distributed words, documents of 1–8 KB) in 100 MB shards, with
1% exact duplicates planted for the deduplicator; it is generated once per size and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARD_MB = 100


def generate(folder: Path, size_mb: int, seed: int = 0) -> None:
    """Write `size_mb` MB of jsonl documents into `folder` (skipped when a finished corpus is there)."""
    import numpy as np

    done = folder / ".done"
    if done.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    words = rng.choice(len(vocab), size=50000 * 25, p=weights)  # one draw: a per-sentence draw with p is slow
    lengths = rng.integers(6, 25, size=50000)
    sentences = [" ".join(vocab[w] for w in words[i * 25 : i * 25 + n]).capitalize() + "."
                 for i, n in enumerate(lengths)]
    written, shard, recent = 0, 0, []
    while written < size_mb * 2**20:
        with open(folder / f"part-{shard:04d}.jsonl", "w") as fh:
            shard_bytes = 0
            while shard_bytes < SHARD_MB * 2**20 and written + shard_bytes < size_mb * 2**20:
                if recent and rng.random() < 0.01:
                    text = recent[rng.integers(len(recent))]  # a planted exact duplicate
                else:
                    idx = rng.integers(0, len(sentences), size=rng.integers(10, 70))
                    text = " ".join(sentences[i] for i in idx)
                    recent = (recent + [text])[-100:]
                line = json.dumps({"text": text}) + "\n"
                fh.write(line)
                shard_bytes += len(line)
        written += shard_bytes
        shard += 1
    done.touch()


def train_tokenizer(corpus: Path, dest: Path) -> None:
    """A 4096-token byte-level BPE from the corpus's first shard (the pipeline's tokenizer stage, in short)."""
    if (dest / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for line in open(sorted(corpus.glob("*.jsonl"))[0])][:2000]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|eos|>", "<|pad|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|pad|>").save_pretrained(dest)


def child(corpus: Path, tokenizer: Path, dedup: str) -> dict:
    """Read the whole corpus through the stream once; returns the figures (run in a fresh process)."""
    import torch
    from transformers import AutoTokenizer

    from llmpipe.config import DataParams
    from llmpipe.data.stream import packing
    from llmpipe.data.stream.filter import deduplicator

    start = time.perf_counter()
    data = DataParams(source="hf", streaming=True, hf={"dataset_name": str(corpus)},
                      dedup={"none": {"exact": False, "near": False, "decontaminate": False},
                             "exact": {"near": False}, "near": {}}[dedup])
    tok = AutoTokenizer.from_pretrained(tokenizer)
    with tempfile.TemporaryDirectory() as scratch:
        dedup_obj = deduplicator(data, references=[])
        stream = packing.build(data, tok, 1024, 0, 1, scratch, dedup_obj)
        loader = torch.utils.data.DataLoader(stream, batch_size=16, num_workers=0)
        first = None
        for _ in loader:
            if first is None:
                first = time.perf_counter() - start
            if any(s.epoch for s in stream.documents.streams):
                break
    total = time.perf_counter() - start
    size_mb = sum(f.stat().st_size for f in corpus.glob("*.jsonl")) / 2**20
    return {
        "size_mb": round(size_mb, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "first_batch_s": round(first, 2),
        "total_s": round(total, 1),
        "mb_per_s": round(size_mb / total, 2),
        "counts": stream.filters.counts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[200, 2000])
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llmpipe-stream-bench")
    p.add_argument("--dedup", choices=["none", "exact", "near"], default="exact")
    p.add_argument("--child", nargs=2, metavar=("CORPUS", "TOKENIZER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(Path(args.child[0]), Path(args.child[1]), args.dedup)))
        return
    results = []
    for size in args.sizes_mb:
        corpus = args.workdir / f"corpus-{size}mb"
        generate(corpus, size)
        train_tokenizer(args.workdir / f"corpus-{min(args.sizes_mb)}mb", args.workdir / "tokenizer")
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "HF_DATASETS_CACHE": cache, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
            out = subprocess.run([sys.executable, __file__, "--dedup", args.dedup, "--child", str(corpus),
                                  str(args.workdir / "tokenizer")], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(out.stderr[-3000:])
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result["cache_files"] = [str(f.relative_to(cache)) for f in Path(cache).rglob("*") if f.is_file()]
        results.append(result)
        print(json.dumps(result))
    if len(results) >= 2:
        small, big = results[0], results[-1]
        rss, first = big["peak_rss_mb"] / small["peak_rss_mb"], big["first_batch_s"] / small["first_batch_s"]
        print(f"peak RSS {big['size_mb']:.0f} MB vs {small['size_mb']:.0f} MB corpus: "
              f"{big['peak_rss_mb']:.0f} / {small['peak_rss_mb']:.0f} MB = {rss:.3f}x")
        print(f"time to first batch: {big['first_batch_s']:.2f} / {small['first_batch_s']:.2f} s = {first:.2f}x")
        print(f"throughput: {small['mb_per_s']} and {big['mb_per_s']} MB/s")
        print(f"{'PASS' if abs(rss - 1) <= 0.10 else 'FAIL'}: peak RSS within 10% across sizes")
        print(f"{'PASS' if first <= 1.2 else 'FAIL'}: time to first batch within 1.2x")
        print(f"{'PASS' if not any(r['cache_files'] for r in results) else 'FAIL'}: no files in the datasets cache")


if __name__ == "__main__":
    main()
