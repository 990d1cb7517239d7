"""What `llm-train chat` and `llm-train generate` share: load a model folder for generation (a full causal LM, or a
peft adapter, or a chain of them, over one) through the one loader of `llmpipe.models`, and sample from it with
transformers' `generate`, stopping at the folder's eos ids.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.models import load_model, load_tokenizer
from llmpipe.models.folders import adapter_base, is_adapter

log = logging.getLogger(__name__)

SAVED = "give a folder written by save_pretrained (a stage's models/<stage>, or your own model)"


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `chat` and `generate` share: the model folder and the sampling settings."""
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a model folder (models/sft, a peft adapter folder, any local HF causal LM)")
    sampling = parser.add_argument_group("sampling (temperature 0 = greedy)")
    sampling.add_argument("--temperature", type=float, default=0.7, help="softmax temperature (default 0.7)")
    sampling.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    sampling.add_argument("--top-k", type=int, default=50,
                          help="sample among the k likeliest tokens; 0 = all (default 50)")
    sampling.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer at most (default 256)")
    sampling.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load a folder whose weights are pickles or whose config maps to Python code")


@dataclass(frozen=True)
class Sampling:
    """How `generate` picks tokens.

    Attributes:
        temperature: Softmax temperature; 0 decodes greedily.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Sample among the k likeliest tokens; 0 keeps them all.
        max_new_tokens: Tokens generated per answer at most.
    """

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Sampling:
        """The flags of :func:`add_generation_arguments`, checked.

        Raises:
            UserError: A value out of range; the message names the flag.
        """
        checks = [(args.temperature >= 0, "--temperature must be >= 0 (0 = greedy)"),
                  (0 < args.top_p <= 1, "--top-p must be in (0, 1]"),
                  (args.top_k >= 0, "--top-k must be >= 0 (0 = no top-k cut)"),
                  (args.max_new_tokens > 0, "--max-new-tokens must be > 0")]  # fmt: skip
        for ok, message in checks:
            if not ok:
                raise UserError(message)
        return cls(args.temperature, args.top_p, args.top_k, args.max_new_tokens)

    def generate_kwargs(self, tokenizer, eos_ids: list[int]) -> dict[str, Any]:
        """Keywords of `model.generate`: the sampling settings (none when greedy), the eos ids (:func:`stop_ids`) and
        the tokenizer's pad."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.temperature > 0,
                               "eos_token_id": eos_ids, "pad_token_id": tokenizer.pad_token_id}
        if self.temperature > 0:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:  # a model's generation_config may ask for sampling; greedy means none of its settings apply
            out.update(temperature=None, top_p=None, top_k=None)
        return out


def load_for_generation(path: str | Path, trust_remote_code: bool = False):
    """A model folder and its tokenizer, ready to generate: eval mode, on the GPU when there is one, left padding.

    The folder loads as every stage loads one (`llmpipe.models.load_model`): a peft adapter folder
    (``adapter_config.json``) over its base, and a chain of them in order. An adapter's tokenizer is the adapter
    folder's when saved there, else its base's. A tokenizer without a pad token pads with its eos (generation
    masks padding; nothing trains on it).

    Args:
        path: A ``save_pretrained`` folder of a causal LM or of a peft adapter.
        trust_remote_code: Let pickled weights and ``auto_map`` code through (``--trust-remote-code``).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        UserError: The folder is missing, refused by the safe loaders, or unreadable; the tokenizer has neither
            pad nor eos token.
    """
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a chat's screen starts with the conversation, not loading bars
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--model {path}: no such folder; {SAVED}")
    model = load_model(path, SAVED, trust_remote_code=trust_remote_code)
    tok_dir = path if (path / "tokenizer_config.json").is_file() or not is_adapter(path) else adapter_base(path)
    tokenizer = load_tokenizer(tok_dir, trust_remote_code, f"save the tokenizer beside the model in {tok_dir}",
                               check_pad=False)  # fmt: skip
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"{tok_dir}: the tokenizer has neither a pad nor an eos token; save it with one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation continues the right end of every prompt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.eval().to(device), tokenizer


def stop_ids(model, tokenizer) -> list[int]:
    """The ids that end an answer: the model's ``generation_config.eos_token_id`` (a list where a chat stage added
    the end-of-turn token, `llmpipe.models.saved_folder`) and the tokenizer's eos."""
    own = getattr(model.generation_config, "eos_token_id", None)
    ids = [*(own if isinstance(own, list) else [own]), tokenizer.eos_token_id]
    return list(dict.fromkeys(i for i in ids if i is not None))


def stop_reason(new: list[int], eos_ids: list[int], end_of_turn_id: int | None) -> str:
    """Why an answer (its new ids, as :func:`generate` returns them) ended: ``end_of_turn`` (the chat template's
    end-of-turn token), ``eos`` (another eos id) or ``max_new_tokens``."""
    if new and new[-1] == end_of_turn_id:
        return "end_of_turn"
    return "eos" if new and new[-1] in eos_ids else "max_new_tokens"


def context_length(model, tokenizer) -> int | None:
    """Tokens the model attends over (``max_position_embeddings``), else the tokenizer's ``model_max_length`` when
    set; None when neither says."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None and tokenizer.model_max_length < 1_000_000:  # transformers' "unset" is 1e30
        limit = tokenizer.model_max_length
    return limit


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """`messages` rendered by the tokenizer's chat template up to the assistant's turn, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])  # fmt: skip


def generate(model, tokenizer, prompts: list[list[int]], sampling: Sampling, streamer=None,
             **model_inputs) -> list[list[int]]:
    """Continue each prompt; one batch, left-padded.

    Args:
        model: From :func:`load_for_generation`.
        tokenizer: Its tokenizer (pad and eos set).
        prompts: Token ids per prompt.
        sampling: How tokens are picked.
        streamer: A transformers streamer (`TextStreamer`) that prints tokens as they come; batch of one only.
        model_inputs: More inputs of `model.generate` (a vision-language model's ``pixel_values``).

    Returns:
        Per prompt, the new token ids up to and including the first eos id (:func:`stop_ids`; no padding).
    """
    import torch

    eos = stop_ids(model, tokenizer)
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, **model_inputs, streamer=streamer, **sampling.generate_kwargs(tokenizer, eos))
    new = out[:, batch["input_ids"].shape[1]:].tolist()  # (B, new tokens), padded after an early eos
    ends = [next((j for j, t in enumerate(row) if t in eos), None) for row in new]
    return [row if end is None else row[: end + 1] for row, end in zip(new, ends, strict=True)]
