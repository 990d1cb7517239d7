"""Run lm-eval's `simple_evaluate` on a saved model directory and flatten its results.

The model and tokenizer are loaded by llmpipe's loaders (`llmpipe.models`: safe loading, a pointer to
``model.init_from`` resolved, ``model.attn_implementation``) and handed to lm-eval's `HFLM`; a full folder loads the
weights ``lm_eval --model hf --model_args pretrained=models/<name>`` would.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from llmpipe.config import EvalParams
from llmpipe.core.errors import UserError
from llmpipe.evaluation.options import evaluate_kwargs, option_groups
from llmpipe.evaluation.tasks import LOCAL_TASKS

log = logging.getLogger(__name__)

SEED = 1234
"""Seed of Python, NumPy and torch inside lm-eval (and of few-shot sampling for standard tasks)."""

BOOTSTRAP_ITERS = 1000
"""Bootstrap resamples for the stderr of metrics without a closed form (lm-eval's default is 100,000)."""

NUM_ANSWERS = 8
"""Greedy answers kept per generation task, first documents first, for the report's side-by-side table."""


def check_llmpipe_names(names: Sequence[str]) -> None:
    """Refuse an ``llmpipe_*`` name that is not one of our tasks (a typo; lm-eval would not know it either).

    Raises:
        UserError: Names the key ``eval.tasks``, the unknown name and the llmpipe tasks.
    """
    bad = [n for n in names if n.startswith("llmpipe_") and n not in LOCAL_TASKS]
    if bad:
        raise UserError(f"eval.tasks: unknown llmpipe task(s) {', '.join(bad)}; llmpipe tasks are "
                        f"{', '.join(LOCAL_TASKS)}")


def task_manager(names: Sequence[str], include_path: str | Path):
    """An lm-eval `TaskManager` that knows the rendered tasks in `include_path` and, only when `names`
    asks for a task that is not ours, lm-eval's built-in tasks (indexing those takes about 8 s).

    Raises:
        UserError: A name is neither a rendered llmpipe task nor an lm-eval task; names the key ``eval.tasks``.
    """
    from lm_eval.tasks import TaskManager

    standard = any(n not in LOCAL_TASKS for n in names)
    with quiet_lm_eval():
        manager = TaskManager(include_path=str(include_path), include_defaults=standard)
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(
            f"eval.tasks: lm-eval knows no task {', '.join(unknown)}; use llmpipe tasks ({', '.join(LOCAL_TASKS)}) "
            "or lm-eval task names (`lm_eval ls tasks`; offline, their datasets must already be in the HF cache)"
        )
    return manager


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Show only lm-eval's warnings and errors while the block runs (it logs every step at INFO)."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def context_length(model_dir: Path, requested: int) -> int:
    """`requested` tokens, capped at the model's ``max_position_embeddings`` (RoPE beyond it is untrained)."""
    from llmpipe.models.folders import model_config

    config = model_config(model_dir)
    limit = config.get("max_position_embeddings") or requested
    if requested > limit:
        log.warning("eval.max_length %d exceeds %s's max_position_embeddings %d; scoring with %d",
                    requested, model_dir, limit, limit)
    return min(requested, limit)


def evaluate(
    model_dir: str | Path, names: Sequence[str], manager, cfg: EvalParams, trust_remote_code: bool = False,
    attn_implementation: str | None = None, answers_to: list[dict[str, str]] | None = None,
) -> dict[str, float]:
    """Evaluate the model in `model_dir` on the tasks `names` with lm-eval.

    Args:
        model_dir: A Hugging Face model directory (weights, config, tokenizer), or a pointer to
            ``model.init_from`` with the tokenizer beside it.
        names: Task names `manager` knows.
        manager: From :func:`task_manager`.
        cfg: ``eval`` params: `limit` documents per task, `batch_size`, `max_length` in tokens, and
            `task_options` (tasks with different options are evaluated in separate `simple_evaluate` calls).
        trust_remote_code: Let pickled weights and ``auto_map`` code load (`llmpipe.models`).
        attn_implementation: ``model.attn_implementation``.
        answers_to: A list that the first :data:`NUM_ANSWERS` greedy answers of each llmpipe generation task are
            appended to (:func:`first_answers`); None keeps none.

    Returns:
        ``{"<task>.<metric>": value}``, with ``<task>.<metric>_stderr`` where lm-eval computes one and
        ``<task>.num_docs`` (documents scored), see :func:`flatten`; and ``num_truncated_requests``: lm-eval
        requests (one per document and choice) whose input was longer than the context and was cut from the
        left to fit (`counting.CountingHFLM`), over all tasks; logged as a warning when not 0.
    """
    import torch
    import tqdm
    from lm_eval import simple_evaluate
    from lm_eval.api import model as api_model
    from lm_eval.api import task as api_task
    from lm_eval.models import huggingface

    from llmpipe.core.lines import lines_in
    from llmpipe.evaluation.counting import CountingHFLM
    from llmpipe.models import load_model, load_tokenizer

    model_dir = Path(model_dir)
    missing = "run the stage that makes it first"
    model = load_model(model_dir, missing, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation)
    model.to(device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float32).eval()
    # lm-eval's loops (requests, contexts, tokenising, bootstrap) draw tqdm bars and offer no progress hook: in a
    # log they become plain lines.
    with contextlib.ExitStack() as bars:
        bars.enter_context(quiet_lm_eval())
        for module in (huggingface, api_model, api_task, tqdm):  # tqdm itself: lm-eval's bootstrap imports it late
            bars.enter_context(lines_in(module, f"evaluate {model_dir.name}", unit="requests"))
        lm = CountingHFLM(
            pretrained=model,
            tokenizer=load_tokenizer(model_dir, trust_remote_code, missing),
            batch_size=cfg.batch_size,
            max_length=context_length(model_dir, cfg.max_length),
        )
        metrics: dict[str, float] = {}
        for options, group in option_groups(names, cfg.task_options):
            results = simple_evaluate(
                model=lm,
                tasks=group,
                limit=cfg.limit,
                task_manager=manager,
                log_samples=answers_to is not None,
                bootstrap_iters=BOOTSTRAP_ITERS,
                random_seed=SEED,
                numpy_random_seed=SEED,
                torch_random_seed=SEED,
                fewshot_random_seed=SEED,
                **evaluate_kwargs(options),
            )
            metrics |= flatten(results)
            if answers_to is not None:
                answers_to += first_answers(results)
    if lm.num_truncated:
        log.warning("%s: %d lm-eval requests of tasks %s were longer than %d tokens and cut from the left to fit "
                    "(their scores are of cut inputs); raise eval.max_length (up to the model's "
                    "max_position_embeddings) or leave such tasks out", model_dir, lm.num_truncated,
                    ", ".join(names), lm.max_length)
    return {**metrics, "num_truncated_requests": float(lm.num_truncated)}


def answers_path(params: Any, model: str) -> Path:
    """``<paths.logs>/evaluate/<model>/answers.jsonl``: the evaluate stage's first greedy answers of the generation
    task (:func:`first_answers`), which the report shows side by side."""
    return params.paths.out(params.paths.logs, "evaluate", model, "answers.jsonl")


def first_answers(results: dict[str, Any], limit: int = NUM_ANSWERS) -> list[dict[str, str]]:
    """``{"task", "prompt", "answer"}`` of the first `limit` documents of each llmpipe ``generate_until`` task in
    lm-eval's logged samples (``log_samples=True``): ``prompt`` is the prompt turns' text, ``answer`` the greedy
    completion up to the stop string."""
    out = []
    for task, samples in results.get("samples", {}).items():
        if task not in LOCAL_TASKS or LOCAL_TASKS[task].output_type != "generate_until":
            continue
        for example in sorted(samples, key=lambda e: e["doc_id"])[:limit]:
            answer = example["filtered_resps"][0]  # one request per document
            out.append({"task": task, "prompt": example["doc"]["prompt"],
                        "answer": answer[0] if isinstance(answer, list) else answer})  # fmt: skip
    return out


def flatten(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's nested results → ``{"<task>.<metric>": float}``.

    lm-eval keys metrics ``"<metric>,<filter>"``; the filter is dropped when it is ``none`` (every
    loglikelihood task) and kept as ``<metric>.<filter>`` otherwise. Non-numeric entries (aliases, ``"N/A"``
    stderrs) and non-finite stderrs are left out. ``<task>.num_fewshot`` is lm-eval's own record of the
    few-shot count it used, when not 0.
    """
    out: dict[str, float] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if not filter_name or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if metric.endswith("_stderr") and not math.isfinite(value):
                continue
            out[f"{task}.{metric if filter_name == 'none' else f'{metric}.{filter_name}'}"] = float(value)
        samples = results.get("n-samples", {}).get(task)
        if samples:
            out[f"{task}.num_docs"] = float(samples["effective"])
        shots = results.get("n-shot", {}).get(task)
        if shots:
            out[f"{task}.num_fewshot"] = float(shots)
    return out
