"""The task record, as MBPP and HumanEval shape theirs, and a user's own records (`data.local.tasks`) read and checked.

A record is ``{"prompt", "entry_point", "canonical_solution", "tests"}``: the ``def`` line(s) and docstring the
model is shown (HumanEval's ``prompt``, which may start with imports), the function's name, the reference body
(indented as under the ``def``; HumanEval's ``canonical_solution``) and the hidden tests, a list of Python
statements that each pass by raising nothing (MBPP's ``test_list``: ``assert f(2) == 5``). The program a body is
tested as is ``prompt + "\\n" + body`` (:func:`program_of`), then each test in its namespace
(:mod:`llmpipe.core.sandbox`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.core.sandbox import Limits, run_many

COLUMNS = ("prompt", "entry_point", "canonical_solution", "tests")
"""The columns every task record has."""

Task = dict[str, Any]


def program_of(prompt: str, body: str) -> str:
    """The program a body is run as: the prompt, a newline, the body (trailing whitespace dropped)."""
    return prompt.rstrip("\n") + "\n" + body.rstrip() + "\n"


def sft_row(task: Task) -> dict[str, Any]:
    """The SFT chat row of a task: the prompt as the user turn, the reference body as the answer; ``name`` and
    ``tests`` go with it, so the RL stages' rewards can run the tests."""
    return {
        "messages": [{"role": "user", "content": task["prompt"]},
                     {"role": "assistant", "content": task["canonical_solution"].rstrip()}],
        "name": task["entry_point"],
        "tests": list(task["tests"]),
        "source": task.get("source", "tasks"),
    }  # fmt: skip


def preference_row(task: Task, rejected: str, corruption: str) -> dict[str, Any]:
    """A TRL conversational preference row: the reference body chosen, a failing variant `rejected`."""
    return {
        "prompt": [{"role": "user", "content": task["prompt"]}],
        "chosen": [{"role": "assistant", "content": task["canonical_solution"].rstrip()}],
        "rejected": [{"role": "assistant", "content": rejected.rstrip()}],
        "corruption": corruption,
        "name": task["entry_point"],
        "source": task.get("source", "tasks"),
    }


def check_shape(values: dict[str, Any], where: str) -> Task:
    """One user record as a task, or a UserError naming `where` (file and row) and what to fix.

    Raises:
        UserError: A column is missing or of the wrong type, or ``tests`` is empty.
    """
    missing = [c for c in COLUMNS if values.get(c) is None]
    if missing:
        raise UserError(f"{where}: no {', '.join(missing)}; a task record has {', '.join(COLUMNS)} (docs/tasks.md)")
    for column in ("prompt", "entry_point", "canonical_solution"):
        if not isinstance(values[column], str) or not values[column].strip():
            raise UserError(f"{where}: `{column}` must be a non-empty string")
    tests = values["tests"]
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise UserError(f"{where}: `tests` must be a list of Python statements (e.g. \"assert f(2) == 5\")")
    if not tests:
        raise UserError(f"{where}: `tests` is empty: a task without tests cannot be scored; give it at least one")
    return {c: values[c] for c in COLUMNS} | {"tests": list(tests), "source": values.get("source", "tasks")}


def check_references(tasks: Sequence[Task], where: Sequence[str], limits: Limits | None = None) -> None:
    """Run every task's reference body against its tests in the sandbox; refuse the first that fails.

    Raises:
        UserError: Names the record (`where`), how many of its tests failed, and why it may be.
    """
    limits = limits or Limits()
    outcomes = run_many([(program_of(t["prompt"], t["canonical_solution"]), t["tests"]) for t in tasks], limits)
    for task, outcome, place in zip(tasks, outcomes, where):
        if outcome.passed < outcome.total:
            reason = {"timeout": f"; it ran past {limits.timeout_s:g} s", "crash": "; the process died"}.get(
                outcome.status, "")
            raise UserError(f"{place}: the reference body (canonical_solution) of {task['entry_point']} fails "
                            f"{outcome.total - outcome.passed} of its {outcome.total} tests{reason}; fix the "
                            "record or its tests")  # fmt: skip


def load_local(path: str, cache_dir: str, key: str = "data.local.tasks") -> list[Task]:
    """A user's task records (a file or folder of .jsonl, .json, .parquet or .csv), shape-checked and with every
    reference run against its tests.

    Raises:
        UserError: See :func:`llmpipe.data.files.find_files`, :func:`check_shape` and :func:`check_references`.
    """
    from llmpipe.data.files import find_files, load_rows

    files = find_files(path, key)
    rows, _ = load_rows(files, cache_dir)
    where = [row.where(files) for row in rows]
    tasks = [check_shape(row.values, place) for row, place in zip(rows, where)]
    check_references(tasks, where)
    return tasks
