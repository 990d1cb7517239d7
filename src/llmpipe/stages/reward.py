"""`reward` stage: a scalar reward model trained on preference pairs with TRL's `RewardTrainer`.

The SFT model's body gets a new one-output score head (`AutoModelForSequenceClassification`,
``num_labels=1``) read at the last token, trained with the pairwise Bradley-Terry loss of Ouyang et al.
2022 (InstructGPT, §3.5). The held-out test pairs are then scored with the saved model: pairwise accuracy
overall and per corruption type (swap / truncate / syntax), so a shortcut such as "longer is better"
shows as one weak type.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.loading import load_split
from llmpipe.models import load_model
from llmpipe.stages.base import TrainerStage
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.checkpoints import ResumeRequest
from llmpipe.train.guards import trainer_preference_signal

COLUMNS = ("prompt", "chosen", "rejected")


def reward_config(params: Params, run_dir: Path, name: str = "reward"):
    """Our params → `trl.RewardConfig`, field by field, from section `name` (a stage that reuses this one: its own)."""
    from trl import RewardConfig

    cfg = params.stage(name)
    return RewardConfig(
        **training_kwargs(params, name, run_dir),
        max_length=cfg.max_length,
        center_rewards_coefficient=cfg.center_rewards_coefficient,
        dataset_num_proc=None,
    )


def score(model, tokenizer, conversations: list[list[dict]], batch_size: int):
    """Reward of each conversation under a sequence-classification reward model.

    Each conversation is rendered with the tokenizer's chat template (as `RewardTrainer` does), cut to the
    model's `max_position_embeddings`, right-padded, and scored at its last real token.

    Args:
        model: An `AutoModelForSequenceClassification` with one output and `config.pad_token_id` set.
        tokenizer: The pipeline tokenizer (chat template, pad token).
        conversations: Message lists, e.g. ``prompt + chosen``.
        batch_size: Sequences per forward pass.

    Returns:
        Float tensor of shape (N,), in the order of `conversations`.
    """
    import torch

    limit = model.config.max_position_embeddings
    ids = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"][:limit] for c in conversations]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths per batch: less padding
    scores = torch.empty(len(ids))
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)  # (B, T)
            mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, T)
            for row, i in enumerate(batch):
                input_ids[row, : len(ids[i])] = torch.tensor(ids[i])
                mask[row, : len(ids[i])] = 1
            logits = model(input_ids=input_ids.to(model.device), attention_mask=mask.to(model.device)).logits  # (B, 1)
            scores[batch] = logits[:, 0].float().cpu()
    return scores


def pairwise_metrics(model, tokenizer, pairs, batch_size: int) -> dict[str, float]:
    """Pairwise accuracy and mean margin of a reward model on preference pairs.

    Args:
        model, tokenizer, batch_size: As for :func:`score`.
        pairs: Rows with conversational ``prompt``, ``chosen``, ``rejected`` and optionally ``corruption``.

    Returns:
        ``accuracy`` (share of pairs with r(chosen) > r(rejected); a tie counts as wrong), ``mean_margin``
        (mean r(chosen) - r(rejected)), ``num_pairs``, and ``accuracy_<type>`` per corruption type.
    """
    pairs = list(pairs)
    chosen = score(model, tokenizer, [p["prompt"] + p["chosen"] for p in pairs], batch_size)
    rejected = score(model, tokenizer, [p["prompt"] + p["rejected"] for p in pairs], batch_size)
    margin = chosen - rejected  # (N,)
    correct = (margin > 0).float()  # (N,)
    metrics = {
        "accuracy": round(float(correct.mean()), 4),
        "mean_margin": round(float(margin.mean()), 4),
        "num_pairs": len(pairs),
    }
    by_type: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(pairs):
        if "corruption" in p:
            by_type[p["corruption"]].append(i)
    for kind, idx in sorted(by_type.items()):
        metrics[f"accuracy_{kind}"] = round(float(correct[idx].mean()), 4)
    return metrics


class Reward(TrainerStage):
    """models/sft + a new score head → models/reward on data/preference with TRL's `RewardTrainer`."""

    name = "reward"
    task_type = "SEQ_CLS"

    def config(self, run_dir: Path):
        return reward_config(self.params, run_dir, self.name)

    def load_model(self, **kwargs):
        """The SFT model with a new one-output score head, initialised from ``reward.seed``."""
        from transformers import set_seed

        set_seed(self.cfg.seed)  # the score head is initialised at load
        return load_model(self.base, self.missing_base, num_labels=1, trust_remote_code=self.trust_remote_code,
                          attn_implementation=self.params.model.attn_implementation, **kwargs)  # fmt: skip

    def samples(self):
        """None: a reward model scores, it does not generate."""

    def datasets(self):
        train = load_split(self.data / "train.jsonl", COLUMNS, self.cfg.num_samples, optional=("margin",))
        valid = load_split(self.data / "validation.jsonl", COLUMNS, self.cfg.max_eval_samples, optional=("margin",))
        return train, valid

    def make_trainer(self, model, args, train, valid, callbacks: list):
        from trl import RewardTrainer

        return RewardTrainer(model=model, args=args, train_dataset=train, eval_dataset=valid,
                             processing_class=self.tokenizer, callbacks=callbacks)  # fmt: skip

    def check_trainer(self, trainer, num_train: int, num_valid: int) -> dict[str, float]:
        return trainer_preference_signal(self.name, trainer, num_train, num_valid, self.cfg.max_length, truncates=False)

    def extra_metrics(self, trainer, metrics: dict[str, float]) -> dict[str, float]:
        """:func:`pairwise_metrics` of the saved model on the held-out test pairs."""
        trainer.accelerator.wait_for_everyone()  # rank 0 has saved the model
        saved = load_model(
            self.params.paths.out(self.params.paths.models, self.name), f"the {self.name} stage did not save it",
            num_labels=1,
        )
        test = load_split(self.data / "test.jsonl", COLUMNS, optional=("corruption",))
        return pairwise_metrics(saved, self.tokenizer, test, self.cfg.per_device_eval_batch_size)


def run(params: Params, resume: ResumeRequest | None = None, trust_remote_code: bool = False) -> dict[str, float]:
    """Train a reward model from models/sft on data/preference; save models/reward; score the test pairs.

    A ``margin`` column in the preference data is passed to the loss when the first row has one.

    Returns:
        The training metrics of :func:`llmpipe.train.loop.train_stage`, plus those of :func:`pairwise_metrics` on the
        held-out pairs of ``data/preference/test.jsonl``: ``accuracy``, ``accuracy_<corruption>`` (swap, truncate,
        syntax on the default data), ``mean_margin``, ``num_pairs``; and per split (``_eval`` for validation)
        ``num_too_long`` (pairs longer than ``reward.max_length``, left out by TRL) and ``num_identical_pairs``
        (chosen == rejected token for token).

    Args:
        params: Validated params; reads ``paths``, ``reward`` and ``distributed``.
        resume: The command line's resume choices (`llmpipe.train.checkpoints.open_run`).
        trust_remote_code: Load model/tokenizer folders with pickled weights or ``auto_map`` code
            (``--trust-remote-code``).

    Raises:
        UserError: models/sft, the tokenizer or a preference split is missing, or a folder is refused; models/sft
            was trained with another tokenizer; more than half of the training pairs (or every validation pair)
            identical.
    """
    return Reward(params, trust_remote_code).run(resume)
