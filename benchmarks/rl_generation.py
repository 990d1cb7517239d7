"""Generated tokens/s of PPO's rollout (`llmpipe.rl.ppo.rollout.Rollout.generate`), the current path against the
candidates, in one process at the shipped sizes.

    python benchmarks/rl_generation.py                 # ~3-5 min on 2 shared cores
    python benchmarks/rl_generation.py --rounds 5 --compile

The model is the shipped ``model:`` shape, randomly initialised (``model.init_seed``), with the tokenizer the
tokenizer stage would train (byte-level BPE of ``tokenizer.vocab_size`` on stdlib text). Prompts are stdlib
functions (signature + docstring, `llmpipe.data.functions`) chat-rendered as a user turn, as the prepared SFT
prompts are, those that fit ``ppo.max_length - generation.max_new_tokens``; each round draws
``ppo.per_device_train_batch_size`` of them with a fixed seed. Sampling is ``ppo.generation`` as shipped, under
the rollout's bf16 autocast where the CPU has it (``precision: auto``). An untrained model almost never samples
eos, so a constant is added to the eos logit (``--eos-bias``; 4.7 ends a response after ~40 tokens on average,
about the trained policy's 31-50 in the default run); generate and scoring see the same model.

Variants (every round runs each once, in this order, from the same seed; medians over the rounds after the first):

- ``current``: ``generation.num_threads: null`` (torch's default: every core), ``cache_implementation: dynamic``.
- ``static``: a static KV cache.
- ``threads1``: one intra-op thread while sampling.
- ``threads1+static``: both.
- ``bucketed``: threads1, the batch sorted by prompt length and sampled as two halves (less left padding).
- ``half-batch``: threads1, half the batch: tokens/s at 8 rows, which bounds what letting finished rows leave the
  batch could gain (a decode step's cost hardly depends on the rows at this size).
- ``--compile``: threads1+static with `torch.compile` of the decode step (transformers' `CompileConfig`, forced on
  CPU); its warm-up is printed apart. Off by default: a long warm-up on 2 cores.

A last column counts the rounds whose tokens equal ``current``'s (same rows, same seed); the split variants sample
other rows and are not compared.

Target: the shipped ppo settings (printed) ≥ 2× ``current``. Figures on a shared machine are load-inflated; the
ratio is what this script is for (both ways in one process, interleaved). CPU only.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

TARGET = 2.0
"""Lowest shipped/current tokens/s ratio that passes."""


def stdlib_prompts(tokenizer, max_tokens: int, count: int) -> list[list[int]]:
    """Token ids of up to `count` chat-rendered stdlib function prompts of at most `max_tokens` tokens."""
    from llmpipe.data.functions import extract_functions

    found: list[list[int]] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            functions = extract_functions(source, ast.parse(source), path.name)
        except SyntaxError:
            continue
        for fn in functions:
            text = tokenizer.apply_chat_template([{"role": "user", "content": fn.prompt}], add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= max_tokens:
                found.append(ids)
        if len(found) >= count:
            return found[:count]
    return found


def eos_biased(model, eos_id: int, bias: float):
    """`model` with `bias` added to the eos logit of every forward pass (a forward hook on the output layer)."""

    def add_bias(_module, _inputs, logits):
        logits[..., eos_id] += bias
        return logits

    model.get_output_embeddings().register_forward_hook(add_bias)
    return model


def rollout_for(params, accelerator, tokenizer, policy, **generation):
    """A `Rollout` that can generate (the models and prompts it does not need are left out)."""
    from llmpipe.rl.ppo.rollout import Rollout

    gen = params.ppo.generation.model_copy(update=generation)
    cfg = params.ppo.model_copy(update={"generation": gen})
    return Rollout(cfg, accelerator, tokenizer, policy, None, None, None, None, None, None, None)


def timed(rollout, batches: list[list[list[int]]], seed: int) -> tuple[float, int, list]:
    """Seconds and real generated tokens (up to each first eos) of generating every batch in turn, and the
    sampled sequences."""
    import torch

    torch.manual_seed(seed)
    start = time.perf_counter()
    sampled = []
    with rollout.accelerator.autocast():  # as Rollout.rollout samples
        for batch in batches:
            sampled.append(rollout.generate(batch))
    tokens = sum(int(b.mask.sum()) for b in sampled)
    return time.perf_counter() - start, tokens, [b.input_ids for b in sampled]


@contextmanager
def compiled_decoding(on: bool) -> Iterator[None]:
    """Within the block (when `on`), the rollout's `GenerationConfig` asks transformers to compile the decode step
    on the CPU too (`CompileConfig`, which by default compiles on CUDA-like devices only)."""
    from transformers import CompileConfig

    from llmpipe.train import samples

    if not on:
        yield
        return
    plain = samples.generation_config

    def compiled(*args, **kwargs):
        config = plain(*args, **kwargs)
        config.compile_config = CompileConfig(mode="default", dynamic=False)
        config.compile_config._compile_all_devices = True
        return config

    samples.generation_config = compiled  # Rollout.generate looks it up at each call
    try:
        yield
    finally:
        samples.generation_config = plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of every variant; the first is warm-up")
    parser.add_argument("--eos-bias", type=float, default=4.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="add the compiled decode step (long warm-up)")
    args = parser.parse_args()

    import torch
    from accelerate import Accelerator
    from pretrain_throughput import build_tokenizer

    from llmpipe.config import load_params
    from llmpipe.models import build_model
    from llmpipe.train.arguments import resolve_precision

    params = load_params(args.params)
    tokenizer = build_tokenizer(params)
    policy = eos_biased(build_model(params.model, tokenizer), tokenizer.eos_token_id, args.eos_bias)
    bf16, _ = resolve_precision(params.ppo.precision)
    precision = "bf16" if bf16 else "fp32"  # the rollout's autocast (`llmpipe.rl.ppo.build.build`)
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=True)
    gen, batch_size = params.ppo.generation, params.ppo.per_device_train_batch_size
    prompts = stdlib_prompts(tokenizer, params.ppo.max_length - gen.max_new_tokens, 40 * batch_size)
    print(f"torch threads {torch.get_num_threads()}, precision {precision}, batch {batch_size}, max_new_tokens "
          f"{gen.max_new_tokens}, temperature {gen.temperature}, top_k {gen.top_k}, {len(prompts)} prompts; shipped "
          f"ppo.generation: num_threads {gen.num_threads}, cache_implementation {gen.cache_implementation}")  # fmt: skip

    def make(**g):
        return rollout_for(params, accelerator, tokenizer, policy, **g)

    def sorted_halves(batch):
        batch = sorted(batch, key=len)
        return [batch[: len(batch) // 2], batch[len(batch) // 2 :]]

    variants = {  # name → (rollout, how a batch is split)
        "current": (make(num_threads=None, cache_implementation="dynamic"), lambda b: [b]),
        "static": (make(num_threads=None, cache_implementation="static"), lambda b: [b]),
        "threads1": (make(num_threads=1, cache_implementation="dynamic"), lambda b: [b]),
        "threads1+static": (make(num_threads=1, cache_implementation="static"), lambda b: [b]),
        "bucketed": (make(num_threads=1, cache_implementation=gen.cache_implementation), sorted_halves),
        "half-batch": (make(num_threads=1, cache_implementation=gen.cache_implementation),
                       lambda b: [b[: len(b) // 2]]),
        "shipped": (make(), lambda b: [b]),
    }  # fmt: skip
    if args.compile:
        variants["compile"] = (make(num_threads=1, cache_implementation="static"), lambda b: [b])

    rng = random.Random(args.seed)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    same = dict.fromkeys(variants, 0)
    for round_ in range(args.rounds):
        batch, reference = rng.sample(prompts, batch_size), None
        for name, (rollout, split) in variants.items():
            with compiled_decoding(name == "compile"):
                seconds, tokens, sampled = timed(rollout, split(batch), args.seed + round_)
            if split(batch) == [batch]:  # same rows, same seed: the same tokens as the current path?
                reference = sampled if name == "current" else reference  # current runs first
                same[name] += all(torch.equal(a, b) for a, b in zip(sampled, reference, strict=True))
            if round_ > 0:
                rates[name].append(tokens / seconds)
            elif name == "compile":
                print(f"compile: first round (warm-up included) {seconds:.1f} s")
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)

    base = statistics.median(rates["current"])
    print(f"\n{'variant':<17}{'tokens/s':>10}{'× current':>11}  rounds with current's tokens")
    for name, values in rates.items():
        rate = statistics.median(values)
        tokens = f"{same[name]}/{args.rounds}" if name not in ("bucketed", "half-batch") else "(other rows)"
        print(f"{name:<17}{rate:>10.1f}{rate / base:>11.2f}  {tokens}")
    ratio = statistics.median(rates["shipped"]) / base
    print(f"\nshipped / current = {ratio:.2f} (target ≥ {TARGET}): {'PASS' if ratio >= TARGET else 'FAIL'}"
          " (figures load-inflated when the machine is shared)")  # fmt: skip


if __name__ == "__main__":
    main()
