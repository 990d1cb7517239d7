"""The `llm-train` commands that train and load nothing: intermediate-size, plot-lr, and the dispatch beside
``--task`` (chat, generate and inspect on tiny models: tests/stages/test_chat_generate_inspect.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import bad_input_helpers
import pytest
import yaml
from conftest import ROOT, TINY_PARAMS
from PIL import Image

from llmpipe.cli import main
from llmpipe.commands import COMMANDS
from llmpipe.commands.schedule import lr_schedule
from llmpipe.commands.sizing import intermediate_size
from llmpipe.config import parse_params

_restore_logging = bad_input_helpers._restore_logging  # `main` points the root logger at captured stderr


@pytest.mark.parametrize(("hidden", "multiple_of", "multiplier", "expected"), [
    (4096, 256, None, 11008),   # Llama 1/2 7B
    (5120, 256, None, 13824),   # Llama 2 13B
    (8192, 4096, 1.3, 28672),   # Llama 2 70B
    (4096, 1024, 1.3, 14336),   # Llama 3 8B
    (64, 32, None, 192),        # 170.67 → 170 → 192
])  # fmt: skip
def test_intermediate_size_is_llamas_rule(hidden, multiple_of, multiplier, expected, capsys):
    assert intermediate_size(hidden, multiple_of, multiplier) == expected
    argv = ["intermediate-size", str(hidden), "--multiple-of", str(multiple_of)]
    assert main(argv + (["--ffn-dim-multiplier", str(multiplier)] if multiplier else [])) == 0
    assert capsys.readouterr().out == f"{expected}\n", "stdout is the number alone, for scripts"


def test_intermediate_size_refuses_non_positive_sizes(capsys):
    assert main(["intermediate-size", "0"]) == 2
    assert "must be > 0" in capsys.readouterr().err


def test_help_lists_the_commands_and_stays_fast_and_task_still_dispatches(capsys):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "llmpipe.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout  # fmt: skip
    took = time.perf_counter() - start
    listed = re.search(r"commands: llm-train \{([a-z,-]+)\}", out)
    assert listed and listed.group(1).split(",") == list(COMMANDS), f"the --help epilog names {list(COMMANDS)}"
    assert "--task" in out
    assert took < 5, f"llm-train --help took {took:.1f} s: a command module imports torch or transformers at import"
    assert main(["--task", "nosuch"]) == 2, "--task is dispatched as before"
    assert "nosuch" in capsys.readouterr().err
    assert main(["sft"]) == 2
    err = capsys.readouterr().err
    assert "llm-train --task NAME" in err and all(name in err for name in COMMANDS), err


def test_plot_lr_matches_transformers_own_schedule_and_writes_a_png(tmp_path, monkeypatch, capsys):
    """The rates plot-lr draws are those transformers' cosine-with-warmup schedule gives at every step (the
    factory the HF Trainer calls, reached here through the specific function, not get_scheduler)."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    raw = yaml.safe_load(TINY_PARAMS)  # sft: cosine, lr 1e-3, warmup 2, 12 steps
    params = parse_params(raw)
    rates = lr_schedule(params, "sft")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    reference = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=12)
    expected = [1e-3 * reference.lr_lambdas[0](k) for k in range(12)]
    assert len(rates) == 12
    for step in (0, 1, 2, 5, 11):  # warmup start, warmup, peak, decay, last
        assert rates[step] == pytest.approx(expected[step], rel=1e-9, abs=1e-15), step
    assert rates[2] == pytest.approx(1e-3) and rates[0] == 0.0

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["plot-lr", "--task", "sft", "--out", "lr.png"]) == 0
    with Image.open(tmp_path / "lr.png") as png:
        assert png.format == "PNG" and png.size[0] > 400
    assert "highest 0.001 at step 3" in capsys.readouterr().out


def test_plot_lr_needs_a_step_count_for_an_epoch_budget(tmp_path, monkeypatch, capsys):
    raw = yaml.safe_load(TINY_PARAMS)
    raw["sft"]["max_steps"] = -1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["plot-lr", "--task", "sft"]) == 2
    assert "--steps N" in capsys.readouterr().err and not (tmp_path / "lr-sft.png").exists()
    assert main(["plot-lr", "--task", "sft", "--steps", "30"]) == 0
    assert (tmp_path / "lr-sft.png").exists()
