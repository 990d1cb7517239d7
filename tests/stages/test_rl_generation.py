"""The faster RL generation settings (``generation.num_threads``, ``generation.cache_implementation``) sample the same
tokens as the plain path in fp32: greedy exactly, and sampled with a fixed seed too, through PPO's real
`Rollout.generate` on a tiny random Llama (under bf16 autocast a static cache can change seeded samples: docs/rl.md);
GRPO's and RLOO's TRL configs receive the cache, and the thread limit is undone after sampling."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from llmpipe.config import parse_params
from llmpipe.models import build_model
from llmpipe.rl.ppo.rollout import Rollout

ROOT = Path(__file__).resolve().parents[2]
PLAIN = {"num_threads": None, "cache_implementation": "dynamic"}
FAST = {"num_threads": 1, "cache_implementation": "static"}


@pytest.fixture(scope="module")
def tiny():
    """Tiny params, a 1k BPE on a little stdlib text, a random tiny Llama, and 8 prompts of differing lengths."""
    from accelerate import Accelerator

    from llmpipe.stages.tokenizer import train_bpe

    params = parse_params(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text()))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    tok = train_bpe(iter([text]), params.tokenizer.vocab_size, 2, 256)
    torch.manual_seed(0)
    model = build_model(params.model, tok)
    prompts = [tok(text[i * 300 : i * 300 + 40 * (i + 1)])["input_ids"] for i in range(8)]
    return params, tok, model, Accelerator(cpu=True), prompts


def _generate(tiny, seed: int, **generation) -> torch.Tensor:
    params, tok, model, accelerator, prompts = tiny
    gen = params.ppo.generation.model_copy(update={"max_new_tokens": 24, **generation})
    cfg = params.ppo.model_copy(update={"generation": gen})
    rollout = Rollout(cfg, accelerator, tok, model, None, None, None, None, None, None, None)
    torch.manual_seed(seed)
    return rollout.generate(prompts).input_ids


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_settings_sample_the_plain_paths_tokens(tiny, seed):
    greedy = {"top_k": 1}  # sampling among the one most likely token: greedy through the rollout's own path
    assert torch.equal(_generate(tiny, seed, **PLAIN, **greedy), _generate(tiny, seed, **FAST, **greedy))
    sampled_plain, sampled_fast = _generate(tiny, seed, **PLAIN), _generate(tiny, seed, **FAST)
    assert torch.equal(sampled_plain, sampled_fast)
    assert not torch.equal(sampled_plain, _generate(tiny, seed + 10, **FAST)), "another seed: other tokens"


def test_thread_limit_is_undone_after_sampling(tiny):
    before = torch.get_num_threads()
    _generate(tiny, 0, num_threads=1)
    assert torch.get_num_threads() == before


def test_group_stages_pass_the_cache_to_trl(tmp_path):
    from llmpipe.stages.grpo import grpo_config
    from llmpipe.stages.rloo import rloo_config

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["grpo"]["generation"]["cache_implementation"] = "static"
    params = parse_params(raw)
    assert params.rloo.generation.cache_implementation == "static" and params.rloo.generation.num_threads == 1
    assert grpo_config(params, tmp_path).cache_implementation == "static"
    assert rloo_config(params, tmp_path).cache_implementation == "static"
