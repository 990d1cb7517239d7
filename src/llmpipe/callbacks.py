"""The public training callback: subclass :class:`Callback`, name it in params, and every training stage calls it.

```yaml
sft:
  callbacks: ["mypkg.watch:StopOnPlateau"]   # or under train: for every training stage
```

A callback is constructed with no arguments when the stage starts training and receives the hooks below in this
order (PPO's own loop calls the same hooks as the Trainer stages)::

    on_train_start(run)
    on_epoch_start(epoch)
      on_step_end(step, logs)      # every optimizer step; logs holds the values logged at that step, else {}
      on_evaluate(step, metrics)   # every eval_steps
      on_save(step, path)          # every save_steps, once the checkpoint is on disk
    on_epoch_end(epoch)
    on_train_end(step)
    on_evaluate(step, metrics)     # the final evaluation of the saved model (Trainer stages)

The built-ins (progress lines, TensorBoard, samples) are callbacks of this class too. This module imports neither
torch nor transformers, so params can check a callback's import path before any work; `llmpipe.train.hooks`
adapts callbacks onto transformers' `TrainerCallback`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmpipe.core.imports import import_object


@dataclass
class RunInfo:
    """What a callback learns about the run at :meth:`Callback.on_train_start`.

    Attributes:
        stage: The stage name (``sft``, ``ppo``, …).
        model: The model being trained (unwrapped; PPO: the policy).
        tokenizer: The pipeline tokenizer.
        max_steps: The optimizer-step budget (PPO: PPO steps).
        start_step: The step the run starts from (> 0 when resumed from a checkpoint).
        log_dir: ``logs/<stage>``.
        run_name: A name of this run, unique per start (``<time>-<fingerprint>``).
        params: The stage's params section as a plain mapping.
        is_main: Whether this is global rank 0 (the one that writes).
    """

    stage: str
    model: Any
    tokenizer: Any
    max_steps: int
    start_step: int
    log_dir: Path
    run_name: str
    params: dict[str, Any] = field(default_factory=dict)
    is_main: bool = True


class Callback:
    """Base of a training callback; every hook does nothing unless overridden. Hooks run on every rank (check
    ``run.is_main`` before writing) and must not change the training state."""

    def on_train_start(self, run: RunInfo) -> None:
        """Training is about to start (after any resume was loaded)."""

    def on_epoch_start(self, epoch: int) -> None:
        """An epoch starts (0-based; a resumed run starts in the epoch of its checkpoint)."""

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        """Optimizer step `step` (1-based) is done.

        Args:
            step: The global step.
            logs: At a logging step (``logging_steps``), the logged training values (``loss``,
                ``learning_rate``, ``tokens_per_s``, …; means over the window); otherwise empty.
        """

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """A validation pass at `step` gave `metrics` (``eval_*`` keys)."""

    def on_save(self, step: int, path: Path) -> None:
        """Checkpoint `path` of `step` is written."""

    def on_epoch_end(self, epoch: int) -> None:
        """Epoch `epoch` ended (also when the step budget ends it early)."""

    def on_train_end(self, step: int) -> None:
        """Training ended at `step`."""


class CallbackList(Callback):
    """Several callbacks called in order, each hook on each of them."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_train_start(self, run: RunInfo) -> None:
        for cb in self.callbacks:
            cb.on_train_start(run)

    def on_epoch_start(self, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_epoch_start(epoch)

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_step_end(step, logs)

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        for cb in self.callbacks:
            cb.on_evaluate(step, metrics)

    def on_save(self, step: int, path: Path) -> None:
        for cb in self.callbacks:
            cb.on_save(step, path)

    def on_epoch_end(self, epoch: int) -> None:
        for cb in self.callbacks:
            cb.on_epoch_end(epoch)

    def on_train_end(self, step: int) -> None:
        for cb in self.callbacks:
            cb.on_train_end(step)


def resolve(spec: str) -> type[Callback]:
    """The `Callback` subclass an import path names.

    Args:
        spec: ``"package.module:ClassName"``.

    Returns:
        The class (not an instance).

    Raises:
        ValueError: `spec` is not ``module:Class``, the module does not import (from the Python path or the
            current folder: `llmpipe.core.imports`), has no such attribute, or the attribute is not a `Callback`
            subclass; the message says which.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not an import path of the form 'package.module:ClassName'")
    try:
        cls = import_object(spec)  # from the Python path or the project folder, as reward functions are
    except ValueError as err:
        raise ValueError(str(err) if str(err).startswith(repr(spec)) else f"{spec!r}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ValueError(f"{spec!r} is not a subclass of llmpipe.callbacks.Callback")  # noqa: TRY004 (pydantic reports ValueError)
    return cls
