"""Prompts for on-policy RL: the conversation of each prepared SFT row up to its first user turn, tokenized with
the chat template (the `ppo` and `grpo` stages), and the seeded, resumable stream of prompt indices a PPO run
draws its rollout batches from (:class:`IndexStream` also orders its ptx blocks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpipe.core.errors import UserError
from llmpipe.data.formats import prompt_turns
from llmpipe.data.loading import load_split

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompts:
    """The prompts of one split, those that fit the token budget, in file order."""

    turns: list[list[dict[str, str]]]
    """The conversation up to and including the first user turn (a system turn stays), as the policy sees it and
    the reward functions get it (the built-ins score its last turn's text: signature + docstring)."""
    names: list[str]
    """The requested function name of each prompt."""
    ids: list[list[int]]
    """:attr:`turns` rendered with the chat template and its generation prompt, as token ids."""
    tests: list[list[str]]
    """The hidden tests of each prompt's executable task (``[]`` for a row without: a stdlib function)."""


def load_prompts(path: Path, tokenizer, max_prompt_tokens: int, limit: int | None, budget: str) -> Prompts:
    """The prompts (:func:`prompt_turns`) of a prepared SFT split, rendered with ``add_generation_prompt=True``.

    Args:
        path: ``data/sft/<split>.jsonl`` (rows with ``messages`` and ``name``; the task rows with ``tests``).
        tokenizer: The pipeline tokenizer (its chat template adds bos and the role tokens).
        max_prompt_tokens: Longer rendered prompts are skipped (they leave no room for the completion).
        limit: Keep at most this many prompts (after skipping); None = all.
        budget: The params key(s) that set `max_prompt_tokens`, named in the error when no prompt fits.

    Raises:
        UserError: The file is missing or malformed, a row has no user turn, or no prompt fits
            `max_prompt_tokens`.
    """
    rows = load_split(path, ("messages", "name"), filled={"tests": []})
    prompts = Prompts([], [], [], [])
    for line, (messages, name, tests) in enumerate(zip(rows["messages"], rows["name"], rows["tests"]), start=1):
        try:
            turns = prompt_turns(messages)
        except ValueError:
            raise UserError(f"{path}:{line}: the conversation has no user turn to use as a prompt") from None
        rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        tokens = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if len(tokens) <= max_prompt_tokens:
            prompts.turns.append(turns)
            prompts.names.append(name)
            prompts.ids.append(tokens)
            prompts.tests.append(list(tests or []))
    if not prompts.ids:
        raise UserError(f"{path}: no prompt fits in {max_prompt_tokens} tokens ({budget}); raise it")
    log.info("%s: %d of %d prompts fit in %d tokens", path, len(prompts.ids), len(rows), max_prompt_tokens)
    return Prompts(prompts.turns[:limit], prompts.names[:limit], prompts.ids[:limit], prompts.tests[:limit])


class IndexStream:
    """An endless stream of indices into ``range(n)``: epoch ``e`` is a permutation seeded with ``seed + e``.

    Its position (epoch, index within the epoch's permutation) is its checkpointed state, so a resumed run
    continues the same sequence.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch, self.index = n, seed, 0, 0

    def _permutation(self) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, count: int) -> list[int]:
        """The next `count` indices, crossing into the next epoch's permutation when one runs out."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation()
            part = perm[self.index : self.index + count - len(out)]
            out += part
            self.index += len(part)
            if self.index == self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "index"}``."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
