"""The `report` stage: the report card's checks, tables and rows, on metrics written here and on a real tiny
evaluation (the `evaluate` tests' model and fixtures)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_evaluate import cli_metrics, make_params, tiny_root  # noqa: F401  (fixtures and params of the evaluate tests)

from llmpipe.config import parse_params
from llmpipe.config.identity import IDENTITY_KEY, run_identity
from llmpipe.config.stages import METRICS_STAGES, REGISTRY
from llmpipe.evaluation.checks import PASS_AT_1, TASK_DISTINCT
from llmpipe.report import card, tables
from llmpipe.stages import report


def write_metrics(root: Path, evals: dict[str, dict[str, float]]) -> None:
    metrics = root / "metrics"
    (metrics / "eval").mkdir(parents=True)
    for model, values in evals.items():
        (metrics / "eval" / f"{model}.json").write_text(json.dumps(values))
    (metrics / "prepare.json").write_text(json.dumps({"num_files": 700, "wall_time_s": 5.5}))
    (metrics / "pretrain.json").write_text(json.dumps(
        {"train_loss": 2.5, "eval_loss": 2.25, "steps": 600, "tokens_per_s": 11234.5, "wall_time_s": 321.0}))


UNWRITTEN = len(METRICS_STAGES) - 2  # the stages with metrics files but the two write_metrics writes


def stamp(params) -> None:
    """Record in each metrics file the run identity the CLI records (`llmpipe.config.identity`) under `params`: the
    report then takes them for this run's."""
    metrics = Path(params.paths.metrics)
    named = [(p, p.stem, None) for p in metrics.glob("*.json") if p.stem in REGISTRY]
    for path, task, model in [*named, *((p, "evaluate", p.stem) for p in (metrics / "eval").glob("*.json"))]:
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, IDENTITY_KEY: run_identity(params, task, model)}))


def model_metrics(bpb: float, chat: float, plain: float, pref: float, wall: float) -> dict[str, float]:
    return {"llmpipe_perplexity.bits_per_byte": bpb, "llmpipe_sft_chat.bits_per_byte": chat,
            "llmpipe_sft_plain.bits_per_byte": plain, "llmpipe_preference.acc_norm": pref,
            "llmpipe_preference.acc_norm_stderr": 0.03, "llmpipe_sft_chat.num_docs": 200, "llmpipe_signature_mc.num_docs": 0,
            "wall_time_s": wall}


def task_metrics(pass1: float, distinct: float, num_docs: int = 200) -> dict[str, float]:
    """The executable tasks' metrics as the evaluate stage writes them (pass@1 with lm-eval's stderr, the
    distinct share without one: the check takes its binomial s.e. from num_docs)."""
    return {PASS_AT_1: pass1, f"{PASS_AT_1}_stderr": (pass1 * (1 - pass1) / num_docs) ** 0.5,
            TASK_DISTINCT: distinct, "llmpipe_tasks.num_docs": num_docs}


def test_report_passing(tmp_path):
    write_metrics(tmp_path, {
        "baseline": model_metrics(4.0, 4.0, 4.1, 0.30, 61.0) | task_metrics(0.0, 0.2),
        "pretrain": model_metrics(2.0, 1.5, 1.6, 0.50, 62.0) | task_metrics(0.05, 0.9),
        "sft": model_metrics(2.1, 1.0, 1.4, 0.55, 63.0) | task_metrics(0.30, 0.9),
        "dpo": model_metrics(2.2, 1.1, 1.5, 0.70, 64.0) | task_metrics(0.45, 0.88),
    })  # fmt: skip
    _, params = make_params(tmp_path, models=["baseline", "pretrain", "sft", "dpo"])
    stamp(params)
    metrics = report.run(params)
    assert metrics == {"check_pretrain_bpb_ratio": 0.5, "check_sft_chat_bpb_delta": -0.5,
                       "check_dpo_preference_acc_norm_delta": pytest.approx(0.15),
                       "check_sft_pass1_delta": pytest.approx(0.25), "check_sft_distinct_delta": 0.0,
                       "check_sft_bpb_ratio": pytest.approx(1.05), "check_dpo_pass1_delta": pytest.approx(0.15),
                       "check_dpo_distinct_delta": pytest.approx(-0.02),
                       "check_dpo_bpb_ratio": pytest.approx(2.2 / 2.1),
                       "num_checks": 9, "num_checks_passed": 9, "num_not_run": UNWRITTEN}
    text = (tmp_path / "reports" / "report.md").read_text()
    lines = text.splitlines()
    perplexity = lines[lines.index("### llmpipe_perplexity"):lines.index("### llmpipe_sft_chat")]
    assert perplexity[2] == "| model | bits_per_byte ↓ |"
    rows = [line.split(" | ")[0].strip("| ") for line in perplexity[4:] if line.startswith("|")]
    assert rows == ["baseline", "pretrain", "sft", "dpo"]  # eval.models order
    assert "| baseline | 4 |" in perplexity and "| dpo | 0.7 |" in text
    assert "### llmpipe_signature_mc" not in text  # no numbers for it
    checks = [line for line in lines if line.startswith("- ✓") or line.startswith("- ✗")]
    assert len(checks) == 9 and all(line.startswith("- ✓") for line in checks)
    assert "- ✓ dpo passes more held-out tasks than sft, by at least 2 standard errors (pass@1, " in text
    assert "sft 0.300 → dpo 0.450 (+0.150, +3.1 s.e. of 0.048)" in text
    headline = json.loads((tmp_path / "metrics" / "headline.json").read_text())["headline"]
    assert {k: headline[f"{k}_pass1"] for k in ("baseline", "pretrain", "sft", "dpo")} == {
        "baseline": 0.0, "pretrain": 0.05, "sft": 0.3, "dpo": 0.45}
    assert "plain format: pretrain 1.6000 → sft 1.4000" in text
    assert "| prepare | 5.5 |" in text and "| pretrain | 321.0 |" in text and "| evaluate@dpo | 64.0 |" in text
    assert "| pretrain | 321 | 600 | – | 11234.5 | – | – | – | loss 2.25 | – |" in text  # training stages table
    assert "llmpipe_signature_mc" in text and "Skipped: its evaluation set is empty" in text


def test_report_failing_and_skipped(tmp_path):
    write_metrics(tmp_path, {
        "baseline": model_metrics(4.0, 4.0, 4.1, 0.30, 61.0),
        "pretrain": model_metrics(3.2, 1.5, 1.6, 0.50, 62.0),
        "sft": model_metrics(3.0, 1.6, 1.4, 0.55, 63.0),
    })  # fmt: skip
    _, params = make_params(tmp_path, models=["baseline", "pretrain", "sft"])
    stamp(params)
    metrics = report.run(params)
    assert metrics["check_pretrain_bpb_ratio"] == 0.8 and metrics["check_sft_chat_bpb_delta"] == pytest.approx(0.1)
    assert "check_dpo_preference_acc_norm_delta" not in metrics
    assert (metrics["num_checks"], metrics["num_checks_passed"]) == (3, 1)  # sft keeps its bits per byte
    lines = (tmp_path / "reports" / "report.md").read_text().splitlines()
    assert sum(line.startswith("- ✗") for line in lines) == 2
    skip = "skipped: no llmpipe_tasks.pass_at_1 in any evaluation (this data has no executable tasks"
    assert any(line.startswith("- – sft passes more held-out tasks than pretrain") and skip in line for line in lines)
    assert any(line.startswith("- –") and "skipped: no evaluation of dpo for these params (in eval.models?"
               in line for line in lines)


def test_report_rl_checks_and_drift_table(tmp_path):
    """Each RL stage is checked on the tasks against its input model; its own rising reward is in the table, not a
    check: grpo's reward rises while it collapses onto one answer, and that fails."""
    evals = {"sft": model_metrics(2.1, 1.0, 1.4, 0.55, 63.0) | task_metrics(0.30, 0.83),
             "ppo": model_metrics(2.2, 1.0, 1.4, 0.55, 61.0) | task_metrics(0.42, 0.80),
             "grpo": model_metrics(2.1, 1.0, 1.4, 0.55, 60.0) | task_metrics(0.50, 0.06)}
    evals["sft"] |= {"llmpipe_generation.score": 0.10, "llmpipe_generation.distinct": 0.9}
    evals["grpo"] |= {"llmpipe_generation.score": 1.0, "llmpipe_generation.distinct": 0.06}
    write_metrics(tmp_path, evals)
    metrics_dir = tmp_path / "metrics"
    (metrics_dir / "reward.json").write_text(json.dumps(
        {"accuracy": 0.8, "accuracy_swap": 0.5, "accuracy_truncate": 0.99, "accuracy_syntax": 0.9}))
    rl = {"reward_first": 0.2, "reward_first_se": 0.03, "reward_last": 0.325, "reward_last_se": 0.04,
          "kl_final": 13.0, "response_length_first": 40.0, "response_length_last": 30.0}
    (metrics_dir / "ppo.json").write_text(json.dumps(rl))  # 13 nats > 2 × ppo.kl_target 6: fails
    (metrics_dir / "grpo.json").write_text(json.dumps({**rl, "reward_last": 0.9, "kl_final": 0.05}))
    _, params = make_params(tmp_path, models=["sft", "ppo", "grpo"])
    stamp(params)
    metrics = report.run(params)
    assert metrics["check_reward_min_accuracy"] == 0.5
    assert metrics["check_ppo_pass1_delta"] == pytest.approx(0.12)
    assert metrics["check_ppo_kl_ratio"] == pytest.approx(13 / 6)
    assert metrics["check_grpo_distinct_delta"] == pytest.approx(-0.77)
    assert not [k for k in metrics if "reward_gain" in k or "generation" in k], "the training reward is no check"
    lines = (tmp_path / "reports" / "report.md").read_text().splitlines()
    marks = {name: next(line[2] for line in lines if line.startswith("- ") and needle in line)
             for name, needle in [("reward", "reward model ranks"), ("ppo pass@1", "ppo passes more held-out tasks"),
                                  ("ppo kl", "ppo ends within 2 × ppo.kl_target"), ("ppo bpb", "ppo keeps held-out"),
                                  ("grpo pass@1", "grpo passes more held-out tasks"),
                                  ("grpo collapse", "grpo does not collapse")]}
    assert marks == {"reward": "✗", "ppo pass@1": "✓", "ppo kl": "✗", "ppo bpb": "✓", "grpo pass@1": "✓",
                     "grpo collapse": "✗"}
    assert "| ppo | 0.2 ± 0.03 | 0.325 ± 0.04 | +2.5 s.e. | 13 nats per response | 40 → 30 |" in lines
    assert "| grpo | 0.2 ± 0.03 | 0.9 ± 0.04 | +14.0 s.e. | 0.05 nats per token | 40 → 30 |" in lines


def test_report_without_a_models_evaluation_shows_it_as_not_run(tmp_path):
    write_metrics(tmp_path, {"baseline": model_metrics(4.0, 4.0, 4.1, 0.3, 1.0)})
    _, params = make_params(tmp_path, models=["baseline", "sft"])
    stamp(params)
    assert report.run(params)["num_not_run"] == UNWRITTEN + 1  # and evaluate@sft
    text = (tmp_path / "reports" / "report.md").read_text()
    assert f"- **evaluate@sft**: no {tmp_path / 'metrics' / 'eval' / 'sft.json'}" in text
    assert "| sft |" not in text.split("## Results per task")[1]


def test_report_on_a_real_evaluation(tiny_root, cli_metrics):  # noqa: F811 (fixtures imported above)
    """The report reads what the evaluate stage wrote (no checks apply to a lone model)."""
    _, params = make_params(tiny_root)
    assert report.run(params) == {"num_checks": 0, "num_checks_passed": 0, "num_not_run": len(METRICS_STAGES)}
    text = (tiny_root / "reports" / "report.md").read_text()
    assert f"| tiny | {tables.fmt(cli_metrics['llmpipe_perplexity.bits_per_byte'])} |" in text
    assert "| evaluate@tiny |" in text




def test_report_uses_only_metrics_of_the_current_params_and_inputs(tmp_path):
    """Files of another run (params or an input changed since, or no identity recorded) are left out everywhere:
    checks, tables, samples, figures and the headline; the card names each and why."""
    evals = {m: model_metrics(2.1, 1.0, 1.4, 0.55, 60.0) for m in ("sft", "dpo", "ppo")}
    write_metrics(tmp_path, evals)
    metrics_dir, logs = tmp_path / "metrics", tmp_path / "logs"
    rl = {"reward_first": 0.2, "reward_first_se": 0.03, "reward_last": 0.9, "reward_last_se": 0.04, "steps": 4,
          "eval_reward": 0.8, "wall_time_s": 99.0}
    (metrics_dir / "ppo.json").write_text(json.dumps(rl))
    (metrics_dir / "reward.json").write_text(json.dumps({"accuracy": 0.9, "num_pairs": 400, "steps": 4}))
    (logs / "ppo").mkdir(parents=True)
    (logs / "ppo" / "samples.jsonl").write_text(json.dumps({"step": 4, "prompt": "p", "completion": "PPO-ANSWER"}))
    (logs / "ppo" / "train.csv").write_text("step,loss,reward\n2,0.3,0.1\n4,0.2,0.5\n")
    raw, params = make_params(tmp_path, models=["sft", "dpo", "ppo"])
    stamp(params)  # the earlier run: every file current
    assert report.run(params)["check_ppo_bpb_ratio"] == 1.0
    (metrics_dir / "vlm.json").write_text(json.dumps({"test_accuracy": 0.9, "steps": 4}))  # no identity
    (tmp_path / "models" / "sft").mkdir(parents=True)
    (tmp_path / "models" / "sft" / "config.json").write_text("{}")  # a new models/sft: its users are stale
    params = parse_params({**raw, "ppo": {"lr": 1e-5}})
    metrics = report.run(params)
    text = (tmp_path / "reports" / "report.md").read_text()
    head, rest = text.split("## Checks")
    assert "## ⚠ Not run for these params" in head and "This card shows none of their results" in head
    sft_eval = tmp_path / "metrics" / "eval" / "sft.json"
    assert (f"- **evaluate@sft**: {sft_eval} is from another run (changed since: input {tmp_path / 'models' / 'sft'})"
            in head)
    assert "- **ppo**:" in head and f"input {tmp_path / 'models' / 'sft'}, params ppo)" in head
    assert "- **reward**:" in head and "- **vlm**:" in head and "records no run identity" in head
    assert "check_ppo_bpb_ratio" not in metrics and "check_reward_min_accuracy" not in metrics
    assert "skipped: no metrics/ppo.json of these params (run the ppo stage)" in rest  # its KL check
    assert "PPO-ANSWER" not in text and "| ppo | 0.2 ± 0.03" not in text
    assert f"| ppo | {card.NOT_RUN} |" in text and f"| vlm | {card.NOT_RUN} |" in text
    assert "| evaluate@sft |" not in text and "| evaluate@dpo | 60.0 |" in text  # dpo's evaluation is of models/dpo
    headline = json.loads((metrics_dir / "headline.json").read_text())["headline"]
    assert "ppo_reward" not in headline and "reward_acc" not in headline and "vlm_acc" not in headline
    assert headline["not_run"] == metrics["num_not_run"] == UNWRITTEN + 1  # and evaluate@sft


def test_report_on_users_data_speaks_of_their_data(tmp_path):
    """data.source other than stdlib: no check or task description of Python functions; the task checks wait for
    tasks with tests; the greedy answers of every model stand side by side."""
    evals = {m: model_metrics(2.1, 1.0, 1.4, 0.55, 60.0) for m in ("baseline", "pretrain", "sft", "dpo", "grpo")}
    for m in evals.values():
        m |= {"llmpipe_answers.exact": 0.1, "llmpipe_answers.distinct": 0.3}
    write_metrics(tmp_path, evals)
    for model in evals:
        answers = tmp_path / "logs" / "evaluate" / model / "answers.jsonl"
        answers.parent.mkdir(parents=True)
        answers.write_text("".join(json.dumps({"task": "llmpipe_answers", "prompt": f"Q{i}?", "answer": f"{model}-{i}"})
                                   + "\n" for i in range(4)))
    raw, _ = make_params(tmp_path, models=list(evals))
    params = parse_params({**raw, "data": {"source": "hf", "hf": {"dataset_name": "my/texts"}}})
    stamp(params)
    report.run(params)
    text = (tmp_path / "reports" / "report.md").read_text()
    for stdlib_words in ("real body", "corrupt", "held-out code", "held-out module", "bodies", "llmpipe_generation",
                         "llmpipe_signature_mc", "function"):
        assert stdlib_words not in text, stdlib_words
    assert "dpo prefers the chosen response of held-out pairs more often than sft" in text
    assert "skipped: no llmpipe_tasks.pass_at_1" in text
    answers = text.split("## Greedy answers")[1].split("\n## ")[0]
    assert answers.count("### Prompt ") == 3 and "| grpo | grpo-2 |" in answers
