"""Users' data files: the formats read (:data:`FORMATS`), finding them under a path, checking every file before any
loading, and loading their records through `datasets`.

Files are checked up front, so a user mistake is a :class:`UserError` naming the key, file, line or row and the
fix, never a traceback from inside `datasets`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import decode_line, read_jsonl

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
"""File suffix → `datasets` loader. A .txt file is one document, or one per paragraph (:data:`TXT_SAMPLE_BY`); the
others hold one record per row (a .json file
is a JSON array of records, or JSON lines; a .csv file has a header line)."""


TXT_SAMPLE_BY = ("document", "paragraph")
"""How a .txt file is cut into records (the `datasets` text loader's ``sample_by``): whole, or at each blank line
(``\n\n``; empty paragraphs dropped)."""


@dataclass(frozen=True)
class DataFiles:
    """The files behind one params key, all of one format.

    Attributes:
        key: The params key they come from, e.g. ``data.local.sft`` (for error messages).
        root: The file or folder as given.
        format: ``json``, ``parquet``, ``csv`` or ``text`` (a `datasets` packaged loader); ``""`` for a dataset
            folder given as a hub dataset name (e.g. `data.hf.dataset_name`), which `datasets` reads by its own rules.
        files: The files, sorted; hidden files and folders are ignored.
        num_records: Records in each file; empty for a `data.hf.dataset_name` folder.
        sample_by: How .txt files are cut into records (one of :data:`TXT_SAMPLE_BY`).
    """

    key: str
    root: Path
    format: str
    files: tuple[Path, ...]
    num_records: tuple[int, ...] = ()
    sample_by: str = "document"

    def rel(self, file: Path) -> str:
        """`file` relative to the given folder (its name when a single file was given)."""
        return file.name if self.root.is_file() else file.relative_to(self.root).as_posix()


@dataclass(frozen=True)
class Row:
    """One loaded record and where it came from (``source`` relative path, 1-based ``number`` in its file)."""

    source: str
    number: int
    values: dict[str, Any]

    def where(self, files: DataFiles) -> str:
        """``<file> row <n>`` for error messages."""
        return f"{files.key}: {files.root if files.root.is_file() else files.root / self.source} row {self.number}"


def find_files(path: str | Path, key: str, txt_sample_by: str = "document") -> DataFiles:
    """The data files at `path` (a file, or a folder searched recursively), checked before any loading.

    Args:
        path: A file or folder.
        key: The params key that names it (in messages).
        txt_sample_by: How .txt files are cut into records: one of :data:`TXT_SAMPLE_BY`, or ``auto`` (a single
            file given by itself: one record per paragraph; the files of a folder: one record each).

    Raises:
        UserError: The path does not exist, a folder has no files, a suffix is not one of :data:`FORMATS`,
            formats are mixed, a file is empty, or a jsonl line is not a JSON object (file and line number).
    """
    root = Path(path)
    if not root.exists():
        raise UserError(f"{key}: {root} does not exist; give an existing file or folder (relative to the repo root)")
    if root.is_file():
        files = [root]
    else:
        files = sorted(f for f in root.rglob("*") if f.is_file() and not _hidden(f.relative_to(root)))
    if not files:
        raise UserError(f"{key}: folder {root} has no data files; add {_suffixes()} files")
    unknown = [f for f in files if f.suffix.lower() not in FORMATS]
    if unknown:
        raise UserError(f"{key}: {unknown[0]} has an unsupported suffix; use one of {', '.join(FORMATS)}")
    formats = {FORMATS[f.suffix.lower()] for f in files}
    if len(formats) > 1:
        raise UserError(f"{key}: {root} mixes formats ({', '.join(sorted(formats))}); keep one format per dataset")
    fmt = formats.pop()
    sample_by = txt_sample_by if txt_sample_by != "auto" else "paragraph" if root.is_file() else "document"
    sample_by = sample_by if fmt == "text" else "document"
    counts = tuple(count_records(f, key, sample_by) for f in files)
    return DataFiles(key, root, fmt, tuple(files), counts, sample_by)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _suffixes() -> str:
    return f"{', '.join(list(FORMATS)[:-1])} or {list(FORMATS)[-1]}"


def count_records(file: Path, key: str, sample_by: str = "document") -> int:
    """Records in a data file (a .txt file: one document, or its non-empty paragraphs by `sample_by`, as the
    `datasets` text loader cuts them), checking every text, jsonl and json line is UTF-8,
    every jsonl line or json array item is a JSON object, and a csv file parses.

    Raises:
        UserError: The file is empty or holds no record, a line is not UTF-8 or a jsonl line is not a JSON object
            (file:line), a json file is not valid JSON (file:line:column), or a parquet or csv file cannot be read.
    """
    import pyarrow.parquet as pq

    if file.stat().st_size == 0:
        raise UserError(f"{key}: {file} is empty; remove it or add data")
    suffix = file.suffix.lower()
    if suffix == ".parquet":
        try:
            num = pq.read_metadata(file).num_rows
        except Exception as err:  # noqa: BLE001 — pyarrow's errors for a file that is not parquet
            raise UserError(f"{key}: {file} is not a readable parquet file ({root_cause(err)})") from None
    else:
        try:
            if suffix == ".txt":
                _check_utf8(file)
                num = 1 if sample_by == "document" else _count_paragraphs(file)
            elif suffix == ".jsonl":
                num = len(read_jsonl(file))
            else:
                num = _count_json(file) if suffix == ".json" else _count_csv(file)
        except ValueError as err:  # their messages name the file and line
            raise UserError(f"{key}: {err}") from None
    if not num:
        raise UserError(f"{key}: {file} has no records; remove it or add data")
    return num


def _utf8_lines(file: Path) -> Iterator[str]:
    """The lines of `file`, decoded (a ValueError names the line that is not UTF-8)."""
    with open(file, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            yield decode_line(raw, file, lineno)


def _check_utf8(file: Path) -> None:
    for _ in _utf8_lines(file):
        pass


def _count_paragraphs(file: Path) -> int:
    """Non-empty paragraphs the `datasets` text loader yields (``sample_by="paragraph"``: universal newlines, then a
    split at every ``\n\n``)."""
    with open(file, encoding="utf-8") as fh:
        return sum(1 for part in fh.read().split("\n\n") if part)


def _count_json(file: Path) -> int:
    """Records in a .json file: a JSON array of objects, or JSON lines (what `datasets`' json loader reads).

    Raises:
        ValueError: Not UTF-8 or not valid JSON (file:line[:column]), or an item that is not an object.
    """
    text = "".join(_utf8_lines(file))
    if not text.lstrip().startswith("["):
        return len(read_jsonl(file))
    try:
        records = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{err.lineno}:{err.colno}: not valid JSON ({err.msg}); fix the file") from None
    for i, record in enumerate(records, 1):
        if not isinstance(record, dict):
            raise ValueError(f"{file}: item {i} of the JSON array is {type(record).__name__}, not a JSON object")
    return len(records)


def _count_csv(file: Path) -> int:
    """Records of a .csv file (after its header line), parsed by pandas as `datasets`' csv loader does.

    Raises:
        ValueError: Not UTF-8 (file:line) or not parseable (pandas names the line).
    """
    import pandas as pd

    _check_utf8(file)
    try:
        return len(pd.read_csv(file, dtype=str, na_filter=False))
    except ValueError as err:  # pandas' ParserError and EmptyDataError
        raise ValueError(f"{file} is not a readable CSV file ({root_cause(err)})") from None


def load_rows(files: DataFiles, cache_dir: str) -> tuple[list[Row], list[str]]:
    """Load every record through `datasets`.

    Args:
        files: From :func:`find_files`.
        cache_dir: Folder for the Arrow cache `datasets` writes (a temporary one: nothing outlives the run).

    Returns:
        The rows in file order, and the column names.

    Raises:
        UserError: `datasets` cannot read the files (e.g. files with other columns or a column of mixed types).
    """
    from datasets import load_dataset

    try:
        ds = load_dataset(files.format, data_files=[str(f) for f in files.files], split="train", cache_dir=cache_dir,
                          **loader_options(files))
    except Exception as err:  # noqa: BLE001 — any failure here is in the user's files; say which
        raise UserError(
            f"{files.key}: datasets could not read {files.root}: {root_cause(err)}; all files of one dataset need "
            "the same columns with the same types"
        ) from None
    assert sum(files.num_records) == len(ds), f"{len(ds)} rows loaded, {sum(files.num_records)} counted"
    where = [(files.rel(f), i + 1) for f, n in zip(files.files, files.num_records) for i in range(n)]
    return [Row(src, num, values) for (src, num), values in zip(where, ds.to_list())], list(ds.column_names)


def loader_options(files: DataFiles) -> dict[str, Any]:
    """Options of `files.format`'s `datasets` loader: a .txt file is cut by `files.sample_by`; a csv cell is text as
    written (no numbers, and an empty cell is ``""``, not null)."""
    if files.format == "text":
        return {"sample_by": files.sample_by}
    if files.format == "csv":
        import pandas as pd
        from datasets import Features, Value

        header = pd.read_csv(files.files[0], nrows=0).columns
        return {"na_filter": False, "features": Features({c: Value("string") for c in header})}
    return {}


def hf_local_files(root: Path, key: str) -> DataFiles:
    """Check a local dataset folder or file given as a hub dataset name the way :func:`find_files` checks local data.

    A folder may hold other files (a README, a dataset card); only its data files are checked.

    Args:
        root: The folder or file.
        key: The params key that names it, e.g. ``data.hf.dataset_name`` (for messages).

    Raises:
        UserError: No data file, an empty file, or a line or file that does not parse (see :func:`count_records`).
    """
    if root.is_file():
        return find_files(root, key)
    files = sorted(f for f in root.rglob("*") if f.is_file() and not _hidden(f.relative_to(root)))
    data_files = [f for f in files if f.suffix.lower() in FORMATS]
    if not data_files:
        raise UserError(f"{key}: folder {root} has no data files; add {_suffixes()} files")
    for f in data_files:
        count_records(f, key)
    return DataFiles(key, root, "", tuple(files))
