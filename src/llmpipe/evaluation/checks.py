"""The three claims the pipeline must show, computed from the evaluation metrics of its models.

1. Pretraining works: ``pretrain`` has at most :data:`PRETRAIN_MAX_BPB_RATIO` × the untrained ``baseline``'s
   bits per byte on held-out code (``llmpipe_perplexity``).
2. SFT works: ``sft`` has lower response bits per byte than ``pretrain`` in the chat format (``llmpipe_sft_chat``).
3. DPO works: ``dpo`` prefers the real body over the corrupted one more often than ``sft`` (``llmpipe_preference``
   acc_norm).

A check whose models are not evaluated (not in ``eval.models``) or whose metric is missing is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

Metrics = dict[str, dict[str, float]]
"""Evaluation metrics per model: ``{model: {"<task>.<metric>": value}}``."""

PRETRAIN_MAX_BPB_RATIO = 0.6
"""Largest pretrain / baseline ratio of ``llmpipe_perplexity.bits_per_byte`` that passes check 1."""


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


def run_checks(evals: Metrics) -> list[Check]:
    """All three checks, in order."""
    return [pretrain_vs_baseline(evals), sft_vs_pretrain(evals), dpo_vs_sft(evals)]
