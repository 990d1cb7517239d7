"""The Trainer callbacks every training stage gets from `llmpipe.train.loop.train_stage`: the batch ledger, the
learning rate of a resumed schedule, the checkpoint rotation that keeps the best, the first-step log line, the
NaN/inf guard, and fault injection for the resume tests (the PPO loop, which has no Trainer, uses the ledger digest,
the schedule fix and the fault injection directly)."""

from __future__ import annotations

import csv
import hashlib
import logging
import math
import os
import signal
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file
from llmpipe.train.checkpoints import PREFIX, newest_whole, rotate

log = logging.getLogger(__name__)


def batch_digest(inputs: Any, h: Any) -> None:
    """Feed a canonical form of a training batch into hash `h`: tensor bytes (any shape or dtype), mapping keys
    in sorted order, sequences in order, and the repr of anything else (GRPO's batches are lists of prompt rows)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        h.update(str(inputs.dtype).encode())
        h.update(inputs.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(inputs, dict):
        for key in sorted(inputs):
            h.update(str(key).encode())
            batch_digest(inputs[key], h)
    elif isinstance(inputs, (list, tuple)):
        for item in inputs:
            batch_digest(item, h)
    else:
        h.update(repr(inputs).encode())


class BatchLedger(TrainerCallback):
    """The ledger of what each optimizer step trained on: per step, a SHA-256 digest (16 hex) over its
    micro-batches as the Trainer passed them to `training_step`.

    It proves a resumed run trained on exactly the batches of an uninterrupted one: the rows ride in the
    checkpoint's trainer state (``stateful_callbacks["BatchLedger"]``), so a resumed run's ledger covers the
    whole run; `train_stage` writes it to ``logs/<stage>/batches.csv``. Install with :meth:`attach`.
    """

    KEY = "BatchLedger"

    def __init__(self) -> None:
        self.rows: list[list[Any]] = []
        self._pending = hashlib.sha256()

    def attach(self, trainer) -> None:
        """Wrap `trainer.training_step` (every HF/TRL trainer's per-micro-batch entry) and add this callback."""
        step = trainer.training_step

        def recorded(model, inputs, *args, **kwargs):
            batch_digest(inputs, self._pending)
            return step(model, inputs, *args, **kwargs)

        trainer.training_step = recorded
        trainer.add_callback(self)

    def restore(self, state) -> None:
        """Take the rows a checkpoint's `TrainerState` carries (up to its step)."""
        stored = state.stateful_callbacks.get(self.KEY) or {}
        self.rows = [r for r in stored.get("rows", []) if r[0] <= state.global_step]

    def on_train_begin(self, args, state, control, **kwargs):
        self.restore(state)

    def on_step_end(self, args, state, control, **kwargs):
        self.rows.append([state.global_step, self._pending.hexdigest()[:16]])
        self._pending = hashlib.sha256()
        state.stateful_callbacks[self.KEY] = {"rows": self.rows}  # saved with the next checkpoint


def write_ledger(rows: list[list[Any]], log_dir: Path) -> None:
    """``batches.csv``: one row per optimizer step, ``step,sha``."""
    with atomic_file(log_dir / "batches.csv") as fh:
        writer = csv.writer(fh)
        writer.writerow(["step", "sha"])
        writer.writerows(rows)


def reapply_schedule(scheduler) -> list[float] | None:
    """Set the optimizer's learning rates to what `scheduler` gives at its current step; returns them.

    A resumed run loads the optimizer and scheduler states of its checkpoint, and both carry the learning rate the
    checkpoint's own schedule reached: for a finished run whose `max_steps` was raised, its end (0.0 for
    ``linear``). The schedule's shape (`max_steps`, warmup) comes from the current params, but the optimizer takes
    its next step at the stored rate, and the scheduler only recomputes it after that step. Recomputing it here
    gives the next step the rate an uninterrupted run of the current budget has there; a resume at the same budget
    computes the very value the checkpoint holds, so it changes nothing.

    Args:
        scheduler: A `torch.optim.lr_scheduler.LambdaLR` (every schedule of transformers' `get_scheduler` that
            ``lr_scheduler_type`` allows), bare or wrapped by Accelerate's `AcceleratedScheduler` (`.scheduler`).

    Returns:
        The learning rates set, one per parameter group, or None for another scheduler (left as it is).
    """
    from torch.optim.lr_scheduler import LambdaLR

    inner = getattr(scheduler, "scheduler", scheduler)
    if not isinstance(inner, LambdaLR):
        return None
    lrs = [base * fn(inner.last_epoch) for fn, base in zip(inner.lr_lambdas, inner.base_lrs, strict=True)]
    for group, lr in zip(inner.optimizer.param_groups, lrs, strict=True):
        if hasattr(group["lr"], "fill_"):  # a tensor lr (capturable optimizers) is updated in place
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    inner._last_lr = list(lrs)  # what get_last_lr(), and so the Trainer's logged learning_rate, returns
    return lrs


class ResumedSchedule(TrainerCallback):
    """Trainer callback: on a resumed run, the first step trains at the rate of the current schedule
    (:func:`reapply_schedule`). `on_train_begin` comes after `Trainer._inner_training_loop` has created the
    scheduler of the current `max_steps` and loaded the checkpoint's optimizer and scheduler states into it."""

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if state.global_step > 0 and lr_scheduler is not None:
            reapply_schedule(lr_scheduler)


KILL_AT_STEP_ENV = "LLMPIPE_KILL_AT_STEP"
"""Fault injection for the resume tests: when set to N, a training process SIGKILLs itself right after optimizer
step N (a crash at a chosen step, which a kill from outside cannot time on millisecond steps)."""


def kill_at_step() -> int | None:
    """The step named by :data:`KILL_AT_STEP_ENV`, or None."""
    value = os.environ.get(KILL_AT_STEP_ENV)
    return int(value) if value else None


def maybe_kill(step: int, at: int | None) -> None:
    """SIGKILL this process if `step` is the fault-injection step `at`."""
    if at is not None and step == at:
        log.warning("%s=%d: killing this process with SIGKILL", KILL_AT_STEP_ENV, at)
        os.kill(os.getpid(), signal.SIGKILL)


class KillAtStep(TrainerCallback):
    """Trainer callback for :data:`KILL_AT_STEP_ENV`: the kill comes after the step's optimizer update, before
    any save at that step."""

    def __init__(self, at: int) -> None:
        self._at = at

    def on_step_end(self, args, state, control, **kwargs):
        maybe_kill(state.global_step, self._at)


class RotateCheckpoints(TrainerCallback):
    """After each save, keep the newest `keep` checkpoints plus the best by validation (`checkpoints.rotate`);
    the HF Trainer's own rotation would count the best inside the limit."""

    def __init__(self, keep: int) -> None:
        self._keep = keep

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            run_dir = Path(args.output_dir)
            rotate(run_dir, self._keep, [run_dir / f"{PREFIX}{state.global_step}", state.best_model_checkpoint])


class FirstStepLog(TrainerCallback):
    """Trainer callback logging the end of a run's first optimizer step: start-up cost is the time to this line."""

    def __init__(self, stage: str) -> None:
        self._stage, self._done = stage, False

    def on_step_end(self, args, state, control, **kwargs):
        if not self._done:
            self._done = True
            log.info("%s: first step done (step %d)", self._stage, state.global_step)


class NonFiniteLossGuard(TrainerCallback):
    """Trainer callback that stops a run at the first step whose loss or gradient is NaN or inf, before any
    checkpoint of that step is written, naming the step.

    In each optimizer step the Trainer calls `on_pre_optimizer_step` (gradients clipped, not yet applied), steps
    the optimizer, calls `on_step_end`, then logs (`on_log`), evaluates (`on_log` again) and writes a checkpoint
    (`on_save` comes only after it is written: too late). So the guard checks:

    - at `on_pre_optimizer_step`, the gradient norm: a NaN/inf gradient is refused before the optimizer writes it
      into the weights (skipped under fp16, whose grad scaler skips such steps itself and lowers its scale; and
      under DeepSpeed, which keeps gradients off ``param.grad``);
    - at `on_step_end`, the loss summed since the last log line (`Trainer._tr_loss`): a loss of 0/0, e.g. a
      batch whose labels are all masked, is NaN with zero gradients. `training_kwargs` turns the Trainer's
      ``logging_nan_inf_filter`` off, which would otherwise replace a NaN step loss by the window's mean;
    - at `on_log`, the logged ``loss`` and ``eval_loss`` (the fallback where `_tr_loss` does not exist).

    Raising from a callback ends `Trainer.train`, so `train_stage` saves no final model either; the newest
    checkpoint on disk is from before the bad step, and the error names it.

    Args:
        trainer: The trainer this guard is added to (read for its accumulated loss).
        stage: The stage name, for the message and the keys it names.

    Raises:
        UserError: From the hooks, at the first non-finite value.
    """

    def __init__(self, trainer, stage: str) -> None:
        self._trainer, self._stage = trainer, stage

    def _stop(self, args, step: int, what: str) -> None:
        s = self._stage
        fp32 = f", try {s}.precision: fp32" if args.bf16 or args.fp16 else ""
        raise UserError(
            f"{s}: {what} at step {step}; training stopped, and no checkpoint of that step is written (newest kept: "
            f"{newest_whole(Path(args.output_dir)) or 'none'}). Lower {s}.lr, keep {s}.max_grad_norm > 0{fp32}, "
            "or look for batches whose labels are all masked"
        )

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        import torch

        if args.fp16 or model is None:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # this rank's shard under FSDP
        if grads:
            norm = torch.nn.utils.get_total_norm(grads).item()
            if not math.isfinite(norm):
                self._stop(args, state.global_step + 1, f"the gradient norm is {norm} (not applied)")

    def on_step_end(self, args, state, control, **kwargs):
        loss = getattr(self._trainer, "_tr_loss", None)
        if loss is not None and not math.isfinite(float(loss)):
            self._stop(args, state.global_step, f"the training loss is {float(loss)}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in ("loss", "eval_loss"):
            if key in (logs or {}) and not math.isfinite(logs[key]):
                self._stop(args, state.global_step, f"the logged {key} is {logs[key]}")
