"""Bad input anywhere — params, data files, model folders — fails before any output is touched.

One table: each row sets up one mistake in a copy of a small, complete workspace (params.yaml, raw data, the
prepared data, a trained tokenizer, tiny safetensors models and earlier metrics), runs ``llm-train`` in-process
as DVC would (output root ``.``), and asserts that

- the exit code is non-zero (2) and there is one ``llm-train: error:`` message, on one line (a params error
  may list several keys on the lines after it),
- the message names the location (params key path, file and line or row, model file) and the fix,
- every file and folder of the workspace is byte-for-byte as before: no half-written output, no temp file.

The safe-loading rules on their own are in ``test_safe_loading.py``; the workspace, the row set-up helpers and
:class:`Bad` are in ``bad_input_helpers.py``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import bad_input_helpers
import pytest
import yaml
from bad_input_helpers import (
    BASE,
    Bad,
    auto_map,
    chain,
    copy,
    documents,
    empty_parquet,
    jsonl,
    local,
    pairs,
    patch_json,
    pickled_weights,
    remove,
    run_cli,
    snapshot,
    write,
)
from conftest import ROOT

from llmpipe.config import DedupParams
from llmpipe.data.dedup import Deduplicator
from llmpipe.orchestration.scratch import deep_merge

# The shared fixtures, as names of this module so that pytest finds them.
template = bad_input_helpers.template
_restore_logging = bad_input_helpers._restore_logging


CASES: dict[str, Bad] = {
    # --- params.yaml and the command line ---
    "params: unknown key, with the key meant": Bad(
        "sft", ("params.yaml", "sft.lrr: unknown key; did you mean 'lr'?"), {"sft": {"lrr": 1e-4}}, multiline=True),
    "params: wrong type": Bad("sft", ("params.yaml", "train.lr: Input should be a valid number", "'fast'"),
                              {"train": {"lr": "fast"}}, multiline=True),
    "params: out of range": Bad("dpo", ("dpo.beta: Input should be greater than 0", "(got -1)"),
                                {"dpo": {"beta": -1}}, multiline=True),
    "params: not one of the choices": Bad("sft", ("train.precision", "'bf16'", "'fp8'"),
                                          {"train": {"precision": "fp8"}}, multiline=True),
    "params: YAML syntax error": Bad(
        "prepare", ("params.yaml: line 4, column 4: YAML syntax error", "flow sequence at line 3, column 9"),
        params_text="train:\n  lr: 0.001\n  seed: [1, 2\nsft: {}\n"),
    "params: top level not a mapping": Bad("prepare", ("params.yaml: the top level must be a mapping",),
                                           params_text="- train\n- sft\n"),
    "params: section not a mapping": Bad("sft", ("sft: Input should be a valid dictionary", "(got 3)"),
                                         params_text="sft: 3\n", multiline=True),
    "params: warmup_steps > max_steps": Bad(
        "sft", ("sft.warmup_steps (10) exceeds sft.max_steps (5)", "lower sft.warmup_steps or raise sft.max_steps"),
        {"sft": {"max_steps": 5, "warmup_steps": 10}}, multiline=True),
    "params: inherited warmup_steps > a stage's max_steps": Bad(
        "prepare", ("pretrain.warmup_steps (8) exceeds pretrain.max_steps (5)",),
        {"train": {"warmup_steps": 8}, "pretrain": {"max_steps": 5}}, multiline=True),
    "params: KV heads do not divide heads": Bad(
        "pretrain", ("model.num_key_value_heads (3) must divide model.num_attention_heads (2)",),
        {"model": {"num_key_value_heads": 3}}, multiline=True),
    "params: heads do not divide hidden size": Bad(
        "pretrain", ("model.num_attention_heads (4) must divide model.hidden_size (18)",),
        {"model": {"hidden_size": 18, "num_attention_heads": 4}}, multiline=True),
    "params: grpo group does not fit a generation round": Bad(
        "grpo", ("grpo.per_device_train_batch_size (6)", "grpo.num_generations (4)"),
        {"grpo": {"per_device_train_batch_size": 6}}, multiline=True),
    "params: ppo without any reward": Bad(
        "ppo", ("ppo has no reward: set ppo.reward_model to true or list ppo.rewards",),
        {"ppo": {"reward_model": False, "rewards": []}}, multiline=True),
    "params: ppo completion longer than max_length": Bad(
        "ppo", ("ppo.generation.max_new_tokens (200)", "ppo.max_length (128)"),
        {"ppo": {"generation": {"max_new_tokens": 200}}}, multiline=True),
    "params: unknown reward name": Bad(
        "grpo", ("grpo.rewards.0.name", "parsable_prefix", "'is_good'", "'module.path:function'"),
        {"grpo": {"rewards": [{"name": "is_good", "weight": 1.0}]}}, multiline=True),
    "params: dpo loss weights do not match loss types": Bad(
        "dpo", ("dpo.loss_weights has 1 entries but dpo.loss_type has 2",),
        {"dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}}, multiline=True),
    "params: decontamination with nothing to match": Bad(
        "prepare", ("data.dedup.decontaminate is true but data.dedup.exact and data.dedup.near are both false",),
        {"data": {"dedup": {"exact": False, "near": False}}}, multiline=True),
    "params: local source without a pretraining path": Bad(
        "prepare", ("data.local.pretrain is not set",), local(pretrain=None), multiline=True),
    "params: a key given twice": Bad(
        "sft", ("params.yaml: line 3, column 3", "key 'lr' appears twice (first at line 2)"),
        params_text="sft:\n  lr: 0.001\n  lr: 3.0\n"),
    "params: a section given twice": Bad(
        "sft", ("params.yaml: line 3, column 1", "key 'sft' appears twice (first at line 1)"),
        params_text="sft:\n  lr: 0.001\nsft:\n  max_steps: 3\n"),
    "params: not UTF-8": Bad("prepare", ("params.yaml:2: not UTF-8 (byte 0xe9 at column 17)",),
                             setup=write("params.yaml", b"train:\n  seed: 1  # caf\xe9\n")),
    "params: --config-path names a folder": Bad(
        "prepare", ("in: a folder, not a params file",), argv=("--config-path", "in")),
    "params: no such params file": Bad(
        "prepare", ("nowhere.yaml: no such params file", "--config-path"), argv=("--config-path", "nowhere.yaml")),
    "cli: --lr not a number": Bad("sft", ("argument --lr: invalid float value: 'abc'",), argv=("--lr", "abc")),
    "cli: --lr out of range": Bad("sft", ("sft.lr: Input should be greater than 0", "came from the command line"),
                                  argv=("--lr", "-1"), multiline=True),
    "cli: unknown task": Bad("sftt", ("unknown task 'sftt'", "registered tasks: prepare"),),
    "cli: evaluate a model not in eval.models": Bad(
        "evaluate", ("--model nope: not in eval.models", "add it to eval.models"), argv=("--model", "nope")),
    "cli: --trust-remote-code where nothing is loaded": Bad(
        "prepare", ("--trust-remote-code: --task prepare loads no model", "drop the flag"),
        argv=("--trust-remote-code",)),
    # --- data files (prepare) ---
    "data: missing path": Bad("prepare", ("data.local.pretrain: in/nowhere.jsonl does not exist",),
                              local(pretrain="in/nowhere.jsonl")),
    "data: empty folder": Bad("prepare", ("data.local.pretrain: folder in/empty has no data files",),
                              local(pretrain="in/empty"), setup=lambda root: (root / "in" / "empty").mkdir()),
    "data: empty file": Bad("prepare", ("data.local.sft: in/empty.jsonl is empty",), local(sft="in/empty.jsonl"),
                            setup=write("in/empty.jsonl", "")),
    "data: broken jsonl line": Bad(
        "prepare", ("data.local.pretrain: in/bad.jsonl:3: not valid JSON", "fix or remove that line"),
        local(pretrain="in/bad.jsonl"), setup=write("in/bad.jsonl", jsonl(documents(2)) + '{"text": "x"\n')),
    "data: jsonl line not an object": Bad(
        "prepare", ("data.local.preference: in/bad.jsonl:2: expected a JSON object, got list",),
        local(preference="in/bad.jsonl"), setup=write("in/bad.jsonl", jsonl(pairs(1)) + "[1, 2]\n")),
    "data: non-UTF-8 bytes in jsonl": Bad(
        "prepare", ("data.local.pretrain: in/latin1.jsonl:2: not UTF-8", "save the file as UTF-8"),
        local(pretrain="in/latin1.jsonl"),
        setup=write("in/latin1.jsonl", jsonl(documents(1)).encode() + '{"text": "café"}\n'.encode("latin-1"))),
    "data: non-UTF-8 bytes in a text file": Bad(
        "prepare", ("data.local.pretrain: in/texts/b.txt:3: not UTF-8",), local(pretrain="in/texts"),
        setup=chain(write("in/texts/a.txt", "fine\n"), write("in/texts/b.txt", b"one\ntwo\nthr\xe9e\n"))),
    "data: empty document in jsonl": Bad(
        "prepare", ("data.local.pretrain: in/docs2.jsonl row 3: `text` is empty", "remove the row"),
        local(pretrain="in/docs2.jsonl"),
        setup=write("in/docs2.jsonl", jsonl(documents(2) + [{"text": "  \n "}] + documents(5)))),
    "data: blank text file": Bad(
        "prepare", ("data.local.pretrain: in/texts/blank.txt row 1: `text` is empty",), local(pretrain="in/texts"),
        setup=chain(*(write(f"in/texts/{i}.txt", f"story {i}\n") for i in range(4)),
                    write("in/texts/blank.txt", "\n  \n"))),
    "data: text of the wrong type": Bad(
        "prepare", ("data.local.pretrain: in/ints.jsonl row 2: `text` must be a string, got int",),
        local(pretrain="in/ints.jsonl"), setup=write("in/ints.jsonl", jsonl([{"text": "a"}, {"text": 5}]))),
    "data: no text column": Bad(
        "prepare", ("data.local.pretrain: in/body.jsonl has no column `text` (found: body)",),
        local(pretrain="in/body.jsonl"), setup=write("in/body.jsonl", jsonl([{"body": "x"}]))),
    "data: no sft record with an assistant turn": Bad(
        "prepare", ("data.local.sft: in/sft2.jsonl row 1: empty response", "as in all 2 records", "roles found: user"),
        local(sft="in/sft2.jsonl"),
        setup=write("in/sft2.jsonl", jsonl([{"messages": [{"role": "user", "content": "q"}]}] * 2))),
    "data: sft assistant turn with no content": Bad(
        "prepare", ("data.local.sft: in/sft2.jsonl row 1: empty response",), local(sft="in/sft2.jsonl"),
        setup=write("in/sft2.jsonl", jsonl([{"messages": [{"role": "user", "content": "q"},
                                                           {"role": "assistant", "content": " "}]}]))),
    "data: sft messages as a string": Bad(
        "prepare", ("in/sft2.jsonl row 1: `messages` must be a list",), local(sft="in/sft2.jsonl"),
        setup=write("in/sft2.jsonl", jsonl([{"messages": "hello"}]))),
    "data: sft message content of the wrong type": Bad(
        "prepare", ("in/sft2.jsonl row 1: `messages` must be",), local(sft="in/sft2.jsonl"),
        setup=write("in/sft2.jsonl", jsonl([{"messages": [{"role": "user", "content": 5}]}]))),
    "data: sft prompt without completion": Bad(
        "prepare", ("data.local.sft: in/sft2.jsonl has no column `completion`", "`messages`"),
        local(sft="in/sft2.jsonl"), setup=write("in/sft2.jsonl", jsonl([{"prompt": "q", "answer": "a"}]))),
    "data: preference data without rejected": Bad(
        "prepare", ("data.local.preference: in/pref2.jsonl has no column `rejected`",),
        local(preference="in/pref2.jsonl"), setup=write("in/pref2.jsonl", jsonl([{"prompt": "p", "chosen": "c"}]))),
    "data: a pair without rejected": Bad(
        "prepare", ("data.local.preference: in/pref2.jsonl row 2: `rejected` is missing",),
        local(preference="in/pref2.jsonl"),
        setup=write("in/pref2.jsonl", jsonl(pairs(1) + [{"prompt": "p", "chosen": "c"}]))),
    "data: a pair with an empty chosen": Bad(
        "prepare", ("data.local.preference: in/pref2.jsonl row 1: empty response",), local(preference="in/pref2.jsonl"),
        setup=write("in/pref2.jsonl", jsonl([{"prompt": "p", "chosen": "", "rejected": "r"}]))),
    "data: empty parquet": Bad("prepare", ("data.local.pretrain: in/none.parquet has no records",),
                               local(pretrain="in/none.parquet"), setup=empty_parquet("in/none.parquet")),
    "data: not a parquet file": Bad("prepare", ("in/junk.parquet is not a readable parquet file",),
                                    local(pretrain="in/junk.parquet"), setup=write("in/junk.parquet", "junk")),
    "data: unsupported suffix": Bad("prepare", ("in/docs.xml has an unsupported suffix", ".jsonl", ".csv"),
                                    local(pretrain="in/docs.xml"), setup=write("in/docs.xml", "<text>x</text>\n")),
    "data: mixed formats in one folder": Bad(
        "prepare", ("data.local.pretrain: in/mixed mixes formats (json, text)",), local(pretrain="in/mixed"),
        setup=chain(write("in/mixed/a.jsonl", jsonl(documents(3))), write("in/mixed/b.txt", "x\n"))),
    "data: too few documents to split": Bad(
        "prepare", ("data.local.pretrain: in/two.jsonl", "too few distinct documents"),
        local(pretrain="in/two.jsonl"), setup=write("in/two.jsonl", jsonl(documents(2)))),
    "data: input inside an output folder": Bad(
        "prepare", ("data.local.pretrain: data/pretrain/train.jsonl is inside data/pretrain", "move it elsewhere"),
        local(pretrain="data/pretrain/train.jsonl")),
    "data: hub dataset without the text field": Bad(
        "prepare", ("data.hf.text_column", "no column `story` (found: text)"),
        {"data": {"source": "hf", "hf": {"dataset_name": "in/docs.jsonl", "text_column": "story"}}}),
    "data: dedup index made with other dedup params": Bad(
        "prepare", ("in/seen.bin: made with data.dedup.num_perm=64, but data.dedup.num_perm is 128",
                    "use another data.dedup.seen_hashes_path"),
        {"data": {"dedup": {"seen_hashes_path": "in/seen.bin", "capacity": 1000}}},
        setup=lambda root: Deduplicator(DedupParams(num_perm=64, capacity=1000)).save(root / "in" / "seen.bin")),
    "data: dedup index that is not one": Bad(
        "prepare", ("in/seen.bin: not a dedup index",), {"data": {"dedup": {"seen_hashes_path": "in/seen.bin"}}},
        setup=write("in/seen.bin", "hashes, I promise\n")),
    "data: prepared split missing for a training stage": Bad(
        "sft", ("data/sft/train.jsonl: missing", "dvc repro prepare"), setup=remove("data/sft")),
    # --- model and tokenizer folders ---
    "model: missing base model names the stage to run": Bad(
        "sft", ("models/pretrain: no model there", "dvc repro pretrain"), setup=remove("models/pretrain")),
    "model: dpo's missing base model": Bad("dpo", ("models/sft: no model there", "dvc repro sft"),
                                           setup=remove("models/sft")),
    "model: reward's missing base model": Bad("reward", ("models/sft: no model there", "dvc repro sft"),
                                              setup=remove("models/sft")),
    "model: ppo's missing reward model": Bad("ppo", ("models/reward: no model there", "dvc repro reward"),
                                             setup=remove("models/reward")),
    "model: weights only as pytorch_model.bin": Bad(
        "sft", ("models/pretrain/pytorch_model.bin", "pickle", "safetensors", "--trust-remote-code"),
        setup=pickled_weights("pretrain")),
    "model: weights only as .pt": Bad("dpo", ("models/sft/model.pt", "--trust-remote-code"),
                                      setup=pickled_weights("sft", "model.pt")),
    "model: weights only as .pkl": Bad("grpo", ("models/sft/weights.pkl", "--trust-remote-code"),
                                       setup=pickled_weights("sft", "weights.pkl")),
    "model: ppo's reward model as .bin": Bad("ppo", ("models/reward/pytorch_model.bin", "--trust-remote-code"),
                                             setup=pickled_weights("reward")),
    "model: evaluate a .bin model": Bad("evaluate", ("models/sft/pytorch_model.bin", "--trust-remote-code"),
                                        argv=("--model", "sft"), setup=pickled_weights("sft")),
    "model: config.json maps to code (auto_map)": Bad(
        "sft", ("models/pretrain/config.json", "auto_map", "custom_code.py", "--trust-remote-code"),
        setup=auto_map("models/pretrain/config.json", "AutoModelForCausalLM")),
    "model: evaluate a model with auto_map": Bad(
        "evaluate", ("models/sft/config.json", "auto_map", "--trust-remote-code"), argv=("--model", "sft"),
        setup=auto_map("models/sft/config.json", "AutoModelForCausalLM")),
    "model: corrupt config.json": Bad("sft", ("models/pretrain/config.json: line 1", "not valid JSON"),
                                      setup=write("models/pretrain/config.json", '{"model_type": "llama",')),
    "model: config.json without a model type": Bad(
        "sft", ("models/pretrain: cannot load the model",), setup=write("models/pretrain/config.json", "{}")),
    "model: truncated safetensors": Bad(
        "sft", ("models/pretrain/model.safetensors: damaged weights", "dvc repro pretrain"),
        setup=lambda root: (root / "models/pretrain/model.safetensors").write_bytes(
            (root / "models/pretrain/model.safetensors").read_bytes()[:-100])),
    "model: config but no weights": Bad("dpo", ("models/sft: no weights", "model.safetensors"),
                                        setup=lambda root: (root / "models/sft/model.safetensors").unlink()),
    "tokenizer: missing": Bad("sft", ("artifacts/tokenizer: no tokenizer there", "dvc repro tokenizer"),
                              setup=remove("artifacts/tokenizer")),
    "tokenizer: auto_map in tokenizer_config.json": Bad(
        "pretrain", ("artifacts/tokenizer/tokenizer_config.json", "auto_map", "--trust-remote-code"),
        setup=auto_map("artifacts/tokenizer/tokenizer_config.json", "AutoTokenizer")),
    "tokenizer: corrupt tokenizer_config.json": Bad(
        "baseline", ("artifacts/tokenizer/tokenizer_config.json: line 2", "not valid JSON"),
        setup=write("artifacts/tokenizer/tokenizer_config.json", '{\n  "x": }\n')),
    "tokenizer: changed after the token files were made": Bad(
        "pretrain", ("data/tokens/train was tokenized with another tokenizer than artifacts/tokenizer",
                     "dvc repro tokenize"),
        setup=patch_json("artifacts/tokenizer/tokenizer_config.json", model_max_length=64)),
    "tokenizer: ppo's ptx tokens made with another one": Bad(
        "ppo", ("data/tokens/train was tokenized with another tokenizer", "dvc repro tokenize"),
        {"ppo": {"ptx_coef": 0.5}}, setup=patch_json("data/tokens/train/meta.json", tokenizer_sha256="0" * 64)),
    "data: token files missing": Bad("pretrain", ("data/tokens/train: no token file there", "dvc repro tokenize"),
                                     setup=remove("data/tokens/train")),
    "data: truncated token file": Bad(
        "pretrain", ("data/tokens/validation/tokens.bin", "meta.json declares", "dvc repro tokenize"),
        setup=lambda root: (root / "data/tokens/validation/tokens.bin").write_bytes(
            (root / "data/tokens/validation/tokens.bin").read_bytes()[:-2])),
    "tokenizer: pretrained folder with auto_map": Bad(
        "tokenizer", ("in/tok/tokenizer_config.json", "auto_map", "--trust-remote-code"),
        {"tokenizer": {"kind": "pretrained", "name_or_path": "in/tok"}},
        setup=chain(copy("artifacts/tokenizer", "in/tok"), auto_map("in/tok/tokenizer_config.json", "AutoTokenizer"))),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_fails_with_the_location_and_leaves_outputs_untouched(case, template, tmp_path, monkeypatch, capsys):
    root = tmp_path / "workspace"
    shutil.copytree(template, root)
    if case.params_text is not None:
        (root / "params.yaml").write_text(case.params_text)
    else:
        (root / "params.yaml").write_text(yaml.safe_dump(deep_merge(BASE, case.params)))
    if case.setup:
        case.setup(root)
    monkeypatch.chdir(root)
    before = snapshot(root)

    code = run_cli(["--task", case.task, *case.argv])

    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert err.count("llm-train: error: ") == 1, err[-3000:]
    message = err[err.index("llm-train: error: "):].rstrip("\n")
    assert "Traceback" not in err
    if not case.multiline:
        assert "\n" not in message, message
    for part in case.expect:
        assert part in message, f"{part!r} not in:\n{message}"
    assert snapshot(root) == before, "the failed run changed the workspace"


def test_the_table_covers_params_data_and_models():
    kinds = [name.split(":")[0] for name in CASES]
    assert len(CASES) >= 30
    assert kinds.count("data") >= 10 and kinds.count("model") + kinds.count("tokenizer") >= 10
    assert kinds.count("params") + kinds.count("cli") >= 10


def test_a_pickled_model_is_refused_by_the_cli_as_dvc_runs_it(template, tmp_path, offline_env):
    """One row of the table as a real process: one stderr line, exit 2, nothing written."""
    root = tmp_path / "workspace"
    shutil.copytree(template, root)
    pickled_weights("pretrain")(root)
    before = snapshot(root)
    env = {**offline_env, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "llmpipe.cli", "--task", "sft"], check=False, cwd=root, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("llm-train: error: ")]
    assert errors == [proc.stderr.splitlines()[-1]] and "models/pretrain/pytorch_model.bin" in errors[0]
    assert "Traceback" not in proc.stderr
    assert snapshot(root) == before
