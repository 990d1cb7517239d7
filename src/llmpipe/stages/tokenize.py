"""`tokenize` stage: the pretraining text tokenised once, into ``<paths.data>/tokens/<split>/`` (raw ids and
their metadata, :mod:`llmpipe.data.tokens`), which the pretrain stage and PPO's ptx term memory-map instead of
tokenising the jsonl at every start.

Issue 7 asked for this in ``prepare``, but the pipeline tokenizer is trained on prepare's output by the
``tokenizer`` stage, so no tokenizer exists yet when prepare runs: a stage after ``tokenizer`` is the only
place the ids can be made.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from llmpipe.config import Params
from llmpipe.data.tokens import write_tokens
from llmpipe.models import load_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
"""The splits training reads; the test split only feeds the evaluation sets prepare builds from it."""


def run(params: Params, trust_remote_code: bool = False) -> dict[str, float]:
    """Tokenise ``<paths.data>/pretrain/{train,validation}.jsonl`` with the tokenizer at ``paths.tokenizer``.

    Args:
        params: Validated params; reads ``paths``.
        trust_remote_code: Let a tokenizer folder that maps to Python code load (``--trust-remote-code``).

    Returns:
        ``num_tokens_<split>`` and ``num_documents_<split>`` per split, and ``mb_per_s``: UTF-8 text in MB
        (10^6 bytes) per second of reading, tokenising and writing, over all splits.

    Raises:
        UserError: The tokenizer or a split is missing (names the stage to run).
    """
    paths = params.paths
    tokenizer = load_tokenizer(paths.tokenizer, trust_remote_code)
    out: dict[str, float] = {}
    num_text_bytes = 0
    start = time.perf_counter()
    for split in SPLITS:
        dest = paths.out(paths.data, "tokens", split)
        meta = write_tokens(Path(paths.data, "pretrain", f"{split}.jsonl"), dest, tokenizer, Path(paths.tokenizer))
        log.info("tokenize: %s: %d documents, %d %s tokens in %s", split, meta["num_documents"], meta["num_tokens"],
                 meta["dtype"], dest)  # fmt: skip
        out[f"num_tokens_{split}"] = meta["num_tokens"]
        out[f"num_documents_{split}"] = meta["num_documents"]
        num_text_bytes += meta["num_text_bytes"]
    out["mb_per_s"] = round(num_text_bytes / 1e6 / (time.perf_counter() - start), 3)
    return out
