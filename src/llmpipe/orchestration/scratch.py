"""A scratch pipeline repository: a git + DVC repo holding this project's DAG, its code and flows, and the shipped
params.yaml with overrides merged in, committed once. `make smoke` runs the whole DAG in one; the end-to-end
tests run theirs in temporary folders."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from llmpipe.report import plots_page

REPO_FILES = ("src", "flows", "dvc.yaml", "prefect.yaml", ".gitignore", ".dvcignore")
"""What a scratch repo holds besides params.yaml and DVC's config (with the offline plots page of
:mod:`llmpipe.report.plots_page`): the DAG, the code its stages hash as deps, and the flows."""


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`base` with `over` merged in, recursively for mappings present in both (a list or scalar replaces)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def merged_params(root: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The shipped ``root/params.yaml`` with `overrides` merged over it."""
    return deep_merge(yaml.safe_load((root / "params.yaml").read_text()), overrides)


def make_pipeline_repo(root: Path, dest: Path, overrides: dict[str, Any], env: dict[str, str]) -> Path:
    """Fill the empty or missing folder `dest` with a committed git + DVC repo of `root`'s pipeline.

    Args:
        root: The llmpipe checkout to copy (:data:`REPO_FILES` and params.yaml).
        dest: Where the repo goes; it must not exist yet or be empty.
        overrides: Params merged over the shipped params.yaml (e.g. configs/tiny.yaml).
        env: Environment of the git and dvc commands (a git identity where the machine has none).

    Returns:
        `dest`.

    Raises:
        subprocess.CalledProcessError: git or dvc failed (its output is in the error).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name in REPO_FILES:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif src.exists():
            shutil.copy(src, dest / name)
    (dest / "params.yaml").write_text(yaml.safe_dump(merged_params(root, overrides), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"],
                ["dvc", "config", "plots.html_template", plots_page.TEMPLATE_NAME]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True, text=True)
    template = root / ".dvc" / plots_page.TEMPLATE_NAME
    if template.exists():  # made by `make install`; else made here (seconds)
        shutil.copy(template, dest / ".dvc" / plots_page.TEMPLATE_NAME)
    else:
        plots_page.write(dest / ".dvc" / plots_page.TEMPLATE_NAME)
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, capture_output=True, text=True)
    return dest
