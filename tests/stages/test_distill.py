"""`sft.distill`: the divergence to a teacher equal to the student is 0 before training and grows as the student
moves away; a tiny distillation run lowers the KL to another teacher; a bad teacher is refused before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmpipe.config import load_params
from llmpipe.core.errors import UserError


@pytest.fixture(scope="module")
def distdir(workdir) -> Path:
    """`workdir` with a random tiny Llama as models/pretrain (the student) and another, sharper one as
    teacher/ (another init, its output head scaled ×8: a distribution far from the student's)."""
    from llmpipe.models import build_model, load_tokenizer, save_model

    params = load_params(workdir / "params.yaml")
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, workdir / "models" / "pretrain")
    teacher = build_model(params.model.model_copy(update={"init_seed": 1, "tie_word_embeddings": False}), tok)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)
    save_model(teacher, tok, workdir / "teacher")
    return workdir


def _stage(root: Path, lr: float = 3e-4, **distill):
    """The sft stage of `root`'s params with `sft.lr` and `sft.distill` = `distill`, its tokenizer loaded."""
    from llmpipe.models import load_tokenizer
    from llmpipe.stages.sft import SFT

    over = {"paths.output_root": str(root / "out"), "sft.lr": lr,
            **{f"sft.distill.{k}": v for k, v in distill.items()}}  # fmt: skip
    stage = SFT(load_params(root / "params.yaml", over))
    stage.tokenizer = load_tokenizer(root / stage.params.paths.tokenizer)
    return stage


def _trainer(stage, run_dir: Path):
    train, valid = stage.datasets()
    return stage.make_trainer(stage.load_model(), stage.config(run_dir), train, valid, [])


@pytest.mark.slow
def test_divergence_to_a_teacher_equal_to_the_student_is_zero_then_grows(distdir, tmp_path, monkeypatch):
    monkeypatch.chdir(distdir)
    trainer = _trainer(_stage(distdir, teacher="pretrain", alpha=0.5), tmp_path)
    assert not trainer.teacher.training and not any(p.requires_grad for p in trainer.teacher.parameters())
    before = trainer.evaluate()["eval_distill_loss"]
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.compute_loss(trainer.model, batch)
    step0 = trainer._metrics["train"]["distill_loss"][-1]
    assert abs(before) <= 1e-6 and abs(step0) <= 1e-6, (before, step0)
    trainer.train()  # 12 steps of SFT + distillation: the student moves, the teacher stays
    after = trainer.evaluate()["eval_distill_loss"]
    print(f"divergence to the student's own start: {before:.2e} (eval), {step0:.2e} (train batch) -> {after:.4f}")
    assert after > 1e-4, after
    logged = [r["distill_loss"] for r in trainer.state.log_history if "distill_loss" in r]
    assert logged and logged[-1] > 1e-4


@pytest.mark.slow
def test_a_tiny_distillation_run_lowers_the_kl_to_the_teacher(distdir, tmp_path, monkeypatch):
    import csv

    from llmpipe.stages import sft

    monkeypatch.chdir(distdir)
    teacher = str(distdir / "teacher")
    stage = _stage(distdir, lr=3e-3, teacher=teacher, alpha=1.0, temperature=2.0)
    start = _trainer(stage, tmp_path).evaluate()["eval_distill_loss"]  # the untrained student on validation
    assert teacher in [str(p) for p in stage.inputs()], "the teacher's bytes are part of the run's fingerprint"
    metrics = sft.run(stage.params)  # the whole stage: teacher loaded once, train_stage, final model saved
    rows = list(csv.DictReader((distdir / "out" / "logs" / "sft" / "eval.csv").open()))
    end = float(rows[-1]["eval_distill_loss"])  # the final evaluation, same validation set
    assert metrics["steps"] == 12 and (distdir / "out" / "models" / "sft" / "model.safetensors").exists()
    print(f"distillation KL to the teacher on validation: {start:.4f} -> {end:.4f} in 12 steps")
    assert end < 0.95 * start, (start, end)


def test_a_teacher_that_is_not_there_or_runs_later_is_refused(distdir, monkeypatch):
    from llmpipe.train.distill import teacher_dir

    monkeypatch.chdir(distdir)
    with pytest.raises(UserError, match=r"sft\.distill\.teacher: 'dpo' runs after sft"):
        teacher_dir(_stage(distdir, teacher="dpo").params)
    with pytest.raises(UserError, match=r"sft\.distill\.teacher: nowhere is not a model folder"):
        _stage(distdir, teacher="nowhere").inputs()


def test_a_teacher_with_a_padded_vocabulary_distils_on_the_ids_both_have(distdir, tmp_path, monkeypatch):
    """The student itself with its embedding padded by 64 rows (the same tokenizer, a vocabulary rounded up): the
    divergence reads the shared ids, so it is 0 before any step, not a tensor-size error."""
    from llmpipe.models import load_model, load_tokenizer, save_model

    monkeypatch.chdir(distdir)
    padded = load_model(distdir / "models" / "pretrain", "")
    tok = load_tokenizer(distdir / "models" / "pretrain")
    padded.resize_token_embeddings(len(tok) + 64)
    save_model(padded, tok, tmp_path / "padded")
    trainer = _trainer(_stage(distdir, teacher=str(tmp_path / "padded"), alpha=1.0), tmp_path / "run")
    assert trainer.teacher.get_input_embeddings().weight.shape[0] == len(tok) + 64
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.compute_loss(trainer.model, batch)
    assert abs(trainer._metrics["train"]["distill_loss"][-1]) <= 1e-6


def test_a_teacher_without_a_tokenizer_or_with_another_is_refused_naming_the_key(distdir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from llmpipe.models import build_model, load_tokenizer
    from llmpipe.stages.tokenizer import train_bpe
    from llmpipe.train.distill import load_teacher

    monkeypatch.chdir(distdir)
    stage = _stage(distdir, teacher="pretrain")
    tok = load_tokenizer(distdir / stage.params.paths.tokenizer)
    build_model(stage.params.model, tok).save_pretrained(tmp_path / "bare")  # weights and config, no tokenizer
    with pytest.raises(UserError, match=r"bare: no tokenizer saved beside the model .*; sft\.distill\.teacher: give a "
                                        r"teacher saved with the tokenizer of"):
        load_teacher(_stage(distdir, teacher=str(tmp_path / "bare")).params, tok)
    other = train_bpe(iter(["def f(x):\n    return x\n" * 50, "print('other text')\n" * 50]), vocab_size=len(tok) + 8,
                      min_frequency=1, model_max_length=256)
    other.save_pretrained(tmp_path / "bare")
    assert AutoTokenizer.from_pretrained(tmp_path / "bare").get_vocab() != tok.get_vocab()
    with pytest.raises(UserError) as err:
        load_teacher(_stage(distdir, teacher=str(tmp_path / "bare")).params, tok)
    assert "different tokenizers" in str(err.value) and "sft.distill.teacher: give a teacher" in str(err.value)
    assert "point paths.tokenizer" not in str(err.value)
