"""The first-vs-last-10% figures of the RL stages (llmpipe.rl.progress), against hand-computed values: per logged
step (grpo) and pooled over every sequence of the steps (ppo)."""

from __future__ import annotations

import math

import pytest

from llmpipe.rl.progress import first_last_tenths, tenth


def test_a_tenth_is_at_least_one_entry_and_rounds_up():
    assert [tenth(n) for n in (1, 9, 10, 11, 20, 30, 36)] == [1, 1, 1, 2, 2, 3, 4]


def test_per_step_series_uses_the_sample_std_of_the_steps():
    # 20 steps: tenths are steps [1, 5] and [7, 9]; se = stdev / sqrt(2): 2.828 / 1.414 = 2 and 1.414 / 1.414 = 1.
    means = [1.0, 5.0] + [0.0] * 16 + [7.0, 9.0]
    assert first_last_tenths(means) == pytest.approx((3.0, 2.0, 8.0, 1.0))
    one = first_last_tenths([4.0] * 10)  # a one-step tenth has no spread to measure
    assert one.first == one.last == 4.0 and math.isnan(one.first_se) and math.isnan(one.last_se)


def test_pooled_series_uses_every_sequence_of_the_steps():
    # Steps of 2 sequences: (0, 2) has mean 1 and population std 1, (4, 6) mean 5, std 1. Pooled first tenth:
    # 0, 2, 4, 6: mean 3, sample variance (9 + 1 + 1 + 9) / 3 = 20/3, standard error sqrt(20/3 / 4).
    means, stds = [1.0, 5.0] + [0.0] * 18, [1.0, 1.0] + [0.0] * 18
    got = first_last_tenths(means, stds, group_size=2)
    assert (got.first, got.first_se) == pytest.approx((3.0, math.sqrt(5 / 3)))
    assert (got.last, got.last_se) == (0.0, 0.0)
    one = first_last_tenths([1.0] * 10, [1.0] * 10, group_size=2)  # one step still has two sequences: 0 and 2
    assert (one.first, one.first_se) == pytest.approx((1.0, 1.0))
