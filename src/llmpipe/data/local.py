"""Users' own files (`data.local`): pretraining documents, and SFT and preference records for
:mod:`llmpipe.data.formats` to normalise."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.data import formats
from llmpipe.data.files import DataFiles, Row, find_files, load_rows


def _require(columns: list[str], needed: Iterable[str], files: DataFiles, shape: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise UserError(
            f"{files.key}: {files.root} has no column {', '.join(f'`{c}`' for c in missing)} "
            f"(found: {', '.join(columns) or 'none'}); {shape}"
        )


def pretrain_documents(files: DataFiles, rows: list[Row], columns: list[str], max_chars: int) -> list[dict[str, Any]]:
    """Documents ``{"text", "source"}`` (cut at `max_chars`).

    Raises:
        UserError: jsonl/parquet without a `text` column, or a row whose `text` is not a string or is empty
            (whitespace only: in users' own files that is an export gone wrong, not a document; a whitespace-only
            paragraph of a .txt file cut by paragraph is skipped).
    """
    _require(columns, ["text"], files, "pretraining data needs a `text` column in jsonl/parquet, or .txt files")
    docs = []
    for row in rows:
        text = row.values["text"]
        if not isinstance(text, str):
            raise UserError(f"{row.where(files)}: `text` must be a string, got {type(text).__name__}")
        if not text.strip() and files.sample_by == "paragraph":  # blank lines between paragraphs, not a document
            continue
        if not text.strip():
            raise UserError(f"{row.where(files)}: `text` is empty (whitespace only); remove the row or give it text")
        docs.append({"text": text[:max_chars], "source": row.source})
    return docs


def local_records(path: str, kind: str, shape: str, cache_dir: str) -> tuple[formats.Records, DataFiles]:
    """The `kind` (``sft`` | ``preference``) records of the files at `path` (`data.local.<kind>`).

    Args:
        path: A file or folder (see :func:`find_files`).
        kind: ``sft`` or ``preference``.
        shape: `data.local.<kind>_format`.
        cache_dir: Arrow cache folder for `datasets`.

    Returns:
        The records (each names its file and row), and the files read.

    Raises:
        UserError: See :func:`find_files` and :func:`load_rows`.
    """
    key = f"data.local.{kind}"
    files = find_files(path, key)
    rows, columns = load_rows(files, cache_dir)
    records = [formats.Record(r.values, r.source, f"{r.source}:{r.number}", r.where(files)) for r in rows]
    return formats.Records(key, str(files.root), columns, records, shape, f"{key}_format"), files
