"""`ppo` stage: PPO (Ouyang et al. 2022; Huang et al. 2024) of models/<policy> on the SFT prompts, with the
algorithm of :mod:`llmpipe.rl.ppo` run on Accelerate (TRL ≥ 1.13 has no PPOTrainer).

This module loads the inputs, checks the tokenizer and the models, opens the run and drives it: the models,
optimizer and schedule come from :func:`llmpipe.rl.ppo.build.build`, the steps, logs, checkpoints and metrics from
:mod:`llmpipe.rl.ppo.loop`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from llmpipe.callbacks import RunInfo
from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.data.tokens import token_blocks
from llmpipe.models import check_model_dir, count_parameters, load_model, load_tokenizer
from llmpipe.rl.ppo import loop
from llmpipe.rl.ppo.build import REWARD_MISSING, build
from llmpipe.rl.prompts import load_prompts
from llmpipe.train import adapters
from llmpipe.train.callbacks import write_ledger
from llmpipe.train.checkpoints import ResumeRequest, open_run
from llmpipe.train.loop import write_plots
from llmpipe.train.profiling import StepProfiler
from llmpipe.train.tensorboard import run_name
from llmpipe.train.throughput import reset_peak_memory

log = logging.getLogger(__name__)


def inputs(params: Params) -> list[Path]:
    """What the run reads (its checkpoint fingerprint hashes them): the SFT prompts, the tokenizer, the policy
    model, the reward model, and the pretraining train tokens when `ptx_coef` mixes them in."""
    paths = params.paths
    found = [Path(paths.data, "sft"), Path(paths.tokenizer), Path(paths.models, params.ppo.policy),
             Path(paths.models, "reward")]  # fmt: skip
    return [*found, Path(paths.data, "tokens", "train")] if params.ppo.ptx_coef > 0 else found


def samples(ppo, cfg, tokenizer):
    """PPO's samples (`llmpipe.train.hooks.StageSamples`): ``ppo.eval_prompts`` or the first ``num_eval_prompts``
    validation prompts, sampled and scored (reward model and functions) as a rollout is."""
    from llmpipe.train.samples import SamplePrompts, user_prompts

    if cfg.eval_prompts is not None:
        prompts = user_prompts(tokenizer, cfg.eval_prompts)
        turns = [[{"role": "user", "content": text}] for text in cfg.eval_prompts]
    else:
        n = cfg.num_eval_prompts
        turns = ppo.valid.turns[:n]
        prompts = SamplePrompts([t[-1]["content"] for t in turns], ppo.valid.ids[:n], ppo.valid.names[:n])
    tests = None if cfg.eval_prompts is not None else ppo.valid.tests[: cfg.num_eval_prompts]

    def generate(model, prompts: SamplePrompts) -> tuple[list[str], list[float]]:
        batch = ppo.generate(prompts.ids)
        return batch.completions, ppo.score(batch, turns, prompts.names, tests).tolist()

    return prompts, generate


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """PPO-train models/<policy> against models/reward and/or reward functions; save models/ppo.

    Args:
        params: Validated params; reads ``paths``, ``ppo``, ``profile`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.rl.ppo.loop.summary`.

    Raises:
        UserError: Missing or refused inputs, no prompt fits the token budget, a too long `max_length`, or a
            compiled setup (not supported by this stage yet; a multi-process one is refused before launch,
            its registry entry's ``one_process``).
    """
    from llmpipe.train.hooks import stage_callbacks  # imports transformers: not at stage-module import

    cfg, paths = params.ppo, params.paths
    if params.distributed.torch_compile:
        raise UserError("ppo does not support distributed.torch_compile yet; set it to false")
    if untracked := [name for name in cfg.report_to if name != "tensorboard"]:
        log.warning("%s: %s not logged to: PPO runs its own loop, not the HF Trainer whose integrations they are; "
                    "it logs to TensorBoard and logs/ppo/train.csv", params.source_of("ppo", "report_to"),
                    ", ".join(untracked))  # fmt: skip
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
    ppo, total_steps = build(params, tokenizer, train, valid, ptx, run.path, trust_remote_code)
    state = loop.resume(ppo, run.resume, run.path)
    resumed_step = state["step"]
    log.info("ppo: %d steps of %d prompts, %.2f M policy parameters", total_steps, ppo.rollout_batch_size,
             count_parameters(ppo.policy) / 1e6)  # fmt: skip
    callbacks = stage_callbacks(params, "ppo", samples(ppo, cfg, tokenizer))
    info = RunInfo(stage="ppo", model=ppo.accelerator.unwrap_model(ppo.policy), tokenizer=tokenizer,
                   max_steps=total_steps, start_step=resumed_step, log_dir=paths.out(paths.logs, "ppo"),
                   run_name=run_name(run.path), params=cfg.model_dump(), is_main=ppo.accelerator.is_main_process)  # fmt: skip
    reset_peak_memory(ppo.accelerator.device)
    profiler = StepProfiler(params.profile, paths.out(paths.logs, "ppo", "profile")) if params.profile.enabled else None
    if profiler is not None:
        profiler.start()
    loop.train(ppo, state, total_steps, run.path, callbacks, info, profiler)
    if profiler is not None:
        profiler.stop()

    missing = f"run the {cfg.policy} stage first (dvc repro {cfg.policy})"
    adapters.save(ppo.accelerator.unwrap_model(ppo.policy), tokenizer, paths.out(paths.models, "ppo"), cfg.peft.merge,
                  lambda: load_model(policy_dir, missing, trust_remote_code=trust_remote_code), chat=True)  # fmt: skip
    write_plots(state["log_history"], paths.out(paths.logs, "ppo"))
    write_ledger([[i + 1, h["sha"]] for i, h in enumerate(state["history"])], paths.out(paths.logs, "ppo"))
    return loop.summary(ppo, state, resumed_step)
