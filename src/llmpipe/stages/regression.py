"""`regression` task: a hardware and launcher smoke test with plain Accelerate, seconds on a CPU.

A small MLP is fitted to ``y = X·w + ε`` (ε ~ N(0, noise_std²)) with Adam. The best any model can do is the
noise floor: a mean squared error of ``noise_std²``. The run reports what it ran on (world size, Accelerate's
distributed type, device), how close the held-out loss came to the floor, and whether every rank ended with
the same parameters: DDP all-reduces the gradients, so ranks that disagree mean a broken launch or
collective. It runs as ``distributed:`` says: one process, or (``strategy: ddp, num_processes: 2``)
re-launched by the CLI under `accelerate launch` on two ranks, over gloo on a CPU machine.
It is a hand-run task: no DVC stage runs it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from llmpipe.config import Params, RegressionParams
from llmpipe.core.errors import UserError
from llmpipe.distributed.agreement import ranks_agree
from llmpipe.distributed.launch import check_world

log = logging.getLogger(__name__)


def make_data(cfg: RegressionParams) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Training and held-out sets of the same law, identical on every rank (drawn from `cfg.seed`).

    Returns:
        ``x_train``, ``y_train``, ``x_test``, ``y_test``: X ``(num_samples, num_features)`` ~ N(0, 1),
        y ``(num_samples, 1)`` = X·w + noise, w ``(num_features,)`` ~ N(0, 1); the held-out set has as many rows.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    w = torch.randn(cfg.num_features, 1, generator=gen)
    x = torch.randn(2 * cfg.num_samples, cfg.num_features, generator=gen)
    y = x @ w + cfg.noise_std * torch.randn(2 * cfg.num_samples, 1, generator=gen)
    n = cfg.num_samples
    return x[:n], y[:n], x[n:], y[n:]


def build_model(cfg: RegressionParams) -> nn.Module:
    """``Linear(F, hidden) → ReLU → Linear(hidden, 1)``, initialised from `cfg.seed`."""
    torch.manual_seed(cfg.seed)
    return nn.Sequential(nn.Linear(cfg.num_features, cfg.hidden_size), nn.ReLU(), nn.Linear(cfg.hidden_size, 1))


@torch.no_grad()
def mse(model: nn.Module, x: Tensor, y: Tensor) -> float:
    """Mean squared error of `model` on ``x (N, F)``, ``y (N, 1)``."""
    return torch.nn.functional.mse_loss(model(x), y).item()


def run(params: Params) -> dict[str, Any]:
    """Fit the MLP for `regression.max_steps` steps on every rank of the current launch; report.

    The learning rate decays linearly from `regression.lr` to 0, so the last steps settle near the floor.

    Returns:
        ``world_size``, ``strategy`` (distributed.strategy, checked against the launch), ``distributed_type``
        (Accelerate's, e.g. ``NO``, ``MULTI_CPU``, ``FSDP``),
        ``device``, ``steps``, ``initial_loss`` and ``final_loss`` (held-out MSE before and after training),
        ``noise_floor`` (noise_std²), ``loss_over_floor`` (final_loss / noise_floor, 1 is perfect),
        ``ranks_agree`` (every rank's parameter checksum equal to rank 0's, bit for bit) and
        ``checksum_max_abs_diff`` (largest checksum difference from rank 0); both None under fsdp/deepspeed,
        whose ranks hold different shards.

    Raises:
        UserError: The launch gave another world size or strategy than ``distributed:`` says.
    """
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    cfg = params.regression
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    world = check_world(params, accelerator)
    x_train, y_train, x_test, y_test = make_data(cfg)
    x_test, y_test = x_test.to(accelerator.device), y_test.to(accelerator.device)
    model = build_model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / cfg.max_steps))
    loader = DataLoader(
        TensorDataset(x_train, y_train),
        batch_size=cfg.per_device_batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    # The schedule counts this run's optimizer steps, so it is not prepared: Accelerate would step a prepared
    # scheduler once per rank on each step.
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if len(loader) == 0:
        raise UserError(
            f"regression.num_samples ({cfg.num_samples}) gives no full batch of regression.per_device_batch_size "
            f"({cfg.per_device_batch_size}) per rank on {accelerator.num_processes} ranks; raise num_samples"
        )
    initial = mse(model, x_test, y_test)
    step = 0
    while step < cfg.max_steps:
        for x, y in loader:  # (B, F), (B, 1)
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == cfg.max_steps:
                break
    final = mse(model, x_test, y_test)
    replicated = params.distributed.strategy in ("none", "ddp")  # sharded ranks hold different parts by design
    agree, diff = ranks_agree(accelerator, model) if replicated else (None, None)
    metrics = {
        **world,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "steps": step,
        "initial_loss": round(initial, 6),
        "final_loss": round(final, 6),
        "noise_floor": round(cfg.noise_std**2, 6),
        "loss_over_floor": round(final / cfg.noise_std**2, 4),
        "ranks_agree": agree,
        "checksum_max_abs_diff": diff,
    }
    if accelerator.is_main_process:
        log.info("regression: %s", ", ".join(f"{k} {v}" for k, v in metrics.items()))
    return metrics
