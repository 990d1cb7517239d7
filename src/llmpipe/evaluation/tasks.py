"""llmpipe's own lm-eval tasks, rendered at evaluation time from ``<paths.data>/eval/`` for one model.

Each task's documents are rendered with the evaluated model's own tokenizer (its chat template and eos token)
into a work folder, next to a task YAML that points at them by absolute path (lm-eval resolves a relative
``data_files`` path against the current directory, not the YAML's folder). `lm_eval --include_path <folder>`
then runs them like any built-in task.

Scoring follows lm-eval's request types (Gao et al., "A framework for few-shot language model evaluation"):
``loglikelihood_rolling`` for perplexity, ``loglikelihood`` (context, continuation) for response loss and
``multiple_choice`` (one loglikelihood per choice) for accuracy, and ``generate_until`` (greedy decoding up to
the model's eos) for the generation tasks, scored by :mod:`llmpipe.rl.rewards` (stdlib functions) or against the
held-out response (users' data, :func:`tasks_for`). lm-eval moves trailing whitespace of a
context into its continuation before tokenising, so the newline that closes a rendered prompt is scored as
the first character of the answer; every choice of a task gets the same newline, which keeps them comparable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from llmpipe.core.errors import UserError
from llmpipe.core.io import read_jsonl, write_jsonl
from llmpipe.data.corrupt import CORRUPTIONS
from llmpipe.evaluation.documents import (
    Row,
    eos_text,
    render_answers,
    render_generation,
    render_perplexity,
    render_preference,
    render_sft_chat,
    render_sft_plain,
    render_signature_mc,
    render_task,
)


class FunctionRef(str):
    """A dotted name written into a task YAML as ``!function <name>``, which lm-eval imports (hooks, aggregations)."""


class _TaskDumper(yaml.SafeDumper):
    pass


_TaskDumper.add_representer(FunctionRef, lambda dumper, ref: dumper.represent_scalar("!function", str(ref)))


@dataclass(frozen=True)
class Metric:
    """One metric a task reports.

    Attributes:
        name: lm-eval metric name (the key in the results).
        aggregation: lm-eval aggregation over documents (`mean`, `bits_per_byte`, `weighted_perplexity`), or a
            `FunctionRef` to one of :mod:`llmpipe.evaluation.hooks`.
        higher_is_better: Direction of improvement.
    """

    name: str
    aggregation: str
    higher_is_better: bool


@dataclass(frozen=True)
class LocalTask:
    """An llmpipe task: where its data comes from, how a row becomes an lm-eval document, what it reports.

    Attributes:
        name: Task name (as in ``eval.tasks``).
        source: File name under ``<paths.data>/eval/``.
        output_type: lm-eval output type.
        measures: One sentence for the report: what a better score means.
        metrics: Reported metrics.
        render: ``(row, tokenizer) -> document``; the document has the fields the YAML names.
        fields: YAML keys mapping document fields to lm-eval (`doc_to_text`, `doc_to_target`, …).
        process_results: Dotted name of a `process_results` hook, or None for lm-eval's own scoring.
        data: Which data it fits: ``stdlib`` (the embedded corpus only: it scores Python code), or ``any``.
        measures_own: The sentence for users' own data (``data.source`` other than stdlib), where `measures`
            speaks of functions and modules.
    """

    name: str
    source: str
    output_type: str
    measures: str
    metrics: tuple[Metric, ...]
    render: Callable[[Row, Any], Row]
    fields: dict[str, str]
    process_results: str | None = None
    data: Literal["stdlib", "any"] = "any"
    measures_own: str | None = None

    def description(self, stdlib: bool) -> str:
        """What a better score means, in the words of the data: `measures`, or `measures_own` on users' data."""
        return self.measures if stdlib or self.measures_own is None else self.measures_own


ACC = Metric("acc", "mean", True)
ACC_NORM = Metric("acc_norm", "mean", True)
BITS_PER_BYTE = Metric("bits_per_byte", "bits_per_byte", False)
MC_FIELDS = {"doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label"}
LOGLIK_FIELDS = {"doc_to_text": "context", "doc_to_target": "continuation"}
RESPONSE_HOOK = "llmpipe.evaluation.hooks.response_bits_per_byte"

LOCAL_TASKS: dict[str, LocalTask] = {
    t.name: t
    for t in (
        LocalTask(
            "llmpipe_perplexity",
            "perplexity.jsonl",
            "loglikelihood_rolling",
            "How well the model predicts held-out module sources, whole (bits per UTF-8 byte, and perplexity "
            "per byte and per whitespace-separated word).",
            (
                BITS_PER_BYTE,
                Metric("byte_perplexity", "weighted_perplexity", False),
                Metric("word_perplexity", "weighted_perplexity", False),
            ),
            render_perplexity,
            {"doc_to_text": "", "doc_to_target": "text"},
            measures_own="How well the model predicts held-out documents of the pretraining text, whole (bits per "
            "UTF-8 byte, and perplexity per byte and per whitespace-separated word); empty without pretraining text.",
        ),
        LocalTask(
            "llmpipe_signature_mc",
            "signature_mc.jsonl",
            "multiple_choice",
            "Given a held-out function's docstring, does the model find its `def` line among four (chance 0.25)? "
            "acc: summed loglikelihood; acc_norm: per character.",
            (ACC, ACC_NORM),
            render_signature_mc,
            MC_FIELDS,
            data="stdlib",
        ),
        LocalTask(
            "llmpipe_sft_chat",
            "sft.jsonl",
            "loglikelihood",
            "Loss on held-out function bodies given signature + docstring in the chat format (bits per UTF-8 byte "
            "of the body, the eos that ends the turn included); acc: fraction of answers the model would produce "
            "greedily, token for token.",
            (BITS_PER_BYTE, ACC),
            render_sft_chat,
            LOGLIK_FIELDS,
            RESPONSE_HOOK,
            measures_own="Loss on the held-out SFT responses given their prompt in the chat format (bits per UTF-8 "
            "byte of the response, the eos that ends the turn included); acc: fraction of responses the model would "
            "produce greedily, token for token.",
        ),
        LocalTask(
            "llmpipe_sft_plain",
            "sft.jsonl",
            "loglikelihood",
            "The same pairs as llmpipe_sft_chat as plain text (prompt, newline, body; no chat tokens, no eos): "
            "what the chat format adds or costs.",
            (BITS_PER_BYTE, ACC),
            render_sft_plain,
            LOGLIK_FIELDS,
            RESPONSE_HOOK,
            measures_own="The same pairs as llmpipe_sft_chat as plain text (prompt, newline, response; no chat "
            "tokens, no eos): what the chat format adds or costs.",
        ),
        LocalTask(
            "llmpipe_preference",
            "preference.jsonl",
            "multiple_choice",
            "Does the model give the real body (chosen) a higher likelihood than a corrupted one (rejected: another "
            "function's body, its first half, or one token deleted), after the chat prompt? acc: summed "
            "loglikelihood; acc_norm: per character, which is the fair comparison when lengths differ (a first "
            "half is a prefix of the real body, so its summed loglikelihood is almost always higher: acc on "
            "truncate stays near 0 for any model). _<type>: the same on one corruption type.",
            (ACC, ACC_NORM, *(Metric(f"{m}_{kind}", "mean", True) for m in ("acc", "acc_norm") for kind in CORRUPTIONS)),
            render_preference,
            MC_FIELDS,
            "llmpipe.evaluation.hooks.preference_accuracy",
            measures_own="Does the model give the chosen response of a held-out pair a higher likelihood than the "
            "rejected one, after the chat prompt? acc: summed loglikelihood; acc_norm: per character (the fair "
            "comparison when the two differ in length).",
        ),
        LocalTask(
            "llmpipe_generation",
            "sft.jsonl",
            "generate_until",
            "Given a held-out function's signature and docstring in the chat format, the model writes the body "
            "(greedy, up to eval.max_new_tokens): score is the share of signature + body that parses and defines "
            "the requested function with a non-trivial body; parses: share that parses; trivial: share whose "
            "body does nothing (pass, ..., a bare name), and distinct: share of distinct bodies (a policy that "
            "writes one body for every prompt scores near 0): the reward-hacking checks.",
            (
                Metric("score", "mean", True),
                Metric("parses", "mean", True),
                Metric("trivial", "mean", False),
                Metric("distinct", FunctionRef("llmpipe.evaluation.hooks.distinct_share"), True),
            ),
            render_generation,
            {"doc_to_text": "context", "doc_to_target": "name"},
            "llmpipe.evaluation.hooks.generation_score",
            data="stdlib",
        ),
        LocalTask(
            "llmpipe_tasks",
            "tasks.jsonl",
            "generate_until",
            "Given a held-out executable task's prompt in the chat format (on the default data, an operation pair "
            "never seen in training), the model writes its code (greedy, up to eval.max_new_tokens), run against the "
            "task's hidden tests in a sandboxed process: pass_at_1: share of tasks whose answer passes every test; "
            "tests_pass: mean share of each task's tests passed; distinct: share of distinct answers.",
            (
                Metric("pass_at_1", "mean", True),
                Metric("tests_pass", "mean", True),
                Metric("distinct", FunctionRef("llmpipe.evaluation.hooks.distinct_share"), True),
            ),
            render_task,
            {"doc_to_text": "context", "doc_to_target": "name"},
            "llmpipe.evaluation.hooks.tests_pass",
        ),
        LocalTask(
            "llmpipe_answers",
            "sft.jsonl",
            "generate_until",
            "The model answers the held-out SFT prompts in the chat format (greedy, up to eval.max_new_tokens; the "
            "report shows the first answers side by side): exact: share equal to the held-out response (surrounding "
            "whitespace aside); distinct: share of distinct answers (one answer for every prompt scores near 0).",
            (Metric("exact", "mean", True), Metric("distinct", FunctionRef("llmpipe.evaluation.hooks.distinct_share"),
                                                  True)),
            render_answers,
            {"doc_to_text": "context", "doc_to_target": "reference"},
            "llmpipe.evaluation.hooks.answer_score",
        ),
    )
}
"""llmpipe's tasks by name; any other name in ``eval.tasks`` is a standard lm-eval task."""

OWN_DATA_TASKS = {"llmpipe_generation": "llmpipe_answers"}
"""The task that takes a stdlib-only task's place on users' own data (``data.source`` other than stdlib); a
stdlib-only task not named here is left out there."""


def tasks_for(names: Iterable[str], stdlib: bool) -> list[str]:
    """``eval.tasks`` as they apply to the data: all of them on the stdlib; on users' data each stdlib-only task
    replaced by its :data:`OWN_DATA_TASKS` counterpart, or left out (no Python-code task grades a chat fine-tune).
    Each name once, in order."""
    out = []
    for name in names:
        task = LOCAL_TASKS.get(name)
        if not stdlib and task is not None and task.data == "stdlib":
            name = OWN_DATA_TASKS.get(name)
        if name is not None:
            out.append(name)
    return list(dict.fromkeys(out))


def task_config(task: LocalTask, data_file: Path, cache_dir: Path, generation: dict[str, Any] | None = None) -> str:
    """The lm-eval task YAML of `task`, reading the rendered `data_file`.

    Args:
        task: The task.
        data_file: Rendered documents (jsonl); written into the YAML as an absolute path.
        cache_dir: Where `datasets` keeps its Arrow cache of that file (absolute).
        generation: lm-eval ``generation_kwargs`` of a ``generate_until`` task (stop strings, max tokens).

    Returns:
        YAML text; ``process_results`` and hook aggregations are ``!function`` references lm-eval imports by
        dotted name.
    """
    config: dict[str, Any] = {
        "task": task.name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_file.resolve())}, "cache_dir": str(cache_dir.resolve())},
        "test_split": "test",
        "output_type": task.output_type,
        **task.fields,
        "target_delimiter": "",
        "metric_list": [
            {"metric": m.name, "aggregation": m.aggregation, "higher_is_better": m.higher_is_better}
            for m in task.metrics
        ],
        "metadata": {"version": 1.0},
    }
    if generation is not None:
        config["generation_kwargs"] = generation
    if task.process_results:
        config["process_results"] = FunctionRef(task.process_results)
    return yaml.dump(config, Dumper=_TaskDumper, sort_keys=False, allow_unicode=True)


def render_documents(task: LocalTask, rows: Iterable[Row], tokenizer, source: Path) -> list[Row]:
    """Render every row of `source` into an lm-eval document of `task`.

    Raises:
        UserError: A row does not have the shape `prepare` writes (names the file and row).
    """
    docs = []
    for i, row in enumerate(rows, 1):
        try:
            docs.append(task.render(row, tokenizer))
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise UserError(
                f"{source}: row {i} does not fit task {task.name} ({type(err).__name__}: {err}); "
                "rebuild the evaluation sets with the prepare stage (dvc repro prepare)"
            ) from None
    return docs


def fits(doc: Row, task: LocalTask, tokenizer, max_length: int, max_new_tokens: int) -> bool:
    """Whether context + every continuation of `doc` (or + `max_new_tokens` for a generation task) fits in
    `max_length` tokens.

    lm-eval would otherwise cut the context from the left without a word (and fail on a continuation longer
    than the window). Rolling-loglikelihood documents always fit: they are scored in windows.
    """
    if task.output_type == "loglikelihood_rolling":
        return True
    n_context = len(tokenizer(doc["context"], add_special_tokens=False)["input_ids"])
    if task.output_type == "generate_until":
        return n_context + max_new_tokens <= max_length
    answers = doc["choices"] if task.output_type == "multiple_choice" else [doc["continuation"]]
    return all(n_context + len(tokenizer(a, add_special_tokens=False)["input_ids"]) <= max_length for a in answers)


def render_tasks(
    names: Iterable[str], eval_dir: str | Path, tokenizer, work_dir: str | Path, max_length: int, max_new_tokens: int
) -> dict[str, tuple[int, int]]:
    """Write ``<task>.jsonl`` and ``<task>.yaml`` into `work_dir` for each llmpipe task in `names`.

    A task whose source file is empty gets no files (lm-eval cannot load an empty dataset); its count is 0.
    Documents longer than `max_length` tokens are left out and counted, never truncated silently.
    Names that are not llmpipe tasks are ignored (they are standard lm-eval tasks).

    Args:
        names: Task names (``eval.tasks``).
        eval_dir: ``<paths.data>/eval``, as written by the prepare stage.
        tokenizer: The evaluated model's tokenizer (chat template, eos token).
        work_dir: Folder to write into; pass it to lm-eval as ``include_path``.
        max_length: The evaluation context in tokens.
        max_new_tokens: Tokens a generation task may generate (greedy, stopping at the model's eos).

    Returns:
        ``(documents rendered, documents left out as too long)`` per llmpipe task.

    Raises:
        UserError: A source file is missing or malformed.
    """
    eval_dir, work_dir = Path(eval_dir), Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in dict.fromkeys(names):
        task = LOCAL_TASKS.get(name)
        if task is None:
            continue
        source = eval_dir / task.source
        if not source.exists():
            raise UserError(f"{source}: missing (needed by eval.tasks entry {name}); run the prepare stage first "
                            "(dvc repro prepare)")
        try:
            rows = read_jsonl(source)
        except ValueError as err:
            raise UserError(str(err)) from None
        rendered = render_documents(task, rows, tokenizer, source)
        docs = [doc for doc in rendered if fits(doc, task, tokenizer, max_length, max_new_tokens)]
        counts[name] = (len(docs), len(rendered) - len(docs))
        if docs:
            data_file = work_dir / f"{name}.jsonl"
            write_jsonl(data_file, docs)
            generation = None
            if task.output_type == "generate_until":
                generation = {"until": [eos_text(tokenizer)], "max_gen_toks": max_new_tokens, "do_sample": False}
            (work_dir / f"{name}.yaml").write_text(task_config(task, data_file, work_dir / "hf_cache", generation))
    return counts
