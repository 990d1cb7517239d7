"""`llm-train intermediate-size HIDDEN [--multiple-of 256] [--ffn-dim-multiplier X]`: the SwiGLU MLP width
(``model.intermediate_size``) for a hidden size, by the rule Llama uses.

Prints the width alone on stdout (for scripts) and the arithmetic on stderr.
"""

from __future__ import annotations

import argparse
import sys

from llmpipe.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train intermediate-size` flags."""
    parser.add_argument("hidden_size", type=int, metavar="HIDDEN", help="model.hidden_size")
    parser.add_argument("--multiple-of", type=int, default=256,
                        help="round the width up to a multiple of this (Llama: 256; Llama 3: 1024)")
    parser.add_argument("--ffn-dim-multiplier", type=float, default=None,
                        help="scale the 2/3·4·hidden width first (Llama 2 70B and Llama 3: 1.3)")


def intermediate_size(hidden_size: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The width of a SwiGLU MLP for `hidden_size`.

    A gated MLP has three matrices where a plain one has two, so its width is 2/3 of the usual 4 × hidden to keep
    the parameter count (Shazeer 2020, "GLU Variants Improve Transformer"); Llama's reference ``FeedForward``
    truncates that to an int, scales it by ``ffn_dim_multiplier`` when given, and rounds up to `multiple_of`
    (hardware-friendly shapes). Llama 7B: 4096 → 11008; Llama 3 8B (1.3, 1024): 4096 → 14336.

    Args:
        hidden_size: The model width (``hidden_size``).
        multiple_of: The width is rounded up to a multiple of this.
        ffn_dim_multiplier: Optional scale applied before the rounding.

    Returns:
        ``intermediate_size``.

    Raises:
        UserError: A non-positive argument.
    """
    if hidden_size <= 0 or multiple_of <= 0 or (ffn_dim_multiplier is not None and ffn_dim_multiplier <= 0):
        raise UserError("HIDDEN, --multiple-of and --ffn-dim-multiplier must be > 0")
    width = int(2 * 4 * hidden_size / 3)
    if ffn_dim_multiplier is not None:
        width = int(ffn_dim_multiplier * width)
    return multiple_of * -(-width // multiple_of)


def run(args: argparse.Namespace) -> int:
    """Print the width (stdout) and how it was reached (stderr)."""
    size = intermediate_size(args.hidden_size, args.multiple_of, args.ffn_dim_multiplier)
    scale = f" × {args.ffn_dim_multiplier}" if args.ffn_dim_multiplier is not None else ""
    print(f"{args.hidden_size} × 4 × 2/3{scale}, rounded up to a multiple of {args.multiple_of}: "
          f"model.intermediate_size: {size}", file=sys.stderr)  # fmt: skip
    print(size)
    return 0
