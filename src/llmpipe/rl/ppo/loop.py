"""The PPO iteration on real models (Ouyang et al. 2022; Huang et al. 2024) and the run around it.

Per PPO step (:meth:`PPORun.step`): take the next prompts of a seeded permutation, make the rollout of
:class:`llmpipe.rl.ppo.rollout.Rollout` (sample, score, log-probabilities, values, GAE advantages), then make
`num_ppo_epochs` passes of `num_mini_batches` optimizer steps over the batch with the clipped losses of
:mod:`llmpipe.rl.ppo.losses`. :func:`train` runs the steps with logging, evaluation and checkpoints,
:func:`resume` restarts from a checkpoint, and :func:`summary` gives the run's metrics.

Checkpoints (``checkpoints/ppo/<fingerprint>/checkpoint-<step>/``) hold what `Accelerator.save_state`
saves (both models, their optimizers and schedules, RNG states) plus ``trainer_state.json``: the running reward
statistics, the KL coefficient and the prompt (and ptx block) positions, the per-step history with each step's
prompt indices, and the log records. Those small states are JSON rather than objects registered with Accelerate, which would
unpickle them on load (`weights_only=False`). A restarted run resumes the newest and sees exactly the prompts
an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmpipe.callbacks import Callback, RunInfo
from llmpipe.config import PPOParams
from llmpipe.config.stages import best_metric
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, write_json
from llmpipe.data.tokens import PackedBlocks
from llmpipe.models import count_parameters
from llmpipe.rl.ppo.losses import logprobs_from_logits, policy_loss, value_loss
from llmpipe.rl.ppo.rollout import Rollout, chunks, hidden_states, response_logits
from llmpipe.rl.progress import first_last_tenths, tenth
from llmpipe.rl.prompts import IndexStream
from llmpipe.train.callbacks import batch_digest, kill_at_step, maybe_kill, reapply_schedule
from llmpipe.train.checkpoints import PREFIX, newest_whole, rotate
from llmpipe.train.profiling import StepProfiler
from llmpipe.train.throughput import peak_memory_gb

log = logging.getLogger(__name__)


def prompts_per_step(cfg: PPOParams) -> int:
    """The rollout batch: micro-batch × gradient accumulation × mini-batches (TRL's PPOTrainer sizes)."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches


LOG_COLUMNS = (
    "step", "epoch", "loss", "reward", "reward_std", "kl", "kl_coef", "entropy", "policy_loss", "value_loss",
    "ptx_loss", "clip_fraction", "value_clip_fraction", "approx_kl", "response_length", "eos_fraction",
    "tokens_per_s", "learning_rate", "value_learning_rate", "grad_norm",
)  # fmt: skip
"""Columns of ``logs/ppo/train.csv`` (means over the `logging_steps` window); ``tokens_per_s`` is generated tokens
per second of generation; ``kl_coef`` the KL coefficient the step's rewards used, which the step's ``kl`` then
updated (`llmpipe.rl.ppo.kl_control`). Each log line also gets ``peak_memory_gb`` (`throughput.peak_memory_gb`,
so far)."""


@dataclass
class PPORun(Rollout):
    """Everything one PPO run holds: the rollout's models and prompts plus the optimizers and schedules (the
    policy's, the value model's) and the prompt (and ptx block) streams; :meth:`step` is one PPO iteration."""

    optimizer: Any
    scheduler: Any
    value_optimizer: Any
    value_scheduler: Any
    stream: IndexStream
    ptx_blocks: PackedBlocks | None = None
    ptx_stream: IndexStream | None = None

    def positions(self) -> dict[str, Any]:
        """The JSON-serialisable state a checkpoint needs besides Accelerate's: prompt and ptx positions, the
        running reward statistics and the KL coefficient."""
        out = {"stream": self.stream.state_dict(), "running": self.running.state_dict(),
               "kl_ctrl": self.kl_ctrl.state_dict()}  # fmt: skip
        return out | ({"ptx_stream": self.ptx_stream.state_dict()} if self.ptx_stream is not None else {})

    def load_positions(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`positions` returned."""
        self.stream.load_state_dict(state["stream"])
        self.running.load_state_dict(state["running"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
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

    def _micro_losses(self, data: dict[str, Tensor], rows: Tensor) -> dict[str, Tensor]:
        cfg = self.cfg
        ids, am, mask = data["input_ids"][rows], data["attention_mask"][rows], data["mask"][rows]
        response_len = mask.shape[1]
        logits = response_logits(self.policy, ids, am, response_len, cfg.generation)
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
            for mini in chunks(self.rollout_batch_size, self.mini_batch_size):
                for micro in chunks(self.mini_batch_size, cfg.per_device_train_batch_size):
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
                for optimizer in (self.optimizer, self.value_optimizer):
                    optimizer.step()
                    optimizer.zero_grad()
        stats = {k: v / count for k, v in sums.items()}
        stats["grad_norm"] = sum(norms) / len(norms)
        stats["learning_rate"] = self.scheduler.get_last_lr()[0]
        stats["value_learning_rate"] = self.value_scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.value_scheduler.step()
        return stats

    def step(self) -> dict[str, Any]:
        """One PPO iteration on the next prompts; returns its statistics, prompt indices and ``sha`` (16 hex of
        SHA-256 over the prompts' token ids: the batch ledger's row)."""
        indices = self.stream.take(self.rollout_batch_size)
        data, stats = self.rollout(indices)
        self.kl_ctrl.update(stats["kl"], self.rollout_batch_size)  # for the next rollout (Ziegler et al. 2019)
        stats.update(self.update(data))
        stats["prompts"] = indices
        digest = hashlib.sha256()
        batch_digest([self.train.ids[i] for i in indices], digest)
        stats["sha"] = digest.hexdigest()[:16]
        return stats


def _raise_if_not_finite(values: dict[str, float]) -> None:
    """Raise FloatingPointError naming every entry of `values` (losses, gradient norms) that is NaN or inf."""
    bad = [f"{k} {v}" for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(", ".join(bad))


def _window_record(history: list[dict[str, Any]], step: int, steps_per_epoch: float) -> dict[str, Any]:
    """One ``train.csv`` line: the means of the `LOG_COLUMNS` over the steps of `history` (the logging window)."""
    keys = [k for k in LOG_COLUMNS if k in history[-1] and k != "step"]
    record = {k: sum(r[k] for r in history) / len(history) for k in keys}
    return {"step": step, "epoch": round(step / steps_per_epoch, 4), **record}


def save_checkpoint(run: PPORun, run_dir: Path, state: dict[str, Any], keep: int) -> None:
    """Write ``checkpoint-<step>`` through a temp folder and a rename; keep the last `keep` checkpoints and the
    one of the best validation reward so far (``state["best_step"]``: by the stage's selection metric,
    `llmpipe.config.stages.best_metric`)."""
    path = run_dir / f"checkpoint-{state['step']}"
    with atomic_dir(path) as tmp:
        run.accelerator.save_state(str(tmp))
        write_json(tmp / "trainer_state.json", {**state, "positions": run.positions()})
    best = state.get("best_step")
    rotate(run_dir, keep, [path, run_dir / f"{PREFIX}{best}" if best else None])


def train(
    run: PPORun,
    state: dict[str, Any],
    total_steps: int,
    run_dir: Path,
    callbacks: Callback,
    info: RunInfo,
    profiler: StepProfiler | None,
) -> None:
    """PPO steps from ``state["step"]`` to `total_steps`: log every `logging_steps` (window means), evaluate
    every `eval_steps`, checkpoint every `save_steps`, and all three at the last step; step `profiler` (if any)
    after every PPO step. `callbacks` (`llmpipe.callbacks`: progress, TensorBoard, samples, the users') get every
    hook, as in a Trainer stage; an epoch is a pass over the training prompts.

    Raises:
        UserError: A loss or gradient norm turned NaN/inf (names the step; no checkpoint of that step is written).
    """
    cfg = run.cfg
    selection = best_metric("ppo", cfg)[0]  # higher is better: every RL stage's selection metric is a reward
    steps_per_epoch = len(run.train.ids) / run.rollout_batch_size
    kill_at = kill_at_step()
    callbacks.on_train_start(info)
    epoch = math.floor(state["step"] / steps_per_epoch)
    callbacks.on_epoch_start(epoch)
    while state["step"] < total_steps:
        try:
            state["history"].append(run.step())
        except FloatingPointError as err:
            fp32 = ", try ppo.precision: fp32" if run.accelerator.mixed_precision != "no" else ""
            raise UserError(
                f"ppo: {err} at step {state['step'] + 1}; stopped before applying it, and no checkpoint of that step "
                f"is written (newest kept: {newest_whole(run_dir) or 'none'}); lower ppo.lr, keep "
                f"ppo.max_grad_norm > 0{fp32}, or check models/reward (it scores the completions and the value model "
                "starts from it)"
            ) from None
        state["step"] += 1
        maybe_kill(state["step"], kill_at)
        if profiler is not None:
            profiler.step()
        step = state["step"]
        logs: dict[str, Any] = {}
        if step % cfg.logging_steps == 0 or step == total_steps:
            window = (step - 1) % cfg.logging_steps + 1  # steps since the last log line
            record = _window_record(state["history"][-window:], step, steps_per_epoch)
            state["log_history"].append({**record, "peak_memory_gb": round(peak_memory_gb(run.accelerator.device), 4)})
            logs = {k: v for k, v in state["log_history"][-1].items() if k != "step"}
        callbacks.on_step_end(step, logs)
        if step % cfg.eval_steps == 0 or step == total_steps:
            metrics = run.evaluate()
            state["log_history"].append({"step": step, "epoch": round(step / steps_per_epoch, 4), **metrics})
            if metrics[selection] > state.get("best_eval_reward", -math.inf):  # the selection metric's best so far
                state["best_step"], state["best_eval_reward"] = step, metrics[selection]
            callbacks.on_evaluate(step, metrics)
        if step % cfg.save_steps == 0 or step == total_steps:
            save_checkpoint(run, run_dir, state, cfg.save_total_limit)
            callbacks.on_save(step, run_dir / f"{PREFIX}{step}")
        if math.floor(step / steps_per_epoch) > epoch and step < total_steps:
            callbacks.on_epoch_end(epoch)
            epoch = math.floor(step / steps_per_epoch)
            callbacks.on_epoch_start(epoch)
    callbacks.on_epoch_end(epoch)
    callbacks.on_train_end(state["step"])


def resume(run: PPORun, checkpoint: Path | None, run_dir: Path) -> dict[str, Any]:
    """The training state to start from: a fresh one, or that of `checkpoint` (its models, optimizer, schedule,
    RNG states and prompt positions loaded into `run`).

    Args:
        run: The built run.
        checkpoint: The checkpoint to resume (`llmpipe.train.checkpoints.open_run`'s choice), or None.
        run_dir: The run's checkpoint folder (named in the log).

    Returns:
        ``step``, ``history`` (one entry per PPO step), ``log_history`` (the log records) and, once evaluated,
        ``best_step``/``best_eval_reward``; :func:`train` advances it.
    """
    if not checkpoint:
        log.info("ppo: fresh run in %s", run_dir)
        return {"step": 0, "history": [], "log_history": []}
    run.accelerator.load_state(str(checkpoint))
    for scheduler in (run.scheduler, run.value_scheduler):
        reapply_schedule(scheduler)  # the stored rate is the old schedule's: see reapply_schedule
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    run.load_positions(state.pop("positions"))
    log.info("ppo: resuming from %s (step %d)", checkpoint, state["step"])
    return state


def summary(run: PPORun, state: dict[str, Any], resumed_step: int) -> dict[str, float]:
    """The `ppo` stage's metrics (``metrics/ppo.json``) of a finished run.

    Args:
        run: The trained run.
        state: The training state after :func:`train`.
        resumed_step: The step the run resumed from (0 for a fresh run).

    Returns:
        ``reward_first``/``reward_last`` (mean raw score over the first/last 10% of steps, pooled over every
        sequence of those steps: :func:`llmpipe.rl.progress.first_last_tenths`) with their standard errors
        ``*_se``, ``kl_final`` (summed per-token KL to the reference, last step), ``kl_coef_final`` (the KL
        coefficient after the last step's update: `ppo.kl_coef` when `kl_ctrl` is fixed), ``response_length_first``
        / ``_last`` (tokens), ``eval_reward`` (validation prompts, final policy), ``steps``, ``tokens_per_s``
        (generated tokens per second of generation, mean over logged windows), ``peak_memory_gb`` (this process,
        `throughput.peak_memory_gb`), ``resumed_from_step`` (0 for a fresh run), ``num_parameters`` (policy).
    """
    history = state["history"]
    k = tenth(len(history))
    means, stds = [r["reward"] for r in history], [r["reward_std"] for r in history]
    rewards = first_last_tenths(means, stds, group_size=run.rollout_batch_size)  # pooled over every sequence
    evals = [r for r in state["log_history"] if "eval_reward" in r]
    rates = [r["tokens_per_s"] for r in state["log_history"] if "tokens_per_s" in r]
    return {
        "reward_first": round(rewards.first, 5),
        "reward_first_se": round(rewards.first_se, 5),
        "reward_last": round(rewards.last, 5),
        "reward_last_se": round(rewards.last_se, 5),
        "kl_final": round(history[-1]["kl"], 5),
        "kl_coef_final": round(run.kl_ctrl.value, 6),
        "response_length_first": round(sum(r["response_length"] for r in history[:k]) / k, 3),
        "response_length_last": round(sum(r["response_length"] for r in history[-k:]) / k, 3),
        "eval_reward": round(evals[-1]["eval_reward"], 5),
        "steps": state["step"],
        "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else 0.0,
        "peak_memory_gb": round(peak_memory_gb(run.accelerator.device), 4),
        "resumed_from_step": resumed_step,
        "num_parameters": count_parameters(run.policy),
    }
