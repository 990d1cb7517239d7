"""Live progress of a training run on stdout (rank 0 only): a tqdm bar on a terminal, one plain line per logging
step anywhere else (CI, DVC, Prefect logs keep no carriage returns), a summary line per epoch and at the end.

tqdm (already a transformers dependency) draws the bar; transformers' own bar is turned off (``disable_tqdm`` in
`llmpipe.train.arguments`) so a run shows exactly one; `llmpipe.cli` turns off the library bars (datasets, hub
downloads, model shards) of a run whose stdout is not a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from llmpipe.callbacks import Callback, RunInfo
from llmpipe.core.lines import duration

SKIPPED_EVAL = ("_runtime", "_per_second")
"""Evaluation keys left out of the console line (timings, not results)."""


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (a bar redraws in place there)."""
    return hasattr(stream, "isatty") and stream.isatty()


def write(line: str, stream: TextIO | None = None) -> None:
    """Print `line` above any live tqdm bar (plain print when there is none)."""
    from tqdm import tqdm

    tqdm.write(line, file=stream or sys.stdout)


def step_fields(logs: dict[str, Any]) -> list[str]:
    """The per-step fields shown: loss, reward (RL), lr, tokens/s."""
    fields = [f"loss {logs['loss']:.4f}"] if "loss" in logs else []
    fields += [f"reward {logs['reward']:.3f}"] if "reward" in logs else []
    fields += [f"lr {logs['learning_rate']:.2e}"] if "learning_rate" in logs else []
    fields += [f"{logs['tokens_per_s']:,.0f} tok/s"] if "tokens_per_s" in logs else []
    return fields


class Progress(Callback):
    """The progress bar or lines of one stage (module docstring).

    Per logging step: ``<stage> step 4/12 | loss 6.8540 | lr 2.93e-04 | 3,109 tok/s | ETA 0:00:05``; per
    evaluation: ``<stage> eval @ step 6 | eval_loss 6.7980``; per epoch and at the end: ``<stage> epoch 1 | loss
    | lr | tokens | time | peak memory | MFU`` (the last two where the logs carry ``peak_memory_gb`` / ``mfu``).

    Args:
        stage: The stage name that starts every line.
        stream: Where to write; default stdout.
    """

    def __init__(self, stage: str, stream: TextIO | None = None) -> None:
        self.stage, self.stream = stage, stream or sys.stdout
        self.bar: Any = None
        self.active = False
        self.total = self.start_step = 0
        self.t0 = 0.0
        self.last: dict[str, Any] = {}

    def _write(self, line: str) -> None:
        write(line, self.stream)

    def on_train_start(self, run: RunInfo) -> None:
        self.active = run.is_main
        self.total, self.start_step, self.t0 = run.max_steps, run.start_step, time.perf_counter()
        if self.active and is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=run.max_steps, initial=run.start_step, desc=self.stage, unit="step",
                            file=self.stream, dynamic_ncols=True)  # fmt: skip

    def eta(self, step: int) -> str:
        """Time left at this step's mean pace since the start (or resume)."""
        done = step - self.start_step
        if done <= 0:
            return "?"
        return duration((time.perf_counter() - self.t0) / done * (self.total - step))

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        if not self.active:
            return
        if logs:
            self.last = {**self.last, **logs}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if logs:
                self.bar.set_postfix_str(" | ".join(step_fields(logs)))
        elif logs:
            fields = [f"{self.stage} step {step}/{self.total}", *step_fields(logs), f"ETA {self.eta(step)}"]
            self._write(" | ".join(fields))

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        shown = {k: v for k, v in metrics.items()
                 if k.startswith("eval_") and isinstance(v, (int, float)) and not k.endswith(SKIPPED_EVAL)}  # fmt: skip
        self._write(" | ".join([f"{self.stage} eval @ step {step}", *(f"{k} {v:.4g}" for k, v in shown.items())]))

    def summary(self, what: str) -> str:
        """``loss | lr | tokens | time | peak memory | MFU`` of the run so far, from the last logged values."""
        last = self.last
        fields = [f"{self.stage} {what}"]
        fields += [f"loss {last['loss']:.4f}"] if "loss" in last else []
        fields += [f"lr {last['learning_rate']:.2e}"] if "learning_rate" in last else []
        fields += [f"{last['num_input_tokens_seen']:,} tokens"] if "num_input_tokens_seen" in last else []
        fields += [f"time {duration(time.perf_counter() - self.t0)}"]
        fields += [f"peak memory {last['peak_memory_gb']:.2f} GB"] if "peak_memory_gb" in last else []
        fields += [f"MFU {last['mfu']:.1%}"] if "mfu" in last else []
        return " | ".join(fields)

    def on_epoch_end(self, epoch: int) -> None:
        if self.active:
            self._write(self.summary(f"epoch {epoch + 1} done"))

    def on_train_end(self, step: int) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self._write(self.summary(f"done at step {step}"))
