"""What the pipeline costs around the work: a `dvc repro` with nothing to do, and a stage's start-up.

    python benchmarks/pipeline_overhead.py            # builds the tests' tiny repo in a temp dir and reproduces
                                                      # it once (~3 min on 2 cores)
    python benchmarks/pipeline_overhead.py --repo DIR # an llmpipe checkout whose pipeline is up to date
    python benchmarks/pipeline_overhead.py --runs 5

No-op repro: `dvc repro` (the whole DAG) in a repo where every stage is up to date, `--runs` times; its
output must say nothing ran. Target: median < 3 s.

Stage start-up: the time from starting `llm-train --task pretrain` (as a hand run with `--output-dir` in a
temporary folder, so the DVC outputs stay up to date and the run starts fresh) to its log line
``pretrain: first step done``, which `llmpipe.train.loop.train_stage` writes when the first optimizer step
has ended; the process is then killed. Each of the stage's log lines is timestamped on arrival, which
splits start-up into imports and params, token files mapped, model and trainer set-up, and the first step.
A fresh interpreter's import of torch, transformers and the Trainer (which the second and third phases
include) is timed apart.
Medians over `--runs`. With the tiny repo the stage trains the tests' tiny params (a 2-layer Llama on a 1k BPE).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_NOOP_S = 3.0
# The stage's log messages (prefixes, in the order they come) that end each phase of start-up.
PHASES = {
    "hand run with overrides": "python start, cli imports",
    "pretrain: ": "params, tokenizer, token files mapped (token_blocks)",
    "pretrain: fresh run": "checkpoint fingerprint, model built, Trainer made",
    "pretrain: first step done": "trainer.train set-up and the first step",
}


def tiny_repo(dest: Path, env: dict[str, str]) -> Path:
    """The tests' tiny git + DVC repo of this checkout (tests/conftest.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_pipeline_repo

    return make_pipeline_repo(dest, env)


def command(name: str, module: str) -> list[str]:
    """The console script `name` next to this interpreter, else ``python -m module``."""
    script = Path(sys.executable).with_name(name)
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def repro(repo: Path, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(
        [*command("dvc", "dvc"), "repro"], check=False, cwd=repo, env=env, capture_output=True, text=True
    )
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"dvc repro failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return took, proc.stdout + proc.stderr


def startup(repo: Path, env: dict[str, str], out: Path) -> dict[str, float]:
    """Start `llm-train --task pretrain`; seconds from start to each phase line; kill it after the first step."""
    cmd = [*command("llm-train", "llmpipe.cli"), "--task", "pretrain", "--output-dir", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stderr:  # logging writes to stderr, unbuffered
        now = time.perf_counter() - start
        lines.append(line)
        message = line.partition(": ")[2]  # format: "<time> <level> <logger>: <message>"
        for prefix in PHASES:
            if prefix not in seen and message.startswith(prefix):
                seen[prefix] = now
        if "pretrain: first step done" in seen:
            break
    proc.kill()
    proc.wait()
    if "pretrain: first step done" not in seen:
        raise SystemExit("llm-train ended before its first step:\n" + "".join(lines[-40:]))
    return seen


def import_s(env: dict[str, str]) -> float:
    """Seconds a fresh interpreter takes to import what the stage imports before its data (torch, the Trainer)."""
    code = "import torch, transformers; from transformers import AutoTokenizer, Trainer, TrainingArguments"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repo", type=Path, help="an llmpipe checkout with an up-to-date pipeline (default: tiny repo)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each measurement")
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DVC_NO_ANALYTICS="1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.repo:
            repo = args.repo.resolve()
        else:
            env.update(
                GIT_AUTHOR_NAME="bench",
                GIT_COMMITTER_NAME="bench",
                GIT_AUTHOR_EMAIL="bench@example.invalid",
                GIT_COMMITTER_EMAIL="bench@example.invalid",
                HF_HOME=str(Path(tmp, "hf_home")),
            )
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
            repo = tiny_repo(Path(tmp, "repo"), env)
            took, _ = repro(repo, env)
            print(f"first dvc repro of the tiny repo (every stage): {took:.1f} s")

        noop = []
        for _ in range(args.runs):
            took, output = repro(repo, env)
            ran = re.findall(r"Running stage '([^']+)'", output)
            if ran:
                raise SystemExit(f"{repo}: not up to date, dvc repro ran {ran}; reproduce it first")
            noop.append(took)
        print(f"no-op dvc repro: median {statistics.median(noop):.2f} s (runs: {' '.join(f'{s:.2f}' for s in noop)})")

        runs = [startup(repo, env, Path(tmp, f"startup-{i}")) for i in range(args.runs)]
        print("llm-train --task pretrain, seconds from process start (median over runs):")
        before = 0.0
        for prefix, phase in PHASES.items():
            at = statistics.median(r[prefix] for r in runs)
            print(f"  {at:6.2f} s  (+{at - before:5.2f})  {phase}")
            before = at
        first = [r["pretrain: first step done"] for r in runs]
        imports = statistics.median(import_s(env) for _ in range(args.runs))
        print(
            f"  (phases 2 and 3 include importing torch, transformers and the Trainer: "
            f"{imports:.2f} s in a fresh process)"
        )
        print(
            f"start-up to first step: median {statistics.median(first):.2f} s "
            f"(runs: {' '.join(f'{s:.2f}' for s in first)})"
        )
    median = statistics.median(noop)
    print(
        f"\n{'PASS' if median < TARGET_NOOP_S else 'FAIL'} no-op dvc repro = {median:.2f} s "
        f"(target < {TARGET_NOOP_S:g} s)"
    )


if __name__ == "__main__":
    main()
