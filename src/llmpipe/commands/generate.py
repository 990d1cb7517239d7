"""`llm-train generate --model DIR --prompt TEXT … [--file prompts.jsonl] [--out out.jsonl]`: answer prompts, one
jsonl line per prompt.

Prompts come from each ``--prompt`` and then each line of ``--file``: a JSON object with ``prompt`` (a string) or
``messages`` (a list of ``{role, content}`` turns); its other keys are copied to the output line. A prompt is
rendered as a user turn through the model's chat template (``--raw``, or a tokenizer without one: continued as
plain text). Each output line holds ``prompt`` or ``messages``, ``completion``, ``num_prompt_tokens``,
``num_new_tokens`` and ``stop_reason``: ``end_of_turn`` (the chat template's end-of-turn token), ``eos`` (another of
the folder's eos ids) or ``max_new_tokens`` (cut: the folder never stopped); it goes to ``--out`` (written whole, then
renamed into place) or else to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from llmpipe.commands.generation import (
    Sampling,
    add_generation_arguments,
    chat_ids,
    generate,
    load_for_generation,
    stop_ids,
    stop_reason,
)
from llmpipe.core.errors import UserError
from llmpipe.core.io import numbered_jsonl, write_jsonl

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train generate` flags: the model, sampling, the prompts and where answers go."""
    add_generation_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for more)")
    parser.add_argument("--file", type=Path, help="a jsonl file of prompts: {\"prompt\": …} or {\"messages\": […]}")
    parser.add_argument("--out", type=Path, help="write the answers here as jsonl (default: stdout)")
    parser.add_argument("--raw", action="store_true", help="continue each prompt as plain text, without the template")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")


def _check_messages(messages: Any, where: str) -> None:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    )
    if not ok:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{\"role\": …, \"content\": …}} strings")


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The rows of a prompts file, each with a string ``prompt`` or a list of ``messages``.

    Raises:
        UserError: The file is missing, a line is not UTF-8 or not a JSON object, or a row has neither a string
            ``prompt`` nor well-formed ``messages``; the message gives ``file:line``.
    """
    try:
        rows = list(numbered_jsonl(path))
    except FileNotFoundError:
        raise UserError(f"--file {path}: no such file") from None
    except ValueError as err:
        raise UserError(str(err)) from None
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        if "messages" in row:
            _check_messages(row["messages"], where)
        elif not isinstance(row.get("prompt"), str):
            raise UserError(f"{where}: expected a string 'prompt' or a 'messages' list; got keys {sorted(row)}")
    if not rows:
        raise UserError(f"--file {path}: no prompts in it (one JSON object per line)")
    return [row for _, row in rows]


def _prompt_ids(tokenizer, row: dict[str, Any], templated: bool) -> list[int]:
    if not templated:
        return tokenizer(row["prompt"])["input_ids"]
    return chat_ids(tokenizer, row.get("messages") or [{"role": "user", "content": row["prompt"]}])


def end_of_turn_id(model, tokenizer, where: Path) -> int | None:
    """The chat template's end-of-turn id (`llmpipe.data.chat_turns.end_of_turn`); a warning when the folder's eos
    ids leave it out, so its answers run on to ``--max-new-tokens``."""
    from llmpipe.data.chat_turns import end_of_turn

    eot = end_of_turn(tokenizer)
    if eot is None:
        return None
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    if eot_id not in stop_ids(model, tokenizer):
        log.warning("%s: %r ends an assistant turn in the chat template but is none of the folder's eos ids %s, so "
                    "answers run on to --max-new-tokens; train it with llmpipe's sft, which names it (its "
                    "generation_config.json eos_token_id)", where, eot, stop_ids(model, tokenizer))  # fmt: skip
    return eot_id


def answers(model, tokenizer, rows: list[dict[str, Any]], sampling: Sampling, templated: bool, batch_size: int,
            eot_id: int | None = None):  # fmt: skip
    """The output line of each prompt row, generated `batch_size` at a time, in order (`eot_id`: the end-of-turn id
    a stop there is reported as)."""
    eos = stop_ids(model, tokenizer)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [_prompt_ids(tokenizer, row, templated) for row in chunk]
        for row, ids, new in zip(chunk, prompts, generate(model, tokenizer, prompts, sampling), strict=True):
            yield {**row, "completion": tokenizer.decode(new, skip_special_tokens=True),
                   "num_prompt_tokens": len(ids), "num_new_tokens": len(new),
                   "stop_reason": stop_reason(new, eos, eot_id)}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Read every prompt (refusing bad ones before the model loads), generate, write one line per prompt.

    Raises:
        UserError: No prompt, a bad prompts file or flag, a model folder that cannot be loaded.
    """
    import transformers

    sampling = Sampling.from_args(args)
    if args.batch_size <= 0:
        raise UserError("--batch-size must be > 0")
    rows = [{"prompt": p} for p in args.prompt] + (read_prompts(args.file) if args.file else [])
    if not rows:
        raise UserError("no prompt: give --prompt TEXT (repeatable) or --file prompts.jsonl")
    if args.raw and any("messages" in row for row in rows):
        raise UserError(f"--file {args.file}: prompts given as 'messages' need the chat template; drop --raw")
    model, tokenizer = load_for_generation(args.model, args.trust_remote_code)
    templated = not args.raw and bool(tokenizer.chat_template)
    if not args.raw and not templated:
        if any("messages" in row for row in rows):
            raise UserError(f"{args.model}: its tokenizer has no chat template to render the 'messages' prompts of "
                            f"--file {args.file}; give them as 'prompt' strings")
        log.warning("%s: the tokenizer has no chat template; prompts are continued as plain text", args.model)
    transformers.set_seed(args.seed)
    eot_id = end_of_turn_id(model, tokenizer, args.model) if templated else None
    lines = answers(model, tokenizer, rows, sampling, templated, args.batch_size, eot_id)
    if args.out:
        n = write_jsonl(args.out, lines)
        print(f"{n} answers in {args.out}", file=sys.stderr)
    else:
        for line in lines:
            print(json.dumps(line, ensure_ascii=False), flush=True)
    return 0
