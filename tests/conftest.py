"""Shared fixtures: the repository root, and tiny params for real end-to-end runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tiny but real: a 2-layer Llama on a 1k BPE, a few steps per stage, the real stdlib corpus.
TINY_PARAMS = """\
data:
  num_eval_examples: 24
  stdlib: {max_sft_pairs: 400, max_preference_pairs: 200}
tokenizer: {vocab_size: 1024}
model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2,
        intermediate_size: 128, max_position_embeddings: 256}
train: {max_steps: 12, per_device_train_batch_size: 4, per_device_eval_batch_size: 8, logging_steps: 4,
        eval_steps: 6, save_steps: 6, max_eval_samples: 8, max_length: 128, warmup_steps: 2}
pretrain: {max_steps: 12, per_device_train_batch_size: 4}
sft: {max_steps: 12, per_device_train_batch_size: 4}
dpo: {max_steps: 12, per_device_train_batch_size: 4, warmup_steps: 2, lr: 0.0001, beta: 0.1}
eval: {limit: 8, batch_size: 8, max_length: 128}
"""


@pytest.fixture(scope="session")
def offline_env() -> dict[str, str]:
    """Environment for subprocesses: offline hub, and any non-loopback HTTP(S) sent to a dead proxy."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HTTP_PROXY="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost,::1",
        TOKENIZERS_PARALLELISM="false",
        DVC_NO_ANALYTICS="1",
    )
    return env
