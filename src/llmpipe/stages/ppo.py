"""`ppo` stage: PPO (Ouyang et al. 2022; Huang et al. 2024) of models/<policy> on the SFT prompts, with
the algorithm of :mod:`llmpipe.rl.ppo.losses` run on Accelerate (TRL ≥ 1.13 has no PPOTrainer).

Per PPO step: take the next prompts of a seeded permutation, sample completions (left-padded batched
`generate`), score them with the reward model and/or the reward functions, compute log-probabilities
under the policy and the frozen reference and values under the value model (all without grad), turn
score and per-token KL into per-token rewards and GAE advantages, then make `num_ppo_epochs` passes of
`num_mini_batches` optimizer steps over the batch.

Models: the policy and the reference are causal LMs from models/<policy>; the value model and the reward
model are one-label `AutoModelForSequenceClassification` models from models/reward, whose backbone and
`score` head run on every position (a value per token; the reward is the score of the last real token).
One optimizer holds policy and value parameters, as in TRL's PPOTrainer: the models share no parameters,
so the one loss ``pg + vf_coef * vf`` gives each its own gradient, and one optimizer means one state and
one schedule to checkpoint; gradients are clipped per model, so a large value gradient never shrinks
the policy's step.

Checkpoints (``checkpoints/ppo/<fingerprint>/checkpoint-<step>/``) hold what `Accelerator.save_state`
saves (both models, optimizer, scheduler, RNG states) plus ``trainer_state.json``: the running reward
statistics and the prompt (and ptx block) positions, the per-step history with each step's prompt indices, and
the log records. Those small states are JSON rather than objects registered with Accelerate, which would
unpickle them on load (`weights_only=False`). A restarted run resumes the newest and sees exactly the prompts
an uninterrupted run would.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from llmpipe.config import Params, PPOParams
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, write_json
from llmpipe.data.tokens import PackedBlocks, token_blocks
from llmpipe.distributed.launch import check_world
from llmpipe.models import (
    check_model_dir,
    check_same_tokenizer,
    count_parameters,
    load_model,
    load_tokenizer,
    save_model,
)
from llmpipe.rl.ppo.loop import REWARD_MISSING, PPORun, load_value_model, prompts_per_step
from llmpipe.rl.ppo.losses import RunningMeanStd
from llmpipe.rl.prompts import IndexStream, Prompts, load_prompts
from llmpipe.train.arguments import resolve_precision, training_kwargs
from llmpipe.train.callbacks import kill_at_step, maybe_kill, reapply_schedule, write_ledger
from llmpipe.train.checkpoints import PREFIX, ResumeRequest, newest_whole, open_run, rotate
from llmpipe.train.loop import write_plots
from llmpipe.train.profiling import StepProfiler
from llmpipe.train.throughput import peak_memory_gb, reset_peak_memory

log = logging.getLogger(__name__)

LOG_COLUMNS = (
    "step", "epoch", "loss", "reward", "reward_std", "kl", "entropy", "policy_loss", "value_loss", "ptx_loss",
    "clip_fraction", "value_clip_fraction", "approx_kl", "response_length", "eos_fraction", "tokens_per_s",
    "learning_rate", "grad_norm",
)  # fmt: skip
"""Columns of ``logs/ppo/train.csv`` (means over the `logging_steps` window); ``tokens_per_s`` is generated tokens
per second of generation. Each log line also gets ``peak_memory_gb`` (`throughput.peak_memory_gb`, so far)."""


def _optimizer(params: Params, run_dir: Path, models: list) -> torch.optim.Optimizer:
    """The `train.optim` optimizer over both models (HF Trainer's mapping of our params); weight decay on
    matrices and embeddings only (parameters of 2+ dimensions), as in GPT-2/nanoGPT."""
    from transformers import Trainer, TrainingArguments

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(**training_kwargs(params, "ppo", run_dir)))
    weights = [p for m in models for p in m.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in weights if p.ndim >= 2], "weight_decay": params.ppo.weight_decay},
        {"params": [p for p in weights if p.ndim < 2], "weight_decay": 0.0},
    ]
    return cls(groups, **kwargs)


def _total_steps(cfg: PPOParams, num_prompts: int) -> int:
    """`max_steps`, or as many PPO steps as `num_train_epochs` passes over the prompts take."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    return max(1, math.ceil(cfg.num_train_epochs * num_prompts / prompts_per_step(cfg)))


def _pooled(rows: list[dict[str, Any]], n: int) -> tuple[float, float]:
    """Mean and standard error of the raw scores of all sequences in `rows` (steps of `n` sequences each)."""
    means = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    second = torch.tensor([r["reward_std"] ** 2 + r["reward"] ** 2 for r in rows], dtype=torch.float64)
    total = n * len(rows)
    mean = means.mean().item()
    var = max(second.mean().item() - mean**2, 0.0) * total / max(total - 1, 1)
    return mean, math.sqrt(var / total)


def _window_record(history: list[dict[str, Any]], step: int, steps_per_epoch: float) -> dict[str, Any]:
    keys = [k for k in LOG_COLUMNS if k in history[-1] and k != "step"]
    record = {k: sum(r[k] for r in history) / len(history) for k in keys}
    return {"step": step, "epoch": round(step / steps_per_epoch, 4), **record}


def _save_checkpoint(run: PPORun, run_dir: Path, state: dict[str, Any], keep: int) -> None:
    """Write ``checkpoint-<step>`` through a temp folder and a rename; keep the last `keep` checkpoints and the
    one of the best validation reward so far (``state["best_step"]``)."""
    path = run_dir / f"checkpoint-{state['step']}"
    with atomic_dir(path) as tmp:
        run.accelerator.save_state(str(tmp))
        write_json(tmp / "trainer_state.json", {**state, "positions": run.positions()})
    best = state.get("best_step")
    rotate(run_dir, keep, [path, run_dir / f"{PREFIX}{best}" if best else None])


def _summary(history: list[dict[str, Any]], rollout_batch_size: int) -> dict[str, float]:
    k = max(1, math.ceil(0.1 * len(history)))
    first, last = history[:k], history[-k:]
    reward_first, se_first = _pooled(first, rollout_batch_size)
    reward_last, se_last = _pooled(last, rollout_batch_size)
    return {
        "reward_first": round(reward_first, 5),
        "reward_first_se": round(se_first, 5),
        "reward_last": round(reward_last, 5),
        "reward_last_se": round(se_last, 5),
        "kl_final": round(history[-1]["kl"], 5),
        "response_length_first": round(sum(r["response_length"] for r in first) / k, 3),
        "response_length_last": round(sum(r["response_length"] for r in last) / k, 3),
    }


def _build(
    params: Params,
    tokenizer,
    train: Prompts,
    valid: Prompts,
    ptx: PackedBlocks | None,
    run_dir: Path,
    trust_remote_code: bool = False,
) -> tuple[PPORun, int]:
    """Models, optimizer and schedule on an `Accelerator`, and the checkpointed state objects registered.

    Args:
        params: Validated params.
        tokenizer: The pipeline tokenizer.
        train: Training prompts.
        valid: Validation prompts.
        ptx: Pretraining blocks for the ptx loss (None when ``ppo.ptx_coef`` is 0).
        run_dir: The run's checkpoint folder.
        trust_remote_code: Let model folders with pickled weights or ``auto_map`` code load.

    Returns:
        The run and its number of PPO steps.

    Raises:
        UserError: A model is missing or was trained with another tokenizer than ``paths.tokenizer``, or
            ``ppo.max_length`` exceeds the policy's context.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    cfg, paths = params.ppo, params.paths
    set_seed(cfg.seed)
    policy_dir = Path(paths.models, cfg.policy)
    missing = f"run the {cfg.policy} stage first (dvc repro {cfg.policy})"
    policy = load_model(policy_dir, missing, trust_remote_code=trust_remote_code)
    ref_policy = load_model(policy_dir, missing, trust_remote_code=trust_remote_code)
    if cfg.max_length > policy.config.max_position_embeddings:
        raise UserError(
            f"ppo.max_length ({cfg.max_length}) exceeds the max_position_embeddings of {policy_dir} "
            f"({policy.config.max_position_embeddings}); lower it"
        )
    value_model = load_value_model(Path(paths.models, "reward"), trust_remote_code)
    for model_dir in (policy_dir, Path(paths.models, "reward")):
        check_same_tokenizer(model_dir, tokenizer, paths.tokenizer)
    reward_model = load_value_model(Path(paths.models, "reward"), trust_remote_code) if cfg.reward_model else None
    if params.distributed.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
        value_model.gradient_checkpointing_enable()
    optimizer = _optimizer(params, run_dir, [policy, value_model])  # before the Accelerator: it resets its state
    total_steps = _total_steps(cfg, len(train.ids))
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.warmup_steps, total_steps)

    bf16, fp16 = resolve_precision(cfg.precision, params.source_of("ppo", "precision"))
    mixed_precision = "bf16" if bf16 else "fp16" if fp16 else "no"
    accelerator = Accelerator(mixed_precision=mixed_precision, cpu=not torch.cuda.is_available())
    check_world(params, accelerator)  # a hand-made launcher must not run N unsynchronised copies
    for frozen in (ref_policy, reward_model):
        if frozen is not None:
            frozen.eval().requires_grad_(False).to(accelerator.device)
    policy, value_model, optimizer, scheduler = accelerator.prepare(policy, value_model, optimizer, scheduler)
    run = PPORun(
        cfg=cfg, accelerator=accelerator, tokenizer=tokenizer, policy=policy, ref_policy=ref_policy,
        value_model=value_model, reward_model=reward_model, optimizer=optimizer, scheduler=scheduler,
        train=train, valid=valid, stream=IndexStream(len(train.ids), cfg.seed), running=RunningMeanStd(),
    )  # fmt: skip
    if ptx is not None:
        run.ptx_blocks, run.ptx_stream = ptx, IndexStream(len(ptx), cfg.seed)
    return run, total_steps


def _train(
    run: PPORun, state: dict[str, Any], total_steps: int, run_dir: Path, tensorboard, profiler: StepProfiler | None
) -> None:
    """PPO steps from ``state["step"]`` to `total_steps`: log every `logging_steps` (window means), evaluate
    every `eval_steps`, checkpoint every `save_steps`, and all three at the last step; step `profiler` (if any)
    after every PPO step.

    Raises:
        UserError: A loss or gradient norm turned NaN/inf (names the step; no checkpoint of that step is written).
    """
    cfg = run.cfg
    steps_per_epoch = len(run.train.ids) / run.rollout_batch_size
    kill_at = kill_at_step()
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
        records = []
        if step % cfg.logging_steps == 0 or step == total_steps:
            window = (step - 1) % cfg.logging_steps + 1  # steps since the last log line
            record = _window_record(state["history"][-window:], step, steps_per_epoch)
            records.append({**record, "peak_memory_gb": round(peak_memory_gb(run.accelerator.device), 4)})
        if step % cfg.eval_steps == 0 or step == total_steps:
            records.append({"step": step, "epoch": round(step / steps_per_epoch, 4), **run.evaluate()})
            if records[-1]["eval_reward"] > state.get("best_eval_reward", -math.inf):
                state["best_step"], state["best_eval_reward"] = step, records[-1]["eval_reward"]
        for record in records:
            state["log_history"].append(record)
            values = {k: v for k, v in record.items() if k not in ("step", "epoch")}
            log.info("ppo step %d/%d: %s", step, total_steps, ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
            for k, v in values.items():
                tensorboard.add_scalar(f"{'eval' if k.startswith('eval_') else 'train'}/{k}", v, step)
        if step % cfg.save_steps == 0 or step == total_steps:
            _save_checkpoint(run, run_dir, state, cfg.save_total_limit)


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them): the SFT prompts, the tokenizer, the policy
    model, the reward model, and the pretraining train tokens when `ptx_coef` mixes them in."""
    paths = params.paths
    found = [Path(paths.data, "sft"), Path(paths.tokenizer), Path(paths.models, params.ppo.policy),
             Path(paths.models, "reward")]  # fmt: skip
    return [*found, Path(paths.data, "tokens", "train")] if params.ppo.ptx_coef > 0 else found


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """PPO-train models/<policy> against models/reward and/or reward functions; save models/ppo.

    Args:
        params: Validated params; reads ``paths``, ``ppo``, ``profile`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        ``reward_first``/``reward_last`` (mean raw score over the first/last 10% of steps) with their standard
        errors ``*_se``, ``kl_final`` (summed per-token KL to the reference, last step), ``response_length_first``
        / ``_last`` (tokens), ``eval_reward`` (validation prompts, final policy), ``steps``, ``tokens_per_s``
        (generated tokens per second of generation, mean over logged windows), ``peak_memory_gb`` (this process,
        `throughput.peak_memory_gb`), ``resumed_from_step`` (0 for a fresh run), ``num_parameters`` (policy).

    Raises:
        UserError: Missing or refused inputs, no prompt fits the token budget, a too long `max_length`, or a
            compiled setup (not supported by this stage yet; a multi-process one is refused before launch,
            its registry entry's ``one_process``).
    """
    from torch.utils.tensorboard import SummaryWriter

    cfg, paths = params.ppo, params.paths
    if params.distributed.torch_compile:
        raise UserError("ppo does not support distributed.torch_compile yet; set it to false")
    data = Path(paths.data, "sft")
    tokenizer = load_tokenizer(paths.tokenizer, trust_remote_code)
    budget = cfg.max_length - cfg.generation.max_new_tokens
    keys = "ppo.max_length - ppo.generation.max_new_tokens"
    train = load_prompts(data / "train.jsonl", tokenizer, budget, cfg.num_samples, keys)
    valid = load_prompts(data / "validation.jsonl", tokenizer, budget, cfg.max_eval_samples, keys)
    policy_dir, reward_dir = Path(paths.models, cfg.policy), Path(paths.models, "reward")
    check_model_dir(policy_dir, f"run the {cfg.policy} stage first (dvc repro {cfg.policy})", trust_remote_code)
    check_model_dir(reward_dir, REWARD_MISSING, trust_remote_code)  # before hashing them: names the fix
    ptx_tokens = Path(paths.data, "tokens", "train")
    ptx = token_blocks(ptx_tokens, Path(paths.tokenizer), cfg.max_length) if cfg.ptx_coef > 0 else None
    run = open_run(params, "ppo", inputs(params), resume)
    ppo, total_steps = _build(params, tokenizer, train, valid, ptx, run.path, trust_remote_code)

    state: dict[str, Any] = {"step": 0, "history": [], "log_history": []}
    if run.resume:
        ppo.accelerator.load_state(str(run.resume))
        reapply_schedule(ppo.scheduler)  # the stored rate is the old schedule's: see reapply_schedule
        state = json.loads((run.resume / "trainer_state.json").read_text())
        ppo.load_positions(state.pop("positions"))
        log.info("ppo: resuming from %s (step %d)", run.resume, state["step"])
    else:
        log.info("ppo: fresh run in %s", run.path)
    resumed_step = state["step"]
    log.info("ppo: %d steps of %d prompts, %.2f M policy parameters", total_steps, ppo.rollout_batch_size,
             count_parameters(ppo.policy) / 1e6)  # fmt: skip
    tensorboard = SummaryWriter(log_dir=str(paths.out(paths.logs, "ppo", "tensorboard")))
    reset_peak_memory(ppo.accelerator.device)
    profiler = StepProfiler(params.profile, paths.out(paths.logs, "ppo", "profile")) if params.profile.enabled else None
    if profiler is not None:
        profiler.start()
    _train(ppo, state, total_steps, run.path, tensorboard, profiler)
    if profiler is not None:
        profiler.stop()
    tensorboard.close()

    save_model(ppo.accelerator.unwrap_model(ppo.policy), tokenizer, paths.out(paths.models, "ppo"))
    write_plots(state["log_history"], paths.out(paths.logs, "ppo"))
    write_ledger([[i + 1, h["sha"]] for i, h in enumerate(state["history"])], paths.out(paths.logs, "ppo"))
    evals = [r for r in state["log_history"] if "eval_reward" in r]
    rates = [r["tokens_per_s"] for r in state["log_history"] if "tokens_per_s" in r]
    return {
        **_summary(state["history"], ppo.rollout_batch_size),
        "eval_reward": round(evals[-1]["eval_reward"], 5),
        "steps": state["step"],
        "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else 0.0,
        "peak_memory_gb": round(peak_memory_gb(ppo.accelerator.device), 4),
        "resumed_from_step": resumed_step,
        "num_parameters": count_parameters(ppo.policy),
    }
