"""Token files (`llmpipe.data.tokens`, the `tokenize` stage): the ids on disk are exactly `pack_ids`'s, their dtype
fits the vocabulary, memory-mapped blocks equal in-memory ones, a file made with another tokenizer is refused,
and a failed or killed write leaves no token file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from llmpipe.core.errors import UserError
from llmpipe.core.io import hash_paths, read_jsonl
from llmpipe.data import tokens
from llmpipe.data.tokens import PackedBlocks, pack_ids, read_tokens, token_blocks, token_dtype, write_tokens
from llmpipe.models import load_tokenizer


@pytest.fixture(scope="module")
def tok_dir(workdir) -> Path:
    return workdir / "artifacts" / "tokenizer"


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def texts_of(path: Path) -> list[str]:
    return [row["text"] for row in read_jsonl(path)]


@pytest.fixture(scope="module")
def packed(workdir, tok) -> dict[str, np.ndarray]:
    """`pack_ids` of each pretraining split, all documents in one batch: what the token files must hold."""
    return {s: pack_ids(texts_of(workdir / "data" / "pretrain" / f"{s}.jsonl"), tok) for s in ("train", "validation")}


def test_pack_ids_gives_the_tokenizer_calls_ids_with_eos_after_each_document(workdir, tok):
    texts = texts_of(workdir / "data" / "pretrain" / "validation.jsonl")
    texts += ["", "special tokens in text: <s> </s> <|user|>"]

    def expected() -> list[int]:
        ids = tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [t for doc in ids for t in (*doc, tok.eos_token_id)]

    assert pack_ids(texts, tok).dtype == np.int64
    assert pack_ids(texts, tok).tolist() == expected()
    tok.backend_tokenizer.enable_truncation(8)  # a backend left truncating: pack_ids goes through the call
    try:
        assert pack_ids(texts, tok).tolist() == expected()
    finally:
        tok.backend_tokenizer.no_truncation()
    assert pack_ids([], tok).tolist() == []


def test_special_token_text_in_a_document_stays_text(tok):
    """A regex group named `s` in the stdlib corpus (``(?P<s>…)``) and special-token text typed in a file: no bos,
    eos or role id inside a document, and the text decodes back whole; the tokenizer itself is unchanged."""
    texts = ["m = re.match(r'(?P<s>a+)</s>', x)", "say <|user|> then <|assistant|> and <pad>"]
    ids = pack_ids(texts, tok).tolist()
    control = {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens}
    assert [i for i in ids if i in control] == [tok.eos_token_id] * 2, "only the eos after each document"
    first = ids[: ids.index(tok.eos_token_id)]
    assert tok.decode(first) == texts[0]
    assert tok("<s>", add_special_tokens=False)["input_ids"] == [tok.bos_token_id], "the tokenizer itself unchanged"


def test_the_stage_wrote_exactly_pack_ids_ids_with_their_metadata(workdir, tok, tok_dir, packed):
    """The `workdir` fixture ran the tokenize stage; its files hold pack_ids of each split, nothing more."""
    for split in ("train", "validation"):
        source = workdir / "data" / "pretrain" / f"{split}.jsonl"
        folder = workdir / "data" / "tokens" / split
        texts = texts_of(source)
        assert np.array_equal(np.fromfile(folder / "tokens.bin", dtype=np.uint16), packed[split]), split
        assert json.loads((folder / "meta.json").read_text()) == {
            "dtype": "uint16", "num_tokens": len(packed[split]), "num_documents": len(texts),
            "num_text_bytes": sum(len(t.encode()) for t in texts), "eos_token_id": tok.eos_token_id,
            "vocab_size": len(tok), "tokenizer_sha256": hash_paths([tok_dir]), "source_sha256": hash_paths([source]),
        }  # fmt: skip


def test_chunked_writing_gives_the_same_ids_as_one_batch(workdir, tok, tok_dir, packed, tmp_path, monkeypatch):
    source = workdir / "data" / "pretrain" / "validation.jsonl"
    monkeypatch.setattr(tokens, "CHUNK_CHARS", 5_000)  # dozens of chunks, documents longer than one
    meta = write_tokens(source, tmp_path / "validation", tok, tok_dir)
    assert np.array_equal(read_tokens(tmp_path / "validation", tok_dir), packed["validation"])
    assert meta["num_documents"] == len(texts_of(source))


def test_dtype_is_uint16_up_to_65536_tokens_then_uint32():
    assert token_dtype(1024) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0 … 65535
    assert token_dtype(65537) == np.uint32
    assert token_dtype(200_000) == np.uint32


def test_a_vocabulary_past_uint16_writes_uint32_ids_that_round_trip(tmp_path):
    """A real 70 000-word tokenizer: ids above 65535 must come back as they went in (uint16 would wrap them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tok.save_pretrained(tmp_path / "tok")
    texts = ["w69999 w3 w65534 w65535", "w0 w70000"]
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    meta = write_tokens(source, tmp_path / "tokens", tok, tmp_path / "tok")
    ids = read_tokens(tmp_path / "tokens", tmp_path / "tok")
    assert meta["dtype"] == "uint32" and ids.dtype == np.uint32
    assert ids.tolist() == [70001, 5, 65536, 65537, 1, 2, 0, 1] == pack_ids(texts, tok).tolist()


def test_memory_mapped_blocks_equal_the_in_memory_ones(workdir, tok_dir, packed):
    in_memory = PackedBlocks(packed["train"], 128)
    mapped = token_blocks(workdir / "data" / "tokens" / "train", tok_dir, 128)
    assert isinstance(mapped.blocks, np.memmap), "blocks are a view of the map, not a copy in memory"
    assert len(mapped) == len(in_memory) > 100
    for i in (0, 1, len(mapped) // 2, len(mapped) - 1):
        item = mapped[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (128,)
        assert torch.equal(item["input_ids"], in_memory[i]["input_ids"])
        assert torch.equal(item["labels"], item["input_ids"])
    rows = [5, 0, len(mapped) - 1]
    assert torch.equal(mapped.batch(rows), in_memory.batch(rows)) and mapped.batch(rows).dtype == torch.long
    assert len(token_blocks(workdir / "data" / "tokens" / "train", tok_dir, 128, max_blocks=7)) == 7
    with pytest.raises(UserError, match=r"data/tokens/validation: \d+ tokens, fewer than one block of max_length"):
        token_blocks(workdir / "data" / "tokens" / "validation", tok_dir, 10**7)


def test_token_files_of_another_tokenizer_are_refused(workdir, tok_dir, tmp_path):
    other = tmp_path / "tokenizer"
    shutil.copytree(tok_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))
    folder = workdir / "data" / "tokens" / "train"
    message = (r"data/tokens/train was tokenized with another tokenizer than .*tokenizer "
               r"\(meta.json: tokenizer_sha256 differs\).*dvc repro tokenize")  # fmt: skip
    with pytest.raises(UserError, match=message):
        read_tokens(folder, other)
    assert read_tokens(folder, tok_dir).shape[0] > 0, "the tokenizer it was made with passes"


def _source_with_a_bad_line(workdir: Path, dest: Path) -> Path:
    """The validation split with a broken line after its documents: the write fails once chunks are written."""
    source = dest / "docs.jsonl"
    source.write_text((workdir / "data" / "pretrain" / "validation.jsonl").read_text() + '{"text": "x"\n')
    return source


def test_a_failed_write_leaves_no_token_file_and_keeps_the_old_one(workdir, tok, tok_dir, tmp_path, monkeypatch):
    source = _source_with_a_bad_line(workdir, tmp_path)
    monkeypatch.setattr(tokens, "CHUNK_CHARS", 5_000)  # chunks are on disk when the bad line is reached
    with pytest.raises(ValueError, match=r"docs.jsonl:\d+: not valid JSON"):
        write_tokens(source, tmp_path / "out" / "train", tok, tok_dir)
    assert list((tmp_path / "out").iterdir()) == [], "no token folder and no temp folder"

    made, old = workdir / "data" / "tokens" / "validation", tmp_path / "old"
    shutil.copytree(made, old / "validation")
    with pytest.raises(ValueError):
        write_tokens(source, old / "validation", tok, tok_dir)
    assert [p.name for p in old.iterdir()] == ["validation"]
    assert (old / "validation" / "tokens.bin").read_bytes() == (made / "tokens.bin").read_bytes()


KILL_MIDWAY = """
import os, signal, sys
from pathlib import Path
from llmpipe.data import tokens
from llmpipe.models import load_tokenizer

tokens.CHUNK_CHARS = 5_000
calls = []
pack_ids = tokens.pack_ids
def pack_then_die(texts, tokenizer):
    calls.append(1)
    if len(calls) == 3:  # two chunks are in tokens.bin
        os.kill(os.getpid(), signal.SIGKILL)
    return pack_ids(texts, tokenizer)
tokens.pack_ids = pack_then_die
source, dest, tok_dir = map(Path, sys.argv[1:])
tokens.write_tokens(source, dest, load_tokenizer(tok_dir), tok_dir)
"""


def test_a_killed_write_leaves_the_previous_token_file_whole(workdir, tok_dir, tmp_path, offline_env):
    """SIGKILL mid-write: the half-written ids stay in a hidden temp folder, never under the token folder's name."""
    dest = tmp_path / "tokens" / "validation"
    shutil.copytree(workdir / "data" / "tokens" / "validation", dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MIDWAY, str(workdir / "data" / "pretrain" / "validation.jsonl"), str(dest),
         str(tok_dir)],
        env={**offline_env, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    leftovers = [p for p in dest.parent.iterdir() if p != dest]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".validation.tmp-"), leftovers
    assert (leftovers[0] / "tokens.bin").stat().st_size > 0 and not (leftovers[0] / "meta.json").exists()
