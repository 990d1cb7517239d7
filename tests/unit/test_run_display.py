"""The built-in callbacks without a training run: progress lines off a terminal, TensorBoard run folders,
histograms of the gradients a step accumulated, and the hook order the Trainer adapter produces."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from llmpipe.callbacks import Callback, CallbackList, RunInfo
from llmpipe.config import parse_params
from llmpipe.core import lines
from llmpipe.train.progress import Progress
from llmpipe.train.tensorboard import TensorBoardLog, hparam_values, run_name

LOGS = {"loss": 2.5, "learning_rate": 3e-4, "tokens_per_s": 1234.5, "num_input_tokens_seen": 4096,
        "peak_memory_gb": 0.5, "mfu": 0.25}  # fmt: skip


def _run(model=None, max_steps: int = 6, log_dir: Path = Path("logs")) -> RunInfo:
    return RunInfo("sft", model, None, max_steps, 0, log_dir, "20260101-000000-abcdef12")


def test_progress_off_a_terminal_is_one_plain_line_per_logging_step():
    out = io.StringIO()  # not a terminal
    progress = Progress("sft", out)
    progress.on_train_start(_run())
    for step in range(1, 7):
        progress.on_step_end(step, LOGS if step % 3 == 0 else {})
    progress.on_evaluate(6, {"eval_loss": 2.25, "eval_runtime": 0.3, "epoch": 0.1})
    progress.on_epoch_end(0)
    progress.on_train_end(6)
    lines = out.getvalue().splitlines()
    assert [re.sub(r"ETA \S+|time \S+", "T", line) for line in lines] == [
        "sft step 3/6 | loss 2.5000 | lr 3.00e-04 | 1,234 tok/s | T",
        "sft step 6/6 | loss 2.5000 | lr 3.00e-04 | 1,234 tok/s | T",
        "sft eval @ step 6 | eval_loss 2.25",
        "sft epoch 1 done | loss 2.5000 | lr 3.00e-04 | 4,096 tokens | T | peak memory 0.50 GB | MFU 25.0%",
        "sft done at step 6 | loss 2.5000 | lr 3.00e-04 | 4,096 tokens | T | peak memory 0.50 GB | MFU 25.0%",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_library_loop_off_a_terminal_is_plain_lines_at_most_one_per_interval(monkeypatch):
    monkeypatch.setattr(lines, "LINE_INTERVAL_S", 0.05)
    out = io.StringIO()
    bar = lines.bar_class("evaluate sft", out, unit="requests")
    module = SimpleNamespace(tqdm=bar)
    with lines.lines_in(module, "evaluate sft", out, unit="requests"):
        assert module.tqdm is not bar and issubclass(module.tqdm, bar.__mro__[1])
        for _ in module.tqdm(range(20), desc="Running loglikelihood requests"):
            time.sleep(0.01)
    assert module.tqdm is bar  # restored
    got = out.getvalue().splitlines()
    assert got[0].startswith("evaluate sft: Running loglikelihood requests 0/20 requests | ")
    assert got[-1].startswith("evaluate sft: Running loglikelihood requests 20/20 requests | ")
    assert 2 < len(got) < 15  # throttled: not a line per item
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_phase_is_one_line_with_its_time_and_details():
    out = io.StringIO()
    with lines.phase("prepare", "read the text", out) as shown:
        shown["documents"] = 1234
    assert re.fullmatch(r"prepare: read the text in 0:00:0\d \(1,234 documents\)\n", out.getvalue())


def test_progress_is_silent_off_rank_zero():
    out = io.StringIO()
    progress = Progress("sft", out)
    progress.on_train_start(RunInfo("sft", None, None, 6, 0, Path("logs"), "r", is_main=False))
    progress.on_step_end(3, LOGS)
    progress.on_train_end(6)
    assert out.getvalue() == ""


def test_tensorboard_histograms_hold_the_gradients_of_the_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = torch.nn.Linear(3, 2)
    board = TensorBoardLog(tmp_path, histogram_steps=2, hparams={"sft": {"lr": 1e-3, "eval_prompts": None}},
                           metric="eval/loss")  # fmt: skip
    board.on_train_start(_run(model))
    for step in (1, 2):
        model.weight.grad = model.bias.grad = None
        (model(torch.ones(1, 3)) * step).sum().backward()  # step 2's gradient is twice step 1's
        board.on_step_end(step, {"loss": float(step)})
    board.on_evaluate(2, {"eval_loss": 0.5})
    acc = EventAccumulator(str(tmp_path / "20260101-000000-abcdef12"), size_guidance={"histograms": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [1.0, 2.0]
    assert [e.step for e in acc.Scalars("eval/loss")] == [2]
    (grad,) = acc.Histograms("gradients/weight")
    assert grad.step == 2 and grad.histogram_value.max == 2.0  # d(2·sum(Wx+b))/dW = 2 for x = 1
    assert [e.step for e in acc.Histograms("weights/bias")] == [2]
    assert acc.PluginTagToContent("hparams")


def test_hparams_flatten_to_tensorboard_types():
    assert hparam_values({"sft": {"lr": 1e-3, "callbacks": [], "eval_prompts": None, "packing": False}}) == {
        "sft.lr": 1e-3, "sft.callbacks": "[]", "sft.eval_prompts": "null", "sft.packing": False}  # fmt: skip
    assert re.fullmatch(r"\d{8}-\d{6}-0123abcd", run_name(Path("checkpoints/sft/0123abcdef")))


class Order(Callback):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_step_end(self, step, logs):
        self.events.append(("step_end", step, dict(logs)))

    def on_evaluate(self, step, metrics):
        self.events.append(("evaluate", step))


def test_the_trainer_adapter_hands_a_logging_step_its_logged_values():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from llmpipe.train.hooks import TrainerHooks

    order = Order()
    hooks = TrainerHooks(CallbackList([order]), "sft", parse_params({}), "r", tokenizer=None)
    args, state, control = TrainingArguments(output_dir="unused", use_cpu=True), TrainerState(), TrainerControl()
    state.max_steps = 2
    hooks.on_train_begin(args, state, control, model=None)
    state.global_step = 1
    hooks.on_step_end(args, state, control)  # not a logging step
    state.global_step, control.should_log = 2, True
    hooks.on_step_end(args, state, control)  # transformers logs after on_step_end:
    hooks.on_log(args, state, control, logs={"loss": 1.5})
    hooks.on_evaluate(args, state, control, metrics={"eval_loss": 1.0})
    assert order.events == [("step_end", 1, {}), ("step_end", 2, {"loss": 1.5}), ("evaluate", 2)]
