"""Shapes of users' SFT and preference records, read from their columns and normalised to the one shape the
stages read (the one the stdlib corpus writes), which they render with the pipeline tokenizer's chat template.

SFT shapes (``data.local.sft_format`` / ``data.hf_sft.format``; ``auto`` reads the shape from the columns):

- ``messages``: a list of ``{role, content}`` (TRL's conversational language modeling);
- ``prompt_completion``: `prompt` and `completion`, each a string or a list of messages (TRL's prompt-completion);
- ``alpaca``: `instruction`, `output`, optional `input` (joined to the instruction by a newline), `system` and
  `history` (``[[query, response], ...]`` earlier turns), as in Alpaca and LLaMA-Factory;
- ``sharegpt``: `conversations`, a list of ``{from, value}`` (see :data:`SHAREGPT_ROLES`), optional `system`.

Preference shapes (``data.local.preference_format`` / ``data.hf_preference.format``):

- ``explicit_prompt``: `prompt`, `chosen` and `rejected`, strings or lists of messages; answers that repeat the
  prompt's turns at their start (whole conversations) lose them;
- ``implicit_prompt``: `chosen` and `rejected` as whole conversations; the prompt is the turns they share at the
  start (TRL's implicit prompt);
- ``unpaired``: `prompt`, `completion`, `label` (desirable: true/false, 1/0, "true"/"false"): TRL's, for KTO.

An SFT record becomes ``{"messages", "name", "source"}``, a pair ``{"prompt", "chosen", "rejected",
"corruption": "none", "name", "source"}``, an unpaired record ``{"prompt", "completion", "label": bool, "name",
"source"}``, with message lists (a string prompt is a user turn, a string answer an assistant turn). Roles other
than system/user/assistant (e.g. `tool`) are kept: the chat template renders them with their role, outside the
loss. Turns after an SFT conversation's last assistant turn are dropped (nothing is learned from them). A record
whose response is empty — no assistant turn, or one with only whitespace; in a pair, either answer — is left out
and counted, with a warning naming the first; every record empty is an error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmpipe.core.errors import UserError

log = logging.getLogger(__name__)

Message = dict[str, str]
Row = dict[str, Any]
Pair = tuple[list[Message], list[Message], list[Message]]
"""(prompt, chosen, rejected)."""

SFT_SHAPES: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
"""SFT shape → the columns it needs (Alpaca's `input`, `system`, `history` and ShareGPT's `system` are optional)."""

PREFERENCE_SHAPES: dict[str, tuple[str, ...]] = {
    "explicit_prompt": ("prompt", "chosen", "rejected"),
    "implicit_prompt": ("chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
"""Preference shape → the columns it needs."""

LABELS = {"true": True, "1": True, "false": False, "0": False}  # an unpaired `label` as text (any case, stripped)

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "system": "system",
    "observation": "tool",
    "function": "tool",
    "tool": "tool",
}
"""ShareGPT `from` → role. `function_call` is the model's own call (trained on, as in LLaMA-Factory);
`observation`, `function` and `tool` are what the tool answered (context, outside the loss)."""


@dataclass(frozen=True)
class Record:
    """One loaded record.

    Attributes:
        values: Column → value, as `datasets` read it.
        source: The file it came from (relative), or ``<dataset>:<split>``; written as the row's ``source``.
        name: ``<source>:<row number>``; written as the row's ``name``.
        where: ``<params key>: <file or dataset> row <n>``, for messages.
    """

    values: dict[str, Any]
    source: str
    name: str
    where: str


@dataclass(frozen=True)
class Records:
    """The SFT or preference records of one params key, before their shape is read.

    Attributes:
        key: The params key of the data, e.g. ``data.local.sft`` (for messages).
        label: The dataset in messages: the file or folder as given, or the hub name and split.
        columns: Column names.
        rows: The records in order.
        shape: The requested shape (a key of :data:`SFT_SHAPES` / :data:`PREFERENCE_SHAPES`, or ``auto``).
        shape_key: The params key of `shape`, e.g. ``data.local.sft_format``.
    """

    key: str
    label: str
    columns: list[str]
    rows: list[Record]
    shape: str
    shape_key: str


@dataclass(frozen=True)
class Normalised:
    """Rows in the internal shape, and how many records were left out for an empty response."""

    rows: list[Row]
    num_empty_responses: int


def detect_shape(kind: str, shapes: dict[str, tuple[str, ...]], records: Records) -> str:
    """The shape of `records`: the requested one if its columns are there; with ``auto``, the one whose columns are.

    When the columns of several shapes are present and one shape's columns include all the others', that one
    wins (`prompt` + `chosen` + `rejected` is ``explicit_prompt``, not ``implicit_prompt``).

    Args:
        kind: ``SFT`` or ``preference`` (for messages).
        shapes: :data:`SFT_SHAPES` or :data:`PREFERENCE_SHAPES`.
        records: The loaded records.

    Raises:
        UserError: The requested shape's columns are missing, no shape's columns are all present (names the
            missing columns of the closest shape), or several shapes fit; each lists the shapes and the columns found.
    """
    found = set(records.columns)
    listing = "; ".join(f"{name} ({_and(cols)})" for name, cols in shapes.items())
    columns = ", ".join(records.columns) or "none"
    if records.shape != "auto":
        missing = [c for c in shapes[records.shape] if c not in found]
        if missing:
            raise UserError(f"{records.key}: {records.label} has no column {_and(missing)} (found: {columns}), which "
                            f"{records.shape_key}: {records.shape} needs; the {kind} shapes are {listing}")
        return records.shape
    fits = [name for name, cols in shapes.items() if found >= set(cols)]
    fits = [a for a in fits if not any(set(shapes[a]) < set(shapes[b]) for b in fits)]
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise UserError(f"{records.key}: {records.label} fits several {kind} shapes ({', '.join(fits)}; columns "
                        f"found: {columns}); set {records.shape_key} to the one meant")
    closest = max(shapes, key=lambda name: len(found & set(shapes[name])))
    missing = [c for c in shapes[closest] if c not in found]
    what = f"has no column {_and(missing)}" if len(missing) < len(shapes[closest]) else f"has no {kind} shape"
    raise UserError(f"{records.key}: {records.label} {what} (found: {columns}); {kind} data needs the columns of one "
                    f"shape: {listing} (rename the columns, or set {records.shape_key})")


def sft_rows(records: Records) -> Normalised:
    """SFT rows ``{"messages", "name", "source"}`` from records of any shape in :data:`SFT_SHAPES`.

    Raises:
        UserError: The shape cannot be told (see :func:`detect_shape`), a record is malformed (names its row), or
            every record has an empty response.
    """
    build = {"messages": _messages_record, "prompt_completion": _prompt_completion, "alpaca": _alpaca,
             "sharegpt": _sharegpt}[detect_shape("SFT", SFT_SHAPES, records)]

    def row(record: Record) -> Row:
        messages = build(record.values, record.where)
        answered = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        return {"messages": messages[: answered[-1] + 1] if answered else messages, "name": record.name,
                "source": record.source}

    return _normalise(records, row, lambda r: [r["messages"]])


def preference_rows(records: Records) -> Normalised:
    """Pairs ``{"prompt", "chosen", "rejected", "corruption": "none", "name", "source"}`` (TRL conversational
    preference rows) from records of any shape in :data:`PREFERENCE_SHAPES`; unpaired rows from ``unpaired``.

    Raises:
        UserError: The shape cannot be told (see :func:`detect_shape`), a record is malformed or has a label that is
            not true or false (names its row), or every record has an empty answer.
    """
    shape = detect_shape("preference", PREFERENCE_SHAPES, records)
    if shape == "unpaired":
        return _normalise(records, _unpaired, lambda r: [r["completion"]])
    build = {"explicit_prompt": _explicit_prompt, "implicit_prompt": _implicit_prompt}[shape]

    def row(record: Record) -> Row:
        prompt, chosen, rejected = build(record.values, record.where)
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "corruption": "none", "name": record.name,
                "source": record.source}

    return _normalise(records, row, lambda r: [r["chosen"], r["rejected"]])


def prompt_turns(messages: list[Message]) -> list[Message]:
    """The turns of a conversation up to and including its first user turn: the prompt an RL policy
    answers, and the prompt of a training run's samples.

    A leading system turn stays (SFT trained the reply under it); later turns are the answer and what follows.

    Raises:
        ValueError: The conversation has no user turn.
    """
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    raise ValueError("a conversation without a user turn")


def _normalise(records: Records, row: Callable[[Record], Row], answers: Callable[[Row], list[list[Message]]]
               ) -> Normalised:
    """`row` of every record, leaving out (and counting) those where an answer of `answers` is empty."""
    kept: list[Row] = []
    empty: list[Record] = []
    roles: set[str] = set()
    for record in records.rows:
        out = row(record)
        conversations = answers(out)
        roles.update(m["role"] for turns in conversations for m in turns)
        if all(map(_answered, conversations)):
            kept.append(out)
        else:
            empty.append(record)
    if empty and not kept:
        raise UserError(
            f"{empty[0].where}: empty response (no assistant turn, or one with only whitespace), as in all "
            f"{len(empty)} records of {records.label} (roles found: {', '.join(sorted(roles))}); give the assistant "
            f"turns text, or check the shape ({records.shape_key})"
        )
    if empty:
        log.warning("%s: empty response (no assistant turn, or one with only whitespace); left out of training with "
                    "the other empty ones: %d of the %d records of %s", empty[0].where, len(empty), len(records.rows),
                    records.label)
    return Normalised(kept, len(empty))


def _answered(messages: list[Message]) -> bool:
    """Whether `messages` has an assistant turn and none of its assistant turns is blank."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    return bool(answers) and all(a.strip() for a in answers)


def _and(columns: tuple[str, ...] | list[str]) -> str:
    """The column names quoted and joined: `a`, `b` and `c`."""
    quoted = [f"`{c}`" for c in columns]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _show(value: Any) -> str:
    return json.dumps(value, default=str)[:80]


def _string(values: dict[str, Any], column: str, where: str) -> str:
    """The string in `column` (it may be empty)."""
    value = values.get(column)
    if value is None:
        raise UserError(f"{where}: `{column}` is missing (or null); give it a string")
    if not isinstance(value, str):
        raise UserError(f"{where}: `{column}` must be a string, got {type(value).__name__} {_show(value)}")
    return value


def _optional_string(values: dict[str, Any], column: str, where: str) -> str:
    """The string in an optional `column`; ``""`` when absent or null."""
    return "" if values.get(column) is None else _string(values, column, where)


def _message_list(value: Any, where: str, column: str, hint: str = "") -> list[Message]:
    """A checked non-empty list of ``{role, content}`` messages (other keys dropped).

    Args:
        value: The column's value.
        where: The record, for messages.
        column: The column, for messages.
        hint: Appended to the error for a string value (what to do instead).
    """
    if value is None:
        raise UserError(f"{where}: `{column}` is missing (or null); give it a list of {{role, content}} messages")
    if isinstance(value, str):
        raise UserError(f"{where}: `{column}` must be a list of {{role, content}} messages, not a string{hint}")
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: `{column}` must be a non-empty list of {{role, content}} messages, got "
                        f"{_show(value)}")
    for i, m in enumerate(value, 1):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{where}: `{column}` must be a list of {{role, content}} messages with string role and "
                            f"content; message {i} is {_show(m)}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _turns(value: Any, role: str, where: str, column: str) -> list[Message]:
    """A string as one `role` message, or a checked list of messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list):
        what = "is missing (or null)" if value is None else f"is {_show(value)}"
        raise UserError(f"{where}: `{column}` {what}; give it a string or a list of {{role, content}} messages")
    return _message_list(value, where, column)


def _prompt(value: Any, where: str) -> list[Message]:
    """The `prompt` column as messages (a string is a user turn); it must have text."""
    turns = _turns(value, "user", where, "prompt")
    if not any(m["content"].strip() for m in turns):
        raise UserError(f"{where}: `prompt` is empty (whitespace only); give the prompt text or remove the record")
    return turns


def _system(values: dict[str, Any], where: str) -> list[Message]:
    """The optional `system` column as a system turn (none when absent or empty)."""
    system = _optional_string(values, "system", where)
    return [{"role": "system", "content": system}] if system else []


def _messages_record(values: dict[str, Any], where: str) -> list[Message]:
    hint = " (a CSV cell holds text only: give message lists in .jsonl, .json or .parquet)"
    return _message_list(values["messages"], where, "messages", hint)


def _prompt_completion(values: dict[str, Any], where: str) -> list[Message]:
    return _prompt(values["prompt"], where) + _turns(values["completion"], "assistant", where, "completion")


def _alpaca(values: dict[str, Any], where: str) -> list[Message]:
    messages = _system(values, where)
    for turn in values.get("history") or []:
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise UserError(f"{where}: `history` must be a list of [query, response] string pairs; got {_show(turn)}")
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    query = "\n".join(t for t in (_string(values, "instruction", where), _optional_string(values, "input", where))
                      if t.strip())
    if not query:
        raise UserError(f"{where}: `instruction` and `input` are empty; give the instruction or remove the record")
    return [*messages, {"role": "user", "content": query},
            {"role": "assistant", "content": _string(values, "output", where)}]


def _sharegpt(values: dict[str, Any], where: str) -> list[Message]:
    turns = values["conversations"]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: `conversations` must be a non-empty list of {{from, value}} turns, got "
                        f"{_show(turns)}")
    messages = _system(values, where)
    for i, turn in enumerate(turns, 1):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise UserError(f"{where}: `conversations` must be a list of {{from, value}} turns with string from and "
                            f"value; turn {i} is {_show(turn)}")
        role = SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise UserError(f"{where}: `conversations` turn {i} is from {turn['from']!r}; `from` must be one of "
                            f"{', '.join(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _explicit_prompt(values: dict[str, Any], where: str) -> Pair:
    prompt = _prompt(values["prompt"], where)
    answers = [_turns(values[c], "assistant", where, c) for c in ("chosen", "rejected")]
    chosen, rejected = (a[len(prompt) :] if a[: len(prompt)] == prompt else a for a in answers)
    return prompt, chosen, rejected


def _label(value: Any, where: str) -> bool:
    """An unpaired record's `label` as a bool: true/false, 1/0, or a text of :data:`LABELS`."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower() if isinstance(value, str) else str(int(value)) if value in (0, 1) else None
    if text not in LABELS:
        raise UserError(f"{where}: `label` must be true (desirable) or false (undesirable), 1/0 or the text "
                        f"\"true\"/\"false\"; got {_show(value)}")
    return LABELS[text]


def _unpaired(record: Record) -> Row:
    prompt = _prompt(record.values["prompt"], record.where)
    completion = _turns(record.values["completion"], "assistant", record.where, "completion")
    if completion[: len(prompt)] == prompt:  # a whole conversation: the completion is what follows the prompt
        completion = completion[len(prompt):]
    return {"prompt": prompt, "completion": completion, "label": _label(record.values["label"], record.where),
            "name": record.name, "source": record.source}


def _implicit_prompt(values: dict[str, Any], where: str) -> Pair:
    hint = " (with string answers, give the prompt in a `prompt` column: the explicit_prompt shape)"
    chosen, rejected = (_message_list(values[c], where, c, hint) for c in ("chosen", "rejected"))
    shared = 0  # the prompt leaves each side at least one turn (as TRL's implicit-prompt extraction does)
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if not shared:
        raise UserError(f"{where}: `chosen` and `rejected` do not start with the same turn, so there is no prompt; "
                        "implicit-prompt pairs are two whole conversations that share their first turns (or give a "
                        "`prompt` column)")
    return chosen[:shared], chosen[shared:], rejected[shared:]
