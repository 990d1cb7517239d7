"""Users' SFT and preference data in the standard shapes (messages, prompt-completion, Alpaca, ShareGPT, explicit
and implicit-prompt preference), from every file format and a hub-like local dataset folder, normalised to the one
shape the stages read; empty responses left out and counted; the chat template's loss mask on a tool turn.

Every file is read through the real `datasets` loaders, offline; only the last test builds a (tiny) model, and
it does not train it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmpipe.config import HFPreferenceParams, HFSFTParams, ParamsError, parse_params
from llmpipe.core.errors import UserError
from llmpipe.core.io import read_jsonl
from llmpipe.data import formats
from llmpipe.data.hub import hub_records
from llmpipe.data.local import local_records
from llmpipe.stages import prepare


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


# --- writing one set of records in each file format ----------------------------------------------------------


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_json_array(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(records, indent=2))
    return path


def write_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_csv(path: Path, records: list[dict[str, Any]]) -> Path:
    pd.DataFrame(records).to_csv(path, index=False)
    return path


def write_hub_folder(path: Path, records: list[dict[str, Any]]) -> Path:
    """A folder laid out like a hub dataset: a card, and parquet shards per split under data/."""
    write_parquet(path / "data" / "train-00000-of-00001.parquet", records)
    write_parquet(path / "data" / "test-00000-of-00001.parquet", records[:1])  # another split: not read
    (path / "README.md").write_text("---\nlicense: mit\n---\nA dataset card.\n")
    return path


WRITERS = {"jsonl": (write_jsonl, "data.jsonl"), "json": (write_json_array, "data.json"),
           "json_lines": (write_jsonl, "lines.json"), "parquet": (write_parquet, "data.parquet"),
           "csv": (write_csv, "data.csv"), "hub": (write_hub_folder, "hub_dataset")}
"""Format → (writer, file or folder name). ``hub`` is read through `data.hf_<kind>`, the others through
`data.local.<kind>`."""


def read(kind: str, fmt: str, records: list[dict[str, Any]], root: Path, shape: str = "auto") -> formats.Normalised:
    """Write `records` as `fmt` under `root` and read them back as `kind` (``sft`` | ``preference``) records."""
    writer, name = WRITERS[fmt]
    root.mkdir(parents=True, exist_ok=True)
    path = writer(root / name, records)
    cache = str(root / "cache")
    if fmt == "hub":
        hub = HFSFTParams if kind == "sft" else HFPreferenceParams
        loaded, _ = hub_records(hub(dataset_name=str(path), format=shape), kind, cache)
    else:
        loaded, _ = local_records(str(path), kind, shape, cache)
    return (formats.sft_rows if kind == "sft" else formats.preference_rows)(loaded)


def content(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their provenance (`name`, `source`, `corruption`)."""
    return [{k: v for k, v in r.items() if k not in ("name", "source", "corruption")} for r in rows]


# --- one case per shape -------------------------------------------------------------------------------------


@dataclass
class Shape:
    kind: str
    records: list[dict[str, Any]]
    expected: list[dict[str, Any]]  # the rows kept, without provenance
    empty_row: int  # the one record with an empty response (1-based)
    formats: tuple[str, ...] = ("jsonl", "json", "json_lines", "parquet", "hub")


SHAPES = {
    "messages, with a tool turn": Shape(
        "sft",
        [{"messages": [system("be brief"), user("2+2?"), assistant("4")]},
         {"messages": [user("weather?"), assistant('get_weather("Oslo")'), tool("rain"), assistant("It rains.")]},
         {"messages": [user("anything?"), assistant(" \n")]},
         {"messages": [user("hi"), assistant("hello"), user("a last question, never answered")]}],
        [{"messages": [system("be brief"), user("2+2?"), assistant("4")]},
         {"messages": [user("weather?"), assistant('get_weather("Oslo")'), tool("rain"), assistant("It rains.")]},
         {"messages": [user("hi"), assistant("hello")]}],
        empty_row=3),
    "prompt-completion strings": Shape(
        "sft",
        [{"prompt": "2+2?", "completion": "4"}, {"prompt": "capital of France?", "completion": "  "},
         {"prompt": "NA", "completion": "null"}],  # words a csv reader could take for missing values
        [{"messages": [user("2+2?"), assistant("4")]}, {"messages": [user("NA"), assistant("null")]}],
        empty_row=2, formats=("jsonl", "json", "json_lines", "parquet", "csv", "hub")),
    "prompt-completion conversational": Shape(
        "sft",
        [{"prompt": [system("terse"), user("2+2?")], "completion": [assistant("4")]},
         {"prompt": [user("q")], "completion": [assistant("")]},
         {"prompt": [user("weather?")], "completion": [assistant("call"), tool("rain"), assistant("It rains.")]}],
        [{"messages": [system("terse"), user("2+2?"), assistant("4")]},
         {"messages": [user("weather?"), assistant("call"), tool("rain"), assistant("It rains.")]}],
        empty_row=2),
    "alpaca": Shape(
        "sft",
        [{"instruction": "Add the numbers.", "input": "1 and 2", "output": "3"},
         {"instruction": "Say hi.", "input": "", "output": "hi"},
         {"instruction": "Say nothing.", "input": "", "output": "\t"},
         {"instruction": "Twelve in digits.", "input": "", "output": "12"}],  # a number in a csv cell stays text
        [{"messages": [user("Add the numbers.\n1 and 2"), assistant("3")]},
         {"messages": [user("Say hi."), assistant("hi")]},
         {"messages": [user("Twelve in digits."), assistant("12")]}],
        empty_row=3, formats=("jsonl", "json", "json_lines", "parquet", "csv", "hub")),
    "alpaca with system and history": Shape(
        "sft",
        [{"instruction": "And times 3?", "input": "", "output": "6", "system": "You do arithmetic.",
          "history": [["What is 1+1?", "2"]]},
         {"instruction": "Hi", "input": "", "output": "", "system": "", "history": []},
         {"instruction": "Hello", "input": "there", "output": "hey", "system": "", "history": []}],
        [{"messages": [system("You do arithmetic."), user("What is 1+1?"), assistant("2"), user("And times 3?"),
                       assistant("6")]},
         {"messages": [user("Hello\nthere"), assistant("hey")]}],
        empty_row=2),
    "sharegpt, with a tool call": Shape(
        "sft",
        [{"conversations": [{"from": "human", "value": "weather in Oslo?"},
                            {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
                            {"from": "observation", "value": '{"sky": "rain"}'},
                            {"from": "gpt", "value": "It rains in Oslo."}], "system": "You can call tools."},
         {"conversations": [{"from": "human", "value": "hello"}], "system": ""},
         {"conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}], "system": ""}],
        [{"messages": [system("You can call tools."), user("weather in Oslo?"),
                       assistant('{"name": "weather", "arguments": {"city": "Oslo"}}'), tool('{"sky": "rain"}'),
                       assistant("It rains in Oslo.")]},
         {"messages": [user("2+2?"), assistant("4")]}],
        empty_row=2),
    "preference, explicit prompt, strings": Shape(
        "preference",
        [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}, {"prompt": "2+3?", "chosen": "5", "rejected": " "},
         {"prompt": "1+1?", "chosen": "2", "rejected": "11"}],
        [{"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
         {"prompt": [user("1+1?")], "chosen": [assistant("2")], "rejected": [assistant("11")]}],
        empty_row=2, formats=("jsonl", "json", "json_lines", "parquet", "csv", "hub")),
    "preference, explicit prompt, conversations that repeat it": Shape(
        "preference",  # as in HuggingFaceH4/ultrafeedback_binarized: a string prompt, whole conversations
        [{"prompt": "2+2?", "chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},
         {"prompt": "1+1?", "chosen": [assistant("2")], "rejected": [assistant("")]},
         {"prompt": "3+3?", "chosen": [assistant("6")], "rejected": [assistant("9")]}],
        [{"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
         {"prompt": [user("3+3?")], "chosen": [assistant("6")], "rejected": [assistant("9")]}],
        empty_row=2),
    "preference, implicit prompt": Shape(
        "preference",
        [{"chosen": [user("2+2?"), assistant("4")], "rejected": [user("2+2?"), assistant("5")]},
         {"chosen": [system("tools"), user("weather?"), assistant("call"), tool("rain"), assistant("It rains.")],
          "rejected": [system("tools"), user("weather?"), assistant("call"), tool("rain"), assistant("Sunny.")]},
         {"chosen": [user("1+1?"), assistant("2")], "rejected": [user("1+1?"), assistant("   ")]}],
        [{"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
         {"prompt": [system("tools"), user("weather?"), assistant("call"), tool("rain")],
          "chosen": [assistant("It rains.")], "rejected": [assistant("Sunny.")]}],
        empty_row=3),
}


@pytest.mark.parametrize("case", list(SHAPES.values()), ids=list(SHAPES))
def test_each_shape_reads_the_same_from_every_format(case, tmp_path, caplog):
    for fmt in case.formats:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llmpipe.data.formats"):
            out = read(case.kind, fmt, case.records, tmp_path / fmt)
        assert content(out.rows) == case.expected, fmt
        assert out.num_empty_responses == 1, fmt
        where = (f"data.hf_{case.kind}.dataset_name: {tmp_path / fmt / 'hub_dataset'} (split train)" if fmt == "hub"
                 else f"data.local.{case.kind}: {tmp_path / fmt / WRITERS[fmt][1]}")
        assert f"{where} row {case.empty_row}: empty response" in caplog.text, fmt
        source = "hub_dataset:train" if fmt == "hub" else WRITERS[fmt][1]
        assert {r["source"] for r in out.rows} == {source}
        assert out.rows[0]["name"] == f"{source}:1"


def test_prepare_writes_users_shapes_and_reports_empty_responses(tmp_path, caplog):
    """End to end: Alpaca in csv and implicit-prompt pairs from a hub-like folder → data/, metrics, a warning."""
    docs = write_jsonl(tmp_path / "in" / "docs.jsonl", [{"text": f"document {i}"} for i in range(12)])
    sft = write_csv(tmp_path / "in" / "alpaca.csv",
                    [{"instruction": f"say {i}", "input": "", "output": "" if i == 4 else f"{i}"} for i in range(10)])
    pairs = [{"chosen": [user(f"q{i}"), assistant(f"good {i}")], "rejected": [user(f"q{i}"), assistant(f"bad {i}")]}
             for i in range(10)]
    hub = write_hub_folder(tmp_path / "in" / "pairs", pairs)
    params = parse_params({
        "paths": {"data": str(tmp_path / "data"), "metrics": str(tmp_path / "metrics")},
        "data": {"source": "local", "local": {"pretrain": str(docs), "sft": str(sft), "sft_format": "alpaca"},
                 "hf_preference": {"dataset_name": str(hub), "format": "implicit_prompt"}},
    })
    with caplog.at_level(logging.WARNING, logger="llmpipe.data.formats"):
        metrics = prepare.run(params)
    assert f"data.local.sft: {sft} row 5: empty response" in caplog.text
    assert metrics["num_sft_empty_responses"] == 1 and metrics["num_preference_empty_responses"] == 0
    splits = ("train", "validation", "test")
    assert sum(metrics[f"num_sft_{s}"] for s in splits) == 9
    sft_rows = [r for s in splits for r in read_jsonl(tmp_path / "data" / "sft" / f"{s}.jsonl")]
    assert {r["name"] for r in sft_rows} == {f"alpaca.csv:{i + 1}" for i in range(10) if i != 4}
    pref_rows = [r for s in splits for r in read_jsonl(tmp_path / "data" / "preference" / f"{s}.jsonl")]
    assert sorted(r["prompt"][0]["content"] for r in pref_rows) == sorted(f"q{i}" for i in range(10))
    assert all(r["chosen"][0]["content"].startswith("good") for r in pref_rows)
    info = json.loads((tmp_path / "data" / "pretrain" / "manifest.json").read_text())
    assert "data.hf_preference.dataset_name" in info["description"] and metrics["num_files"] == 5


def test_the_format_param_picks_a_shape_the_columns_leave_open(tmp_path):
    both = [{"messages": [user("q"), assistant("from messages")],
             "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "from conversations"}]}] * 2
    with pytest.raises(UserError) as err:
        read("sft", "jsonl", both, tmp_path / "auto")
    message = str(err.value)
    assert message.startswith(f"data.local.sft: {tmp_path / 'auto' / 'data.jsonl'} fits several SFT shapes")
    assert "messages, sharegpt" in message and "data.local.sft_format" in message
    out = read("sft", "jsonl", both, tmp_path / "named", shape="sharegpt")
    assert out.rows[0]["messages"][-1] == assistant("from conversations")
    with pytest.raises(UserError, match=r"no column `instruction` and `output` \(found: messages, conversations\), "
                                        r"which data\.local\.sft_format: alpaca needs"):
        read("sft", "jsonl", both, tmp_path / "wrong", shape="alpaca")


def test_params_take_one_source_per_kind_and_only_known_shapes():
    with pytest.raises(ParamsError, match=r"data\.local\.sft and data\.hf_sft\.dataset_name are both set"):
        parse_params({"data": {"local": {"sft": "a.jsonl"}, "hf_sft": {"dataset_name": "org/chats"}}})
    with pytest.raises(ParamsError, match=r"data\.hf_preference\.format: Input should be 'auto', 'explicit_prompt'"):
        parse_params({"data": {"hf_preference": {"format": "sharegpt"}}})


# --- bad shapes and records name the file, the row and the columns ------------------------------------------


BAD = {
    "no shape in the columns": (
        "sft", "jsonl", [{"question": "q", "answer": "a"}],
        r"data\.local\.sft: .*data\.jsonl has no SFT shape \(found: question, answer\); SFT data needs the columns of "
        r"one shape: messages \(`messages`\); prompt_completion \(`prompt` and `completion`\); alpaca \(`instruction` "
        r"and `output`\); sharegpt \(`conversations`\)"),
    "the closest shape's missing column": (
        "preference", "parquet", [{"prompt": "p", "chosen": "c"}],
        r"data\.local\.preference: .*data\.parquet has no column `rejected` \(found: prompt, chosen\); .*"
        r"explicit_prompt \(`prompt`, `chosen` and `rejected`\); implicit_prompt"),
    "a hub folder without the columns": (
        "sft", "hub", [{"text": "t"}],
        r"data\.hf_sft\.dataset_name: .*hub_dataset \(split train\) has no SFT shape \(found: text\).*data\.hf_sft\."
        r"format"),
    "an unknown ShareGPT speaker": (
        "sft", "json", [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                        {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}],
        r"data\.json row 2: `conversations` turn 2 is from 'bot'; `from` must be one of human, user, gpt"),
    "a message without content": (
        "sft", "jsonl", [{"messages": [user("q"), {"role": "assistant", "content": None}]}],
        r"data\.jsonl row 1: `messages` must be a list of \{role, content\} messages with string role and content; "
        r"message 2 is"),
    "message lists in a csv cell": (
        "sft", "csv", [{"messages": json.dumps([user("q"), assistant("a")])}],
        r"data\.csv row 1: `messages` must be a list of \{role, content\} messages, not a string \(a CSV cell holds "
        r"text only"),
    "implicit-prompt pairs as strings": (
        "preference", "jsonl", [{"chosen": "Human: hi Assistant: hello", "rejected": "Human: hi Assistant: go"}],
        r"data\.jsonl row 1: `chosen` must be a list of \{role, content\} messages, not a string \(with string "
        r"answers, give the prompt in a `prompt` column"),
    "implicit-prompt pairs that share no turn": (
        "preference", "jsonl", [{"chosen": [user("a"), assistant("b")], "rejected": [user("c"), assistant("d")]}],
        r"data\.jsonl row 1: `chosen` and `rejected` do not start with the same turn, so there is no prompt"),
    "an empty prompt": (
        "sft", "csv", [{"prompt": "q", "completion": "a"}, {"prompt": " ", "completion": "a"}],
        r"data\.csv row 2: `prompt` is empty"),
    "alpaca history that is not pairs": (
        "sft", "jsonl", [{"instruction": "i", "output": "o", "history": [["q"]]}],
        r"data\.jsonl row 1: `history` must be a list of \[query, response\] string pairs"),
    "every response empty": (
        "sft", "parquet", [{"messages": [user("q"), {"role": "bot", "content": "a"}]}] * 2,
        r"data\.parquet row 1: empty response \(no assistant turn, or one with only whitespace\), as in all 2 "
        r"records of .*data\.parquet \(roles found: bot, user\); .*check the shape \(data\.local\.sft_format\)"),
}


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_shapes_name_the_file_row_and_columns(case, tmp_path):
    kind, fmt, records, message = case
    with pytest.raises(UserError, match=message):
        read(kind, fmt, records, tmp_path)


@pytest.mark.parametrize(("name", "text", "message"), [
    ("broken.json", '[\n  {"prompt": "q", "completion": "a"},\n  {"prompt": "q"\n]\n',
     r"data\.local\.sft: .*broken\.json:4:1: not valid JSON"),
    ("items.json", '[{"prompt": "q", "completion": "a"}, ["q", "a"]]',
     r"items\.json: item 2 of the JSON array is list, not a JSON object"),
    ("ragged.csv", "prompt,completion\nq,a\nq,a,extra\n", r"ragged\.csv is not a readable CSV file .*line 3"),
    ("header.csv", "prompt,completion\n", r"header\.csv has no records"),
    ("latin1.csv", "prompt,completion\nq,a\ncaf\xe9,a\n", r"latin1\.csv:3: not UTF-8"),
])
def test_unreadable_json_and_csv_files_name_the_line(name, text, message, tmp_path):
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(UserError, match=message):
        local_records(str(path), "sft", "auto", str(tmp_path / "cache"))


# --- the chat template on roles beyond system/user/assistant -------------------------------------------------


def test_tool_turns_are_rendered_and_left_out_of_the_loss(tmp_path):
    """With the pipeline's tokenizer and chat template and TRL's own SFT tokenisation, a `tool` turn is rendered
    with its role and gets label -100; every assistant turn (and its eos) is trained on."""
    from datasets import Dataset
    from trl import SFTTrainer

    from llmpipe.models import build_model
    from llmpipe.stages.sft import sft_config
    from llmpipe.stages.tokenizer import train_bpe

    conversation = [system("You may call tools."), user("Weather in Oslo?"), assistant('weather("Oslo")'),
                    tool("rain, 7 degrees"), assistant("It rains in Oslo.")]
    texts = [m["content"] for m in conversation] * 20
    tok = train_bpe(iter(texts), vocab_size=320, min_frequency=1, model_max_length=128)
    rendered = tok.apply_chat_template(conversation, tokenize=False)
    assert "<|tool|>rain, 7 degrees\n" in rendered and rendered.endswith("<|assistant|>It rains in Oslo.</s>\n")

    params = parse_params({"model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "intermediate_size": 32, "max_position_embeddings": 128},
                           "sft": {"max_length": 128, "assistant_only_loss": True}})
    data = Dataset.from_list([{"messages": conversation}])
    trainer = SFTTrainer(model=build_model(params.model, tok), args=sft_config(params, tmp_path / "run"),
                         train_dataset=data, eval_dataset=data, processing_class=tok)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert tok.decode(ids) == rendered
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert tok.decode(trained) == 'weather("Oslo")</s>It rains in Oslo.</s>'
    assert [label for label in labels if label != -100] == trained



def test_an_unpaired_file_is_kto_data_with_its_labels_read(tmp_path):
    """`prompt`/`completion`/`label` as data.local.preference (README: KTO reads it): labels true/false, 1/0 and
    their text are read as booleans from any format (a CSV cell is text), anything else is refused with its row."""
    records = [{"prompt": f"q{i}", "completion": f"a{i}", "label": label}
               for i, label in enumerate(["true", "False", "0", " 1 "])]
    for fmt in ("csv", "jsonl"):
        rows = read("preference", fmt, records, tmp_path / fmt).rows
        assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [
            ([user(f"q{i}")], [assistant(f"a{i}")], label) for i, label in enumerate([True, False, False, True])]
    numbers = [{"prompt": "q", "completion": [assistant("a")], "label": n} for n in (1, 0)]
    assert [r["label"] for r in read("preference", "parquet", numbers, tmp_path / "pq").rows] == [True, False]
    bad = [{"prompt": "q", "completion": "a", "label": "true"}, {"prompt": "q", "completion": "a", "label": "maybe"}]
    with pytest.raises(UserError, match=r"data\.jsonl row 2: `label` must be true \(desirable\) or false .*got \"maybe\""):
        read("preference", "jsonl", bad, tmp_path / "bad")
    assert parse_params({"data": {"source": "local", "local": {"pretrain": "d", "preference": "p",
                                                               "preference_format": "unpaired"}}})
