"""The claims the pipeline must show, computed from the evaluation metrics of its models and the metrics of
its training stages.

1. Pretraining works: ``pretrain`` has at most :data:`PRETRAIN_MAX_BPB_RATIO` × the untrained ``baseline``'s
   bits per byte on held-out code (``llmpipe_perplexity``).
2. SFT works: ``sft`` has lower response bits per byte than ``pretrain`` in the chat format (``llmpipe_sft_chat``).
3. DPO works: ``dpo`` prefers the real body over the corrupted one more often than ``sft`` (``llmpipe_preference``
   acc_norm), by at least :data:`MIN_MARGIN_SE` standard errors of the difference.
4. The reward model ranks held-out pairs right at least :data:`REWARD_MIN_ACCURACY` of the time, overall (by
   :data:`MIN_MARGIN_SE` binomial standard errors over ``num_pairs``) and for each corruption type
   (``metrics/reward.json``).
5. Every RL stage (the registry's ``rl``: ppo, grpo) raises the reward: the mean reward over the last 10% of steps
   exceeds the first 10%'s by at least :data:`MIN_MARGIN_SE` standard errors (of the difference)
   (``metrics/<stage>.json``).
6. Every RL stage on verifiable rewards (the registry's ``verifiable``: grpo) writes better code: its generation
   score is at least :data:`RL_MIN_SCORE_GAIN` above ``sft``'s (``llmpipe_generation.score``), and by at least
   :data:`MIN_MARGIN_SE` standard errors of the difference. On users' own data (``data.source`` other than stdlib),
   where no stdlib function is generated: it passes more of the held-out tasks' tests than ``sft``
   (:data:`TESTS_PASS`), skipped while the data has no such tasks.

The claims speak of the data: functions and corrupted bodies on the stdlib, held-out text, responses and pairs on
users' own data. Without pretraining (``pretrain.enabled: false``) check 1 is skipped and check 2 compares sft with
the baseline, the model sft started from.

Wherever lm-eval or the stage gives a standard error, a check passes only by a margin of :data:`MIN_MARGIN_SE` of
them (lm-eval gives none for bits per byte: checks 1 and 2 compare the figures as they are).

Beside the claims, :func:`run_costs` flags what post-training cost: each post-training stage's held-out bits per
byte against its input model's (the "alignment tax", flagged above :data:`ALIGNMENT_TAX_MAX_RISE`) and the RL
stages' share of distinct generated bodies (flagged below :data:`RL_MIN_DISTINCT`: one body written for every
prompt is reward hacking, not learning).
A check whose models are not evaluated for the current params (not in ``eval.models``, or their metrics are of
another run: :mod:`llmpipe.report.current`) or whose metric is missing is skipped, saying why; a GRPO run whose
groups never differed in reward (no gradient at all) fails check 5.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmpipe.config.stages import RL_TASKS, VERIFIABLE_TASKS

Metrics = dict[str, dict[str, float]]
"""Evaluation metrics per model: ``{model: {"<task>.<metric>": value}}``."""

PRETRAIN_MAX_BPB_RATIO = 0.6
"""Largest pretrain / baseline ratio of ``llmpipe_perplexity.bits_per_byte`` that passes check 1."""

REWARD_MIN_ACCURACY = 0.75
"""Smallest held-out pairwise accuracy of the reward model, overall and per corruption type (check 4)."""

MIN_MARGIN_SE = 2.0
"""Smallest margin of a passing check, in standard errors of the difference (checks 3 to 6)."""

ALIGNMENT_TAX_MAX_RISE = 0.10
"""Largest relative rise of held-out ``llmpipe_perplexity.bits_per_byte`` over the input model's that is not
flagged (10%)."""

RL_MIN_DISTINCT = 0.5
"""Smallest share of distinct generated bodies (``llmpipe_generation.distinct``) of an RL stage that is not
flagged."""

RL_MIN_SCORE_GAIN = 0.05
"""Smallest gain of ``llmpipe_generation.score`` from sft to an RL stage on verifiable rewards (check 6): 5 points."""

TESTS_PASS = "llmpipe_tasks.tests_pass"
"""The share of held-out task tests a model's code passes, on tasks with tests users give: check 6 on their
data (:func:`tests_pass_gain`); skipped while the data has none."""

DISTINCT = {True: "llmpipe_generation.distinct", False: "llmpipe_answers.distinct"}
"""The share of distinct generated answers, by whether the data is the stdlib (`llmpipe.evaluation.tasks.tasks_for`)."""


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
    if missing:  # not in eval.models, or its evaluation is of other params or inputs (llmpipe.report.current)
        return (f"skipped: no evaluation of {' and '.join(missing)} for these params (in eval.models? dvc repro "
                f"{' '.join(f'evaluate@{m}' for m in missing)})")
    absent = [m for m in (model, ref) if key not in evals[m]]
    if absent:
        return f"skipped: no {key} for {' and '.join(absent)} (is the task in eval.tasks, with data?)"
    return evals[model][key], evals[ref][key]


def _skipped(claim: str, metric: str, reason: str) -> Check:
    return Check(claim, metric, None, None, reason)


def _stderr_of_difference(evals: Metrics, key: str, model: str, ref: str) -> float | None:
    """sqrt(se_model² + se_ref²) of ``<key>_stderr`` (independent samples: an upper bound for the paired ones the
    tasks use), or None when either has no stderr."""
    errors = [evals[m].get(f"{key}_stderr") for m in (model, ref)]
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
        return _skipped(claim, metric, "skipped: pretrain.enabled is false (nothing was pretrained: models/pretrain "
                        "is the baseline)")
    pair = _pair(evals, "llmpipe_perplexity.bits_per_byte", "pretrain", "baseline")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    ratio = ours / ref
    return Check(claim, metric, ratio, ratio <= PRETRAIN_MAX_BPB_RATIO,
                 f"pretrain {ours:.4f} / baseline {ref:.4f} = {ratio:.3f}")


def sft_vs_pretrain(evals: Metrics, source: str = "pretrain") -> Check:
    """Check 2; its value is sft − `source` (sft's input model: pretrain, or the baseline when nothing was
    pretrained) of ``llmpipe_sft_chat.bits_per_byte`` (negative passes)."""
    claim = f"sft's response bits per byte in the chat format is below {source}'s (llmpipe_sft_chat.bits_per_byte)"
    metric = "check_sft_chat_bpb_delta"
    pair = _pair(evals, "llmpipe_sft_chat.bits_per_byte", "sft", source)
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    detail = f"chat format: {source} {ref:.4f} → sft {ours:.4f} ({ours - ref:+.4f})"
    plain = _pair(evals, "llmpipe_sft_plain.bits_per_byte", "sft", source)
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
    pair = _pair(evals, key, "dpo", "sft")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    passed, noise = beyond_noise(ours - ref, _stderr_of_difference(evals, key, "dpo", "sft"))
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
        return _skipped(claim, metric, "skipped: no metrics/reward.json of these params with an accuracy (run the "
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


def rl_reward_gain(stages: Metrics, stage: str) -> Check:
    """Check 5 for RL `stage`; its value is the gain in standard errors of the difference."""
    claim = (f"{stage} raises the reward: the mean over the last 10% of steps exceeds the first 10%'s by at least "
             f"{MIN_MARGIN_SE:g} standard errors (metrics/{stage}.json)")
    metric = f"check_{stage}_reward_gain_se"
    m = stages.get(stage)
    keys = ("reward_first", "reward_first_se", "reward_last", "reward_last_se")
    if m is None:
        return _skipped(claim, metric, f"skipped: no metrics/{stage}.json of these params (run the {stage} stage)")
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
    return Check(claim, metric, gain, gain >= MIN_MARGIN_SE, detail)


def generation_gain(evals: Metrics, stage: str) -> Check:
    """Check 6 for RL `stage` on verifiable rewards; its value is `stage` − sft of ``llmpipe_generation.score``."""
    claim = (f"{stage}'s generated bodies parse and define the function at least {RL_MIN_SCORE_GAIN * 100:g} points "
             f"and {MIN_MARGIN_SE:g} standard errors more often than sft's (llmpipe_generation.score)")
    metric = f"check_{stage}_generation_score_delta"
    pair = _pair(evals, "llmpipe_generation.score", stage, "sft")
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    se = _stderr_of_difference(evals, "llmpipe_generation.score", stage, "sft")
    significant, noise = beyond_noise(ours - ref, se)
    detail = f"sft {ref:.3f} → {stage} {ours:.3f} ({ours - ref:+.3f}{noise})"
    for key, label in (("trivial", "trivial bodies"), ("distinct", "distinct bodies")):  # reward-hacking signs
        shares = _pair(evals, f"llmpipe_generation.{key}", stage, "sft")
        if not isinstance(shares, str):
            detail += f"; {label}: sft {shares[1]:.3f} → {stage} {shares[0]:.3f}"
    return Check(claim, metric, ours - ref, significant and ours - ref >= RL_MIN_SCORE_GAIN - 1e-9, detail)


def tests_pass_gain(evals: Metrics, model: str, ref: str = "sft") -> Check:
    """Check 6 on users' own data, where no stdlib function is generated: `model` passes more of the held-out
    tasks' tests than `ref` (:data:`TESTS_PASS`, from the tasks a user gives), by :data:`MIN_MARGIN_SE`
    standard errors; skipped, saying so, where the data has no such tasks."""
    claim = (f"{model} passes more of the held-out tasks' tests than {ref}, by at least {MIN_MARGIN_SE:g} standard "
             f"errors ({TESTS_PASS})")
    metric = f"check_{model}_tests_pass_delta"
    if not any(TESTS_PASS in m for m in evals.values()):
        return _skipped(claim, metric, f"skipped: no {TESTS_PASS} (this data has no executable tasks with tests)")
    pair = _pair(evals, TESTS_PASS, model, ref)
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, theirs = pair
    passed, noise = beyond_noise(ours - theirs, _stderr_of_difference(evals, TESTS_PASS, model, ref))
    return Check(claim, metric, ours - theirs, passed, f"{ref} {theirs:.3f} → {model} {ours:.3f} "
                 f"({ours - theirs:+.3f}{noise})")


def run_checks(evals: Metrics, stages: Metrics, stdlib: bool = True, sft_source: str = "pretrain") -> list[Check]:
    """Every check, in order, in the words of the data.

    Args:
        evals: Evaluation metrics per model.
        stages: Training-stage metrics per stage (``metrics/<stage>.json``); missing stages are skipped.
        stdlib: Whether the data is the embedded stdlib corpus (``data.source``); on users' own data no check
            grades Python code, and check 6 reads the tests of their tasks (:func:`tests_pass_gain`).
        sft_source: sft's input model: ``pretrain``, or ``baseline`` when nothing was pretrained (check 1 is then
            skipped).
    """
    return [
        pretrain_vs_baseline(evals, stdlib, pretrained=sft_source == "pretrain"),
        sft_vs_pretrain(evals, sft_source),
        dpo_vs_sft(evals, stdlib),
        reward_accuracy(stages, stdlib),
        *(rl_reward_gain(stages, stage) for stage in RL_TASKS),
        *(generation_gain(evals, stage) if stdlib else tests_pass_gain(evals, stage) for stage in VERIFIABLE_TASKS),
    ]


def alignment_tax(evals: Metrics, stage: str, source: str) -> Check:
    """What post-training `stage` cost on held-out text: its ``llmpipe_perplexity.bits_per_byte`` over its input
    model `source`'s; flagged (passed False) above 1 + :data:`ALIGNMENT_TAX_MAX_RISE`."""
    claim = (f"{stage} keeps held-out bits per byte within {ALIGNMENT_TAX_MAX_RISE:.0%} of its input model {source}'s "
             "(llmpipe_perplexity.bits_per_byte)")
    metric = f"cost_{stage}_bpb_ratio"
    pair = _pair(evals, "llmpipe_perplexity.bits_per_byte", stage, source)
    if isinstance(pair, str):
        return _skipped(claim, metric, pair)
    ours, ref = pair
    ratio = ours / ref
    return Check(claim, metric, ratio, ratio <= 1 + ALIGNMENT_TAX_MAX_RISE,
                 f"{source} {ref:.3f} → {stage} {ours:.3f} (×{ratio:.3f})")


def distinct_answers(evals: Metrics, stage: str, source: str, stdlib: bool = True) -> Check:
    """The share of distinct bodies (answers, on users' data) RL `stage` generates (:data:`DISTINCT`), beside its
    input model's; flagged (passed False) below :data:`RL_MIN_DISTINCT`."""
    key = DISTINCT[stdlib]
    claim = (f"{stage} writes distinct {'bodies' if stdlib else 'answers'} for at least {RL_MIN_DISTINCT:.0%} of the "
             f"prompts ({key})")
    metric = f"cost_{stage}_distinct"
    if key not in evals.get(stage, {}):
        return _skipped(claim, metric, f"skipped: no {key} for {stage} (is it in eval.models and eval.tasks?)")
    ours = evals[stage][key]
    before = f"{source} {evals[source][key]:.3f} → " if key in evals.get(source, {}) else ""
    return Check(claim, metric, ours, ours >= RL_MIN_DISTINCT, f"{before}{stage} {ours:.3f}")


def run_costs(evals: Metrics, sources: dict[str, str], rl_stages: tuple[str, ...], stdlib: bool = True
              ) -> list[Check]:
    """What each post-training stage cost, in order: the alignment tax of every stage in `sources`, then the
    distinct-answer share of every RL stage.

    Args:
        evals: Evaluation metrics per model.
        sources: ``{post-training stage: its input model}`` (sft: pretrain, dpo: sft, ppo: ppo.policy, …).
        rl_stages: The RL stages among them.
        stdlib: Whether the data is the stdlib corpus (which generation task gives the distinct share).
    """
    costs = [alignment_tax(evals, stage, source) for stage, source in sources.items()]
    return costs + [distinct_answers(evals, stage, sources[stage], stdlib) for stage in rl_stages if stage in sources]
