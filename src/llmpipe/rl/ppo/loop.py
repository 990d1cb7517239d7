"""The PPO iteration on real models (Ouyang et al. 2022; Huang et al. 2024): :class:`PPORun` samples a
rollout batch, scores it, computes log-probabilities, values and advantages, and makes the clipped updates,
composing the pure maths of :mod:`llmpipe.rl.ppo.losses` on an Accelerate `Accelerator`; with the model helpers it
needs (the value/reward model loader, left-padding-aware positions, backbone hidden states, response logits).

The `ppo` stage (:mod:`llmpipe.stages.ppo`) builds a :class:`PPORun`, drives its steps, logs and checkpoints.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmpipe.config import PPOParams
from llmpipe.core.errors import UserError
from llmpipe.data.tokens import PackedBlocks
from llmpipe.models import load_pretrained
from llmpipe.rl.ppo.losses import (
    KL_ESTIMATORS,
    RunningMeanStd,
    entropy_from_logits,
    gae,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    shape_scores,
    token_rewards,
    value_loss,
    whiten,
)
from llmpipe.rl.prompts import IndexStream, Prompts
from llmpipe.rl.rewards import compute_rewards
from llmpipe.train.callbacks import batch_digest


def prompts_per_step(cfg: PPOParams) -> int:
    """The rollout batch: micro-batch × gradient accumulation × mini-batches (TRL's PPOTrainer sizes)."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches


REWARD_MISSING = "run the reward stage first (dvc repro reward)"


def load_value_model(path: Path, trust_remote_code: bool = False):
    """A one-label `AutoModelForSequenceClassification` with a `score` head (what the reward stage saves).

    Args:
        path: The reward model folder.
        trust_remote_code: Let pickled weights or ``auto_map`` code load (see `llmpipe.models`).

    Raises:
        UserError: The folder is missing or refused, or the model has more than one label or no `score` head.
    """
    from transformers import AutoModelForSequenceClassification

    model = load_pretrained(AutoModelForSequenceClassification, path, REWARD_MISSING, trust_remote_code)
    if model.config.num_labels != 1 or not hasattr(model, "score"):
        raise UserError(f"{path}: expected a one-label sequence-classification model with a `score` head")
    return model


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: ``(B, L)``."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hidden_states(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last hidden states ``(B, L, H)`` of a sequence-classification model's backbone."""
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    return out.last_hidden_state


def response_logits(policy, input_ids: Tensor, attention_mask: Tensor, response_len: int, temperature: float):
    """Logits ``(B, R, V)`` that predicted each of the last `response_len` tokens, divided by `temperature`."""
    out = policy(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_to_keep=response_len + 1,
    )
    return out.logits[:, :-1].float() / temperature


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


@dataclass
class PPORun:
    """Everything one PPO run holds; :meth:`step` is one PPO iteration."""

    cfg: PPOParams
    accelerator: Any
    tokenizer: Any
    policy: Any
    ref_policy: Any
    value_model: Any
    reward_model: Any | None
    optimizer: Any
    scheduler: Any
    train: Prompts
    valid: Prompts
    stream: IndexStream
    running: RunningMeanStd
    ptx_blocks: PackedBlocks | None = None
    ptx_stream: IndexStream | None = None

    def positions(self) -> dict[str, Any]:
        """The JSON-serialisable state a checkpoint needs besides Accelerate's: prompt and ptx positions and the
        running reward statistics."""
        out = {"stream": self.stream.state_dict(), "running": self.running.state_dict()}
        return out | ({"ptx_stream": self.ptx_stream.state_dict()} if self.ptx_stream is not None else {})

    def load_positions(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`positions` returned."""
        self.stream.load_state_dict(state["stream"])
        self.running.load_state_dict(state["running"])
        if self.ptx_stream is not None:
            self.ptx_stream.load_state_dict(state["ptx_stream"])

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step."""
        return self.cfg.per_device_train_batch_size * self.cfg.gradient_accumulation_steps

    @property
    def rollout_batch_size(self) -> int:
        """Prompts per PPO step."""
        return prompts_per_step(self.cfg)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]]) -> Batch:
        """Sample one completion per prompt with the `generation` params (left-padded, one batch)."""
        from transformers import GenerationConfig

        g, tok = self.cfg.generation, self.tokenizer
        device = self.accelerator.device
        longest = max(len(p) for p in prompt_ids)
        ids = torch.tensor([[tok.pad_token_id] * (longest - len(p)) + p for p in prompt_ids], device=device)
        prompt_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        config = GenerationConfig(
            do_sample=True,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            min_p=g.min_p,
            repetition_penalty=g.repetition_penalty,
            suppress_tokens=g.suppress_tokens or None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            use_cache=True,
        )
        policy = self.accelerator.unwrap_model(self.policy)
        policy.eval()
        out = policy.generate(input_ids=ids, attention_mask=prompt_mask, generation_config=config)
        policy.train()
        responses = out[:, longest:]
        is_eos = responses == tok.eos_token_id
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
    def score(self, batch: Batch, texts: list[str], names: list[str]) -> Tensor:
        """Raw sequence scores ``(B,)``: the reward model's score of the last real token, plus the weighted
        reward functions of the plain prompt and the completion."""
        scores = torch.zeros(len(texts), device=self.accelerator.device)
        if self.reward_model is not None:
            hidden = hidden_states(self.reward_model, batch.input_ids, batch.attention_mask)
            last = batch.input_ids.shape[1] - batch.response_len + batch.mask.sum(1) - 1
            scores += self.reward_model.score(hidden[torch.arange(len(texts)), last]).squeeze(-1).float()
        if self.cfg.rewards:
            scores += compute_rewards(self.cfg.rewards, texts, batch.completions, names).to(scores.device)
        return scores

    def _chunks(self, n: int, size: int) -> list[slice]:
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]

    @torch.no_grad()
    def rollout(self, indices: list[int]) -> tuple[dict[str, Tensor], dict[str, float]]:
        """Generate, score and evaluate the rollout batch of prompts `indices`.

        Returns:
            The tensors the update needs (``input_ids``, ``attention_mask``, ``mask``, ``logprobs``,
            ``values``, ``advantages``, ``returns``; ``(B, ·)``) and the step's rollout statistics.
        """
        cfg, acc = self.cfg, self.accelerator
        start = time.perf_counter()
        batch = self.generate([self.train.ids[i] for i in indices])
        generation_s = time.perf_counter() - start
        with acc.autocast():
            raw = self.score(batch, [self.train.texts[i] for i in indices], [self.train.names[i] for i in indices])
            parts: dict[str, list[Tensor]] = {"logprobs": [], "ref_logprobs": [], "entropy": [], "values": []}
            for s in self._chunks(len(indices), cfg.per_device_train_batch_size):
                ids, am = batch.input_ids[s], batch.attention_mask[s]
                logits = response_logits(self.policy, ids, am, batch.response_len, cfg.generation.temperature)
                parts["logprobs"].append(logprobs_from_logits(logits, batch.responses[s]))
                parts["entropy"].append(entropy_from_logits(logits))
                ref_logits = response_logits(self.ref_policy, ids, am, batch.response_len, cfg.generation.temperature)
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
        rewards = token_rewards(scores, kl, mask, cfg.kl_coef)
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

    def _micro_losses(self, data: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        cfg = self.cfg
        ids, am, mask = data["input_ids"][rows], data["attention_mask"][rows], data["mask"][rows]
        response_len = mask.shape[1]
        logits = response_logits(self.policy, ids, am, response_len, cfg.generation.temperature)
        logp = logprobs_from_logits(logits, ids[:, -response_len:])
        hidden = hidden_states(self.value_model, ids, am)[:, -response_len - 1 : -1]
        values = self.value_model.score(hidden).squeeze(-1).float()
        pg = policy_loss(logp, data["logprobs"][rows], data["advantages"][rows], mask, cfg.cliprange)
        vf, vf_clip = value_loss(values, data["values"][rows], data["returns"][rows], mask, cfg.cliprange_value)
        out = {
            "loss": pg.loss + cfg.vf_coef * vf,
            "policy_loss": pg.loss,
            "value_loss": vf,
            "clip_fraction": pg.clip_fraction,
            "value_clip_fraction": vf_clip,
            "approx_kl": pg.approx_kl,
        }
        if self.ptx_blocks is not None:
            blocks = self.ptx_blocks.batch(self.ptx_stream.take(len(rows))).to(ids.device)  # (B, T)
            out["ptx_loss"] = self.policy(input_ids=blocks, labels=blocks).loss
            out["loss"] = out["loss"] + cfg.ptx_coef * out["ptx_loss"]
        return out

    def update(self, data: dict[str, Tensor]) -> dict[str, float]:
        """`num_ppo_epochs` × `num_mini_batches` optimizer steps on a rollout; returns mean losses and stats.

        Raises:
            FloatingPointError: A micro-batch loss or a gradient norm is NaN or inf; raised before its backward
                pass or optimizer step, so the models keep the weights of the last good update.
        """
        cfg, acc = self.cfg, self.accelerator
        sums: dict[str, float] = {}
        count = 0
        norms = []
        for _ in range(cfg.num_ppo_epochs):
            order = torch.randperm(self.rollout_batch_size, device=acc.device)
            for mini in self._chunks(self.rollout_batch_size, self.mini_batch_size):
                for micro in self._chunks(self.mini_batch_size, cfg.per_device_train_batch_size):
                    rows = order[mini][micro]
                    with acc.autocast():
                        losses = self._micro_losses(data, rows)
                    values = {k: v.item() for k, v in losses.items()}
                    _raise_if_not_finite(values)
                    acc.backward(losses["loss"] / cfg.gradient_accumulation_steps)
                    for k, v in values.items():
                        sums[k] = sums.get(k, 0.0) + v
                    count += 1
                acc.unscale_gradients()
                max_norm = cfg.max_grad_norm or math.inf
                policy_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm).item()
                value_norm = torch.nn.utils.clip_grad_norm_(self.value_model.parameters(), max_norm).item()
                _raise_if_not_finite({"policy gradient norm": policy_norm, "value gradient norm": value_norm})
                norms.append(policy_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
        stats = {k: v / count for k, v in sums.items()}
        stats["grad_norm"] = sum(norms) / len(norms)
        stats["learning_rate"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return stats

    def step(self) -> dict[str, Any]:
        """One PPO iteration on the next prompts; returns its statistics, prompt indices and ``sha`` (16 hex of
        SHA-256 over the prompts' token ids: the batch ledger's row)."""
        indices = self.stream.take(self.rollout_batch_size)
        data, stats = self.rollout(indices)
        stats.update(self.update(data))
        stats["prompts"] = indices
        digest = hashlib.sha256()
        batch_digest([self.train.ids[i] for i in indices], digest)
        stats["sha"] = digest.hexdigest()[:16]
        return stats

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean raw score and response length on the validation prompts (sampled with a fixed seed, so the
        training RNG stream is untouched)."""
        cfg = self.cfg
        scores, lengths = [], []
        devices = [self.accelerator.device.index or 0] if self.accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self.accelerator.autocast():
            torch.manual_seed(cfg.seed)
            for s in self._chunks(len(self.valid.ids), cfg.per_device_eval_batch_size):
                batch = self.generate(self.valid.ids[s])
                scores.append(self.score(batch, self.valid.texts[s], self.valid.names[s]))
                lengths.append(batch.mask.sum(1).float())
        return {
            "eval_reward": torch.cat(scores).mean().item(),
            "eval_response_length": torch.cat(lengths).mean().item(),
        }


def _raise_if_not_finite(values: dict[str, float]) -> None:
    """Raise FloatingPointError naming every entry of `values` (losses, gradient norms) that is NaN or inf."""
    bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(", ".join(bad))
