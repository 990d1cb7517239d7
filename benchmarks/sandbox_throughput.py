"""Programs per second through the sandbox (`llmpipe.core.sandbox.run_many`): a generated task's reference body and
its hidden tests, one process each, on a pool sized to the cores.

    python benchmarks/sandbox_throughput.py                  # 200 programs, workers = the cores
    python benchmarks/sandbox_throughput.py --num 400 --workers 1

What a GRPO step or an evaluation pays per completion scored by `tests_pass`. Prints the rate, the mean wall time
of one program and the machine's core count; on a shared machine the figure is load-inflated. Target: at least
:data:`TARGET` programs/s, so that scoring a GRPO step of 16 completions costs under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

TARGET = 16.0
"""Programs per second the sandbox must run (PASS/FAIL)."""

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    from llmpipe.config import DataParams
    from llmpipe.core.sandbox import run_many
    from llmpipe.data.tasks.mixing import build_tasks
    from llmpipe.data.tasks.records import program_of

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--workers", type=int, default=None, help="default: the cores")
    args = parser.parse_args()
    tasks = build_tasks(DataParams(tasks={"num_train": args.num}))["train"]
    jobs = [(program_of(t["prompt"], t["canonical_solution"]), t["tests"]) for t in tasks]
    run_many(jobs[:4], workers=args.workers)  # warm the page cache
    start = time.perf_counter()
    outcomes = run_many(jobs, workers=args.workers)
    wall = time.perf_counter() - start
    workers = args.workers or os.cpu_count()
    assert all(o.passed == o.total for o in outcomes), "a reference failed its tests"
    print(f"{len(jobs) / wall:.1f} programs/s ({len(jobs)} programs of {len(jobs[0][1])} tests, {workers} workers, "
          f"{os.cpu_count()} cores; {1000 * wall * workers / len(jobs):.0f} ms per program per worker)")
    rate = len(jobs) / wall
    print(f"{'PASS' if rate >= TARGET else 'FAIL'}: {rate:.1f} programs/s (target >= {TARGET:g})")


if __name__ == "__main__":
    main()
