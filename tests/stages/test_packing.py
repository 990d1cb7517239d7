"""`sft.packing` is exact: every sample's loss in a packed batch, as TRL's `compute_loss` computes it on the sft
stage's own trainer, is its loss unpacked (sdpa and eager); a model that lets packed samples meet (OPT) is refused
before training, naming the key; the stage reports the packing fill."""

from __future__ import annotations

import pytest
import torch

from llmpipe.config import load_params
from llmpipe.core.errors import UserError

MAX_LENGTH = 256  # long enough for the tiny data's conversations to share rows (half are under 190 tokens)


def _trainer(workdir, tmp_path, packing: bool, attn: str):
    from llmpipe.models import build_model, load_tokenizer, save_model
    from llmpipe.stages.sft import SFT

    over = {"paths.output_root": str(tmp_path), "sft.packing": packing, "sft.max_length": MAX_LENGTH,
            "sft.num_samples": 48, "model.attn_implementation": attn}  # fmt: skip
    stage = SFT(load_params(workdir / "params.yaml", over))
    stage.tokenizer = load_tokenizer(workdir / stage.params.paths.tokenizer)
    if not (workdir / "models" / "pretrain").exists():
        torch.manual_seed(0)
        save_model(build_model(stage.params.model, stage.tokenizer), stage.tokenizer, workdir / "models" / "pretrain")
    train, valid = stage.datasets()
    trainer = stage.make_trainer(stage.load_model(), stage.config(tmp_path / f"run-{packing}"), train, valid, [])
    stage.check_trainer(trainer, len(train), len(valid))
    trainer.model.eval()
    return trainer


def _sample_losses(trainer, rows: list[dict]) -> dict[tuple[int, ...], float]:
    """Each sample of the batch of `rows` (packed: split by their ``seq_lengths``) → its mean loss by TRL's
    `compute_loss` on the trainer's own collated batch, the labels masked to that sample alone."""
    batch, losses = trainer.data_collator(rows), {}
    for i, row in enumerate(rows):
        ends = torch.tensor(row.get("seq_lengths", [len(row["input_ids"])])).cumsum(0).tolist()
        for start, end in zip([0, *ends[:-1]], ends):
            labels = torch.full_like(batch["labels"], -100)
            labels[i, start:end] = batch["labels"][i, start:end]
            with torch.no_grad():
                loss = trainer.compute_loss(trainer.model, {**batch, "labels": labels})
            losses[tuple(row["input_ids"][start:end])] = loss.item()
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_packed_sample_has_its_unpacked_loss(workdir, tmp_path, monkeypatch, attn):
    monkeypatch.chdir(workdir)
    packed, unpacked = _trainer(workdir, tmp_path, True, attn), _trainer(workdir, tmp_path, False, attn)
    assert packed.model.config._attn_implementation == attn
    rows = [packed.train_dataset[i] for i in range(len(packed.train_dataset))]
    shared = [r for r in rows if len(r["seq_lengths"]) > 1][:4]
    assert len(shared) == 4, "the data packs several samples per row"
    batch = packed.data_collator(shared)
    assert "attention_mask" not in batch and batch["position_ids"].shape == batch["input_ids"].shape
    got = _sample_losses(packed, shared)
    alone = {tuple(r["input_ids"]): r for r in unpacked.train_dataset}
    assert len(got) >= 8 and set(got) <= set(alone), "each packed sample is one of the unpacked samples"
    worst = max(abs(loss - _sample_losses(unpacked, [alone[ids]])[ids]) for ids, loss in got.items())
    assert worst <= 1e-5, f"a packed sample's loss differs from its loss alone by {worst:.3g}"


@pytest.mark.slow
def test_a_model_that_lets_packed_samples_meet_is_refused_before_training(workdir, tmp_path, monkeypatch):
    """OPT builds its mask from the attention mask alone: packed, its samples attend to each other."""
    from transformers import OPTConfig, OPTForCausalLM

    from llmpipe.models import load_tokenizer, save_model
    from llmpipe.stages import sft

    monkeypatch.chdir(workdir)
    params = load_params(workdir / "params.yaml", {"paths.output_root": str(tmp_path),
                                                   "paths.models": str(tmp_path / "models")})  # fmt: skip
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                   num_attention_heads=2, word_embed_proj_dim=32, max_position_embeddings=256,
                                   pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id))  # fmt: skip
    save_model(opt, tok, tmp_path / "models" / "pretrain")
    with pytest.raises(UserError, match=r"^sft\.packing: the model \(opt, attention sdpa\) does not keep packed "
                                        r"samples apart .* set sft\.packing: false"):  # fmt: skip
        sft.run(params)
    assert not list((tmp_path / "checkpoints").rglob("checkpoint-*")), "nothing trained"
