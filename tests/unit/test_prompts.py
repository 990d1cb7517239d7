"""RL prompts: PPO and GRPO take the same turns of an SFT row (a system turn included, the answer left out) and
skip the same too-long prompts, with errors that name the row or the params key to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmpipe.core.errors import UserError
from llmpipe.data.formats import prompt_turns
from llmpipe.models import load_tokenizer
from llmpipe.rl.prompts import load_prompts
from llmpipe.stages import grpo

SYSTEM = {"role": "system", "content": "You write Python function bodies."}
USER = {"role": "user", "content": 'def add(a, b):\n    """Return the sum of a and b."""'}
ANSWER = {"role": "assistant", "content": "    return a + b"}
LONG_USER = {"role": "user", "content": "def f(x):\n    \"\"\"" + "word " * 200 + "\"\"\""}


def write_rows(path: Path, rows: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": m, "name": "add"}) + "\n" for m in rows))
    return path


def test_prompt_turns_keep_the_system_turn_and_stop_at_the_first_user_turn():
    later = {"role": "user", "content": "and now subtract"}
    assert prompt_turns([SYSTEM, USER, ANSWER, later]) == [SYSTEM, USER]
    assert prompt_turns([USER, ANSWER]) == [USER]
    with pytest.raises(ValueError, match="without a user turn"):
        prompt_turns([SYSTEM, ANSWER])


def test_ppo_and_grpo_select_the_same_prompts_and_render_the_system_turn(workdir, tmp_path):
    tok = load_tokenizer(workdir / "artifacts" / "tokenizer")
    path = write_rows(tmp_path / "train.jsonl", [[USER, ANSWER], [LONG_USER, ANSWER], [SYSTEM, USER, ANSWER]])

    prompts = load_prompts(path, tok, 64, None, "ppo.max_length")
    assert prompts.turns == [[USER], [SYSTEM, USER]], "the long prompt is skipped, the system turn kept"
    rendered = tok.decode(prompts.ids[1])
    assert SYSTEM["content"] in rendered and ANSWER["content"] not in rendered
    assert len(prompts.ids[1]) > len(prompts.ids[0])

    dataset = grpo.prompt_dataset(path, tok, 64)
    assert dataset["prompt"] == prompts.turns and dataset["name"] == ["add", "add"]
    assert grpo.prompt_dataset(path, tok, 64, limit=1)["prompt"] == [[USER]]


def test_prompt_errors_name_the_row_or_the_budget_key(workdir, tmp_path):
    tok = load_tokenizer(workdir / "artifacts" / "tokenizer")
    no_user = write_rows(tmp_path / "a.jsonl", [[USER, ANSWER], [SYSTEM, ANSWER]])
    with pytest.raises(UserError, match=r"a\.jsonl:2: the conversation has no user turn"):
        grpo.prompt_dataset(no_user, tok, 64)
    too_long = write_rows(tmp_path / "b.jsonl", [[LONG_USER, ANSWER]])
    with pytest.raises(UserError, match=r"b\.jsonl: no prompt fits in 64 tokens \(grpo\.max_length\)"):
        grpo.prompt_dataset(too_long, tok, 64)
