"""`dpo` stage: preference tuning of models/sft on preference pairs by ``dpo.method``, each on TRL's own trainer:
Direct Preference Optimization (Rafailov et al. 2023, `trl.DPOTrainer`, the default), KTO (Ethayarajh et al.
2024, `trl.KTOTrainer`, on unpaired examples), ORPO (Hong et al. 2024, `trl.experimental.orpo.ORPOTrainer`),
SimPO (Meng et al. 2024) and CPO (Xu et al. 2024), both `trl.experimental.cpo.CPOTrainer`. DPO and KTO keep
models/sft as the frozen reference; ORPO, SimPO and CPO are reference-free and load one copy of the weights.

KTO reads unpaired ``prompt``/``completion``/``label`` rows: the preference file's own when it has those
columns, else two per pair (chosen desirable, rejected undesirable); shuffled, and each row's KL completion is
another prompt's (:mod:`llmpipe.train.kto`). Its metrics count the desirable and undesirable examples.

TRL cuts sequences to ``dpo.max_length``: DPO and KTO drop the rows whose prompt fills it; CPO and ORPO keep them
with no completion token (a NaN loss), so the stage drops them. A rejected body that differs from the chosen one
only after the cut becomes the same sequence: no preference left, no gradient. The stage counts both kinds per
split, reports them in its metrics, and refuses to train when they are too many
(`llmpipe.train.guards.preference_signal`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from llmpipe.config import Params
from llmpipe.config.training import DPO_LOSS_KEYS
from llmpipe.data.loading import load_split
from llmpipe.stages.base import TrainerStage
from llmpipe.train import kto
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest
from llmpipe.train.guards import drop_no_completion, trainer_preference_signal

log = logging.getLogger(__name__)

COLUMNS = ("prompt", "chosen", "rejected")


def dpo_config(params: Params, run_dir: Path, name: str = "dpo"):
    """Our params → `trl.DPOConfig`, field by field, from section `name` (a stage that reuses this one: its own)."""
    from trl import DPOConfig

    cfg = params.stage(name)
    return DPOConfig(
        **training_kwargs(params, name, run_dir),
        beta=cfg.beta,
        loss_type=list(cfg.loss_type),
        loss_weights=cfg.loss_weights,
        label_smoothing=cfg.label_smoothing,
        max_length=cfg.max_length,
        dataset_num_proc=None,
    )


def kto_config(params: Params, run_dir: Path, name: str = "dpo"):
    """Our params → `trl.KTOConfig`, field by field (TRL's KTO loss; sequential sampling, TRL's default, which
    its KL estimate needs)."""
    from trl import KTOConfig

    cfg = params.stage(name)
    return KTOConfig(
        **training_kwargs(params, name, run_dir),
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        max_length=cfg.max_length,
        dataset_num_proc=None,
    )


def orpo_config(params: Params, run_dir: Path, name: str = "dpo"):
    """Our params → `trl.experimental.orpo.ORPOConfig`, field by field (``beta`` is the paper's λ)."""
    from trl.experimental.orpo import ORPOConfig

    cfg = params.stage(name)
    return ORPOConfig(
        **training_kwargs(params, name, run_dir), beta=cfg.beta, max_length=cfg.max_length, dataset_num_proc=None
    )


def cpo_config(params: Params, run_dir: Path, name: str = "dpo"):
    """Our params → `trl.experimental.cpo.CPOConfig`, field by field: CPO's sigmoid loss with ``cpo_alpha`` × NLL,
    or SimPO's loss (``loss_type="simpo"``) without the NLL term (``cpo_alpha=0``, TRL's recipe for SimPO)."""
    from trl.experimental.cpo import CPOConfig

    cfg = params.stage(name)
    simpo = cfg.method == "simpo"
    return CPOConfig(
        **training_kwargs(params, name, run_dir),
        loss_type="simpo" if simpo else "sigmoid",
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        simpo_gamma=cfg.simpo_gamma,
        cpo_alpha=0.0 if simpo else cfg.cpo_alpha,
        max_length=cfg.max_length,
        dataset_num_proc=None,
    )


CONFIGS = {"dpo": dpo_config, "kto": kto_config, "orpo": orpo_config, "simpo": cpo_config, "cpo": cpo_config}
"""``dpo.method`` → its params mapping."""

NO_PACKING = ("TRL 1.16's DPOTrainer has no padding-free path (its padding_free falls back to padding since its "
              "refactor), nor have its KTO, ORPO and CPO trainers: every batch pads to its longest pair")
"""Why the dpo stage does not pack, as it logs it (sft packs: `llmpipe.train.packing`)."""

REFERENCE_FREE = frozenset({"orpo", "simpo", "cpo"})
"""Methods with no reference model: the stage loads models/sft once."""

def trainer_class(method: str):
    """TRL's trainer of a ``dpo.method``."""
    if method == "dpo":
        from trl import DPOTrainer

        return DPOTrainer
    if method == "kto":
        from trl import KTOTrainer

        return KTOTrainer
    from llmpipe.train.throughput import counting_pair_tokens  # their batches have no input_ids to count

    if method == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        return counting_pair_tokens(ORPOTrainer)
    from trl.experimental.cpo import CPOTrainer

    return counting_pair_tokens(CPOTrainer)


class DPO(TrainerStage):
    """models/sft → models/dpo on data/preference by ``dpo.method`` (module docstring)."""

    name = "dpo"

    def config(self, run_dir: Path):
        return CONFIGS[self.cfg.method](self.params, run_dir, self.name)

    def datasets(self):
        if self.cfg.method == "kto":
            return (kto.unpaired_split(self.data / "train.jsonl", self.cfg.num_samples, self.cfg.seed),
                    kto.unpaired_split(self.data / "validation.jsonl", self.cfg.max_eval_samples, self.cfg.seed))
        train = load_split(self.data / "train.jsonl", COLUMNS, self.cfg.num_samples)
        valid = load_split(self.data / "validation.jsonl", COLUMNS, self.cfg.max_eval_samples)
        return train, valid

    @property
    def copies_reference(self) -> bool:
        return self.cfg.method not in REFERENCE_FREE

    def make_trainer(self, model, args, train, valid, callbacks: list):
        common = {"model": model, "args": args, "train_dataset": train, "eval_dataset": valid,
                  "processing_class": self.tokenizer, "callbacks": callbacks, "peft_config": self.peft_config}  # fmt: skip
        if self.cfg.method not in REFERENCE_FREE and not self.adapter:
            # with an adapter, TRL keeps the reference in the same weights (llmpipe.train.adapters): no second copy
            common["ref_model"] = self.load_model()
        return trainer_class(self.cfg.method)(**common)

    def check_trainer(self, trainer, num_train: int, num_valid: int) -> dict[str, float]:
        trainer.train_dataset = drop_no_completion(trainer.train_dataset)  # CPO/ORPO keep them: a NaN loss
        trainer.eval_dataset = drop_no_completion(trainer.eval_dataset)
        counts = trainer_preference_signal(self.name, trainer, num_train, num_valid, self.cfg.max_length,
                                           truncates=True)  # fmt: skip
        if self.cfg.method == "kto":
            trainer.train_dataset = kto.mismatched_kl(trainer.train_dataset, self.cfg.per_device_train_batch_size)
            trainer.eval_dataset = kto.mismatched_kl(trainer.eval_dataset, self.cfg.per_device_eval_batch_size)
            counts |= kto.label_counts(trainer.train_dataset)
        return counts

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        final = [r for r in trainer.state.log_history if "eval_rewards/accuracies" in r]
        if not final:
            return {}
        return {"eval_reward_accuracy": round(float(final[-1]["eval_rewards/accuracies"]), 4),
                "eval_reward_margin": round(float(final[-1]["eval_rewards/margins"]), 4)}  # fmt: skip


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Preference-tune models/sft on data/preference by ``dpo.method``; save models/dpo.

    Args:
        params: Validated params.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, ``eval_reward_accuracy`` and ``eval_reward_margin``
        (methods whose trainer logs them: dpo, orpo, simpo, cpo), ``num_desirable`` and ``num_undesirable`` (kto:
        the training examples of each label it trains on), and per split (``_eval`` for validation)
        ``num_fully_truncated`` (pairs, or KTO examples, whose prompt fills ``dpo.max_length``) and
        ``num_identical_pairs`` (chosen == rejected within ``dpo.max_length`` tokens; KTO: undesirable examples
        with a desirable one's tokens).

    Raises:
        UserError: Missing or refused inputs; models/sft was trained with another tokenizer; more than half of the
            training pairs (or every validation pair) dropped or identical (names ``dpo.max_length``).
    """
    if unread := unread_loss_choice(params.dpo):
        log.warning(unread)
    log.info("dpo: packing off: %s", NO_PACKING)
    return DPO(params, trust_remote_code).run(resume)


def unread_loss_choice(cfg) -> str | None:
    """The warning for a DPO loss choice (:data:`~llmpipe.config.training.DPO_LOSS_KEYS`) that ``dpo.method`` does
    not read, or None under method dpo. Not an error: the shipped params set it, and a method sweep
    (`dvc exp run -S dpo.method=kto`) must run on the shipped file."""
    if cfg.method == "dpo":
        return None
    unread = ", ".join(f"dpo.{k} {getattr(cfg, k)!r}" for k in DPO_LOSS_KEYS if getattr(cfg, k) is not None)
    return f"dpo: method {cfg.method} does not read the DPO loss choice ({unread}); it applies to method dpo only"
