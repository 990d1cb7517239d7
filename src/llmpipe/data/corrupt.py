"""Rejected bodies for the stdlib preference pairs: another function's body, a truncated one, a broken one.

Each corruption returns ``None`` when it cannot make a body that differs from the real one; the pair
builder then takes another type, keeping the three types balanced.
"""

from __future__ import annotations

import ast
import io
import random
import tokenize
from collections.abc import Sequence

from llmpipe.data.functions import Function

CORRUPTIONS = ("swap", "truncate", "syntax")
"""The corruption types, in round-robin order."""

_CLOSERS = frozenset({")", "]", "}", ":"})


def swap(fn: Function, pool: Sequence[Function], rng: random.Random) -> str | None:
    """The body of another function of `pool` (another name, other text), scanning from a random start."""
    if not pool:
        return None
    start = rng.randrange(len(pool))
    for i in range(len(pool)):
        other = pool[(start + i) % len(pool)]
        if other.name != fn.name and other.body != fn.body:
            return other.body
    return None


def truncate(fn: Function, pool: Sequence[Function], rng: random.Random) -> str | None:
    """The first half of the body's lines (at least one line fewer than the real body)."""
    lines = fn.body.split("\n")
    if len(lines) < 2:
        return None
    return "\n".join(lines[: len(lines) // 2]).rstrip()


def syntax(fn: Function, pool: Sequence[Function], rng: random.Random) -> str | None:
    """The body with one token deleted so that ``prompt + "\\n" + body`` no longer parses.

    Closing brackets and colons are tried first (in a random order), then any other operator or name.
    """
    head = fn.prompt.count("\n") + 1
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(fn.prompt + "\n" + fn.body + "\n").readline))
    except (tokenize.TokenError, SyntaxError):
        return None
    own = [t for t in tokens if t.start[0] > head and t.type in (tokenize.OP, tokenize.NAME)]
    closers = [t for t in own if t.string in _CLOSERS]
    others = [t for t in own if t.string not in _CLOSERS]
    rng.shuffle(closers)
    rng.shuffle(others)
    lines = fn.body.split("\n")
    for tok in closers + others:
        row = tok.start[0] - head - 1
        line = lines[row]
        broken = lines[:row] + [line[: tok.start[1]] + line[tok.end[1] :]] + lines[row + 1 :]
        candidate = "\n".join(broken)
        if not _parses(fn.prompt + "\n" + candidate):
            return candidate
    return None


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


_MAKERS = {"swap": swap, "truncate": truncate, "syntax": syntax}


def preference_pairs(functions: Sequence[Function], pool: Sequence[Function], rng: random.Random) -> list[dict]:
    """One preference pair per function, corruption types balanced (the least used type that works).

    Args:
        functions: The functions to make pairs of.
        pool: Functions whose bodies a `swap` may take (the same split).
        rng: Seeded generator; the same seed gives the same pairs.

    Returns:
        Rows ``{"prompt": [user msg], "chosen": [assistant msg], "rejected": [assistant msg],
        "corruption": type, "name": qualname, "source": relative path}`` (TRL conversational preference).
        A function no corruption works for is left out.
    """
    counts = dict.fromkeys(CORRUPTIONS, 0)
    rows = []
    for i, fn in enumerate(functions):
        order = sorted(CORRUPTIONS, key=lambda t: (counts[t], (CORRUPTIONS.index(t) - i) % len(CORRUPTIONS)))
        for kind in order:
            rejected = _MAKERS[kind](fn, pool, rng)
            if rejected is not None and rejected != fn.body:
                counts[kind] += 1
                rows.append(preference_row(fn, rejected, kind))
                break
    return rows


def preference_row(fn: Function, rejected: str, corruption: str) -> dict:
    """A TRL conversational preference row for `fn` with the given rejected body."""
    return {
        "prompt": [{"role": "user", "content": fn.prompt}],
        "chosen": [{"role": "assistant", "content": fn.body}],
        "rejected": [{"role": "assistant", "content": rejected}],
        "corruption": corruption,
        "name": fn.name,
        "source": fn.source,
    }
