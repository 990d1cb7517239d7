"""The corpus of users' data (`data.source: local | hf | mixture`): pretraining documents from `data.local` /
`data.hf` (or a sample of the stream), SFT and preference rows from `data.local` / `data.hf_sft` /
`data.hf_preference`, each split by the hash of (seed, content), with their provenance.

Reading is :mod:`llmpipe.data.local` (users' files, found and checked by :mod:`llmpipe.data.files`) and
:mod:`llmpipe.data.hub` (`datasets` datasets); records are normalised by :mod:`llmpipe.data.formats`.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import DataParams
from llmpipe.core.errors import UserError
from llmpipe.data import formats
from llmpipe.data.corpus import Corpus
from llmpipe.data.files import DataFiles, find_files, load_rows
from llmpipe.data.hub import hf_documents, hub_records
from llmpipe.data.local import local_records, pretrain_documents
from llmpipe.data.splits import split_by_key

Rows = list[dict[str, Any]]


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
            from llmpipe.data.stream.mixture import sample

            docs = sample(data, data.stream.sample_documents, cache)
            hub_texts += [d["text"] for d in docs]
        elif data.source == "local" and data.local.pretrain is None:  # nothing is pretrained (config/params.py)
            docs = []
        elif data.source == "local":
            read.append(find_files(data.local.pretrain, "data.local.pretrain", data.local.txt_sample_by))
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
        UserError: Any problem with the given paths or their contents (see :func:`find_files`,
            :func:`llmpipe.data.hub.load_hub` and :mod:`llmpipe.data.formats`).
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
