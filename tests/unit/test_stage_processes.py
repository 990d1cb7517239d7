"""How the `full-pipeline` flow runs a stage's process, without Prefect: a time limit stops the whole process group
(SIGINT first, so a stage can stop cleanly), and a failed stage's output is reduced to the lines that say why."""

from __future__ import annotations

import os
import sys
import time

import psutil
import pytest

from llmpipe.config import parse_params
from llmpipe.config.loading import ParamsError
from llmpipe.orchestration.processes import failure_reason, run_command

# A parent that starts a child in its group; both print, then sleep; each records the SIGINT it gets.
TREE = """\
import os, pathlib, subprocess, sys, time
role = sys.argv[1]
if role == "parent":
    subprocess.Popen([sys.executable, __file__, "child"])
print(role, os.getpid(), flush=True)
try:
    time.sleep(300)
except KeyboardInterrupt:
    with pathlib.Path(role + ".stopped").open("w") as fh:
        fh.write("SIGINT")
"""


def test_a_command_past_its_time_limit_is_stopped_with_its_children(tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"stopped after its time limit of 3 s"):
        run_command([sys.executable, str(script), "parent"], tmp_path, dict(os.environ), lines.append, timeout_s=3)
    assert time.monotonic() - start < 30, "SIGINT ends both at once; no wait for SIGTERM or SIGKILL"
    assert sorted(line.split()[0] for line in lines) == ["child", "parent"], "output before the stop is kept"
    pids = [int(line.split()[1]) for line in lines]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert (tmp_path / "parent.stopped").read_text() == (tmp_path / "child.stopped").read_text() == "SIGINT"


def test_a_command_within_its_time_limit_returns_its_exit_code(tmp_path):
    lines: list[str] = []
    cmd = [sys.executable, "-c", "import sys; print('done'); sys.exit(3)"]
    assert run_command(cmd, tmp_path, dict(os.environ), lines.append, timeout_s=60) == 3
    assert lines == ["done"]


DVC_CLOSING = "ERROR: failed to reproduce 'sft': failed to run: llm-train --task sft, exited with 2"


def test_failure_reason_is_llm_trains_own_error_with_its_continuation_lines():
    output = ["Running stage 'sft':", "> llm-train --task sft", "llm-train: error: params.yaml: invalid params:",
              "  sft.lrr: unknown key; did you mean 'lr'?", "  sft.beta: unknown key", DVC_CLOSING]
    assert failure_reason(output) == ("llm-train: error: params.yaml: invalid params:\n"
                                      "  sft.lrr: unknown key; did you mean 'lr'?\n  sft.beta: unknown key")


def test_failure_reason_is_a_tracebacks_exception_line():
    output = ["Running stage 'sft':", "Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
              "    boom()", "RuntimeError: CUDA out of memory", DVC_CLOSING]
    assert failure_reason(output) == "RuntimeError: CUDA out of memory"


def test_failure_reason_is_otherwise_the_last_lines_but_dvcs_closing_one():
    assert failure_reason(["a", "b", "c", DVC_CLOSING], max_lines=2) == "b\nc"
    assert failure_reason([DVC_CLOSING]) == "(no output)"


def test_stage_time_limits_fall_back_from_stage_to_group_to_default():
    orchestration = parse_params({"orchestration": {"timeout_s": 60, "stage_timeout_s": {
        "pretrain": 3600, "evaluate": 300, "evaluate@sft": 30}}}).orchestration
    assert orchestration.stage_timeout("pretrain") == 3600
    assert orchestration.stage_timeout("evaluate@dpo") == 300 and orchestration.stage_timeout("evaluate@sft") == 30
    assert orchestration.stage_timeout("sft") == 60
    assert parse_params({}).orchestration.stage_timeout("pretrain") is None, "no limit by default"


@pytest.mark.parametrize(("limits", "message"), [
    ({"pretrian": 60}, r"orchestration\.stage_timeout_s\.pretrian: not a stage of dvc\.yaml; one of prepare, "),
    ({"pretrain": 0}, r"orchestration\.stage_timeout_s\.pretrain: 0\.0 is not a positive number of seconds"),
])  # fmt: skip
def test_a_bad_stage_time_limit_is_a_params_error(limits, message):
    with pytest.raises(ParamsError, match=message):
        parse_params({"orchestration": {"stage_timeout_s": limits}})
