"""The post-training stages' checks: each is measured on what it is for, the held-out executable tasks, against
the model it started from, never on its own training reward.

For every post-training stage (sft, dpo and every RL stage: the stages the report's ``sources`` give an input
model, among those evaluated by default in the registry) against its input model (sft: pretrain, or the baseline
without pretraining; dpo: sft; an RL stage: its ``policy``):

1. it raises held-out pass@1 (:data:`~llmpipe.evaluation.checks.PASS_AT_1`) by at least
   :data:`~llmpipe.evaluation.checks.MIN_MARGIN_SE` standard errors of the difference;
2. it does not collapse: its share of distinct held-out answers on the tasks
   (:data:`~llmpipe.evaluation.checks.TASK_DISTINCT`) is not below its input's by more than :data:`~llmpipe.evaluation.checks.MIN_MARGIN_SE` standard errors (one answer
   written for every prompt is reward hacking, not learning);
3. it keeps held-out bits per byte within :data:`MAX_BPB_RISE` of its input's (the alignment tax);
4. an RL stage with a KL target (ppo's ``kl_target``) ends within :data:`MAX_KL_TARGET_RATIO` × that target.

dpo's preference accuracy rising is :func:`llmpipe.evaluation.checks.dpo_vs_sft`. An RL stage's rising training
reward is shown on the card (its RL table), never a check: a policy can raise it by writing one body that meets
the reward for every prompt. Where no evaluation has the tasks' metric (a run or users' data without executable
tasks) checks 1 and 2 are skipped, saying so.
"""

from __future__ import annotations

from llmpipe.config.stages import REGISTRY
from llmpipe.evaluation.checks import (
    MIN_MARGIN_SE,
    PASS_AT_1,
    TASK_DISTINCT,
    Check,
    Metrics,
    beyond_noise,
    pair_of,
    skipped,
    stderr_of_difference,
)

MAX_BPB_RISE = 0.10
"""Largest relative rise of held-out ``llmpipe_perplexity.bits_per_byte`` over the input model's that passes (10%)."""

MAX_KL_TARGET_RATIO = 2.0
"""Largest ratio of an RL stage's final KL to the reference (``kl_final``) over its ``kl_target`` that passes."""

BPB = "llmpipe_perplexity.bits_per_byte"


def _without_tasks(claim: str, metric: str, key: str, evals: Metrics) -> Check | None:
    """The skipped check when no evaluation has `key` (the data has no executable tasks), else None."""
    if any(key in m for m in evals.values()):
        return None
    return skipped(claim, metric, f"skipped: no {key} in any evaluation (this data has no executable tasks with "
                   "tests, or llmpipe_tasks is not in eval.tasks)")


def _moved(source: str, ref: float, stage: str, ours: float, noise: str) -> str:
    """A check's detail: ``sft 0.300 → ppo 0.420 (+0.120, +2.5 s.e. of 0.048)``."""
    return f"{source} {ref:.3f} → {stage} {ours:.3f} ({ours - ref:+.3f}{noise})"


def pass_at_1_gain(evals: Metrics, stage: str, source: str) -> Check:
    """Check 1; its value is `stage` − `source` of :data:`PASS_AT_1` (passes by :data:`MIN_MARGIN_SE` s.e.)."""
    claim = (f"{stage} passes more held-out tasks than {source}, by at least {MIN_MARGIN_SE:g} standard errors "
             f"(pass@1, {PASS_AT_1})")
    metric = f"check_{stage}_pass1_delta"
    pair = pair_of(evals, PASS_AT_1, stage, source)
    if isinstance(pair, str):
        return _without_tasks(claim, metric, PASS_AT_1, evals) or skipped(claim, metric, pair)
    ours, ref = pair
    passed, noise = beyond_noise(ours - ref, stderr_of_difference(evals, PASS_AT_1, stage, source))
    return Check(claim, metric, ours - ref, passed, _moved(source, ref, stage, ours, noise))


def no_collapse(evals: Metrics, stage: str, source: str) -> Check:
    """Check 2; its value is `stage` − `source` of :data:`TASK_DISTINCT`. It fails when the drop exceeds
    :data:`MIN_MARGIN_SE` standard errors of the difference (any drop when there is none)."""
    claim = (f"{stage} does not collapse: its share of distinct held-out answers is not below {source}'s by more "
             f"than {MIN_MARGIN_SE:g} standard errors ({TASK_DISTINCT})")
    metric = f"check_{stage}_distinct_delta"
    pair = pair_of(evals, TASK_DISTINCT, stage, source)
    if isinstance(pair, str):
        return _without_tasks(claim, metric, TASK_DISTINCT, evals) or skipped(claim, metric, pair)
    ours, ref = pair
    se = stderr_of_difference(evals, TASK_DISTINCT, stage, source)
    drop = ref - ours
    passed = drop <= 0 if not se else drop <= MIN_MARGIN_SE * se
    noise = ("; no standard error" if se is None else "; standard error 0" if se == 0
             else f", {-drop / se:+.1f} s.e. of {se:.3f}")
    return Check(claim, metric, ours - ref, passed, _moved(source, ref, stage, ours, noise))


def bpb_kept(evals: Metrics, stage: str, source: str) -> Check:
    """Check 3; its value is the ratio `stage` / `source` of held-out ``llmpipe_perplexity.bits_per_byte``."""
    claim = (f"{stage} keeps held-out bits per byte within {MAX_BPB_RISE:.0%} of its input model {source}'s "
             f"({BPB})")
    metric = f"check_{stage}_bpb_ratio"
    pair = pair_of(evals, BPB, stage, source)
    if isinstance(pair, str):
        return skipped(claim, metric, pair)
    ours, ref = pair
    ratio = ours / ref
    return Check(claim, metric, ratio, ratio <= 1 + MAX_BPB_RISE,
                 f"{source} {ref:.3f} → {stage} {ours:.3f} (×{ratio:.3f})")


def kl_within_target(stages: Metrics, stage: str, target: float) -> Check:
    """Check 4; its value is `stage`'s ``kl_final`` (``metrics/<stage>.json``) over `target` (its ``kl_target``,
    in the same unit)."""
    claim = (f"{stage} ends within {MAX_KL_TARGET_RATIO:g} × {stage}.kl_target of its reference (the last step's KL, "
             f"metrics/{stage}.json kl_final)")
    metric = f"check_{stage}_kl_ratio"
    m = stages.get(stage)
    if m is None:
        return skipped(claim, metric, f"skipped: no metrics/{stage}.json of these params (run the {stage} stage)")
    if "kl_final" not in m:
        return skipped(claim, metric, f"skipped: metrics/{stage}.json has no kl_final")
    ratio = m["kl_final"] / target
    return Check(claim, metric, ratio, ratio <= MAX_KL_TARGET_RATIO,
                 f"kl_final {m['kl_final']:.3f} / kl_target {target:g} = {ratio:.2f}")


def post_training(sources: dict[str, str]) -> dict[str, str]:
    """The post-training stages among `sources` (``{training stage: its input model}``) and their inputs: those the
    registry evaluates by default (the reward model and vlm are not post-training of the policy)."""
    return {stage: source for stage, source in sources.items() if REGISTRY[stage].evaluated}


def run_task_checks(evals: Metrics, stages: Metrics, sources: dict[str, str], kl_targets: dict[str, float]
                    ) -> list[Check]:
    """Checks 1 to 4 of every post-training stage, stage by stage in pipeline order.

    Args:
        evals: Evaluation metrics per model.
        stages: Training-stage metrics per stage (``metrics/<stage>.json``).
        sources: ``{training stage: its input model}`` (sft: pretrain, dpo: sft, ppo: ppo.policy, …); only the
            :func:`post_training` ones are checked.
        kl_targets: ``{RL stage: its kl_target}`` for the stages that steer to one (check 4), in the unit of their
            ``kl_final``.
    """
    found = []
    for stage, source in post_training(sources).items():
        found += [check(evals, stage, source) for check in (pass_at_1_gain, no_collapse, bpb_kept)]
        if stage in kl_targets:
            found.append(kl_within_target(stages, stage, kl_targets[stage]))
    return found
