"""The `prepare` stage: the stdlib corpus (split, SFT, preference, eval sets), users' data, errors, atomicity.

The stdlib runs read the real standard library of this interpreter (≈5 s each on 2 cores); the local and hub
runs use small files written here and read through the real `datasets` loaders, offline.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmpipe.config import ParamsError, parse_params
from llmpipe.core.errors import UserError
from llmpipe.core.io import read_jsonl
from llmpipe.data import stdlib
from llmpipe.data.splits import split_by_key
from llmpipe.stages import prepare

SPLITS = ("train", "validation", "test")
SUBSETS = ("pretrain", "sft", "preference", "tasks")
EVAL = ("perplexity", "signature_mc", "sft", "preference", "tasks")
STDLIB_DATA = {
    "seed": 7,
    "num_eval_examples": 50,
    "stdlib": {"max_sft_pairs": 1500, "max_preference_pairs": 1200},
    "tasks": {"enabled": False},  # the stdlib corpus alone (the tasks: tests/stages/test_tasks_stages.py)
}


def make_params(root: Path, data: dict[str, Any]):
    """Params writing under `root`, with the given `data` section."""
    images = {"num_train": 3, "num_validation": 3, "num_test": 3}  # the vlm set: drawn, not what these tests check
    return parse_params({"paths": {"data": str(root / "data"), "metrics": str(root / "metrics")},
                         "data": {"images": images, **data}})


def load(root: Path, sub: str, name: str) -> list[dict[str, Any]]:
    return read_jsonl(root / "data" / sub / f"{name}.jsonl")


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root/data`` (relative path → bytes), hidden leftovers included."""
    data = root / "data"
    return {p.relative_to(data).as_posix(): p.read_bytes() for p in sorted(data.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stdlib_run(tmp_path_factory) -> tuple[Path, dict[str, float]]:
    root = tmp_path_factory.mktemp("stdlib")
    return root, prepare.run(make_params(root, STDLIB_DATA))


# --- the stdlib corpus -------------------------------------------------------------------------------------


def test_stdlib_same_seed_gives_identical_files(stdlib_run, tmp_path, capsys):
    root, metrics = stdlib_run
    again = prepare.run(make_params(tmp_path, STDLIB_DATA))
    assert again == metrics
    # Its progress: one line per phase, with what it counted.
    phases = re.findall(r"^prepare: (.+) in \d:\d\d:\d\d(?: \((.*)\))?$", capsys.readouterr().out, re.MULTILINE)
    assert [p[0] for p in phases] == ["read the text of data.source: stdlib", "added the executable function tasks",
                                      "deduplicated and built the evaluation sets", "wrote the image records",
                                      f"wrote {tmp_path / 'data'}"]  # fmt: skip
    read = int(re.fullmatch(r"([\d,]+) documents", phases[0][1]).group(1).replace(",", ""))
    assert read >= sum(metrics[f"num_documents_{s}"] for s in SPLITS)  # before deduplication
    assert phases[2][1].startswith(f"{metrics['num_documents_train']:,} training documents kept")
    assert phases[3][1] == f"{3 * len(SPLITS)} records"
    first, second = snapshot(root), snapshot(tmp_path)
    expected = {f"{s}/{n}.jsonl" for s in (*SUBSETS, "vlm") for n in SPLITS} | {f"eval/{n}.jsonl" for n in EVAL}
    images = {f"vlm/images/{s}/{i:05d}.png" for s in SPLITS for i in range(3)}
    assert set(first) == expected | images | {"pretrain/manifest.json"}
    assert first == second


def test_stdlib_another_seed_gives_another_split():
    paths = stdlib.module_paths(stdlib.stdlib_root())
    a = split_by_key(paths, str, 7, 0.05, 0.05)
    b = split_by_key(paths, str, 8, 0.05, 0.05)
    assert a["test"] != b["test"] and a["validation"] != b["validation"]
    assert a == split_by_key(paths, str, 7, 0.05, 0.05)
    assert not any(part in stdlib.EXCLUDED_DIRS for p in paths for part in p.split("/")[:-1])


def test_stdlib_modules_never_cross_splits(stdlib_run):
    root, metrics = stdlib_run
    modules = {s: {d["source"] for d in load(root, "pretrain", s)} for s in SPLITS}
    assert all(modules.values())
    assert not (modules["train"] & modules["validation"] or modules["train"] & modules["test"]
                or modules["validation"] & modules["test"])
    dropped = sum(metrics[f"num_dedup_dropped_{why}"] for why in ("exact", "near", "contaminated"))
    assert sum(map(len, modules.values())) + dropped == metrics["num_files"]  # data.dedup drops training modules
    for sub in ("sft", "preference"):
        for s in SPLITS:
            assert {r["source"] for r in load(root, sub, s)} <= modules[s]
    for name in ("sft", "preference"):
        assert {r["source"] for r in load(root, "eval", name)} <= modules["test"]
    test_docs = [d["text"] for d in load(root, "pretrain", "test")]
    for row in load(root, "eval", "perplexity"):
        assert 0 < len(row["text"]) <= 4000 and any(t.startswith(row["text"]) for t in test_docs)


def test_stdlib_sft_pairs_are_the_function_split_in_two(stdlib_run):
    root, metrics = stdlib_run
    assert metrics["num_sft_train"] == 1500  # capped by data.stdlib.max_sft_pairs
    rows = [r for s in SPLITS for r in load(root, "sft", s)]
    for row in rows:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        prompt, body = user["content"], assistant["content"]
        assert prompt.startswith(("def ", "async def ")), prompt[:80]
        code = [line for line in body.split("\n") if line.strip() and not line.startswith("#")]
        assert code[0].startswith((" ", "\t")) and 2 <= len(body.split("\n")) <= 30
        fn = ast.parse(prompt + "\n" + body).body[0]
        assert isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name == row["name"].split(".")[-1]
        assert ast.get_docstring(fn) is not None


def test_stdlib_preference_corruptions(stdlib_run):
    root, metrics = stdlib_run
    train = load(root, "preference", "train")
    assert len(train) == metrics["num_preference_train"] == 1200
    counts = Counter(r["corruption"] for r in train)
    assert set(counts) == {"swap", "truncate", "syntax"}
    mean = len(train) / 3
    assert all(abs(n - mean) <= 0.1 * mean for n in counts.values()), counts
    assert {k: metrics[f"num_preference_{k}_train"] for k in counts} == dict(counts)
    for row in train + load(root, "preference", "test"):
        prompt, chosen, rejected = (row[k][0]["content"] for k in ("prompt", "chosen", "rejected"))
        assert [row[k][0]["role"] for k in ("prompt", "chosen", "rejected")] == ["user", "assistant", "assistant"]
        ast.parse(prompt + "\n" + chosen)
        assert rejected != chosen
        if row["corruption"] == "syntax":
            with pytest.raises(SyntaxError):
                ast.parse(prompt + "\n" + rejected)
        elif row["corruption"] == "truncate":
            assert chosen.startswith(rejected) and rejected.count("\n") < chosen.count("\n")


def test_stdlib_signature_mc(stdlib_run):
    root, metrics = stdlib_run
    rows = load(root, "eval", "signature_mc")
    assert len(rows) == metrics["num_eval_signature_mc"] == 50
    prompts = {}
    for r in load(root, "sft", "test"):
        prompts.setdefault(r["name"], []).append(r["messages"][0]["content"])
    for row in rows:
        assert len(row["choices"]) == len(set(row["choices"])) == 4 and row["query"]
        assert all(c.lstrip().startswith(("def ", "async def ")) for c in row["choices"])
        assert any(p.startswith(row["choices"][row["label"]]) for p in prompts[row["name"]])
    assert len({r["label"] for r in rows}) == 4


def test_stdlib_metrics_and_manifest(stdlib_run):
    root, metrics = stdlib_run
    metrics = dict(metrics)
    sources = metrics.pop("sources")
    assert all(isinstance(v, int | float) for v in metrics.values())
    assert list(sources) == ["stdlib"] and sources["stdlib"]["documents"] == sum(
        metrics[f"num_documents_{s}"] for s in SPLITS)
    info = json.loads((root / "data" / "pretrain" / "manifest.json").read_text())
    assert int(info["content_sha256"][:12], 16) == metrics["content_hash_int"]
    assert info["counts"]["pretrain"]["train"] == metrics["num_documents_train"]
    assert str(stdlib.stdlib_root()) not in json.dumps(info)  # no absolute interpreter path in a DVC out
    assert metrics["num_chars_train"] > 1_000_000 and metrics["num_eval_perplexity"] > 0


# --- users' data ---------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def documents(n: int) -> list[dict[str, str]]:
    return [{"text": f"document {i}: " + "word " * (i % 7 + 1)} for i in range(n)]


def chats(n: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
            for i in range(n)]


def preference_data(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"p {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]


def test_local_jsonl_with_sft_and_preference(tmp_path):
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", documents(40) + documents(5))  # 5 duplicates
    write_jsonl(tmp_path / "in" / "sft" / "a.jsonl", chats(20)[:10])
    write_jsonl(tmp_path / "in" / "sft" / "b.jsonl", chats(20)[10:])
    pref = write_jsonl(tmp_path / "in" / "pref.jsonl", preference_data(30))
    data = {"source": "local", "local": {"pretrain": str(docs), "sft": str(tmp_path / "in" / "sft"),
                                         "preference": str(pref)}}
    metrics = prepare.run(make_params(tmp_path, data))
    texts = {s: [d["text"] for d in load(tmp_path, "pretrain", s)] for s in SPLITS}
    assert all(texts.values()) and sum(map(len, texts.values())) == 40
    assert not set(texts["train"]) & (set(texts["validation"]) | set(texts["test"]))  # duplicates share a split
    assert metrics["num_dedup_dropped_exact"] == 5  # ... train, here, where data.dedup keeps the first of each
    assert {d["source"] for s in SPLITS for d in load(tmp_path, "pretrain", s)} == {"docs.jsonl"}
    sft = [r for s in SPLITS for r in load(tmp_path, "sft", s)]
    assert len(sft) == 20 and {r["source"] for r in sft} == {"a.jsonl", "b.jsonl"}
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in sft)
    pref_rows = [r for s in SPLITS for r in load(tmp_path, "preference", s)]
    assert len(pref_rows) == 30 and all(r["corruption"] == "none" for r in pref_rows)
    assert pref_rows[0]["chosen"][0] == {"role": "assistant", "content": pref_rows[0]["chosen"][0]["content"]}
    assert load(tmp_path, "eval", "signature_mc") == []
    assert load(tmp_path, "eval", "sft") == load(tmp_path, "sft", "test")
    assert metrics["num_eval_perplexity"] == metrics["num_documents_test"] > 0
    assert metrics["num_files"] == 4


def test_local_parquet_with_prompt_completion_sft(tmp_path):
    table = pa.Table.from_pylist(documents(20))
    (tmp_path / "pq").mkdir()
    pq.write_table(table.slice(0, 12), tmp_path / "pq" / "part-0.parquet")
    pq.write_table(table.slice(12), tmp_path / "pq" / "part-1.parquet")
    pairs = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "sft.parquet")
    data = {"source": "local", "local": {"pretrain": str(tmp_path / "pq"), "sft": str(tmp_path / "sft.parquet")}}
    metrics = prepare.run(make_params(tmp_path, data))
    rows = [d for s in SPLITS for d in load(tmp_path, "pretrain", s)]
    assert sorted(d["text"] for d in rows) == sorted(d["text"] for d in documents(20))
    assert Counter(d["source"] for d in rows) == {"part-0.parquet": 12, "part-1.parquet": 8}
    sft = sorted((r for s in SPLITS for r in load(tmp_path, "sft", s)), key=lambda r: int(r["name"].split(":")[1]))
    assert sft[3] == {"messages": [{"role": "user", "content": "question 3"},
                                   {"role": "assistant", "content": "answer 3"}],
                      "name": "sft.parquet:4", "source": "sft.parquet"}
    assert metrics["num_preference_train"] == 0


def test_local_text_folder_one_document_per_file(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    for i in range(6):
        (folder / ("sub" if i % 2 else ".") / f"story{i}.txt").write_text(f"Once upon a time {i}.\n\nThe end.\n")
    (folder / ".hidden.txt").write_text("ignored")
    prepare.run(make_params(tmp_path, {"source": "local", "max_chars_per_document": 20,
                                       "local": {"pretrain": str(folder)}}))
    rows = [d for s in SPLITS for d in load(tmp_path, "pretrain", s)]
    assert len(rows) == 6 and all(len(d["text"]) == 20 for d in rows)
    assert {d["source"] for d in rows} == {f"{'sub/' if i % 2 else ''}story{i}.txt" for i in range(6)}


def test_hf_source_on_a_local_dataset_folder(tmp_path):
    folder = tmp_path / "my_dataset"
    write_jsonl(folder / "train.jsonl", [{"story": d["text"]} for d in documents(30)])
    write_jsonl(folder / "test.jsonl", [{"story": "held out by the dataset, not read"}])
    (folder / "README.md").write_text("A dataset card.\n")
    data = {"source": "hf", "hf": {"dataset_name": str(folder), "split": "train", "text_column": "story",
                                   "max_documents": 25}}
    metrics = prepare.run(make_params(tmp_path, data))
    rows = [d for s in SPLITS for d in load(tmp_path, "pretrain", s)]
    assert sorted(d["text"] for d in rows) == sorted(d["text"] for d in documents(30)[:25])
    assert {d["source"] for d in rows} == {"my_dataset:train"} and metrics["num_files"] == 3
    whole = prepare.run(make_params(tmp_path / "w", {**data, "hf": {**data["hf"], "max_documents": None}}))
    assert sum(whole[f"num_documents_{s}"] for s in SPLITS) == 30


# --- user mistakes -------------------------------------------------------------------------------------------


def local(tmp_path: Path, **paths: str):
    return make_params(tmp_path, {"source": "local", "local": paths})


def test_missing_path(tmp_path):
    with pytest.raises(UserError, match=r"data\.local\.pretrain: .*nowhere.jsonl does not exist"):
        prepare.run(local(tmp_path, pretrain=str(tmp_path / "nowhere.jsonl")))


def test_empty_file_and_empty_folder(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match=r"empty\.jsonl is empty"):
        prepare.run(local(tmp_path, pretrain=str(tmp_path / "empty.jsonl")))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"blank\.jsonl has no records"):
        prepare.run(local(tmp_path, pretrain=str(tmp_path / "blank.jsonl")))
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"broken\.parquet is not a readable parquet file"):
        prepare.run(local(tmp_path, pretrain=str(tmp_path / "broken.parquet")))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(UserError, match="has no data files"):
        prepare.run(local(tmp_path, pretrain=str(tmp_path / "nothing")))


def test_jsonl_with_a_broken_line_names_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"\n{"text": "four"}\n')
    with pytest.raises(UserError) as err:
        prepare.run(local(tmp_path, pretrain=str(path)))
    assert f"{path}:3:" in str(err.value) and "data.local.pretrain" in str(err.value)


def test_missing_columns_name_the_column_and_the_shapes(tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", documents(10))
    body = write_jsonl(tmp_path / "body.jsonl", [{"body": "x"}])
    with pytest.raises(UserError, match=r"no column `text` \(found: body\)"):
        prepare.run(local(tmp_path, pretrain=str(body)))
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "q", "answer": "a"}])
    with pytest.raises(UserError) as err:
        prepare.run(local(tmp_path, pretrain=str(docs), sft=str(sft)))
    assert "`completion`" in str(err.value) and "`messages`" in str(err.value) and "data.local.sft" in str(err.value)
    pref = write_jsonl(tmp_path / "pref.jsonl", [{"prompt": "q", "chosen": "a"}])
    with pytest.raises(UserError, match=r"no column `rejected`.*`prompt`, `chosen` and `rejected`"):
        prepare.run(local(tmp_path, pretrain=str(docs), preference=str(pref)))
    unanswered = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "q"}]}] * 3)
    with pytest.raises(UserError, match=r"bad\.jsonl row 1: empty response .*as in all 3 records"):
        prepare.run(local(tmp_path, pretrain=str(docs), sft=str(unanswered)))
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"prompt": "q", "completion": "a"}])
    write_jsonl(tmp_path / "mixed" / "b.jsonl", chats(1))
    with pytest.raises(UserError, match=r"data\.local\.sft: datasets could not read .*mixed: CastError.*same columns"):
        prepare.run(local(tmp_path, pretrain=str(docs), sft=str(tmp_path / "mixed")))
    data = {"source": "hf", "hf": {"dataset_name": str(docs), "text_column": "story"}}
    with pytest.raises(UserError, match=r"data\.hf\.text_column: .* no column `story` \(found: text\)"):
        prepare.run(make_params(tmp_path, data))


def test_too_few_documents_and_bad_params(tmp_path):
    one = write_jsonl(tmp_path / "one.jsonl", documents(2))
    with pytest.raises(UserError, match="too few distinct documents"):
        prepare.run(local(tmp_path, pretrain=str(one)))
    with pytest.raises(ParamsError, match="dataset_name nor data.hf.preset"):
        make_params(tmp_path, {"source": "hf"})
    with pytest.raises(ParamsError, match="min_body_lines"):
        make_params(tmp_path, {"stdlib": {"min_body_lines": 5, "max_body_lines": 3}})


def test_input_inside_an_output_folder_is_refused(tmp_path):
    inside = write_jsonl(tmp_path / "data" / "pretrain" / "mine.jsonl", documents(10))
    with pytest.raises(UserError, match="which prepare rewrites"):
        prepare.run(local(tmp_path, pretrain=str(inside)))
    assert inside.exists()


# --- atomicity -----------------------------------------------------------------------------------------------


def test_failure_while_writing_leaves_previous_outputs_intact(tmp_path, monkeypatch):
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", documents(30))
    pref = write_jsonl(tmp_path / "in" / "pref.jsonl", preference_data(10))
    prepare.run(local(tmp_path, pretrain=str(docs), preference=str(pref)))
    before = snapshot(tmp_path)
    real_write = prepare.write_jsonl
    calls = []

    def write_then_fail(path, rows):  # the disk fills up after the pretraining files were written
        calls.append(path)
        if len(calls) > 4:
            raise OSError("No space left on device")
        return real_write(path, rows)

    monkeypatch.setattr(prepare, "write_jsonl", write_then_fail)
    other = make_params(tmp_path, {"source": "local", "seed": 99, "local": {"pretrain": str(docs)}})
    with pytest.raises(OSError, match="No space left"):
        prepare.run(other)
    assert len(calls) == 5
    assert snapshot(tmp_path) == before  # same files, same bytes, no temporary leftovers


def test_leftovers_of_a_killed_run_are_removed(tmp_path):
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", documents(30))
    leftovers = [tmp_path / "data" / ".pretrain.tmp-abc123", tmp_path / "data" / ".vlm.tmp-def456"]
    for leftover in leftovers:
        leftover.mkdir(parents=True)
        (leftover / "train.jsonl").write_text("half a line")
    prepare.run(local(tmp_path, pretrain=str(docs)))
    assert not any(leftover.exists() for leftover in leftovers)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["eval", "preference", "pretrain", "sft", "tasks", "vlm"]


def test_validation_source_replaces_the_hash_split_and_sources_are_counted(tmp_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", documents(40))
    held = tmp_path / "held"
    write_jsonl(held / "validation.jsonl", [{"body": f"A validation document number {i}. " * 3} for i in range(5)]
                + [{"body": "   "}])
    data = {"source": "hf", "max_chars_per_document": 60, "hf": {"dataset_name": str(docs)},
            "validation_source": {"dataset_name": str(held), "split": "validation", "text_column": "body"}}
    metrics = prepare.run(make_params(tmp_path, data))
    validation = load(tmp_path, "pretrain", "validation")
    assert [d["text"] for d in validation] == [(f"A validation document number {i}. " * 3)[:60] for i in range(5)]
    assert metrics["num_documents_train"] + metrics["num_documents_test"] == 40, "no hub document is lost"
    sources = metrics["sources"]
    assert sources["held:validation"] == {"documents": 5, "chars": 300, "truncated": 5}
    assert sources["docs.jsonl:train"]["documents"] == 40
