"""What `llm-train chat` and `llm-train generate` share: load a model folder for generation (a full causal LM, or a
peft adapter over one) through the safe loaders of `llmpipe.models`, and sample from it with transformers'
`generate`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import safetensors_problem
from llmpipe.models import (
    PICKLE_SUFFIXES,
    TRUST_FLAG,
    check_model_dir,
    load_model,
    load_tokenizer,
    pretrained_kwargs,
    read_config,
)
from llmpipe.models.folders import ADAPTER_CONFIG

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

    def generate_kwargs(self, tokenizer) -> dict[str, Any]:
        """Keywords of `model.generate`: the sampling settings (none when greedy), and the tokenizer's eos and pad."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.temperature > 0,
                               "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        if self.temperature > 0:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        else:  # a model's generation_config may ask for sampling; greedy means none of its settings apply
            out.update(temperature=None, top_p=None, top_k=None)
        return out


def _adapter_weights_problem(path: Path, trust_remote_code: bool) -> str | None:
    """Why the adapter weights in `path` must not be loaded (missing, truncated, or an untrusted pickle), else None."""
    names = sorted(f.name for f in path.iterdir() if f.name.startswith("adapter_model"))
    tensors = [n for n in names if n.endswith(".safetensors")]
    for name in tensors:
        if problem := safetensors_problem(path / name):
            return f"{name}: damaged ({problem})"
    if tensors:
        return None
    pickles = [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
    if not pickles:
        return "no adapter_model.safetensors beside adapter_config.json"
    if not trust_remote_code:
        return f"adapter weights only as a pickle ({', '.join(pickles)}), which can run code; pass {TRUST_FLAG} " \
               "only if you trust its source"  # fmt: skip
    return None


def base_model_dir(adapter: Path) -> Path:
    """The local base model folder an adapter names (``base_model_name_or_path``, relative to the working directory,
    as peft stored it).

    Raises:
        UserError: The adapter config is broken or names no local folder.
    """
    base = read_config(adapter / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise UserError(f"{adapter / ADAPTER_CONFIG}: base_model_name_or_path {base!r} is not a model folder here; "
                        "run from the directory the adapter was trained in, or set it to the base model's path")
    return Path(base)


def _load_adapter(path: Path, trust_remote_code: bool):
    """A peft `PeftModel` over its base model, both folders checked as :func:`llmpipe.models.check_model_dir`
    checks a model folder; peft's `AutoPeftModelForCausalLM` reads them (``from_pretrained`` keywords of
    :func:`llmpipe.models.pretrained_kwargs`)."""
    from peft import AutoPeftModelForCausalLM

    base = base_model_dir(path)
    check_model_dir(base, f"the base model of the adapter {path} must be a saved model folder", trust_remote_code)
    if problem := _adapter_weights_problem(path, trust_remote_code):
        raise UserError(f"{path}: {problem}")
    try:
        return AutoPeftModelForCausalLM.from_pretrained(str(path), **pretrained_kwargs(trust_remote_code))
    except (OSError, ValueError, KeyError) as err:  # peft's and transformers' errors for folders they cannot read
        raise UserError(f"{path}: cannot load the adapter: {root_cause(err)}") from None


def load_for_generation(path: str | Path, trust_remote_code: bool = False):
    """A model folder and its tokenizer, ready to generate: eval mode, on the GPU when there is one, left padding.

    A folder with ``adapter_config.json`` is a peft adapter: its base model is loaded from
    ``base_model_name_or_path`` and the adapter over it; its tokenizer is the adapter folder's when saved there,
    else the base model's. A tokenizer without a pad token pads with its eos (generation masks padding; nothing
    trains on it).

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
    adapter = (path / ADAPTER_CONFIG).is_file()
    if adapter:
        model = _load_adapter(path, trust_remote_code)
    else:
        model = load_model(path, SAVED, trust_remote_code=trust_remote_code)
    tok_dir = path if (path / "tokenizer_config.json").is_file() or not adapter else base_model_dir(path)
    tokenizer = load_tokenizer(tok_dir, trust_remote_code, f"save the tokenizer beside the model in {tok_dir}",
                               check_pad=False)  # fmt: skip
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise UserError(f"{tok_dir}: the tokenizer has neither a pad nor an eos token; save it with one")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation continues the right end of every prompt
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.eval().to(device), tokenizer


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
        Per prompt, the new token ids up to and including the first eos (no padding).
    """
    import torch

    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**batch, **model_inputs, streamer=streamer, **sampling.generate_kwargs(tokenizer))
    new = out[:, batch["input_ids"].shape[1]:].tolist()  # (B, new tokens), padded after an early eos
    eos = tokenizer.eos_token_id
    return [row[: row.index(eos) + 1] if eos in row else row for row in new]
