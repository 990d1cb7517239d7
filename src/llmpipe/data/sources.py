"""Users' own data (`data.source: local`) and Hugging Face datasets (`data.source: hf`), via `datasets` loaders.

Local files are read with ``load_dataset("json" | "parquet" | "text", data_files=...)``; a hub dataset with
``load_dataset(name, config, split=...)``, where a local folder (or file) as `name` works the same, offline.
Shapes are checked up front, so a user mistake is a :class:`UserError` naming the key, file, line or row and
the fix, never a traceback from inside `datasets`. Rows are normalised to the shapes the stdlib corpus writes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import DataParams, HFSourceParams
from llmpipe.data.corpus import Corpus
from llmpipe.data.splits import split_by_key
from llmpipe.errors import UserError, root_cause
from llmpipe.io import decode_line, read_jsonl

FORMATS = {".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
"""File suffix → `datasets` loader. A .txt file is one document; jsonl/parquet hold one row per record."""

Rows = list[dict[str, Any]]

SFT_SHAPES = "a `messages` column (list of {role, content}), or `prompt` + `completion` columns"
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class DataFiles:
    """The files behind one params key, all of one format.

    Attributes:
        key: The params key they come from, e.g. ``data.local.sft`` (for error messages).
        root: The file or folder as given.
        format: ``json``, ``parquet`` or ``text`` (a `datasets` packaged loader); ``""`` for a dataset folder
            given as `data.hf.dataset_name`, which `datasets` reads by its own rules.
        files: The files, sorted; hidden files and folders are ignored.
        num_records: Records in each file (a .txt file is one); empty for a `data.hf.dataset_name` folder.
    """

    key: str
    root: Path
    format: str
    files: tuple[Path, ...]
    num_records: tuple[int, ...] = ()

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


def find_files(path: str | Path, key: str) -> DataFiles:
    """The data files at `path` (a file, or a folder searched recursively), checked before any loading.

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
        raise UserError(f"{key}: folder {root} has no data files; add .jsonl, .parquet or .txt files")
    unknown = [f for f in files if f.suffix.lower() not in FORMATS]
    if unknown:
        raise UserError(f"{key}: {unknown[0]} has an unsupported suffix; use one of {', '.join(FORMATS)}")
    formats = {FORMATS[f.suffix.lower()] for f in files}
    if len(formats) > 1:
        raise UserError(f"{key}: {root} mixes formats ({', '.join(sorted(formats))}); keep one format per dataset")
    counts = tuple(count_records(f, key) for f in files)
    return DataFiles(key, root, formats.pop(), tuple(files), counts)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def count_records(file: Path, key: str) -> int:
    """Records in a data file (a .txt file is one document), checking every jsonl line parses.

    Raises:
        UserError: The file is empty or holds no record, a text or jsonl line is not UTF-8 or a jsonl line is not
            a JSON object (file:line), or a parquet file cannot be read.
    """
    import pyarrow.parquet as pq

    if file.stat().st_size == 0:
        raise UserError(f"{key}: {file} is empty; remove it or add data")
    suffix = file.suffix.lower()
    if suffix == ".txt":
        try:
            with open(file, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    decode_line(raw, file, lineno)
        except ValueError as err:
            raise UserError(f"{key}: {err}") from None
        return 1
    if suffix == ".jsonl":
        try:
            num = len(read_jsonl(file))
        except ValueError as err:  # read_jsonl's errors name the file and line
            raise UserError(f"{key}: {err}") from None
    else:
        try:
            num = pq.read_metadata(file).num_rows
        except Exception as err:  # noqa: BLE001 — pyarrow's errors for a file that is not parquet
            raise UserError(f"{key}: {file} is not a readable parquet file ({root_cause(err)})") from None
    if not num:
        raise UserError(f"{key}: {file} has no records; remove it or add data")
    return num


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

    kwargs = {"sample_by": "document"} if files.format == "text" else {}
    try:
        ds = load_dataset(
            files.format, data_files=[str(f) for f in files.files], split="train", cache_dir=cache_dir, **kwargs
        )
    except Exception as err:  # noqa: BLE001 — any failure here is in the user's files; say which
        raise UserError(
            f"{files.key}: datasets could not read {files.root}: {root_cause(err)}; all files of one dataset need "
            "the same columns with the same types"
        ) from None
    assert sum(files.num_records) == len(ds), f"{len(ds)} rows loaded, {sum(files.num_records)} counted"
    where = [(files.rel(f), i + 1) for f, n in zip(files.files, files.num_records) for i in range(n)]
    return [Row(src, num, values) for (src, num), values in zip(where, ds.to_list())], list(ds.column_names)


def _require(columns: list[str], needed: Iterable[str], files: DataFiles, shape: str) -> None:
    missing = [c for c in needed if c not in columns]
    if missing:
        raise UserError(
            f"{files.key}: {files.root} has no column {', '.join(f'`{c}`' for c in missing)} "
            f"(found: {', '.join(columns) or 'none'}); {shape}"
        )


def _messages(value: Any, role: str, where: str, column: str) -> list[dict[str, str]]:
    """A string as one `role` message, or a validated list of ``{role, content}`` messages."""
    if value is None:
        raise UserError(f"{where}: `{column}` is missing (or null); give it a string or a list of {{role, content}}")
    if isinstance(value, str) and value.strip():
        return [{"role": role, "content": value}]
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )
    if not ok:
        raise UserError(
            f"{where}: `{column}` must be a non-empty string or a list of {{role, content}} messages, "
            f"got {json.dumps(value, default=str)[:80]}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def pretrain_documents(files: DataFiles, rows: list[Row], columns: list[str], max_chars: int) -> list[dict[str, Any]]:
    """Documents ``{"text", "source"}`` (cut at `max_chars`).

    Raises:
        UserError: jsonl/parquet without a `text` column, or a row whose `text` is not a string or is empty
            (whitespace only: in users' own files that is an export gone wrong, not a document).
    """
    _require(columns, ["text"], files, "pretraining data needs a `text` column in jsonl/parquet, or .txt files")
    docs = []
    for row in rows:
        text = row.values["text"]
        if not isinstance(text, str):
            raise UserError(f"{row.where(files)}: `text` must be a string, got {type(text).__name__}")
        if not text.strip():
            raise UserError(f"{row.where(files)}: `text` is empty (whitespace only); remove the row or give it text")
        docs.append({"text": text[:max_chars], "source": row.source})
    return docs


def sft_rows(files: DataFiles, rows: list[Row], columns: list[str]) -> list[dict[str, Any]]:
    """Chat rows ``{"messages", "name", "source"}``; `prompt` + `completion` become a user and an assistant turn.

    Raises:
        UserError: Neither accepted shape is present, or a row's messages are malformed or have no assistant turn.
    """
    if "messages" not in columns:
        _require(columns, ["prompt", "completion"], files, f"SFT data needs {SFT_SHAPES}")
    out = []
    for row in rows:
        where, v = row.where(files), row.values
        if "messages" in columns:
            if isinstance(v["messages"], str):
                raise UserError(f"{where}: `messages` must be a list of {{role, content}} messages, not a string")
            messages = _messages(v["messages"], "user", where, "messages")
        else:
            messages = _messages(v["prompt"], "user", where, "prompt") + _messages(
                v["completion"], "assistant", where, "completion"
            )
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise UserError(f"{where}: no assistant message with content to learn from; add a "
                            "{role: assistant, content} turn")
        out.append({"messages": messages, "name": f"{row.source}:{row.number}", "source": row.source})
    return out


def preference_rows(files: DataFiles, rows: list[Row], columns: list[str]) -> list[dict[str, Any]]:
    """TRL conversational preference rows ``{"prompt", "chosen", "rejected", "corruption": "none", "name", "source"}``.

    Strings become one message (user for the prompt, assistant for the answers).

    Raises:
        UserError: A column of `prompt`/`chosen`/`rejected` is missing, or a value is empty or malformed.
    """
    _require(columns, PREFERENCE_COLUMNS, files, "preference data needs `prompt`, `chosen` and `rejected` columns")
    out = []
    for row in rows:
        where, v = row.where(files), row.values
        out.append(
            {
                "prompt": _messages(v["prompt"], "user", where, "prompt"),
                "chosen": _messages(v["chosen"], "assistant", where, "chosen"),
                "rejected": _messages(v["rejected"], "assistant", where, "rejected"),
                "corruption": "none",
                "name": f"{row.source}:{row.number}",
                "source": row.source,
            }
        )
    return out


def hf_local_files(root: Path) -> DataFiles:
    """Check a local dataset folder or file given as `data.hf.dataset_name` the way :func:`find_files` checks local data.

    A folder may hold other files (a README, a dataset card); only its data files are checked.

    Raises:
        UserError: No data file, an empty file, or a jsonl line that is not a JSON object.
    """
    if root.is_file():
        return find_files(root, "data.hf.dataset_name")
    files = sorted(f for f in root.rglob("*") if f.is_file() and not _hidden(f.relative_to(root)))
    data_files = [f for f in files if f.suffix.lower() in FORMATS]
    if not data_files:
        raise UserError(f"data.hf.dataset_name: folder {root} has no data files; add .jsonl, .parquet or .txt files")
    for f in data_files:
        count_records(f, "data.hf.dataset_name")
    return DataFiles("data.hf.dataset_name", root, "", tuple(files))


def hf_documents(hf: HFSourceParams, max_chars: int, cache_dir: str) -> tuple[list[dict[str, Any]], DataFiles | None]:
    """Documents ``{"text", "source"}`` from ``load_dataset(hf.dataset_name, hf.dataset_config, split=hf.split)``.

    A local folder as `hf.dataset_name` is loaded by `datasets`' folder inference, a local file by its format
    loader (both checked first, jsonl line by line); anything else is a hub name, which needs the network or
    the HF cache. At most `hf.max_documents` rows are read, streamed (so a hub dataset is not downloaded whole).

    Returns:
        The documents, and the local files read (None for a hub dataset).

    Raises:
        UserError: The dataset cannot be loaded, lacks `hf.text_column`, or a text is not a string.
    """
    local = Path(hf.dataset_name)
    files = hf_local_files(local) if local.exists() else None
    ds = _load_hf(hf, files, cache_dir)
    if ds.column_names is not None:  # a streamed dataset may not know its columns before the first row
        _require_text_column(hf, list(ds.column_names))
    source = f"{local.name if files else hf.dataset_name}:{hf.split}"
    docs = []
    for i, row in enumerate(itertools.islice(ds, hf.max_documents)):
        _require_text_column(hf, list(row))
        text = row[hf.text_column]
        if not isinstance(text, str):
            raise UserError(f"data.hf.dataset_name: {hf.dataset_name!r} row {i + 1}: `{hf.text_column}` is {type(text).__name__}, "
                            "not a string")
        if text.strip():
            docs.append({"text": text[:max_chars], "source": source})
    return docs, files


def _load_hf(hf: HFSourceParams, files: DataFiles | None, cache_dir: str) -> Any:
    """``load_dataset`` of `hf.dataset_name`: a local file by its format loader, a folder or hub name as a dataset."""
    from datasets import load_dataset

    if files is not None and files.root.is_file():
        args, kwargs = (files.format,), {"data_files": str(files.root)}
    else:
        args, kwargs = (hf.dataset_name, hf.dataset_config), {}
    if files is not None and files.format == "text":
        kwargs["sample_by"] = "document"
    cache = cache_dir if files else None  # a hub dataset uses the HF cache, so it is downloaded once
    try:
        return load_dataset(*args, split=hf.split, streaming=hf.max_documents is not None, cache_dir=cache, **kwargs)
    except Exception as err:  # noqa: BLE001 — report it as the user's dataset problem
        raise UserError(
            f"data.hf.dataset_name: could not load {hf.dataset_name!r} (config {hf.dataset_config!r}, split {hf.split!r}): "
            f"{root_cause(err)}; a hub name needs the network or the HF cache, a local path must exist"
        ) from None


def _require_text_column(hf: HFSourceParams, columns: list[str]) -> None:
    if hf.text_column not in columns:
        raise UserError(
            f"data.hf.text_column: {hf.dataset_name!r} has no column `{hf.text_column}` (found: {', '.join(columns)}); "
            "set data.hf.text_column to the column holding the text"
        )


def content_sha256(read: list[DataFiles], hub_docs: list[dict[str, Any]]) -> str:
    """sha256 (hex) over (key, relative path, bytes) of the files read, then the texts of hub documents."""
    digest = hashlib.sha256()
    for files in read:
        for f in files.files:
            raw = f.read_bytes()
            digest.update(f"{files.key}/{files.rel(f)}".encode() + b"\0" + len(raw).to_bytes(8, "big") + raw)
    for doc in hub_docs:
        raw = doc["text"].encode()
        digest.update(len(raw).to_bytes(8, "big") + raw)
    return digest.hexdigest()


def _load_all(data: DataParams) -> tuple[Rows, Rows, Rows, list[DataFiles], bool]:
    """Pretraining documents, SFT rows, preference rows, the local files read, and whether the text is from the hub."""
    read: list[DataFiles] = []
    with tempfile.TemporaryDirectory(prefix="llmpipe-datasets-") as cache:
        if data.streaming:  # pretrain streams the source; prepare keeps a sample for the tokenizer and held-out splits
            from llmpipe.data.stream import sample

            docs = sample(data, data.stream.sample_documents, cache)
        elif data.source == "local":
            read.append(find_files(data.local.pretrain, "data.local.pretrain"))
            docs = pretrain_documents(read[-1], *load_rows(read[-1], cache), data.max_chars_per_document)
        else:
            docs, files = hf_documents(data.hf, data.max_chars_per_document, cache)
            read += [files] if files else []
        sft: Rows = []
        preference: Rows = []
        if data.local.sft:
            read.append(find_files(data.local.sft, "data.local.sft"))
            sft = sft_rows(read[-1], *load_rows(read[-1], cache))
        if data.local.preference:
            read.append(find_files(data.local.preference, "data.local.preference"))
            preference = preference_rows(read[-1], *load_rows(read[-1], cache))
    from_hub = data.streaming or (data.source == "hf" and not Path(data.hf.dataset_name).exists())
    return docs, sft, preference, read, from_hub


def _prompt_key(messages: list[dict[str, str]]) -> str:
    """The conversation before its last assistant turn, as JSON: the split key of an SFT row."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return json.dumps(messages[:last], sort_keys=True)


def build_corpus(data: DataParams) -> Corpus:
    """Read `data.local` / `data.hf`, split every dataset by the hash of (seed, content) and return it.

    Pretraining documents are keyed by their text, SFT rows by the conversation before the last assistant
    turn, preference rows by their prompt: equal keys share a split, so a duplicate never straddles two.
    `data.local.sft` and `data.local.preference` are read for both sources; the signature MC set is empty.

    Raises:
        UserError: Any problem with the given paths or their contents (see :func:`find_files` and the row
            builders).
    """
    docs, sft, preference, read, from_hub = _load_all(data)
    seed, vf, tf = data.seed, data.validation_fraction, data.test_fraction
    where = {"hf": data.hf.dataset_name, "local": data.local.pretrain}.get(data.source, "data.mixture")
    return Corpus(
        pretrain=split_by_key(docs, lambda d: d["text"], seed, vf, tf, fill_empty=not data.streaming),
        sft=split_by_key(sft, lambda r: _prompt_key(r["messages"]), seed, vf, tf),
        preference=split_by_key(preference, lambda r: json.dumps(r["prompt"], sort_keys=True), seed, vf, tf),
        manifest={
            "source": data.source,
            "description": f"{'a sample of the stream ' if data.streaming else ''}"
            f"{'hub dataset' if from_hub else 'local data'} {where}"
            + "".join(f"; {f.key} = {f.root} ({len(f.files)} files)" for f in read),
            "num_files": sum(len(f.files) for f in read),
            "num_skipped_files": 0,
            "content_sha256": content_sha256(read, docs if from_hub else []),
        },
    )
