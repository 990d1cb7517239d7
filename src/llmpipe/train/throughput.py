"""How fast and how big a training run is: tokens/s, peak memory and model FLOPs utilization (MFU).

MFU (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", §4.1 and appendix B) is the
observed token throughput times the model FLOPs each token needs (forward + backward, no recomputation),
over the devices' peak matmul FLOP/s. The numerator uses :func:`training_flops_per_token`; the denominator
the datasheet dense bf16 peak of :data:`DATASHEET_BF16_TFLOPS`, so MFU is comparable across runs and
papers. :func:`measure_matmul_tflops` measures what a few large bf16 matmuls really reach on the current
device, printed beside the datasheet figure (a run cannot beat the measured figure; the gap between the two
is the device's own shortfall, not the training code's).

torch is imported inside the functions that use it; at module level only transformers' `TrainerCallback` is (the
base of :class:`ThroughputCallback`). Nothing here reads params.
"""

from __future__ import annotations

import logging
import re
import resource
import sys
import time
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger(__name__)

BYTES_PER_GB = 1e9
"""Memory figures are in GB of 10^9 bytes (not GiB)."""

DATASHEET_BF16_TFLOPS: tuple[tuple[str, float, str], ...] = (
    (r"\bH200\b", 989.0, "NVIDIA H200 datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity (SXM)"),
    (r"\bH100\b.*\bNVL\b", 835.0, "NVIDIA H100 datasheet: BF16 1,671 TFLOPS with sparsity (NVL)"),
    (r"\bH100\b.*\bPCIe\b", 756.0, "NVIDIA H100 datasheet: BF16 1,513 TFLOPS with sparsity (PCIe)"),
    (r"\bH100\b", 989.0, "NVIDIA H100 datasheet: BF16 1,979 TFLOPS with sparsity (SXM)"),
    (r"\bA100\b", 312.0, "NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity), SXM and PCIe"),
    (r"\bL40S\b", 362.0, "NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity)"),
    (r"\bL4\b", 121.0, "NVIDIA L4 datasheet: BF16 Tensor Core 242 TFLOPS with sparsity"),
    (r"\bA10\b", 125.0, "NVIDIA A10 datasheet: BF16 Tensor Core 125 TFLOPS (250 with sparsity)"),
)
"""Dense (no 2:4 sparsity) bf16 tensor-core peaks in TFLOP/s by device-name pattern, most specific first, with
their source. Datasheets quote the sparse figure for Hopper parts; the dense peak is half of it. CPUs and
devices not listed have no entry, so no MFU is reported for them."""


def datasheet_bf16_tflops(device_name: str) -> float | None:
    """The datasheet dense bf16 peak of a device, or None when it is not in :data:`DATASHEET_BF16_TFLOPS`.

    Args:
        device_name: As `torch.cuda.get_device_name()` gives it, e.g. ``"NVIDIA H100 80GB HBM3"``.

    Returns:
        TFLOP/s per device, or None.
    """
    for pattern, tflops, _source in DATASHEET_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def training_flops_per_token(
    num_matmul_parameters: int, num_layers: int, num_heads: int, head_dim: int, seq_len_tokens: int
) -> int:
    """Model FLOPs to train on one token: ``6N + 12·L·H·Q·T`` (PaLM, Chowdhery et al. 2022, appendix B).

    ``6N``: each weight takes part in one multiply-add (2 FLOPs) per token in the forward pass and two in the
    backward pass (gradients with respect to the input and to the weight), Kaplan et al. 2020. ``12·L·H·Q·T``:
    the attention-score and attention-value matmuls, ``2·2·Q·T`` FLOPs per token, head and layer forward and
    twice that backward; T is the full sequence length (the causal mask is not discounted, as in the paper).
    Recomputation (activation checkpointing) is not counted: MFU measures the model's FLOPs, not the hardware's.

    Args:
        num_matmul_parameters: N; see :func:`matmul_parameters` for which parameters count.
        num_layers: L, decoder layers.
        num_heads: H, query heads (with grouped-query attention every query head still attends over T keys).
        head_dim: Q, dimension of one head.
        seq_len_tokens: T, sequence length.

    Returns:
        FLOPs per trained token.
    """
    return 6 * num_matmul_parameters + 12 * num_layers * num_heads * head_dim * seq_len_tokens


def matmul_parameters(model) -> int:
    """N of :func:`training_flops_per_token` for a transformers model: its parameters, each counted once,
    less the input embedding table unless it is tied to the output projection.

    PaLM's N is the whole parameter count, its input and output embeddings being one shared matrix
    (appendix B with table 1: 8.63 B parameters give table 22's 0.0550 TFLOP per token, 6 × 8.63e9 +
    12 × 32 × 16 × 256 × 2048; without the 1.05 B embedding it would be 0.0487). Counting the shared
    matrix once counts the output projection (logits, ``2·d·V`` FLOPs per token forward), which is a
    matmul, and not the input lookup, which is not. An untied model has a separate lookup table that does no
    matmul, so it is left out; its LM head stays in. A sequence-classification head is counted like any
    other weight. Norm weights and biases are counted, as in the paper's N (a negligible share).
    """
    total = sum(p.numel() for p in model.parameters())  # `parameters()` yields a tied matrix once
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is not None and outputs.weight is inputs.weight:
        return total
    return total - inputs.weight.numel()


def model_flops_per_token(model, seq_len_tokens: int) -> int:
    """:func:`training_flops_per_token` of a transformers decoder (Llama-style config names).

    Args:
        model: A `PreTrainedModel` whose config has ``num_hidden_layers``, ``num_attention_heads`` and
            ``hidden_size`` (``head_dim`` where it is set).
        seq_len_tokens: T, the sequence length trained on.
    """
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return training_flops_per_token(
        matmul_parameters(model), cfg.num_hidden_layers, cfg.num_attention_heads, head_dim, seq_len_tokens
    )


def reset_peak_memory(device) -> None:
    """Start a new CUDA peak-memory window on `device` (a no-op elsewhere: a process's peak RSS cannot be reset)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device) -> float:
    """Peak memory of this process, GB (10^9 bytes).

    On a CUDA device, the most tensor memory allocated on it since the last :func:`reset_peak_memory`
    (`torch.cuda.max_memory_allocated`; the caching allocator reserves more). Elsewhere, the process's peak
    resident set size since it started (`getrusage`), which includes Python, libraries and the data.
    """
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / BYTES_PER_GB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak * (1 if sys.platform == "darwin" else 1024) / BYTES_PER_GB


def measure_matmul_tflops(device, size: int = 8192, num_iters: int = 20, dtype=None) -> float:
    """Achieved matmul throughput of `device`: `num_iters` products of two ``(size, size)`` matrices.

    Each product is ``2·size³`` FLOPs; one untimed product warms up first. On CUDA this takes well under a
    second for the default size on a datacenter GPU and allocates 3 × size² elements (0.4 GB in bf16);
    on a CPU the default size takes minutes, so pass a smaller one there.

    Args:
        device: Where to multiply.
        size: Matrix side.
        num_iters: Timed products.
        dtype: Element type; default bf16.

    Returns:
        TFLOP/s.
    """
    import torch

    dtype = dtype or torch.bfloat16
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    out = a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(num_iters):
        torch.matmul(a, b, out=out)
    sync(device)
    elapsed = time.perf_counter() - start
    del a, b, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size**3 * num_iters / elapsed / 1e12


def device_peak_tflops(device) -> tuple[float | None, str]:
    """The datasheet dense bf16 peak of `device` (None on CPU and unlisted devices) and the device's name."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None, device.type
    name = torch.cuda.get_device_name(device)
    return datasheet_bf16_tflops(name), name


PAIR_INPUTS = ("chosen_input_ids", "rejected_input_ids")
"""The token tensors of a TRL CPO/ORPO batch (``experimental.cpo``, ``experimental.orpo``), which has no ``input_ids``."""


def counting_pair_tokens(trainer_cls: type) -> type:
    """`trainer_cls` (TRL's CPO or ORPO trainer) counting the tokens of both sequences of each pair into
    ``state.num_input_tokens_seen``.

    The Trainer counts ``inputs[model.main_input_name]`` (``input_ids``) and counts nothing, with one warning, in
    a batch without it: CPO, SimPO and ORPO then logged 0 tokens/s. This overrides the Trainer's own counting hook
    (``_track_num_input_tokens``, transformers 5) for such batches only, as it counts (padding included, every rank
    summed); a batch that has ``input_ids`` is counted by the Trainer as before.
    """

    class CountingPairTokens(trainer_cls):
        def _track_num_input_tokens(self, inputs):
            if "input_ids" in inputs or not all(k in inputs for k in PAIR_INPUTS):
                return super()._track_num_input_tokens(inputs)
            if self.args.include_num_input_tokens_seen == "no":
                return None
            import torch

            tokens = torch.as_tensor(sum(inputs[k].numel() for k in PAIR_INPUTS), device=self.args.device,
                                     dtype=torch.int64)  # fmt: skip
            self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()
            return None

    CountingPairTokens.__name__ = CountingPairTokens.__qualname__ = trainer_cls.__name__
    return CountingPairTokens


class ThroughputCallback(TrainerCallback):
    """Trainer callback adding ``tokens_per_s``, ``peak_memory_gb`` and, on a device with a known peak, ``mfu``
    to every training log entry.

    - ``tokens_per_s``: input tokens of all ranks (``state.num_input_tokens_seen``, padding included) per
      second of wall time since the previous log entry.
    - ``peak_memory_gb``: :func:`peak_memory_gb` of this process (rank 0's is the one logged), since training
      began on CUDA, since the process started on CPU.
    - ``mfu``: ``tokens_per_s × flops_per_token / (peak FLOP/s × devices)``, a fraction in [0, 1]; the key is
      absent (not 0) where the peak is unknown, e.g. on CPU.

    MFU counts the trained model's forward and backward passes only: DPO's reference-model forwards and GRPO's
    generation are work the formula leaves out, so their MFU understates how busy the device is.

    On CUDA it also logs, once at train start, the measured bf16 matmul TFLOP/s beside the datasheet peak.
    It must run before the printing and TensorBoard callbacks, so insert it first.

    Args:
        seq_len_tokens: T of the FLOPs formula, the stage's sequence length (exact for packed blocks; for
            padded batches it is an upper bound of the batch length, so MFU is slightly overstated).
        measure_peak: Measure the achieved matmul peak at train start (CUDA only).
    """

    def __init__(self, seq_len_tokens: int, measure_peak: bool = True) -> None:
        self.seq_len_tokens = seq_len_tokens
        self.measure_peak = measure_peak
        self.flops_per_token: int | None = None
        self.peak_tflops: float | None = None
        self.measured_tflops: float | None = None
        self._device = None
        self._t: float | None = None
        self._tokens = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._device = args.device
        self.peak_tflops, name = device_peak_tflops(self._device)
        if model is not None:
            try:
                self.flops_per_token = model_flops_per_token(model, self.seq_len_tokens)
            except AttributeError as err:  # a model without the Llama-style config names: no MFU
                log.info("throughput: no FLOPs count for %s (%s); mfu not logged", type(model).__name__, err)
        reset_peak_memory(self._device)
        if self.measure_peak and self._device.type == "cuda":
            self.measured_tflops = measure_matmul_tflops(self._device)
        datasheet = f"{self.peak_tflops:.0f}" if self.peak_tflops else "unknown"
        measured = f", measured {self.measured_tflops:.0f}" if self.measured_tflops else ""
        log.info(
            "throughput: %s, bf16 matmul peak TFLOP/s: datasheet %s%s; %s training FLOPs per token (T=%d)",
            name, datasheet, measured, f"{self.flops_per_token:.3g}" if self.flops_per_token else "no",
            self.seq_len_tokens,
        )  # fmt: skip
        self._t, self._tokens = time.perf_counter(), state.num_input_tokens_seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self._t is None:
            return
        now = time.perf_counter()
        rate = (state.num_input_tokens_seen - self._tokens) / max(now - self._t, 1e-9)
        self._t, self._tokens = now, state.num_input_tokens_seen
        added: dict[str, Any] = {
            "tokens_per_s": round(rate, 1),
            "peak_memory_gb": round(peak_memory_gb(self._device), 4),
        }
        if self.peak_tflops and self.flops_per_token:
            added["mfu"] = round(rate * self.flops_per_token / (self.peak_tflops * 1e12 * args.world_size), 5)
        logs.update(added)
        if state.log_history:
            state.log_history[-1].update(added)
