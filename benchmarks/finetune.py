"""Fine-tuning with adapters: what LoRA costs and saves against full training, and what llmpipe adds over TRL.

    python benchmarks/finetune.py              # ~5-10 min on 2 cores
    python benchmarks/finetune.py --steps 60 --rounds 3

In a temp workspace (the tests' tiny data: prepare and tokenizer of configs/tiny.yaml), on one model saved as
models/pretrain (the shipped `model:` shape, a 4-layer Llama) and the same SFT data and hyperparameters:

1. **tokens/s**: llmpipe's sft stage with ``peft.method: none`` and with ``lora`` (r 8, all-linear), and a plain
   TRL script (`SFTTrainer` + a peft `LoraConfig`, no llmpipe code but the tokens/s meter, llmpipe's
   `ThroughputCallback`, so both sides are measured alike). Each configuration runs `--rounds` times,
   interleaved; the best round counts (a shared machine only ever slows a run down). Target: llmpipe's LoRA sft
   at least 0.95× the plain TRL script.
2. **DPO memory** on a wider model (hidden 1024, 8 layers, ~100 M parameters, so weights outweigh the libraries):
   the peak RSS of the dpo stage with full training (policy + reference model + AdamW state) against LoRA (one
   copy of the weights, the reference = the adapter-disabled policy), each in its own process, read from the last
   training log line (before the merge on save loads a second copy) and at the end of the stage.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.95
LORA = {"method": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
WIDE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
        "intermediate_size": 2752}  # fmt: skip


def workspace(root: Path) -> dict:
    """Prepared tiny data and tokenizer under `root`; returns the raw params (tiny overrides, shipped model)."""
    from llmpipe.config import parse_params
    from llmpipe.stages import prepare, tokenizer

    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    raw.pop("model")  # the shipped 4-layer shape: enough compute per step for tokens/s to mean something
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    os.chdir(root)
    params = parse_params(raw)
    prepare.run(params)
    tokenizer.run(params)
    return raw


def save_base(root: Path, raw: dict, name: str, shape: dict | None = None) -> None:
    """A seeded random Llama of `raw`'s model shape (or `shape`) saved as models/`name`."""
    from llmpipe.config import parse_params
    from llmpipe.models import build_model, load_tokenizer, save_model

    params = parse_params({**raw, "model": shape or {}})
    tok = load_tokenizer(root / params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, root / "models" / name)


def llmpipe_sft(root: Path, raw: dict, peft: dict, steps: int, tag: str) -> float:
    """Mean logged tokens/s of llmpipe's sft stage (its metric) with `peft`."""
    from llmpipe.config import parse_params
    from llmpipe.stages import sft

    run = {**raw, "sft": {**raw["sft"], **schedule(steps), "peft": peft}, "paths": {"output_root": f"out-{tag}"}}
    return sft.run(parse_params(run))["tokens_per_s"]


def schedule(steps: int) -> dict:
    return {"max_steps": steps, "logging_steps": 5, "eval_steps": steps, "save_steps": steps,
            "per_device_train_batch_size": 8}  # fmt: skip


def plain_trl_sft(root: Path, raw: dict, steps: int, tag: str) -> float:
    """Mean logged tokens/s of a plain TRL `SFTTrainer` + peft LoRA script, llmpipe's hyperparameters by hand."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from llmpipe.train.throughput import ThroughputCallback  # the meter only, so both sides are timed alike

    sft_cfg = {**raw["train"], **raw["sft"], **schedule(steps)}
    tok = AutoTokenizer.from_pretrained(root / "artifacts" / "tokenizer")
    model = AutoModelForCausalLM.from_pretrained(root / "models" / "pretrain")
    data = load_dataset("json", data_files=str(root / "data" / "sft" / "train.jsonl"), split="train")
    data = data.select_columns(["messages"])
    bf16, fp16 = _auto_precision()
    args = SFTConfig(
        output_dir=f"out-{tag}", learning_rate=sft_cfg["lr"], per_device_train_batch_size=8, max_steps=steps,
        warmup_steps=sft_cfg["warmup_steps"], lr_scheduler_type="cosine", weight_decay=sft_cfg["weight_decay"],
        logging_steps=5, save_strategy="no", eval_strategy="no", bf16=bf16, fp16=fp16, max_length=sft_cfg["max_length"],
        assistant_only_loss=True, packing=False, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
        include_num_input_tokens_seen=True, report_to="none", seed=42, data_seed=42, dataset_num_proc=None,
    )  # fmt: skip
    lora = LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
                      target_modules="all-linear")  # fmt: skip
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=lora,
                         callbacks=[ThroughputCallback(sft_cfg["max_length"])])  # fmt: skip
    trainer.train()
    rates = [r["tokens_per_s"] for r in trainer.state.log_history if "tokens_per_s" in r]
    return sum(rates) / len(rates)


def _auto_precision() -> tuple[bool, bool]:
    """(bf16, fp16) as llmpipe's `precision: auto` picks them on this device, so both sides train alike."""
    from llmpipe.train.arguments import resolve_precision

    return resolve_precision("auto", "train.precision")


def dpo_peak(root: Path, raw: dict, peft: dict, tag: str) -> tuple[float, float]:
    """Peak RSS (GB) of the dpo stage in its own process: at its last training log line, and at its end."""
    run = {**raw, "model": WIDE, "dpo": {**raw["dpo"], "max_steps": 3, "logging_steps": 1, "eval_steps": 3,
                                          "save_steps": 3, "peft": peft}}  # fmt: skip
    (root / f"params-{tag}.yaml").write_text(yaml.safe_dump(run))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "llmpipe.cli", "--task", "dpo", "--config-path", f"params-{tag}.yaml",
                           "--output-dir", f"out-{tag}"], check=False, cwd=root, env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"dpo ({tag}) failed:\n{done.stderr[-3000:]}")
    rows = list(csv.DictReader((root / f"out-{tag}" / "logs" / "dpo" / "train.csv").open()))
    final = json.loads((root / f"out-{tag}" / "metrics" / "dpo.json").read_text())["peak_memory_gb"]
    return float(rows[-1]["peak_memory_gb"]), final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="sft steps per timed run")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each configuration, interleaved")
    parser.add_argument("--parts", default="sft,dpo", help="sft (tokens/s), dpo (peak RSS) or both")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = workspace(root)
        save_base(root, raw, "pretrain")
        if "sft" in args.parts:
            sft_throughput(root, raw, args.steps, args.rounds)
        if "dpo" in args.parts:
            dpo_memory(root, raw)


def sft_throughput(root: Path, raw: dict, steps: int, rounds: int) -> None:
    """Part 1 of the module docstring: prints tokens/s and the PASS/FAIL line of the TRL ratio."""
    runs: dict[str, list[float]] = {"llmpipe full sft": [], "llmpipe lora sft": [], "plain TRL lora sft": []}
    for i in range(rounds):
        runs["llmpipe full sft"].append(llmpipe_sft(root, raw, {"method": "none"}, steps, f"full{i}"))
        runs["llmpipe lora sft"].append(llmpipe_sft(root, raw, LORA, steps, f"lora{i}"))
        runs["plain TRL lora sft"].append(plain_trl_sft(root, raw, steps, f"trl{i}"))
    best = {k: max(v) for k, v in runs.items()}
    for name, rates in runs.items():
        print(f"{name:>20}: best {best[name]:8.0f} tokens/s (rounds: {' '.join(f'{r:.0f}' for r in rates)})")
    print(f"lora / full sft (llmpipe): {best['llmpipe lora sft'] / best['llmpipe full sft']:.3f}")
    ratio = best["llmpipe lora sft"] / best["plain TRL lora sft"]
    print(f"llmpipe lora / plain TRL lora: {ratio:.3f} (target >= {TARGET_RATIO}) "
          f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}")  # fmt: skip


def dpo_memory(root: Path, raw: dict) -> None:
    """Part 2 of the module docstring: prints the peak RSS of full and LoRA dpo."""
    save_base(root, raw, "sft", WIDE)
    start = time.perf_counter()
    full = dpo_peak(root, raw, {"method": "none"}, "dpo-full")
    lora = dpo_peak(root, raw, LORA, "dpo-lora")
    print(f"dpo on a ~100 M-parameter Llama ({time.perf_counter() - start:.0f} s): peak RSS while training "
          f"full {full[0]:.2f} GB, lora {lora[0]:.2f} GB; at the end (lora: after the merge) full {full[1]:.2f} "
          f"GB, lora {lora[1]:.2f} GB")  # fmt: skip
    print(f"lora dpo holds one copy of the weights: {'PASS' if lora[0] < full[0] else 'FAIL'}")


if __name__ == "__main__":
    main()
