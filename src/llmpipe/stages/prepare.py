"""`prepare`: build the pretraining, SFT, preference and evaluation datasets under ``paths.data``.

Writes ``<paths.data>/{pretrain,sft,preference,tasks,vlm}/{train,validation,test}.jsonl`` (vlm: with its
images; tasks: the executable function tasks of `data.tasks`, whose training and validation rows are also mixed
into sft and preference: :mod:`llmpipe.data.tasks.mixing`), ``<paths.data>/pretrain/manifest.json`` (provenance)
and ``<paths.data>/eval/{perplexity,signature_mc,sft,preference,tasks}.jsonl``. Everything is built in memory first, then each folder is written into a temporary
sibling that replaces it in one rename, so a failed or killed run leaves the previous data as it was.
The training documents of the pretraining text are deduplicated and decontaminated (`data.dedup`,
:mod:`llmpipe.data.dedup`) after the split; `data.dedup.seen_hashes_path`, when set, is written last.
"""

from __future__ import annotations

import contextlib
import platform
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmpipe.config import DataParams, DedupParams, Params
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, write_json, write_jsonl
from llmpipe.core.lines import phase
from llmpipe.data.corpus import EVAL_SETS, Corpus, eval_sets
from llmpipe.data.corrupt import CORRUPTIONS
from llmpipe.data.dedup import COUNTERS, Deduplicator, from_params
from llmpipe.data.splits import SPLITS
from llmpipe.data.tasks.mixing import CORRUPTIONS as TASK_CORRUPTIONS
from llmpipe.data.tasks.mixing import add_tasks

DATASETS = ("pretrain", "sft", "preference", "tasks")
"""Folders with one ``<split>.jsonl`` per split."""

FOLDERS = (*DATASETS, "eval")
"""Every folder `prepare` writes under ``paths.data``."""


def run(params: Params) -> dict[str, float]:
    """Build every dataset from `params.data` and write it under ``paths.out(paths.data)``.

    Returns:
        DVC metrics (numbers, one level nested): ``python_major``, ``python_minor`` (the interpreter whose stdlib was
        read), ``num_files``, ``num_skipped_files``, ``content_hash_int`` (first 12 hex digits of the content sha256 as an int),
        ``num_documents_<split>``, ``num_sft_<split>``, ``num_preference_<split>``,
        ``num_preference_<corruption>_train`` (the tasks' kinds too), ``num_tasks_<split>``, ``num_sft_tasks_train``
        (task rows among the SFT training rows), ``num_eval_<set>``, ``num_chars_train`` (it and
        ``num_documents_train`` count after deduplication), ``num_dedup_kept``, ``num_dedup_dropped_exact``,
        ``num_dedup_dropped_near``, ``num_dedup_dropped_contaminated`` (training documents of the pretraining
        text; all kept when `data.dedup` compares nothing),
        ``num_sft_empty_responses``, ``num_preference_empty_responses`` (users' records left out for an empty
        response), ``num_dropped_empty`` (empty pretraining rows of a `datasets` source), and ``sources``:
        per pretraining source, its ``documents``, ``chars`` and ``truncated`` count (numbers, nested).

    Raises:
        UserError: Bad data paths or contents (a task record without tests or whose reference fails them), an input
            inside an output folder, too few documents (before or
            after deduplication), or a `data.dedup.seen_hashes_path` made with other `data.dedup` params.
    """
    root = params.paths.out(params.paths.data)
    _check_inputs_outside(params.data, root)
    dedup = from_params(params.data.dedup)  # before the corpus: bad dedup params or a bad index fail fast
    with phase("prepare", f"read the text of {data_key(params.data)}") as shown:
        corpus = build_corpus(params.data)
        shown["documents"] = sum(len(docs) for docs in corpus.pretrain.values())
    if params.data.validation_source is not None:
        from llmpipe.data.sources import use_validation_source

        use_validation_source(corpus, params.data)
    if params.data.source != "local" or params.data.local.pretrain is not None:  # null: nothing is pretrained
        _check_nonempty(corpus, data_key(params.data))
    with phase("prepare", "added the executable function tasks") as shown:
        corpus = add_tasks(corpus, params.data)
        shown |= {split: len(rows) for split, rows in corpus.tasks.items()}
    with phase("prepare", "deduplicated and built the evaluation sets") as shown:
        corpus, counts = deduplicate(corpus, dedup, params.data.dedup)
        evals = eval_sets(corpus, params.data)
        shown |= {"training documents kept": len(corpus.pretrain["train"]), "evaluation sets": len(evals)}
    for folder in (*FOLDERS, "vlm"):  # what a killed run left behind
        for stale in [*root.glob(f".{folder}.tmp-*"), *root.glob(f".{folder}.old-*")]:
            _remove(stale)
    with phase("prepare", "wrote the image records") as shown:
        images = write_images(root / "vlm", params.data)  # first: a refused image record leaves the text as it was
        shown["records"] = sum(images.values())
    with phase("prepare", f"wrote {root}"):
        write(root, corpus, evals, manifest(corpus, evals, params.data, counts))
    if dedup is not None and params.data.dedup.seen_hashes_path is not None and not params.data.streaming:
        # After the outputs: a failed run consumes nothing. A stream's sample is not consumed: pretrain records
        # what the stream admits.
        dedup.save(params.data.dedup.seen_hashes_path)
    return metrics(corpus, evals, params.data, counts) | images


def write_images(folder: Path, data: DataParams) -> dict[str, int]:
    """``<paths.data>/vlm``: the user's image records (`data.local.vlm`, checked and copied) or the synthetic
    shapes (`data.images`); written atomically. Returns ``num_vlm_<split>``."""
    if data.local.vlm is not None:
        from llmpipe.data.image_records import import_records

        if Path(data.local.vlm).resolve().is_relative_to(folder.resolve()):
            raise UserError(f"data.local.vlm: {data.local.vlm} is inside {folder}, which prepare rewrites; move it "
                            "elsewhere")  # fmt: skip
        return import_records(Path(data.local.vlm), folder)
    from llmpipe.data.images import write_image_set

    with atomic_dir(folder) as tmp:
        return write_image_set(tmp, data.images)


def build_corpus(data: DataParams) -> Corpus:
    """The corpus of `data.source`: the embedded stdlib, local files or a `datasets` dataset."""
    if data.source == "stdlib":
        from llmpipe.data import stdlib

        return stdlib.build_corpus(data)
    from llmpipe.data import sources

    return sources.build_corpus(data)


def _check_inputs_outside(data: DataParams, root: Path) -> None:
    """Refuse inputs under a folder `prepare` replaces (they would be deleted by the write)."""
    inputs = {"data.local.tasks": data.local.tasks}  # read with every source
    if data.source != "stdlib":  # users' other data is read only with the other sources
        inputs |= {"data.local.pretrain": data.local.pretrain, "data.local.sft": data.local.sft,
                   "data.local.preference": data.local.preference, "data.hf_sft.dataset_name": data.hf_sft.dataset_name,
                   "data.hf_preference.dataset_name": data.hf_preference.dataset_name,
                   "data.dedup.seen_hashes_path": data.dedup.seen_hashes_path}
    if data.source == "hf":
        inputs["data.hf.dataset_name"] = data.hf.dataset_name
    if data.source == "mixture":
        inputs.update({f"data.mixture[{i}].dataset_name": s.dataset_name for i, s in enumerate(data.mixture)})
    for key, value in inputs.items():
        if value is None:
            continue
        for folder in FOLDERS:
            if Path(value).resolve().is_relative_to((root / folder).resolve()):
                raise UserError(f"{key}: {value} is inside {root / folder}, which prepare rewrites; move it elsewhere "
                                f"(e.g. {root / 'raw'})")


def data_key(data: DataParams) -> str:
    """``<params key>: <value>`` of the pretraining text, for messages about it."""
    if data.source == "local":
        return f"data.local.pretrain: {data.local.pretrain}"
    if data.source == "hf":
        return f"data.hf.dataset_name: {data.hf.dataset_name}"
    if data.source == "mixture":
        return "data.mixture: " + ", ".join(str(s.dataset_name) for s in data.mixture)
    return "data.source: stdlib"


def _check_nonempty(corpus: Corpus, where: str) -> None:
    counts = {s: len(corpus.pretrain[s]) for s in SPLITS}
    if not counts["train"]:
        raise UserError(f"{where}: no documents with text; check the data paths")
    if not all(counts.values()):
        raise UserError(f"{where}: too few distinct documents to split ({counts}); give at least 3 so train, "
                        "validation and test each get one (a stream: raise data.stream.sample_documents)")


def deduplicate(corpus: Corpus, dedup: Deduplicator | None, params: DedupParams) -> tuple[Corpus, dict[str, int]]:
    """Drop duplicate and contaminated documents from the pretraining text's training split.

    With `params.decontaminate`, the validation and test documents are registered as references first; then
    the training documents are checked in corpus order and the admitted ones kept (the first of each group of
    duplicates). Validation, test and the other datasets are returned as they were.

    Returns:
        The corpus with the kept training documents, and the counts ``{name: n}`` of
        :data:`llmpipe.data.dedup.COUNTERS` (all kept when `dedup` is None).

    Raises:
        UserError: No training document is left.
    """
    train = corpus.pretrain["train"]
    if dedup is None:
        return corpus, {**dict.fromkeys(COUNTERS, 0), "num_kept": len(train)}
    if params.decontaminate:
        for split in ("validation", "test"):
            for doc in corpus.pretrain[split]:
                dedup.add_reference(doc["text"])
    kept = [doc for doc in train if dedup.check(doc["text"]) is None]
    if train and not kept:
        seen = params.seen_hashes_path
        hint = (f"; {seen} records what earlier runs kept, so a rerun over the same data drops it all: remove that "
                "file or set data.dedup.seen_hashes_path to another" if seen and Path(seen).exists() else "")
        raise UserError(f"data.dedup: all {len(train)} training documents were dropped ({dedup.counts}){hint}")
    return replace(corpus, pretrain={**corpus.pretrain, "train": kept}), dedup.counts


def manifest(
    corpus: Corpus, evals: dict[str, list[dict[str, Any]]], data: DataParams, dedup_counts: dict[str, int]
) -> dict[str, Any]:
    """Provenance written to ``pretrain/manifest.json``: interpreter, source, content hash, split, counts,
    and the deduplication (its params but the seen-hashes path, and its counts)."""
    return {
        **corpus.manifest,
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "seed": data.seed,
        "validation_fraction": data.validation_fraction,
        "test_fraction": data.test_fraction,
        "counts": {
            **{kind: {s: len(getattr(corpus, kind)[s]) for s in SPLITS} for kind in DATASETS},
            "eval": {name: len(rows) for name, rows in evals.items()},
        },
        "num_chars": {s: sum(len(d["text"]) for d in corpus.pretrain[s]) for s in SPLITS},
        "dedup": {
            **data.dedup.model_dump(exclude={"seen_hashes_path"}),
            "seen_hashes_path_set": data.dedup.seen_hashes_path is not None,
            "counts": dedup_counts,
        },
    }


def write(root: Path, corpus: Corpus, evals: dict[str, list[dict[str, Any]]], info: dict[str, Any]) -> None:
    """Write every folder under `root`; all of them are renamed into place only after all were written."""
    with contextlib.ExitStack() as stack:
        tmp = {folder: stack.enter_context(atomic_dir(root / folder)) for folder in FOLDERS}
        for kind in DATASETS:
            for split in SPLITS:
                write_jsonl(tmp[kind] / f"{split}.jsonl", getattr(corpus, kind)[split])
        for name in EVAL_SETS:
            write_jsonl(tmp["eval"] / f"{name}.jsonl", evals[name])
        write_json(tmp["pretrain"] / "manifest.json", info)


def _remove(path: Path) -> None:
    """Remove a leftover temporary file or folder of a killed run."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def metrics(corpus: Corpus, evals: dict[str, list[dict[str, Any]]], data: DataParams, dedup_counts: dict[str, int]
            ) -> dict[str, Any]:
    """The numbers `run` returns (see there)."""
    v = sys.version_info
    out: dict[str, float] = {
        "python_major": v.major,
        "python_minor": v.minor,
        "num_files": corpus.manifest["num_files"],
        "num_skipped_files": corpus.manifest["num_skipped_files"],
        "content_hash_int": int(corpus.manifest["content_sha256"][:12], 16),
    }
    for split in SPLITS:
        out[f"num_documents_{split}"] = len(corpus.pretrain[split])
        out[f"num_sft_{split}"] = len(corpus.sft[split])
        out[f"num_preference_{split}"] = len(corpus.preference[split])
        out[f"num_tasks_{split}"] = len(corpus.tasks[split])
    out["num_sft_tasks_train"] = sum("tests" in r for r in corpus.sft["train"])
    for kind in (*CORRUPTIONS, *TASK_CORRUPTIONS):
        out[f"num_preference_{kind}_train"] = sum(r.get("corruption") == kind for r in corpus.preference["train"])
    for name in EVAL_SETS:
        out[f"num_eval_{name}"] = len(evals[name])
    out["num_chars_train"] = sum(len(d["text"]) for d in corpus.pretrain["train"])
    for kind, num in corpus.num_empty_responses.items():
        out[f"num_{kind}_empty_responses"] = num
    out["num_dropped_empty"] = corpus.num_dropped_empty
    out["sources"] = source_statistics(corpus, data)
    out |= {f"num_dedup_{name.removeprefix('num_')}": n for name, n in dedup_counts.items()}
    return out


def source_statistics(corpus: Corpus, data: DataParams) -> dict[str, dict[str, int]]:
    """Per pretraining source (``<dataset>:<split>`` of a `datasets` source or stream, else `data.source`), over
    all splits: ``documents``, ``chars`` and ``truncated`` (documents cut at `data.max_chars_per_document`)."""
    by_name = data.streaming or data.source in ("hf", "mixture") or data.validation_source is not None
    out: dict[str, dict[str, int]] = {}
    for docs in corpus.pretrain.values():
        for d in docs:
            stats = out.setdefault(d["source"] if by_name else data.source,
                                   {"documents": 0, "chars": 0, "truncated": 0})
            stats["documents"] += 1
            stats["chars"] += len(d["text"])
            stats["truncated"] += len(d["text"]) == data.max_chars_per_document
    return out
