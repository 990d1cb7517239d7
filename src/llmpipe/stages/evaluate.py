"""`evaluate` stage: lm-evaluation-harness on one model directory (``llm-train --task evaluate --model NAME``).

Reads ``<paths.models>/<model>/`` and ``<paths.data>/eval/``; renders llmpipe's tasks that apply to the data
(`llmpipe.evaluation.tasks.tasks_for`: no Python-code task on users' own data) in that model's own chat format, and
lm-eval's own tasks with a local copy of their data (``eval.task_data``: `llmpipe.evaluation.standard`) as YAMLs that
read it, into a temporary folder (removed at the end; ``llm-train eval-tasks --out DIR`` writes the same into DIR
for ``lm_eval --include_path DIR``), writes the first greedy answers of its generation task to
``<paths.logs>/evaluate/<model>/answers.jsonl`` (the report shows them side by side) and returns the flat metrics,
which the CLI writes to ``<paths.metrics>/eval/<model>.json``. DVC runs it as a matrix stage over ``eval.models``.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import EvalParams, Params
from llmpipe.config.stages import REGISTRY
from llmpipe.core.errors import UserError
from llmpipe.core.io import write_jsonl
from llmpipe.evaluation import harness, standard
from llmpipe.evaluation.options import check_fewshot
from llmpipe.evaluation.tasks import LOCAL_TASKS, render_tasks, tasks_for
from llmpipe.models import check_model_dir, load_tokenizer

log = logging.getLogger(__name__)


def model_dir(params: Params, model: str, trust_remote_code: bool = False) -> Path:
    """The directory of `model` (or a pointer to ``model.init_from``), checked (`llmpipe.models.check_model_dir`).

    Raises:
        UserError: `model` is not in ``eval.models``, or its directory holds no model yet or is refused
            (pickled weights or ``auto_map`` code without `trust_remote_code`).
    """
    if model not in params.eval.models:
        raise UserError(f"--model {model}: not in eval.models ({', '.join(params.eval.models)}); "
                        "pick one of those or add it to eval.models in params.yaml")
    path = Path(params.paths.models, model)
    made_by = (f"run the stage that makes it first (dvc repro {model})" if model in REGISTRY else
               "no stage makes it: save a model there (save_pretrained: config, weights, tokenizer)")  # fmt: skip
    check_model_dir(path, made_by, trust_remote_code)
    return path


def longer_context(task: str, cfg: EvalParams, max_length: int) -> str:
    """What to change so that `task`'s documents fit the `max_length`-token evaluation context: ``eval.max_length``,
    or, when the model's ``max_position_embeddings`` capped it below that, the model's context (a retrain); and
    for the generation task, which must fit ``eval.max_new_tokens`` as well, that key."""
    if max_length < cfg.max_length:
        fix = (f"the model's max_position_embeddings ({max_length}) caps eval.max_length ({cfg.max_length}): "
               "train it with a longer model.max_position_embeddings")
    else:
        fix = f"raise eval.max_length (now {cfg.max_length})"
    if LOCAL_TASKS[task].output_type == "generate_until":
        fix += f", or lower eval.max_new_tokens (now {cfg.max_new_tokens}, counted in the context)"
    return fix


@dataclass
class Prepared:
    """The tasks of one model's evaluation, written into a work folder (:func:`prepare`).

    Attributes:
        path: The model directory.
        names: The tasks to evaluate (llmpipe tasks with documents, and standard lm-eval tasks), in order.
        metrics: ``<task>.num_docs`` (0) of the llmpipe tasks skipped and ``<task>.num_too_long`` of each.
        manager: The lm-eval `TaskManager` that knows them (None when no task is left).
        max_length: The evaluation context in tokens: ``eval.max_length`` capped at the model's.
    """

    path: Path
    names: list[str]
    metrics: dict[str, float]
    manager: Any
    max_length: int


def prepare(params: Params, model: str, work: str | Path, trust_remote_code: bool = False) -> Prepared:
    """Write the task YAMLs and data of `model`'s evaluation into `work`, and check them, without loading the model:
    llmpipe's tasks rendered in its chat format, standard tasks redirected to their local copies
    (`llmpipe.evaluation.standard`), every standard task's data loaded, few-shot counts checked.

    ``llm-train eval-tasks`` writes the same into a folder of the user's (``lm_eval --include_path``).

    Raises:
        UserError: See :func:`run`.
    """
    path = model_dir(params, model, trust_remote_code)
    harness.check_llmpipe_names(params.eval.tasks)
    tasks = tasks_for(params.eval.tasks, params.data.source == "stdlib")
    if left := [t for t in dict.fromkeys(params.eval.tasks) if t not in tasks]:
        log.info("data.source %s: %s grade(s) Python functions of the stdlib corpus: evaluating %s instead",
                 params.data.source, ", ".join(left), ", ".join(tasks))
    tokenizer = load_tokenizer(path, trust_remote_code, what=f"rerun the {model} stage (it saves its tokenizer there)")
    max_length = harness.context_length(path, params.eval.max_length)
    counts = render_tasks(tasks, Path(params.paths.data, "eval"), tokenizer, work, max_length,
                          params.eval.max_new_tokens)  # fmt: skip
    skipped = [name for name, (n, _) in counts.items() if n == 0]
    for name, (n, too_long) in counts.items():
        if n == 0 and too_long:
            log.warning("%s: skipped (num_docs 0): all %d documents are longer than %d tokens; %s",
                        name, too_long, max_length, longer_context(name, params.eval, max_length))
        elif n == 0:
            log.warning("%s: its evaluation set is empty (this data source has none); skipped (num_docs 0)", name)
        elif too_long:
            log.warning("%s: %d documents longer than %d tokens left out (scored %d)", name, too_long, max_length, n)
    names = [name for name in tasks if name not in skipped]
    metrics = {f"{name}.num_docs": 0.0 for name in skipped}
    metrics |= {f"{name}.num_too_long": float(too_long) for name, (_, too_long) in counts.items()}
    manager = None
    if names or params.eval.task_data:
        manager = standard.prepare(harness.task_manager(names, work), names, params.eval.task_data, work)
        check_fewshot(manager, {n: o for n, o in params.eval.task_options.items() if n in names})
    return Prepared(path, names, metrics, manager, max_length)


def run(params: Params, model: str, trust_remote_code: bool = False) -> dict[str, float]:
    """Evaluate ``<paths.models>/<model>`` on ``eval.tasks``.

    Args:
        params: Validated params; reads ``paths``, ``eval``, ``model.attn_implementation`` and ``data.source``.
        model: A name in ``eval.models``.
        trust_remote_code: Load a model folder with pickled weights or ``auto_map`` code
            (``--trust-remote-code``); passed on to lm-eval's loader.

    Returns:
        ``{"<task>.<metric>": value}`` (see :func:`llmpipe.evaluation.harness.flatten`), with
        ``<task>.num_docs`` for every llmpipe task; 0 means its evaluation set was empty (e.g.
        ``llmpipe_signature_mc`` on non-stdlib data) and the task was skipped. Inputs longer than the context are
        never cut silently: ``<task>.num_too_long`` counts the llmpipe task documents left out, and
        ``num_truncated_requests`` the requests lm-eval cut to fit (standard lm-eval tasks).

    Raises:
        UserError: A bad model name, a missing model or eval set, an unknown task name in ``eval.tasks``, a
            standard task whose data is neither in ``eval.task_data`` nor in the Hugging Face cache, or a
            ``num_fewshot`` in ``eval.task_options`` a task cannot draw (all raised before the model is loaded).
    """
    answers: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory(prefix=f"llmpipe-eval-{model}-") as work:
        prep = prepare(params, model, work, trust_remote_code)
        metrics = prep.metrics
        if prep.names:
            metrics |= harness.evaluate(prep.path, prep.names, prep.manager, params.eval, trust_remote_code,
                                        params.model.attn_implementation, answers_to=answers)
    write_jsonl(harness.answers_path(params, model), answers)  # a DVC output: written, if empty, for every model
    return metrics
