"""`llm-train dvc-yaml [--write] [--path dvc.yaml]`: llmpipe's stages and charts in dvc.yaml, rendered from the
registry (`llmpipe.orchestration.dvc_yaml`); the users' own stages, charts and comments stay as written.

Without ``--write`` it checks: exit 0 when the file is as rendered, else 1 with the diff on stdout. After adding
a stage to the registry (or changing what a stage imports), ``llm-train dvc-yaml --write`` writes its block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmpipe.orchestration import dvc_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train dvc-yaml` flags."""
    parser.add_argument("--write", action="store_true", help="rewrite the file as rendered (default: check only)")
    parser.add_argument("--path", type=Path, default=Path("dvc.yaml"), help="the dvc.yaml (default: ./dvc.yaml)")


def run(args: argparse.Namespace) -> int:
    """Check or write `args.path`; the exit code (1: it differs and was not written)."""
    if args.write:
        changed = dvc_yaml.write(args.path)
        print(f"{args.path}: {'rewritten' if changed else 'already as rendered'}", file=sys.stderr)
        return 0
    if diff := dvc_yaml.difference(args.path):
        print(diff, end="")
        print(f"{args.path} differs from its rendering: run llm-train dvc-yaml --write", file=sys.stderr)
        return 1
    return 0
