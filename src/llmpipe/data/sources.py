"""Users' own data (`data.source: local`) and Hugging Face datasets (`data.source: hf`), via `datasets` loaders.

Local files are read with ``load_dataset("json" | "parquet" | "csv" | "text", data_files=...)``; a hub dataset
with ``load_dataset(name, config, split=...)``, where a local folder (or file) as `name` works the same, offline.
Files are checked up front, so a user mistake is a :class:`UserError` naming the key, file, line or row and the
fix, never a traceback from inside `datasets`. SFT and preference records (`data.local.sft`/`preference`,
`data.hf_sft`/`hf_preference`) are normalised by :mod:`llmpipe.data.formats`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import DataParams, HFRecordsParams, HFSourceParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import decode_line, read_jsonl
from llmpipe.data import formats
from llmpipe.data.corpus import Corpus
from llmpipe.data.splits import split_by_key

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
"""File suffix → `datasets` loader. A .txt file is one document; the others hold one record per row (a .json file
is a JSON array of records, or JSON lines; a .csv file has a header line)."""

Rows = list[dict[str, Any]]


@dataclass(frozen=True)
class DataFiles:
    """The files behind one params key, all of one format.

    Attributes:
        key: The params key they come from, e.g. ``data.local.sft`` (for error messages).
        root: The file or folder as given.
        format: ``json``, ``parquet``, ``csv`` or ``text`` (a `datasets` packaged loader); ``""`` for a dataset
            folder given as a hub dataset name (e.g. `data.hf.dataset_name`), which `datasets` reads by its own rules.
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
        raise UserError(f"{key}: folder {root} has no data files; add {_suffixes()} files")
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


def _suffixes() -> str:
    return f"{', '.join(list(FORMATS)[:-1])} or {list(FORMATS)[-1]}"


def count_records(file: Path, key: str) -> int:
    """Records in a data file (a .txt file is one document), checking every text, jsonl and json line is UTF-8,
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
            if suffix == ".txt":  # one document: only its encoding is checked
                _check_utf8(file)
                num = 1
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
                          **_loader_options(files))
    except Exception as err:  # noqa: BLE001 — any failure here is in the user's files; say which
        raise UserError(
            f"{files.key}: datasets could not read {files.root}: {root_cause(err)}; all files of one dataset need "
            "the same columns with the same types"
        ) from None
    assert sum(files.num_records) == len(ds), f"{len(ds)} rows loaded, {sum(files.num_records)} counted"
    where = [(files.rel(f), i + 1) for f, n in zip(files.files, files.num_records) for i in range(n)]
    return [Row(src, num, values) for (src, num), values in zip(where, ds.to_list())], list(ds.column_names)


def _loader_options(files: DataFiles) -> dict[str, Any]:
    """Options of `files.format`'s `datasets` loader: a .txt file is one document; a csv cell is text as written
    (no numbers, and an empty cell is ``""``, not null)."""
    if files.format == "text":
        return {"sample_by": "document"}
    if files.format == "csv":
        import pandas as pd
        from datasets import Features, Value

        header = pd.read_csv(files.files[0], nrows=0).columns
        return {"na_filter": False, "features": Features({c: Value("string") for c in header})}
    return {}


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


def hf_documents(hf: HFSourceParams, max_chars: int, cache_dir: str, key: str = "data.hf"
                 ) -> tuple[list[dict[str, Any]], DataFiles | None, int]:
    """Documents ``{"text", "source"}`` from ``load_dataset(hf.dataset_name, hf.dataset_config, split=hf.split)``.

    A local folder as `hf.dataset_name` is loaded by `datasets`' folder inference, a local file by its format
    loader (both checked first, jsonl line by line); anything else is a hub name, which needs the network or
    the HF cache. At most `hf.max_documents` rows are read, streamed (so a hub dataset is not downloaded whole).

    Args:
        hf: The source.
        max_chars: Documents are cut to this many characters.
        cache_dir: Arrow cache folder for a local dataset.
        key: The params key of `hf` (``data.hf``, ``data.validation_source``), for messages.

    Returns:
        The documents, the local files read (None for a hub dataset), and the number of empty (whitespace-only)
        texts left out.

    Raises:
        UserError: The dataset cannot be loaded, lacks `hf.text_column`, or a text is not a string.
    """
    local = Path(hf.dataset_name)
    files = hf_local_files(local, f"{key}.dataset_name") if local.exists() else None
    ds = load_hub(f"{key}.dataset_name", hf.dataset_name, hf.dataset_config, hf.split, files, cache_dir,
                  streaming=hf.max_documents is not None)
    if ds.column_names is not None:  # a streamed dataset may not know its columns before the first row
        _require_text_column(hf, list(ds.column_names), key)
    source = f"{local.name if files else hf.dataset_name}:{hf.split}"
    docs, num_empty = [], 0
    for i, row in enumerate(itertools.islice(ds, hf.max_documents)):
        _require_text_column(hf, list(row), key)
        text = row[hf.text_column]
        if not isinstance(text, str):
            raise UserError(f"{key}.dataset_name: {hf.dataset_name!r} row {i + 1}: `{hf.text_column}` is "
                            f"{type(text).__name__}, not a string")
        if text.strip():
            docs.append({"text": text[:max_chars], "source": source})
        else:
            num_empty += 1
    return docs, files, num_empty


def load_hub(key: str, name: str, config: str | None, split: str, files: DataFiles | None, cache_dir: str,
             streaming: bool = False) -> Any:
    """``load_dataset(name, config, split=split)``: a local file by its format loader, a folder or hub name as a
    dataset.

    Args:
        key: The params key that names the dataset (for messages).
        name: A hub dataset name, or a local folder or file.
        config: The dataset configuration, or None.
        split: The split (`datasets` slices such as ``train[:100]`` work).
        files: :func:`hf_local_files` of a local `name`; None for a hub name.
        cache_dir: Arrow cache folder for a local dataset (a hub dataset uses the HF cache: it downloads once).
        streaming: Return an iterable dataset that reads as it goes.

    Raises:
        UserError: `datasets` cannot load it (offline and not cached, a missing split or config, unreadable files).
    """
    from datasets import load_dataset

    if files is not None and files.root.is_file():
        args, kwargs = (files.format,), {"data_files": str(files.root), **_loader_options(files)}
    else:
        args, kwargs = (name, config), {}
    try:
        return load_dataset(*args, split=split, streaming=streaming, cache_dir=cache_dir if files else None, **kwargs)
    except Exception as err:  # noqa: BLE001 — report it as the user's dataset problem
        raise UserError(
            f"{key}: could not load {name!r} (config {config!r}, split {split!r}): "
            f"{root_cause(err)}; a hub name needs the network or the HF cache, a local path must exist"
        ) from None


def _require_text_column(hf: HFSourceParams, columns: list[str], key: str) -> None:
    if hf.text_column not in columns:
        raise UserError(
            f"{key}.text_column: {hf.dataset_name!r} has no column `{hf.text_column}` (found: {', '.join(columns)}); "
            f"set {key}.text_column to the column holding the text"
        )


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


def hub_records(hub: HFRecordsParams, kind: str, cache_dir: str) -> tuple[formats.Records, DataFiles | None]:
    """The `kind` (``sft`` | ``preference``) records of ``load_dataset(hub.dataset_name, hub.dataset_config,
    split=hub.split)`` (`data.hf_<kind>`); a local folder or file is checked first, as for `data.hf.dataset_name`.

    Returns:
        The records (each names its row in the split), and the local files read (None for a hub dataset).

    Raises:
        UserError: The dataset cannot be loaded, or a local one fails the checks of :func:`hf_local_files`.
    """
    key = f"data.hf_{kind}.dataset_name"
    local = Path(hub.dataset_name)
    files = hf_local_files(local, key) if local.exists() else None
    ds = load_hub(key, hub.dataset_name, hub.dataset_config, hub.split, files, cache_dir)
    source = f"{local.name if files else hub.dataset_name}:{hub.split}"
    label = f"{hub.dataset_name} (split {hub.split})"
    rows = [formats.Record(values, source, f"{source}:{i}", f"{key}: {label} row {i}")
            for i, values in enumerate(ds.to_list(), 1)]
    return formats.Records(key, label, list(ds.column_names), rows, hub.format, f"data.hf_{kind}.format"), files


def content_sha256(read: list[DataFiles], hub_texts: Iterable[str]) -> str:
    """sha256 (hex) over (key, relative path, bytes) of the files read, then the texts read from the hub."""
    digest = hashlib.sha256()
    for files in read:
        for f in files.files:
            raw = f.read_bytes()
            digest.update(f"{files.key}/{files.rel(f)}".encode() + b"\0" + len(raw).to_bytes(8, "big") + raw)
    for text in hub_texts:
        raw = text.encode()
        digest.update(len(raw).to_bytes(8, "big") + raw)
    return digest.hexdigest()


@dataclass
class _Loaded:
    """What :func:`_load_all` read.

    Attributes:
        docs: Pretraining documents.
        sft: SFT rows (none when no SFT data is given).
        preference: Preference rows (none when no preference data is given).
        read: The local files read.
        hub: ``<key> = <name>`` of each SFT or preference dataset read from the hub (not a local path).
        hub_texts: What the hub gave, for the content hash: pretraining texts, then those datasets' rows as JSON.
        num_empty: Pretraining rows of `data.hf` left out for an empty text.
    """

    docs: Rows
    sft: formats.Normalised
    preference: formats.Normalised
    read: list[DataFiles]
    hub: list[str]
    hub_texts: list[str]
    num_empty: int


def _load_all(data: DataParams) -> _Loaded:
    """Pretraining documents of `data.local.pretrain` / `data.hf`, and the SFT and preference rows of
    `data.local` / `data.hf_sft` / `data.hf_preference`."""
    read: list[DataFiles] = []
    hub: list[str] = []
    hub_texts: list[str] = []
    num_empty = 0
    with tempfile.TemporaryDirectory(prefix="llmpipe-datasets-") as cache:
        if data.streaming:  # pretrain streams the source; prepare keeps a sample for the tokenizer and held-out splits
            from llmpipe.data.stream import sample

            docs = sample(data, data.stream.sample_documents, cache)
            hub_texts += [d["text"] for d in docs]
        elif data.source == "local":
            read.append(find_files(data.local.pretrain, "data.local.pretrain"))
            docs = pretrain_documents(read[-1], *load_rows(read[-1], cache), data.max_chars_per_document)
        else:
            docs, files, num_empty = hf_documents(data.hf, data.max_chars_per_document, cache)
            read += [files] if files else []
            hub_texts += [] if files else [d["text"] for d in docs]
        normalised = {}
        for kind, normalise in (("sft", formats.sft_rows), ("preference", formats.preference_rows)):
            local, remote = getattr(data.local, kind), getattr(data, f"hf_{kind}")
            if local is None and remote.dataset_name is None:
                normalised[kind] = formats.Normalised([], 0)
                continue
            if local is not None:
                records, files = local_records(local, kind, getattr(data.local, f"{kind}_format"), cache)
            else:
                records, files = hub_records(remote, kind, cache)
            normalised[kind] = normalise(records)
            read += [files] if files else []
            if files is None:
                hub.append(f"{records.key} = {records.label}")
                hub_texts += [json.dumps(row, sort_keys=True) for row in normalised[kind].rows]
    return _Loaded(docs, normalised["sft"], normalised["preference"], read, hub, hub_texts, num_empty)


def _prompt_key(messages: list[dict[str, str]]) -> str:
    """The conversation before its last assistant turn, as JSON: the split key of an SFT row."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return json.dumps(messages[:last], sort_keys=True)


def build_corpus(data: DataParams) -> Corpus:
    """Read `data.local` / `data.hf` / `data.hf_sft` / `data.hf_preference`, split every dataset by the hash of
    (seed, content) and return it.

    Pretraining documents are keyed by their text, SFT rows by the conversation before the last assistant
    turn, preference rows by their prompt: equal keys share a split, so a duplicate never straddles two.
    SFT and preference data are read for both sources; the signature MC set is empty.

    Raises:
        UserError: Any problem with the given paths or their contents (see :func:`find_files`, :func:`load_hub`
            and :mod:`llmpipe.data.formats`).
    """
    loaded = _load_all(data)
    seed, vf, tf = data.seed, data.validation_fraction, data.test_fraction
    from_hub = data.streaming or (data.source == "hf" and not Path(data.hf.dataset_name).exists())
    where = {"hf": data.hf.dataset_name, "local": data.local.pretrain}.get(data.source, "data.mixture")
    return Corpus(
        pretrain=split_by_key(loaded.docs, lambda d: d["text"], seed, vf, tf, fill_empty=not data.streaming),
        sft=split_by_key(loaded.sft.rows, lambda r: _prompt_key(r["messages"]), seed, vf, tf),
        preference=split_by_key(loaded.preference.rows, lambda r: json.dumps(r["prompt"], sort_keys=True), seed, vf,
                                tf),
        manifest={
            "source": data.source,
            "description": f"{'a sample of the stream ' if data.streaming else ''}"
            f"{'hub dataset' if from_hub else 'local data'} {where}"
            + "".join(f"; {f.key} = {f.root} ({len(f.files)} files)" for f in loaded.read)
            + "".join(f"; {h} (hub)" for h in loaded.hub),
            "num_files": sum(len(f.files) for f in loaded.read),
            "num_skipped_files": 0,
            "content_sha256": content_sha256(loaded.read, loaded.hub_texts),
        },
        num_empty_responses={"sft": loaded.sft.num_empty_responses,
                             "preference": loaded.preference.num_empty_responses},
        num_dropped_empty=loaded.num_empty,
    )


def use_validation_source(corpus: Corpus, data: DataParams) -> None:
    """Take the pretraining validation split from `data.validation_source` (in place): the documents the hash
    split held out for validation go back to train, and the content hash covers the new source.

    Raises:
        UserError: The source cannot be read or has no document with text.
    """
    with tempfile.TemporaryDirectory(prefix="llmpipe-datasets-") as cache:
        docs, files, _ = hf_documents(data.validation_source, data.max_chars_per_document, cache,
                                      "data.validation_source")
    if not docs:
        raise UserError(f"data.validation_source: {data.validation_source.dataset_name!r} has no document with text")
    corpus.pretrain["train"] = corpus.pretrain["train"] + corpus.pretrain["validation"]
    corpus.pretrain["validation"] = docs
    corpus.manifest["description"] += f"; validation from data.validation_source = {data.validation_source.dataset_name}"
    extra = content_sha256([files] if files else [], [] if files else [d["text"] for d in docs])
    corpus.manifest["content_sha256"] = hashlib.sha256((corpus.manifest["content_sha256"] + extra).encode()).hexdigest()
