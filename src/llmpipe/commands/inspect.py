"""`llm-train inspect CHECKPOINT [--config-path params.yaml]`: what a training checkpoint holds — step, losses,
data position — and whether its run is the one the current params would resume, or how it differs.

CHECKPOINT is a ``checkpoints/<stage>/<fingerprint>/checkpoint-<step>`` folder, or a run folder (its newest whole
checkpoint). The run's identity is the ``fingerprint.json`` beside the checkpoints (`llmpipe.train.checkpoints`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError

NOT_METRICS = ("_runtime", "_per_second")
"""Suffixes of Trainer log keys that time an evaluation rather than measure the model."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train inspect` flags."""
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a checkpoint-<step> folder, or a run folder (its newest whole checkpoint)")
    parser.add_argument("--config-path", default="params.yaml", help="compare the run with these params (default: "
                        "params.yaml)")  # fmt: skip


def _last(history: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any] | None:
    return next((r for r in reversed(history) if any(k in r for k in keys)), None)


def _fmt(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def losses(state: dict[str, Any]) -> list[str]:
    """The last training and validation records of a trainer state, and its best checkpoint, one line each."""
    history = state.get("log_history") or []
    lines = []
    if train := _last(history, ("loss",)):
        keys = ("loss", "learning_rate", "grad_norm")
        lines.append(f"train      {_fmt({k: train[k] for k in keys if k in train})} (step {train.get('step')})")
    if evaluation := _last(history, tuple(k for r in history for k in r if k.startswith("eval_"))):
        values = {k: v for k, v in evaluation.items() if k.startswith("eval_") and not k.endswith(NOT_METRICS)}
        lines.append(f"validation {_fmt(values)} (step {evaluation.get('step')})")
    if state.get("best_global_step") is not None:
        lines.append(f"best       {state['best_metric']:.4g} at step {state['best_global_step']}")
    elif state.get("best_step") is not None:  # PPO's own loop
        lines.append(f"best       validation reward at step {state['best_step']}")
    return lines or ["losses     none logged yet"]


def data_position(state: dict[str, Any]) -> list[str]:
    """Where the run stood in its data: epoch and tokens seen (Trainer), the batch ledger, a stream's cursor, PPO's
    prompt positions."""
    lines = []
    seen = state.get("num_input_tokens_seen")
    if "epoch" in state:
        lines.append(f"data       epoch {state['epoch']:.4g}" + (f", {seen:,} input tokens seen" if seen else ""))
    callbacks = state.get("stateful_callbacks") or {}
    if rows := (callbacks.get("BatchLedger") or {}).get("rows"):
        lines.append(f"           batch ledger: {len(rows)} steps, last batch hash {rows[-1][1]} (step {rows[-1][0]})")
    if cursor := callbacks.get("StreamCursor"):
        ranks = cursor.get("ranks") or []
        lines.append(f"           stream cursor for {len(ranks)} rank(s): {json.dumps(ranks)[:300]}")
    if positions := state.get("positions"):
        lines.append(f"           prompt positions: {json.dumps(positions)[:300]}")
    return lines


def compare(run_dir: Path, config_path: str) -> list[str]:
    """The run's stage and fingerprint, and how its identity differs from the current params and inputs.

    A params file that cannot be read leaves the comparison out with the reason (the checkpoint was still shown).
    """
    from llmpipe import stages
    from llmpipe.config import load_params
    from llmpipe.config import stages as registry
    from llmpipe.train.checkpoints import FINGERPRINT_FILE, differences, identity

    stored_file = run_dir / FINGERPRINT_FILE
    if not stored_file.is_file():
        return [f"run        no {FINGERPRINT_FILE} in {run_dir}: which params trained it is unknown"]
    stored = json.loads(stored_file.read_text())
    stage = stored.get("stage")
    lines = [f"run        {stage}, fingerprint {run_dir.name} ({len(stored)} identity keys in {stored_file})"]
    if stage not in registry.TRAINING_TASKS:
        return [*lines, f"params     not compared: {stored_file} names no training stage of this llmpipe ({stage!r})"]
    try:
        params = load_params(config_path)
        current = identity(params, stage, stages.run_inputs(stage, params))
    except UserError as err:
        return [*lines, f"params     not compared: {err}"]
    if diff := differences(stored, current):
        return [*lines, f"params     differs from {config_path} and its inputs ({len(diff)}):",
                *(f"             {line}" for line in diff)]  # fmt: skip
    return [*lines, f"params     same as {config_path} and its inputs: llm-train --task {stage} resumes this run"]


def run(args: argparse.Namespace) -> int:
    """Print the checkpoint's step, losses, data position and run comparison.

    Raises:
        UserError: No such folder, no checkpoint in a run folder, or a checkpoint whose trainer state is missing
            or broken (a damaged weight file is reported, not refused).
    """
    from llmpipe.train.checkpoints import STATE_FILE, checkpoint_problem, newest_whole, step_of

    path = args.checkpoint
    if not path.is_dir():
        raise UserError(f"{path}: no such folder; give a checkpoints/<stage>/<fingerprint>/checkpoint-<step> folder")
    if step_of(path) is None:
        newest = newest_whole(path)
        if newest is None:
            raise UserError(f"{path}: no whole checkpoint-<step> folder in it")
        path = newest
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError):
        raise UserError(f"{path}: no readable {STATE_FILE} (the save did not finish); inspect another checkpoint") \
            from None  # fmt: skip
    step = state.get("global_step", state.get("step"))
    planned = state.get("max_steps")
    problem = checkpoint_problem(path)
    lines = [f"checkpoint {path}" + (f" (damaged: {problem})" if problem else ""),
             f"step       {step}" + (f" of {planned}" if planned else "")]  # fmt: skip
    lines += losses(state) + data_position(state) + compare(path.parent, args.config_path)
    print("\n".join(lines))
    return 0
