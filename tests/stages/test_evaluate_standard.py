"""lm-eval's own tasks in the evaluate stage, offline: a standard task (arc_easy, mmlu's stem group) run through
lm-eval's own task config from a small local copy in the dataset's real schema (``eval.task_data``), a task
without data refused before the model loads, and ``llm-train eval-tasks`` + lm-eval's own CLI reproducing the
stage's numbers exactly (slow).

The local copies are written here: a few rows of each split in the columns of allenai/ai2_arc and cais/mmlu, laid
out as their Hub repositories are (one folder per config, ``<split>-00000-of-00001.<ext>``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import save_file
from test_evaluate import SRC, make_params, stdlib_text, tiny_root  # noqa: F401  (fixture and helpers)

from llmpipe import cli
from llmpipe.config import ParamsError, parse_params
from llmpipe.core.errors import UserError
from llmpipe.core.io import write_jsonl
from llmpipe.evaluation.harness import flatten
from llmpipe.stages import evaluate
from llmpipe.stages.tokenizer import train_bpe

ARC_SPLITS = {"train": 3, "validation": 2, "test": 4}
TASK_OPTIONS = {"arc_easy": {"num_fewshot": 1}}  # a second option group: a second lm_eval command


def arc_rows(split: str, n: int) -> list[dict]:
    """`n` questions in allenai/ai2_arc's columns (id, question, choices {text, label}, answerKey)."""
    return [{"id": f"{split}-{i}", "question": f"Which number is {i} plus {i}?",
             "choices": {"text": [str(i + 1), str(2 * i), str(i), "zero"], "label": ["A", "B", "C", "D"]},
             "answerKey": "B"} for i in range(1, n + 1)]  # fmt: skip


def write_arc_copy(root: Path, splits: dict[str, int] = ARC_SPLITS, config: str = "ARC-Easy") -> Path:
    """A local copy of allenai/ai2_arc's `config`, in the Hub's layout; returns the dataset's folder."""
    for split, n in splits.items():
        write_jsonl(root / config / f"{split}-00000-of-00001.jsonl", arc_rows(split, n))
    return root


@pytest.fixture(scope="module")
def arc_copy(tmp_path_factory) -> Path:
    return write_arc_copy(tmp_path_factory.mktemp("ai2_arc"))


@pytest.fixture(scope="module")
def standard_params(tiny_root, arc_copy):  # noqa: F811 (the fixture imported above)
    """Params evaluating llmpipe_sft_chat, llmpipe_perplexity and arc_easy (1-shot, every document: limit null)."""
    return make_params(tiny_root, tasks=["llmpipe_sft_chat", "llmpipe_perplexity", "arc_easy"], limit=None,
                       task_data={"arc_easy": str(arc_copy)}, task_options=TASK_OPTIONS)  # fmt: skip


@pytest.fixture(scope="module")
def stage_metrics(standard_params) -> dict[str, float]:
    return evaluate.run(standard_params[1], model="tiny")


@pytest.fixture(scope="module")
def prepared(standard_params, tmp_path_factory):
    """The evaluate stage's tasks for those params, written into a folder (`evaluate.prepare`, as eval-tasks does);
    its `TaskManager` indexes lm-eval's built-in tasks too (indexing takes seconds: once for this module)."""
    work = tmp_path_factory.mktemp("prepared")
    return evaluate.prepare(standard_params[1], "tiny", work), work


def test_a_standard_task_runs_offline_from_a_local_copy(stage_metrics):
    # Every test document of the copy (4, not ARC-Easy's 2,376), 1-shot from its train split, lm-eval's metrics.
    assert stage_metrics["arc_easy.num_docs"] == ARC_SPLITS["test"]
    assert stage_metrics["arc_easy.num_fewshot"] == 1
    assert 0 <= stage_metrics["arc_easy.acc"] <= 1 and 0 <= stage_metrics["arc_easy.acc_norm"] <= 1
    assert stage_metrics["arc_easy.acc_stderr"] > 0
    assert stage_metrics["llmpipe_sft_chat.num_docs"] == 4 and stage_metrics["llmpipe_sft_chat.bits_per_byte"] > 0
    assert "arc_easy.num_too_long" not in stage_metrics  # llmpipe's count; lm-eval's cuts are num_truncated_requests
    assert stage_metrics["num_truncated_requests"] == 0


def test_the_redirected_task_is_lm_evals_own_config_reading_the_copy(prepared, arc_copy):
    prep, work = prepared
    assert prep.names == ["llmpipe_sft_chat", "llmpipe_perplexity", "arc_easy"]
    override = yaml.safe_load((work / "arc_easy.yaml").read_text())
    assert Path(override["include"]).parts[-3:] == ("tasks", "arc", "arc_easy.yaml")
    assert override["dataset_path"] == "json" and override["tag"] == []
    assert override["dataset_kwargs"]["data_files"] == {
        split: [str(arc_copy / "ARC-Easy" / f"{split}-00000-of-00001.jsonl")] for split in ARC_SPLITS}
    task = prep.manager.load(["arc_easy"])["tasks"]["arc_easy"]
    builtin = yaml.safe_load(Path(override["include"]).read_text())
    assert task.config.doc_to_text == builtin["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert task.doc_to_text(task.eval_docs[0]) == "Question: Which number is 1 plus 1?\nAnswer:"
    assert task.doc_to_choice(task.eval_docs[0]) == ["2", "2", "1", "zero"] and task.doc_to_target(task.eval_docs[0]) == 1
    # lm-eval's tag ai2_arc still names both of its tasks (a tag in the override would have replaced it).
    assert prep.manager.task_index["ai2_arc"].tags == {"arc_easy", "arc_challenge"}


def test_a_group_takes_the_copies_of_its_subtasks_from_one_folder(prepared, tmp_path):
    """mmlu_stem (19 subjects) from a folder laid out as cais/mmlu is: one subfolder per subject."""
    from lm_eval.tasks import TaskManager

    from llmpipe.evaluation.standard import leaf_tasks, write_redirects

    manager = prepared[0].manager
    subjects = {t: manager.task_index[t].cfg["dataset_name"] for t in leaf_tasks(manager, "mmlu_stem")}
    assert len(subjects) == 19
    row = {"question": "2 + 2 = ?", "subject": "x", "choices": ["1", "2", "3", "4"], "answer": 3}
    for subject in subjects.values():
        for split in ("dev", "test"):
            write_jsonl(tmp_path / "mmlu" / subject / f"{split}-00000-of-00001.jsonl", [row, row])
    work = tmp_path / "work"
    work.mkdir()
    assert write_redirects(manager, ["mmlu_stem"], {"mmlu_stem": str(tmp_path / "mmlu")}, work) == sorted(subjects)
    group = TaskManager(include_path=str(work)).load(["mmlu_stem"])
    assert set(group["tasks"]) == set(subjects)
    assert {len(t.eval_docs) for t in group["tasks"].values()} == {2}, "every subject read its copy"


@pytest.mark.parametrize(
    ("task_data", "message"),
    [
        ({"arc_challenge": "COPY"}, None),
        ({"arc_challenge": "TEST_ONLY"}, r"eval\.task_data\.arc_challenge: lm-eval's task arc_challenge reads "
                                         r"split\(s\) train, validation, test \(training_split, validation_split, "
                                         r"test_split\); the local copy has test: add train, validation"),
        ({"arc_challenge": "MISSING"}, r"eval\.task_data\.arc_challenge: .*nowhere is not a folder"),
        ({"hellaswag": "COPY"}, r"eval\.task_data\.hellaswag: not a standard task of eval\.tasks \(arc_challenge\)"),
        ({"arc_challenge": {"test": "MISSING/test.jsonl"}}, r"eval\.task_data\.arc_challenge: .*test\.jsonl does not "
                                                            r"exist"),
    ],
)
def test_a_local_copy_lacking_what_the_task_reads_is_an_error_naming_the_key(prepared, tmp_path, task_data, message):
    """On arc_challenge, which the module's `TaskManager` knows as lm-eval defines it (its arc_easy is redirected)."""
    from llmpipe.evaluation.standard import write_redirects

    manager = prepared[0].manager
    write_arc_copy(tmp_path / "copy", config="ARC-Challenge")
    write_arc_copy(tmp_path / "test_only", {"test": 2}, config="ARC-Challenge")
    places = {"COPY": str(tmp_path / "copy"), "TEST_ONLY": str(tmp_path / "test_only"),
              "MISSING": str(tmp_path / "nowhere")}  # fmt: skip
    task_data = {k: places.get(v, v) if isinstance(v, str) else {s: f.replace("MISSING", places["MISSING"])
                                                                  for s, f in v.items()} for k, v in task_data.items()}  # fmt: skip
    if message is None:
        assert write_redirects(manager, ["arc_challenge"], task_data, tmp_path) == ["arc_challenge"]
        assert yaml.safe_load((tmp_path / "arc_challenge.yaml").read_text())["dataset_kwargs"]["data_files"]["test"] == [
            str(tmp_path / "copy" / "ARC-Challenge" / "test-00000-of-00001.jsonl")]
        return
    with pytest.raises(UserError, match=message):
        write_redirects(manager, ["arc_challenge"], task_data, tmp_path)


def test_a_standard_task_without_data_offline_is_an_error_before_the_model_loads(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # as HF_DATASETS_OFFLINE=1 would
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty_cache")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    # No weights in the model folder: had the model been loaded first, the error would be another.
    (model / "config.json").write_text("{}")
    save_file({}, model / "model.safetensors")
    train_bpe(iter(stdlib_text("string")), vocab_size=300, min_frequency=2, model_max_length=64).save_pretrained(model)
    _, params = make_params(tmp_path, tasks=["hellaswag"])
    with pytest.raises(UserError) as err:
        evaluate.run(params, model="tiny")
    text = str(err.value)
    assert text.startswith("eval.tasks: hellaswag: lm-eval's task hellaswag reads dataset Rowan/hellaswag, which "
                           "cannot be loaded")
    assert "eval.task_data (hellaswag: a folder with a file per split train, validation" in text
    assert "Hugging Face cache (online, once: python -c \"import datasets; datasets.load_dataset('Rowan/hellaswag')\")" in text


@pytest.mark.parametrize(
    ("task_data", "message"),
    [
        ({"llmpipe_sft_chat": "data"}, r"eval\.task_data\.llmpipe_sft_chat: llmpipe tasks read paths\.data/eval"),
        ({"arc_easy": {}}, r"eval\.task_data\.arc_easy: empty"),
    ],
)
def test_bad_task_data_is_a_params_error(task_data, message):
    with pytest.raises(ParamsError, match=message):
        parse_params({"eval": {"tasks": ["arc_easy"], "task_data": task_data}})


@pytest.mark.slow
def test_lm_evals_cli_on_the_written_tasks_reproduces_the_stages_numbers(standard_params, stage_metrics, tiny_root,  # noqa: F811
                                                                          tmp_path, offline_env):
    """`llm-train eval-tasks --out DIR`, then the `lm_eval` commands it prints, each run as lm-eval's own CLI in a
    new process: every metric lm-eval reports equals the stage's, exactly."""
    raw, _ = standard_params
    config = tmp_path / "params.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "tasks"
    assert cli.main(["eval-tasks", "--out", str(out), "--model", "tiny", "--config-path", str(config)]) == 0
    commands = [shlex.split(line) for line in (out / "lm_eval.sh").read_text().splitlines()
                if line.startswith("lm_eval ")]  # fmt: skip
    assert len(commands) == 2, "one command per set of task options"
    model_args = commands[0][commands[0].index("--model_args") + 1]
    assert model_args.startswith(f"pretrained={tiny_root / 'models' / 'tiny'},max_length=128,dtype=float32,")
    env = {**offline_env, "PYTHONPATH": str(SRC)}  # the llmpipe tasks' hooks import from this checkout
    cli_metrics: dict[str, float] = {}
    for i, command in enumerate(commands):
        run = [sys.executable, "-m", "lm_eval", *command[1:], "--output_path", str(tmp_path / f"out{i}")]
        proc = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (result_file,) = (tmp_path / f"out{i}").rglob("results_*.json")
        cli_metrics |= flatten(json.loads(result_file.read_text()))
    llmpipe_only = {k for k in stage_metrics if k.endswith(".num_too_long")} | {"num_truncated_requests"}
    assert set(cli_metrics) == set(stage_metrics) - llmpipe_only
    assert cli_metrics == {k: stage_metrics[k] for k in cli_metrics}  # exact, not approximate
    assert {"arc_easy.acc", "arc_easy.acc_norm", "llmpipe_sft_chat.bits_per_byte"} <= set(cli_metrics)
