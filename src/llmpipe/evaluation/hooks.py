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
