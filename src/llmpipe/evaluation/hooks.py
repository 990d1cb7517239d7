"""`process_results` hooks named by the rendered task YAMLs (``!function llmpipe.evaluation.hooks.<name>``).

lm-eval imports them by dotted name, so they must stay importable and free of work at import.
"""

from __future__ import annotations

from typing import Any


def response_bits_per_byte(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, Any]:
    """Score one (context, continuation) pair of a `loglikelihood` task.

    Args:
        doc: The rendered document; ``doc["num_bytes"]`` is the UTF-8 length of the response text.
        results: lm-eval's one ``(loglikelihood in nats, is_greedy)`` for the continuation.

    Returns:
        ``bits_per_byte``: ``(loglikelihood, num_bytes)``, which lm-eval's `bits_per_byte` aggregation turns
        into ``-sum(loglikelihood) / (ln 2 * sum(num_bytes))`` over the task (lower is better); ``acc``: 1.0
        when greedy decoding would produce the continuation token for token.
    """
    loglikelihood, is_greedy = results[0]
    return {"bits_per_byte": (loglikelihood, doc["num_bytes"]), "acc": float(is_greedy)}


def generation_score(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """Score one greedy completion of a `generate_until` task with :mod:`llmpipe.rl.rewards`.

    Args:
        doc: The rendered document: ``prompt`` (def line(s) + docstring) and ``name`` (requested function).
        results: lm-eval's one generated string (up to the stop string, which is not included).

    Returns:
        ``score``: 1.0 when prompt + completion parses and defines ``name`` with a non-trivial body;
        ``parses``: 1.0 when it parses; ``trivial``: 1.0 when it parses but the body does nothing;
        ``distinct``: the completion without surrounding whitespace, for :func:`distinct_share`.
    """
    from llmpipe.rl.rewards import defines_function, is_trivial_completion, python_parses

    completion = results[0]
    return {
        "score": defines_function(doc["prompt"], completion, doc["name"]),
        "parses": python_parses(doc["prompt"], completion, doc["name"]),
        "trivial": float(is_trivial_completion(doc["prompt"], completion, doc["name"])),
        "distinct": completion.strip(),
    }


def tests_pass(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Score one greedy body of the `llmpipe_tasks` task by running it against the task's tests in the sandbox.

    Args:
        doc: The rendered document: ``prompt`` (def line and docstring) and ``tests`` (statements).
        results: lm-eval's one generated string (up to the stop string, which is not included).

    Returns:
        ``pass_at_1``: 1.0 when every test passed; ``tests_pass``: the share of tests passed; ``distinct``: the
        body without surrounding whitespace, for :func:`distinct_share`.
    """
    from llmpipe.core.sandbox import run_program
    from llmpipe.data.tasks.records import program_of

    outcome = run_program(program_of(doc["prompt"], results[0]), doc["tests"])
    return {"pass_at_1": float(outcome.total > 0 and outcome.passed == outcome.total),
            "tests_pass": outcome.fraction, "distinct": results[0].strip()}


def answer_score(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    """Score one greedy answer to a held-out prompt of users' own data (the `llmpipe_answers` task).

    Args:
        doc: The rendered document: ``reference`` (the held-out response).
        results: lm-eval's one generated string (up to the stop string, which is not included).

    Returns:
        ``exact``: 1.0 when the answer is the reference, surrounding whitespace aside; ``distinct``: the answer
        without surrounding whitespace, for :func:`distinct_share`.
    """
    answer = results[0].strip()
    return {"exact": float(answer == doc["reference"].strip()), "distinct": answer}


def distinct_share(completions: list[str]) -> float:
    """lm-eval aggregation: distinct completions / completions (1.0 when every prompt got its own body; 1/N
    when a policy writes one body for all N prompts, the mode collapse a verifiable reward invites)."""
    return len(set(completions)) / len(completions) if completions else 0.0


def preference_accuracy(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, float]:
    """Score one (chosen, rejected) pair of the `multiple_choice` preference task, overall and by corruption.

    Args:
        doc: The rendered document: ``choices`` = [chosen, rejected] texts, ``label`` (0), ``corruption``.
        results: lm-eval's ``(loglikelihood in nats, is_greedy)`` per choice.

    Returns:
        ``acc`` (summed loglikelihood picks the label) and ``acc_norm`` (loglikelihood per character, as
        lm-eval's own acc_norm), and the same under ``acc_<corruption>``/``acc_norm_<corruption>`` when the
        pair has a corruption type; lm-eval averages each key over the documents that report it.
    """
    lls = [ll for ll, _ in results]
    norm = [ll / max(len(choice), 1) for ll, choice in zip(lls, doc["choices"])]
    acc = float(max(range(len(lls)), key=lls.__getitem__) == doc["label"])
    acc_norm = float(max(range(len(norm)), key=norm.__getitem__) == doc["label"])
    out = {"acc": acc, "acc_norm": acc_norm}
    if doc.get("corruption") not in (None, "none"):  # users' pairs carry "none": no type to break down by
        out |= {f"acc_{doc['corruption']}": acc, f"acc_norm_{doc['corruption']}": acc_norm}
    return out
