"""What a run shows while it trains: a user's callback named by import path gets every hook in order (a Trainer
stage and PPO), TensorBoard holds the scalars, histograms, samples and hparams, samples.jsonl the samples, and
a stage whose stdout is a pipe prints one plain line per logging step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from conftest import ROOT, TINY_PARAMS

from llmpipe.callbacks import Callback, RunInfo
from llmpipe.config import ParamsError, parse_params
from llmpipe.models import build_model, load_tokenizer, save_model


class Recorder(Callback):
    """Records every hook it gets, in order, into the class list :attr:`events` (the stage builds it itself)."""

    events: ClassVar[list[tuple]] = []

    def on_train_start(self, run: RunInfo) -> None:
        self.events.append(("train_start", run.stage, run.max_steps, run.start_step))

    def on_epoch_start(self, epoch: int) -> None:
        self.events.append(("epoch_start", epoch))

    def on_step_end(self, step: int, logs: dict[str, float]) -> None:
        self.events.append(("step_end", step, "loss" in logs))

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        self.events.append(("evaluate", step))

    def on_save(self, step: int, path: Path) -> None:
        assert path.is_dir(), f"on_save before {path} was written"
        self.events.append(("save", step))

    def on_epoch_end(self, epoch: int) -> None:
        self.events.append(("epoch_end", epoch))

    def on_train_end(self, step: int) -> None:
        self.events.append(("train_end", step))


RECORDER = f"{__name__}:Recorder"


def expected(max_steps: int, logging: int, evals: int, saves: int) -> list[tuple]:
    """The documented hook order of a fresh one-epoch run (`llmpipe.callbacks`)."""
    events: list[tuple] = [("epoch_start", 0)]
    for step in range(1, max_steps + 1):
        events.append(("step_end", step, step % logging == 0 or step == max_steps))
        events += [("evaluate", step)] if step % evals == 0 or step == max_steps else []
        events += [("save", step)] if step % saves == 0 or step == max_steps else []
    return [*events, ("epoch_end", 0), ("train_end", max_steps)]


def _raw(output_root: Path, stage: str, **own) -> dict:
    raw = yaml.safe_load(TINY_PARAMS)
    raw[stage] = {**raw.get(stage, {}), **own}
    raw["paths"] = {"output_root": str(output_root)}
    return raw


def events_in(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_a_bad_callback_path_is_a_params_error_naming_the_key():
    with pytest.raises(ParamsError, match=r"sft\.callbacks: 'nowhere\.mod:X': no module named nowhere\.mod: neither "
                                         r"on the Python path nor in "):
        parse_params({"sft": {"callbacks": ["nowhere.mod:X"]}})
    with pytest.raises(ParamsError, match=r"train\.callbacks: .*has no attribute 'Missing'"):
        parse_params({"train": {"callbacks": [f"{__name__}:Missing"]}})
    with pytest.raises(ParamsError, match=r"dpo\.callbacks: 'json:dumps' is not a subclass"):
        parse_params({"dpo": {"callbacks": ["json:dumps"]}})
    with pytest.raises(ParamsError, match=r"grpo\.callbacks: 'Recorder' is not an import path"):
        parse_params({"grpo": {"callbacks": ["Recorder"]}})
    assert parse_params({"train": {"callbacks": [RECORDER]}}).ppo.callbacks == [RECORDER]  # inherited


def test_a_callback_module_in_the_project_folder_imports_as_a_reward_module_does(tmp_path, monkeypatch):
    """`llm-train` and DVC run in the project folder: a module kept there beside params.yaml needs no install."""
    import sys

    from llmpipe.callbacks import resolve

    (tmp_path / "project_watch.py").write_text("from llmpipe.callbacks import Callback\n\n\n"
                                               "class Watch(Callback):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "project_watch", raising=False)
    assert parse_params({"sft": {"callbacks": ["project_watch:Watch"]}}).sft.callbacks == ["project_watch:Watch"]
    assert resolve("project_watch:Watch").__module__ == "project_watch"
    sys.modules.pop("project_watch", None)


@pytest.fixture(scope="module")
def tiny_inputs(workdir) -> Path:
    """`workdir` with a random tiny Llama saved as models/pretrain and models/sft (sft's and ppo's inputs) and a
    one-label models/reward on its backbone."""
    from transformers import AutoModelForSequenceClassification

    params = parse_params(_raw(workdir, "sft"))
    tok = load_tokenizer(workdir / params.paths.tokenizer)
    model = build_model(params.model, tok)
    for name in ("pretrain", "sft"):
        save_model(model, tok, workdir / "models" / name)
    reward = AutoModelForSequenceClassification.from_pretrained(workdir / "models" / "sft", num_labels=1)
    save_model(reward, tok, workdir / "models" / "reward")
    return workdir


@pytest.mark.slow
def test_sft_calls_a_user_callback_and_fills_tensorboard_and_samples(tiny_inputs, tmp_path, monkeypatch):
    from llmpipe.stages import sft

    monkeypatch.chdir(tiny_inputs)
    Recorder.events.clear()
    params = parse_params(_raw(tmp_path, "sft", callbacks=[RECORDER], histogram_steps=4))
    sft.run(params)

    cfg = params.sft  # 12 steps, logging 4, eval and save 6
    assert Recorder.events[0] == ("train_start", "sft", 12, 0)
    assert Recorder.events[1:] == [*expected(12, cfg.logging_steps, cfg.eval_steps, cfg.save_steps), ("evaluate", 12)]

    samples = [json.loads(line) for line in (tmp_path / "logs" / "sft" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [6, 6, 12, 12]  # the final evaluation's repeat of step 12 is not kept
    assert all(r["prompt"] and isinstance(r["completion"], str) for r in samples)

    (run_dir,) = (tmp_path / "logs" / "sft" / "tensorboard").iterdir()
    assert re.fullmatch(r"\d{8}-\d{6}-\w{8}", run_dir.name)
    acc = events_in(run_dir)
    assert [e.step for e in acc.Scalars("train/loss")] == [4, 8, 12]
    assert {"train/learning_rate", "train/tokens_per_s", "train/grad_norm"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("eval/loss")] == [6, 12, 12]
    weights = [t for t in acc.Tags()["histograms"] if t.startswith("weights/")]
    grads = [t for t in acc.Tags()["histograms"] if t.startswith("gradients/")]
    assert weights and grads and {w.removeprefix("weights/") for w in weights} == {g.removeprefix("gradients/")
                                                                                   for g in grads}  # fmt: skip
    assert [e.step for e in acc.Histograms(grads[0])] == [4, 8, 12]
    texts = acc.Tensors("samples/text_summary")
    assert [e.step for e in texts] == [6, 12]
    assert samples[0]["prompt"][:20] in texts[0].tensor_proto.string_val[0].decode()
    hparams = acc.PluginTagToContent("hparams")
    assert hparams, "no hparams written"


@pytest.mark.slow
def test_ppo_calls_the_same_hooks_in_order(tiny_inputs, tmp_path, monkeypatch):
    from llmpipe.stages import ppo

    monkeypatch.chdir(tiny_inputs)
    Recorder.events.clear()
    params = parse_params(_raw(tmp_path, "ppo", callbacks=[RECORDER]))
    ppo.run(params)

    cfg = params.ppo  # 4 PPO steps of 8 prompts out of 64: one epoch; logging 2, eval 4, save 2
    assert Recorder.events[0] == ("train_start", "ppo", 4, 0)
    assert Recorder.events[1:] == expected(4, cfg.logging_steps, cfg.eval_steps, cfg.save_steps)
    samples = [json.loads(line) for line in (tmp_path / "logs" / "ppo" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in samples] == [4, 4] and all("reward" in r for r in samples)
    (run_dir,) = (tmp_path / "logs" / "ppo" / "tensorboard").iterdir()
    acc = events_in(run_dir)
    assert [e.step for e in acc.Scalars("train/reward")] == [2, 4]
    assert [e.step for e in acc.Scalars("eval/reward")] == [4]
    assert not acc.Tags()["histograms"]  # histogram_steps 0: none


@pytest.mark.slow
def test_a_piped_stage_prints_one_plain_line_per_logging_step(tiny_inputs, tmp_path):
    raw = _raw(tmp_path, "sft")
    raw["paths"] = {}
    (tiny_inputs / "params.yaml").write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_DATASETS_DISABLE_PROGRESS_BARS",
                                                             "HF_HUB_DISABLE_PROGRESS_BARS")}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "llmpipe.cli", "--task", "sft", "--output-dir", str(tmp_path / "out")]
    # bytes: text=True would turn every \r into \n before the check below could see it
    proc = subprocess.run(cmd, cwd=tiny_inputs, env=env, capture_output=True, timeout=600, check=False)
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stderr[-3000:]

    steps = re.findall(r"^sft step (\d+)/12 \| loss [\d.]+ \| lr [\d.e+-]+ \| [\d,]+ tok/s \| ETA [\d:]+$",
                       stdout, re.MULTILINE)  # fmt: skip
    assert steps == ["4", "8", "12"], stdout
    assert re.search(r"^sft done at step 12 \| loss [\d.]+ \| .* tokens \| time .* \| peak memory", stdout, re.MULTILINE)
    for stream in (stdout, stderr):
        assert "\r" not in stream and "\x1b[" not in stream, "progress-bar control characters in a piped run"
