"""The training run every Trainer stage shares: train (resuming the checkpoint `llmpipe.train.checkpoints` picked,
with the callbacks of `llmpipe.train.callbacks`), per-step logs (CSV for `dvc plots`; TensorBoard and the console
are `llmpipe.train.hooks`' callbacks), and the atomic save of the final model.

Training runs on the Hugging Face `Trainer` (TRL's trainers subclass it): it sits on Accelerate, so one
CPU process, DDP, FSDP and DeepSpeed are the same code, and it checkpoints model, optimizer, scheduler,
RNG states and the data position, which is what resume needs.
"""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file
from llmpipe.distributed.agreement import ranks_agree, same_resume_step
from llmpipe.distributed.launch import check_world
from llmpipe.models import count_parameters
from llmpipe.train import merge_check
from llmpipe.train.checkpoints import Run
from llmpipe.train.trackers import hold_run_end

log = logging.getLogger(__name__)


TRAIN_COLUMNS = ("step", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_s", "num_input_tokens_seen")
"""The first columns of ``train.csv``; every other key a stage logs per step follows, sorted."""


def write_plots(log_history: list[dict[str, Any]], log_dir: Path) -> None:
    """Write ``train.csv`` (:data:`TRAIN_COLUMNS`, then every other key logged with a ``loss``, e.g. GRPO's or
    PPO's reward and KL) and ``eval.csv`` (step, epoch and every ``eval_*`` key) from the whole log history
    (which checkpoints carry, so a resumed run's plots are complete)."""
    train_rows = [r for r in log_history if "loss" in r]
    train_cols = [*TRAIN_COLUMNS, *sorted({k for r in train_rows for k in r} - set(TRAIN_COLUMNS))]
    evals = [r for r in log_history if any(k.startswith("eval_") for k in r)]
    eval_rows = list({r["step"]: r for r in evals}.values())  # the final eval repeats a step
    eval_cols = ["step", "epoch"] + sorted({k for r in eval_rows for k in r if k.startswith("eval_")})
    for name, cols, rows in (("train.csv", train_cols, train_rows), ("eval.csv", eval_cols, eval_rows)):
        with atomic_file(log_dir / name) as fh:
            writer = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)


def consolidated_save(trainer, tokenizer, final: Path, merge: bool = True, load_base=None, chat: bool = False,
                      quantized: bool = False):  # fmt: skip
    """Save the trained model as one standard HF directory, whatever the strategy (called on every rank).

    Under FSDP the full state dict is gathered from the shards, under DeepSpeed ZeRO-3 the 16-bit weights
    (``stage3_gather_16bit_weights_on_model_save``); both are collectives, so every rank takes part and
    rank 0 writes. A peft model is saved as its adapter, merged (`merge`) into a fresh copy of the input model
    that `load_base` loads (`llmpipe.train.adapters.save`): the gathered state dict holds every rank's shard of it.
    `chat`: a chat stage's folder names the template's end-of-turn token as an eos (`llmpipe.models.saved_folder`).

    Returns:
        The merged model on rank 0 when an adapter was merged, else None.
    """
    from llmpipe.train import adapters

    acc = trainer.accelerator
    state_dict = acc.get_state_dict(trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model)
    if trainer.is_world_process_zero():
        return adapters.save(acc.unwrap_model(trainer.model), tokenizer, final, merge, load_base,
                             state_dict=state_dict, chat=chat, quantized=quantized)  # fmt: skip
    return None


def _finished_run(trainer, params: Params, stage: str, run: Run) -> bool:
    """Whether `run.resume` is the last step of the run (so nothing is left to train).

    Only for a step budget (`max_steps` > 0) and a strategy whose weights load outside `Trainer.train` (not
    FSDP or DeepSpeed, where a finished run is resumed as any other and trains one step past `max_steps`).

    Raises:
        UserError: The checkpoint is past `max_steps` (only one named by ``--resume-from``: without it,
            `checkpoints.open_run` trains a shorter budget as a run of its own).
    """
    max_steps = trainer.args.max_steps
    if run.resume is None or max_steps <= 0 or run.resumed_step < max_steps:
        return False
    if run.resumed_step > max_steps:
        raise UserError(
            f"{stage}: the checkpoint {run.resume} is at step {run.resumed_step}, past {stage}.max_steps "
            f"({max_steps}); raise {stage}.max_steps, --resume-from an earlier checkpoint, or drop --resume-from "
            f"(a {max_steps}-step run then trains from step 0 in a folder of its own)"
        )
    return params.distributed.strategy not in ("fsdp", "deepspeed")


def train_stage(trainer, params: Params, stage: str, run: Run, tokenizer, load_base=None,
                chat: bool = False) -> dict[str, float]:  # fmt: skip
    """Train (resuming `run.resume` when set), save the final model, return metrics.

    The final model goes to ``models/<stage>`` atomically, before the final evaluation (a crash there loses no
    weights); the per-step logs and the batch ledger to ``logs/<stage>/``.

    Args:
        load_base: Loads the stage's input model afresh (an adapter is merged into it on save).
        chat: A chat stage (sft and every stage after it): the saved folder names the chat template's end-of-turn
            token as an eos (`llmpipe.models.saved_folder.finish`).

    Raises:
        UserError: The checkpoint named by ``--resume-from`` is past the stage's `max_steps` (from a longer run).

    Returns:
        ``train_loss`` (mean of the logged training losses over the whole run, the part before a resume
        included, so an interrupted run reports what an uninterrupted one does), ``eval_loss`` (final
        validation), ``steps``, ``tokens_per_s``
        (mean over logged steps), ``peak_memory_gb`` (this process, see `throughput.peak_memory_gb`), ``mfu``
        (mean over logged steps; only on a device with a known peak), ``resumed_from_step`` (0 for a fresh
        run), ``num_parameters``, ``num_trainable_parameters`` (an adapter's, as peft counts them); with a merged
        adapter in one process, `llmpipe.train.merge_check.compare`'s figures, and for QLoRA ``eval_loss`` is the
        merged model's (``eval_loss_4bit`` the trained one's).
    """
    # Imported here, not at the top: the callbacks subclass transformers' TrainerCallback, whose module imports
    # peft (when installed) and with it most of transformers, so a stage module would take seconds to import.
    from transformers.trainer_callback import PrinterCallback

    from llmpipe.train.callbacks import (
        BatchLedger,
        FirstStepLog,
        KillAtStep,
        NonFiniteLossGuard,
        ResumedSchedule,
        RotateCheckpoints,
        kill_at_step,
        write_ledger,
    )
    from llmpipe.train.optimizers import attach
    from llmpipe.train.profiling import ProfilerCallback
    from llmpipe.train.throughput import ThroughputCallback, peak_memory_gb

    attach(trainer, params.stage(stage))  # optim muon: before train() builds the optimizer
    trainer.callback_handler.callbacks.insert(0, ThroughputCallback(params.stage(stage).max_length))
    trainer.remove_callback(PrinterCallback)  # llmpipe.train.progress prints instead (disable_tqdm drops the bar)
    if params.profile.enabled:
        trainer.add_callback(ProfilerCallback(params.profile, params.paths.out(params.paths.logs, stage, "profile")))
    world = check_world(params, trainer.accelerator)
    if world["world_size"] > 1:
        same_resume_step(trainer.accelerator, stage, run.resumed_step)
    num_parameters = count_parameters(trainer.model)  # before sharding wraps it
    num_trainable = count_parameters(trainer.model, trainable_only=True)
    if run.resume:
        log.info("%s: resuming from %s (step %d)", stage, run.resume, run.resumed_step)
    else:
        log.info("%s: fresh run in %s", stage, run.path)
    ledger = BatchLedger()
    ledger.attach(trainer)
    trainer.add_callback(ResumedSchedule())
    trainer.add_callback(RotateCheckpoints(params.stage(stage).save_total_limit))
    trainer.add_callback(FirstStepLog(stage))
    trainer.add_callback(NonFiniteLossGuard(trainer, stage))
    if (at := kill_at_step()) is not None:
        trainer.add_callback(KillAtStep(at))
    end_tracker_runs = hold_run_end(trainer)  # after the final evaluation, which they log too
    if _finished_run(trainer, params, stage, run):
        # Resumed at max_steps, the HF Trainer would train one step more; the run is done, so load its weights.
        from transformers import TrainerState

        log.info("%s: %s ends the run (max_steps %d): saving its model, no training", stage, run.resume,
                 trainer.args.max_steps)  # fmt: skip
        trainer._load_from_checkpoint(str(run.resume))
        trainer.state = TrainerState.load_from_json(str(run.resume / "trainer_state.json"))
        ledger.restore(trainer.state)
    else:
        trainer.train(resume_from_checkpoint=str(run.resume) if run.resume else None)
    final = params.paths.out(params.paths.models, stage)
    peft = params.stage(stage).peft
    merged = consolidated_save(trainer, tokenizer, final, peft.merge, load_base, chat, peft.load_in_4bit)  # before evaluating
    if params.distributed.strategy == "ddp" and world["world_size"] > 1:
        agree, diff = ranks_agree(trainer.accelerator, trainer.model)
        if not agree:
            raise RuntimeError(f"{stage}: DDP ranks ended with different weights (checksums differ by {diff})")
        world["ranks_agree"] = True
    final_eval = trainer.evaluate()
    # A sharded model's forward needs every rank, and only rank 0 holds the merged copy: scored one process only.
    merge_figures = merge_check.compare(trainer, merged) if merged is not None and world["world_size"] == 1 else {}
    del merged
    end_tracker_runs()
    if trainer.is_world_process_zero():
        write_plots(trainer.state.log_history, params.paths.out(params.paths.logs, stage))
        write_ledger(ledger.rows, params.paths.out(params.paths.logs, stage))
    rates = [r["tokens_per_s"] for r in trainer.state.log_history if "tokens_per_s" in r]
    mfus = [r["mfu"] for r in trainer.state.log_history if "mfu" in r]
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    eval_loss = final_eval.get("eval_loss", math.nan)
    return merge_check.merged_eval({
        "train_loss": round(sum(losses) / len(losses), 5) if losses else math.nan,
        "eval_loss": round(float(eval_loss), 5),
        "steps": int(trainer.state.global_step),
        "tokens_per_s": round(sum(rates) / len(rates), 1) if rates else 0.0,
        "peak_memory_gb": round(peak_memory_gb(trainer.args.device), 4),
        **({"mfu": round(sum(mfus) / len(mfus), 5)} if mfus else {}),
        "resumed_from_step": run.resumed_step,
        "num_parameters": num_parameters,
        "num_trainable_parameters": num_trainable,
        **world,
    }, merge_figures, quantized=peft.load_in_4bit)
