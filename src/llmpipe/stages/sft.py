"""`sft` stage: supervised fine-tuning of models/pretrain on chat `messages` with TRL's `SFTTrainer`,
the loss on assistant tokens only: the chat template's `{% generation %}` mask where it has the markers (TRL
computes it), else the mask computed by rendering the conversation turn by turn (`llmpipe.data.chat_turns`), given to
TRL as a pre-tokenised dataset (``input_ids``, ``assistant_masks``), from which it builds the labels.

A sample whose prompt fills ``sft.max_length`` keeps no assistant token, so no label: TRL leaves it out (or,
with packing, packs it as dead weight) without a word. The stage counts them per split, reports the counts
in its metrics, and refuses to train when they are too many (`llmpipe.train.guards.check_no_signal`) or when a batch
has no label at all (`llmpipe.train.guards.MaskedBatchGuard`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.stages.base import TrainerStage
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest
from llmpipe.train.guards import MaskedBatchGuard, check_no_signal, count_fully_truncated

log = logging.getLogger(__name__)


def sft_config(params: Params, run_dir: Path, name: str = "sft", rendered_masks: bool = False):
    """Our params → `trl.SFTConfig`, field by field, from section `name` (a stage that reuses this one: its own);
    with `rendered_masks` the datasets carry their assistant masks (:func:`tokenized`), so TRL's own
    ``assistant_only_loss`` (which needs markers) is off."""
    from trl import SFTConfig

    cfg = params.stage(name)
    return SFTConfig(
        **training_kwargs(params, name, run_dir),
        max_length=cfg.max_length,
        assistant_only_loss=cfg.assistant_only_loss and not rendered_masks,
        packing=cfg.packing,
        dataset_num_proc=None,
    )


def tokenized(split, tokenizer):
    """A ``messages`` split as TRL takes a pre-tokenised one: ``input_ids`` and ``assistant_masks``
    (`llmpipe.data.chat_turns.rendered_masks`), from which TRL builds the labels (-100 off the mask), truncates and
    packs as it does its own."""
    from llmpipe.data.chat_turns import rendered_masks

    return split.map(lambda row: rendered_masks(tokenizer, row["messages"]), remove_columns=["messages"])


class SFT(TrainerStage):
    """models/pretrain → models/sft on data/sft with TRL's `SFTTrainer`."""

    name = "sft"
    data_first = True  # the truncation counts need only the tokenizer

    @property
    def rendered_masks(self) -> bool:
        """Whether the assistant masks are computed by rendering: assistant-only loss, a template without markers."""
        from llmpipe.data.chat_turns import has_markers

        return self.cfg.assistant_only_loss and not has_markers(self.tokenizer.chat_template)

    def config(self, run_dir: Path):
        return sft_config(self.params, run_dir, self.name, self.rendered_masks)

    def datasets(self):
        train = load_split(self.data / "train.jsonl", ("messages",), self.cfg.num_samples)
        valid = load_split(self.data / "validation.jsonl", ("messages",), self.cfg.max_eval_samples)
        return train, valid

    def check_data(self, train, valid) -> dict[str, float]:
        """Count the samples with no assistant token within ``sft.max_length`` per split; refuse too many."""
        cfg, counts = self.cfg, {}
        if self.rendered_masks:
            log.info("sft: the chat template of %s has no {%% generation %%} markers: assistant masks computed by "
                     "rendering each conversation turn by turn", self.params.paths.tokenizer)  # fmt: skip
        splits = (("num_fully_truncated", train, "train"), ("num_fully_truncated_eval", valid, "validation"))
        for key, split, name in splits:
            training, kind = name == "train", "training" if name == "train" else "validation"
            counts[key] = count_fully_truncated(split["messages"], self.tokenizer, cfg.max_length,
                                                cfg.assistant_only_loss, str(self.data / f"{name}.jsonl"))  # fmt: skip
            what = (f"{self.name}: {kind} samples with no completion token within "
                    f"{self.name}.max_length={cfg.max_length}")
            log.info("%s: %d of %d", what, counts[key], len(split))
            check_no_signal(counts[key], len(split), what, f"raise {self.name}.max_length", training)
        return counts

    def inputs(self) -> list[Path]:
        """The registry's inputs, plus the teacher's folder under ``sft.distill`` (another teacher: another run)."""
        from llmpipe.train.distill import teacher_dir

        return [*super().inputs(), *([teacher_dir(self.params)] if self.cfg.distill.teacher else [])]

    def make_trainer(self, model, args, train, valid, callbacks: list):
        from trl import SFTTrainer

        from llmpipe.train.losses import token_loss  # torch: imported when the stage runs, not with the module

        loss = token_loss(self.cfg.loss, self.tokenizer, f"{self.name}.loss")
        if self.rendered_masks:
            train, valid = tokenized(train, self.tokenizer), tokenized(valid, self.tokenizer)
        kwargs = {"model": model, "args": args, "train_dataset": train, "eval_dataset": valid,
                  "processing_class": self.tokenizer, "callbacks": callbacks}  # fmt: skip
        if self.cfg.distill.teacher:
            from llmpipe.train.distill import DistillSFTTrainer, load_teacher

            teacher = load_teacher(self.params, self.tokenizer, self.trust_remote_code)
            trainer = DistillSFTTrainer(**kwargs, teacher=teacher, distill=self.cfg.distill, sft_loss=loss)
        else:
            trainer = SFTTrainer(**kwargs)
            trainer.compute_loss_func = None if self.cfg.loss.is_default else loss  # TRL's own loss when default
        trainer.data_collator = MaskedBatchGuard(trainer.data_collator, f"{self.name}.max_length")
        return trainer


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Fine-tune models/pretrain on data/sft; save models/sft.

    Args:
        params: Validated params.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`); None resumes the newest
            whole checkpoint of the same run.
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, plus ``num_fully_truncated`` and
        ``num_fully_truncated_eval``: training / validation samples with no assistant token within
        ``sft.max_length`` tokens (left out of training by TRL).

    Raises:
        UserError: Missing or refused inputs; models/pretrain was trained with another tokenizer; more than half
            of the training samples (or every validation sample) are fully truncated, or a batch has no label
            (both name ``sft.max_length``).
    """
    return SFT(params, trust_remote_code).run(resume)
