"""The rollout half of a PPO step (Ouyang et al. 2022; Huang et al. 2024): :class:`Rollout` samples completions
of a batch of prompts (left-padded batched `generate`), scores them with the reward model and/or the reward
functions, computes log-probabilities under the policy and the frozen reference and values under the value model
(all without grad), and turns score and per-token KL into per-token rewards and GAE advantages with the pure maths
of :mod:`llmpipe.rl.ppo.losses`; with the model helpers the update reuses (left-padding-aware positions, backbone
hidden states, response logits).

:class:`llmpipe.rl.ppo.loop.PPORun` adds the optimizer, the prompt streams and the update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llmpipe.config import GenerationParams, PPOParams
from llmpipe.rl.generation import generation_threads
from llmpipe.rl.ppo.kl_control import KLController
from llmpipe.rl.ppo.losses import (
    KL_ESTIMATORS,
    RunningMeanStd,
    entropy_from_logits,
    gae,
    logprobs_from_logits,
    masked_mean,
    shape_scores,
    token_rewards,
    whiten,
)
from llmpipe.rl.ppo.sampling import own_settings_only, sampled_logits
from llmpipe.rl.prompts import Prompts
from llmpipe.rl.rewards import reward_values


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: ``(B, L)``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hidden_states(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last hidden states ``(B, L, H)`` of a sequence-classification model's backbone (a peft model's: its LoRA or
    IA³ layers sit inside the backbone)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.last_hidden_state


def response_logits(policy, input_ids: Tensor, attention_mask: Tensor, response_len: int, gen: GenerationParams):
    """Logits ``(B, R, V)`` of the distribution each of the last `response_len` tokens was sampled from: the
    model's, through the `generation` settings (`llmpipe.rl.ppo.sampling.sampled_logits`)."""
    out = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_to_keep=response_len + 1,
    )
    return sampled_logits(out.logits[:, :-1].float(), input_ids, attention_mask, gen)


@dataclass
class Batch:
    """Prompts with sampled completions: ``L = P + R`` tokens, prompt left-padded, response right-padded."""

    input_ids: Tensor  # (B, L)
    attention_mask: Tensor  # (B, L)
    mask: Tensor  # (B, R) 1 on response tokens up to and including the first eos
    contains_eos: Tensor  # (B,) bool
    completions: list[str]  # decoded responses without special tokens

    @property
    def response_len(self) -> int:
        return self.mask.shape[1]

    @property
    def responses(self) -> Tensor:
        return self.input_ids[:, -self.response_len :]


def chunks(n: int, size: int) -> list[slice]:
    """Slices of ``range(n)`` of `size` rows each (the last may be shorter)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass
class Rollout:
    """The models and prompts a PPO rollout needs; :meth:`rollout` is the rollout half of one PPO step."""

    cfg: PPOParams
    accelerator: Any
    tokenizer: Any
    policy: Any
    ref_policy: Any
    value_model: Any
    reward_model: Any | None
    train: Prompts
    valid: Prompts
    running: RunningMeanStd
    kl_ctrl: KLController

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]]) -> Batch:
        """Sample one completion per prompt with the `generation` params (left-padded, one batch)."""
        from llmpipe.train.samples import generation_config

        tok = self.tokenizer
        device = self.accelerator.device
        longest = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[tok.pad_token_id] * (longest - len(p)) + p for p in prompt_ids], device=device)
        prompt_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        config = generation_config(tok, self.cfg.generation.max_new_tokens, self.cfg.generation)
        policy = self.accelerator.unwrap_model(self.policy)
        policy.eval()
        with own_settings_only(policy), generation_threads(self.cfg.generation.num_threads):
            out = policy.generate(input_ids=ids, attention_mask=prompt_mask, generation_config=config)
        policy.train()
        responses = out[:, longest:]
        is_eos = torch.isin(responses, torch.tensor(config.eos_token_id, device=device))  # eos or end of turn
        contains_eos = is_eos.any(1)
        steps = torch.arange(responses.shape[1], device=device)
        length = torch.where(contains_eos, is_eos.int().argmax(1) + 1, responses.shape[1])
        mask = (steps[None, :] < length[:, None]).long()
        responses = responses.masked_fill(mask == 0, tok.pad_token_id)
        return Batch(
            input_ids=torch.cat([ids, responses], 1),
            attention_mask=torch.cat([prompt_mask, mask], 1),
            mask=mask,
            contains_eos=contains_eos,
            completions=tok.batch_decode(responses, skip_special_tokens=True),
        )

    @torch.no_grad()
    def score(self, batch: Batch, turns: list[list[dict[str, str]]], names: list[str],
              tests: list[list[str]] | None = None) -> Tensor:
        """Raw sequence scores ``(B,)``: the reward model's score of the last real token, plus the weighted
        reward functions of the prompt's turns and the completion (called as GRPO's TRL calls them; `tests`: each
        prompt's hidden tests, for the test rewards)."""
        return self.score_parts(batch, turns, names, tests)[0]

    @torch.no_grad()
    def score_parts(self, batch: Batch, turns: list[list[dict[str, str]]], names: list[str],
                    tests: list[list[str]] | None = None) -> tuple[Tensor, list[tuple[str, Tensor]]]:
        """:meth:`score`, and each reward function's own unweighted values ``(B,)`` with its label
        (`llmpipe.rl.rewards.reward_values`)."""
        scores = torch.zeros(len(turns), device=self.accelerator.device)
        if self.reward_model is not None:
            hidden = hidden_states(self.reward_model, batch.input_ids, batch.attention_mask)
            last = batch.input_ids.shape[1] - batch.response_len + batch.mask.sum(1) - 1
            scores += self.reward_model.score(hidden[torch.arange(len(turns)), last]).squeeze(-1).float()
        ids = [r[m.bool()].tolist() for r, m in zip(batch.responses, batch.mask)]
        parts = reward_values(self.cfg.rewards, turns, batch.completions, names, ids, tests) if self.cfg.rewards else []
        for spec, (_, values) in zip(self.cfg.rewards, parts):
            scores += spec.weight * values.to(scores.device)
        return scores, parts

    @torch.no_grad()
    def rollout(self, indices: list[int]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Generate, score and evaluate the rollout batch of prompts `indices`.

        Returns:
            The tensors the update needs (``input_ids``, ``attention_mask``, ``mask``, ``logprobs``,
            ``values``, ``advantages``, ``returns``; ``(B, ·)``) and the step's rollout statistics.
        """
        cfg, acc = self.cfg, self.accelerator
        start = time.perf_counter()
        with acc.autocast():  # as the scoring below: the tokens are scored at the precision they were sampled at
            batch = self.generate([self.train.ids[i] for i in indices])
        generation_s = time.perf_counter() - start
        with acc.autocast():
            raw = self.score(batch, [self.train.turns[i] for i in indices], [self.train.names[i] for i in indices],
                             [self.train.tests[i] for i in indices])
            parts: dict[str, list[Tensor]] = {"logprobs": [], "ref_logprobs": [], "entropy": [], "values": []}
            for s in chunks(len(indices), cfg.per_device_train_batch_size):
                ids, am = batch.input_ids[s], batch.attention_mask[s]
                logits = response_logits(self.policy, ids, am, batch.response_len, cfg.generation)
                parts["logprobs"].append(logprobs_from_logits(logits, batch.responses[s]))
                parts["entropy"].append(entropy_from_logits(logits))
                ref_logits = response_logits(self.ref_policy, ids, am, batch.response_len, cfg.generation)
                parts["ref_logprobs"].append(logprobs_from_logits(ref_logits, batch.responses[s]))
                hidden = hidden_states(self.value_model, ids, am)[:, -batch.response_len - 1 : -1]
                parts["values"].append(self.value_model.score(hidden).squeeze(-1).float())
        logp, ref_logp, entropy, values = (
            torch.cat(parts[k]) for k in ("logprobs", "ref_logprobs", "entropy", "values")
        )
        mask = batch.mask
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp) * mask
        method = cfg.normalize_method if cfg.normalize_rewards else "none"
        scores = shape_scores(raw, batch.contains_eos, method, self.running, cfg.reward_clip, cfg.missing_eos_penalty)
        rewards = token_rewards(scores, kl, mask, self.kl_ctrl.value)
        if cfg.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, values * mask, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages = whiten(advantages, mask)
        lengths = mask.sum(1).float()
        stats = {
            "reward": raw.mean().item(),
            "reward_std": raw.std(unbiased=False).item(),
            "kl": kl.sum(1).mean().item(),
            "kl_coef": self.kl_ctrl.value,
            "entropy": masked_mean(entropy, mask).item(),
            "response_length": lengths.mean().item(),
            "eos_fraction": batch.contains_eos.float().mean().item(),
            "tokens_per_s": lengths.sum().item() / max(generation_s, 1e-9),
        }
        tensors = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "mask": mask,
            "logprobs": logp,
            "values": values * mask,
            "advantages": advantages,
            "returns": returns,
        }
        return tensors, stats

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean raw score and response length on the validation prompts (sampled with a fixed seed, so the
        training RNG stream is untouched), and each reward function's mean as ``eval_rewards/<label>/mean`` (TRL's
        GRPO names; one of them can pick the best checkpoint: `llmpipe.config.stages.best_metric`)."""
        cfg = self.cfg
        scores, lengths, parts = [], [], []
        devices = [self.accelerator.device.index or 0] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.accelerator.autocast():
            torch.manual_seed(cfg.seed)
            for s in chunks(len(self.valid.ids), cfg.per_device_eval_batch_size):
                batch = self.generate(self.valid.ids[s])
                score, own = self.score_parts(batch, self.valid.turns[s], self.valid.names[s], self.valid.tests[s])
                scores.append(score)
                parts.append(own)
                lengths.append(batch.mask.sum(1).float())
        labels = [label for label, _ in parts[0]] if parts else []
        return {
            "eval_reward": torch.cat(scores).mean().item(),
            "eval_response_length": torch.cat(lengths).mean().item(),
            **{f"eval_rewards/{label}/mean": torch.cat([own[i][1] for own in parts]).mean().item()
               for i, label in enumerate(labels)},
        }
