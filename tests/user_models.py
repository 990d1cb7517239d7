"""Tiny "models users already have", built and saved by the tests (nothing downloads): a Llama, a Qwen2 and a GPT-2
with tokenizers of their own kinds, and a Hugging Face cache layout that holds one as a hub id; a user's data and the
tiny params that fine-tune such a model in a temporary folder."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import torch
import yaml
from conftest import TINY_PARAMS

END = "<|endoftext|>"


def corpus() -> list[str]:
    """A few standard-library modules' source: enough text for a small byte-level BPE."""
    import argparse
    import json as json_module
    import textwrap

    return [inspect.getsource(m) for m in (argparse, json_module, textwrap)]


def train_tokenizer(vocab_size: int = 400, special_tokens: tuple[str, ...] = (END,), **tokens: str):
    """A byte-level BPE wrapped for transformers with the given special tokens (e.g. ``eos_token="</s>"``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, model_max_length=256, **tokens)


def gpt2_tokenizer():
    """GPT-2's shape: one special token as bos, eos and unk; no pad token, no chat template."""
    return train_tokenizer(bos_token=END, eos_token=END, unk_token=END)


QWEN_TEMPLATE = (Path(__import__("trl").__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
"""Qwen2.5's chat template as TRL ships it: no ``{% generation %}`` markers (TRL has a marked version)."""

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
"""A template of no known family, without ``{% generation %}`` markers."""


CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""Plain ChatML (the Qwen shape): turns end with ``<|im_end|>``; no ``{% generation %}`` markers, and TRL has no
marked copy of it."""


def base_chatml_tokenizer():
    """A base model's tokenizer with a ChatML template, as Qwen's base models ship it: ``<|endoftext|>`` is its eos
    (and pad), while the template ends each turn with ``<|im_end|>``."""
    tok = train_tokenizer(special_tokens=(END, "<|im_start|>", "<|im_end|>"), eos_token=END, pad_token=END)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def chat_tokenizer(template: str):
    """Distinct bos/eos/pad and `template` (as an instruct model's tokenizer has)."""
    tok = train_tokenizer(special_tokens=("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"),
                          bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.chat_template = template
    return tok


def build(arch: str, tokenizer, extra_rows: int = 0, seed: int = 0):
    """A randomly initialised tiny causal LM of `arch` (llama, qwen2, gpt2) embedding `tokenizer` (+ `extra_rows`)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = len(tokenizer) + extra_rows
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    torch.manual_seed(seed)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=1, n_head=2, n_positions=256, **ids))
    shape = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1, "intermediate_size": 64, "max_position_embeddings": 256, **ids}
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


def save_user_model(dest: Path, arch: str, tokenizer, extra_rows: int = 0) -> Path:
    """`build` saved as a user would: `save_pretrained` of model (safetensors) and tokenizer into `dest`."""
    build(arch, tokenizer, extra_rows).save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = "0" * 40) -> Path:
    """Lay `folder` out in the Hugging Face hub cache at `cache` as `repo_id` at `commit`, with ``refs/main``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file in `path`."""
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def pointer(path: Path) -> dict:
    """The pointer file in model folder `path`."""
    return json.loads((path / "init_from.json").read_text())


STEPS = {"max_steps": 2, "eval_steps": 2, "save_steps": 2, "warmup_steps": 0, "logging_steps": 1}


def user_data(root: Path) -> dict[str, str]:
    """An Alpaca SFT file and a preference jsonl, as a user brings them."""
    raw = root / "raw"
    raw.mkdir()
    alpaca = [{"instruction": f"Add {i} to x.", "input": "", "output": f"def f(x):\n    return x + {i}\n"}
              for i in range(30)]
    (raw / "alpaca.json").write_text(json.dumps(alpaca))
    pairs = [{"prompt": f"Add {i} to x.", "chosen": f"return x + {i}", "rejected": f"return x - {i}"} for i in range(30)]
    (raw / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return {"sft": str(raw / "alpaca.json"), "preference": str(raw / "pairs.jsonl")}


def params_at(root: Path, init_from: str, **sections):
    """TINY_PARAMS in `root` (every path absolute), starting from `init_from` on the user data of :func:`user_data`,
    without pretraining unless `sections` say otherwise."""
    from llmpipe.config import parse_params

    raw = yaml.safe_load(TINY_PARAMS)
    raw["paths"] = {k: str(root / k) for k in ("data", "models", "metrics", "logs", "checkpoints", "runs")}
    raw["paths"]["tokenizer"] = str(root / "artifacts" / "tokenizer")
    local = user_data(root) if not (root / "raw").exists() else {
        "sft": str(root / "raw" / "alpaca.json"), "preference": str(root / "raw" / "pairs.jsonl")}
    raw["data"] = {**raw["data"], "source": "local", "local": local}
    raw["model"] = {"init_from": init_from}
    raw["pretrain"] = {**raw["pretrain"], "enabled": False}
    raw["sft"] = {**raw["sft"], **STEPS}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_params(raw)


def run_stages(params, *names: str) -> dict[str, dict]:
    from llmpipe import stages

    return {name: stages.runner(name)(params) for name in names}
