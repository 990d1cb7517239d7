"""`make smoke`: the whole DAG (`dvc repro`) on configs/tiny.yaml, in minutes, in a scratch repo `.smoke/`.

The scratch folder is a git + DVC repo of its own, made afresh on every call (the previous one is deleted):
dvc.yaml, .gitignore, flows and a copy of src/ (the stages' deps: DVC hashes them; the stages run `llm-train`
of the installed package), and params.yaml = the shipped params.yaml with configs/tiny.yaml merged over it; the run's
result (dvc.lock, metrics, reports) is committed, so `dvc exp run -S …` there has a baseline to compare with. Nothing of
the workspace's own run (data/, models/, metrics/, logs/, reports/, dvc.lock, checkpoints/) is read or written.

Usage: python scripts/smoke.py [--dir .smoke]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from llmpipe.orchestration import scratch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# Offline like `make run`; a git identity of its own so the one commit works on a machine without one.
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DVC_NO_ANALYTICS": "1",
       "GIT_AUTHOR_NAME": "llmpipe smoke", "GIT_AUTHOR_EMAIL": "smoke@localhost",
       "GIT_COMMITTER_NAME": "llmpipe smoke", "GIT_COMMITTER_EMAIL": "smoke@localhost"}


def main(argv: list[str] | None = None) -> int:
    """Make the scratch repo afresh, run `dvc repro` in it, print where the report is. Returns dvc's exit status.

    Raises:
        ValueError: ``--dir`` is the repository root or lies outside it (it is deleted first).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".smoke", help="scratch folder (recreated)")
    dest = parser.parse_args(argv).dir.resolve()
    if dest == ROOT or ROOT not in dest.parents:
        raise ValueError(f"--dir {dest}: must be a folder inside {ROOT}, e.g. .smoke")
    env = {**ENV, **os.environ}
    start = time.monotonic()
    shutil.rmtree(dest, ignore_errors=True)
    overrides = yaml.safe_load(TINY.read_text())
    scratch.make_pipeline_repo(ROOT, dest, overrides, env)
    code = subprocess.run(["dvc", "repro"], cwd=dest, env=env).returncode
    elapsed_s = time.monotonic() - start
    if code:
        print(f"smoke: dvc repro failed (exit {code}) after {elapsed_s:.0f} s; logs under {dest}/logs", file=sys.stderr)
        return code
    # Committed, so the daily loop has a baseline to compare with (dvc exp show, dvc metrics diff).
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "smoke: dvc repro on configs/tiny.yaml"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True)
    report = dest / scratch.merged_params(ROOT, overrides)["paths"]["reports"] / "report.md"
    print(f"smoke: whole DAG on configs/tiny.yaml in {elapsed_s:.0f} s; report: {os.path.relpath(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
