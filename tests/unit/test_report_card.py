"""The report card's parts without a pipeline: honest checks (a margin of two standard errors), the post-training
stages' checks on the executable tasks, the headline, figures from CSV logs, the self-contained page, provenance and
the offline plots template."""

from __future__ import annotations

import base64
import io
import re
import subprocess

import pytest
from PIL import Image

from llmpipe.evaluation import checks, task_checks
from llmpipe.report import figures, page, plots_page, provenance
from llmpipe.report.card import reward_rise
from llmpipe.report.headline import headline


def pref(acc_norm: float, stderr: float) -> dict[str, float]:
    return {"llmpipe_preference.acc_norm": acc_norm, "llmpipe_preference.acc_norm_stderr": stderr}


def test_dpo_check_needs_two_standard_errors():
    # the default run once passed at +0.005 with a standard error of 0.033: noise, not a gain
    noise = checks.dpo_vs_sft({"sft": pref(0.690, 0.033), "dpo": pref(0.695, 0.033)})
    assert noise.passed is False and "s.e." in noise.detail
    real = checks.dpo_vs_sft({"sft": pref(0.60, 0.02), "dpo": pref(0.70, 0.02)})  # +0.1 = 3.5 s.e. of 0.028
    assert real.passed is True and real.value == pytest.approx(0.1)
    assert checks.dpo_vs_sft({"sft": pref(0.60, 0.02), "dpo": pref(0.65, 0.02)}).passed is False  # 1.8 s.e.


def test_reward_check_needs_two_binomial_standard_errors():
    m = {"accuracy": 0.78, "accuracy_swap": 0.8, "num_pairs": 100}  # 0.78 - 2 × 0.041 < 0.75
    assert checks.reward_accuracy({"reward": m}).passed is False
    assert checks.reward_accuracy({"reward": {**m, "num_pairs": 10_000}}).passed is True


def tasks(pass1: float, distinct: float, num_docs: int = 200, **extra: float) -> dict[str, float]:
    """A model's metrics on the executable tasks as the evaluate stage writes them: pass@1 with lm-eval's stderr,
    the distinct share without one (its binomial s.e. comes from num_docs)."""
    se = (pass1 * (1 - pass1) / num_docs) ** 0.5
    return {checks.PASS_AT_1: pass1, f"{checks.PASS_AT_1}_stderr": se, checks.TASK_DISTINCT: distinct,
            "llmpipe_tasks.num_docs": num_docs, **extra}


def test_pass_at_1_must_rise_by_two_standard_errors_of_the_difference():
    # 200 tasks: s.e. of the difference of 0.30 and 0.40 is 0.0474; +0.10 = 2.1 s.e.
    real = task_checks.pass_at_1_gain({"sft": tasks(0.30, 0.9), "ppo": tasks(0.40, 0.9)}, "ppo", "sft")
    assert real.passed is True and real.value == pytest.approx(0.10) and "sft 0.300 → ppo 0.400" in real.detail
    noise = task_checks.pass_at_1_gain({"sft": tasks(0.30, 0.9), "ppo": tasks(0.38, 0.9)}, "ppo", "sft")  # 1.7 s.e.
    assert noise.passed is False and "+1.7 s.e." in noise.detail
    worse = task_checks.pass_at_1_gain({"pretrain": tasks(0.2, 0.9), "sft": tasks(0.1, 0.9)}, "sft", "pretrain")
    assert worse.passed is False and worse.metric == "check_sft_pass1_delta"


def test_collapse_is_a_drop_of_distinct_answers_beyond_two_binomial_standard_errors():
    # the default run's GRPO once wrote one body for almost every prompt: distinct 0.83 → 0.06
    collapsed = task_checks.no_collapse({"sft": tasks(0.3, 0.83), "grpo": tasks(0.5, 0.06)}, "grpo", "sft")
    assert collapsed.passed is False and collapsed.value == pytest.approx(-0.77)
    # 0.80 → 0.75 over 200 tasks: binomial s.e. of the difference 0.0416, a drop of 1.2 s.e.: within noise
    kept = task_checks.no_collapse({"sft": tasks(0.3, 0.80), "grpo": tasks(0.5, 0.75)}, "grpo", "sft")
    assert kept.passed is True and "-1.2 s.e. of 0.042" in kept.detail
    few = task_checks.no_collapse({"sft": tasks(0.3, 0.80, 20), "grpo": tasks(0.5, 0.60, 20)}, "grpo", "sft")
    assert few.passed is True, "0.2 is 1.4 s.e. over 20 tasks"
    no_count = {"sft": {checks.TASK_DISTINCT: 0.8}, "grpo": {checks.TASK_DISTINCT: 0.79}}
    assert task_checks.no_collapse(no_count, "grpo", "sft").passed is False  # no s.e.: any drop fails
    assert checks.stderr({"m": {checks.TASK_DISTINCT: 0.5, "llmpipe_tasks.num_docs": 100}}, checks.TASK_DISTINCT,
                         "m") == pytest.approx(0.05)


def test_bits_per_byte_and_ppo_kl_are_checks():
    bpb = "llmpipe_perplexity.bits_per_byte"
    taxed = task_checks.bpb_kept({"sft": {bpb: 2.30}, "dpo": {bpb: 3.11}}, "dpo", "sft")
    assert taxed.passed is False and taxed.value == pytest.approx(3.11 / 2.3)
    assert "sft 2.300 → dpo 3.110" in taxed.detail
    assert task_checks.bpb_kept({"sft": {bpb: 2.30}, "grpo": {bpb: 2.5}}, "grpo", "sft").passed is True  # ×1.087
    far = task_checks.kl_within_target({"ppo": {"kl_final": 9.5}}, "ppo", 4.0)  # the default run once ended at 9.5
    assert far.passed is False and far.value == pytest.approx(2.375) and "kl_final 9.500 / kl_target 4" in far.detail
    assert task_checks.kl_within_target({"ppo": {"kl_final": 11.9}}, "ppo", 6.0).passed is True
    assert "run the ppo stage" in task_checks.kl_within_target({}, "ppo", 6.0).detail


def test_task_checks_cover_every_post_training_stage_and_skip_without_tasks():
    sources = {"sft": "pretrain", "dpo": "sft", "ppo": "sft", "grpo": "dpo", "vlm": "sft"}
    evals = {"pretrain": tasks(0.1, 0.9), "sft": tasks(0.3, 0.9), "dpo": tasks(0.45, 0.9), "grpo": tasks(0.6, 0.88)}
    found = {c.metric: c for c in task_checks.run_task_checks(evals, {"ppo": {"kl_final": 3.0}}, sources, {"ppo": 6.0})}
    assert list(found) == [f"check_{s}_{what}" for s in ("sft", "dpo", "ppo", "grpo")
                           for what in ("pass1_delta", "distinct_delta", "bpb_ratio", *(("kl_ratio",) * (s == "ppo")))]
    grpo, ppo = found["check_grpo_pass1_delta"], found["check_ppo_pass1_delta"]
    assert grpo.passed is True and "dpo 0.450 → grpo 0.600" in grpo.detail  # against its own policy, dpo
    assert ppo.passed is None and "no evaluation of ppo" in ppo.detail
    assert found["check_ppo_kl_ratio"].passed is True
    assert found["check_sft_bpb_ratio"].passed is None  # no bits per byte written here: skipped, saying so
    without = task_checks.run_task_checks({"sft": {}, "pretrain": {}}, {}, {"sft": "pretrain"}, {})
    assert [c.passed for c in without] == [None, None, None]
    assert "skipped: no llmpipe_tasks.pass_at_1 in any evaluation (this data has no executable" in without[0].detail
    assert f"skipped: no {checks.TASK_DISTINCT} in any evaluation" in without[1].detail


def test_a_rising_training_reward_is_shown_in_standard_errors_not_checked():
    assert reward_rise({"reward_first": 0.2, "reward_first_se": 0.03, "reward_last": 0.325, "reward_last_se": 0.04}
                       ) == "+2.5 s.e."
    assert reward_rise({"reward_first": 0.0, "reward_last": 0.0, "frac_zero_std_groups": 1.0}).startswith(
        "none: every group's rewards were equal")
    assert "too few logged steps" in reward_rise({"reward_first": 0.0, "reward_last": 0.1})


def test_headline_holds_each_stage_target_pass_at_1_and_the_counts():
    evals = {"pretrain": {"llmpipe_perplexity.bits_per_byte": 2.123456}, "grpo": {"llmpipe_generation.score": 0.9},
             "sft": tasks(0.312345, 0.9)}
    stage_metrics = {"ppo": {"eval_reward": 3.3, "wall_time_s": 100.0}, "reward": {"accuracy": 0.65},
                     "vlm": {"test_accuracy": 0.71234, "untrained_accuracy": 0.3}}
    passed = checks.Check("c", "m", 1.0, True, "")
    failed = checks.Check("c", "m", 1.0, False, "")
    skipped = checks.Check("c", "m", None, None, "")
    got = headline(evals, stage_metrics, [passed, failed, skipped], 2)
    assert got == {"pretrain_bpb": 2.1235, "grpo_gen_score": 0.9, "ppo_reward": 3.3, "reward_acc": 0.65,
                   "vlm_acc": 0.7123, "sft_pass1": 0.3123, "checks_passed": 1, "checks_run": 2, "not_run": 2}


def write_logs(root):
    (root / "sft").mkdir(parents=True)
    (root / "sft" / "train.csv").write_text("step,loss,learning_rate\n1,2.0,0.001\n2,-0.5,0.002\n3,1.0,0.001\n")
    (root / "sft" / "eval.csv").write_text("step,eval_loss\n3,1.5\n")
    (root / "ppo").mkdir()
    (root / "ppo" / "train.csv").write_text("step,loss,learning_rate,reward,kl,response_length,num_input_tokens_seen\n"
                                            "2,0.3,0.0001,0.1,0.0,40,\n4,0.2,0.0001,0.5,0.2,35,\n")
    (root / "ppo" / "eval.csv").write_text("step,eval_reward,eval_response_length\n4,0.6,33\n")


def png_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def test_figures_are_pngs_from_the_csv_logs(tmp_path):
    write_logs(tmp_path / "logs")
    drawn = figures.draw_all(tmp_path / "logs", ("pretrain", "sft", "ppo"), ("ppo", "grpo"), tmp_path / "figures")
    assert set(drawn) == {"loss", "lr", "rl"}
    for path in drawn.values():
        width, height = png_size(path.read_bytes())
        assert width > 300 and height > 200
    rl = figures.rl_panels({"ppo": (figures.read_log(tmp_path / "logs" / "ppo" / "train.csv"),
                                    figures.read_log(tmp_path / "logs" / "ppo" / "eval.csv"))}, ("ppo",))
    assert [p.title for p in rl] == ["ppo: reward", "ppo: KL to reference", "ppo: response length"]
    assert [label for label, _, _ in rl[0].lines] == ["train", "eval"]
    assert figures.series(figures.read_log(tmp_path / "logs" / "ppo" / "train.csv"), "num_input_tokens_seen") is None
    assert figures.draw_all(tmp_path / "none", ("sft",), (), tmp_path / "empty") == {}


def test_page_embeds_every_image_and_declares_its_charset(tmp_path):
    write_logs(tmp_path / "logs")
    drawn = figures.draw_all(tmp_path / "logs", ("sft",), (), tmp_path / "figures")
    text = "# card\n\n| a | b |\n|---|---|\n| −1.5 | x |\n\n![loss](figures/loss.png)\n"
    (tmp_path / "card.md").write_text(text)
    html = page.render(text, tmp_path, "t")
    assert '<meta charset="utf-8">' in html and "<table>" in html and "−1.5" in html
    (source,) = re.findall(r'<img[^>]* src="([^"]+)"', html)
    assert base64.b64decode(source.removeprefix("data:image/png;base64,")) == drawn["loss"].read_bytes()
    assert "](data:image/png;base64," in page.markdown_with_images(tmp_path / "card.md")
    with pytest.raises(FileNotFoundError):
        page.render("![x](figures/none.png)", tmp_path, "t")


def test_provenance_reads_git_and_dvc_lock(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    (tmp_path / "src.py").write_text("x = 1\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "a.json").write_text("{}")
    (tmp_path / "dvc.lock").write_text(
        "schema: '2.0'\nstages:\n  a:\n    cmd: x\n    params:\n      params.yaml:\n        a.lr: 0.1\n"
        "    outs:\n    - path: models/a\n      md5: abc.dir\n    - path: metrics/a.json\n      md5: def\n")
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "i"]):
        subprocess.run([*git, *cmd], cwd=tmp_path, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True)
    head = head.stdout.strip()
    (tmp_path / "metrics" / "a.json").write_text('{"x": 1}')  # the pipeline's own output: not dirty
    clean = provenance.collect(tmp_path, ["metrics", "reports"])
    assert clean.commit == head and clean.dirty == []
    assert clean.outputs == {"models/a": "abc.dir"} and clean.params_hash and len(clean.params_hash) == 12
    assert "torch" in clean.packages and clean.hardware["cpu cores"].isdigit()
    (tmp_path / "src.py").write_text("x = 2\n")
    assert provenance.collect(tmp_path, ["metrics"]).dirty == ["src.py"]
    assert provenance.collect(tmp_path / "metrics", []).params_hash is None  # no dvc.lock there


def test_plots_template_inlines_vega_and_declares_its_charset():
    text = plots_page.page()
    assert '<meta charset="utf-8">' in text and "{plot_divs}" in text and "{refresh_tag}" in text
    assert "{scripts}" not in text, "DVC would add its CDN script tags"
    assert not re.search(r"<script[^>]*\bsrc=", text) and "window.vegaEmbed" in text


def test_plots_template_command_writes_where_told_and_help_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as ended:
        plots_page.main(["--help"])
    assert ended.value.code == 0 and "usage:" in capsys.readouterr().out
    assert not list(tmp_path.iterdir()), "--help is not a path"
    assert plots_page.main([str(tmp_path / "page.html")]) == 0
    assert (tmp_path / "page.html").read_text() == plots_page.page()
