"""The `dpo` stage's preference methods (dpo.method: kto, orpo, simpo, cpo), each on TRL's own trainer: a few steps
train every parameter with a logged loss, the reference-free ones load one copy of the weights, a killed run
resumes exactly, and a key of another method is refused at load."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT, TINY_PARAMS

from llmpipe.config import load_params, parse_params
from llmpipe.core.errors import UserError
from llmpipe.models import load_model

STEPS = {"max_steps": 3, "eval_steps": 3, "save_steps": 3, "logging_steps": 1, "warmup_steps": 0}


def method_params(root, method: str, **over):
    """TINY_PARAMS with dpo.method `method`, a few logged steps, outputs under `root/out-<method>`."""
    raw = yaml.safe_load(TINY_PARAMS)
    raw["dpo"] = {**raw["dpo"], **STEPS, "method": method, **over}
    (root / f"params-{method}.yaml").write_text(yaml.safe_dump(raw))
    return load_params(root / f"params-{method}.yaml", {"paths.output_root": str(root / f"out-{method}")})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kto", "orpo", "simpo", "cpo"])
def test_method_trains_every_parameter_with_a_logged_loss(tiny_sft, method, monkeypatch):
    from llmpipe.stages import dpo

    monkeypatch.chdir(tiny_sft)
    params = method_params(tiny_sft, method)
    loads = []

    def counted(*args, **kwargs):
        loads.append(args[0])
        return load_model(*args, **kwargs)

    monkeypatch.setattr("llmpipe.stages.base.load_model", counted)
    metrics = dpo.run(params)

    assert metrics["steps"] == STEPS["max_steps"]
    rows = list(csv.DictReader((tiny_sft / f"out-{method}" / "logs" / "dpo" / "train.csv").open()))
    assert len(rows) == STEPS["max_steps"] and all(r["loss"] != "" for r in rows)
    assert metrics["num_identical_pairs"] >= 0 and "num_fully_truncated_eval" in metrics
    assert len(loads) == (2 if method == "kto" else 1), "reference-free methods load no reference model"
    before = load_model(tiny_sft / "models" / "sft", "")
    after = load_model(tiny_sft / f"out-{method}" / "models" / "dpo", "")
    unchanged = [n for (n, a), b in zip(before.named_parameters(), after.parameters()) if torch.equal(a, b)]
    assert not unchanged, f"{method}: parameters that did not change: {unchanged}"


@pytest.mark.slow
def test_a_killed_simpo_run_resumes_exactly(tiny_sft, tmp_path, monkeypatch):
    from llmpipe.stages import dpo

    raw = yaml.safe_load(TINY_PARAMS)
    raw["dpo"] = {**raw["dpo"], "method": "simpo", "max_steps": 6, "save_steps": 3, "eval_steps": 6,
                  "logging_steps": 1, "warmup_steps": 0}  # fmt: skip
    (tiny_sft / "params.yaml").write_text(yaml.safe_dump(raw))
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    env = {k: v for k, v in os.environ.items() if k != "LLMPIPE_KILL_AT_STEP"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "llmpipe.cli", "--task", "dpo", "--output-dir", str(killed)]
    crash = subprocess.run(cmd, cwd=tiny_sft, env={**env, "LLMPIPE_KILL_AT_STEP": "5"}, capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert crash.returncode == -9, crash.stderr[-3000:]
    rerun = subprocess.run(cmd, cwd=tiny_sft, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = json.loads((killed / "metrics" / "dpo.json").read_text())
    assert resumed["resumed_from_step"] == 3

    monkeypatch.chdir(tiny_sft)
    reference = dpo.run(load_params("params.yaml", {"paths.output_root": str(whole)}))
    assert resumed["steps"] == reference["steps"] == 6

    def rows(root, name):
        return list(csv.DictReader((root / "logs" / "dpo" / name).open()))

    assert rows(killed, "batches.csv") == rows(whole, "batches.csv"), "the resumed run trained on other batches"
    for a, b in zip(rows(killed, "train.csv"), rows(whole, "train.csv"), strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), abs=1e-4), f"step {a['step']}"
    assert resumed["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-4)


@pytest.mark.parametrize(("over", "key"), [
    ({"desirable_weight": 2.0}, "dpo.desirable_weight"),
    ({"simpo_gamma": 1.0}, "dpo.simpo_gamma"),
    ({"cpo_alpha": 0.5}, "dpo.cpo_alpha"),
])
def test_a_key_of_another_method_is_refused_naming_it(over, key):
    with pytest.raises(UserError, match=rf"{key} .*applies to dpo.method \w+, not 'dpo'"):
        parse_params({"dpo": over})


def test_the_dpo_loss_choice_is_left_unread_with_a_warning_under_another_method_and_defaults_pass():
    from llmpipe.stages.dpo import unread_loss_choice

    kto = parse_params({"dpo": {"method": "kto", "loss_type": ["sigmoid"]}}).dpo  # the shipped file sets loss_type
    assert "dpo.loss_type ['sigmoid']" in unread_loss_choice(kto) and "method kto" in unread_loss_choice(kto)
    assert unread_loss_choice(parse_params({"dpo": {"loss_type": ["sigmoid"]}}).dpo) is None
    assert parse_params({"dpo": {"method": "kto", "desirable_weight": 1.5}}).dpo.desirable_weight == 1.5
    assert parse_params({}).dpo.method == "dpo"


def test_kto_rows_come_from_pairs_or_from_an_unpaired_file(tmp_path):
    from llmpipe.stages.dpo import unpaired_split

    prompt = [{"role": "user", "content": "q"}]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": c}],
                                         "rejected": [{"role": "assistant", "content": r}]}) + "\n"
                             for c, r in (("a", "b"), ("c", "d"))))  # fmt: skip
    rows = unpaired_split(pairs, None)
    assert [(r["completion"][0]["content"], r["label"]) for r in rows] == [
        ("a", True), ("b", False), ("c", True), ("d", False)]
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text(json.dumps({"prompt": prompt, "completion": [{"role": "assistant", "content": "x"}],
                                    "label": False}) + "\n")  # fmt: skip
    assert unpaired_split(unpaired, None)["label"] == [False]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": prompt, "answer": "x"}) + "\n")
    with pytest.raises(UserError, match="dpo.method kto needs pairs"):
        unpaired_split(bad, None)
