"""Streaming pretraining (`data.streaming: true`): the cursor resumes token for token (also twice, and through a
mixture), ranks read disjoint documents, a cursor refuses other data, and a 2-process `llm-train --task stream_lm`
killed and resumed twice trains on the batches of an uninterrupted run."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port

from llmpipe.config import load_params
from llmpipe.core.errors import UserError
from llmpipe.data.stream import packing
from llmpipe.data.stream.filter import deduplicator
from llmpipe.models import load_tokenizer
from llmpipe.train.callbacks import batch_digest

WORDS = "the a of model data stream token block shard cursor resume learning rate batch loss eval train".split()

# Small shards (20 documents of ~40 tokens), so a dozen steps cross several shards and the shard order matters.
PARAMS = {
    "data": {"source": "hf", "streaming": True, "num_eval_examples": 16, "hf": {"dataset_name": "corpus"},
             "stream": {"shuffle_buffer": 16, "sample_documents": 300}},
    "tokenizer": {"vocab_size": 300},
    "model": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 64, "max_position_embeddings": 128},
    "train": {"max_length": 128, "logging_steps": 1, "max_eval_samples": 8, "warmup_steps": 1, "lr": 1e-3,
              "weight_decay": 0.0},  # lr and weight_decay: the values these tests were written with
    "pretrain": {"max_steps": 12, "save_steps": 3, "eval_steps": 12, "per_device_train_batch_size": 4,
                 "max_length": 32},
}


def write_corpus(folder: Path, num_shards: int, docs_per_shard: int, seed: int) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    for f in range(num_shards):
        with open(folder / f"part-{f:02d}.jsonl", "w") as fh:
            for i in range(docs_per_shard):
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
                fh.write(json.dumps({"text": f"{folder.name} {f}-{i}: {words}"}) + "\n")


@pytest.fixture(scope="module")
def streamdir(tmp_path_factory) -> Path:
    """A folder with an 8-shard and a 3-shard corpus, params.yaml streaming the first, and prepare's sample,
    tokenizer and token files (validation blocks) made from it."""
    from llmpipe.stages import prepare, tokenize, tokenizer

    root = tmp_path_factory.mktemp("stream")
    write_corpus(root / "corpus", 8, 20, seed=0)
    write_corpus(root / "other", 3, 30, seed=1)
    (root / "params.yaml").write_text(yaml.safe_dump(PARAMS))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        params = load_params("params.yaml")
        prepare.run(params)
        tokenizer.run(params)
        tokenize.run(params)
    finally:
        os.chdir(cwd)
    return root


def _params(root: Path, **data):
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["data"] = {**raw["data"], **data}
    path = root / f"params-{hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:8]}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_params(path)


def _take(stream, n: int) -> list[list[int]]:
    it = iter(stream)
    return [next(it)["input_ids"].tolist() for _ in range(n)]


def _stream(params, root: Path, rank: int = 0, world: int = 1):
    tok = load_tokenizer(root / params.paths.tokenizer)
    dedup = deduplicator(params.data, [])
    return packing.build(params.data, tok, params.pretrain.max_length, rank, world, str(root / "scratch"), dedup)


def test_the_cursor_resumes_token_for_token_twice_through_a_mixture(streamdir, monkeypatch):
    monkeypatch.chdir(streamdir)
    params = _params(streamdir, source="mixture", mixture=[{"dataset_name": "corpus", "weight": 3.0},
                                                           {"dataset_name": "other", "weight": 1.0}])
    whole = _take(_stream(params, streamdir), 120)

    first = _stream(params, streamdir)
    _take(first, 25)  # a step's batches, as the Trainer reads them
    cursor = json.loads(json.dumps(first.cursor_at(25)))  # through JSON, as the checkpoint stores it
    second = _stream(params, streamdir)
    second.resume(cursor, "test")
    assert _take(second, 35) == whole[25:60]
    third = _stream(params, streamdir)
    third.resume(json.loads(json.dumps(second.cursor_at(60))), "test")
    assert _take(third, 60) == whole[60:120]
    assert third.filters.counts["num_tokens"] == _stream_tokens(params, streamdir, 120), "counts survive resumes"

    docs = _documents(params, streamdir, 0, 1, 200)
    share = sum(d.startswith("corpus") for d in docs) / len(docs)
    assert 0.65 < share < 0.85, f"weights 3:1 gave a {share:.2f} share"


def _stream_tokens(params, root: Path, blocks: int) -> int:
    stream = _stream(params, root)
    _take(stream, blocks)
    return stream.filters.counts["num_tokens"]


def _documents(params, root: Path, rank: int, world: int, limit: int | None = None) -> list[str]:
    """Documents of one pass (or the first `limit`) of the stream of rank `rank`."""
    stream = _stream(params, root, rank, world)
    out, docs = [], stream.documents
    while limit is None or len(out) < limit:
        text = docs.next_document()
        if any(s.epoch for s in docs.streams):
            break
        out.append(text)
    return out


@pytest.mark.parametrize("name,how", [("corpus", "8 shards: by shard"), ("other", "3 shards: by document")])
def test_ranks_read_disjoint_documents(streamdir, monkeypatch, name, how):
    monkeypatch.chdir(streamdir)
    params = _params(streamdir, hf={"dataset_name": name}, stream={"shuffle_buffer": 0, "sample_documents": 300})
    ranks = [_documents(params, streamdir, r, 2) for r in range(2)]
    one = _documents(params, streamdir, 0, 1)
    assert ranks[0] and ranks[1] and not set(ranks[0]) & set(ranks[1]), how
    assert sorted(ranks[0] + ranks[1]) == sorted(one), "together the ranks read the whole pass, once"
    heldout = {json.loads(line)["text"] for split in ("validation", "test")
               for line in (streamdir / "data" / "pretrain" / f"{split}.jsonl").read_text().splitlines()}
    assert heldout and not heldout & set(one), "the held-out documents never enter the training stream"


def test_the_stream_drops_duplicates_and_a_later_run_skips_what_it_admitted(streamdir, monkeypatch):
    monkeypatch.chdir(streamdir)
    rows = [json.dumps({"text": f"unique document {i}: " + " ".join(WORDS[i % 7 :] + WORDS[: i % 5])})
            for i in range(60)]
    copied = [r for r in rows[:30] for _ in range(2)]  # each document twice in a row
    for name, parts in (("dups", [copied, rows[30:45]]), ("more", [rows[30:], rows[:10]])):
        (streamdir / name).mkdir()
        for i, part in enumerate(parts):
            (streamdir / name / f"part-{i}.jsonl").write_text("\n".join(part) + "\n")
    dedup = {"near": False, "seen_hashes_path": "seen.bin"}
    unshuffled = {"shuffle_buffer": 0, "sample_documents": 300}
    first = _params(streamdir, hf={"dataset_name": "dups"}, dedup=dedup, stream=unshuffled)
    stream = _stream(first, streamdir)
    docs = [stream.documents.next_document() for _ in range(43)]  # 45 distinct documents, 2 of them held out
    assert len(set(docs)) == 43 and set(docs) <= set(_texts(rows[:45])), "a copy came through"
    assert stream.filters.counts["num_dropped_exact"] > 0
    stream.filters.dedup.save("seen.bin")
    later = _documents_of(_stream(_params(streamdir, hf={"dataset_name": "more"}, dedup=dedup, stream=unshuffled),
                                  streamdir))
    assert later and not set(later) & set(docs), "a document the first run admitted came back"
    assert set(later) <= set(_texts(rows[45:]))


def _texts(rows: list[str]) -> list[str]:
    return [json.loads(r)["text"] for r in rows]


def _documents_of(stream) -> list[str]:
    """One pass of a stream's documents (with shuffle_buffer 0: nothing waits in the buffer)."""
    out = []
    while not any(s.epoch for s in stream.documents.streams):
        text = stream.documents.next_document()
        if not any(s.epoch for s in stream.documents.streams):
            out.append(text)
    return out


def test_a_cursor_of_other_data_is_refused(streamdir, monkeypatch):
    monkeypatch.chdir(streamdir)
    params = _params(streamdir)
    stream = _stream(params, streamdir)
    _take(stream, 5)
    cursor = stream.cursor_at(5)
    os.utime(streamdir / "corpus" / "part-01.jsonl")  # a touch (or a copy) is not other data
    _stream(params, streamdir).resume(cursor, "checkpoint-5")
    shard = streamdir / "corpus" / "part-03.jsonl"
    shard.write_text(shard.read_text() + json.dumps({"text": "a new document"}) + "\n")
    with pytest.raises(UserError, match="saved while streaming other data"):
        _stream(params, streamdir).resume(cursor, "checkpoint-5")


def test_a_shard_that_cannot_be_read_names_the_source_and_shard(streamdir, monkeypatch):
    monkeypatch.chdir(streamdir)
    (streamdir / "broken").mkdir()
    (streamdir / "broken" / "part-0.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    stream = _stream(_params(streamdir, hf={"dataset_name": "broken"}), streamdir)
    with pytest.raises(UserError, match=r"data.hf: 'broken' shard 1 of 1 .* cannot be read .*fix or remove that file"):
        _take(stream, 1)


# ---- end to end: llm-train --task stream_lm, killed and resumed ---------------------------------------------------


def _llm_train(root: Path, out: Path, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmpipe.cli", "--task", "stream_lm", "--output-dir", str(out)]
    return subprocess.run(cmd, cwd=root, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


def _ledger(out: Path) -> list[dict[str, str]]:
    with open(out / "logs" / "pretrain" / "batches.csv") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_a_two_process_stream_killed_twice_reads_the_batches_of_an_uninterrupted_run(streamdir, tmp_path):
    """The second resume is where `datasets` itself has had bugs; both ranks resume at their own cursor, and rank
    0's ledger equals the batches its stream gives uninterrupted."""
    params = yaml.safe_load((streamdir / "params.yaml").read_text())
    params["distributed"] = {"strategy": "ddp", "num_processes": 2, "main_process_port": free_port()}
    (streamdir / "params.yaml").write_text(yaml.safe_dump(params))
    try:
        killed = tmp_path / "killed"
        for at in (5, 8):  # checkpoints every 3 steps: resumes from 3, then from 6
            crash = _llm_train(streamdir, killed, LLMPIPE_KILL_AT_STEP=str(at))
            assert crash.returncode != 0 and "rank 1/2 reads every 2-th of the shards" in crash.stderr
        resumed = _llm_train(streamdir, killed)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "stream resumes after block 24 of rank 1" in resumed.stderr and "(step 6)" in resumed.stderr
        metrics = json.loads((killed / "metrics" / "pretrain.json").read_text())
        assert metrics["resumed_from_step"] == 6 and metrics["stream_num_dropped_heldout"] > 0
    finally:
        del params["distributed"]
        (streamdir / "params.yaml").write_text(yaml.safe_dump(params))
    # An uninterrupted run's rank 0 trains on rank 0's stream of 2 (which is not what one process reads).
    uninterrupted = [_batch_digests(streamdir, rank=0, world=world, steps=12, batch=4) for world in (2, 1)]
    assert [r["sha"] for r in _ledger(killed)] == uninterrupted[0] != uninterrupted[1]


def _batch_digests(root: Path, rank: int, world: int, steps: int, batch: int) -> list[str]:
    """The batch ledger (`BatchLedger` digests) of `steps` steps of rank `rank`'s stream, read in this process
    with the deduplicator the pretrain stage builds (the held-out documents as references)."""
    import torch

    cwd = os.getcwd()
    os.chdir(root)
    try:
        params = load_params("params.yaml")
        held_out = [json.loads(line)["text"] for split in ("validation", "test")
                    for line in Path("data", "pretrain", f"{split}.jsonl").read_text().splitlines()]
        tok = load_tokenizer(params.paths.tokenizer)
        blocks = iter(packing.build(params.data, tok, params.pretrain.max_length, rank, world, "scratch",
                                    deduplicator(params.data, held_out)))
        rows = []
        for _ in range(steps):
            items = [next(blocks) for _ in range(batch)]
            h = hashlib.sha256()
            batch_digest({k: torch.stack([b[k] for b in items]) for k in ("input_ids", "labels")}, h)
            rows.append(h.hexdigest()[:16])
        return rows
    finally:
        os.chdir(cwd)


# ---- presets and the params of a stream ----------------------------------------------------------------------


def test_list_presets_prints_each_hub_address(capsys):
    from llmpipe.cli import main
    from llmpipe.config.presets import PRESETS

    assert main(["--list-presets"]) == 0
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
        assert name in out and preset.dataset_name in out and preset.text_column in out
    assert "redpajama/<subset>" in out


@pytest.mark.parametrize("data,message", [
    ({"source": "hf", "hf": {"preset": "c5"}}, "unknown preset 'c5'; presets: tinystories, fineweb-edu, c4"),
    ({"source": "hf", "hf": {"preset": "redpajama/arxiv"}}, "dataset script.*use preset 'slimpajama'"),
    ({"source": "mixture", "mixture": [{"preset": "c4"}]}, "data.source 'mixture' is read as a stream"),
    ({"streaming": True}, "data.streaming is true but data.source is 'stdlib'"),
    ({"source": "hf", "streaming": True, "hf": {"preset": "c4", "max_documents": 9}},
     "data.hf.max_documents is set but data.streaming is true"),
])
def test_stream_params_errors_name_the_key(tmp_path, data, message):
    from llmpipe.config import ParamsError

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"data": data}))
    with pytest.raises(ParamsError, match=message):
        load_params(tmp_path / "params.yaml")


def test_a_preset_fills_only_the_fields_not_given(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(
        {"data": {"source": "hf", "hf": {"preset": "fineweb-edu", "dataset_config": "sample-100BT"}}}))
    hf = load_params(tmp_path / "params.yaml").data.hf
    assert (hf.dataset_name, hf.dataset_config, hf.text_column) == ("HuggingFaceFW/fineweb-edu", "sample-100BT", "text")


def test_a_stream_needs_a_step_budget_and_stream_lm_needs_a_stream(tmp_path, monkeypatch, capsys):
    from llmpipe.cli import main
    from llmpipe.config import ParamsError

    raw = {**PARAMS, "pretrain": {**PARAMS["pretrain"], "max_steps": -1}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError, match="a stream has no length: set pretrain.max_steps, or pretrain.steps_per_epoch"):
        load_params(tmp_path / "params.yaml")
    raw["pretrain"]["steps_per_epoch"] = 5
    raw["pretrain"]["num_train_epochs"] = 2.0
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    assert load_params(tmp_path / "params.yaml").pretrain.resolved_max_steps == 10
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    assert main(["--task", "stream_lm"]) == 2
    assert "--task stream_lm streams the pretraining text: set data.streaming: true" in capsys.readouterr().err


@pytest.mark.slow
def test_a_continued_run_with_seen_hashes_reads_what_one_longer_run_reads(streamdir, tmp_path, monkeypatch):
    """Raising the step budget continues the run on the tokens of one longer run, although the first part wrote
    `seen_hashes_path` (each pass restarts the index from the run's start, kept in the run folder)."""
    from llmpipe import stages

    monkeypatch.chdir(streamdir)

    def pretrain(root: Path, max_steps: int, seen: Path) -> list[dict[str, str]]:
        overrides = {"paths.output_root": str(root), "pretrain.max_steps": max_steps, "pretrain.save_steps": 10,
                     "pretrain.eval_steps": 1000, "data.dedup.seen_hashes_path": str(seen)}
        stages.runner("pretrain")(load_params("params.yaml", overrides))
        return _ledger(root)

    pretrain(tmp_path / "continued", 40, tmp_path / "seen-a.bin")  # ~1 pass of the corpus
    continued = pretrain(tmp_path / "continued", 250, tmp_path / "seen-a.bin")  # passes more than once
    assert len(continued) == 250
    assert continued == pretrain(tmp_path / "straight", 250, tmp_path / "seen-b.bin")
