"""PPO for language models, the algorithm alone: every piece is a pure torch function over padded
``(B, T)`` tensors of response tokens, so it can be pinned by hand-computed tests.

Conventions: ``B`` sequences, ``T`` response tokens (right-padded), ``V`` vocabulary. ``mask`` is 1 on real
response tokens (up to and including the first eos) and 0 on padding; masks are contiguous prefixes of each
row. Log-probabilities are natural logs (nats) of the sampled token.

Sources:
    Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (clipped surrogate, clipped value loss).
    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation" (GAE).
    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences" (per-token KL penalty in the
    reward, reward normalisation).
    Ouyang et al. 2022, "Training language models to follow instructions with human feedback" (PPO-ptx).
    Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO: A Case Study on TL;DR Summarization"
    (score at the eos token, missing-eos penalty, reward and advantage whitening, value clipping).
    Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html (k1, k3).
    Chan, Golub and LeVeque 1979, "Updating Formulae and a Pairwise Algorithm for Computing Sample
    Variances" (the parallel mean/variance merge of :class:`RunningMeanStd`).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is 1.

    Args:
        x: Any shape, e.g. ``(B, T)``.
        mask: Same shape as `x`, 0/1 (bool or float).
        dim: Reduce this dimension only; None reduces all.

    Returns:
        A scalar, or `x` reduced over `dim`. NaN where the mask is all zero.
    """
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of `x` over the positions where `mask` is 1 (all dimensions reduced).

    Args:
        x: Any shape.
        mask: Same shape as `x`, 0/1.
        unbiased: Apply Bessel's correction n / (n - 1) (as TRL does); skipped when n is 1.

    Returns:
        A scalar tensor.

    Raises:
        ValueError: The mask selects nothing.
    """
    n = mask.to(x.dtype).sum()
    if n == 0:
        raise ValueError("masked_var: the mask selects no element")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise `x` over the masked positions: ``(x - mean) / sqrt(var + eps)`` (unbiased var).

    Args:
        x: ``(B, T)``.
        mask: ``(B, T)`` 0/1.
        shift_mean: When False the mean is added back, so only the scale changes (how TRL and Huang et al.
            2024 whiten per-token rewards, keeping their sign).
        eps: Added to the variance.

    Returns:
        ``(B, T)``, 0 at padding.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-probability (nats) of each token under the logits that predict it.

    Args:
        logits: ``(B, T, V)`` of the sampling distribution (`llmpipe.rl.ppo.sampling.sampled_logits`).
        tokens: ``(B, T)`` token ids.

    Returns:
        ``(B, T)``.
    """
    return torch.gather(logits.log_softmax(-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of the categorical distribution at each position: ``logsumexp(z) - sum(softmax(z) * z)``.

    Args:
        logits: ``(B, T, V)``; -inf where a sampling filter dropped a token (it adds 0, not 0 × -inf).

    Returns:
        ``(B, T)``.
    """
    probs = logits.softmax(-1)
    return torch.logsumexp(logits, -1) - (probs * logits.masked_fill(probs == 0, 0.0)).sum(-1)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimator k1 = ``logp - ref_logp`` (Schulman 2020).

    Unbiased for the KL of a sampled token, but high-variance and negative on some tokens.

    Args:
        logprobs: ``(B, T)`` log-probabilities of the sampled tokens under the policy that sampled them.
        ref_logprobs: ``(B, T)`` the same tokens under the reference policy.

    Returns:
        ``(B, T)`` in nats.
    """
    return logprobs - ref_logprobs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(policy || reference) estimator k3 = ``(r - 1) - log r`` with ``r = p_ref / p`` (Schulman 2020).

    Unbiased, never negative, lower variance than k1 when the policies are close.

    Args:
        logprobs: ``(B, T)`` log-probabilities of the sampled tokens under the policy.
        ref_logprobs: ``(B, T)`` the same tokens under the reference policy.

    Returns:
        ``(B, T)`` in nats.
    """
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio


KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}
"""``ppo.kl_estimator`` → estimator."""


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens, by a reverse scan.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``; the value after
    the last real token is 0 (the episode ends there), which zeroing padding gives for free.

    Args:
        rewards: ``(B, T)`` per-token rewards.
        values: ``(B, T)`` value estimates V(s_t) of the state before each response token.
        mask: ``(B, T)`` 0/1, 1 on real tokens (a prefix of each row).
        gamma: Discount per token.
        lam: GAE lambda (0 = one-step TD, 1 = Monte Carlo return minus V).

    Returns:
        ``(advantages, returns)``, both ``(B, T)`` and 0 at padding; ``returns = advantages + values``
        is the value target.
    """
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages * mask, (advantages + values) * mask


class PolicyLoss(NamedTuple):
    """What :func:`policy_loss` returns (all scalars)."""

    loss: Tensor
    clip_fraction: Tensor
    approx_kl: Tensor


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float
) -> PolicyLoss:
    """PPO's clipped surrogate loss (Schulman et al. 2017), averaged over response tokens.

    ``ratio = exp(logp - old_logp)``; per token ``max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c))``.

    Args:
        logprobs: ``(B, T)`` under the policy being updated (with grad).
        old_logprobs: ``(B, T)`` under the policy that sampled the rollout.
        advantages: ``(B, T)``.
        mask: ``(B, T)`` 0/1.
        cliprange: c, the allowed ratio deviation.

    Returns:
        ``loss``; ``clip_fraction``, the share of tokens where the clipped term is the larger (no gradient
        there); ``approx_kl = 0.5 * mean((logp - old_logp)^2)``, how far this update moved the policy.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return PolicyLoss(
        loss=masked_mean(torch.max(unclipped, clipped), mask),
        clip_fraction=masked_mean((clipped > unclipped).to(logprobs.dtype), mask),
        approx_kl=0.5 * masked_mean(log_ratio**2, mask),
    )


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss: ``0.5 * mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2))``.

    Args:
        values: ``(B, T)`` predictions of the value model being updated (with grad).
        old_values: ``(B, T)`` its predictions at rollout time.
        returns: ``(B, T)`` targets from :func:`gae`.
        mask: ``(B, T)`` 0/1.
        cliprange_value: c, how far a prediction may move from `old_values` before its gradient stops.

    Returns:
        ``(loss, clip_fraction)``: the loss and the share of tokens where the clipped error is the larger.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).to(values.dtype), mask)


class RunningMeanStd:
    """Mean and (population) variance of every value seen so far, merged batch by batch (Chan et al. 1979).

    Starts at mean 0, variance 1, count 0, so normalising before any update is the identity. Its state is a
    dict of floats that the `ppo` stage writes into each checkpoint.
    """

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: Tensor) -> None:
        """Merge a batch of values ``(N,)`` into the statistics (float64 arithmetic)."""
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean, batch_var = x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    @property
    def std(self) -> float:
        """Population standard deviation."""
        return math.sqrt(self.var)

    def state_dict(self) -> dict[str, float]:
        """``{"mean", "var", "count"}``, JSON-serialisable."""
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def shape_scores(
    scores: Tensor,
    contains_eos: Tensor,
    normalize: Literal["none", "running", "batch"],
    running: RunningMeanStd,
    reward_clip: float | None,
    missing_eos_penalty: float,
    eps: float = 1e-8,
) -> Tensor:
    """Sequence scores as PPO uses them: normalised, clipped, then penalised when no eos was generated.

    Args:
        scores: ``(B,)`` raw scores (reward model and/or reward functions).
        contains_eos: ``(B,)`` bool, whether the response ended with eos within the token budget.
        normalize: ``running``: update `running` with this batch, then ``(s - mean) / sqrt(var + eps)`` with
            the running statistics (Ziegler et al. 2019); ``batch``: the same with this batch's mean and
            population variance; ``none``: unchanged.
        running: The running statistics (updated in place when `normalize` is ``running``).
        reward_clip: Clip to ``[-reward_clip, reward_clip]`` after normalising; None = no clipping.
        missing_eos_penalty: Subtracted from the score of responses without eos (Huang et al. 2024); 0 = off.
        eps: Added to the variance.

    Returns:
        ``(B,)``.
    """
    if normalize == "running":
        running.update(scores)
        scores = (scores - running.mean) / math.sqrt(running.var + eps)
    elif normalize == "batch":
        scores = (scores - scores.mean()) / torch.sqrt(scores.var(unbiased=False) + eps)
    if reward_clip is not None:
        scores = scores.clamp(-reward_clip, reward_clip)
    return scores - missing_eos_penalty * (~contains_eos).to(scores.dtype)


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards: ``-kl_coef * KL_t`` on every response token, plus the sequence score on the last one.

    The KL penalty against the reference policy is part of the reward, not of the loss (Ziegler et al. 2019,
    Ouyang et al. 2022; TRL's PPOTrainer up to 1.12).

    Args:
        scores: ``(B,)`` shaped sequence scores (:func:`shape_scores`).
        kl: ``(B, T)`` per-token KL estimates (:data:`KL_ESTIMATORS`).
        mask: ``(B, T)`` 0/1, a non-empty prefix of each row.
        kl_coef: Weight of the KL penalty.

    Returns:
        ``(B, T)``, 0 at padding.
    """
    mask = mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(scores), device=rewards.device), last] += scores.to(rewards.dtype)
    return rewards
