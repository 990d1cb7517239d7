"""`sft` stage: supervised fine-tuning of models/pretrain on chat `messages` with TRL's `SFTTrainer`,
the loss on assistant tokens only: the chat template's `{% generation %}` mask where it has the markers (TRL
computes it), else the mask computed by rendering the conversation turn by turn (`llmpipe.data.chat_turns`), given to
TRL as a pre-tokenised dataset (``input_ids``, ``assistant_masks``), from which it builds the labels.

With ``sft.packing`` (the default) TRL packs whole conversations into rows of at most ``sft.max_length`` tokens,
each kept apart from the others of its row by position ids alone (`llmpipe.train.packing`): every sample's loss is
its loss unpacked. Before training the stage checks that the model does keep them apart, and refuses packing where
it does not; its metrics give the packing fill, the share of the batches' positions that are tokens, not padding.

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
        packing_strategy="bfd",  # TRL's default: whole conversations, cut to max_length as unpacked
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
    fill = None  # its llmpipe.train.packing.PackingFill, from make_trainer

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
        from llmpipe.train.packing import PackedRows, PackingFill

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
        pad = trainer.data_collator.pad_token_id
        if self.cfg.packing:
            trainer.data_collator = PackedRows(pad, trainer.data_collator.pad_to_multiple_of)
        trainer.data_collator = MaskedBatchGuard(trainer.data_collator, f"{self.name}.max_length")
        self.fill = PackingFill(pad)
        self.fill.attach(trainer)
        return trainer

    def check_trainer(self, trainer, num_train: int, num_valid: int) -> dict[str, float]:
        """With packing, refuse a model (or teacher) that lets packed samples meet (`check_keeps_apart`)."""
        from llmpipe.train.packing import check_keeps_apart

        key = f"{self.name}.packing"
        if not self.cfg.packing:
            log.info("%s: packing off (%s: false): each batch pads to its longest conversation", self.name, key)
            return {}
        models = [("the model", trainer.model), ("the teacher", getattr(trainer, "teacher", None))]
        for role, model in filter(lambda m: m[1] is not None, models):
            attn = getattr(model.config, "_attn_implementation", None)
            check_keeps_apart(model, trainer.data_collator.collator, key,
                              f"{role} ({model.config.model_type}, attention {attn})")  # fmt: skip
        log.info("%s: packing on: %d conversations in %d rows of at most %s=%d tokens, each kept apart by its "
                 "position ids (checked on the model)", self.name, num_train, len(trainer.train_dataset),
                 f"{self.name}.max_length", self.cfg.max_length)  # fmt: skip
        return {}

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        """``packing_fill``: the share of the training batches' positions that hold tokens, not padding."""
        log.info("%s: packing fill %.3f (tokens / batch positions over %d tokens trained; packing %s)", self.name,
                 self.fill.fill, self.fill.tokens, "on" if self.cfg.packing else "off")  # fmt: skip
        return {"packing_fill": round(self.fill.fill, 4)}


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
        ``sft.max_length`` tokens (left out of training by TRL), and ``packing_fill``: tokens over batch positions
        (the rest is padding) of the micro-batches this process trained, packed or not.

    Raises:
        UserError: Missing or refused inputs; models/pretrain was trained with another tokenizer; more than half
            of the training samples (or every validation sample) are fully truncated, or a batch has no label
            (both name ``sft.max_length``); with ``sft.packing``, the model or the teacher lets packed samples
            attend to each other (names ``sft.packing``).
    """
    return SFT(params, trust_remote_code).run(resume)
