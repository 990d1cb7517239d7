"""The report card's parts without a pipeline: honest checks (a margin of two standard errors), what post-training
cost, the headline, figures from CSV logs, the self-contained page, provenance and the offline plots template."""

from __future__ import annotations

import base64
import io
import re
import subprocess

import pytest
from PIL import Image

from llmpipe.evaluation import checks
from llmpipe.report import figures, page, plots_page, provenance
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


def test_grpo_check_needs_the_gain_and_two_standard_errors():
    def gen(score: float, stderr: float) -> dict[str, float]:
        return {"llmpipe_generation.score": score, "llmpipe_generation.score_stderr": stderr}

    assert checks.generation_gain({"sft": gen(0.1, 0.01), "grpo": gen(0.3, 0.01)}, "grpo").passed is True
    assert checks.generation_gain({"sft": gen(0.1, 0.05), "grpo": gen(0.2, 0.05)}, "grpo").passed is False  # 1.4 s.e.


def test_reward_check_needs_two_binomial_standard_errors():
    m = {"accuracy": 0.78, "accuracy_swap": 0.8, "num_pairs": 100}  # 0.78 - 2 × 0.041 < 0.75
    assert checks.reward_accuracy({"reward": m}).passed is False
    assert checks.reward_accuracy({"reward": {**m, "num_pairs": 10_000}}).passed is True


def test_costs_flag_the_alignment_tax_and_collapsed_answers():
    evals = {
        "sft": {"llmpipe_perplexity.bits_per_byte": 2.30, "llmpipe_generation.distinct": 0.83},
        "dpo": {"llmpipe_perplexity.bits_per_byte": 3.11},
        "grpo": {"llmpipe_perplexity.bits_per_byte": 2.31, "llmpipe_generation.distinct": 0.115},
    }
    sources = {"dpo": "sft", "grpo": "sft", "ppo": "sft"}
    costs = {c.metric: c for c in checks.run_costs(evals, sources, ("ppo", "grpo"))}
    assert costs["cost_dpo_bpb_ratio"].passed is False
    assert costs["cost_dpo_bpb_ratio"].value == pytest.approx(3.11 / 2.3)
    assert "sft 2.300 → dpo 3.110" in costs["cost_dpo_bpb_ratio"].detail
    assert costs["cost_grpo_bpb_ratio"].passed is True
    distinct = costs["cost_grpo_distinct"]
    assert distinct.passed is False and "sft 0.830 → grpo 0.115" in distinct.detail
    assert costs["cost_ppo_bpb_ratio"].passed is None and costs["cost_ppo_distinct"].passed is None  # not evaluated


def test_headline_holds_each_stage_target_and_the_counts():
    evals = {"pretrain": {"llmpipe_perplexity.bits_per_byte": 2.123456}, "grpo": {"llmpipe_generation.score": 0.9}}
    stage_metrics = {"ppo": {"eval_reward": 3.3, "wall_time_s": 100.0}, "reward": {"accuracy": 0.65},
                     "vlm": {"test_accuracy": 0.71234, "untrained_accuracy": 0.3}}
    passed = checks.Check("c", "m", 1.0, True, "")
    flagged = checks.Check("c", "m", 1.0, False, "")
    skipped = checks.Check("c", "m", None, None, "")
    got = headline(evals, stage_metrics, [passed, flagged, skipped], [flagged], 2)
    assert got == {"pretrain_bpb": 2.1235, "grpo_gen_score": 0.9, "ppo_reward": 3.3, "reward_acc": 0.65,
                   "vlm_acc": 0.7123, "checks_passed": 1, "checks_run": 2, "costs_flagged": 1, "not_run": 2}


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
