"""The claims the pipeline must show, computed from the evaluation metrics of its models and the metrics of
its training stages. This module holds the claims about pretraining, the chat format, preferences and the reward
model, and what every check shares; the post-training stages' checks on the executable tasks are
:mod:`llmpipe.evaluation.task_checks`.

1. Pretraining works: ``pretrain`` has at most :data:`PRETRAIN_MAX_BPB_RATIO` × the untrained ``baseline``'s
   bits per byte on held-out code (``llmpipe_perplexity``).
2. SFT learns the chat format: ``sft`` has lower response bits per byte than ``pretrain`` in the chat format
   (``llmpipe_sft_chat``).
3. DPO learns the preferences: ``dpo`` prefers the real body over the corrupted one more often than ``sft``
   (``llmpipe_preference`` acc_norm), by at least :data:`MIN_MARGIN_SE` standard errors of the difference.
4. The reward model ranks held-out pairs right at least :data:`REWARD_MIN_ACCURACY` of the time, overall (by
   :data:`MIN_MARGIN_SE` binomial standard errors over ``num_pairs``) and for each corruption type
   (``metrics/reward.json``).

The claims speak of the data: functions and corrupted bodies on the stdlib, held-out text, responses and pairs on
users' own data. Without pretraining (``pretrain.enabled: false``) check 1 is skipped and check 2 compares sft with
the baseline, the model sft started from.

Wherever lm-eval or the stage gives a standard error (or, for a share, the number of documents it is a share of),
a check passes only by a margin of :data:`MIN_MARGIN_SE` of them (lm-eval gives none for bits per byte: those
checks compare the figures as they are). A check whose models are not evaluated for the current params (not in
``eval.models``, or their metrics are of another run: :mod:`llmpipe.report.current`) or whose metric is missing
is skipped, saying why.
"""

from __future__ import annotations

from dataclasses import dataclass

Metrics = dict[str, dict[str, float]]
"""Evaluation metrics per model: ``{model: {"<task>.<metric>": value}}``."""

PRETRAIN_MAX_BPB_RATIO = 0.6
"""Largest pretrain / baseline ratio of ``llmpipe_perplexity.bits_per_byte`` that passes check 1."""

REWARD_MIN_ACCURACY = 0.75
"""Smallest held-out pairwise accuracy of the reward model, overall and per corruption type (check 4)."""

MIN_MARGIN_SE = 2.0
"""Smallest margin of a passing check, in standard errors of the difference."""

PASS_AT_1 = "llmpipe_tasks.pass_at_1"
"""pass@1 on the held-out executable tasks (the share of tasks whose hidden tests a model's greedy answer passes),
with its ``<key>_stderr`` as lm-eval writes it."""

TASK_DISTINCT = "llmpipe_tasks.distinct"
"""The share of distinct answers a model writes for the held-out tasks."""


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


def pair_of(evals: Metrics, key: str, model: str, ref: str) -> tuple[float, float] | str:
    """``(evals[model][key], evals[ref][key])``, or the reason the check must be skipped."""
    missing = [m for m in (model, ref) if m not in evals]
    if missing:  # not in eval.models, or its evaluation is of other params or inputs (llmpipe.report.current)
        return (f"skipped: no evaluation of {' and '.join(missing)} for these params (in eval.models? dvc repro "
                f"{' '.join(f'evaluate@{m}' for m in missing)})")
    absent = [m for m in (model, ref) if key not in evals[m]]
    if absent:
        return f"skipped: no {key} for {' and '.join(absent)} (is the task in eval.tasks, with data?)"
    return evals[model][key], evals[ref][key]


def skipped(claim: str, metric: str, reason: str) -> Check:
    """A check that did not run, and `reason`, why."""
    return Check(claim, metric, None, None, reason)


def stderr(evals: Metrics, key: str, model: str) -> float | None:
    """The standard error of `model`'s ``<task>.<metric>`` `key`: lm-eval's ``<key>_stderr``, else the binomial
    sqrt(p (1 − p) / n) of a share p over the task's ``<task>.num_docs`` n; None when neither is known."""
    m = evals[model]
    if f"{key}_stderr" in m:
        return m[f"{key}_stderr"]
    n = m.get(f"{key.split('.', 1)[0]}.num_docs")
    if not n or not 0 <= m[key] <= 1:
        return None
    return (m[key] * (1 - m[key]) / n) ** 0.5


def stderr_of_difference(evals: Metrics, key: str, model: str, ref: str) -> float | None:
    """sqrt(se_model² + se_ref²) of :func:`stderr` (independent samples: an upper bound for the paired ones the
    tasks use), or None when either has none."""
    errors = [stderr(evals, key, m) for m in (model, ref)]
    if any(e is None for e in errors):
        return None
    return (errors[0] ** 2 + errors[1] ** 2) ** 0.5


def beyond_noise(gain: float, se: float | None) -> tuple[bool, str]:
    """Whether `gain` is positive by at least :data:`MIN_MARGIN_SE` × `se` (just positive when `se` is None), and
    the text that says so for a check's detail."""
    if se is None:
        return gain > 0, "; no standard error"
    if se == 0:
        return gain > 0, "; standard error 0"
    return gain >= MIN_MARGIN_SE * se, f", {gain / se:+.1f} s.e. of {se:.3f}"


def pretrain_vs_baseline(evals: Metrics, stdlib: bool = True, pretrained: bool = True) -> Check:
    """Check 1; its value is the ratio pretrain / baseline of ``llmpipe_perplexity.bits_per_byte``. Skipped when
    nothing was pretrained (``pretrain.enabled: false``: models/pretrain is the baseline)."""
    claim = (f"pretrain's bits per byte on held-out {'code' if stdlib else 'text'} is at most "
             f"{PRETRAIN_MAX_BPB_RATIO} × the {'untrained ' if stdlib else ''}baseline's (llmpipe_perplexity.bits_per_byte)")
    metric = "check_pretrain_bpb_ratio"
    if not pretrained:
        return skipped(claim, metric, "skipped: pretrain.enabled is false (nothing was pretrained: models/pretrain "
                        "is the baseline)")
    pair = pair_of(evals, "llmpipe_perplexity.bits_per_byte", "pretrain", "baseline")
    if isinstance(pair, str):
        return skipped(claim, metric, pair)
    ours, ref = pair
    ratio = ours / ref
    return Check(claim, metric, ratio, ratio <= PRETRAIN_MAX_BPB_RATIO,
                 f"pretrain {ours:.4f} / baseline {ref:.4f} = {ratio:.3f}")


def sft_vs_pretrain(evals: Metrics, source: str = "pretrain") -> Check:
    """Check 2; its value is sft − `source` (sft's input model: pretrain, or the baseline when nothing was
    pretrained) of ``llmpipe_sft_chat.bits_per_byte`` (negative passes)."""
    claim = f"sft's response bits per byte in the chat format is below {source}'s (llmpipe_sft_chat.bits_per_byte)"
    metric = "check_sft_chat_bpb_delta"
    pair = pair_of(evals, "llmpipe_sft_chat.bits_per_byte", "sft", source)
    if isinstance(pair, str):
        return skipped(claim, metric, pair)
    ours, ref = pair
    detail = f"chat format: {source} {ref:.4f} → sft {ours:.4f} ({ours - ref:+.4f})"
    plain = pair_of(evals, "llmpipe_sft_plain.bits_per_byte", "sft", source)
    if not isinstance(plain, str):
        detail += f"; plain format: {source} {plain[1]:.4f} → sft {plain[0]:.4f} ({plain[0] - plain[1]:+.4f})"
    return Check(claim, metric, ours - ref, ours < ref, detail)


def dpo_vs_sft(evals: Metrics, stdlib: bool = True) -> Check:
    """Check 3; its value is dpo − sft of ``llmpipe_preference.acc_norm`` (positive passes).

    Per character, not summed: a truncated body is a prefix of the real one, so its summed loglikelihood is
    higher for any model and summed accuracy on that third of the pairs cannot move. The detail gives the
    summed accuracy and each corruption type beside it.
    """
    pair_words = "the real body over the corrupted one" if stdlib else "the chosen response of held-out pairs"
    claim = (f"dpo prefers {pair_words} more often than sft, by at least {MIN_MARGIN_SE:g} standard errors "
             "(llmpipe_preference.acc_norm, loglikelihood per character)")
    metric = "check_dpo_preference_acc_norm_delta"
    key = "llmpipe_preference.acc_norm"
    pair = pair_of(evals, key, "dpo", "sft")
    if isinstance(pair, str):
        return skipped(claim, metric, pair)
    ours, ref = pair
    passed, noise = beyond_noise(ours - ref, stderr_of_difference(evals, key, "dpo", "sft"))
    detail = f"sft {ref:.3f} → dpo {ours:.3f} ({ours - ref:+.3f}{noise})"
    for other in sorted(k for k in evals["dpo"] if k.startswith("llmpipe_preference.acc") and k != key
                        and not k.endswith("_stderr") and k in evals["sft"]):
        detail += f"; {other.split('.', 1)[1]}: {evals['sft'][other]:.3f} → {evals['dpo'][other]:.3f}"
    return Check(claim, metric, ours - ref, passed, detail)


def reward_accuracy(stages: Metrics, stdlib: bool = True) -> Check:
    """Check 4; its value is the smallest of the overall and per-type held-out accuracies."""
    per_type = " and for each corruption type" if stdlib else ""
    claim = (f"the reward model ranks held-out pairs right at least {REWARD_MIN_ACCURACY} of the time, overall "
             f"(by {MIN_MARGIN_SE:g} standard errors){per_type} (metrics/reward.json)")
    metric = "check_reward_min_accuracy"
    m = stages.get("reward")
    if m is None or "accuracy" not in m:
        return skipped(claim, metric, "skipped: no metrics/reward.json of these params with an accuracy (run the "
                        "reward stage)")
    values = {k: v for k, v in m.items() if k == "accuracy" or (k.startswith("accuracy_") and not k.endswith("_se"))}
    worst = min(values.values())
    detail = ", ".join(f"{k.removeprefix('accuracy_') if k != 'accuracy' else 'overall'} {v:.3f}"
                       for k, v in values.items())
    passed = worst >= REWARD_MIN_ACCURACY
    if m.get("num_pairs"):  # binomial standard error of the overall accuracy over the held-out pairs
        se = (m["accuracy"] * (1 - m["accuracy"]) / m["num_pairs"]) ** 0.5
        passed = passed and m["accuracy"] - MIN_MARGIN_SE * se >= REWARD_MIN_ACCURACY
        detail += f" (overall ± {se:.3f} over {m['num_pairs']:g} pairs)"
    return Check(claim, metric, worst, passed, detail)


def run_checks(evals: Metrics, stages: Metrics, stdlib: bool = True, sft_source: str = "pretrain") -> list[Check]:
    """Checks 1 to 4, in order, in the words of the data (the post-training stages' checks on the tasks follow
    them on the card: :func:`llmpipe.evaluation.task_checks.run_task_checks`).

    Args:
        evals: Evaluation metrics per model.
        stages: Training-stage metrics per stage (``metrics/<stage>.json``); missing stages are skipped.
        stdlib: Whether the data is the embedded stdlib corpus (``data.source``).
        sft_source: sft's input model: ``pretrain``, or ``baseline`` when nothing was pretrained (check 1 is then
            skipped).
    """
    return [
        pretrain_vs_baseline(evals, stdlib, pretrained=sft_source == "pretrain"),
        sft_vs_pretrain(evals, sft_source),
        dpo_vs_sft(evals, stdlib),
        reward_accuracy(stages, stdlib),
    ]
