"""Experiments of the `full-pipeline` flow: an isolated git worktree of the repository that shares its DVC
cache, params overrides applied there, and the result saved with `dvc exp save`."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from llmpipe.config import parse_params, set_dotted

EXPERIMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
"""A DVC experiment name that is also a valid git ref component and folder name."""

def git(cwd: Path, *args: str) -> str:
    """`git <args>` in `cwd`; its stdout.

    Raises:
        RuntimeError: git failed; the message holds its stderr.
    """
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()}")
    return proc.stdout


def dvc(cwd: Path, *args: str) -> str:
    """`dvc <args>` in `cwd` with this interpreter; its stdout.

    Raises:
        RuntimeError: DVC failed; the message holds its output.
    """
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"dvc {' '.join(args)} failed in {cwd}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc.stdout


def working_copy_path(root: Path, experiment: str) -> Path:
    """Where an experiment's isolated copy lives: under .dvc/tmp (ignored by git and by DVC's stage search)."""
    return root / ".dvc" / "tmp" / "llmpipe-runs" / experiment


def check_experiment(root: Path, experiment: str, set_params: dict[str, str]) -> list[str]:
    """Validate an experiment request before any work; return the overrides as `dvc exp run -S` takes them
    (`key=value`, or `+key=value` for a valid key the file does not write out).

    The overrides are applied to a scratch copy of params.yaml with DVC's own `-S` parser and the result
    is validated like any params.yaml.

    Raises:
        ValueError: The name is invalid or taken, the repository has no commit, or the params are invalid
            (the message names the key and the fix).
    """
    from dvc.utils.hydra import apply_overrides

    if not EXPERIMENT_NAME.match(experiment):
        raise ValueError(
            f"experiment_name {experiment!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit)"
        )
    if subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root, capture_output=True).returncode:
        raise ValueError(f"{root} has no commit: an experiment is saved on top of a commit; `git commit` first")
    taken = git(root, "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps").split()
    if experiment in taken:
        raise ValueError(
            f"experiment {experiment!r} exists: choose another experiment_name or `dvc exp remove {experiment}`"
        )
    source = f"{root / 'params.yaml'} with set_params"
    raw = yaml.safe_load((root / "params.yaml").read_text())
    overrides = []
    for key, value in set_params.items():
        node = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) and part in node else KeyError
        if node is KeyError:  # not written in the file (e.g. a `train` default a stage inherits): the schema decides
            set_dotted(raw, key, value)
            parse_params(raw, source)  # an unknown key: ParamsError names it and suggests the right one
        overrides.append(f"{key}={value}" if node is not KeyError else f"+{key}={value}")
    with tempfile.TemporaryDirectory() as scratch:
        params_file = Path(scratch, "params.yaml")
        shutil.copy(root / "params.yaml", params_file)
        try:
            apply_overrides(params_file, overrides)
        except Exception as err:  # DVC/hydra: the value does not parse
            raise ValueError(f"set_params {set_params}: {err.__cause__ or err}") from None
        parse_params(yaml.safe_load(params_file.read_text()), source)  # ParamsError names the key and the fix
    return overrides


def make_working_copy(root: Path, experiment: str, overrides: list[str], logger: logging.Logger) -> Path:
    """A git worktree of `root` at HEAD that shares its DVC cache and starts from the workspace's dvc.lock,
    with `overrides` applied to its params.yaml.

    No output is checked out: `dvc repro` of a stage whose lock entry still holds restores its outputs
    from the shared run cache, and DVC git-ignores them as it does so.

    A copy left by an earlier failed or cancelled run of the same experiment at the same commit is reused,
    so its checkpoints are resumed.
    """
    from dvc.repo import Repo
    from dvc.utils.hydra import apply_overrides

    path = working_copy_path(root, experiment)
    head = git(root, "rev-parse", "HEAD").strip()
    if git(root, "status", "--porcelain", "--untracked-files=no").strip():
        logger.warning("%s has uncommitted changes: the experiment starts from the last commit, without them", root)
    if path.exists() and git(path, "rev-parse", "HEAD").strip() == head:
        logger.info("reusing the working copy %s left by an earlier run (its checkpoints are resumed)", path)
        git(path, "checkout", "--", "params.yaml")
    else:
        if path.exists():
            remove_worktree(root, path)
        path.parent.mkdir(parents=True, exist_ok=True)
        git(root, "worktree", "add", "--detach", str(path), "HEAD")
        with Repo(str(root)) as repo:
            cache_dir = repo.cache.local_cache_dir
        dvc(path, "config", "--local", "cache.dir", str(Path(cache_dir).resolve()))
        if (root / "dvc.lock").exists():
            shutil.copy(root / "dvc.lock", path / "dvc.lock")
        logger.info("made the working copy %s (git worktree at %s, DVC cache %s)", path, head[:8], cache_dir)
    apply_overrides(path / "params.yaml", overrides)
    logger.info("applied %s to %s", overrides, path / "params.yaml")
    return path


def save_experiment(workdir: Path, experiment: str, stages: list[str]) -> str:
    """`dvc exp save -n <experiment> <stages>` in the working copy; the experiment's name.

    The stages' outputs go to the shared cache; the files DVC does not git-ignore (dvc.lock, `cache: false`
    metrics and plots, .gitignore files) go into the experiment's commit, as `dvc exp run` does. Stages that
    did not run keep their lock entries from the workspace.
    """
    untracked = git(workdir, "ls-files", "--others", "--exclude-standard").split()
    include = [arg for path in untracked for arg in ("--include-untracked", path)]
    dvc(workdir, "exp", "save", "-n", experiment, *include, *stages)
    return experiment


def remove_worktree(root: Path, path: Path) -> None:
    """Remove the git worktree at `path` (files included) and git's record of it."""
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=root, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    git(root, "worktree", "prune")
