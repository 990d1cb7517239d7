"""What resuming costs: process start to the first training step, resuming at step 10 and at step 1,000.

    python benchmarks/resume_overhead.py             # the tests' tiny repo in a temp dir (~3 min on 2 cores)
    python benchmarks/resume_overhead.py --runs 5

A resumed run must not pay for the steps already done: the HF Trainer skips the batches of the current epoch
in index space (`accelerate.skip_first_batches` over a seeded sampler: no batch is loaded or collated), so
time to first step should not grow with the step resumed. One pretrain run of the tests' tiny params (a 2-layer
Llama, 4 blocks of 128 tokens per step, 1,000 steps inside the first epoch) keeps a checkpoint every 10 steps;
then `llm-train --task pretrain --resume-from …/checkpoint-N` is started for N = 10 and N = 1,000, alternating,
and timed from process start to its log line ``pretrain: first step done``, then killed. Medians over
`--runs`. Target: the step-1,000 median within 1.2× of the step-10 median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import yaml
from pipeline_overhead import ROOT, command, tiny_repo

TARGET_RATIO = 1.2
STEPS = 1000
SCHEDULE = {"max_steps": STEPS, "save_steps": 10, "save_total_limit": STEPS, "eval_steps": STEPS,
            "logging_steps": 100}  # fmt: skip


def first_step_s(repo: Path, env: dict[str, str], root: Path, checkpoint: Path) -> float:
    """Seconds from starting a run that resumes `checkpoint` to its first optimizer step (then killed)."""
    cmd = [*command("llm-train", "llmpipe.cli"), "--task", "pretrain", "--output-dir", str(root),
           "--resume-from", str(checkpoint), "--steps-per-epoch", str(STEPS + 100)]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "pretrain: first step done" in line:
            took = time.perf_counter() - start
            proc.kill()
            proc.wait()
            return took
    raise SystemExit("llm-train ended before its first step:\n" + "".join(lines[-40:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed resumes at each step")
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", DVC_NO_ANALYTICS="1",
               GIT_AUTHOR_NAME="bench", GIT_COMMITTER_NAME="bench", GIT_AUTHOR_EMAIL="bench@example.invalid",
               GIT_COMMITTER_EMAIL="bench@example.invalid")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        env["HF_HOME"] = str(Path(tmp, "hf_home"))
        repo = tiny_repo(Path(tmp, "repo"), env)
        params = yaml.safe_load((repo / "params.yaml").read_text())
        params["pretrain"] = {**params["pretrain"], **SCHEDULE}
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for stage in ("prepare", "tokenizer", "tokenize"):
            subprocess.run([*command("dvc", "dvc"), "repro", "--single-item", stage], check=True, cwd=repo, env=env,
                           capture_output=True)  # fmt: skip
        root = Path(tmp, "run")
        start = time.perf_counter()
        subprocess.run([*command("llm-train", "llmpipe.cli"), "--task", "pretrain", "--output-dir", str(root)],
                       check=True, cwd=repo, env=env, capture_output=True)  # fmt: skip
        print(f"pretrain, {STEPS} steps with a checkpoint every 10: {time.perf_counter() - start:.1f} s")
        (run,) = (root / "checkpoints" / "pretrain").iterdir()
        times: dict[int, list[float]] = {10: [], STEPS: []}
        for _ in range(args.runs):
            for step, runs in times.items():
                runs.append(first_step_s(repo, env, root, run / f"checkpoint-{step}"))
    for step, runs in times.items():
        print(f"resume at step {step:>5}: process start to first step, median {statistics.median(runs):.2f} s "
              f"(runs: {' '.join(f'{s:.2f}' for s in runs)})")  # fmt: skip
    ratio = statistics.median(times[STEPS]) / statistics.median(times[10])
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    print(f"\n{verdict} resume at step {STEPS} / at step 10 = {ratio:.2f}x (target <= {TARGET_RATIO}x)")


if __name__ == "__main__":
    main()
