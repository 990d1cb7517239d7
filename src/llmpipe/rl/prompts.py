"""Prompts for on-policy RL: the user turns of the prepared SFT data, tokenized with the chat template, and
the seeded, resumable stream of prompt indices a run draws its rollout batches from (the `ppo` stage;
:class:`IndexStream` also orders its ptx blocks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llmpipe.data.loading import load_split
from llmpipe.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompts:
    """The prompts of one split, those that fit the token budget, in file order."""

    texts: list[str]
    """The user turn as plain text (signature + docstring): what the reward functions score."""
    names: list[str]
    """The requested function name of each prompt."""
    ids: list[list[int]]
    """The user turn rendered with the chat template and its generation prompt, as token ids."""


def load_prompts(path: Path, tokenizer, max_prompt_tokens: int, limit: int | None) -> Prompts:
    """The user turns of a prepared SFT split, rendered with ``add_generation_prompt=True``.

    Args:
        path: ``data/sft/<split>.jsonl`` (rows with ``messages`` and ``name``).
        tokenizer: The pipeline tokenizer (its chat template adds bos and the role tokens).
        max_prompt_tokens: Longer rendered prompts are skipped (they leave no room for the completion).
        limit: Keep at most this many prompts (after skipping); None = all.

    Raises:
        UserError: The file is missing or malformed, or no prompt fits `max_prompt_tokens`.
    """
    rows = load_split(path, ("messages", "name"))
    texts, names, ids = [], [], []
    for messages, name in zip(rows["messages"], rows["name"]):
        user = next(m for m in messages if m["role"] == "user")
        rendered = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)
        tokens = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if len(tokens) <= max_prompt_tokens:
            texts.append(user["content"])
            names.append(name)
            ids.append(tokens)
    if not ids:
        raise UserError(
            f"{path}: no prompt fits in {max_prompt_tokens} tokens (ppo.max_length - ppo.generation.max_new_tokens)"
        )
    log.info("ppo: %d prompts of %d in %s fit in %d tokens", len(ids), len(rows), path, max_prompt_tokens)
    return Prompts(texts[:limit], names[:limit], ids[:limit])


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
