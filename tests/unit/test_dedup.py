"""Deduplication and decontamination (`llmpipe.data.dedup`) on planted duplicates, alone and in `prepare`.

Documents are 300 seeded random words from a 5,000-word vocabulary: two of them share no 5-word shingle in
practice. A near copy changes one word and appends one (Jaccard ≈ 0.96 at 5-word shingles, caught by the
default 9 × 13 banding with probability > 0.999); a half copy keeps half the words (Jaccard ≈ 0.33, caught with
probability < 10^-5), so it must be admitted. All seeds are fixed, so every decision here is deterministic.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmpipe.config import DedupParams, parse_params
from llmpipe.core.errors import UserError
from llmpipe.core.io import read_jsonl
from llmpipe.data.dedup import Deduplicator
from llmpipe.data.splits import SPLITS, split_by_key
from llmpipe.stages import prepare

VOCAB = [f"w{i}" for i in range(5000)]
PARAMS = DedupParams(capacity=10_000)  # the default capacity's 31 MB of filters is needlessly slow to copy


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCAB, k=300)) for _ in range(n)]


def near_copy(text: str) -> str:
    words = text.split()
    words[150] = "changed"
    return " ".join([*words, "appended"])


def half_copy(text: str, seed: int) -> str:
    words = text.split()
    return " ".join(words[:150] + documents(1, seed)[0].split()[:150])


def reformat(text: str) -> str:
    """The same document after normalisation: other case and whitespace."""
    return "  " + text.upper().replace(" ", " \n\t", 7) + "\n"


def test_planted_exact_and_near_duplicates_leave_the_originals():
    originals = documents(40, seed=0)
    planted = {reformat(t): "exact" for t in originals[:10]} | {near_copy(t): "near" for t in originals[10:20]}
    unrelated = {half_copy(t, seed=i): None for i, t in enumerate(originals[20:25])}
    stream = list(planted.items()) + list(unrelated.items())
    random.Random(1).shuffle(stream)
    dedup = Deduplicator(PARAMS)
    assert [dedup.check(t) for t in originals] == [None] * 40
    assert [dedup.check(t) for t, _ in stream] == [want for _, want in stream]
    assert dedup.counts == {"num_kept": 45, "num_dropped_exact": 10, "num_dropped_near": 10,
                            "num_dropped_contaminated": 0}
    near_only = Deduplicator(PARAMS.model_copy(update={"exact": False}))
    assert [near_only.check(t) for t in [*originals[:20], *planted]] == [None] * 20 + ["near"] * 20


def test_memory_stays_flat_however_many_documents():
    dedup = Deduplicator(PARAMS)
    empty = len(dedup.state())
    for text in documents(300, seed=2):
        assert dedup.check(text) is None
    assert len(dedup.state()) - empty < 10 and dedup.num_seen == 300  # the digits of the counts in its header


def test_training_copies_of_references_are_contaminated():
    references = documents(5, seed=3)
    dedup = Deduplicator(PARAMS)
    for text in references:
        dedup.add_reference(text)
    train = [references[0], reformat(references[1]), near_copy(references[2]), *documents(5, seed=4), references[0]]
    assert [dedup.check(t) for t in train] == ["contaminated"] * 3 + [None] * 5 + ["contaminated"]
    assert dedup.num_dropped_contaminated == 4 and dedup.num_kept == 5 and dedup.num_references == 5
    exact_only = Deduplicator(PARAMS.model_copy(update={"near": False}))
    exact_only.add_reference(references[2])
    assert exact_only.check(near_copy(references[2])) is None  # exact-only decontamination misses edits


def test_state_round_trip_gives_identical_decisions():
    originals = documents(30, seed=5)
    first = Deduplicator(PARAMS)
    for text in originals[:3]:
        first.add_reference(text)
    for text in originals[3:20]:
        first.check(text)
    second = Deduplicator.from_state(first.state(), PARAMS)
    assert second.counts == first.counts and second.num_seen == first.num_seen == 17
    rest = [*originals[20:], *originals[5:10], *map(near_copy, originals[:6]), *map(reformat, originals[10:15])]
    decisions = [first.check(t) for t in rest]
    assert [second.check(t) for t in rest] == decisions
    assert {None, "exact", "near", "contaminated"} <= set(decisions)
    assert second.state() == first.state()


def test_an_index_made_with_other_params_is_refused(tmp_path):
    path = tmp_path / "seen.bin"
    dedup = Deduplicator(PARAMS)
    dedup.check(documents(1, seed=6)[0])
    dedup.save(path)
    assert not list(tmp_path.glob(".seen.bin.tmp-*"))
    for key, value in {"num_perm": 64, "shingle_size": 3, "threshold": 0.7, "capacity": 20_000, "exact": False}.items():
        with pytest.raises(UserError, match=rf"seen\.bin: made with data\.dedup\.{key}=.*but data\.dedup\.{key} is"):
            Deduplicator(PARAMS.model_copy(update={key: value})).load(path)
    again = Deduplicator(PARAMS)
    again.load(path)
    assert again.check(documents(1, seed=6)[0]) == "exact" and again.num_seen == 1
    with pytest.raises(UserError, match="holds a seen index only"):
        Deduplicator.from_state(path.read_bytes(), PARAMS)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UserError, match="damaged"):
        again.load(path)
    path.write_text("not an index")
    with pytest.raises(UserError, match="not a dedup index"):
        again.load(path)


# --- in the prepare stage ------------------------------------------------------------------------------------


def prepare_local(root: Path, texts: list[str], **dedup) -> dict[str, float]:
    """`prepare` on `texts` as a local jsonl file under `root`, splits of 60 / 20 / 20 %."""
    source = root / "in" / "docs.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = {"source": "local", "seed": 11, "validation_fraction": 0.2, "test_fraction": 0.2,
            "local": {"pretrain": str(source)}, "dedup": {"capacity": 10_000, **dedup}}
    return prepare.run(parse_params({"paths": {"data": str(root / "data"), "metrics": str(root / "metrics")},
                                     "data": data}))


def train_texts(root: Path) -> list[str]:
    return [d["text"] for d in read_jsonl(root / "data" / "pretrain" / "train.jsonl")]


def test_prepare_drops_duplicates_and_contaminated_training_documents(tmp_path):
    originals = documents(60, seed=7)
    exact, near = originals[:8], [near_copy(t) for t in originals[8:20]]
    texts = originals + exact + near
    # where each text lands: prepare splits local documents by the hash of their text, as here
    split = split_by_key(texts, str, 11, 0.2, 0.2)
    where = {t: s for s in SPLITS for t in split[s]}
    want = {
        "exact": sum(where[t] == "train" for t in exact),
        "near": sum(where[c] == where[o] == "train" for o, c in zip(originals[8:20], near)),
        # either way: a training copy of a held-out original, or a training original of a held-out copy
        "contaminated": sum(where[c] != where[o] and "train" in (where[o], where[c])
                            for o, c in zip(originals[8:20], near)),
    }
    assert all(want.values()), want  # the seed plants every kind in train
    metrics = prepare_local(tmp_path, texts)
    dropped = {k: metrics[f"num_dedup_dropped_{k}"] for k in want}
    assert dropped == want
    assert metrics["num_dedup_kept"] == metrics["num_documents_train"] == len(split["train"]) - sum(want.values())
    kept = train_texts(tmp_path)
    assert len(kept) == len(set(kept)) and not set(near) & set(kept)
    assert [d["text"] for d in read_jsonl(tmp_path / "data" / "pretrain" / "test.jsonl")] == split["test"]
    info = json.loads((tmp_path / "data" / "pretrain" / "manifest.json").read_text())
    assert info["dedup"]["counts"] == {"num_kept": len(kept), **{f"num_dropped_{k}": n for k, n in want.items()}}
    off = prepare_local(tmp_path / "off", texts, exact=False, near=False, decontaminate=False)
    assert off["num_documents_train"] == off["num_dedup_kept"] == len(split["train"])


def test_prepare_with_a_seen_index_admits_nothing_an_earlier_run_consumed(tmp_path):
    originals = documents(60, seed=8)
    seen = str(tmp_path / "seen.bin")
    prepare_local(tmp_path / "first", originals[:40], seen_hashes_path=seen)
    consumed = set(train_texts(tmp_path / "first"))
    metrics = prepare_local(tmp_path / "second", originals[20:], seen_hashes_path=seen)
    second = set(train_texts(tmp_path / "second"))
    overlap = consumed & set(originals[20:])
    assert overlap and second and not consumed & second
    assert metrics["num_dedup_dropped_exact"] == len(overlap)  # a document keeps its split: hash of its text
    before = Path(seen).read_bytes()
    with pytest.raises(UserError, match=r"all \d+ training documents were dropped.*seen\.bin records what earlier"):
        prepare_local(tmp_path / "second", originals[20:], seen_hashes_path=seen)
    assert Path(seen).read_bytes() == before and set(train_texts(tmp_path / "second")) == second
    with pytest.raises(UserError, match=r"made with data\.dedup\.num_perm=128, but data\.dedup\.num_perm is 64"):
        prepare_local(tmp_path / "third", originals, seen_hashes_path=seen, num_perm=64)
