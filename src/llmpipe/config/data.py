"""Sections of the data stages: `data` (sources, streaming, deduplication, the split) for `prepare`, and
`tokenizer`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from llmpipe.config import presets
from llmpipe.config.section import Section


class StdlibSourceParams(Section):
    """How the embedded default corpus (the running interpreter's standard library) is cut."""

    min_body_lines: int = Field(2, ge=1, description="Functions with shorter bodies are not used as SFT pairs.")
    max_body_lines: int = Field(30, ge=1, description="Functions with longer bodies are not used as SFT pairs.")
    max_sft_pairs: int = Field(20000, gt=0, description="Cap on training SFT pairs.")
    max_preference_pairs: int = Field(10000, gt=0, description="Cap on training preference pairs.")


SFTFormat = Literal["auto", "messages", "prompt_completion", "alpaca", "sharegpt"]
"""Shapes of SFT records (`llmpipe.data.formats`); ``auto`` reads the shape from the columns."""

PreferenceFormat = Literal["auto", "explicit_prompt", "implicit_prompt", "unpaired"]
"""Shapes of preference records (`llmpipe.data.formats`); ``auto`` reads the shape from the columns."""


class LocalSourceParams(Section):
    """Users' own files (a file, or a folder of one format: .jsonl, .json, .parquet, .csv, and .txt for pretraining
    text) per dataset kind; null = none.

    `sft` and `preference` are read whenever `data.source` is not 'stdlib' (which brings its own; setting them
    with it is an error). `pretrain` may be null when nothing is pretrained (`pretrain.enabled: false` with a
    `model.init_from`): the pretraining splits are then empty.
    """

    pretrain: str | None = Field(
        None, description="Text documents: .txt files, or records with a `text` column; null = no pretraining text."
    )
    txt_sample_by: Literal["auto", "document", "paragraph"] = Field(
        "auto",
        description="How .txt pretraining files become documents: each file whole, or each blank-line-separated "
        "paragraph; auto = paragraphs of a single file given by itself, whole files of a folder.",
    )
    sft: str | None = Field(None, description="SFT records in one of the shapes of `sft_format`.")
    preference: str | None = Field(None, description="Preference records in one of the shapes of `preference_format`.")
    tasks: str | None = Field(None, description="Executable function tasks (prompt, entry_point, canonical_solution, "
                              "tests: docs/tasks.md) instead of the generated ones, split by data.tasks' fractions; "
                              "null = generated. Read with every data.source.")
    vlm: str | None = Field(None, description="Image question/answer records for `vlm`: a folder with train.jsonl "
                            "and validation.jsonl (test.jsonl optional), `messages` + `images` (llmpipe.data.image_records); "
                            "null = the synthetic shapes of data.images.")
    sft_format: SFTFormat = Field("auto", description="Shape of the `sft` records; auto = from the columns.")
    preference_format: PreferenceFormat = Field(
        "auto", description="Shape of the `preference` records; auto = from the columns."
    )


class HFRecordsParams(Section):
    """SFT or preference records from ``datasets.load_dataset(dataset_name, dataset_config, split=split)``; a local
    dataset folder (or file) as `dataset_name` works the same, offline. Read whenever `data.source` is not 'stdlib'."""

    dataset_name: str | None = Field(None, description="A hub dataset name, or a local dataset folder; null = none.")
    dataset_config: str | None = Field(None, description="Dataset configuration name.")
    split: str = Field("train", description="Split to read; `datasets` slices work, e.g. train[:1000].")


class HFSFTParams(HFRecordsParams):
    """`data.hf_sft`: SFT records from a hub dataset."""

    format: SFTFormat = Field("auto", description="Shape of the records; auto = from the columns.")


class HFPreferenceParams(HFRecordsParams):
    """`data.hf_preference`: preference records from a hub dataset."""

    format: PreferenceFormat = Field("auto", description="Shape of the records; auto = from the columns.")


class HFSourceParams(Section):
    """A pretraining text source read through `datasets.load_dataset` (a hub name, or a local file or folder).

    `preset` fills `dataset_name`, `dataset_config` and `text_column` where they are not given
    (``llm-train --list-presets``); fields given directly win.
    """

    preset: str | None = Field(None, description="A named hub corpus (llm-train --list-presets).")
    dataset_name: str | None = Field(None, description="Dataset name on the hub, or a local dataset file or folder.")
    dataset_config: str | None = Field(None, description="Dataset configuration name.")
    split: str = Field("train", description="Split to read.")
    text_column: str = Field("text", description="Column holding the document text (null: the preset's, or text).")
    max_documents: int | None = Field(
        None, gt=0, description="prepare reads at most this many documents (streamed, so nothing else is downloaded)."
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("preset") is not None:
            preset = presets.resolve(data["preset"])
            for key in ("dataset_name", "dataset_config", "text_column"):
                if data.get(key) is None:
                    data[key] = getattr(preset, key)
        if data.get("text_column") is None:
            data["text_column"] = "text"
        return data


class MixtureSourceParams(HFSourceParams):
    """One source of `data.mixture`: an `HFSourceParams` with its sampling weight."""

    weight: float = Field(1.0, gt=0, description="Relative share of documents drawn from this source.")


class StreamParams(Section):
    """How `pretrain` reads a stream (`data.streaming: true`): order, shuffling and the sample `prepare` keeps."""

    shuffle_buffer: int = Field(
        1000, ge=0, description="Documents in the seeded shuffle buffer (saved in every checkpoint); 0 = stream order."
    )
    sample_documents: int = Field(
        2000, gt=0, description="Documents prepare reads from the stream for the tokenizer and validation/test splits."
    )


class DedupParams(Section):
    """Document-level deduplication and decontamination of the pretraining text (:mod:`llmpipe.data.dedup`).

    `prepare` drops from the training split, keeping the first of each group in corpus order: documents whose
    normalised text was seen (`exact`), documents whose word shingles overlap a seen one's by about
    `threshold` Jaccard similarity or more (`near`, MinHash + LSH), and, with `decontaminate`, documents that
    match a validation or test document either way. Validation and test are left whole.
    """

    exact: bool = Field(
        True, description="Drop documents whose normalised text (NFKC, case-folded, whitespace collapsed) was seen."
    )
    near: bool = Field(True, description="Drop near duplicates: MinHash signatures of word shingles, LSH bands.")
    threshold: float = Field(
        0.8,
        gt=0,
        lt=1,
        description="Jaccard similarity of shingle sets the LSH bands are tuned to cut at; a soft cut: at the "
        "defaults a pair at 0.8 is caught 40% of the time, at 0.9 93%.",
    )
    num_perm: int = Field(128, ge=2, description="MinHash permutations (signature length): sharper cut-off, slower.")
    shingle_size: int = Field(5, gt=0, description="Words per shingle (word n-gram).")
    capacity: int = Field(
        1_000_000,
        gt=0,
        description="Documents the Bloom filters of seen documents are sized for (memory ≈ 31 bytes per document at "
        "the defaults, fixed); past it, false drops exceed false_positive_rate.",
    )
    false_positive_rate: float = Field(
        1e-4,
        gt=0,
        lt=1,
        description="Chance that a document unlike every seen one is dropped anyway (Bloom false positive), while at "
        "most capacity documents were kept.",
    )
    decontaminate: bool = Field(
        True, description="Drop training documents that duplicate or near-duplicate a validation or test document."
    )
    seen_hashes_path: str | None = Field(
        None,
        description="File of the documents earlier runs kept: read first when it exists, written after; a later run "
        "drops them as duplicates. null = every run starts empty. Not a DVC dep or out.",
    )

    @property
    def enabled(self) -> bool:
        """Whether any document is compared at all."""
        return self.exact or self.near

    @model_validator(mode="after")
    def _decontaminate_needs_a_match(self) -> DedupParams:
        if self.decontaminate and not self.enabled:
            raise ValueError("data.dedup.decontaminate is true but data.dedup.exact and data.dedup.near are both "
                             "false: set one of them to true (it says how a reference is matched) or decontaminate "
                             "to false")
        return self


class ImagesParams(Section):
    """The synthetic image set `prepare` draws for the `vlm` stage when `data.local.vlm` is null: shapes of
    several colours, sizes and counts on plain or noisy backgrounds, each with a question about colour, shape or
    count (`llmpipe.data.images`)."""

    num_train: int = Field(2000, gt=0, description="Training images (one question each).")
    num_validation: int = Field(100, gt=0, description="Validation images.")
    num_test: int = Field(300, gt=0, description="Held-out test images (the vlm stage's accuracy).")
    image_size: int = Field(32, ge=16, description="Side of the drawn images in pixels.")
    seed: int = Field(0, description="Seed of the drawing; same seed → same images.")


class TasksParams(Section):
    """The executable function tasks `prepare` writes to data/tasks and mixes into the SFT and preference data
    (`llmpipe.data.tasks`): generated (seeded, offline) with the stdlib corpus, or a user's own (`data.local.tasks`,
    with any source); users' own corpora get none of the generated Python tasks."""

    enabled: bool = Field(True, description="false: no tasks; SFT, preference pairs and RL prompts are the corpus's alone.")
    num_train: int = Field(2000, gt=0, description="Generated training tasks.")
    num_validation: int = Field(100, gt=0, description="Generated validation tasks (held-out combinations).")
    num_test: int = Field(200, gt=0, description="Generated test tasks (held-out combinations, none of validation's).")
    num_tests: int = Field(5, gt=0, description="Hidden tests per generated task.")
    held_out_fraction: float = Field(
        0.2, gt=0, lt=1, description="Share of each family's operation pairs kept out of training (half for "
        "validation, half for test); a user's tasks: the share of records held out, by hash."
    )
    sft_share: float = Field(
        0.5, gt=0, le=1, description="Share of the SFT training rows (and so of the RL prompts) that are tasks: the "
        "corpus's rows are subsampled to make it (1 = tasks only)."
    )
    preference_share: float = Field(
        0.5, gt=0, le=1, description="Share of the preference training pairs that are tasks (chosen: the reference; "
        "rejected: another constant, off by one, another operation); the corpus's pairs are subsampled to make it."
    )


class DataParams(Section):
    """The `prepare` stage: which corpus, and how it is split into train/validation/test (by document)."""

    source: Literal["stdlib", "local", "hf", "mixture"] = Field("stdlib", description="Corpus to prepare.")
    streaming: bool = Field(
        False, description="pretrain reads data.hf or data.mixture on the fly instead of prepare's train split."
    )
    seed: int = Field(1234, description="Seed of the split and of the corruptions; same seed → same data.")
    validation_fraction: float = Field(0.05, gt=0, lt=0.5, description="Fraction of modules held out for validation.")
    test_fraction: float = Field(0.05, gt=0, lt=0.5, description="Fraction of modules held out for evaluation.")
    num_eval_examples: int = Field(400, gt=0, description="Max examples per evaluation set.")
    max_chars_per_document: int = Field(
        200_000, gt=0, description="Longer documents are cut (keeps one huge module from dominating)."
    )
    eval_max_chars_per_document: int = Field(
        4000, gt=0, description="Perplexity-eval documents are cut to this many characters (keeps evaluation fast)."
    )
    stdlib: StdlibSourceParams = StdlibSourceParams()
    local: LocalSourceParams = LocalSourceParams()
    hf: HFSourceParams = HFSourceParams()
    hf_sft: HFSFTParams = HFSFTParams()
    hf_preference: HFPreferenceParams = HFPreferenceParams()
    images: ImagesParams = ImagesParams()
    tasks: TasksParams = TasksParams()
    mixture: list[MixtureSourceParams] = Field([], description="Sources interleaved by weight (source: mixture).")
    validation_source: HFSourceParams | None = Field(
        None,
        description="Pretraining validation documents from this source (e.g. a dataset's validation split) instead "
        "of the hash split, whose validation share then goes to train.",
    )
    stream: StreamParams = StreamParams()
    dedup: DedupParams = DedupParams()

    @model_validator(mode="after")
    def _source_configured(self) -> DataParams:
        if self.stdlib.min_body_lines > self.stdlib.max_body_lines:
            raise ValueError(
                f"data.stdlib.min_body_lines ({self.stdlib.min_body_lines}) exceeds data.stdlib.max_body_lines "
                f"({self.stdlib.max_body_lines})"
            )
        if self.source == "hf" and self.hf.dataset_name is None:
            raise ValueError(
                "data.source is 'hf' but neither data.hf.dataset_name nor data.hf.preset is set: give a dataset name, "
                "a local folder or a preset"
            )
        if self.source == "mixture":
            if not self.mixture:
                raise ValueError("data.source is 'mixture' but data.mixture is empty: list sources with weights")
            if not self.streaming:
                raise ValueError("data.source 'mixture' is read as a stream: set data.streaming: true")
            for i, source in enumerate(self.mixture):
                if source.dataset_name is None:
                    raise ValueError(f"data.mixture[{i}]: give dataset_name or preset")
        capped = [k for k, src in [("data.hf", self.hf), *((f"data.mixture[{i}]", m) for i, m in enumerate(self.mixture))]
                  if src.max_documents is not None]
        if self.streaming and capped:
            raise ValueError(
                f"{capped[0]}.max_documents is set but data.streaming is true: a stream's length is pretrain.max_steps "
                "(prepare's sample is data.stream.sample_documents); set it to null"
            )
        if self.streaming and self.source not in ("hf", "mixture"):
            raise ValueError(
                f"data.streaming is true but data.source is {self.source!r}: streaming reads data.hf or data.mixture "
                "(a local file or folder works as data.hf.dataset_name)"
            )
        for kind, hub in (("sft", self.hf_sft), ("preference", self.hf_preference)):
            if getattr(self.local, kind) is not None and hub.dataset_name is not None:
                raise ValueError(f"data.local.{kind} and data.hf_{kind}.dataset_name are both set: give one (set the "
                                 "other to null)")
        if self.source == "stdlib":  # the stdlib corpus builds its own SFT and preference pairs
            given = [k for k, v in (("data.local.sft", self.local.sft), ("data.local.preference", self.local.preference),
                                    ("data.hf_sft.dataset_name", self.hf_sft.dataset_name),
                                    ("data.hf_preference.dataset_name", self.hf_preference.dataset_name)) if v]
            if given:
                raise ValueError(
                    f"{given[0]} is set but data.source is 'stdlib', which builds its own SFT and preference pairs and "
                    "would ignore it: set data.source: local (data.local.pretrain may stay null when nothing is "
                    f"pretrained), or set {given[0]} to null"
                )
        return self


class TokenizerParams(Section):
    """The `tokenizer` stage: train a byte-level BPE, or load an existing tokenizer."""

    kind: Literal["train", "pretrained"] = Field("train", description="Train a BPE, or load `name_or_path`.")
    name_or_path: str | None = Field(None, description="Hub name or local folder when kind is 'pretrained'.")
    vocab_size: int = Field(4096, ge=260, description="BPE vocabulary size in tokens (256 bytes + specials + merges).")
    min_frequency: int = Field(2, ge=1, description="Minimum pair count for a BPE merge.")
    model_max_length: int = Field(512, gt=0, description="Longest sequence in tokens the tokenizer reports.")

    @model_validator(mode="after")
    def _pretrained_named(self) -> TokenizerParams:
        if self.kind == "pretrained" and not self.name_or_path:
            raise ValueError("tokenizer.kind is 'pretrained' but tokenizer.name_or_path is not set")
        return self
