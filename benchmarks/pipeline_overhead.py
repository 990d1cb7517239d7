"""What the pipeline costs around the work: a `dvc repro` with nothing to do, and a stage's start-up.

    python benchmarks/pipeline_overhead.py            # builds the tests' tiny repo in a temp dir and reproduces
                                                      # it once (~3 min on 2 cores)
    python benchmarks/pipeline_overhead.py --repo DIR # an llmpipe checkout whose pipeline is up to date
    python benchmarks/pipeline_overhead.py --runs 5 --stages sft

No-op repro: `dvc repro` (the whole DAG) in a repo where every stage is up to date, `--runs` times; its
output must say nothing ran. Target: median < 3 s.

Stage start-up (`--stages`, default pretrain and sft): the time from starting `llm-train --task <stage>` (as a
hand run with `--output-dir` in a temporary folder, so the DVC outputs stay up to date and the run starts fresh)
to its log line ``<stage>: first step done``, which `llmpipe.train.callbacks.FirstStepLog` writes when the first
optimizer step has ended; the process is then killed. Each of the stage's log lines is timestamped on arrival,
which splits start-up into imports and params, the stage's inputs read, model and trainer set-up, and the first
step, and the CPU time the process used (user + system, all threads), which a shared machine's load inflates less
than the wall time. Target for sft: minimum < 3 s on an idle 2-core machine (the minimum, because a shared machine
only ever adds time). A fresh interpreter's import of `llmpipe.stages.<stage>`, and of torch, transformers and the
Trainer (which the second and third phases include), is timed apart.
Medians and minima over `--runs`. With the tiny repo the stage trains the tests' tiny params (a 2-layer Llama
on a 1k BPE).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_NOOP_S = 3.0
TARGET_STARTUP_S = 3.0
FIRST_STEP = "first step done"
# Per stage, the log messages (prefixes after "<stage>: ", in the order they come) that end each phase of
# start-up; "" is the stage's first line. The first phase ends at the cli's own line.
PHASES = {
    "pretrain": {
        "": "params, tokenizer, token files mapped (token_blocks)",
        "fresh run": "checkpoint fingerprint, model built, Trainer made",
        FIRST_STEP: "trainer.train set-up and the first step",
    },
    "sft": {
        "": "params, stage imports, tokenizer, SFT data read and counted",
        "fresh run": "model loaded, checkpoint fingerprint, SFTTrainer made (tokenises the data)",
        FIRST_STEP: "trainer.train set-up and the first step",
    },
}
CLI_LINE = "hand run with overrides"
CPU = "cpu"


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


def startup(repo: Path, env: dict[str, str], out: Path, stage: str) -> dict[str, float]:
    """Start `llm-train --task <stage>`; seconds from start to each phase line; kill it after the first step."""
    cmd = [*command("llm-train", "llmpipe.cli"), "--task", stage, "--output-dir", str(out)]
    cpu_before = _children_cpu_s()
    prefixes = {CLI_LINE: CLI_LINE, **{f"{stage}: {p}": p for p in PHASES[stage]}}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stderr:  # logging writes to stderr, unbuffered
        now = time.perf_counter() - start
        lines.append(line)
        message = line.partition(": ")[2]  # format: "<time> <level> <logger>: <message>"
        for prefix, phase in prefixes.items():
            if phase not in seen and message.startswith(prefix):
                seen[phase] = now
        if FIRST_STEP in seen:
            break
    proc.kill()
    proc.wait()
    if FIRST_STEP not in seen:
        raise SystemExit(f"llm-train --task {stage} ended before its first step:\n" + "".join(lines[-40:]))
    seen[CPU] = _children_cpu_s() - cpu_before
    return seen


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def report_startup(repo: Path, env: dict[str, str], tmp: str, stage: str, num_runs: int) -> float:
    """Print the phases of `stage`'s start-up (medians) and its start-up to first step; return the minimum."""
    runs = [startup(repo, env, Path(tmp, f"startup-{stage}-{i}"), stage) for i in range(num_runs)]
    print(f"llm-train --task {stage}, seconds from process start (median over runs):")
    before = 0.0
    for phase, what in {CLI_LINE: "python start, cli imports", **PHASES[stage]}.items():
        at = statistics.median(r[phase] for r in runs)
        print(f"  {at:6.2f} s  (+{at - before:5.2f})  {what}")
        before = at
    stage_import = [import_s(env, f"import llmpipe.cli, llmpipe.stages.{stage}") for _ in range(num_runs)]
    print(f"  (import llmpipe.stages.{stage} in a fresh process: {_figures(stage_import)})")
    first = [r[FIRST_STEP] for r in runs]
    print(f"start-up to first step, {stage}: {_figures(first)}")
    print(f"  CPU time of that process (up to the kill; less sensitive to a shared machine's load): "
          f"{_figures([r[CPU] for r in runs])}")
    return min(first)


def _figures(seconds: list[float]) -> str:
    runs = " ".join(f"{s:.2f}" for s in seconds)
    return f"min {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s (runs: {runs})"


TRAINER_IMPORT = "import torch, transformers; from transformers import AutoTokenizer, Trainer, TrainingArguments"


def import_s(env: dict[str, str], code: str = TRAINER_IMPORT) -> float:
    """Seconds a fresh interpreter takes to run `code` (by default: import torch and the Trainer)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repo", type=Path, help="an llmpipe checkout with an up-to-date pipeline (default: tiny repo)"
    )
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each measurement")
    parser.add_argument(
        "--stages", nargs="*", choices=sorted(PHASES), default=list(PHASES), help="stages whose start-up to time"
    )
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

        firsts = {stage: report_startup(repo, env, tmp, stage, args.runs) for stage in args.stages}
        imports = [import_s(env) for _ in range(args.runs)]
        print(f"(import torch, transformers and the Trainer in a fresh process: {_figures(imports)})")
    median = statistics.median(noop)
    print(
        f"\n{'PASS' if median < TARGET_NOOP_S else 'FAIL'} no-op dvc repro = {median:.2f} s "
        f"(target < {TARGET_NOOP_S:g} s)"
    )
    if "sft" in firsts:
        print(
            f"{'PASS' if firsts['sft'] < TARGET_STARTUP_S else 'FAIL'} sft start-up to first step = "
            f"{firsts['sft']:.2f} s (minimum; target < {TARGET_STARTUP_S:g} s on an idle 2-core machine)"
        )


if __name__ == "__main__":
    main()
