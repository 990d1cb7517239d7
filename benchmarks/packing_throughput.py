"""SFT tokens/s packed (`sft.packing: true`) against unpacked, and the final validation loss of both, on the default
SFT data and on an Alpaca-like length distribution.

    python benchmarks/packing_throughput.py                      # ~15-25 min on 2 idle cores
    python benchmarks/packing_throughput.py --samples 160 --rounds 1

In a temp workspace, prepare and tokenizer of the shipped params.yaml (the stdlib SFT pairs, the 4k BPE) and the
shipped `model:` shape, random-initialised, saved as models/pretrain. Two data sets, each trained both ways by
llmpipe's own sft stage on the same `--samples` conversations for one epoch (so packed takes fewer steps), the
shipped sft keys otherwise (batch 8, max_length 256, bf16 where the CPU has it):

1. **default**: the first `--samples` conversations of the prepared data/sft.
2. **alpaca-like**: synthetic conversations whose prompt and response lengths (in tokens) are log-normal, medians
   20 and 60 tokens, a long tail of responses (σ 0.9) as instruction data has; the words are tokens of the same
   BPE, so only the lengths mean anything.

tokens/s counts tokens, not padding: the stage's packing fill times the positions it trained (padding included),
over its training seconds (each logged window's positions over its rate, as benchmarks/gpu_check.sh counts).
The validation loss of each trained model is computed the same way for both (unpacked, TRL's evaluation on the
validation split), so the two are comparable. Each configuration runs `--rounds` times, interleaved; the best
tokens/s counts (a shared machine only slows a run down). Target: packed at least 1.5× unpacked on the default data.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
TARGET_RATIO = 1.5
ALPACA_MEDIANS, ALPACA_SIGMAS = (20, 60), (0.6, 0.9)


def workspace(root: Path) -> dict:
    """Prepared shipped data, tokenizer and a random models/pretrain under `root`; returns the raw params."""
    from llmpipe.config import parse_params
    from llmpipe.models import build_model, load_tokenizer, save_model
    from llmpipe.stages import prepare, tokenizer

    os.chdir(root)
    raw = {"paths": {"output_root": "."}}
    params = parse_params(raw)
    prepare.run(params)
    tokenizer.run(params)
    tok = load_tokenizer(root / params.paths.tokenizer)
    save_model(build_model(params.model, tok), tok, root / "models" / "pretrain")
    return raw


def alpaca_like(root: Path, n: int, seed: int = 0) -> Path:
    """`n` training and n/4 validation conversations of Alpaca-like lengths in ``alpaca/sft`` (module docstring)."""
    import numpy as np

    from llmpipe.models import load_tokenizer

    tok = load_tokenizer(root / "artifacts" / "tokenizer")
    rng = np.random.default_rng(seed)
    words = np.array(sorted(set(range(300, len(tok))) - set(tok.all_special_ids)))
    out = root / "alpaca" / "sft"
    out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", n), ("validation", max(n // 4, 8))):
        lengths = [rng.lognormal(np.log(ALPACA_MEDIANS), ALPACA_SIGMAS).astype(int) + 1 for _ in range(count)]
        rows = [{"messages": [{"role": role, "content": tok.decode(rng.choice(words, size=k))}
                              for role, k in zip(("user", "assistant"), pair)]} for pair in lengths]  # fmt: skip
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out.parent


def sft_run(raw: dict, data: str, samples: int, packing: bool, tag: str) -> dict:
    """The sft stage's metrics on `samples` conversations of `data`, one epoch, packed or not."""
    from llmpipe.config import parse_params
    from llmpipe.stages import sft

    keys = {"packing": packing, "num_samples": samples, "max_steps": -1, "num_train_epochs": 1, "logging_steps": 2,
            "eval_steps": 10_000, "save_steps": 10_000, "num_eval_prompts": 0}  # fmt: skip
    return sft.run(parse_params({**raw, "paths": {"output_root": tag, "data": data}, "sft": keys}))


def tokens_per_s(tag: str, metrics: dict) -> float:
    """Tokens (padding left out) per second of training of the sft run under `tag` (module docstring)."""
    import csv

    rows = [r for r in csv.DictReader(open(Path(tag) / "logs" / "sft" / "train.csv")) if r.get("tokens_per_s")]
    seen = [0.0] + [float(r["num_input_tokens_seen"]) for r in rows]
    seconds = sum((seen[i + 1] - seen[i]) / float(r["tokens_per_s"]) for i, r in enumerate(rows))
    return seen[-1] * metrics["packing_fill"] / seconds


def validation_loss(raw: dict, data: str, model_dir: Path) -> float:
    """The unpacked validation loss of the model in `model_dir` (TRL's evaluation, the sft stage's trainer)."""
    from llmpipe.config import parse_params
    from llmpipe.models import load_model, load_tokenizer
    from llmpipe.stages.sft import SFT

    stage = SFT(parse_params({**raw, "paths": {"output_root": "eval", "data": data}, "sft": {"packing": False}}))
    stage.tokenizer = load_tokenizer(Path(stage.params.paths.tokenizer))
    train, valid = stage.datasets()
    trainer = stage.make_trainer(load_model(model_dir, ""), stage.config(Path("eval")), train, valid, [])
    return trainer.evaluate()["eval_loss"]


def compare(raw: dict, name: str, data: str, samples: int, rounds: int) -> float:
    """Print the figures of one data set; returns packed / unpacked tokens/s (best rounds)."""
    best: dict[bool, tuple[float, dict, str]] = {}
    for i in range(rounds):
        for packing in (False, True):
            tag = f"out-{name}-{'packed' if packing else 'padded'}-{i}"
            m = sft_run(raw, data, samples, packing, tag)
            rate = tokens_per_s(tag, m)
            print(f"  {name} {'packed  ' if packing else 'unpacked'} round {i}: {rate:7.0f} tokens/s (fill "
                  f"{m['packing_fill']:.3f}), {m['steps']} steps")  # fmt: skip
            if packing not in best or rate > best[packing][0]:
                best[packing] = (rate, m, tag)
    ratio = best[True][0] / best[False][0]
    losses = {p: validation_loss(raw, data, Path(best[p][2]) / "models" / "sft") for p in (False, True)}
    print(f"{name}: tokens/s unpacked {best[False][0]:.0f}, packed {best[True][0]:.0f}: {ratio:.2f}×; fill "
          f"{best[False][1]['packing_fill']:.3f} → {best[True][1]['packing_fill']:.3f}; steps {best[False][1]['steps']} → "
          f"{best[True][1]['steps']}; final validation loss (unpacked eval) {losses[False]:.4f} vs {losses[True]:.4f} "
          f"(Δ {losses[True] - losses[False]:+.4f})")  # fmt: skip
    return ratio if math.isfinite(ratio) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=880, help="conversations per run (880: 110 steps of 8)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration, interleaved")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = workspace(root)
        ratio = compare(raw, "default", "data", args.samples, args.rounds)
        compare(raw, "alpaca-like", str(alpaca_like(root, args.samples)), args.samples, args.rounds)
    print(f"packed / unpacked tokens/s on the default data: {ratio:.2f} (target >= {TARGET_RATIO}) "
          f"{'PASS' if ratio >= TARGET_RATIO else 'FAIL'}")


if __name__ == "__main__":
    main()
