"""Do the ranks of a data-parallel run hold the same weights? (DDP keeps replicas in sync only if every rank
takes the same steps; a rank that skipped a step or saw NaN drifts silently.)"""

from __future__ import annotations

from llmpipe.core.errors import UserError


def parameter_checksum(model):
    """Three float64 sums of all parameters (plain, squared, position-weighted): equal parameters give equal
    checksums, and a swap or a sign flip changes at least one. Shape ``(3,)``, on the parameters' device."""
    import torch

    with torch.no_grad():
        flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
        position = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        return torch.stack([flat.sum(), (flat * flat).sum(), (flat * position).sum() / flat.numel()])


def ranks_agree(accelerator, model) -> tuple[bool, float]:
    """Gather every rank's :func:`parameter_checksum` of a replicated (unsharded) model and compare (collective).

    Returns:
        ``(agree, max_abs_diff)``: all checksums bit-identical to rank 0's, and the largest difference.
    """
    import torch

    checksums = accelerator.gather(parameter_checksum(model)[None]).cpu()  # (world_size, 3)
    return bool(torch.equal(checksums, checksums[:1].expand_as(checksums))), (checksums - checksums[0]).abs().max().item()


def same_resume_step(accelerator, stage: str, step: int) -> None:
    """Every rank resumes the same checkpoint step (collective), before training.

    Each rank picks its checkpoint from the folder it sees; a machine that does not see machine 0's checkpoints
    (no shared filesystem) would start from step 0 while machine 0 resumes, and the world would train two runs.

    Raises:
        UserError: The ranks' steps differ (listed per rank).
    """
    import torch

    steps = accelerator.gather(torch.tensor([step], device=accelerator.device)).cpu().tolist()
    if len(set(steps)) > 1:
        raise UserError(
            f"{stage}: the ranks would resume from different checkpoint steps ({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); "
            "a machine that does not see machine 0's checkpoints starts from step 0: resuming a multi-machine run needs "
            "paths.checkpoints on a filesystem every machine shares (or machine 0's run folder copied to the others), "
            "or --restart on every machine"
        )
