"""Pretraining loss after N steps with `train.optim: muon` beside the shipped AdamW, same model, data and schedule.

    python benchmarks/muon_vs_adamw.py                           # the configs/tiny.yaml model, 300 steps
    python benchmarks/muon_vs_adamw.py --model shipped --steps 150 --muon-lr 0.01 0.02 0.04

Each run is the pretrain stage's Trainer (`llmpipe.stages.pretrain.make_trainer`, the stage's `training_kwargs`)
with the optimiser `llmpipe.train.optimizers.attach` gives it, from the same initial weights (`model.init_seed`),
on the same packed blocks of stdlib text tokenised by a byte-level BPE trained here (the tokenizer stage's
`train_bpe`); training batches are drawn in the same seeded order. Printed per run: the mean training loss of
the last logged window, the validation loss after the last step (held-out stdlib modules) and the wall time.
Muon: `muon_lr` on the hidden matrices, the shipped `lr` on embeddings, head and norms (AdamW). CPU only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]


def params_for(model: str, steps: int, **pretrain):
    """The shipped params (plus configs/tiny.yaml's model and tokenizer for ``tiny``) with `steps` pretraining
    steps, evaluation and checkpoints out of the way, and `pretrain` overrides."""
    import yaml

    from llmpipe.config import parse_params
    from llmpipe.orchestration.scratch import deep_merge

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    if model == "tiny":
        tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
        raw = deep_merge(raw, {"model": tiny["model"], "tokenizer": tiny["tokenizer"]})
    over = {"max_steps": steps, "eval_steps": steps + 1, "save_steps": steps + 1, "logging_steps": 10,
            "max_length": 128, **pretrain}  # fmt: skip
    return parse_params(deep_merge(raw, {"pretrain": over}))


def blocks(params, tokenizer):
    """Training and validation `PackedBlocks`: the first stdlib modules, then the next ones held out."""
    from pretrain_throughput import stdlib_text

    from llmpipe.data.tokens import PackedBlocks, pack_ids

    texts = stdlib_text(3_000_000)
    cut = int(len(texts) * 0.9)
    length = params.pretrain.max_length
    return PackedBlocks(pack_ids(texts[:cut], tokenizer), length), PackedBlocks(pack_ids(texts[cut:], tokenizer),
                                                                                 length, max_blocks=256)  # fmt: skip


def run(params, tokenizer, train, valid) -> dict[str, float]:
    """Train one optimiser; return its last logged training loss, final validation loss and seconds."""
    from llmpipe.models import build_model
    from llmpipe.stages.pretrain import make_trainer
    from llmpipe.train.optimizers import attach

    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(params, build_model(params.model, tokenizer), train, valid, Path(out))
        attach(trainer, params.pretrain)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        return {"train_loss": losses[-1], "eval_loss": trainer.evaluate()["eval_loss"], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "shipped"], default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--muon-lr", type=float, nargs="+", default=[0.02])
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from pretrain_throughput import build_tokenizer

    base = params_for(args.model, args.steps)
    tokenizer = build_tokenizer(base)
    train, valid = blocks(base, tokenizer)
    print(f"model {args.model}, {args.steps} steps × {base.pretrain.per_device_train_batch_size} × "
          f"{base.pretrain.max_length} tokens, lr {base.pretrain.lr}, {base.pretrain.lr_scheduler_type}, "
          f"precision {base.pretrain.precision}; {len(train)} train / {len(valid)} validation blocks")  # fmt: skip
    variants = [("adamw_torch", base)] + [
        (f"muon muon_lr={lr}", params_for(args.model, args.steps, optim="muon", muon_lr=lr)) for lr in args.muon_lr
    ]
    for name, params in variants:
        r = run(params, tokenizer, train, valid)
        print(f"{name:24s} train_loss {r['train_loss']:.4f}  eval_loss {r['eval_loss']:.4f}  {r['seconds']:.1f} s")


if __name__ == "__main__":
    main()
