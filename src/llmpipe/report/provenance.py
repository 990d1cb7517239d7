"""Where a run came from: git commit and dirty flag, a hash of the params the stages ran with, the data and model
hashes DVC recorded in ``dvc.lock``, package versions and the hardware. Read without importing torch, so the report
stays quick."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

PACKAGES = ("llmpipe", "torch", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers", "lm_eval",
            "dvc", "prefect")
"""The packages whose versions the card lists."""


@dataclass(frozen=True)
class Provenance:
    """What the card's provenance section shows.

    Attributes:
        commit: ``git rev-parse HEAD``, or None outside a git repository.
        dirty: Tracked files that differ from that commit (``git status --porcelain --untracked-files=no``), the
            pipeline's own outputs and ``dvc.lock`` aside (a run rewrites those); None outside git.
        params_hash: sha256 (first 12 hex digits) of every stage's params as ``dvc.lock`` records them; None without
            a ``dvc.lock``.
        outputs: ``{path: md5}`` of the stage outputs in ``dvc.lock`` outside the metrics, logs and reports folders
            (data, tokenizer, models; DVC's own hashes).
        packages: ``{name: version}``; absent when not installed.
        hardware: ``{what: description}``: machine, CPU, cores, memory, GPUs.
    """

    commit: str | None
    dirty: list[str] | None
    params_hash: str | None
    outputs: dict[str, str]
    packages: dict[str, str]
    hardware: dict[str, str]


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def read_lock(root: Path) -> dict[str, Any]:
    """The stages of ``root/dvc.lock`` (``{stage: {cmd, deps, params, outs}}``); empty when there is none (a hand
    run outside DVC)."""
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    return (yaml.safe_load(lock.read_text()) or {}).get("stages", {})


def lock_outputs(lock: dict[str, Any]) -> dict[str, str]:
    """``{path: md5}`` of every output recorded in `lock` that DVC hashed (cache: false JSON files included)."""
    return {out["path"]: out["md5"] for stage in lock.values() for out in stage.get("outs", []) if "md5" in out}


def params_hash(lock: dict[str, Any]) -> str | None:
    """sha256 (12 hex digits) of the params every stage in `lock` ran with; None when `lock` is empty."""
    if not lock:
        return None
    used = {name: stage.get("params", {}) for name, stage in sorted(lock.items())}
    return hashlib.sha256(json.dumps(used, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> str:
    """``nvidia-smi``'s names and memory of the local GPUs, or "none" (no torch import: the report stays quick)."""
    if shutil.which("nvidia-smi") is None:
        return "none"
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (nvidia-smi failed)"
    return "; ".join(line.strip() for line in proc.stdout.splitlines() if line.strip()) or "none"


def hardware() -> dict[str, str]:
    """The machine the report runs on (the pipeline's own, under `dvc repro`)."""
    memory = ""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        memory = f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    return {
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu": _cpu_model(),
        "cpu cores": str(os.cpu_count()),
        "memory": memory or "unknown",
        "gpus": _gpus(),
        "python": platform.python_version(),
    }


def packages() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return found


def changed_sources(status: str, outputs: list[str]) -> list[str]:
    """The paths of ``git status --porcelain`` output `status` that are not `outputs` (files or folders) nor
    ``dvc.lock``."""
    changed = [line.split(None, 1)[1].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    prefixes = tuple(o.rstrip("/") + "/" for o in outputs)
    return [p for p in changed if p != "dvc.lock" and p not in outputs and not p.startswith(prefixes)]


def collect(root: Path, own_outputs: list[str]) -> Provenance:
    """The provenance of the run in the repository (or folder) `root`.

    Args:
        root: Where dvc.lock and the git work tree are.
        own_outputs: Paths (relative to `root`) the pipeline writes besides those dvc.lock lists (the report's own
            outputs, the metrics and logs folders): a change there does not make the source dirty.
    """
    lock = read_lock(root)
    outputs = lock_outputs(lock)
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    dirty = None if status is None else changed_sources(status, [*outputs, *own_outputs])
    own = tuple(o.rstrip("/") + "/" for o in own_outputs)
    data_and_models = {path: md5 for path, md5 in outputs.items() if not path.startswith(own)}
    return Provenance(commit, dirty, params_hash(lock), data_and_models, packages(), hardware())
