"""How the RL stages run `generate` on a CPU: the threads it may use (``generation.num_threads``).

Sampling a completion is one forward pass of a few rows per token: at the shipped sizes each matmul is tiny, and
on a shared 2-core machine torch's intra-op threads spend more time meeting at their barriers than computing (see
docs/rl.md and benchmarks/rl_generation.py for the figures). Neither `GenerationConfig` nor TRL's `GRPOConfig`
has a thread setting, so :func:`generation_threads` sets torch's for the duration of the call and puts it back;
the forward and backward passes of training keep every thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any


@contextmanager
def generation_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with `num_threads` intra-op threads (None: leave torch's setting), restored after.

    Args:
        num_threads: ``generation.num_threads`` (> 0), or None.
    """
    import torch

    if num_threads is None:
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def limit_generation_threads(trainer, num_threads: int | None) -> None:
    """Make a TRL `GRPOTrainer`'s (or `RLOOTrainer`'s) generation run under :func:`generation_threads`.

    Both trainers sample every completion through ``_generate_single_turn`` (TRL 1.16): the instance's method is
    wrapped, as `llmpipe.rl.reference.checkpoint_reference` wraps its checkpoint methods.

    Args:
        trainer: The TRL trainer.
        num_threads: ``<stage>.generation.num_threads``; None leaves the trainer as it is.
    """
    if num_threads is None:
        return
    generate: Callable[..., Any] = trainer._generate_single_turn

    @wraps(generate)
    def with_threads(*args, **kwargs):
        with generation_threads(num_threads):
            return generate(*args, **kwargs)

    trainer._generate_single_turn = with_threads
