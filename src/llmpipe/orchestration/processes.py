"""Stage processes of the `full-pipeline` flow: each runs in its own process group, so a cancelled run
can end the whole tree (dvc, llm-train, accelerate workers) and DVC releases its lock."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RUN_MARKER_ENV = "LLMPIPE_FLOW_RUN_ID"
"""Set on every stage process (and so inherited by its children): how a cancelled run's leftovers are found."""

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""Terminal control sequences (progress bars' cursor moves), dropped from the logged output."""

def stage_env(flow_run_id: str | None) -> dict[str, str]:
    """Environment of a stage process: this one, this interpreter's bin/ first on PATH (so `dvc` and
    `llm-train` come from the flow's environment), and the flow run's id as a marker for cleanup."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env[RUN_MARKER_ENV] = flow_run_id or ""
    return env


def run_command(
    cmd: list[str], cwd: Path, env: dict[str, str], on_line: Callable[[str], None], timeout_s: float | None = None
) -> int:
    """Run `cmd` in its own process group, passing each output line to `on_line`; return its exit code.

    Whatever interrupts the wait (cancellation raises in this thread) ends the whole process tree first.

    Args:
        cmd: The command.
        cwd: Its working directory.
        env: Its environment (:func:`stage_env`).
        on_line: Called with each line of its stdout and stderr (merged), control sequences removed.
        timeout_s: Seconds it may run; past them its process group is stopped (:func:`stop_process_group`).
            A watchdog thread does it: the wait here blocks reading the output, which a silent process never
            ends, so neither a check between lines nor Prefect's task timeout (an exception raised into this
            thread between bytecodes) would fire.

    Raises:
        TimeoutError: It ran past `timeout_s` and was stopped (its last lines have gone to `on_line`).
    """
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    timed_out = threading.Event()

    def stop_when_late() -> None:
        timed_out.set()
        stop_process_group(proc)

    watchdog = threading.Timer(timeout_s, stop_when_late) if timeout_s else None
    try:
        if watchdog:
            watchdog.start()
        assert proc.stdout is not None
        for raw in proc.stdout:
            # Progress bars redraw with \r and move the cursor: keep the last state of a line, without escapes.
            line = ANSI_ESCAPE.sub("", raw.decode(errors="replace").rstrip("\n").split("\r")[-1]).rstrip()
            if line:
                on_line(line)
        code = proc.wait()
    finally:
        if watchdog:
            watchdog.cancel()
        stop_process_group(proc)
    if timed_out.is_set():
        raise TimeoutError(f"stopped after its time limit of {timeout_s:g} s (exit code {code})")
    return code


def failure_reason(lines: Sequence[str], max_lines: int = 12) -> str:
    """What a failed stage's output says went wrong, for the flow run's state message.

    `llm-train`'s own error (``llm-train: error: …`` and its indented continuation lines: a params error lists one
    key per line) when there is one; else the exception line of the last Python traceback; else the last lines
    that are not DVC's closing ``ERROR: failed to reproduce …`` (which only repeats the exit code).

    Args:
        lines: The output's last lines, oldest first.
        max_lines: At most this many lines come back.
    """
    lines = list(lines)
    starts = [i for i, line in enumerate(lines) if line.startswith("llm-train: error:")]
    if starts:
        picked = [lines[starts[-1]]]
        picked += list(itertools.takewhile(lambda line: line.startswith((" ", "\t")), lines[starts[-1] + 1 :]))
        return "\n".join(picked[:max_lines])
    own = [line for line in lines if not line.startswith("ERROR: failed to reproduce")]
    tracebacks = [i for i, line in enumerate(own) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:
        error = next((line for line in own[tracebacks[-1] + 1 :] if not line.startswith((" ", "\t"))), None)
        if error:
            return error
    return "\n".join(own[-max_lines:]) or "(no output)"


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End every process of `proc`'s group: SIGINT (DVC then releases its locks), SIGTERM, then SIGKILL.

    Args:
        proc: A process started with `start_new_session=True` (its pid is its group id).
        grace_s: Seconds to wait after SIGINT and after SIGTERM before escalating. Generous: a DVC killed
            before its stage's process has exited leaves its rwlock behind, and on 2 busy CPU cores a trainer
            in the middle of an evaluation or a checkpoint took more than 10 s to stop.
    """
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, grace_s / 2), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and _group_alive(proc):
            time.sleep(0.1)


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reaps the leader once it exits
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc.returncode is None or _group_has_live_member(proc.pid)


def _group_has_live_member(pgid: int) -> bool:
    import psutil

    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def end_marked_processes(marker: str, grace_s: float = 10.0) -> None:
    """End every process whose environment carries ``RUN_MARKER_ENV=marker``: SIGINT, then SIGKILL.

    Covers a flow process killed before it could end its stage's process group itself.
    """
    import psutil

    leftovers = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(RUN_MARKER_ENV) == marker:
                leftovers.append(p)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGINT)
    _, alive = psutil.wait_procs(leftovers, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
