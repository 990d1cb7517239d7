"""The stage modules: ``llmpipe.stages.<name>`` is the stage ``name`` of the registry (`llmpipe.config.stages`) and
exposes ``run(params, **kwargs)``. Here only the lookup of a task's module: a module is imported when its task runs,
so `llm-train --help` stays fast."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from llmpipe.config.stages import input_paths, resolve


def run_inputs(task: str, params: Any) -> list[Path]:
    """What a training run of `task` reads (its checkpoint fingerprint hashes them): the stage module's own
    ``inputs(params)`` where that depends on more than templates (pretrain, ppo), else :func:`input_paths`."""
    own = getattr(module(task), "inputs", None)
    return own(params) if own is not None else input_paths(resolve(task), params)


def module(task: str) -> ModuleType:
    """The module of `task`."""
    return importlib.import_module(f"llmpipe.stages.{resolve(task)}")


def runner(task: str) -> Callable[..., dict[str, float]]:
    """The ``run`` function of `task`."""
    return module(task).run
