"""TensorBoard events of a training run: every logged scalar, weight and gradient histograms every
``histogram_steps``, the samples as text and the run's params as hparams, in one folder per run.

The folder is ``logs/<stage>/tensorboard/<run name>/`` (:func:`run_name`: start time and checkpoint fingerprint),
so ``tensorboard --logdir logs/`` shows each run as a curve of its own instead of drawing a second run over the
first. DVC declares ``logs/<stage>/tensorboard`` as an out and empties it before it reruns a stage, so under DVC
the folder holds the run that made the stage's outputs; hand runs and experiments keep theirs apart by name.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from llmpipe.callbacks import Callback, RunInfo


def run_name(run_path: Path) -> str:
    """``<YYYYmmdd-HHMMSS>-<first 8 characters of the run folder>``: unique per start, names the checkpoint run."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{run_path.name[:8]}"


def tag(key: str) -> str:
    """transformers' TensorBoard tag of a logged key: ``eval_loss`` → ``eval/loss``, ``loss`` → ``train/loss``."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def hparam_values(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested params mapping flattened to the types TensorBoard's hparams take (numbers, strings, booleans):
    ``{"sft.lr": 3e-4, "sft.callbacks": "[]", "sft.eval_prompts": "null"}``."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(hparam_values(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


class TensorBoardLog(Callback):
    """Writes a run's TensorBoard events (module docstring); only on global rank 0.

    Gradients are taken by a ``register_post_accumulate_grad_hook`` on each trainable parameter, armed only for
    the optimizer steps that write a histogram: the hook sees the gradient accumulated over the step's
    micro-batches (this rank's, before a DDP all-reduce; PPO: its last optimizer step of the PPO step).

    Args:
        log_dir: ``logs/<stage>/tensorboard``; the run writes into a subfolder named by `RunInfo.run_name`.
        histogram_steps: Optimizer steps between histograms; 0 writes none (and arms no hook).
        hparams: The run's params (nested mapping), written once as TensorBoard hparams.
        metric: The tag the hparams view shows against the params (e.g. ``eval/loss``).
    """

    def __init__(self, log_dir: Path, histogram_steps: int, hparams: dict[str, Any], metric: str) -> None:
        self.log_dir, self.histogram_steps = log_dir, histogram_steps
        self.hparams, self.metric = hparams, metric
        self.writer: Any = None
        self.model: Any = None
        self.armed = False
        self.grads: dict[str, Any] = {}

    def on_train_start(self, run: RunInfo) -> None:
        if not run.is_main:
            return
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(self.log_dir / run.run_name))
        for summary in hparams(hparam_values(self.hparams), {self.metric: 0.0}):
            self.writer.file_writer.add_summary(summary)
        if self.histogram_steps:
            self.model = run.model
            for name, param in run.model.named_parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._grad_hook(name))
            self.armed = (run.start_step + 1) % self.histogram_steps == 0

    def _grad_hook(self, name: str):
        def keep(param) -> None:
            if self.armed and param.grad is not None:
                self.grads[name] = param.grad.detach().float().cpu()

        return keep

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """Write every numeric value under :func:`tag` and flush."""
        if self.writer is None:
            return
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag(key), value, step)
        self.writer.flush()

    def text(self, name: str, text: str, step: int) -> None:
        """Write a text summary (markdown) under `name`."""
        if self.writer is not None:
            self.writer.add_text(name, text, step)
            self.writer.flush()

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        if self.writer is None:
            return
        if self.histogram_steps and step % self.histogram_steps == 0:
            for name, param in self.model.named_parameters():
                self.writer.add_histogram(f"weights/{name}", param.detach().float().cpu(), step)
            for name, grad in self.grads.items():
                self.writer.add_histogram(f"gradients/{name}", grad, step)
            self.grads = {}
        if self.histogram_steps:
            self.armed = (step + 1) % self.histogram_steps == 0
        self.scalars(step, logs)

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        self.scalars(step, metrics)
