"""Three runtime rules of the training stages, each once a defect: a raised step budget trains its next step at
the rate of the longer schedule (not the rate the old one ended on, 0.0 for ``linear``); a budget below the newest
checkpoint trains a shorter run in a folder of its own, leaving the longer run's checkpoints; a precision the
device cannot run is refused before any work, naming the key where it was set."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_PARAMS
from safetensors.torch import load_file

from llmpipe import stages
from llmpipe.cli import main
from llmpipe.config import load_params
from llmpipe.orchestration.scratch import deep_merge
from llmpipe.train.callbacks import reapply_schedule


def _schedule_lr(kind: str, lr: float, warmup_steps: int, total_steps: int, step: int) -> float:
    """The learning rate optimizer step `step` (1-based) of an uninterrupted `total_steps`-step run trains at."""
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(kind, optimizer, warmup_steps, total_steps)
    for _ in range(step - 1):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


def _finished(kind: str, total_steps: int, resumed_total_steps: int):
    """An optimizer and schedule of `resumed_total_steps` steps that loaded the states a finished `total_steps`-step
    run ended with, as a resumed Trainer (or `Accelerator.load_state`) leaves them."""
    from transformers import get_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    scheduler = get_scheduler(kind, optimizer, 2, total_steps)
    for _ in range(total_steps):
        optimizer.step()
        scheduler.step()
    states = optimizer.state_dict(), scheduler.state_dict()
    resumed = torch.optim.SGD([param], lr=1e-3)
    schedule = get_scheduler(kind, resumed, 2, resumed_total_steps)
    resumed.load_state_dict(states[0])
    schedule.load_state_dict(states[1])
    return resumed, schedule


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_a_resumed_schedule_gives_the_next_step_the_longer_schedules_rate(kind):
    from accelerate.scheduler import AcceleratedScheduler

    optimizer, scheduler = _finished(kind, 12, 13)
    want = _schedule_lr(kind, 1e-3, 2, 13, 13)
    assert want > 0
    assert reapply_schedule(AcceleratedScheduler(scheduler, optimizer)) == [want]  # as the PPO loop holds it
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == want

    # The same budget (a killed run resumed): the stored rate, to the bit.
    optimizer, scheduler = _finished(kind, 12, 12)
    stored = optimizer.param_groups[0]["lr"]
    assert reapply_schedule(scheduler) == [stored] and optimizer.param_groups[0]["lr"] == stored


# ---- on the pretrain stage (the cheapest) and the PPO loop (its own, not the HF Trainer) -----------------------


@pytest.fixture(scope="module")
def stagedir(workdir) -> Path:
    """`workdir` with every step logged, and tiny untrained models/sft and a one-label models/reward for PPO."""
    from transformers import AutoModelForSequenceClassification

    from llmpipe.models import build_model, load_tokenizer, save_model

    raw = deep_merge(yaml.safe_load(TINY_PARAMS), {"pretrain": {"logging_steps": 1}, "ppo": {"logging_steps": 1}})
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(workdir / "params.yaml")
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, workdir / "models" / "sft")
    reward = AutoModelForSequenceClassification.from_pretrained(workdir / "models" / "sft", num_labels=1)
    save_model(reward, tok, workdir / "models" / "reward")
    return workdir


def _run(stage: str, root: Path, **over) -> dict:
    """Run `stage` in this process with params.yaml plus `over` (dotted under ``<stage>.``), writing to `root`."""
    extra = {f"{stage}.{k}": v for k, v in over.items()}
    return stages.runner(stage)(load_params("params.yaml", {"paths.output_root": str(root), **extra}))


def _logged_lr(root: Path, stage: str, step: int) -> float:
    (row,) = [r for r in csv.DictReader((root / "logs" / stage / "train.csv").open()) if int(r["step"]) == step]
    return float(row["learning_rate"])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["pretrain", "ppo"])
def test_a_raised_budget_trains_on_at_the_longer_schedules_rate(stagedir, stage, tmp_path, monkeypatch):
    monkeypatch.chdir(stagedir)
    params = load_params("params.yaml").stage(stage)
    steps = params.max_steps
    _run(stage, tmp_path)
    before = load_file(tmp_path / "models" / stage / "model.safetensors")

    longer = _run(stage, tmp_path, max_steps=steps + 1)

    assert (longer["resumed_from_step"], longer["steps"]) == (steps, steps + 1)
    want = _schedule_lr(params.lr_scheduler_type, params.lr, params.warmup_steps, steps + 1, steps + 1)
    assert want > 0 and _logged_lr(tmp_path, stage, steps + 1) == pytest.approx(want, rel=1e-6)
    after = load_file(tmp_path / "models" / stage / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before), "the extra step left the weights as they were"


@pytest.mark.slow
def test_a_budget_below_the_newest_checkpoint_trains_a_shorter_run_of_its_own(stagedir, tmp_path, monkeypatch, caplog):
    """What ``dvc exp run -S pretrain.max_steps=6`` after a finished 12-step run does: DVC has deleted
    models/pretrain and cannot pass --restart, so the stage must train without being told how."""
    monkeypatch.chdir(stagedir)
    full = _run("pretrain", tmp_path)
    (run,) = (tmp_path / "checkpoints" / "pretrain").iterdir()
    kept = sorted(p.name for p in run.iterdir())
    assert "checkpoint-12" in kept

    with caplog.at_level(logging.INFO, logger="llmpipe.train.checkpoints"):
        short = _run("pretrain", tmp_path, max_steps=6)

    assert (short["resumed_from_step"], short["steps"]) == (0, 6)
    ledger = csv.DictReader((tmp_path / "logs" / "pretrain" / "batches.csv").open())
    assert [int(r["step"]) for r in ledger] == list(range(1, 7))
    (line,) = [r.getMessage() for r in caplog.records if "is below step 12" in r.getMessage()]
    assert "pretrain.max_steps (6)" in line and f"{run.name}-steps-6" in line, line
    assert sorted(p.name for p in run.iterdir()) == kept, "the longer run's checkpoints were touched"
    assert sorted(p.name for p in (run.parent / f"{run.name}-steps-6").glob("checkpoint-*")) == ["checkpoint-6"]

    # The short run started again is finished; raising the budget back finds the longer run, finished too.
    assert _run("pretrain", tmp_path, max_steps=6)["resumed_from_step"] == 6
    again = _run("pretrain", tmp_path)
    assert (again["resumed_from_step"], again["steps"], again["eval_loss"]) == (12, 12, full["eval_loss"])


# ---- a precision the device cannot run --------------------------------------------------------------------------


@pytest.fixture
def _restore_logging():
    """`main` points the root logger at the captured stderr; give the next test its own handlers back."""
    handlers = logging.getLogger().handlers[:]
    yield
    logging.getLogger().handlers[:] = handlers


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid on a CUDA device")
@pytest.mark.usefixtures("_restore_logging")
@pytest.mark.parametrize(("section", "named"), [("dpo", "dpo.precision"), ("train", "train.precision")])
def test_fp16_on_cpu_is_refused_before_any_work_naming_where_it_was_set(
    tiny_sft, section, named, tmp_path, monkeypatch, capsys
):
    raw = deep_merge(yaml.safe_load(TINY_PARAMS), {section: {"precision": "fp16"}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tiny_sft)

    code = main(["--task", "dpo", "--config-path", str(tmp_path / "params.yaml"), "--output-dir", str(tmp_path)])

    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("llm-train: error:")]
    assert code == 2 and line == f"llm-train: error: {named}: fp16 needs a CUDA device; use bf16, auto or fp32 on CPU"
    assert not (tmp_path / "checkpoints" / "dpo").exists() and not (tiny_sft / "checkpoints").exists()
