"""Progress of the stages that do not train (prepare, evaluate) in plain lines: where stdout is not a terminal
(CI, DVC, Prefect logs), a tqdm bar's carriage-return redraws become one line every `LINE_INTERVAL_S` seconds and
one at the end; on a terminal, the bar as usual.

Training stages have their own (`llmpipe.train.progress`); this is for loops written by a library (lm-eval's
request loops) or by a stage outside a Trainer.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

LINE_INTERVAL_S = 15.0
"""Seconds between two progress lines of one loop (a log keeps every line; a bar redraws several times a second)."""

LINE_FORMAT = "{desc} {n_fmt}/{total_fmt} {unit} | {rate_fmt} | elapsed {elapsed} | ETA {remaining}"
"""A line without bar glyphs (they are noise in a log); ``?`` where the loop's length is unknown."""


def duration(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class _Lines:
    """A text stream for tqdm that turns each redraw (``\\r`` + status) into a line of its own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        status = text.replace("\r", "").rstrip()
        if status:
            self.stream.write(status + "\n")

    def flush(self) -> None:
        self.stream.flush()


def bar_class(label: str, stream: TextIO | None = None, unit: str = "it") -> type:
    """A tqdm class for `stream` (default stdout): tqdm itself on a terminal, else :class:`_Lines` output at most
    every `LINE_INTERVAL_S` seconds in `LINE_FORMAT`, with the final count when the loop ends; each line starts with
    `label` (then the loop's own description, if it has one); `unit` names what a loop counts unless it says."""
    from tqdm import tqdm

    out = stream or sys.stdout
    if hasattr(out, "isatty") and out.isatty():
        return tqdm

    class LineBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            desc = kwargs.get("desc")
            kwargs.setdefault("unit", unit)
            kwargs.update(file=_Lines(out), mininterval=LINE_INTERVAL_S, maxinterval=LINE_INTERVAL_S,
                          bar_format=LINE_FORMAT, desc=f"{label}: {desc}" if desc else label)  # fmt: skip
            super().__init__(*args, **kwargs)

    return LineBar


@contextlib.contextmanager
def lines_in(module: Any, label: str, stream: TextIO | None = None, unit: str = "it") -> Iterator[None]:
    """Within the block, `module`'s ``tqdm`` draws through :func:`bar_class` (lines start with `label`).

    For a library module that imports ``tqdm`` by name and offers no progress hook (lm-eval's request loops):
    its name is rebound for the block and restored after.
    """
    original = module.tqdm
    module.tqdm = bar_class(label, stream, unit)
    try:
        yield
    finally:
        module.tqdm = original


@contextlib.contextmanager
def phase(stage: str, what: str, stream: TextIO | None = None) -> Iterator[dict[str, Any]]:
    """One line when the block ends: ``<stage>: <what> in 0:00:04 (<details>)``.

    Yields:
        A dict the block fills with details (``{"documents": 1234}`` → ``1,234 documents``).
    """
    details: dict[str, Any] = {}
    start = time.perf_counter()
    yield details
    shown = ", ".join(f"{v:,} {k}" if isinstance(v, int) else f"{k} {v}" for k, v in details.items())
    line = f"{stage}: {what} in {duration(time.perf_counter() - start)}" + (f" ({shown})" if shown else "")
    print(line, file=stream or sys.stdout, flush=True)
