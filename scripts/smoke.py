"""`make smoke`: the whole DAG (`dvc repro`) on configs/tiny.yaml, in minutes, in a scratch repo `.smoke/`.

The scratch folder is a git + DVC repo of its own, made afresh on every call (the previous one is deleted):
dvc.yaml, .gitignore and a copy of src/ (the stages' deps: DVC hashes them; the stages run `llm-train` of the
installed package), and params.yaml = the shipped params.yaml with configs/tiny.yaml merged over it. Nothing of
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

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
COPIED = ("src", "dvc.yaml", ".gitignore")
# Offline like `make run`; a git identity of its own so the one commit works on a machine without one.
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DVC_NO_ANALYTICS": "1",
       "GIT_AUTHOR_NAME": "llmpipe smoke", "GIT_AUTHOR_EMAIL": "smoke@localhost",
       "GIT_COMMITTER_NAME": "llmpipe smoke", "GIT_COMMITTER_EMAIL": "smoke@localhost"}


def deep_merge(base: dict, over: dict) -> dict:
    """`base` with `over` merged in, recursively for mappings present in both (as tests/conftest.py does)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def tiny_params() -> dict:
    """The shipped params.yaml with configs/tiny.yaml merged over it."""
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    return deep_merge(shipped, yaml.safe_load(TINY.read_text()))


def make_repo(dest: Path, env: dict[str, str]) -> None:
    """Replace `dest` with a committed git + DVC repo holding the DAG, its code deps and the tiny params.

    Raises:
        ValueError: `dest` is the repository root or lies outside it (it is deleted first).
    """
    if dest == ROOT or ROOT not in dest.parents:
        raise ValueError(f"--dir {dest}: must be a folder inside {ROOT}, e.g. .smoke")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(src, dest / name)
    (dest / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "smoke: shipped params + configs/tiny.yaml"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    """Make the scratch repo, run `dvc repro` in it, print where the report is. Returns dvc's exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=ROOT / ".smoke", help="scratch folder (recreated)")
    dest = parser.parse_args(argv).dir.resolve()
    env = {**ENV, **os.environ}
    start = time.monotonic()
    make_repo(dest, env)
    code = subprocess.run(["dvc", "repro"], cwd=dest, env=env).returncode
    elapsed_s = time.monotonic() - start
    if code:
        print(f"smoke: dvc repro failed (exit {code}) after {elapsed_s:.0f} s; logs under {dest}/logs", file=sys.stderr)
        return code
    report = dest / tiny_params()["paths"]["reports"] / "report.md"
    print(f"smoke: whole DAG on configs/tiny.yaml in {elapsed_s:.0f} s; report: {os.path.relpath(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
