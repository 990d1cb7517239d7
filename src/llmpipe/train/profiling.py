"""`torch.profiler` over a few training steps, driven by the ``profile:`` params section.

The profiler follows `torch.profiler.schedule(wait, warmup, active)` once: it skips `wait` optimizer steps
(start-up: data loader, allocator, compilation), traces `warmup` steps and throws them away, then records
`active` steps. When the recording ends it writes, into the stage's ``logs/<stage>/profile/``:

- ``trace.json``: a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing);
- ``ops.txt``: the :data:`ROW_LIMIT` operators with the most self time (CUDA time on a GPU, else CPU time),
  from `key_averages().table`.

Only the main process (rank 0) profiles, so the files of several ranks never collide.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from llmpipe.config import ProfileParams

log = logging.getLogger(__name__)

ROW_LIMIT = 25
"""Operators listed in ``ops.txt``."""

TRACE_FILE, OPS_FILE = "trace.json", "ops.txt"


class StepProfiler:
    """A `torch.profiler.profile` on the schedule of `cfg`, stepped once per optimizer step.

    Args:
        cfg: The ``profile:`` section (`enabled` is the caller's business).
        out_dir: Where ``trace.json`` and ``ops.txt`` go (created when they are written).
    """

    def __init__(self, cfg: ProfileParams, out_dir: Path) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.cfg, self.out_dir, self.written = cfg, Path(out_dir), False
        self.cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._steps = 0
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._write,
            record_shapes=True,
        )

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / TRACE_FILE))
        sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=ROW_LIMIT)
        (self.out_dir / OPS_FILE).write_text(table + "\n")
        self.written = True
        log.info("profile: %d steps traced; %s and %s in %s", self.cfg.active, TRACE_FILE, OPS_FILE, self.out_dir)

    def start(self) -> None:
        """Begin the schedule (the next :meth:`step` ends the first step)."""
        self._prof.start()

    def step(self) -> None:
        """Mark the end of one optimizer step."""
        self._steps += 1
        self._prof.step()

    def stop(self) -> None:
        """End profiling; a recording cut short by the end of training is still written."""
        self._prof.stop()
        if not self.written:
            log.warning(
                "profile: training ended after %d steps, before the profiled window (wait %d + warmup %d) began; "
                "nothing written. Lower profile.wait/profile.warmup or train longer",
                self._steps, self.cfg.wait, self.cfg.warmup,
            )  # fmt: skip


class ProfilerCallback(TrainerCallback):
    """Trainer callback running a :class:`StepProfiler` over training (main process only).

    Args:
        cfg: The ``profile:`` section.
        out_dir: ``logs/<stage>/profile``.
    """

    def __init__(self, cfg: ProfileParams, out_dir: Path) -> None:
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.profiler: StepProfiler | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.profiler = StepProfiler(self.cfg, self.out_dir)
            self.profiler.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
