"""Training stages on tiny real models: fingerprints keep runs apart and the final model is written atomically
(killed-and-resumed runs of every stage: test_resume.py; packing and token files: test_tokens.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TINY_PARAMS

import llmpipe
from llmpipe.config import parse_params
from llmpipe.core.io import atomic_dir
from llmpipe.train.checkpoints import code_hash, fingerprint


def test_fingerprint_ignores_budgets_but_not_hyperparameters(workdir):
    inputs = [workdir / "data" / "pretrain"]
    raw = yaml.safe_load(TINY_PARAMS)
    base = parse_params(raw)
    longer = parse_params({**raw, "pretrain": {**raw.get("pretrain", {}), "max_steps": 500}})  # only the budget
    other_lr = parse_params({**raw, "train": {**raw["train"], "lr": 5e-4}})
    assert fingerprint(base, "pretrain", inputs) == fingerprint(longer, "pretrain", inputs)
    assert fingerprint(base, "pretrain", inputs) != fingerprint(other_lr, "pretrain", inputs)
    assert fingerprint(base, "sft", inputs) != fingerprint(base, "pretrain", inputs)


def test_code_hash_follows_the_sources_not_their_bytecode(tmp_path):
    package = tmp_path / "llmpipe"
    shutil.copytree(Path(llmpipe.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    before = code_hash(package)
    assert before == code_hash(), "the copy hashes as the installed package"
    (package / "rl" / "__pycache__").mkdir()
    (package / "rl" / "__pycache__" / "ppo.cpython-311.pyc").write_bytes(b"bytecode")
    assert code_hash(package) == before, "bytecode the interpreter writes is not a code change"
    ppo = package / "rl" / "ppo" / "losses.py"
    ppo.write_text(ppo.read_text() + "\n# a fix\n")
    assert code_hash(package) != before


def test_atomic_dir_keeps_the_old_folder_on_failure(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        (tmp / "weights").write_text("half")
        raise RuntimeError("killed mid-save")
    assert (final / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"], "no temp folder left behind"
