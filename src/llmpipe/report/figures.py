"""The report card's PNG figures (matplotlib, Agg backend), drawn from the per-step CSV logs every training stage
writes (``logs/<stage>/train.csv`` and ``eval.csv``)."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

RL_PANELS = (
    ("reward", ("reward",), "mean reward per step"),
    ("KL to reference", ("kl",), "KL (the stage's unit)"),
    ("KL coefficient", ("kl_coef",), "weight of the KL penalty"),
    ("response length", ("response_length", "completions/mean_length"), "tokens per response"),
)
"""The RL figure's columns: title, the CSV columns that hold it (PPO's name, then TRL GRPO's), y label. The KL
coefficient is PPO's (fixed, or its adaptive controller's); GRPO's `beta` is fixed and not logged."""


@dataclass
class Panel:
    """One small chart: a title, axis labels and ``(label, xs, ys)`` lines (a label starting ``eval`` is drawn as
    markers: validation points are few)."""

    title: str
    ylabel: str
    lines: list[tuple[str, list[float], list[float]]] = field(default_factory=list)
    xlabel: str = "optimizer step"


def read_log(path: Path) -> dict[str, list[float]]:
    """A per-step CSV log as ``{column: values}`` (blank or non-numeric cells as NaN); empty when the file is
    missing."""
    if not path.exists():
        return {}
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    columns: dict[str, list[float]] = {}
    for row in rows:
        for key, cell in row.items():
            try:
                value = float(cell)
            except (TypeError, ValueError):
                value = math.nan
            columns.setdefault(key, []).append(value)
    return columns


def series(log: dict[str, list[float]], *names: str) -> tuple[list[float], list[float]] | None:
    """``(steps, values)`` of the first of `names` the log has, NaN rows dropped; None when it has none."""
    for name in names:
        if name in log and "step" in log:
            pairs = [(s, v) for s, v in zip(log["step"], log[name]) if math.isfinite(v)]
            if pairs:
                return [s for s, _ in pairs], [v for _, v in pairs]
    return None


def loss_panels(logs: dict[str, tuple[dict, dict]]) -> list[Panel]:
    """Per stage: training loss and validation loss on one chart."""
    panels = []
    for stage, (train, evals) in logs.items():
        panel = Panel(stage, "loss")
        for label, log, name in (("train loss", train, "loss"), ("eval loss", evals, "eval_loss")):
            found = series(log, name)
            if found:
                panel.lines.append((label, *found))
        if panel.lines:
            panels.append(panel)
    return panels


def lr_panels(logs: dict[str, tuple[dict, dict]]) -> list[Panel]:
    """Per stage: the learning rate the optimizer stepped with (PPO: its value model's too)."""
    panels = []
    for stage, (train, _) in logs.items():
        lines = [(label, *found) for label, name in (("lr", "learning_rate"), ("value lr", "value_learning_rate"))
                 if (found := series(train, name))]  # fmt: skip
        if lines:
            panels.append(Panel(stage, "learning rate", lines))
    return panels


def rl_panels(logs: dict[str, tuple[dict, dict]], rl_stages: tuple[str, ...]) -> list[Panel]:
    """Per RL stage: reward, KL to the reference and response length, one chart each."""
    panels = []
    for stage in rl_stages:
        if stage not in logs:
            continue
        train, evals = logs[stage]
        for title, names, ylabel in RL_PANELS:
            panel = Panel(f"{stage}: {title}", ylabel)
            found = series(train, *names)
            if found:
                panel.lines.append(("train", *found))
            found = series(evals, *(f"eval_{n}" for n in names))
            if found:
                panel.lines.append(("eval", *found))
            if panel.lines:
                panels.append(panel)
    return panels


def draw(panels: list[Panel], path: Path, columns: int = 3) -> Path | None:
    """Draw `panels` as a grid of small charts into the PNG `path`; None (nothing written) when there are none.

    Raises:
        OSError: `path` cannot be written.
    """
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display: the report runs under DVC, CI and Prefect workers
    import matplotlib.pyplot as plt

    columns = min(columns, len(panels))
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.0 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, xs, ys in panel.lines:
            style = {"marker": "o", "markersize": 4} if label.startswith("eval") else {"linewidth": 1.4}
            ax.plot(xs, ys, label=label, **style)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(panel.lines) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # fixed margins: tight_layout measured every tick label and took most of the figure's time
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.13 / rows ** 0.5, top=1 - 0.1 / rows ** 0.5, wspace=0.3,
                        hspace=0.55)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def draw_all(logs_dir: Path, stages: tuple[str, ...], rl_stages: tuple[str, ...], out_dir: Path) -> dict[str, Path]:
    """Every figure of the card, from ``logs_dir/<stage>/{train,eval}.csv`` of `stages`, into `out_dir`.

    Returns:
        ``{"loss" | "lr" | "rl": PNG path}`` for the figures that had data.
    """
    logs = {s: (read_log(logs_dir / s / "train.csv"), read_log(logs_dir / s / "eval.csv")) for s in stages}
    logs = {s: pair for s, pair in logs.items() if pair[0] or pair[1]}
    drawn = {
        "loss": draw(loss_panels(logs), out_dir / "loss.png"),
        "lr": draw(lr_panels(logs), out_dir / "lr.png"),
        "rl": draw(rl_panels(logs, rl_stages), out_dir / "rl.png"),
    }
    return {name: path for name, path in drawn.items() if path is not None}
