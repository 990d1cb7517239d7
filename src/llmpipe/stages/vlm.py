"""`vlm` stage: teach the SFT model to see — a LLaVA model (`llmpipe.vlm.model`) trained with TRL's
`SFTTrainer` on image question/answer records (``data/vlm``), the loss on the answers only, the parts chosen by
`vlm.freeze_*` frozen; then its held-out accuracy per question type against chance and against the same model
before training (`llmpipe.vlm.scoring`).

The records are checked before any model loads (`llmpipe.data.image_records`: missing or unreadable images, placeholders
that do not match the images), and a record whose image tokens ``vlm.max_length`` would cut is refused with its
file and row (cut image tokens no longer match the image's features, which fails deep inside the model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmpipe.config import Params
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, write_jsonl
from llmpipe.data.chat_turns import require_markers
from llmpipe.data.image_records import IMAGE_TAG, read_records, typed_content
from llmpipe.stages.base import TrainerStage
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest
from llmpipe.vlm.model import build_processor, build_vlm, freeze

log = logging.getLogger(__name__)


class VLM(TrainerStage):
    """models/sft → models/vlm on data/vlm."""

    name = "vlm"
    data_first = True  # the records' checks need only the tokenizer: a bad record is refused before any model loads

    def __init__(self, params: Params, trust_remote_code: bool = False) -> None:
        super().__init__(params, trust_remote_code)
        self.rows = {s: read_records(self.data / f"{s}.jsonl") for s in ("train", "validation", "test")}
        self.processor: Any = None
        self.trainable: dict[str, int] = {}

    def _processor(self):
        if self.processor is None:
            self.processor = build_processor(self.tokenizer, self.cfg.vision)
        return self.processor

    def load_model(self):
        """The SFT model grown into a LLaVA model (same params → same initial weights), frozen per params."""
        model = build_vlm(super().load_model(), self._processor(), self.cfg)
        self.trainable = freeze(model, self.cfg)
        return model

    def saved_with(self):
        return self.processor

    def samples(self):
        # The samples hook renders text prompts for a text model; answers to held-out images are the accuracy
        # extra_metrics scores.
        return None

    def config(self, run_dir: Path):
        from trl import SFTConfig

        return SFTConfig(**training_kwargs(self.params, self.name, run_dir), max_length=self.cfg.max_length,
                         assistant_only_loss=True, remove_unused_columns=False,  # the collator reads `images`
                         dataset_kwargs={"skip_prepare_dataset": True})  # fmt: skip

    def _dataset(self, split: str, limit: int | None):
        import datasets

        rows = self.rows[split][:limit]
        typed = [{"messages": [{"role": m["role"], "content": typed_content(m["content"])} for m in r["messages"]],
                  "images": [str(self.data / p) for p in r["images"]]} for r in rows]  # fmt: skip
        return datasets.Dataset.from_list(typed).cast_column("images", datasets.Sequence(datasets.Image()))

    def datasets(self):
        return self._dataset("train", self.cfg.num_samples), self._dataset("validation", self.cfg.max_eval_samples)

    def check_data(self, train, valid) -> dict[str, float]:
        """Refuse a template TRL cannot mask answers by, and a record whose image tokens `vlm.max_length` would cut;
        count answers cut (left unlearned)."""
        tok, per_image = self._processor().tokenizer, self.cfg.vision.num_image_tokens
        require_markers(tok.chat_template, str(self.params.paths.tokenizer), self.name)
        image_id, cut = tok.convert_tokens_to_ids(IMAGE_TAG), 0
        for split in ("train", "validation"):
            for i, row in enumerate(self.rows[split]):
                ids = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
                where = [j for j, t in enumerate(ids) if t == image_id]
                end = where[-1] + len(where) * (per_image - 1) + 1 if where else 0  # after expansion
                if end > self.cfg.max_length:
                    raise UserError(f"{self.data / f'{split}.jsonl'}: row {i + 1}: its image tokens end at token "
                                    f"{end}, past {self.name}.max_length ({self.cfg.max_length}), so they would be "
                                    f"cut; raise {self.name}.max_length or shorten the text before the image")  # fmt: skip
                cut += len(ids) + len(where) * (per_image - 1) > self.cfg.max_length
        return {"num_truncated": cut}

    def make_trainer(self, model, args, train, valid, callbacks: list):
        from trl import SFTTrainer

        class VLMTrainer(SFTTrainer):
            def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
                # transformers' Trainer loads a checkpoint's weights with load_state_dict(strict=False), but LLaVA
                # saves them under its legacy key names (vision_tower.…, not model.vision_tower.…), so nothing
                # would load and a resumed run would go on from the initial weights. from_pretrained maps them
                # back; strict loading then fails loudly on any mismatch.
                model = self.model if model is None else model
                model.load_state_dict(type(model).from_pretrained(resume_from_checkpoint).state_dict())

        return VLMTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid,
                          processing_class=self.processor, callbacks=callbacks)  # fmt: skip

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        """Held-out accuracy per question type of the trained model (``test_*``) and of the model as built
        before training (``untrained_*``), and the trainable parameters per part."""
        from llmpipe.vlm.scoring import accuracy_by_type, sample_answers

        rows = self.rows["test"]
        trained = accuracy_by_type(trainer.model, self.processor, rows, self.data)
        if trainer.is_world_process_zero():
            write_answers(sample_answers(trainer.model, self.processor, rows, self.data), self.data,
                          self.params.paths.out(self.params.paths.logs, self.name, "answers"))  # fmt: skip
        untrained = accuracy_by_type(self.load_model(), self.processor, rows, self.data)
        for kind in sorted(k.removeprefix("chance_") for k in trained if k.startswith("chance_")):
            log.info("vlm: %s accuracy %.3f ± %.3f (untrained %.3f, chance %.3f, n %d)", kind,
                     trained[f"accuracy_{kind}"], trained[f"accuracy_{kind}_se"], untrained[f"accuracy_{kind}"],
                     trained[f"chance_{kind}"], trained[f"num_{kind}"])  # fmt: skip
        return ({f"test_{k}": v for k, v in trained.items()}
                | {f"untrained_{k}": v for k, v in untrained.items() if k.startswith("accuracy")} | self.trainable)


def write_answers(answers: list[dict[str, Any]], data: Path, folder: Path) -> None:
    """``<folder>/answers.jsonl`` and a copy of each answered image (``<n>.png``), for the report card; atomic."""
    import shutil

    with atomic_dir(folder) as tmp:
        for i, answer in enumerate(answers):
            shutil.copyfile(data / answer["image"], tmp / f"{i}.png")
        write_jsonl(tmp / "answers.jsonl", [{**a, "image": f"{i}.png"} for i, a in enumerate(answers)])


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Train models/vlm from models/sft on data/vlm; score it on data/vlm/test.jsonl.

    Returns:
        The metrics of :func:`llmpipe.train.loop.train_stage`, ``num_truncated`` (records whose answer
        ``vlm.max_length`` cuts), ``test_accuracy_<type>`` / ``_se`` / ``test_chance_<type>`` /
        ``test_num_<type>`` and ``untrained_accuracy_<type>`` per question type (`llmpipe.vlm.scoring`), and
        ``trainable_<part>`` parameter counts. Writes ``logs/vlm/answers/``: a few held-out images per question
        type with the trained model's greedy answers (the report card shows them).

    Raises:
        UserError: Missing or refused inputs (records, images, models/sft), or a record whose image tokens
            ``vlm.max_length`` would cut.
    """
    return VLM(params, trust_remote_code).run(resume)
