"""The `evaluate` stage: llmpipe's lm-eval tasks on a real tiny model (the report card: test_report_stage.py).

Everything is real and offline: a BPE trained here on a few stdlib modules, a randomly initialised 2-layer
Llama saved as a Hugging Face directory, evaluation sets in the shapes `prepare` writes, and lm-eval itself
(in process through the stage, and as the `lm_eval` command for the slow test).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from safetensors.torch import save_file

from llmpipe import cli
from llmpipe.config import EVAL_TASKS, ModelParams, parse_params
from llmpipe.config.identity import IDENTITY_KEY
from llmpipe.core.errors import UserError
from llmpipe.core.io import write_jsonl
from llmpipe.data.corrupt import CORRUPTIONS
from llmpipe.evaluation.harness import flatten
from llmpipe.evaluation.hooks import distinct_share, generation_score, preference_accuracy
from llmpipe.evaluation.options import check_fewshot
from llmpipe.evaluation.tasks import LOCAL_TASKS, render_tasks
from llmpipe.models import build_model, load_tokenizer, save_model
from llmpipe.report import tables
from llmpipe.stages import evaluate
from llmpipe.stages.tokenizer import train_bpe

SRC = Path(__file__).resolve().parents[1] / "src"
TINY_MODEL = ModelParams(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
EVAL = {"models": ["tiny"], "limit": 3, "batch_size": 4, "max_length": 128, "max_new_tokens": 16}
EXPECTED_KEYS = {
    "llmpipe_perplexity.bits_per_byte", "llmpipe_perplexity.byte_perplexity", "llmpipe_perplexity.word_perplexity",
    "llmpipe_signature_mc.acc", "llmpipe_signature_mc.acc_norm",
    "llmpipe_sft_chat.bits_per_byte", "llmpipe_sft_chat.acc",
    "llmpipe_sft_plain.bits_per_byte", "llmpipe_sft_plain.acc",
    "llmpipe_preference.acc", "llmpipe_preference.acc_norm",
    *(f"llmpipe_preference.{m}_{kind}" for m in ("acc", "acc_norm") for kind in ("swap", "truncate", "syntax")),
    "llmpipe_generation.score", "llmpipe_generation.parses", "llmpipe_generation.trivial",
    "llmpipe_generation.distinct",
    "llmpipe_tasks.pass_at_1", "llmpipe_tasks.tests_pass", "llmpipe_tasks.distinct",
}  # fmt: skip

TESTS = (["assert add(1, 2) == 3"], ["assert greet('a') is None"], ["assert is_even(2)", "assert not is_even(3)"],
         ["assert first([3]) == 3", "assert first([]) is None"])
"""Each of FUNCTIONS' hidden tests, for the executable-task set."""

FUNCTIONS = [
    ("def add(a, b):", "Return the sum of a and b.", "    total = a + b\n    return total"),
    ("def greet(name):", "Say hello to name.", "    message = 'hello ' + name\n    print(message)"),
    ("def is_even(n):", "True when n is even.", "    if n % 2:\n        return False\n    return True"),
    ("def first(items):", "The first item, or None.", "    for item in items:\n        return item\n    return None"),
]


def stdlib_text(*modules: str) -> list[str]:
    """Sources of a few stdlib modules (real code and English, like the default corpus)."""
    import importlib

    return [Path(importlib.import_module(m).__file__).read_text() for m in modules]


def write_eval_sets(eval_dir: Path, signature_mc: bool = True) -> None:
    """The five sets `prepare` writes under ``<paths.data>/eval/``, four rows each (signature_mc optional)."""
    docs = stdlib_text("textwrap", "string", "json.decoder", "shlex")
    write_jsonl(eval_dir / "perplexity.jsonl", [{"text": d[:1500]} for d in docs])
    sft, pref, mc = [], [], []
    for i, (sig, doc, body) in enumerate(FUNCTIONS):
        prompt = f'{sig}\n    """{doc}"""'
        other = FUNCTIONS[(i + 1) % len(FUNCTIONS)][2]
        sft.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": body}],
                    "name": sig[4:].split("(")[0], "source": "tiny.py"})
        pref.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": body}],
                     "rejected": [{"role": "assistant", "content": other}], "corruption": CORRUPTIONS[i % 3]})
        mc.append({"query": doc, "choices": [f[0] for f in FUNCTIONS], "label": i, "name": sig})
    write_jsonl(eval_dir / "sft.jsonl", sft)
    write_jsonl(eval_dir / "preference.jsonl", pref)
    write_jsonl(eval_dir / "signature_mc.jsonl", mc if signature_mc else [])
    write_jsonl(eval_dir / "tasks.jsonl", [{"prompt": f'{sig}\n    """{doc}"""', "entry_point": sig[4:].split("(")[0],
                                            "canonical_solution": body, "tests": tests, "source": "tiny"}
                                           for (sig, doc, body), tests in zip(FUNCTIONS, TESTS)])  # fmt: skip


def make_params(root: Path, **eval_overrides: Any):
    raw = {
        "paths": {name: str(root / name) for name in ("data", "models", "metrics", "reports", "logs")},
        "eval": {**EVAL, **eval_overrides},
    }
    return raw, parse_params(raw)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory) -> Path:
    """A root with ``models/tiny`` (tokenizer trained here, random 2-layer Llama) and ``data/eval``."""
    root = tmp_path_factory.mktemp("eval")
    tok = train_bpe(iter(stdlib_text("textwrap", "string", "argparse")), vocab_size=512, min_frequency=2,
                    model_max_length=256)
    save_model(build_model(TINY_MODEL, tok), tok, root / "models" / "tiny")
    write_eval_sets(root / "data" / "eval")
    return root


@pytest.fixture(scope="module")
def cli_metrics(tiny_root) -> dict[str, float]:
    """`llm-train --task evaluate --model tiny`, in process, stdout and stderr a pipe (kept as ``evaluate_stdout.txt``);
    returns what it wrote to metrics/eval/tiny.json."""
    raw, _ = make_params(tiny_root)
    config = tiny_root / "params.yaml"
    config.write_text(yaml.safe_dump(raw))
    import datasets
    from transformers.utils import logging as hf_logging

    out = io.StringIO()
    # transformers' and datasets' bars are off in a stage's own process (llmpipe.cli sets their switches before
    # the imports); here both are already imported, so they are switched off by hand.
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):  # lm-eval's own bars write to stderr
            assert cli.main(["--task", "evaluate", "--model", "tiny", "--config-path", str(config)]) == 0
    finally:
        hf_logging.enable_progress_bar()
        datasets.enable_progress_bars()
    (tiny_root / "evaluate_stdout.txt").write_text(out.getvalue())
    return json.loads((tiny_root / "metrics" / "eval" / "tiny.json").read_text())


# --- evaluate ----------------------------------------------------------------------------------------------


def test_evaluate_reports_every_metric_finite(cli_metrics, tiny_root):
    assert EXPECTED_KEYS <= set(cli_metrics)
    assert all(math.isfinite(v) for k, v in cli_metrics.items() if k != IDENTITY_KEY)
    for key in EXPECTED_KEYS:
        if key.endswith("bits_per_byte"):
            assert cli_metrics[key] > 0, key
        if key.endswith(("acc", "acc_norm")):
            assert 0 <= cli_metrics[key] <= 1, key
    # eval.limit caps every task (each set has 4 rows), and the CLI adds the wall time.
    assert {cli_metrics[f"{t}.num_docs"] for t in EVAL_TASKS} == {3}
    assert cli_metrics["wall_time_s"] > 0
    answers = [json.loads(line) for line in (tiny_root / "logs" / "evaluate" / "tiny" / "answers.jsonl").open()]
    generation = [a["prompt"] for a in answers if a["task"] == "llmpipe_generation"]
    assert generation == [f'{sig}\n    """{doc}"""' for sig, doc, _ in FUNCTIONS[:3]]
    assert answers[0]["task"] == "llmpipe_generation"  # first: the report shows the first prompts side by side
    assert {a["task"] for a in answers} == {"llmpipe_generation", "llmpipe_tasks"}
    # llmpipe tasks leave documents longer than the context out, so lm-eval has nothing to cut.
    assert cli_metrics["num_truncated_requests"] == 0
    # Byte perplexity and bits per byte are one number in two units.
    assert cli_metrics["llmpipe_perplexity.byte_perplexity"] == pytest.approx(
        2 ** cli_metrics["llmpipe_perplexity.bits_per_byte"], rel=1e-6)


def test_evaluate_off_a_terminal_shows_lm_evals_progress_as_plain_lines(cli_metrics, tiny_root):
    out = (tiny_root / "evaluate_stdout.txt").read_bytes().decode()  # bytes: read_text would make a \r a \n
    assert "\r" not in out and "\x1b[" not in out, "progress-bar control characters in a piped run"
    assert all(line.startswith("evaluate tiny") for line in out.splitlines() if "requests |" in line or "it |" in line)
    done = re.findall(r"^evaluate tiny: Running loglikelihood requests (\d+)/(\d+) requests \| .* \| ETA ", out,
                      re.MULTILINE)  # fmt: skip
    assert done and done[-1][0] == done[-1][1] != "0", out  # the last line of a loop is its final count


def test_rendered_tasks_use_absolute_paths_and_the_models_chat_format(tiny_root, tmp_path, monkeypatch):
    tok = load_tokenizer(tiny_root / "models" / "tiny")
    monkeypatch.chdir(tmp_path)  # relative inputs, to prove the YAMLs do not depend on the cwd
    counts = render_tasks(list(LOCAL_TASKS), os.path.relpath(tiny_root / "data" / "eval"), tok, "work", 4096, 16)
    assert counts == dict.fromkeys(LOCAL_TASKS, (4, 0))
    for name in LOCAL_TASKS:
        text = (tmp_path / "work" / f"{name}.yaml").read_text()
        config = yaml.load(text, Loader=_IgnoreTags)
        data_file = Path(config["dataset_kwargs"]["data_files"]["test"])
        assert data_file.is_absolute() and data_file.exists(), name
        assert Path(config["dataset_kwargs"]["cache_dir"]).is_absolute()
        assert config["task"] == name and config["target_delimiter"] == ""

    def rows(name):
        return [json.loads(line) for line in (tmp_path / "work" / f"{name}.jsonl").read_text().splitlines()]

    user = [{"role": "user", "content": f'{FUNCTIONS[0][0]}\n    """{FUNCTIONS[0][1]}"""'}]
    chat_prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    chat, plain, pref = rows("llmpipe_sft_chat")[0], rows("llmpipe_sft_plain")[0], rows("llmpipe_preference")[0]
    assert chat["context"] == chat_prompt and chat_prompt.startswith(tok.bos_token)
    assert chat["continuation"] == FUNCTIONS[0][2] + tok.eos_token
    assert plain == {"context": user[0]["content"] + "\n", "continuation": FUNCTIONS[0][2],
                     "num_bytes": len(FUNCTIONS[0][2].encode())}
    assert pref["context"] == chat_prompt and pref["label"] == 0
    assert pref["choices"] == [FUNCTIONS[0][2] + tok.eos_token, FUNCTIONS[1][2] + tok.eos_token]
    assert rows("llmpipe_signature_mc")[1]["context"] == f'"""{FUNCTIONS[1][1]}"""\n'


class _IgnoreTags(yaml.SafeLoader):
    """Reads a task YAML without importing its ``!function`` hooks."""


_IgnoreTags.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_empty_signature_mc_is_skipped_and_said(tmp_path):
    write_eval_sets(tmp_path / "data" / "eval", signature_mc=False)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    _, params = make_params(tmp_path, tasks=["llmpipe_signature_mc"])
    # No task left to run: lm-eval and the model are never loaded, so a config and an empty weights file suffice.
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    save_file({}, tmp_path / "models" / "tiny" / "model.safetensors")
    tok = train_bpe(iter(stdlib_text("string")), vocab_size=300, min_frequency=2, model_max_length=64)
    tok.save_pretrained(tmp_path / "models" / "tiny")
    assert evaluate.run(params, model="tiny") == {"llmpipe_signature_mc.num_docs": 0,
                                                  "llmpipe_signature_mc.num_too_long": 0}
    assert render_tasks(["llmpipe_signature_mc"], tmp_path / "data" / "eval", tok, tmp_path / "w", 64, 16) == {
        "llmpipe_signature_mc": (0, 0)}
    assert not list((tmp_path / "w").iterdir())


def test_documents_longer_than_the_context_are_left_out_and_counted(tiny_root, tmp_path):
    """lm-eval would cut the context from the left without a word; we leave such documents out and say so."""
    tok = load_tokenizer(tiny_root / "models" / "tiny")
    eval_dir = tiny_root / "data" / "eval"
    lengths = []
    for row in (eval_dir / "sft.jsonl").read_text().splitlines():
        messages = json.loads(row)["messages"]
        text = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
        lengths.append(len(tok(text + messages[1]["content"] + tok.eos_token, add_special_tokens=False)["input_ids"]))
    cut = sorted(lengths)[len(lengths) // 2]
    kept, left_out = render_tasks(["llmpipe_sft_chat"], eval_dir, tok, tmp_path / "w", cut, 16)["llmpipe_sft_chat"]
    assert kept == sum(n <= cut for n in lengths) and left_out == sum(n > cut for n in lengths) > 0


def test_a_task_whose_every_document_is_too_long_says_so_and_names_the_key(tiny_root, caplog):
    _, params = make_params(tiny_root, tasks=["llmpipe_sft_chat", "llmpipe_generation"], max_length=8)
    with caplog.at_level("WARNING", logger="llmpipe.stages.evaluate"):
        metrics = evaluate.run(params, model="tiny")  # nothing fits: lm-eval is never called
    assert metrics == {"llmpipe_sft_chat.num_docs": 0, "llmpipe_generation.num_docs": 0,
                       "llmpipe_sft_chat.num_too_long": 4, "llmpipe_generation.num_too_long": 4}
    assert "llmpipe_sft_chat: skipped (num_docs 0): all 4 documents are longer than 8 tokens; raise eval.max_length " \
           "(now 8)" in caplog.text
    assert "or lower eval.max_new_tokens (now 16" in caplog.text and "evaluation set is empty" not in caplog.text
    # Past the model's own context (256 positions), raising eval.max_length cannot help: the message says what can.
    assert "train it with a longer model.max_position_embeddings" in evaluate.longer_context(
        "llmpipe_sft_chat", params.eval.model_copy(update={"max_length": 4096}), 256)
    text = "\n".join(tables.tasks_section(["llmpipe_sft_chat"], {"tiny": metrics}))
    assert "Skipped: all 4 documents are longer than the evaluation context" in text and "raise eval.max_length" in text
    assert "evaluation set is empty" not in text


def test_preference_hook_scores_summed_and_per_character_by_corruption():
    # chosen: 20 chars, -10 nats (-0.5/char); rejected: its 5-char prefix, -4 nats (-0.8/char).
    doc = {"choices": ["x" * 20, "x" * 5], "label": 0, "corruption": "truncate"}
    got = preference_accuracy(doc, [(-10.0, False), (-4.0, False)])
    assert got == {"acc": 0.0, "acc_norm": 1.0, "acc_truncate": 0.0, "acc_norm_truncate": 1.0}
    assert preference_accuracy({**doc, "corruption": None}, [(-3.0, False), (-4.0, False)]) == {"acc": 1.0,
                                                                                                "acc_norm": 1.0}


def test_generation_hook_scores_parse_definition_and_trivial_bodies():
    doc = {"prompt": 'def add(a, b):\n    """Sum."""', "name": "add"}

    def scores(completion):
        return {k: v for k, v in generation_score(doc, [completion]).items() if k != "distinct"}

    assert scores("    return a + b") == {"score": 1.0, "parses": 1.0, "trivial": 0.0}
    assert scores("    pass") == {"score": 0.0, "parses": 1.0, "trivial": 1.0}
    assert scores("    return (a +") == {"score": 0.0, "parses": 0.0, "trivial": 0.0}
    bodies = [generation_score(doc, [c])["distinct"] for c in ("    return a + b", "    return a + b\n", "    pass")]
    assert distinct_share(bodies) == pytest.approx(2 / 3)


@pytest.mark.parametrize("bad", ["llmpipe_perplexty", "no_such_task_anywhere"])
def test_unknown_task_is_a_user_error_naming_eval_tasks(tiny_root, bad):
    _, params = make_params(tiny_root, tasks=["llmpipe_perplexity", bad])
    with pytest.raises(UserError, match=rf"eval\.tasks.*{bad}"):
        evaluate.run(params, model="tiny")


def test_model_must_be_listed_and_present(tiny_root, tmp_path):
    _, params = make_params(tiny_root)
    with pytest.raises(UserError, match=r"not in eval\.models \(tiny\)"):
        evaluate.run(params, model="sft")
    _, params = make_params(tmp_path, models=["tiny", "sft"])
    with pytest.raises(UserError, match=r"no stage makes it: save a model there"):
        evaluate.run(params, model="tiny")  # a user's own folder: no stage to run
    with pytest.raises(UserError, match=r"dvc repro sft"):
        evaluate.run(params, model="sft")


def test_missing_eval_set_names_prepare(tiny_root, tmp_path):
    raw, _ = make_params(tiny_root)
    raw["paths"]["data"] = str(tmp_path / "nodata")
    with pytest.raises(UserError, match=r"perplexity\.jsonl: missing.*dvc repro prepare"):
        evaluate.run(parse_params(raw), model="tiny")


def test_flatten_names_filters_and_drops_text():
    results = {
        "results": {
            "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1},
            "llmpipe_sft_chat": {"bits_per_byte,none": 1.5, "bits_per_byte_stderr,none": "N/A",
                                 "acc,none": 0.25, "acc_stderr,none": float("nan")},
        },
        "n-samples": {"gsm8k": {"original": 10, "effective": 4}},
    }
    assert flatten(results) == {
        "gsm8k.exact_match.strict-match": 0.5, "gsm8k.exact_match_stderr.strict-match": 0.1, "gsm8k.num_docs": 4,
        "llmpipe_sft_chat.bits_per_byte": 1.5, "llmpipe_sft_chat.acc": 0.25,
    }


@pytest.mark.slow
def test_lm_eval_command_runs_our_tasks_on_a_saved_model(tiny_root, tmp_path):
    """The promise: `lm_eval --model hf --model_args pretrained=models/<name>` works on our model directories,
    with our rendered tasks (including a `process_results` hook imported in the new process)."""
    work = tmp_path / "tasks"
    render_tasks(list(LOCAL_TASKS), tiny_root / "data" / "eval", load_tokenizer(tiny_root / "models" / "tiny"), work,
                 4096, 16)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={tiny_root / 'models' / 'tiny'}", "--tasks", "llmpipe_perplexity,llmpipe_sft_chat,llmpipe_generation",
           "--include_path", str(work), "--limit", "2", "--device", "cpu", "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(result_file.read_text())["results"]
    assert results["llmpipe_perplexity"]["bits_per_byte,none"] > 0
    assert results["llmpipe_sft_chat"]["bits_per_byte,none"] > 0
    assert 0 <= results["llmpipe_generation"]["parses,none"] <= 1
    assert 0 < results["llmpipe_generation"]["distinct,none"] <= 1  # our !function aggregation, imported there


# --- lm-eval options per task ---------------------------------------------------------------------------------

QA_TASK = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
doc_to_choice: "{{{{choices}}}}"
metric_list: [{{metric: acc}}]
"""


@pytest.fixture
def user_tasks(tmp_path) -> Path:
    """Two copies of a user's own 4-question multiple-choice lm-eval task (only evaluation documents)."""
    rows = [{"question": f"{a} + {a}?", "choices": [str(2 * a), str(a)], "answer": 0} for a in range(4)]
    write_jsonl(tmp_path / "qa.jsonl", rows)
    for name in ("user_qa", "user_qa_plain"):
        (tmp_path / f"{name}.yaml").write_text(QA_TASK.format(name=name, data=tmp_path / "qa.jsonl"))
    return tmp_path


def test_task_options_reach_lm_eval_per_task(tiny_root, user_tasks):
    from lm_eval.tasks import TaskManager

    from llmpipe.evaluation.harness import evaluate as lm_evaluate

    options = {"user_qa": {"num_fewshot": 2, "apply_chat_template": True, "fewshot_as_multiturn": True}}
    _, params = make_params(tiny_root, tasks=["user_qa", "user_qa_plain"], task_options=options)
    manager = TaskManager(include_path=str(user_tasks), include_defaults=False)
    check_fewshot(manager, params.eval.task_options)
    metrics = lm_evaluate(tiny_root / "models" / "tiny", ["user_qa", "user_qa_plain"], manager, params.eval)
    assert metrics["user_qa.num_fewshot"] == 2, "lm-eval ran the task 2-shot"
    assert "user_qa_plain.num_fewshot" not in metrics, "the other task kept its 0-shot default"
    assert 0 <= metrics["user_qa.acc"] <= 1 and metrics["user_qa.num_docs"] == params.eval.limit


def test_a_fewshot_count_the_task_cannot_draw_is_an_error_naming_the_key(tiny_root, user_tasks):
    from lm_eval.tasks import TaskManager

    _, params = make_params(tiny_root, tasks=["user_qa"], task_options={"user_qa": {"num_fewshot": 4}})
    manager = TaskManager(include_path=str(user_tasks), include_defaults=False)
    with pytest.raises(UserError, match=r"eval\.task_options\.user_qa\.num_fewshot: 4 examples, but task user_qa "
                                        r"draws them from its evaluation documents \(4 documents, minus the one "
                                        r"scored\); use at most 3"):
        check_fewshot(manager, params.eval.task_options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"arc_easy": {"num_fewshot": 5}}, r"eval\.task_options\.arc_easy: not in eval\.tasks"),
        ({"llmpipe_sft_chat": {"apply_chat_template": True}}, (r"llmpipe_sft_chat\.apply_chat_template: llmpipe "
                                                               r"tasks render the model's chat format themselves")),
        ({"llmpipe_perplexity": {"fewshot_as_multiturn": True}}, r"fewshot_as_multiturn needs apply_chat_template"),
        ({"llmpipe_perplexity": {"num_fewshot": -1}}, r"num_fewshot: Input should be greater than or equal to 0"),
    ],
)
def test_bad_task_options_are_params_errors(options, message):
    from llmpipe.config import ParamsError

    with pytest.raises(ParamsError, match=message):
        parse_params({"eval": {"task_options": options}})
