"""Tokens/s of the pretrain stage's training loop against a minimal raw PyTorch loop, same model and batch.

    python benchmarks/pretrain_throughput.py                        # bf16, fp32, compile; shipped params.yaml model
    python benchmarks/pretrain_throughput.py --modes fp32 compile-fp32 --rounds 7 --block-steps 6
    python benchmarks/pretrain_throughput.py --params my_params.yaml

Stage loop: the HF `Trainer` that `llmpipe.stages.pretrain.make_trainer` builds (the stage's
`training_kwargs`, TensorBoard callback) run by `llmpipe.train.loop.train_stage` (which adds the stage's
per-step callbacks), on `PackedBlocks` of random token ids drawn from the vocabulary (in memory, stored as the
tokenize stage stores them; the stage memory-maps its token files). Raw loop: the same
`build_model(params.model, …)` weights, `torch.optim.AdamW` with the same lr, betas and weight decay
(decay on matrices only, like the Trainer), the same lr scheduler, `clip_grad_norm_` at `max_grad_norm`,
batches indexed straight out of the blocks (`PackedBlocks.batch`).

Both loops run in one process and alternate: a callback at the end of every `--block-steps`-th Trainer
step runs one raw block, so the rounds go trainer block, raw block, trainer block, … The trainer block's
time runs from the end of the previous raw block to the end of its last step, so it holds everything the
Trainer does per step (data loading, loss, backward, clipping, optimizer, scheduler, logging every
`logging_steps`, callbacks). The first block of each is warm-up and not counted; medians are over the
`--rounds` that follow (on a shared 2-core machine 5 rounds gave fp32 ratios from 0.966 to 0.985, 9 gave
0.998; the Trainer's own per-step cost, printed as "trainer time over raw per step", is ~1.8 ms).
Evaluation and checkpointing are kept out of the timed window: `eval_steps` and `save_steps` are set
beyond it, `max_steps` one past it and the run stopped at its end (the stage's final evaluation and model
save then run, untimed).

Modes: `bf16` (Trainer `bf16=True`, fp32 master weights; raw loop under `torch.autocast("cpu",
torch.bfloat16)`), `fp32`, `compile` (Trainer with `distributed.torch_compile: true` in bf16 autocast
against the raw EAGER bf16 loop; the compile warm-up, first trainer block minus a steady block, is printed
apart: 24-27 s here on a first run, ~7 s once torch's on-disk inductor cache holds the graphs), and
`compile-fp32` (the same in fp32, figures only: does compile pay without bf16?). Targets on 2 CPU cores:
trainer/raw ≥ 0.98 in bf16 and in fp32; compiled trainer ≥ 1.2× raw eager bf16. bf16 only pays on CPUs
with native bf16 (AVX512-BF16/AMX); the script prints whether this one has it. Without it (an AVX2-only
CPU) bf16 matmuls are emulated and a bf16 step of the default model takes ~20 s against ~1 s in fp32, so
there the bf16 modes default to 3 rounds of 1 step. CPU only: GPUs are hidden.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TARGETS = {"bf16": 0.98, "fp32": 0.98, "compile": 1.2, "compile-fp32": None}
"""Mode → lowest trainer/raw tokens/s ratio that passes (None: figures only)."""


def stdlib_text(max_chars: int) -> list[str]:
    """The first `max_chars` characters of the interpreter's stdlib modules (tokenizer training text)."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def build_tokenizer(params):
    """A byte-level BPE of `tokenizer.vocab_size` trained on a few MB of stdlib (as the tokenizer stage does)."""
    from llmpipe.stages.tokenizer import train_bpe

    cfg = params.tokenizer
    return train_bpe(iter(stdlib_text(4_000_000)), cfg.vocab_size, cfg.min_frequency, cfg.model_max_length)


def random_blocks(num_blocks: int, block_size: int, vocab_size: int, seed: int):
    """`PackedBlocks` over random ids of the dtype the tokenize stage would store them in."""
    import numpy as np

    from llmpipe.data.tokens import PackedBlocks, token_dtype

    ids = np.random.default_rng(seed).integers(vocab_size, size=num_blocks * block_size, dtype=token_dtype(vocab_size))
    return PackedBlocks(ids, block_size)


class RawLoop:
    """The minimal PyTorch loop: (B, T) batches of random rows, forward with labels, backward, clip, step."""

    def __init__(self, params, model, blocks, bf16: bool, total_steps: int) -> None:
        import torch
        from transformers import get_scheduler

        cfg = params.pretrain
        self.model, self.blocks, self.bf16, self.cfg = model, blocks, bf16, cfg
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self.sched = get_scheduler(cfg.lr_scheduler_type, self.opt, cfg.warmup_steps, total_steps)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        model.train()

    def block(self, steps: int) -> float:
        """Run `steps` optimizer steps; return the seconds they took."""
        import torch

        start = time.perf_counter()
        for _ in range(steps):
            idx = torch.randint(len(self.blocks), (self.cfg.per_device_train_batch_size,), generator=self.gen)
            x = self.blocks.batch(idx.tolist())  # (B, T) int64
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start


def alternate_callback(raw: RawLoop, block_steps: int, num_blocks: int):
    """A TrainerCallback that times trainer blocks and runs a raw block after each one."""
    from transformers import TrainerCallback

    class Alternate(TrainerCallback):
        def __init__(self) -> None:
            self.trainer_s: list[float] = []
            self.raw_s: list[float] = []
            self._t = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % block_steps:
                return
            self.trainer_s.append(time.perf_counter() - self._t)
            self.raw_s.append(raw.block(block_steps))
            if len(self.trainer_s) == num_blocks:
                control.should_training_stop = True
            self._t = time.perf_counter()

    return Alternate()


def run_mode(mode: str, params_path: Path, rounds: int, block_steps: int, tokenizer, tmp: Path) -> dict[str, float]:
    import torch

    from llmpipe.config import load_params
    from llmpipe.models import build_model
    from llmpipe.stages.pretrain import make_trainer
    from llmpipe.train.checkpoints import Run
    from llmpipe.train.hooks import trainer_hooks
    from llmpipe.train.loop import train_stage

    fp32, compiled = mode.endswith("fp32"), mode.startswith("compile")
    num_blocks = rounds + 1  # the first is warm-up
    window = num_blocks * block_steps
    out = tmp / mode
    params = load_params(
        params_path,
        {
            "paths.output_root": str(out),
            "pretrain.precision": "fp32" if fp32 else "bf16",
            "distributed.torch_compile": compiled,
            "pretrain.max_steps": window + 1,
            "pretrain.warmup_steps": 0,  # params refuse warmup beyond max_steps; the lr value does not change speed
            "pretrain.eval_steps": window + 1,
            "pretrain.save_steps": window + 1,
        },
    )
    cfg = params.pretrain
    train = random_blocks(max(cfg.num_samples or 0, 4096), cfg.max_length, len(tokenizer), cfg.seed)
    valid = random_blocks(cfg.max_eval_samples, cfg.max_length, len(tokenizer), cfg.seed + 1)
    raw = RawLoop(params, build_model(params.model, tokenizer), train, bf16=not fp32, total_steps=window + 1)
    timer = alternate_callback(raw, block_steps, num_blocks)
    run_dir = out / "checkpoints"
    hooks = trainer_hooks(params, "pretrain", run_dir, tokenizer)  # progress and TensorBoard, as the stage has
    trainer = make_trainer(params, build_model(params.model, tokenizer), train, valid, run_dir, [hooks, timer])
    assert trainer.args.bf16 == (not fp32) and trainer.args.torch_compile == compiled
    train_stage(trainer, params, "pretrain", Run(path=run_dir, resume=None), tokenizer)
    assert len(timer.trainer_s) == num_blocks, "the trainer stopped early"
    tokens = block_steps * cfg.per_device_train_batch_size * cfg.max_length
    trainer_tps = statistics.median(tokens / s for s in timer.trainer_s[1:])
    raw_tps = statistics.median(tokens / s for s in timer.raw_s[1:])
    steady = statistics.median(timer.trainer_s[1:])
    del trainer, raw
    torch._dynamo.reset()
    paired = statistics.median(r / t for t, r in zip(timer.trainer_s[1:], timer.raw_s[1:]))
    return {
        "trainer": trainer_tps,
        "raw": raw_tps,
        "ratio": trainer_tps / raw_tps,
        "paired": paired,
        "warmup_s": timer.trainer_s[0] - steady,
        "trainer_blocks": timer.trainer_s[1:],
        "raw_blocks": timer.raw_s[1:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--params", type=Path, default=ROOT / "params.yaml", help="params file (default: the shipped one)"
    )
    parser.add_argument("--modes", nargs="+", choices=list(TARGETS), default=["bf16", "fp32", "compile"])
    parser.add_argument("--rounds", type=int, help="timed trainer/raw block pairs per mode (default 9; 3 slow bf16)")
    parser.add_argument("--block-steps", type=int, help="optimizer steps per block (default 5; 1 slow bf16)")
    args = parser.parse_args()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark: the Trainer must not pick a GPU the raw loop lacks
    logging.basicConfig(level=logging.WARNING)

    import torch
    import transformers

    from llmpipe.config import load_params
    from llmpipe.models import build_model, count_parameters

    transformers.logging.set_verbosity_error()
    params = load_params(args.params)
    tokenizer = build_tokenizer(params)
    cfg = params.pretrain
    native_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    print(
        f"model: {count_parameters(build_model(params.model, tokenizer)) / 1e6:.2f} M parameters, vocab "
        f"{len(tokenizer)}; batch {cfg.per_device_train_batch_size} × {cfg.max_length} tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16: {native_bf16}"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            slow = not native_bf16 and not mode.endswith("fp32")  # emulated bf16: ~20x slower steps
            rounds, block_steps = args.rounds or (3 if slow else 9), args.block_steps or (1 if slow else 5)
            print(f"\n{mode}: {rounds} rounds of {block_steps} steps per loop, after one warm-up block each")
            r = results[mode] = run_mode(mode, args.params, rounds, block_steps, tokenizer, Path(tmp))
            vs = f"raw eager {'fp32' if mode.endswith('fp32') else 'bf16'}" if mode.startswith("compile") else "raw"
            print(
                f"{mode}: trainer {r['trainer']:,.0f} tokens/s, {vs} {r['raw']:,.0f} tokens/s, "
                f"ratio {r['ratio']:.3f} (median of per-round ratios {r['paired']:.3f})"
            )
            print("  trainer blocks (s): " + " ".join(f"{s:.2f}" for s in r["trainer_blocks"]))
            print("  raw blocks (s):     " + " ".join(f"{s:.2f}" for s in r["raw_blocks"]))
            extra_ms = (statistics.median(r["trainer_blocks"]) - statistics.median(r["raw_blocks"])) / block_steps
            print(f"  trainer time over raw per step: {extra_ms * 1e3:+.1f} ms")
            if mode.startswith("compile"):
                print(f"  compile warm-up: {r['warmup_s']:.1f} s (first trainer block minus a steady one)")
    print()
    for mode, r in results.items():
        if TARGETS[mode] is None:
            continue
        ok = r["ratio"] >= TARGETS[mode]
        what = "compiled trainer / raw eager bf16" if mode == "compile" else f"trainer / raw ({mode})"
        print(f"{'PASS' if ok else 'FAIL'} {what} = {r['ratio']:.3f} (target >= {TARGETS[mode]})")


if __name__ == "__main__":
    main()
