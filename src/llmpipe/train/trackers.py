"""The experiment trackers of ``<stage>.report_to`` beyond TensorBoard: the HF Trainer's own integrations (W&B,
MLflow, Trackio), each pointed at a store on this machine under ``paths.logs``, so a run sends nothing anywhere.

TensorBoard is not among them: every stage writes ``logs/<stage>/tensorboard`` through its own callback
(`llmpipe.train.loop.tensorboard_callback`), a DVC output. Each integration reads its settings from the environment
when the Trainer starts, so :func:`tracker_kwargs` sets them in this process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.config import Params

log = logging.getLogger(__name__)

PROJECT = "llmpipe"
"""The W&B project, MLflow experiment and Trackio project every stage logs to; the run is named after the stage."""


def store_environment(trackers: list[str], logs: Path) -> dict[str, str]:
    """The environment that keeps each tracker local: W&B offline (`wandb sync` uploads later), MLflow on a SQLite
    store (its file store refuses new data since MLflow 3.7), Trackio in a folder.

    Args:
        trackers: Names from ``report_to`` other than tensorboard.
        logs: The run's ``paths.logs`` folder; each tracker gets a subfolder.
    """
    logs = logs.resolve()
    env: dict[str, str] = {}
    if "wandb" in trackers:
        env |= {"WANDB_MODE": "offline", "WANDB_DIR": str(logs), "WANDB_PROJECT": PROJECT}
    if "mlflow" in trackers:
        (logs / "mlflow").mkdir(parents=True, exist_ok=True)
        env |= {"MLFLOW_TRACKING_URI": f"sqlite:///{logs / 'mlflow' / 'mlflow.db'}", "MLFLOW_EXPERIMENT_NAME": PROJECT}
    if "trackio" in trackers:
        env |= {"TRACKIO_DIR": str(logs / "trackio")}
    return env


def tracker_kwargs(params: Params, stage: str) -> dict[str, Any]:
    """The `TrainingArguments` keywords of ``<stage>.report_to``, with this process's environment set for them.

    Args:
        params: Validated params (``report_to`` names installed trackers only: checked when loaded).
        stage: A training stage section name.

    Returns:
        ``report_to`` (the trackers besides TensorBoard, or ``"none"``), ``run_name`` (the stage) and ``project``;
        with Trackio, ``trackio_static_space_id=False`` (no snapshot Space on the Hub after training).
    """
    trackers = [name for name in params.stage(stage).report_to if name != "tensorboard"]
    env = store_environment(trackers, params.paths.out(params.paths.logs))
    os.environ.update(env)
    if trackers:
        log.info("%s: logging to %s as well (%s)", stage, ", ".join(trackers),
                 ", ".join(f"{k}={v}" for k, v in env.items()))  # fmt: skip
    kwargs: dict[str, Any] = {"report_to": trackers or "none", "run_name": stage, "project": PROJECT}
    if "trackio" in trackers:
        kwargs["trackio_static_space_id"] = False
    return kwargs


def hold_run_end(trainer) -> Callable[[], None]:
    """Hold back the tracker integrations' ``on_train_end`` until the stage's final evaluation is logged; returns the
    function that calls them.

    Each integration ends its tracker's run when training ends, and the stage evaluates after that: MLflow would
    log the final ``eval_*`` metrics into a second, unnamed run. The held call is made on the instances themselves
    (TrainerCallback has no "after the last log" event to subscribe to).

    Args:
        trainer: A Trainer built with :func:`tracker_kwargs` (its ``args.report_to``).
    """
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    kinds = tuple(INTEGRATION_TO_CALLBACK[name] for name in trainer.args.report_to if name in INTEGRATION_TO_CALLBACK)
    held = [cb for cb in trainer.callback_handler.callbacks if kinds and isinstance(cb, kinds)]
    ends = [cb.on_train_end for cb in held]
    for cb in held:
        cb.on_train_end = lambda *args, **kwargs: None

    def end_runs() -> None:
        for end in ends:
            end(trainer.args, trainer.state, trainer.control)

    return end_runs
