"""Samples during training: a few prompts answered at every evaluation, written to the console, TensorBoard (text)
and ``logs/<stage>/samples.jsonl`` (one line per prompt: step, prompt, completion, reward where the stage has one).

The prompts are ``<stage>.eval_prompts`` or ``num_eval_prompts`` drawn from the stage's held-out data
(:func:`held_out_turns`); the chat stages render them with the chat template and its generation prompt,
pretrain continues a text prefix. Generation is greedy for ``eval_max_new_tokens`` tokens, except in the RL stages,
which sample with their ``generation:`` settings and score with their reward functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.callbacks import Callback, RunInfo
from llmpipe.core.io import write_jsonl
from llmpipe.data.formats import prompt_turns
from llmpipe.data.loading import load_split
from llmpipe.train.progress import write
from llmpipe.train.tensorboard import TensorBoardLog

PREFIX_TOKENS = 24
"""Tokens of a held-out pretraining block used as a text prompt."""


@dataclass(frozen=True)
class SamplePrompts:
    """The prompts of a run's samples: ``texts`` as recorded, ``ids`` as the model reads them, ``names`` (the
    requested function name, for reward functions; ``""`` when unknown)."""

    texts: list[str]
    ids: list[list[int]]
    names: list[str]


def held_out_turns(path: Path, count: int) -> list[list[dict[str, str]]]:
    """The prompt turns of the first `count` rows of a prepared split: ``messages`` up to the first user turn (SFT
    data) or ``prompt`` (preference data; a string is one user turn)."""
    rows = load_split(path, (), count, optional=("messages", "prompt"))
    if "messages" in rows.column_names:
        return [prompt_turns(m) for m in rows["messages"]]
    return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in rows["prompt"]]


def chat_prompts(tokenizer, turns: list[list[dict[str, str]]], names: list[str] | None = None) -> SamplePrompts:
    """Conversations rendered with the chat template and its generation prompt; the last turn's text is recorded."""
    ids = [tokenizer.apply_chat_template(t, add_generation_prompt=True, tokenize=False) for t in turns]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ids]
    texts = [t[-1]["content"] for t in turns]
    return SamplePrompts(texts, ids, names or [function_name(t) for t in texts])


def user_prompts(tokenizer, texts: list[str]) -> SamplePrompts:
    """Each text as the one user turn of a conversation (``<stage>.eval_prompts``), chat-rendered."""
    return chat_prompts(tokenizer, [[{"role": "user", "content": t}] for t in texts])


HELD_OUT_ROWS = 64
"""Held-out rows looked at for prompts that fit ``max_length`` (the first that fit are taken)."""


def stage_prompts(cfg, tokenizer, held_out: Path) -> SamplePrompts:
    """The chat prompts of a stage: ``cfg.eval_prompts`` as user turns, or the first ``num_eval_prompts`` of the
    first :data:`HELD_OUT_ROWS` rows of `held_out` whose rendered prompt fits ``cfg.max_length`` tokens."""
    if cfg.eval_prompts is not None:
        return user_prompts(tokenizer, cfg.eval_prompts)
    if cfg.num_eval_prompts == 0:
        return SamplePrompts([], [], [])
    found = chat_prompts(tokenizer, held_out_turns(held_out, HELD_OUT_ROWS))
    keep = [i for i, ids in enumerate(found.ids) if len(ids) <= cfg.max_length][: cfg.num_eval_prompts]
    return SamplePrompts(*([column[i] for i in keep] for column in (found.texts, found.ids, found.names)))


def function_name(text: str) -> str:
    """The name of the first ``def`` in a prompt (what the reward functions check), or ``""``."""
    found = re.search(r"def\s+(\w+)\s*\(", text)
    return found.group(1) if found else ""


def generation_config(tokenizer, max_new_tokens: int, generation=None):
    """A `transformers.GenerationConfig`: greedy for `max_new_tokens`, or sampled with a ``generation:`` block's
    settings (`llmpipe.config.rl.GenerationParams`) when given; it stops at the eos and at the chat template's
    end-of-turn token (`llmpipe.data.chat_turns.end_of_turn`), as the saved folder will (`llmpipe.models.saved_folder`)."""
    from transformers import GenerationConfig

    from llmpipe.data.chat_turns import end_of_turn

    sampled: dict[str, Any] = {"do_sample": False}
    if generation is not None:
        max_new_tokens = generation.max_new_tokens
        sampled = {"do_sample": True, "temperature": generation.temperature, "top_p": generation.top_p,
                   "top_k": generation.top_k, "min_p": generation.min_p,
                   "repetition_penalty": generation.repetition_penalty,
                   "suppress_tokens": generation.suppress_tokens or None,
                   "cache_implementation": generation.cache_implementation}  # fmt: skip
    eot = end_of_turn(tokenizer)
    eos = list(dict.fromkeys([tokenizer.eos_token_id, *([tokenizer.convert_tokens_to_ids(eot)] if eot else [])]))
    return GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=tokenizer.pad_token_id, use_cache=True, **sampled)  # fmt: skip


def complete(model, tokenizer, ids: list[list[int]], config) -> list[str]:
    """Left-padded batch generation from token ids `ids`; the completions decoded without special tokens. The
    model is put in eval mode for it and back in the mode it was in."""
    import torch

    longest = max(len(p) for p in ids)
    device = next(model.parameters()).device
    batch = torch.tensor([[tokenizer.pad_token_id] * (longest - len(p)) + p for p in ids], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in ids], device=device)
    training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=batch, attention_mask=mask, generation_config=config)
    model.train(training)
    return tokenizer.batch_decode(out[:, longest:], skip_special_tokens=True)


Generate = Callable[[Any, SamplePrompts], tuple[list[str], list[float] | None]]
"""(model, prompts) → completions and their rewards (None where the stage has none)."""


def model_generate(tokenizer, config, reward: Callable[[SamplePrompts, list[str]], list[float]] | None = None):
    """A :data:`Generate` over the model the run trains (:func:`complete`), scored by `reward` when given."""

    def generate(model, prompts: SamplePrompts) -> tuple[list[str], list[float] | None]:
        completions = complete(model, tokenizer, prompts.ids, config)
        return completions, reward(prompts, completions) if reward is not None else None

    return generate


class Samples(Callback):
    """Answers the prompts at every evaluation (module docstring); writes on global rank 0.

    Args:
        stage: The stage name (console lines).
        prompts: The prompts.
        generate: How the stage answers them (:func:`model_generate`, or PPO's rollout).
        path: ``logs/<stage>/samples.jsonl``, rewritten (atomically) with every row of the run at each evaluation.
        tensorboard: Where the samples also go as text, if anywhere.
    """

    def __init__(self, stage: str, prompts: SamplePrompts, generate: Generate, path: Path,
                 tensorboard: TensorBoardLog | None = None) -> None:  # fmt: skip
        self.stage, self.prompts, self.generate, self.path = stage, prompts, generate, path
        self.tensorboard = tensorboard
        self.run: RunInfo | None = None
        self.rows: list[dict[str, Any]] = []

    def on_train_start(self, run: RunInfo) -> None:
        self.run = run

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        if self.run is None or not self.prompts.ids or (self.rows and self.rows[-1]["step"] == step):
            return  # (the final evaluation repeats the last step's when it was an eval step)
        import torch

        # On a forked RNG, so sampled samples leave the training's random stream (and so its results) as they were.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            completions, rewards = self.generate(self.run.model, self.prompts)  # every rank: FSDP gathers in forward
        if not self.run.is_main:
            return
        rows = [{"step": step, "prompt": p, "completion": c} for p, c in zip(self.prompts.texts, completions)]
        for row, r in zip(rows, rewards or []):
            row["reward"] = round(float(r), 5)
        self.rows += rows
        write_jsonl(self.path, self.rows)
        for i, row in enumerate(rows, start=1):
            reward = f" (reward {row['reward']:.3f})" if "reward" in row else ""
            write(f"{self.stage} sample {i}/{len(rows)} @ step {step}{reward}: {row['prompt'][-60:]!r} → "
                  f"{row['completion'][:120]!r}")  # fmt: skip
        if self.tensorboard is not None:
            self.tensorboard.text("samples", markdown(rows), step)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The samples of one step as markdown (TensorBoard's text view renders it): prompt and completion as code."""
    parts = []
    for row in rows:
        reward = f" — reward {row['reward']:.3f}" if "reward" in row else ""
        parts.append(
            f"**prompt**{reward}\n\n```\n{row['prompt']}\n```\n\n**completion**\n\n```\n{row['completion']}\n```"
        )
    return "\n\n---\n\n".join(parts)
