"""Which peft method and optimizer each adapter stage can train with: the rules that need the stage (its name and
registry traits), so they live above the section classes (`llmpipe.config.peft`) and below every caller
(`llmpipe.config.loading` refuses a stage's own choice at load, `llmpipe.train.arguments` what it inherits when
it runs)."""

from __future__ import annotations

from typing import NamedTuple

from llmpipe.config.params import Params
from llmpipe.config.peft import NOT_FOR_MUON, PROMPT_LEARNING
from llmpipe.config.stages import REGISTRY


class Refusal(NamedTuple):
    """Why a stage cannot train as its section says (:func:`stage_refusal`)."""

    message: str
    """Names the keys where the values were set and the fix."""
    keys: frozenset[str]
    """The section's keys the rule reads (``peft``, ``optim``): written in the stage's own section, the refusal
    comes at load; all inherited from `train:`, when the stage runs."""


def stage_refusal(params: Params, stage: str) -> Refusal | None:
    """Why `stage` cannot train with its merged `peft:` and `optim`, or None.

    The rules: a stage with a loop of its own (ppo: the registry's ``hf_trainer`` trait) takes no virtual tokens (it reads the value model position by position), no AdaLoRA
    (its rank schedule runs on the Trainer's optimizer-step hook) and no schedule-free optimizer (it does not switch
    one between its training and averaged weights, as the Trainer does); a sequence classifier (reward: ``causal_lm`` false) takes no virtual tokens (peft 0.21
    cannot prefix-tune a transformers 5 classifier, and gives a prompt-tuned one no token ids, so it scores the
    last position, a pad in a right-padded batch); a preference stage's ORPO, SimPO and CPO take no prompt tuning (TRL pairs
    their logits with the labels position by position); a packing stage (sft) takes no virtual tokens (a packed row
    holds them once, for its first conversation only); AdaLoRA needs a step budget; Muon needs a trainable weight
    matrix (:data:`NOT_FOR_MUON`; LoRA of rank 1 has vectors only).

    Args:
        params: Validated params.
        stage: An adapter stage (`llmpipe.config.stages.ADAPTER_TASKS`).
    """
    t = params.stage(stage)
    cfg, where, optim = t.peft, params.source_of(stage, "peft"), params.source_of(stage, "optim")
    inherited = where != f"{stage}.peft"
    method = f"{stage}.peft.method {cfg.method}" + (f" (from {where})" if inherited else "")
    use = (f"give {stage} a peft: block of its own with method" if inherited else f"set {stage}.peft.method to")
    peft, both = frozenset({"peft"}), frozenset({"peft", "optim"})
    own_loop = not REGISTRY[stage].hf_trainer  # ppo: llmpipe.rl.ppo, not the HF Trainer
    if own_loop and cfg.method in PROMPT_LEARNING:
        return Refusal(f"{method}: {stage}'s own loop reads the value model's hidden states position by position, which "
                       f"virtual tokens would shift; {use} lora or ia3", peft)  # fmt: skip
    if own_loop and cfg.method == "adalora":
        return Refusal(f"{method}: its rank schedule runs on the Trainer's optimizer-step hook, which {stage}'s own loop "
                       f"does not have; {use} lora or ia3", peft)  # fmt: skip
    if own_loop and t.optim.startswith("schedule_free"):
        return Refusal(f"{optim} {t.optim}: {stage}'s own loop does not switch a schedule-free optimizer between "
                       f"its training and averaged weights (the Trainer stages do); set {stage}.optim to adamw_torch or "
                       "muon",
                       frozenset({"optim"}))  # fmt: skip
    if not REGISTRY[stage].causal_lm and cfg.method in PROMPT_LEARNING:
        why = ("looks for the model's past_key_values argument, which transformers 5 calls cache, and fails"
               if cfg.method == "prefix_tuning" else "gives the classifier no token ids, so it scores the last "
               "position, a pad in a right-padded batch")  # fmt: skip
        return Refusal(f"{method}: peft 0.21's virtual tokens in a sequence classifier {why}; {use} lora or ia3", peft)
    if cfg.method == "prompt_tuning" and getattr(t, "method", None) in ("orpo", "simpo", "cpo"):
        return Refusal(f"{method} with {stage}.method {t.method}: TRL's ORPO and CPO trainers pair the logits with the "
                       "labels position by position, and prompt tuning's virtual tokens add positions (a size error "
                       f"inside TRL); {use} prefix_tuning, lora or ia3, or set {stage}.method to dpo or kto",
                       frozenset({"peft", "method"}))  # fmt: skip
    if cfg.method in PROMPT_LEARNING and getattr(t, "packing", False):
        return Refusal(f"{method} with {stage}.packing true: the virtual tokens open each packed row once, so every "
                       f"conversation packed after the first would train without them; set {stage}.packing: false, "
                       f"or {use} lora or ia3", peft)  # fmt: skip
    if cfg.method == "adalora" and (t.max_steps <= 0 or cfg.tinit + cfg.tfinal >= t.max_steps):
        return Refusal(f"{method} schedules its rank budget over {stage}.max_steps: set it (> 0, now {t.max_steps}) "
                       f"above peft.tinit + peft.tfinal ({cfg.tinit} + {cfg.tfinal})", peft)  # fmt: skip
    rank = {"lora": cfg.r, "adalora": cfg.init_r}.get(cfg.method, 2)
    if t.optim == "muon" and (cfg.method in NOT_FOR_MUON or rank < 2):
        trains = NOT_FOR_MUON.get(cfg.method, "rank-1 matrices, which are vectors")
        return Refusal(f"{optim} muon steps weight matrices, and {method} trains {trains} only, which leaves Muon "
                       f"nothing to step; set {stage}.optim to adamw_torch (or another optimizer), or "
                       f"{stage}.peft.method to lora (rank 2 or more), adalora or none", both)  # fmt: skip
    return None
