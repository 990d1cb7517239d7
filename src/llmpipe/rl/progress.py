"""Learning progress of an RL run: the mean and standard error of a logged series (the reward, the response
length) over its first and its last 10%, the figures the `ppo` and `grpo` metrics report and the report's
reward-gain check divides by."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

import torch


class Tenths(NamedTuple):
    """Mean and standard error of the first and of the last 10% of a series."""

    first: float
    first_se: float
    last: float
    last_se: float


def tenth(n: int) -> int:
    """Entries in the first (and in the last) 10% of a series of `n` entries: at least one."""
    return max(1, math.ceil(n / 10))


def first_last_tenths(means: Sequence[float], stds: Sequence[float] | None = None, group_size: int = 1) -> Tenths:
    """Mean and standard error of the first and of the last 10% of a series (:func:`tenth` entries each).

    Two kinds of series, told apart by `stds`:

    - ``stds=None``: each entry is one observation (`grpo`: a logged step's mean reward, over logged steps). The
      standard error is the entries' sample standard deviation over sqrt(entries); nan when a tenth holds one entry.
    - `stds` given: entry ``i`` is the mean of `group_size` observations whose population standard deviation is
      ``stds[i]`` (`ppo`: one step's raw scores of its rollout batch). A tenth's observations are pooled: the mean
      is over all of them, the standard error is their sample standard deviation (from the pooled second moment)
      over sqrt(observations), so even a one-step tenth has one.

    Args:
        means: The series, oldest first; at least one entry.
        stds: Per-entry population standard deviations of the observations behind each mean, or None.
        group_size: Observations behind each entry (used with `stds` only).

    Returns:
        ``Tenths(first, first_se, last, last_se)``.
    """
    k = tenth(len(means))
    if stds is None:
        return Tenths(*_mean_se(means[:k]), *_mean_se(means[-k:]))
    return Tenths(*_pooled(means[:k], stds[:k], group_size), *_pooled(means[-k:], stds[-k:], group_size))


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan
    return statistics.fmean(xs), se


def _pooled(means: Sequence[float], stds: Sequence[float], group_size: int) -> tuple[float, float]:
    """Mean and standard error of all ``len(means) * group_size`` observations behind `means` (float64)."""
    mean_t = torch.tensor(list(means), dtype=torch.float64)
    second = torch.tensor([s**2 + m**2 for m, s in zip(means, stds, strict=True)], dtype=torch.float64)
    total = group_size * len(means)
    mean = mean_t.mean().item()
    var = max(second.mean().item() - mean**2, 0.0) * total / max(total - 1, 1)
    return mean, math.sqrt(var / total)
