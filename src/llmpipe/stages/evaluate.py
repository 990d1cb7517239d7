"""`evaluate` stage: lm-evaluation-harness on one model directory (``llm-train --task evaluate --model NAME``).

Reads ``<paths.models>/<model>/`` and ``<paths.data>/eval/``; renders llmpipe's tasks in that model's own
chat format into a temporary folder (removed at the end) and returns the flat metrics, which the CLI writes
to ``<paths.metrics>/eval/<model>.json``. DVC runs it as a matrix stage over ``eval.models``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from llmpipe.config import Params
from llmpipe.errors import UserError
from llmpipe.evaluation import harness
from llmpipe.evaluation.tasks import render_tasks
from llmpipe.modeling import load_tokenizer

log = logging.getLogger(__name__)


def model_dir(params: Params, model: str) -> Path:
    """The directory of `model`, checked.

    Raises:
        UserError: `model` is not in ``eval.models``, or its directory holds no model yet.
    """
    if model not in params.eval.models:
        raise UserError(f"--model {model}: not in eval.models ({', '.join(params.eval.models)}); "
                        "pick one of those or add it to eval.models in params.yaml")
    path = Path(params.paths.models, model)
    if not (path / "config.json").exists():
        raise UserError(f"{path}: no model there; run the stage that makes it first (dvc repro {model})")
    return path


def run(params: Params, model: str) -> dict[str, float]:
    """Evaluate ``<paths.models>/<model>`` on ``eval.tasks``.

    Args:
        params: Validated params; reads ``paths`` and ``eval``.
        model: A name in ``eval.models``.

    Returns:
        ``{"<task>.<metric>": value}`` (see :func:`llmpipe.evaluation.harness.flatten`), with
        ``<task>.num_docs`` for every llmpipe task; 0 means its evaluation set was empty (e.g.
        ``llmpipe_signature_mc`` on non-stdlib data) and the task was skipped. Inputs longer than the context are
        never cut silently: ``<task>.num_too_long`` counts the llmpipe task documents left out, and
        ``num_truncated_requests`` the requests lm-eval cut to fit (standard lm-eval tasks).

    Raises:
        UserError: A bad model name, a missing model or eval set, or an unknown task name in ``eval.tasks``
            (raised before the model is loaded).
    """
    path = model_dir(params, model)
    tasks = list(dict.fromkeys(params.eval.tasks))
    harness.check_llmpipe_names(tasks)
    tokenizer = load_tokenizer(path)
    with tempfile.TemporaryDirectory(prefix=f"llmpipe-eval-{model}-") as work:
        max_length = harness.context_length(path, params.eval.max_length)
        counts = render_tasks(
            tasks, Path(params.paths.data, "eval"), tokenizer, work, max_length, params.eval.max_new_tokens
        )
        skipped = [name for name, (n, _) in counts.items() if n == 0]
        for name in skipped:
            log.warning("%s: its evaluation set is empty; skipped (num_docs 0)", name)
        for name, (n, too_long) in counts.items():
            if too_long:
                log.warning("%s: %d documents longer than %d tokens left out (scored %d)", name, too_long, max_length, n)
        names = [name for name in tasks if name not in skipped]
        metrics = {f"{name}.num_docs": 0.0 for name in skipped}
        metrics |= {f"{name}.num_too_long": float(too_long) for name, (_, too_long) in counts.items()}
        if names:
            manager = harness.task_manager(names, work)
            metrics |= harness.evaluate(path, names, manager, params.eval)
    return metrics
