"""Load a prepared split (jsonl written by `prepare`) as an in-memory `datasets.Dataset` for the trainers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.core.io import read_jsonl


def load_split(path: Path, columns: tuple[str, ...], limit: int | None = None, optional: tuple[str, ...] = (),
               filled: dict[str, Any] | None = None):
    """Rows of a prepared jsonl split, keeping only `columns` (what TRL's trainers expect).

    Args:
        path: A file under ``data/<kind>/<split>.jsonl``.
        columns: Columns to keep, e.g. ``("messages",)`` or ``("prompt", "chosen", "rejected")``.
        limit: Keep at most this many rows (the first ones: prepare already shuffled by hash).
        optional: Columns kept when the first row has them, and then required in every row (e.g. a
            per-pair ``margin``).
        filled: Columns kept in every row, given this value where a row lacks them (the ``tests`` of the task rows
            among the SFT rows of a corpus, which have none).

    Returns:
        A `datasets.Dataset` held in memory (no cache files).

    Raises:
        UserError: The file is missing or empty, or a row lacks a column.
    """
    from datasets import Dataset

    if not path.exists():
        raise UserError(f"{path}: missing; run the prepare stage first (dvc repro prepare)")
    rows = read_jsonl(path)[:limit]
    if not rows:
        raise UserError(f"{path}: no rows; check data.* in params.yaml and rerun prepare")
    columns = columns + tuple(c for c in optional if c in rows[0])
    for lineno, row in enumerate(rows, 1):
        missing = [c for c in columns if c not in row]
        if missing and {"completion", "label"} <= row.keys() and "chosen" in missing:
            raise UserError(f"{path}: unpaired preference rows (prompt, completion, label: the data.local.preference "
                            "or data.hf_preference given), which only dpo.method kto reads; give pairs (prompt, "
                            "chosen, rejected) for the other methods and the reward stage, and rerun prepare")
        if missing:
            raise UserError(f"{path}:{lineno}: missing column(s) {missing}; expected {list(columns)}")
    filled = filled or {}
    return Dataset.from_list([{c: row[c] for c in columns} | {c: row.get(c, v) for c, v in filled.items()}
                              for row in rows])  # fmt: skip
