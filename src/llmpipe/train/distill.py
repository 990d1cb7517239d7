"""Knowledge distillation in `sft` (`sft.distill`): the SFT loss mixed with a divergence to a teacher's logits,
``(1 - alpha) · SFT + alpha · T² · D_beta(teacher_T ‖ student_T)`` on the completion tokens (Hinton et al. 2015
for the mix and the T² factor; D is TRL's generalized Jensen-Shannon divergence, Agarwal et al. 2024).

TRL's own distillation trainers train on the divergence alone: `DistillationTrainer` on completions the student
generates, `experimental.gkd.GKDTrainer` (``lmbda=0``) on the dataset with its own collator and without the
temperature in its loss. Neither mixes in the SFT loss, so this subclasses `SFTTrainer` (TRL's advice for a loss of
one's own: its data preparation, assistant-only masks and llmpipe's guards stay as they are) and takes the
divergence from `GKDTrainer.generalized_jsd_loss`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from trl import SFTTrainer
from trl.experimental.gkd import GKDTrainer

from llmpipe.config import Params
from llmpipe.config.optim import DistillParams
from llmpipe.config.stages import REGISTRY
from llmpipe.core.errors import UserError
from llmpipe.models import load_model
from llmpipe.models.tokenizer_identity import check_same_tokenizer
from llmpipe.train.losses import TokenWeightedLoss

TEACHER_STAGES = ("pretrain",)
"""Stages a teacher may name: those that write a causal LM before `sft` runs (DVC already orders them first)."""


def teacher_dir(params: Params) -> Path:
    """The teacher's folder: ``models/<stage>`` for a stage name in :data:`TEACHER_STAGES`, else the path given.

    Raises:
        UserError: ``sft`` or a later stage named (it does not exist before sft runs), or a folder that is missing.
    """
    name = params.sft.distill.teacher
    if name in REGISTRY and name not in TEACHER_STAGES:
        raise UserError(f"sft.distill.teacher: {name!r} runs after sft (or is not a model stage); name "
                        f"{' or '.join(TEACHER_STAGES)} or a model folder")  # fmt: skip
    path = Path(params.paths.models, name) if name in TEACHER_STAGES else Path(name)
    if not path.is_dir():
        raise UserError(f"sft.distill.teacher: {path} is not a model folder; run its stage first or fix the path")
    return path


def load_teacher(params: Params, tokenizer, trust_remote_code: bool = False):
    """The teacher of ``sft.distill``, checked, then loaded once through `llmpipe.models` in eval mode with no
    gradients. Its embedding may have more rows than the student's (a vocabulary padded to a multiple, the same
    tokenizer): the divergence reads the ids both have (:class:`DistillSFTTrainer`).

    Raises:
        UserError: See :func:`teacher_dir`; the folder holds no tokenizer files, or another tokenizer than
            ``paths.tokenizer``, or fewer embedding rows than it has tokens (the divergence compares token
            distributions id by id), each naming ``sft.distill.teacher``; or the loader refuses the folder.
    """
    path = teacher_dir(params)
    fix = (f"sft.distill.teacher: give a teacher saved with the tokenizer of {params.paths.tokenizer} (the "
           "divergence compares the two models' distributions token id by token id)")
    check_same_tokenizer(path, tokenizer, params.paths.tokenizer, fix=fix, require_tokenizer=True)
    teacher = load_model(path, f"sft.distill.teacher: {path} is missing", trust_remote_code=trust_remote_code)
    return teacher.eval().requires_grad_(False)


class DistillSFTTrainer(SFTTrainer):
    """`SFTTrainer` whose loss is the distillation mix of the module docstring; logs ``sft_loss`` and
    ``distill_loss`` (the divergence D, before the ``alpha · T²`` factor) per step and at evaluation.

    Args:
        teacher: The teacher model (:func:`load_teacher`).
        distill: ``sft.distill``.
        sft_loss: The SFT term (`llmpipe.train.losses.TokenWeightedLoss`: plain cross-entropy without
            ``sft.loss`` keys).
        *args, **kwargs: `SFTTrainer`'s.
    """

    def __init__(self, *args, teacher, distill: DistillParams, sft_loss: TokenWeightedLoss, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Not `accelerator.prepare_model` (GKDTrainer's way): a prepared teacher makes Accelerate skip preparing the
        # student for an evaluation before training, which then runs without the teacher's autocast. The teacher
        # runs under `accelerator.autocast()` instead, the precision of the prepared student.
        self.teacher = teacher.to(self.args.device)
        self.distill, self.sft_loss = distill, sft_loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        model_inputs = {k: v for k, v in inputs.items() if k != "labels"} | {"use_cache": False}
        outputs = model(**model_inputs)
        with torch.no_grad(), self.accelerator.autocast():
            teacher_logits = self.teacher(**model_inputs).logits  # (B, T, V_teacher)
        # the ids both embeddings have: rows past the smaller one are padding (both hold every token of the
        # tokenizer: checked at load), which no label names
        vocab = min(outputs.logits.shape[-1], teacher_logits.shape[-1])
        labels = inputs["labels"]  # (B, T), unshifted
        d = self.distill
        sft = self.sft_loss(outputs, labels, num_items_in_batch)
        # in fp32: under bf16 autocast the teacher's logits are bf16, and log-softmax in bf16 normalises too coarsely
        # for a divergence (identical models gave -1e-3)
        kd = GKDTrainer.generalized_jsd_loss(outputs.logits[:, :-1, :vocab].float(),
                                             teacher_logits[:, :-1, :vocab].float(),
                                             labels=labels[:, 1:], beta=d.beta, temperature=d.temperature,
                                             num_items_in_batch=num_items_in_batch)  # fmt: skip
        loss = (1 - d.alpha) * sft + d.alpha * d.temperature**2 * kd
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # as SFTTrainer: DDP averages what the count summed
        # logged per batch as means over its own label tokens, whatever the accumulation
        count = max(1, int((labels[:, 1:] != -100).sum()))
        scale = 1.0 if num_items_in_batch is None else float(num_items_in_batch) / count
        for key, value in (("sft_loss", sft), ("distill_loss", kd)):
            self._metrics[mode][key].append(self.accelerator.gather_for_metrics(value.detach() * scale).mean().item())
        return (loss, outputs) if return_outputs else loss
