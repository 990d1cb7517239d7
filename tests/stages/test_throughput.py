"""Throughput logging and the profiler: the FLOPs formula against a hand count and the PaLM paper's own figures,
the datasheet table, and a tiny real pretrain run that logs tokens/s and peak memory and writes a profile."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from llmpipe.train.throughput import (
    datasheet_bf16_tflops,
    matmul_parameters,
    measure_matmul_tflops,
    model_flops_per_token,
    training_flops_per_token,
)


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=24, tie_word_embeddings=tied)  # fmt: skip
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])
def test_flops_per_token_matches_a_hand_count(tied):
    # Per layer, head dim Q = 16 / 4 = 4: q 16×16, k and v 16×(2·4), o 16×16, SwiGLU 3 × 16×24, two RMSNorms of 16.
    per_layer = 256 + 128 + 128 + 256 + 3 * 16 * 24 + 2 * 16
    # Final norm, and the 100×16 output projection: the shared matrix once when tied; the untied input table
    # is a lookup, not a matmul, so it is left out.
    n = 2 * per_layer + 16 + 100 * 16
    model = _tiny_llama(tied)
    assert matmul_parameters(model) == n == 5520
    assert sum(p.numel() for p in model.parameters()) == n + (0 if tied else 1600)
    # 6N + 12·L·H·Q·T with L=2, H=4, Q=4, T=32.
    assert model_flops_per_token(model, 32) == 6 * 5520 + 12 * 2 * 4 * 4 * 32 == 45408


def test_flops_formula_reproduces_palm_table_22():
    """PaLM 8B and 540B (table 1 shapes, all parameters as N, T = 2048): 0.0550 and 3.28 TFLOP per token."""
    assert training_flops_per_token(8.63e9, 32, 16, 256, 2048) / 1e12 == pytest.approx(0.0550, abs=5e-5)
    assert training_flops_per_token(540.35e9, 118, 48, 256, 2048) / 1e12 == pytest.approx(3.28, abs=5e-3)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
     ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
     ("NVIDIA A10", 125.0), ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None), ("cpu", None)],
)  # fmt: skip
def test_datasheet_peak_by_device_name(name, tflops):
    assert datasheet_bf16_tflops(name) == tflops


def test_measured_matmul_peak_is_positive_on_cpu():
    assert measure_matmul_tflops("cpu", size=128, num_iters=2) > 0


@pytest.fixture(scope="module")
def profiled_pretrain(workdir, tmp_path_factory):
    """A tiny pretrain run in-process with the profiler on (wait 1, warmup 1, active 2 of 12 steps)."""
    from llmpipe.config import parse_params
    from llmpipe.stages import pretrain

    out = tmp_path_factory.mktemp("profiled")
    raw = yaml.safe_load((workdir / "params.yaml").read_text())
    raw["paths"] = {"data": str(workdir / "data"), "tokenizer": str(workdir / "artifacts" / "tokenizer"),
                    "output_root": str(out)}  # fmt: skip
    raw["profile"] = {"enabled": True, "wait": 1, "warmup": 1, "active": 2}
    raw.setdefault("pretrain", {})["num_eval_prompts"] = 0  # no samples: the stage must still run (it once crashed)
    params = parse_params(raw)
    return out, pretrain.run(params)


@pytest.mark.slow
def test_training_logs_tokens_per_s_and_peak_memory(profiled_pretrain):
    out, metrics = profiled_pretrain
    rows = list(csv.DictReader((out / "logs" / "pretrain" / "train.csv").open()))
    assert len(rows) == 3, "logging_steps 4 of 12 steps"
    for row in rows:
        assert float(row["tokens_per_s"]) > 0
        assert 0.05 < float(row["peak_memory_gb"]) < 64, "CPU: the process's peak RSS, in GB"
    assert "mfu" not in rows[0], "no datasheet peak on CPU: no mfu column at all, not zeros"
    assert metrics["tokens_per_s"] > 0 and metrics["peak_memory_gb"] >= float(rows[-1]["peak_memory_gb"])
    assert "mfu" not in metrics
    assert (out / "logs" / "pretrain" / "samples.jsonl").read_text() == "", "num_eval_prompts 0: no samples"


@pytest.mark.slow
def test_profiler_writes_a_trace_and_an_ops_table(profiled_pretrain):
    out, _ = profiled_pretrain
    profile = out / "logs" / "pretrain" / "profile"
    trace = json.loads((profile / "trace.json").read_text())
    assert any(e.get("name") == "ProfilerStep#2" for e in trace["traceEvents"]), "active steps 2 and 3 recorded"
    table = (profile / "ops.txt").read_text()
    assert "Self CPU time total" in table and "aten::mm" in table
