"""Documents/s and MB/s of `Deduplicator.check` (exact + MinHash-LSH near + Bloom lookups) on ~10 MB of text.

    python benchmarks/dedup_throughput.py                    # the defaults of data.dedup
    python benchmarks/dedup_throughput.py --megabytes 20 --num-perm 256

Text: the stdlib modules of this interpreter in path order (what `prepare` reads by default) until `--megabytes`
MB of UTF-8 (10^6 bytes), checked twice: as whole modules (≈14 KB each) and cut into 2,000-character pieces (the
size of a typical web document). Each pass uses a fresh `Deduplicator`, after one warm-up document; a pass is
one process on one core (the work is pure Python plus numpy). Also printed: the share of time in normalising
and shingling, and the size of the state a checkpoint would hold.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PIECE_CHARS = 2000


def stdlib_texts(megabytes: float) -> list[str]:
    """Module sources in path order until their UTF-8 size reaches `megabytes`."""
    from llmpipe.data.stdlib import module_paths, stdlib_root

    root, texts, size = stdlib_root(), [], 0
    for rel in module_paths(root):
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        texts.append(text)
        size += len(text.encode())
        if size >= megabytes * 1e6:
            break
    return texts


def run_pass(name: str, texts: list[str], params) -> None:
    from llmpipe.data.dedup import Deduplicator, normalise, shingles

    dedup = Deduplicator(params)
    dedup.index_keys("warm up the hashing and numpy paths")
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    start = time.perf_counter()
    for text in texts:
        dedup.check(text)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    for text in texts:
        shingles(normalise(text), params.shingle_size)
    prep = time.perf_counter() - start
    print(
        f"{name}: {len(texts)} documents, {megabytes:.2f} MB in {seconds:.2f} s → {len(texts) / seconds:,.0f} docs/s, "
        f"{megabytes / seconds:.2f} MB/s; normalise + shingle {prep / seconds:.0%} of it; "
        f"kept {dedup.num_kept}, dropped exact {dedup.num_dropped_exact}, near {dedup.num_dropped_near}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=10.0, help="MB of text to check")
    parser.add_argument("--num-perm", type=int, help="data.dedup.num_perm (default: the params default)")
    args = parser.parse_args()

    from llmpipe.config import DedupParams
    from llmpipe.data.dedup import Deduplicator

    params = DedupParams(**({"num_perm": args.num_perm} if args.num_perm else {}))
    dedup = Deduplicator(params)
    print(f"data.dedup defaults but num_perm={params.num_perm}: b={dedup.bands} bands × r={dedup.rows} rows; "
          f"state of an empty index {len(dedup.state()) / 1e6:.1f} MB (capacity {params.capacity:,} documents)")
    texts = stdlib_texts(args.megabytes)
    run_pass("modules", texts, params)
    pieces = [t[i : i + PIECE_CHARS] for t in texts for i in range(0, len(t), PIECE_CHARS)]
    run_pass(f"{PIECE_CHARS}-char pieces", pieces, params)


if __name__ == "__main__":
    main()
