"""The embedded default corpus: the Python standard library of the running interpreter, split by module.

Nothing is downloaded: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (≈12 MB without test
folders) give pretraining documents (one per module), SFT pairs (signature + docstring → body), preference
pairs (real body vs a corrupted one) and a docstring → signature multiple-choice eval set.
"""

from __future__ import annotations

import ast
import hashlib
import os
import platform
import random
import sysconfig
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import DataParams
from llmpipe.core.errors import UserError
from llmpipe.data.corpus import Corpus
from llmpipe.data.corrupt import preference_pairs
from llmpipe.data.functions import Function, extract_functions
from llmpipe.data.splits import SPLITS, split_by_key, subsample

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
"""Folders of the stdlib tree that are not part of the corpus (installed packages and test suites)."""

NUM_CHOICES = 4
"""Choices per signature multiple-choice question (one right, three distractors)."""


@dataclass(frozen=True)
class Module:
    """One stdlib module that decodes as UTF-8 and parses.

    Attributes:
        path: Path relative to the stdlib root, with ``/`` separators (e.g. ``json/decoder.py``).
        text: The module source.
        functions: Its functions with a docstring and a body (:func:`extract_functions`).
    """

    path: str
    text: str
    functions: tuple[Function, ...]


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def module_paths(root: Path) -> list[str]:
    """Relative paths of the ``.py`` files under `root`, outside :data:`EXCLUDED_DIRS`, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def read_modules(root: Path, paths: Sequence[str]) -> tuple[list[Module], int, str]:
    """Read and parse the modules; skip files that are not UTF-8 or do not parse.

    Returns:
        The modules in the order of `paths`, the number of files skipped, and the sha256 (hex) over the
        relative path and bytes of every module used.
    """
    modules, skipped, digest = [], 0, hashlib.sha256()
    for rel in paths:
        raw = (root / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
            norm = text.replace("\r\n", "\n").replace("\r", "\n")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(norm)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            skipped += 1
            continue
        digest.update(rel.encode() + b"\0" + len(raw).to_bytes(8, "big") + raw)
        modules.append(Module(rel, text, tuple(extract_functions(norm, tree, rel))))
    return modules, skipped, digest.hexdigest()


def sft_row(fn: Function) -> dict[str, Any]:
    """A chat SFT row: the user gives signature + docstring, the assistant writes the body."""
    return {
        "messages": [{"role": "user", "content": fn.prompt}, {"role": "assistant", "content": fn.body}],
        "name": fn.name,
        "source": fn.source,
    }


def signature_mc(functions: Sequence[Function], pool: Sequence[Function], rng: random.Random) -> list[dict[str, Any]]:
    """Docstring → right signature among :data:`NUM_CHOICES`; distractors are other functions' signatures.

    Distractors have another short name and another signature text than the right one; the right one's
    position is drawn from `rng`. Functions with an empty docstring or too few distractors are left out.

    Returns:
        Rows ``{"query": docstring, "choices": [def line(s) × 4], "label": index of the right one, "name"}``.
    """
    rows = []
    for fn in functions:
        short = fn.name.rsplit(".", 1)[-1]
        others = {g.signature: g for g in pool if g.name.rsplit(".", 1)[-1] != short and g.signature != fn.signature}
        if not fn.docstring.strip() or len(others) < NUM_CHOICES - 1:
            continue
        choices = rng.sample(sorted(others), NUM_CHOICES - 1)
        label = rng.randrange(NUM_CHOICES)
        choices.insert(label, fn.signature)
        rows.append({"query": fn.docstring, "choices": choices, "label": label, "name": fn.name})
    return rows


def build_corpus(data: DataParams) -> Corpus:
    """Split the stdlib by module (hash of seed and relative path) and build every dataset from it.

    Args:
        data: The `data` params; `data.stdlib` sets the body-length window and the train caps.

    Raises:
        UserError: No module of the standard library could be read.
    """
    root = stdlib_root()
    modules, skipped, digest = read_modules(root, module_paths(root))
    if not modules:
        raise UserError("no readable .py files in this interpreter's standard library; set data.source to local or hf")
    by_split = split_by_key(modules, lambda m: m.path, data.seed, data.validation_fraction, data.test_fraction)
    lo, hi = data.stdlib.min_body_lines, data.stdlib.max_body_lines
    fns = {s: [f for m in by_split[s] for f in m.functions if lo <= f.num_body_lines <= hi] for s in SPLITS}
    caps = data.stdlib
    sft_fns = {**fns, "train": subsample(fns["train"], caps.max_sft_pairs, data.seed, "sft/train")}
    pref_fns = {**fns, "train": subsample(fns["train"], caps.max_preference_pairs, data.seed, "preference/train")}
    mc_fns = subsample(fns["test"], data.num_eval_examples, data.seed, "eval/signature_mc/candidates")
    return Corpus(
        pretrain={s: [{"text": m.text[: data.max_chars_per_document], "source": m.path} for m in by_split[s]]
                  for s in SPLITS},
        sft={s: [sft_row(f) for f in sft_fns[s]] for s in SPLITS},
        preference={s: preference_pairs(pref_fns[s], fns[s], random.Random(f"{data.seed}:preference/{s}"))
                    for s in SPLITS},
        signature_mc=signature_mc(mc_fns, fns["test"], random.Random(f"{data.seed}:eval/signature_mc")),
        manifest={
            "source": "stdlib",
            "description": (
                f"standard library of {platform.python_implementation()} {platform.python_version()}: the .py files "
                f"under sysconfig.get_paths()['stdlib'] outside folders named {', '.join(sorted(EXCLUDED_DIRS))}; "
                "paths are relative to that folder"
            ),
            "num_files": len(modules),
            "num_skipped_files": skipped,
            "content_sha256": digest,
        },
    )
