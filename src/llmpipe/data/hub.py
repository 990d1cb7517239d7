"""Hugging Face datasets (`data.hf`, `data.hf_sft`, `data.hf_preference`, `data.validation_source`), via
``load_dataset(name, config, split=...)``, where a local folder (or file) as `name` works the same, offline.

A local dataset is checked first (:func:`llmpipe.data.files.hf_local_files`), so a user mistake is a
:class:`UserError` naming the key, file or row and the fix.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from llmpipe.config import HFRecordsParams, HFSourceParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.data import formats
from llmpipe.data.files import DataFiles, hf_local_files, loader_options


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
        args, kwargs = (files.format,), {"data_files": str(files.root), **loader_options(files)}
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
