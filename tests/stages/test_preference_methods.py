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
    assert all(float(r["tokens_per_s"]) > 0 for r in rows), "tokens of both sequences counted (CPO/ORPO: no input_ids)"
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


def test_kto_rows_come_from_pairs_or_from_an_unpaired_file_shuffled(tmp_path):
    from llmpipe.train.kto import unpaired_split

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                         "chosen": [{"role": "assistant", "content": f"good {i}"}],
                                         "rejected": [{"role": "assistant", "content": f"bad {i}"}]}) + "\n"
                             for i in range(20)))  # fmt: skip
    rows = unpaired_split(pairs, None, seed=42)
    got = [(r["prompt"][0]["content"], r["completion"][0]["content"], r["label"]) for r in rows]
    assert sorted(got) == sorted([(f"q{i}", f"good {i}", True) for i in range(20)]
                                 + [(f"q{i}", f"bad {i}", False) for i in range(20)])
    side_by_side = sum(a[0] == b[0] for a, b in zip(got, got[1:]))
    assert side_by_side < 5, "a pair's two rows are not laid next to each other"  # 39 neighbours, 1 in 39 by chance
    assert [r["label"] for r in unpaired_split(pairs, None, seed=42)] == [r["label"] for r in rows]  # seeded
    unpaired = tmp_path / "unpaired.jsonl"
    unpaired.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}],
                                    "completion": [{"role": "assistant", "content": "x"}], "label": False}) + "\n")
    assert unpaired_split(unpaired, None, seed=0)["label"] == [False]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "answer": "x"}) + "\n")
    with pytest.raises(UserError, match="dpo.method kto needs pairs"):
        unpaired_split(bad, None, seed=0)


def kl_rows(prompts: list[int]):
    """TRL-prepared KTO rows with these prompt ids (one token each), completion i = [100 + i], and TRL's own KL
    completions: rotated by one within batches of 2."""
    from datasets import Dataset

    completions = [[100 + i] for i in range(len(prompts))]
    kl = []
    for start in range(0, len(prompts), 2):  # trl.KTOTrainer's own rule (add_kl_completion_ids)
        batch = completions[start:start + 2]
        kl += batch[-1:] + batch[:-1]
    return Dataset.from_dict({"prompt_ids": [[p] for p in prompts], "completion_ids": completions,
                              "KL_completion_ids": kl, "label": [i % 2 == 0 for i in range(len(prompts))]})


def test_each_kto_example_is_paired_for_its_kl_term_with_another_prompts_completion():
    """Pairs laid side by side (TRL's rotation then pairs each row with its own prompt's other answer) and a tail
    batch of one row (paired with itself): every KL completion comes from another prompt, within the batch where
    one is there."""
    from llmpipe.train.kto import label_counts, mismatched_kl

    prompts = [0, 0, 1, 1, 2, 3, 4]  # batches of 2: (0, 0) (1, 1) (2, 3) (4,)
    before = kl_rows(prompts)
    assert sum(prompts[before["completion_ids"].index(k)] == p for k, p in zip(before["KL_completion_ids"], prompts)) > 3
    after = mismatched_kl(before, batch_size=2)
    owner = {c[0]: p for c, p in zip(after["completion_ids"], prompts)}
    assert all(owner[k[0]] != p for k, p in zip(after["KL_completion_ids"], prompts))
    assert after["KL_completion_ids"][4:6] == [[105], [104]]  # a batch of two prompts: its completions, swapped
    assert after["KL_completion_ids"][6] != [106]  # the tail batch of one row
    assert label_counts(after) == {"num_desirable": 4, "num_undesirable": 3}
    with pytest.raises(UserError, match="every preference example has the same prompt"):
        mismatched_kl(kl_rows([7, 7, 7]), batch_size=2)


def test_kto_with_one_example_per_batch_is_a_params_error():
    with pytest.raises(ValueError, match=r"dpo.per_device_train_batch_size is 1 under dpo.method kto: KTO estimates"):
        parse_params({"dpo": {"method": "kto", "per_device_train_batch_size": 1}})
    with pytest.raises(ValueError, match=r"dpo.per_device_train_batch_size is 1 under dpo.method kto"):
        parse_params({"train": {"per_device_train_batch_size": 1}, "dpo": {"method": "kto"}})  # inherited
    assert parse_params({"dpo": {"method": "dpo", "per_device_train_batch_size": 1}})


@pytest.mark.slow  # ~1 min: a few KTO steps of the tiny model
def test_kto_trains_on_unpaired_rows_with_other_prompts_in_its_kl_term(tiny_sft, tmp_path, monkeypatch):
    """Unpaired rows as prepare writes them from a prompt/completion/label file, an odd number of them in batches of
    2 (a tail batch of one): every KL completion TRL's trainer uses is another prompt's; the label counts are
    metrics."""
    from llmpipe.core.io import read_jsonl, write_jsonl
    from llmpipe.stages import dpo
    from llmpipe.train import kto

    monkeypatch.chdir(tiny_sft)
    for split in ("train", "validation"):
        pairs = [p for p in read_jsonl(tiny_sft / "data" / "preference" / f"{split}.jsonl")
                 if len(json.dumps(p["prompt"])) < 200][:6]  # short prompts: their answers fit dpo.max_length
        rows = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
                for p in pairs for key in ("chosen", "rejected")]
        write_jsonl(tmp_path / "data" / "preference" / f"{split}.jsonl", rows)
    params = method_params(tiny_sft, "kto", num_samples=7, per_device_train_batch_size=2, max_eval_samples=5,
                           max_length=256)
    params = params.model_copy(update={"paths": params.paths.model_copy(update={"data": str(tmp_path / "data")})})
    seen, mismatched_kl = [], kto.mismatched_kl

    def observed(dataset, batch_size):  # the real function; its results kept to look at
        seen.append(mismatched_kl(dataset, batch_size))
        return seen[-1]

    monkeypatch.setattr(kto, "mismatched_kl", observed)
    metrics = dpo.run(params)
    assert metrics["steps"] == STEPS["max_steps"]
    assert metrics["num_desirable"] + metrics["num_undesirable"] == 7 and metrics["num_undesirable"] > 0
    for prepared in seen:  # train, then validation
        prompt_of = {tuple(c): tuple(p) for p, c in zip(prepared["prompt_ids"], prepared["completion_ids"])}
        assert all(prompt_of[tuple(k)] != tuple(p) for p, k in zip(prepared["prompt_ids"],
                                                                    prepared["KL_completion_ids"]))
