"""`llm-train plot-lr --task STAGE [--out lr.png]`: a training stage's learning-rate schedule, from params.yaml, as a
PNG — the schedule its trainer builds, from the same `TrainingArguments` and transformers' `get_scheduler`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from llmpipe.config import stages as registry
from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import atomic_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train plot-lr` flags."""
    parser.add_argument("--task", required=True, choices=registry.TRAINING_TASKS, help="the training stage")
    parser.add_argument("--config-path", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--steps", type=int,
                        help="optimizer steps of the run, needed when <task>.max_steps is -1 (a budget in epochs)")
    parser.add_argument("--out", type=Path, help="the PNG to write (default: lr-<task>.png)")


def lr_schedule(params, task: str, steps: int | None = None) -> list[float]:
    """The learning rate each optimizer step of `task` applies, steps 1 … N.

    Built as the HF Trainer builds it (`Trainer.create_scheduler`): `TrainingArguments` from
    `llmpipe.train.arguments.training_kwargs`, then ``get_scheduler(lr_scheduler_type, optimizer,
    args.get_warmup_steps(N), N, args.lr_scheduler_kwargs)`` over a one-parameter optimizer at ``<task>.lr``;
    step k applies the rate the scheduler holds after k - 1 ``scheduler.step()`` calls. PPO's loop calls
    `get_scheduler` with the same type, warmup and step count.

    Args:
        params: Validated params.
        task: A training stage.
        steps: N, the run's optimizer steps; default ``<task>.max_steps``.

    Returns:
        N learning rates.

    Raises:
        UserError: No step budget (``max_steps`` -1 and no `steps`), or a schedule transformers refuses.
    """
    import torch
    from transformers import TrainingArguments, get_scheduler

    from llmpipe.train.arguments import training_kwargs

    total = steps if steps is not None else params.stage(task).resolved_max_steps
    if total <= 0:
        raise UserError(f"{task}.max_steps is {total}: the run's length in steps depends on its data; "
                        "give it with --steps N")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(**training_kwargs(params, task, Path(tmp)))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    try:
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.get_warmup_steps(total),
                                  num_training_steps=total, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    except (ValueError, TypeError) as err:
        raise UserError(f"{task}.lr_scheduler_type {args.lr_scheduler_type}: {root_cause(err)}") from None
    rates = []
    for _ in range(total):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()  # the order the Trainer keeps; torch warns when the scheduler steps first
        scheduler.step()
    return rates


def plot(rates: list[float], title: str, path: Path) -> None:
    """Draw `rates` against optimizer steps 1 … N into the PNG `path` (written whole, then renamed into place).

    matplotlib's object API with the Agg canvas: no pyplot state, no display needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(range(1, len(rates) + 1), rates, linewidth=1.5)
    ax.set(title=title, xlabel="optimizer step", ylabel="learning rate", xlim=(1, max(len(rates), 2)))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.grid(alpha=0.3)
    with atomic_file(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=120)


def run(args: argparse.Namespace) -> int:
    """Load params, compute the schedule, write the PNG, print one summary line.

    Raises:
        UserError: Bad params or flags (see :func:`lr_schedule`).
    """
    from llmpipe.config import load_params

    params = load_params(args.config_path)
    if args.steps is not None and args.steps <= 0:
        raise UserError("--steps must be > 0")
    rates = lr_schedule(params, args.task, args.steps)
    t = params.stage(args.task)
    out = args.out or Path(f"lr-{args.task}.png")
    title = f"{args.task}: {t.lr_scheduler_type}, peak {t.lr:g}, warmup {t.warmup_steps}, {len(rates)} steps"
    plot(rates, title, out)
    peak = max(range(len(rates)), key=rates.__getitem__)
    print(f"{title}; highest {rates[peak]:.4g} at step {peak + 1}, last {rates[-1]:.4g} → {out}")
    return 0
