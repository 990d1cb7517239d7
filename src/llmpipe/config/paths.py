"""`paths`: where every stage reads and writes, the one place a path is written (dvc.yaml templates it)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from llmpipe.config.section import Section


class PathsParams(Section):
    """Where every stage reads and writes, relative to the repository root (dvc.yaml templates these)."""

    data: str = Field("data", description="Prepared datasets: data/{pretrain,sft,preference,eval,tokens}/.")
    tokenizer: str = Field("artifacts/tokenizer", description="Tokenizer directory (save_pretrained).")
    models: str = Field("models", description="Final model directories: models/<stage>/.")
    metrics: str = Field("metrics", description="DVC metrics: metrics/<stage>.json, metrics/eval/<model>.json.")
    logs: str = Field("logs", description="Per-step logs for dvc plots and TensorBoard: logs/<stage>/.")
    checkpoints: str = Field(
        "checkpoints", description="Training checkpoints: checkpoints/<stage>/<fingerprint>/ (git-ignored)."
    )
    reports: str = Field("reports", description="reports/report.md.")
    runs: str = Field("runs", description="Hand runs with CLI overrides write under runs/<task>-<time>/.")
    output_root: str = Field(
        ".",
        description="Root under which a stage writes its outputs; '.' for DVC runs, runs/<task>-<time> for hand runs.",
    )

    def out(self, *parts: str) -> Path:
        """Path a stage writes to: ``output_root/<parts>`` (inputs use the plain fields)."""
        return Path(self.output_root, *parts)
