"""`sft.loss` reaches TRL's SFTTrainer: with critical tokens and label smoothing its training loss on a real batch is
`weighted_token_loss` of the model's logits, and a misspelled token is refused naming the key."""

from __future__ import annotations

import pytest
import torch

from llmpipe.config import load_params
from llmpipe.core.errors import UserError


def _trainer(workdir, tmp_path, **loss):
    from llmpipe.models import build_model, load_tokenizer, save_model
    from llmpipe.stages.sft import SFT

    over = {"paths.output_root": str(tmp_path), **{f"sft.loss.{k}": v for k, v in loss.items()}}
    stage = SFT(load_params(workdir / "params.yaml", over))
    stage.tokenizer = load_tokenizer(workdir / stage.params.paths.tokenizer)
    if not (workdir / "models" / "pretrain").exists():
        save_model(build_model(stage.params.model, stage.tokenizer), stage.tokenizer, workdir / "models" / "pretrain")
    train, valid = stage.datasets()
    return stage, stage.make_trainer(stage.load_model(), stage.config(tmp_path / "run"), train, valid, [])


def test_sft_trains_on_the_weighted_loss(workdir, tmp_path, monkeypatch):
    from llmpipe.train.losses import weighted_token_loss

    monkeypatch.chdir(workdir)
    stage, trainer = _trainer(workdir, tmp_path, critical_tokens=["</s>"], critical_alpha=3.0,
                              label_smoothing=0.1)  # fmt: skip
    eos = stage.tokenizer.convert_tokens_to_ids("</s>")
    # packed, most rows are one conversation cut at max_length, whose eos is gone: the first batch that has one
    batch = next(b for b in trainer.get_train_dataloader() if (b["labels"] == eos).any())
    batch = trainer._prepare_inputs(batch)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    with torch.no_grad():
        logits = trainer.model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    want = weighted_token_loss(logits[:, :-1], batch["labels"][:, 1:], torch.tensor([eos]), 3.0, 0.1)
    plain = weighted_token_loss(logits[:, :-1], batch["labels"][:, 1:], torch.tensor([eos]), 1.0, 0.0)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5) and abs(want.item() - plain.item()) > 1e-3


def test_a_misspelled_critical_token_is_refused(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    with pytest.raises(UserError, match=r"sft\.loss\.critical_tokens: '</think> now' is not one token"):
        _trainer(workdir, tmp_path, critical_tokens=["</think> now"], critical_alpha=2.0)
