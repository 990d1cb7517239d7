"""The callbacks of a training stage (`llmpipe.callbacks`) and their adapter onto transformers' `TrainerCallback`.

:func:`stage_callbacks` lists the built-ins (progress, TensorBoard, the stage's samples) and the users'
(``<stage>.callbacks``) in the order they are called; :class:`TrainerHooks` calls them from a Trainer's events (the
PPO loop calls them itself).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from llmpipe.callbacks import Callback, CallbackList, RunInfo, resolve
from llmpipe.config import Params
from llmpipe.config.stages import best_metric
from llmpipe.core.io import write_jsonl
from llmpipe.distributed.launch import is_main_process
from llmpipe.train.progress import Progress
from llmpipe.train.samples import Generate, SamplePrompts, Samples
from llmpipe.train.tensorboard import TensorBoardLog, run_name, tag

StageSamples = tuple[SamplePrompts, Generate]
"""What a stage answers at each evaluation and how (`llmpipe.train.samples`)."""


def stage_callbacks(params: Params, stage: str, samples: StageSamples | None = None) -> CallbackList:
    """Progress, TensorBoard, the stage's samples (when it has any), then the users' callbacks (``<stage>.callbacks``,
    each constructed with no arguments), in the order they are called."""
    cfg = params.stage(stage)
    paths = params.paths
    tensorboard = TensorBoardLog(
        paths.out(paths.logs, stage, "tensorboard"),
        cfg.histogram_steps,
        {stage: cfg.model_dump(), "model": params.model.model_dump()},
        tag(best_metric(stage, cfg)[0]),
    )
    built_in: list[Callback] = [Progress(stage), tensorboard]
    samples_path = paths.out(paths.logs, stage, "samples.jsonl")
    if samples is not None:
        built_in.append(Samples(stage, *samples, samples_path, tensorboard))
    if is_main_process():  # DVC's outs exist even when a finished run is only saved (no train start)
        tensorboard.log_dir.mkdir(parents=True, exist_ok=True)
        if samples is not None:
            write_jsonl(samples_path, [])
    return CallbackList([*built_in, *(resolve(spec)() for spec in cfg.callbacks)])


def trainer_hooks(params: Params, stage: str, run_path: Path, tokenizer, samples: StageSamples | None = None):
    """:func:`stage_callbacks` on a Trainer: the one `TrainerCallback` a Trainer stage adds for them."""
    return TrainerHooks(stage_callbacks(params, stage, samples), stage, params, run_name(run_path), tokenizer)


class TrainerHooks(TrainerCallback):
    """Calls `callbacks` (a `CallbackList`) from a Hugging Face / TRL Trainer's events.

    transformers calls ``on_step_end`` before it logs that step, so at a logging step (``control.should_log``)
    the step's ``on_step_end`` waits for the ``on_log`` that carries its ``loss`` and passes those values; every
    other event first delivers a step still waiting. Events before ``on_train_begin`` (a finished run that is only
    saved) are not passed on; the final evaluation after ``on_train_end`` is.

    Args:
        callbacks: What to call.
        stage: The stage name.
        params: Validated params (the stage section goes to `RunInfo.params`).
        run_name: `llmpipe.train.tensorboard.run_name` of this run.
        tokenizer: The pipeline tokenizer.
    """

    def __init__(self, callbacks: CallbackList, stage: str, params: Params, run_name: str, tokenizer) -> None:
        self.callbacks, self.stage, self.params = callbacks, stage, params
        self.run_name, self.tokenizer = run_name, tokenizer
        self.started = False
        self.pending: int | None = None
        self.epoch = 0

    def _flush(self) -> None:
        if self.pending is not None:
            step, self.pending = self.pending, None
            self.callbacks.on_step_end(step, {})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        paths = self.params.paths
        self.started = True
        self.callbacks.on_train_start(RunInfo(
            stage=self.stage, model=model, tokenizer=self.tokenizer, max_steps=state.max_steps,
            start_step=state.global_step, log_dir=paths.out(paths.logs, self.stage), run_name=self.run_name,
            params=self.params.stage(self.stage).model_dump(), is_main=state.is_world_process_zero,
        ))  # fmt: skip

    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.started:
            self.epoch = math.floor(state.epoch or 0)
            self.callbacks.on_epoch_start(self.epoch)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.started:
            return
        self._flush()
        if control.should_log:
            self.pending = state.global_step
        else:
            self.callbacks.on_step_end(state.global_step, {})

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs):
        if self.pending is not None and "loss" in (logs or {}):
            step, self.pending = self.pending, None
            self.callbacks.on_step_end(step, dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self.started:
            self._flush()
            self.callbacks.on_evaluate(state.global_step, dict(metrics or {}))

    def on_save(self, args, state, control, **kwargs):
        if self.started:
            self._flush()
            self.callbacks.on_save(state.global_step, Path(args.output_dir, f"checkpoint-{state.global_step}"))

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.started:
            self._flush()
            self.callbacks.on_epoch_end(self.epoch)

    def on_train_end(self, args, state, control, **kwargs):
        if self.started:
            self._flush()
            self.callbacks.on_train_end(state.global_step)
