"""The sandbox (llmpipe.core.sandbox) on hostile programs: each is stopped by its bound, leaves no process behind
and changes nothing outside its scratch folder; a plain body is scored test by test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmpipe.core.sandbox import Limits, Outcome, run_many, run_program

FAST = Limits(timeout_s=1.5, cpu_s=1, memory_mb=256)
TESTS = ["assert f(1) == 2", "assert f(2) == 3", "assert f(5) == 6"]


def processes_of(session: int) -> list[int]:
    """The live processes of session `session` (a sandboxed program's pid is its session id)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[3]) == session:  # after the comm: state, ppid, pgrp, session
            found.append(int(entry.name))
    return found


@pytest.fixture
def workspace(tmp_path) -> Path:
    """A folder standing for the user's project, with a file in it."""
    (tmp_path / "keep.txt").write_text("precious")
    return tmp_path


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def run(program: str, tests: list[str] = TESTS) -> Outcome:
    outcome = run_program(program, tests, FAST)
    assert processes_of(outcome.pid) == [], "the program left processes behind"
    return outcome


def test_a_body_is_scored_test_by_test():
    good = run("def f(x):\n    return x + 1\n")
    assert (good.passed, good.total, good.status, good.fraction) == (3, 3, "ok", 1.0)
    half = run("def f(x):\n    return x + 1 if x < 5 else 0\n")
    assert (half.passed, half.status) == (2, "ok")
    broken = run("def f(x)\n    return x\n")
    assert (broken.passed, broken.status) == (0, "ok")


def test_an_infinite_loop_is_killed_at_the_timeout():
    outcome = run("def f(x):\n    while True:\n        pass\n")
    assert (outcome.status, outcome.passed) == ("timeout", 0)


def test_a_program_that_ignores_alarms_and_termination_is_killed_at_the_timeout():
    program = ("try:\n    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
               "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\nexcept ImportError:\n    pass\n"
               "def f(x):\n    while True:\n        pass\n")  # fmt: skip
    assert run(program).status == "timeout"


def test_a_sleeping_program_is_killed_at_the_timeout():
    outcome = run("import time\ndef f(x):\n    time.sleep(60)\n")
    assert outcome.status == "timeout"


def test_the_tests_before_a_hang_are_counted():
    outcome = run("def f(x):\n    while x == 5:\n        pass\n    return x + 1\n")
    assert (outcome.status, outcome.passed) == ("timeout", 2)


def test_a_fork_bomb_starts_nothing_and_leaves_nothing():
    outcome = run("import os\ndef f(x):\n    while True:\n        os.fork()\n")
    assert outcome.passed == 0


def test_a_huge_allocation_fails_its_test_without_taking_the_memory():
    outcome = run("def f(x):\n    block = bytearray(8 << 30)\n    return x + 1\n")
    assert (outcome.status, outcome.passed) == ("ok", 0)


def test_printing_gigabytes_goes_nowhere():
    outcome = run("def f(x):\n    while True:\n        print('x' * 65536)\n")
    assert outcome.status == "timeout"


def test_reading_stdin_meets_its_end():
    outcome = run("def f(x):\n    return int(input()) + 1\n")
    assert (outcome.status, outcome.passed) == ("ok", 0)


def test_writing_and_deleting_outside_the_scratch_folder_changes_nothing(workspace):
    before = snapshot(workspace)
    keep, new = workspace / "keep.txt", workspace / "new.txt"
    program = (f"import os\ndef f(x):\n    open({str(new)!r}, 'w').write('x')\n    return x + 1\n"
               f"def g():\n    os.remove({str(keep)!r})\n")  # fmt: skip
    assert run(program).passed == 0
    assert run(program, ["g()"]).passed == 0
    assert run(f"import shutil\nshutil.rmtree({str(workspace)!r})\n").passed == 0
    assert snapshot(workspace) == before


def test_writing_inside_the_scratch_folder_works():
    outcome = run("def f(x):\n    open('note.txt', 'w').write(str(x))\n    return int(open('note.txt').read()) + 1\n")
    assert outcome.passed == 3


def test_os_system_runs_nothing(workspace):
    marker = workspace / "ran"
    outcome = run(f"import os\ndef f(x):\n    os.system('touch {marker}')\n    return x + 1\n")
    assert outcome.passed == 0
    assert not marker.exists()


def test_the_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("LLMPIPE_TEST_SECRET", "s3cret")
    outcome = run("import os\n", ["assert 'LLMPIPE_TEST_SECRET' not in os.environ", "assert 'HOME' not in os.environ"])
    assert outcome.passed == 2


def test_sys_exit_fails_its_test_and_the_rest_still_run():
    outcome = run("import sys\ndef f(x):\n    if x == 1:\n        sys.exit(0)\n    return x + 1\n")
    assert (outcome.status, outcome.passed) == ("ok", 2)


def test_os_exit_ends_the_run_as_a_crash():
    outcome = run("import os\ndef f(x):\n    if x == 2:\n        os._exit(0)\n    return x + 1\n")
    assert (outcome.status, outcome.passed) == ("crash", 1)


@pytest.mark.skipif(os.getuid() != 0, reason="a network namespace needs root or user namespaces")
def test_as_root_the_program_has_no_network():
    assert run("").network_isolated


def test_many_programs_keep_their_order():
    programs = [(f"def f(x):\n    return x + {k}\n", TESTS) for k in (1, 0, 1)]
    assert [o.passed for o in run_many(programs, FAST)] == [3, 0, 3]
