"""lm-eval options per task (`eval.task_options`): the tasks grouped into one `simple_evaluate` call per set of
options, and the few-shot counts checked against each task's few-shot pool before the model is loaded.

`simple_evaluate` takes `num_fewshot`, `apply_chat_template`, `fewshot_as_multiturn` and `gen_kwargs` for all
its tasks at once, so tasks that differ are evaluated in separate calls on the one loaded model; lm-eval applies
each option exactly as ``lm_eval --tasks … --num_fewshot …`` would.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from llmpipe.config import TaskOptions
from llmpipe.core.errors import UserError


def option_groups(names: Sequence[str], options: Mapping[str, TaskOptions]) -> list[tuple[TaskOptions, list[str]]]:
    """The tasks `names` grouped by their options (defaults for a task `options` does not name), in first-seen
    order: one `simple_evaluate` call each."""
    groups: dict[str, tuple[TaskOptions, list[str]]] = {}
    for name in names:
        opts = options.get(name, TaskOptions())
        groups.setdefault(json.dumps(opts.model_dump(), sort_keys=True), (opts, []))[1].append(name)
    return list(groups.values())


def evaluate_kwargs(options: TaskOptions) -> dict[str, Any]:
    """`simple_evaluate` keyword arguments of one group's options."""
    return {
        "num_fewshot": options.num_fewshot,
        "apply_chat_template": options.apply_chat_template,
        "fewshot_as_multiturn": options.fewshot_as_multiturn,
        "gen_kwargs": dict(options.gen_kwargs) or None,
    }


def cli_arguments(options: TaskOptions) -> list[str]:
    """The ``lm_eval`` command-line flags that pass `options` as :func:`evaluate_kwargs` passes them to
    `simple_evaluate` (``llm-train eval-tasks`` prints the command); none for the defaults.

    lm-eval's CLI turns ``fewshot_as_multiturn`` on with ``--apply_chat_template``, so its value is always given
    there.
    """
    args = [] if options.num_fewshot is None else ["--num_fewshot", str(options.num_fewshot)]
    if options.apply_chat_template:
        args += ["--apply_chat_template", "--fewshot_as_multiturn", str(options.fewshot_as_multiturn).lower()]
    if options.gen_kwargs:
        args += ["--gen_kwargs", *(f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                   for k, v in options.gen_kwargs.items())]  # fmt: skip
    return args


def check_fewshot(manager, options: Mapping[str, TaskOptions]) -> None:
    """Refuse a `num_fewshot` that a task cannot draw from its few-shot pool, or one lm-eval would ignore.

    lm-eval samples few-shot examples from the task's few-shot split (else training, else validation, else its
    evaluation documents, leaving out the document being scored) and fails mid-run with an assertion when the pool
    is too small; it silently keeps 0 for a task whose config fixes ``num_fewshot: 0``.

    Args:
        manager: The lm-eval `TaskManager` that knows the tasks.
        options: ``eval.task_options``.

    Raises:
        UserError: Names ``eval.task_options.<task>.num_fewshot``, the pool size and the largest count allowed.
    """
    for name, opts in options.items():
        if not opts.num_fewshot:
            continue
        key = f"eval.task_options.{name}.num_fewshot"
        for task_name, task in manager.load([name])["tasks"].items():
            if task.get_config("num_fewshot") == 0:
                raise UserError(f"{key}: task {task_name} fixes num_fewshot 0 in its config (lm-eval would ignore "
                                f"{opts.num_fewshot}); remove the option")  # fmt: skip
            pool = list(task.fewshot_docs() or [])
            evaluated = task.eval_docs
            own = len(pool) == len(evaluated) and (not pool or pool[0] == evaluated[0])  # the scored doc is left out
            most = len(pool) - 1 if own else len(pool)
            if opts.num_fewshot > most:
                source = "its evaluation documents" if own else "its few-shot split"
                raise UserError(f"{key}: {opts.num_fewshot} examples, but task {task_name} draws them from {source} "
                                f"({len(pool)} documents{', minus the one scored' if own else ''}); use at most {most}")
