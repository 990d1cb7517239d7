"""PPO's KL controller (Ziegler et al. 2019): the adaptive rule step by step against hand-computed values, its
pull toward the target in a closed loop, the fixed one, and the state a checkpoint carries. The stage's own
steps and its exact resume after SIGKILL: tests/stages/test_ppo.py and test_resume.py."""

from __future__ import annotations

import itertools
import json

import pytest

from llmpipe.rl.ppo.kl_control import KLController


def test_adaptive_rule_step_by_step():
    ctrl = KLController("adaptive", kl_coef=0.1, target=2.0, horizon=100.0)
    # KL 2.2: error 2.2 / 2 - 1 = 0.1, mult 1 + 0.1 * 10 / 100 = 1.01 → 0.1 * 1.01 = 0.101
    assert ctrl.update(2.2, n_steps=10) == pytest.approx(0.101, rel=1e-12)
    # KL 10: error 4 is clipped to 0.2, mult 1 + 0.2 * 10 / 100 = 1.02 → 0.101 * 1.02 = 0.10302
    assert ctrl.update(10.0, n_steps=10) == pytest.approx(0.10302, rel=1e-12)
    # KL 0: error -1 clipped to -0.2, n 50: mult 1 - 0.2 * 50 / 100 = 0.9 → 0.10302 * 0.9 = 0.092718
    assert ctrl.update(0.0, n_steps=50) == pytest.approx(0.092718, rel=1e-12)
    # KL at the target: error 0, unchanged
    assert ctrl.update(2.0, n_steps=50) == pytest.approx(0.092718, rel=1e-12)


def test_fixed_never_moves():
    ctrl = KLController("fixed", kl_coef=0.05, target=1.0, horizon=10.0)
    assert [ctrl.update(kl, 16) for kl in (0.0, 1.0, 50.0)] == [0.05, 0.05, 0.05]


def test_closed_loop_moves_the_kl_toward_the_target():
    """A stand-in for the policy whose KL falls as the penalty rises (KL = 0.3 / coefficient): from either side the
    coefficient moves so that the KL approaches the target, and settles there."""
    for start in (0.01, 1.0):  # KL 30 (above the target of 3) and 0.3 (below)
        ctrl = KLController("adaptive", kl_coef=start, target=3.0, horizon=64.0)
        gaps = []
        for _ in range(200):
            kl = 0.3 / ctrl.value
            gaps.append(abs(kl - 3.0))
            before = ctrl.value
            ctrl.update(kl, n_steps=16)
            if abs(kl - 3.0) > 1e-9:  # not yet at the target, to float precision
                assert (ctrl.value > before) == (kl > 3.0), "the coefficient rises above the target, falls below"
        assert all(b <= a + 1e-12 for a, b in itertools.pairwise(gaps)), "the gap to the target never widens"
        assert gaps[-1] < 0.01 * gaps[0]


def test_state_round_trips_through_json_exactly():
    ctrl = KLController("adaptive", kl_coef=0.05, target=6.0, horizon=512.0)
    for kl in (0.3, 7.1, 12.0):
        ctrl.update(kl, 16)
    restored = KLController("adaptive", kl_coef=0.05, target=6.0, horizon=512.0)
    restored.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    assert restored.value == ctrl.value
    assert restored.update(4.0, 16) == ctrl.update(4.0, 16)
