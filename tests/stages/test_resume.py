"""Exact resume: every training stage, SIGKILLed at a seeded step between checkpoints and run again, trains on
the batches of an uninterrupted run and ends with its losses; and the resume rules (fingerprints, --resume-from,
--restart, raised budgets, damaged checkpoints, the best checkpoint kept, --list-checkpoints)."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY_PARAMS

from llmpipe import stages
from llmpipe.cli import main
from llmpipe.config import load_params
from llmpipe.config import stages as registry
from llmpipe.train.checkpoints import newest_whole

# Per stage: steps, checkpoint interval, and every step logged (so each step's loss can be compared); the RL stages
# also run the controls whose state a checkpoint must carry: PPO's adaptive KL coefficient (a horizon short enough
# to move it by ~8 % a step) and its value model's own schedule, GRPO's reference sync (a sync at step 2, before the
# kill, and at step 4, after the resume).
RESUME = {
    "pretrain": {"max_steps": 9, "save_steps": 4, "eval_steps": 9, "logging_steps": 1},
    "sft": {"max_steps": 9, "save_steps": 4, "eval_steps": 9, "logging_steps": 1},
    "dpo": {"max_steps": 9, "save_steps": 4, "eval_steps": 9, "logging_steps": 1},
    "reward": {"max_steps": 9, "save_steps": 4, "eval_steps": 9, "logging_steps": 1},
    # RL stages: a step is a generation round (GRPO) or a rollout plus its PPO epochs, so fewer of them.
    "grpo": {"max_steps": 5, "save_steps": 2, "eval_steps": 5, "logging_steps": 1, "sync_ref_model": True,
             "ref_model_sync_steps": 2, "ref_model_mixup_alpha": 0.5},
    "rloo": {"max_steps": 5, "save_steps": 2, "eval_steps": 5, "logging_steps": 1},
    "ppo": {"max_steps": 5, "save_steps": 2, "eval_steps": 5, "logging_steps": 1, "kl_ctrl": "adaptive",
            "kl_target": 0.5, "kl_horizon": 20.0, "value_lr": 3e-4, "value_warmup_steps": 3,
            "value_lr_scheduler_type": "linear"},
    "vlm": {"max_steps": 9, "save_steps": 4, "eval_steps": 9, "logging_steps": 1},
}


def test_every_training_stage_has_a_resume_schedule():
    missing = set(registry.TRAINING_TASKS) - set(RESUME)
    assert not missing, f"add a schedule for {sorted(missing)} to RESUME in tests/stages/test_resume.py"


@pytest.fixture(scope="module")
def stagedir(workdir) -> Path:
    """`workdir` with tiny untrained models/pretrain and models/sft, a one-label models/reward on the same
    backbone, and params.yaml with the `RESUME` schedules: every training stage can run here."""
    from transformers import AutoModelForSequenceClassification

    from llmpipe.models import build_model, load_tokenizer, save_model

    raw = yaml.safe_load(TINY_PARAMS)
    for stage, schedule in RESUME.items():
        raw[stage] = {**raw.get(stage, {}), **schedule}
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(workdir / "params.yaml")
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    model = build_model(params.model, tok)
    for name in ("pretrain", "sft"):
        save_model(model, tok, workdir / "models" / name)
    reward = AutoModelForSequenceClassification.from_pretrained(workdir / "models" / "sft", num_labels=1)
    save_model(reward, tok, workdir / "models" / "reward")
    return workdir


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMPIPE_KILL_AT_STEP"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _llm_train(cwd: Path, stage: str, root: Path, config: str = "params.yaml", **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmpipe.cli", "--task", stage, "--output-dir", str(root), "--config-path", config]
    return subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=600)


def _rows(root: Path, stage: str, name: str) -> list[dict[str, str]]:
    return list(csv.DictReader((root / "logs" / stage / name).open()))


def _kill_step(stage: str) -> int:
    """A seeded step after the first checkpoint that is not a checkpoint step."""
    s = RESUME[stage]
    choices = [k for k in range(s["save_steps"] + 1, s["max_steps"]) if k % s["save_steps"]]
    return random.Random(stage).choice(choices)


ADAPTER_CASES = {"sft-lora": ("sft", {"method": "lora", "r": 4, "lora_dropout": 0.1, "target_modules": "all-linear"})}
"""Resume with an adapter (checkpoints hold the adapter and its optimizer state): stage and its `peft` block."""


@pytest.mark.slow
@pytest.mark.parametrize("case", [*RESUME, *ADAPTER_CASES])
def test_a_killed_stage_resumes_exactly(stagedir, case, tmp_path, monkeypatch):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    stage, config = case, "params.yaml"
    if case in ADAPTER_CASES:
        stage, peft = ADAPTER_CASES[case]
        raw = yaml.safe_load((stagedir / "params.yaml").read_text())
        raw[stage] = {**raw[stage], "peft": peft}
        config = f"params-{case}.yaml"
        (stagedir / config).write_text(yaml.safe_dump(raw))
    at = _kill_step(stage)
    crash = _llm_train(stagedir, stage, killed, config, LLMPIPE_KILL_AT_STEP=str(at))
    assert crash.returncode == -9, crash.stderr[-3000:]
    assert not (killed / "models" / stage).exists(), "killed before the end: no final model"

    rerun = _llm_train(stagedir, stage, killed, config)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = json.loads((killed / "metrics" / f"{stage}.json").read_text())
    expected_resume = at - at % RESUME[stage]["save_steps"]
    assert f"resuming from {killed}" in rerun.stderr and resumed["resumed_from_step"] == expected_resume > 0

    monkeypatch.chdir(stagedir)  # the same run, uninterrupted, in this process
    reference = stages.runner(stage)(load_params(config, {"paths.output_root": str(whole)}))

    assert resumed["steps"] == reference["steps"] == RESUME[stage]["max_steps"]
    ledger = _rows(killed, stage, "batches.csv")
    assert [int(r["step"]) for r in ledger] == list(range(1, RESUME[stage]["max_steps"] + 1))
    assert ledger == _rows(whole, stage, "batches.csv"), "the resumed run trained on other batches"
    if stage == "ppo":
        assert len({r["sha"] for r in ledger}) == len(ledger), "each PPO step takes new prompts"
    got, want = _rows(killed, stage, "train.csv"), _rows(whole, stage, "train.csv")
    assert [r["step"] for r in got] == [r["step"] for r in want], "the log keeps the steps before the kill"
    for a, b in zip(got, want, strict=True):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), abs=1e-4), f"step {a['step']}"
    final = registry.REGISTRY[stage].best_metric[0]  # eval_reward for the RL stages
    assert resumed[final] == pytest.approx(reference[final], abs=1e-4)
    if stage == "ppo":  # the KL coefficient and the value model's rate continue from the checkpoint
        for column in ("kl_coef", "value_learning_rate"):
            assert [float(a[column]) for a in got] == pytest.approx([float(b[column]) for b in want], rel=1e-6), column
        assert resumed["kl_coef_final"] == pytest.approx(reference["kl_coef_final"], abs=2e-6)
    if stage == "grpo":  # the synced reference continues from the checkpoint, not from models/sft
        _assert_same_reference(killed, whole, stagedir / "models" / "sft")
    if case in ADAPTER_CASES:
        adapter = killed / "models" / stage / "adapter" / "adapter_model.safetensors"
        assert adapter.read_bytes() == (whole / "models" / stage / "adapter" / adapter.name).read_bytes()


def _assert_same_reference(killed: Path, whole: Path, start: Path) -> None:
    """The last checkpoint's synced GRPO reference is that of the uninterrupted run, and moved from `start`."""
    import torch
    from safetensors.torch import load_file

    from llmpipe.rl.reference import REFERENCE_FILE

    last = f"checkpoint-{RESUME['grpo']['max_steps']}"
    (a,), (b,) = (list(root.glob(f"checkpoints/grpo/*/{last}/{REFERENCE_FILE}")) for root in (killed, whole))
    got, want, initial = load_file(a), load_file(b), load_file(start / "model.safetensors")
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    assert any(not torch.equal(got[n], initial[n]) for n in got.keys() & initial.keys()), "the reference never moved"


# ---- the resume rules, on pretrain (the cheapest stage) ----------------------------------------------------------


def _pretrain(root: Path, **over) -> dict:
    """Run pretrain in this process with params.yaml plus `over` (dotted under ``pretrain.``), writing to `root`."""
    extra = {f"pretrain.{k}": v for k, v in over.items()}
    return stages.runner("pretrain")(load_params("params.yaml", {"paths.output_root": str(root), **extra}))


def _runs(root: Path) -> list[Path]:
    return sorted((root / "checkpoints" / "pretrain").iterdir())


@pytest.mark.slow
def test_resume_rules(stagedir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(stagedir)
    root = tmp_path / "rules"
    first = _pretrain(root)
    (run,) = _runs(root)
    assert first["resumed_from_step"] == 0
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-8", "checkpoint-9"]

    # A finished run started again trains nothing (the HF Trainer would take one step past max_steps) and
    # reports the same (a budget below its last checkpoint: tests/stages/test_runtime_defects.py).
    again = _pretrain(root)
    assert (again["resumed_from_step"], again["steps"]) == (9, 9) and not (run / "checkpoint-10").exists()
    assert (again["train_loss"], again["eval_loss"]) == (first["train_loss"], first["eval_loss"])

    # Raising only the budget continues the same run: same folder, no step skipped or repeated.
    longer = _pretrain(root, max_steps=12)
    assert (longer["resumed_from_step"], longer["steps"]) == (9, 12) and _runs(root) == [run]
    ledger = _rows(root, "pretrain", "batches.csv")
    assert [int(r["step"]) for r in ledger] == list(range(1, 13))

    # Other params train from step 0 in a folder of their own.
    other = _pretrain(root, lr=5e-4)
    assert other["resumed_from_step"] == 0 and len(_runs(root)) == 2

    # --resume-from a checkpoint of other params: an error naming each key that differs, and the way out.
    capsys.readouterr()
    code = main(["--task", "pretrain", "--output-dir", str(root), "--resume-from", str(run / "checkpoint-12"),
                 "--lr", "0.002", "--batch-size", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"pretrain\.lr: \S+ → 0\.002", err), err
    (line,) = [x for x in err.splitlines() if x.startswith("llm-train: error:")]
    assert "--restart" in line and "pretrain.per_device_train_batch_size: 4 → 2" in line
    assert "does not resume across it" in line, "a batch-layout change is refused with its reason"

    # A damaged newest checkpoint is skipped with a warning naming it; the previous one is resumed.
    weights = run / "checkpoint-12" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # as a kill during the save would leave it
    again = _pretrain(root, max_steps=14)
    assert again["resumed_from_step"] == 9, "fell back to checkpoint-9"

    # --resume-from an earlier checkpoint of the same run rewinds to it.
    assert main(["--task", "pretrain", "--output-dir", str(root), "--steps-per-epoch", "14",
                 "--resume-from", str(run / "checkpoint-12")]) == 0  # fmt: skip
    rewound = json.loads((root / "metrics" / "pretrain.json").read_text())
    assert (rewound["resumed_from_step"], rewound["steps"]) == (12, 14)

    # --list-checkpoints names every run folder and how it differs; --restart keeps the old checkpoints.
    capsys.readouterr()
    assert main(["--task", "pretrain", "--output-dir", str(root), "--list-checkpoints"]) == 0
    listing = capsys.readouterr().out
    assert run.name in listing and "current params and inputs" in listing
    assert re.search(r"pretrain\.lr: 0\.0005 → \S+", listing), listing
    assert main(["--task", "pretrain", "--output-dir", str(root), "--steps-per-epoch", "14", "--restart"]) == 0
    assert json.loads((root / "metrics" / "pretrain.json").read_text())["resumed_from_step"] == 0
    assert any(p.name.startswith(f"{run.name}-restarted-") for p in _runs(root)), "old checkpoints kept"


@pytest.mark.slow
def test_a_code_change_trains_anew_unless_a_checkpoint_is_named(stagedir, tmp_path, monkeypatch, capsys):
    """DVC reruns a stage when its code changed: the finished run of the old code must not be saved again as the
    new model. Naming its checkpoint still resumes it (a fix to llmpipe after a crash), with a warning."""
    from llmpipe.train import checkpoints

    monkeypatch.chdir(stagedir)
    root = tmp_path / "code"
    _pretrain(root)
    (old,) = _runs(root)
    monkeypatch.setattr(checkpoints, "code_hash", lambda: "the code after an edit")
    fresh = _pretrain(root)
    assert (fresh["resumed_from_step"], fresh["steps"]) == (0, 9) and len(_runs(root)) == 2
    (new,) = [run for run in _runs(root) if run != old]
    assert json.loads((new / "fingerprint.json").read_text())["code llmpipe"] == "the code after an edit"

    capsys.readouterr()
    assert main(["--task", "pretrain", "--output-dir", str(root), "--resume-from", str(old / "checkpoint-9")]) == 0
    assert json.loads((root / "metrics" / "pretrain.json").read_text())["resumed_from_step"] == 9
    assert "was trained by other llmpipe code; resuming it as asked" in capsys.readouterr().err


@pytest.mark.slow
def test_the_best_checkpoint_is_kept_besides_the_last(stagedir, tmp_path, monkeypatch):
    monkeypatch.chdir(stagedir)
    # A constant, far too high lr makes the validation loss jump about; which lr leaves the best checkpoint
    # before the last depends on the data, so the first that does is the run checked.
    for lr in (0.5, 1.0, 0.3, 2.0):
        root = tmp_path / f"best-{lr}"
        _pretrain(root, max_steps=12, save_steps=2, eval_steps=2, save_total_limit=1, lr=lr, warmup_steps=0,
                  lr_scheduler_type="constant")
        (run,) = _runs(root)
        state = json.loads((run / "checkpoint-12" / "trainer_state.json").read_text())
        if Path(state["best_model_checkpoint"]).name != "checkpoint-12":
            break
    else:
        pytest.fail(f"every lr left the best checkpoint last, which proves nothing: {state['log_history']}")
    kept = sorted(p.name for p in run.glob("checkpoint-*"))
    assert kept == sorted({"checkpoint-12", Path(state["best_model_checkpoint"]).name}), "best or last deleted"


def test_newest_is_the_most_recently_finished_whole_checkpoint(tmp_path):
    """After a rewind (--resume-from an earlier checkpoint), the abandoned later checkpoints are not resumed
    again; an unfinished save and a truncated weights file are skipped."""
    for step, finished_at in ((5, 300), (9, 200), (7, 400)):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / "trainer_state.json").write_text("{}")
        os.utime(ckpt / "trainer_state.json", (finished_at, finished_at))
    (tmp_path / "checkpoint-12").mkdir()  # a save killed before its trainer_state.json
    (tmp_path / "checkpoint-7" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert newest_whole(tmp_path) == tmp_path / "checkpoint-5"


def test_the_resume_command_of_a_hand_run_names_the_folder_it_wrote_to():
    from llmpipe.cli import resume_command

    assert resume_command(["--task", "sft", "--lr", "1e-4"], "runs/sft-20261204-101500") == (
        "llm-train --task sft --lr 1e-4 --output-dir runs/sft-20261204-101500")  # again without it: a new folder
    assert resume_command(["--task", "sft", "--restart", "--output-dir=my run"], "my run") == (
        "llm-train --task sft '--output-dir=my run'")
    assert resume_command(["--task", "sft"], None) == "llm-train --task sft"


@pytest.mark.slow
def test_ctrl_c_says_how_to_resume(stagedir, tmp_path):
    """SIGINT (Ctrl-C) after a checkpoint of a hand run with overrides: exit 130 with one line giving the command
    that resumes it (with the run folder it wrote to), no traceback."""
    cmd = [sys.executable, "-m", "llmpipe.cli", "--task", "pretrain", "--steps-per-epoch", "5000"]
    earlier = set(stagedir.glob("runs/pretrain-*"))
    # A shell that starts a job in the background (as CI runners and `make … &` do) ignores SIGINT in it, and
    # Python installs no KeyboardInterrupt handler then: give the child a terminal's default disposition.
    proc = subprocess.Popen(cmd, cwd=stagedir, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while not (done := [c for c in stagedir.glob("runs/pretrain-*/checkpoints/pretrain/*/checkpoint-*/trainer_state.json")
                        if c.parents[4] not in earlier]):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint before the end"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    root = done[0].parents[4].relative_to(stagedir)  # runs/pretrain-<time>
    assert (f"llm-train: interrupted; run `llm-train --task pretrain --steps-per-epoch 5000 --output-dir {root}` to "
            "resume pretrain from its newest checkpoint") in err
    assert "Traceback" not in err
