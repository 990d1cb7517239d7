"""The claims the pipeline must show, computed from the evaluation metrics of its models and the metrics of
its training stages.

1. Pretraining works: ``pretrain`` has at most :data:`PRETRAIN_MAX_BPB_RATIO` × the untrained ``baseline``'s
   bits per byte on held-out code (``llmpipe_perplexity``).
2. SFT works: ``sft`` has lower response bits per byte than ``pretrain`` in the chat format (``llmpipe_sft_chat``).
3. DPO works: ``dpo`` prefers the real body over the corrupted one more often than ``sft`` (``llmpipe_preference``
   acc_norm).
4. The reward model ranks held-out pairs right at least :data:`REWARD_MIN_ACCURACY` of the time, overall and
   for each corruption type (``metrics/reward.json``).
5. PPO and GRPO raise the reward: the mean reward over the last 10% of steps exceeds the first 10%'s by at
   least :data:`RL_MIN_GAIN_SE` standard errors (of the difference) (``metrics/{ppo,grpo}.json``).
6. GRPO writes better code: ``grpo``'s generation score is at least :data:`GRPO_MIN_SCORE_GAIN` above ``sft``'s
   (``llmpipe_generation.score``).

A check whose models are not evaluated (not in ``eval.models``) or whose metric is missing is skipped, saying
why; a GRPO run whose groups never differed in reward (no gradient at all) fails check 5.
"""

from __future__ import annotations

from dataclasses import dataclass

Metrics = dict[str, dict[str, float]]
"""Evaluation metrics per model: ``{model: {"<task>.<metric>": value}}``."""

PRETRAIN_MAX_BPB_RATIO = 0.6
"""Largest pretrain / baseline ratio of ``llmpipe_perplexity.bits_per_byte`` that passes check 1."""

REWARD_MIN_ACCURACY = 0.75
"""Smallest held-out pairwise accuracy of the reward model, overall and per corruption type (check 4)."""

RL_MIN_GAIN_SE = 2.0
"""Smallest reward gain, last 10% of steps over the first 10%, in standard errors of the difference (check 5)."""

GRPO_MIN_SCORE_GAIN = 0.05
"""Smallest gain of ``llmpipe_generation.score`` from sft to grpo (check 6): 5 points."""


@dataclass(frozen=True)
class Check:
    """The outcome of one claim.

    Attributes:
        claim: The claim, one sentence.
        metric: Name of the number the check computes (a key of the report stage's metrics).
        value: That number, or None when skipped.
        passed: True/False, or None when skipped.
        detail: The figures behind it, or why it was skipped.
    """

    claim: str
    metric: str
    value: float | None
    passed: bool | None
    detail: str


def _pair(evals: Metrics, key: str, model: str, ref: str) -> tuple[float, float] | str:
    """``(evals[model][key], evals[ref][key])``, or the reason the check must be skipped."""
    missing = [m for m in (model, ref) if m not in evals]
    if missing:
        return f"skipped: {' and '.join(missing)} not in eval.models"
    absent = [m for m in (model, ref) if key not in evals[m]]
    if absent:
        return f"skipped: no {key} for {' and '.join(absent)} (is the task in eval.tasks, with data?)"
    return evals[model][key], evals[ref][key]


def _skipped(claim: str, metric: str, reason: str) -> Check:
    return Check(claim, metric, None, None, reason)


def pretrain_vs_baseline(evals: Metrics) -> Check:
    """Check 1; its value is the ratio pretrain / baseline of ``llmpipe_perplexity.bits_per_byte``."""
    claim = (f"pretrain's bits per byte on held-out code is at most {PRETRAIN_MAX_BPB_RATIO} × the untrained "
             "baseline's (llmpipe_perplexity.bits_per_byte)")
    metric = "check_pretrain_bpb_ratio"
    pair = _pair(evals, "llmpipe_perplexity.bits_per_byte", "pretrain", "baseline")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    ratio = ours / ref
    return Check(claim, metric, ratio, ratio <= PRETRAIN_MAX_BPB_RATIO,
                 f"pretrain {ours:.4f} / baseline {ref:.4f} = {ratio:.3f}")


def sft_vs_pretrain(evals: Metrics) -> Check:
    """Check 2; its value is sft − pretrain of ``llmpipe_sft_chat.bits_per_byte`` (negative passes)."""
    claim = "sft's response bits per byte in the chat format is below pretrain's (llmpipe_sft_chat.bits_per_byte)"
    metric = "check_sft_chat_bpb_delta"
    pair = _pair(evals, "llmpipe_sft_chat.bits_per_byte", "sft", "pretrain")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    detail = f"chat format: pretrain {ref:.4f} → sft {ours:.4f} ({ours - ref:+.4f})"
    plain = _pair(evals, "llmpipe_sft_plain.bits_per_byte", "sft", "pretrain")
    if not isinstance(plain, str):
        detail += f"; plain format: pretrain {plain[1]:.4f} → sft {plain[0]:.4f} ({plain[0] - plain[1]:+.4f})"
    return Check(claim, metric, ours - ref, ours < ref, detail)


def dpo_vs_sft(evals: Metrics) -> Check:
    """Check 3; its value is dpo − sft of ``llmpipe_preference.acc_norm`` (positive passes).

    Per character, not summed: a truncated body is a prefix of the real one, so its summed loglikelihood is
    higher for any model and summed accuracy on that third of the pairs cannot move. The detail gives the
    summed accuracy and each corruption type beside it.
    """
    claim = ("dpo prefers the real body over the corrupted one more often than sft (llmpipe_preference.acc_norm, "
             "loglikelihood per character)")
    metric = "check_dpo_preference_acc_norm_delta"
    key = "llmpipe_preference.acc_norm"
    pair = _pair(evals, key, "dpo", "sft")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    stderr = evals["dpo"].get(f"{key}_stderr")
    noise = f" (stderr of dpo's {stderr:.3f})" if stderr is not None else ""
    detail = f"sft {ref:.3f} → dpo {ours:.3f} ({ours - ref:+.3f}){noise}"
    for other in sorted(k for k in evals["dpo"] if k.startswith("llmpipe_preference.acc") and k != key
                        and not k.endswith("_stderr") and k in evals["sft"]):
        detail += f"; {other.split('.', 1)[1]}: {evals['sft'][other]:.3f} → {evals['dpo'][other]:.3f}"
    return Check(claim, metric, ours - ref, ours > ref, detail)


def reward_accuracy(stages: Metrics) -> Check:
    """Check 4; its value is the smallest of the overall and per-type held-out accuracies."""
    claim = (f"the reward model ranks held-out pairs right at least {REWARD_MIN_ACCURACY} of the time, overall "
             "and for each corruption type (metrics/reward.json)")
    metric = "check_reward_min_accuracy"
    m = stages.get("reward")
    if m is None or "accuracy" not in m:
        return _skipped(claim, metric, "skipped: no metrics/reward.json with an accuracy (run the reward stage)")
    values = {k: v for k, v in m.items() if k == "accuracy" or (k.startswith("accuracy_") and not k.endswith("_se"))}
    worst = min(values.values())
    detail = ", ".join(f"{k.removeprefix('accuracy_') if k != 'accuracy' else 'overall'} {v:.3f}"
                       for k, v in values.items())
    return Check(claim, metric, worst, worst >= REWARD_MIN_ACCURACY, detail)


def rl_reward_gain(stages: Metrics, stage: str) -> Check:
    """Check 5 for `stage` (ppo or grpo); its value is the gain in standard errors of the difference."""
    claim = (f"{stage} raises the reward: the mean over the last 10% of steps exceeds the first 10%'s by at least "
             f"{RL_MIN_GAIN_SE:g} standard errors (metrics/{stage}.json)")
    metric = f"check_{stage}_reward_gain_se"
    m = stages.get(stage)
    keys = ("reward_first", "reward_first_se", "reward_last", "reward_last_se")
    if m is None:
        return _skipped(claim, metric, f"skipped: no metrics/{stage}.json (run the {stage} stage)")
    if m.get("frac_zero_std_groups", 0.0) >= 1.0:  # GRPO's advantages are all 0: loss and gradient 0 on every step
        return Check(claim, metric, 0.0, False, f"{stage} ran, but every group's rewards were equal on every step "
                     "(frac_zero_std_groups 1.0): no advantage, no gradient, the policy never moved; use rewards "
                     f"that differ between completions ({stage}.rewards, e.g. a graded one) or more "
                     f"{stage}.num_generations")
    if "reward_first" not in m:
        return _skipped(claim, metric, f"skipped: {stage} logged no training step with a reward (metrics/{stage}.json "
                        f"has no reward_first; lower {stage}.logging_steps below {stage}.max_steps)")
    if any(k not in m for k in keys):  # one logged step per tenth: no spread, so no standard error (nan, dropped)
        return _skipped(claim, metric, f"skipped: {stage} logged too few steps for a standard error (a tenth of them "
                        f"is one step; it needs at least 11: lower {stage}.logging_steps or raise {stage}.max_steps)")
    first, first_se, last, last_se = (m[k] for k in keys)
    se = (first_se**2 + last_se**2) ** 0.5
    gain = (last - first) / se if se > 0 else float("inf") if last > first else 0.0
    detail = f"first 10% {first:.3f} ± {first_se:.3f} → last 10% {last:.3f} ± {last_se:.3f} ({gain:+.1f} s.e.)"
    return Check(claim, metric, gain, gain >= RL_MIN_GAIN_SE, detail)


def grpo_vs_sft(evals: Metrics) -> Check:
    """Check 6; its value is grpo − sft of ``llmpipe_generation.score``."""
    claim = (f"grpo's generated bodies parse and define the function at least {GRPO_MIN_SCORE_GAIN * 100:g} points "
             "more often than sft's (llmpipe_generation.score)")
    metric = "check_grpo_generation_score_delta"
    pair = _pair(evals, "llmpipe_generation.score", "grpo", "sft")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    detail = f"sft {ref:.3f} → grpo {ours:.3f} ({ours - ref:+.3f})"
    for key, label in (("trivial", "trivial bodies"), ("distinct", "distinct bodies")):  # reward-hacking signs
        shares = _pair(evals, f"llmpipe_generation.{key}", "grpo", "sft")
        if not isinstance(shares, str):
            detail += f"; {label}: sft {shares[1]:.3f} → grpo {shares[0]:.3f}"
    return Check(claim, metric, ours - ref, ours - ref >= GRPO_MIN_SCORE_GAIN - 1e-9, detail)


def run_checks(evals: Metrics, stages: Metrics) -> list[Check]:
    """Every check, in order.

    Args:
        evals: Evaluation metrics per model.
        stages: Training-stage metrics per stage (``metrics/<stage>.json``); missing stages are skipped.
    """
    return [
        pretrain_vs_baseline(evals),
        sft_vs_pretrain(evals),
        dpo_vs_sft(evals),
        reward_accuracy(stages),
        rl_reward_gain(stages, "ppo"),
        rl_reward_gain(stages, "grpo"),
        grpo_vs_sft(evals),
    ]
