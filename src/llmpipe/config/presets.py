"""Named pretraining corpora on the Hugging Face hub (`data.hf.preset`), each a (dataset, config, text column) triple.

A preset only fills the fields a user left out: `data.hf.dataset_name`, `dataset_config` and `text_column` given
directly always win, so a preset never hides what is read. Every preset names a repository of plain data files
(parquet / jsonl): the `datasets` version in use refuses dataset loading scripts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """A hub dataset by its address: ``load_dataset(dataset_name, dataset_config)[text_column]``."""

    dataset_name: str
    dataset_config: str | None
    text_column: str
    description: str


PRESETS: dict[str, Preset] = {
    "tinystories": Preset("roneneldan/TinyStories", None, "text", "synthetic children's stories (Eldan & Li 2023)"),
    "fineweb-edu": Preset(
        "HuggingFaceFW/fineweb-edu", "sample-10BT", "text", "educational web pages, the 10B-token sample"
    ),
    "c4": Preset("allenai/c4", "en", "text", "Colossal Clean Crawled Corpus, English (Raffel et al. 2020)"),
    "pile": Preset(
        "monology/pile-uncopyrighted", None, "text", "The Pile without its copyrighted parts (the original was taken down)"
    ),
    "slimpajama": Preset(
        "cerebras/SlimPajama-627B", None, "text", "RedPajama-1T cleaned and deduplicated; meta.redpajama_set_name names the subset"
    ),
}

REDPAJAMA_SUBSETS = ("arxiv", "book", "c4", "common_crawl", "github", "stackexchange", "wikipedia")


def resolve(name: str) -> Preset:
    """The preset called `name`.

    Raises:
        ValueError: `name` is not a preset (the message lists them), or is ``redpajama/<subset>``: every
            RedPajama-1T repository on the hub loads through a dataset script, which `datasets` refuses, and no
            script-free copy of its subsets is known, so the message says what to use instead.
    """
    if name.startswith("redpajama"):
        subset = name.partition("/")[2]
        known = f" (subsets: {', '.join(REDPAJAMA_SUBSETS)})" if subset not in REDPAJAMA_SUBSETS else ""
        raise ValueError(
            f"preset {name!r}: togethercomputer/RedPajama-Data-1T (and -1T-Sample, -V2) load through a dataset "
            f"script, which the installed `datasets` refuses, and no script-free copy of its subsets is known{known}; "
            "use preset 'slimpajama' (RedPajama cleaned and deduplicated, in plain jsonl.zst shards), or download the "
            "jsonl files from the dataset card's urls.txt and give their folder as data.hf.dataset_name"
        )
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}, redpajama/<subset> (explains itself)")
    return PRESETS[name]


def listing() -> str:
    """The table `llm-train --list-presets` prints: name, dataset, config, text column, description."""
    rows = [(n, p.dataset_name, p.dataset_config or "-", p.text_column, p.description) for n, p in PRESETS.items()]
    rows.append(("redpajama/<subset>", "-", "-", "-", "not available: its hub copies need a dataset script"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)
