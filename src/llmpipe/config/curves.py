"""What a training stage logs per step (``logs/<stage>/train.csv`` and ``eval.csv``) and how dvc.yaml plots it: the
stage's own plots, its charts in the top-level ``plots:`` block, and an RL stage's reward, KL and length charts.

The registry (`llmpipe.config.stages`) gives each training stage one of the sets below; `llm-train dvc-yaml`
renders them (`llmpipe.orchestration.dag`). A Trainer stage logs what the HF Trainer logs (:data:`TRAINER`); an RL
stage on a TRL trainer what TRL's RL trainers log (:data:`TRL_RL`: GRPO's column names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Log = Literal["train", "eval"]
"""``logs/<stage>/train.csv`` (every logged training step) or ``eval.csv`` (every evaluation)."""


@dataclass(frozen=True)
class Plot:
    """A plot of the stage's own in dvc.yaml: one column of one of its logs against the step.

    Attributes:
        log: The CSV it reads.
        y: The column.
        title: Shown as ``<stage>: <title>``; None draws the column bare (no title, no axis labels).
        y_label: The y axis label (with a title).
    """

    log: Log
    y: str
    title: str | None = None
    y_label: str | None = None


@dataclass(frozen=True)
class Chart:
    """A chart of the top-level ``plots:`` block, ``<stage> <name>``: columns of the stage's logs on one chart.

    Attributes:
        name: After the stage's name: ``loss``, ``learning rate``.
        y_label: The y axis label.
        columns: ``(log, column)`` per curve.
    """

    name: str
    y_label: str
    columns: tuple[tuple[Log, str], ...]


@dataclass(frozen=True)
class Curves:
    """What a training stage logs, as dvc.yaml plots it.

    Attributes:
        plots: The stage's own plots.
        charts: Its charts in the top-level block; one of validation loss (``eval_loss`` of ``eval.csv``) puts the
            stage on the "validation loss across stages" chart.
        reward: (RL) the columns of the mean reward: ``train.csv``'s, and ``eval.csv``'s or None.
        kl: (RL) ``train.csv``'s column of the KL to the reference (its unit: the registry's ``kl_unit``).
        length: (RL) the columns of the response length, ``train.csv``'s and ``eval.csv``'s or None, and its label.
    """

    plots: tuple[Plot, ...]
    charts: tuple[Chart, ...] = ()
    reward: tuple[str, str | None] | None = None
    kl: str = "kl"
    length: tuple[str, str | None, str] | None = None


TOKENS_PER_S = Plot("train", "tokens_per_s", "tokens/s", "tokens per second")
LEARNING_RATE = Chart("learning rate", "learning rate", (("train", "learning_rate"),))

TRAINER = Curves(
    plots=(TOKENS_PER_S, Plot("eval", "eval_loss", "validation loss", "validation loss")),
    charts=(Chart("loss", "loss", (("train", "loss"), ("eval", "eval_loss"))), LEARNING_RATE),
)
"""A Hugging Face Trainer stage: tokens/s, validation loss; training and validation loss on one chart, the
learning rate."""

PPO = Curves(
    plots=(TOKENS_PER_S, Plot("eval", "eval_reward", "validation reward", "validation reward")),
    charts=(Chart("loss", "PPO loss (policy + value)", (("train", "loss"),)),
            Chart("learning rate", "learning rate", (("train", "learning_rate"), ("train", "value_learning_rate"))),
            Chart("KL coefficient", "KL coefficient (fixed, or adapted toward ppo.kl_target)", (("train", "kl_coef"),))),
    reward=("reward", "eval_reward"),
    length=("response_length", "eval_response_length", "tokens per response"),
)
"""llmpipe's PPO loop (`llmpipe.rl.ppo.loop`): it evaluates the reward and response length as well, and logs the
value model's learning rate and the KL coefficient (`llmpipe.rl.ppo.kl_control`)."""

TRL_RL = Curves(
    plots=(TOKENS_PER_S,),
    charts=(Chart("loss", "loss", (("train", "loss"),)), LEARNING_RATE),
    reward=("reward", None),
    length=("completions/mean_length", None, "tokens per completion"),
)
"""An RL stage on a TRL trainer (GRPO and its family): reward, KL and completion length on the training steps."""

BARE = Curves(plots=(Plot("train", "loss"), Plot("eval", "eval_loss")))
"""The training and validation loss, drawn bare, and no top-level chart (the vlm stage)."""
