"""A metrics file's run identity: which params and inputs produced it, so that the report card leaves out a file
another run wrote (the clone's committed files of the default run, a stage not rerun after a params change).

The identity of a stage (``evaluate`` with the evaluated model) is one short hash per params section or key the
registry says it reads (those dvc.yaml lists, ``paths`` aside: they say where files are, and the inputs are hashed
by content) and one per input path, of its content (``<missing>`` when it does not exist). The CLI records it under
:data:`IDENTITY_KEY` in every metrics file it writes; :func:`differences` names what changed since. Unlike a training
run's checkpoint fingerprint (`llmpipe.train.checkpoints.identity`), it leaves out llmpipe's code (a fix does not
make finished results belong to other params) and keeps the step budgets (fewer steps are other results).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pydantic import BaseModel

from llmpipe.config.stages import REGISTRY, resolve_template
from llmpipe.core.errors import UserError
from llmpipe.core.io import hash_paths

IDENTITY_KEY = "run_identity"
"""The key of a metrics file that holds its run identity."""

MISSING = "<missing>"


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _short(value: Any) -> str:
    return hashlib.sha256(json.dumps(_plain(value), sort_keys=True, default=str).encode()).hexdigest()[:16]


def _dotted(params: Any, key: str) -> Any:
    for part in key.split("."):
        params = getattr(params, part)
    return params


def content_hash(path: Path, cache: dict[str, str] | None = None) -> str:
    """16 hex characters of :func:`llmpipe.core.io.hash_paths` over `path`, or :data:`MISSING`; memoised in
    `cache` (one report hashes each input folder once)."""
    key = str(path)
    if cache is not None and key in cache:
        return cache[key]
    try:
        digest = hash_paths([path])[:16]
    except UserError:  # hash_paths refuses a missing input
        digest = MISSING
    if cache is not None:
        cache[key] = digest
    return digest


def run_identity(params: Any, task: str, model: str | None = None, cache: dict[str, str] | None = None
                 ) -> dict[str, str]:
    """The identity of stage `task` (of the evaluation of `model`) under `params`.

    Args:
        params: Validated :class:`~llmpipe.config.Params`.
        task: A registered stage.
        model: For ``evaluate``: the evaluated model (its ``${item.model}``).
        cache: Content hashes already computed, by path (see :func:`content_hash`).

    Returns:
        ``{"params <section or key>": hash, "input <path>": hash}``, flat, 16 hex characters per value.
    """
    stage = REGISTRY[task]
    scope = SimpleNamespace(**{name: getattr(params, name) for name in type(params).model_fields},
                            item=SimpleNamespace(model=model))
    out = {f"params {key}": _short(_dotted(params, key)) for key in stage.params if key != "paths"}
    for template in stage.inputs:
        path = Path(resolve_template(template, scope))
        out[f"input {path}"] = content_hash(path, cache)
    return out


def differences(recorded: dict[str, str], current: dict[str, str]) -> list[str]:
    """What differs between two identities, one phrase each: ``params sft``, ``input models/sft`` (``… is
    missing now`` when it no longer exists)."""
    out = []
    for key in sorted(recorded.keys() | current.keys()):
        if recorded.get(key) != current.get(key):
            out.append(f"{key} is missing now" if current.get(key) == MISSING else key)
    return out
