"""The report card, the DVC plots page and the run's headline on the tiny pipeline the session trains once
(`trained_pipeline`): what a user opens after `dvc repro`, checked against metrics/*.json and dvc.lock."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, sh
from PIL import Image

from llmpipe.config import stages as registry
from llmpipe.report.tables import fmt

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def repo(trained_pipeline) -> Path:
    return trained_pipeline.repo


def open_png(data: bytes) -> tuple[int, int]:
    """The size of a PNG, after PIL checked the whole file."""
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "PNG"
        image.load()
        return image.size


def headless(page: Path, screenshot: Path) -> list[str]:
    """Open `page` in headless Chromium (network cut), save a screenshot; return the console lines it logged."""
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--proxy-server=127.0.0.1:9",
         "--window-size=1150,2600", "--virtual-time-budget=10000", f"--screenshot={screenshot}",
         "--enable-logging=stderr", "--v=0", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert screenshot.exists(), proc.stderr[-3000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def test_report_card_has_every_stage_and_every_figure_opens(repo):
    text = (repo / "reports" / "report.md").read_text()
    assert "Not run for these params" not in text, "under dvc repro every metrics file is of the current params"
    for stage in registry.TRAINING_TASKS:
        assert re.search(rf"^\| {stage} \| ", text, re.MULTILINE), f"{stage} has no row in the card"
    links = re.findall(r"!\[[^\]]*\]\((figures/[^)]+)\)", text)
    figures, names = {"loss.png", "lr.png", "rl.png"}, {Path(link).name for link in links}
    assert figures <= names and all(n in figures or n.startswith("vlm-") for n in names), names  # vlm: its images
    for link in links:
        width, height = open_png((repo / "reports" / link).read_bytes())
        assert (width > 300 and height > 200) if Path(link).name in figures else width == height >= 64
    page = (repo / "reports" / "report.html").read_text()
    assert '<meta charset="utf-8">' in page and "<script" not in page
    sources = re.findall(r'<img[^>]* src="([^"]+)"', page)
    assert len(sources) == len(links) and all(s.startswith("data:image/png;base64,") for s in sources)
    for source in sources:
        open_png(base64.b64decode(source.split(",", 1)[1]))
    assert "https://" not in page and "http://" not in page


def test_report_tables_agree_with_metrics_and_dvc_lock(repo, pipeline_env):
    text = (repo / "reports" / "report.md").read_text()
    commit = sh(repo, pipeline_env, "git", "rev-parse", "HEAD").strip()
    assert f"- git commit: `{commit}`" in text
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    outputs = {o["path"]: o["md5"] for s in lock.values() for o in s.get("outs", [])
               if not o["path"].startswith(("metrics/", "logs/", "reports/"))}
    assert any(p.startswith("data/") for p in outputs) and any(p.startswith("models/") for p in outputs)
    for path, md5 in outputs.items():
        assert f"| `{path}` | `{md5}` |" in text, path
    for stage in registry.TRAINING_TASKS:
        m = json.loads((repo / "metrics" / f"{stage}.json").read_text())
        row = f"| {stage} | {fmt(m['wall_time_s'])} | {fmt(m['steps'])} | "
        assert row in text, row
        assert f"| {fmt(m.get('tokens_per_s'))} | {fmt(m.get('mfu'))} | {fmt(m.get('peak_memory_gb'))} |" in text
    headline = json.loads((repo / "metrics" / "headline.json").read_text())["headline"]
    checks = json.loads((repo / "metrics" / "report.json").read_text())
    assert headline["not_run"] == checks["num_not_run"] == 0
    assert headline["checks_run"] == checks["num_checks"] and headline["checks_passed"] == checks["num_checks_passed"]
    sft = json.loads((repo / "metrics" / "eval" / "sft.json").read_text())
    assert headline["sft_chat_bpb"] == round(sft["llmpipe_sft_chat.bits_per_byte"], 4)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install chromium)")
def test_report_page_renders_in_headless_chromium(repo, tmp_path):
    console = headless(repo / "reports" / "report.html", tmp_path / "report.png")
    assert console == [], "the page logged to the console (a missing image is a 'Failed to load resource' error)"
    assert open_png((tmp_path / "report.png").read_bytes()) == (1150, 2600)


def declared_plot_ids(repo: Path) -> set[str]:
    """Every plot dvc.yaml declares: the top-level definitions' names and the stages' plot files, as DVC makes
    them HTML ids."""
    dvc = yaml.safe_load((repo / "dvc.yaml").read_text())
    logs = yaml.safe_load((repo / "params.yaml").read_text())["paths"]["logs"]
    names = [next(iter(p)) for p in dvc["plots"]]
    names += [next(iter(p)).replace("${paths.logs}", logs) for s in dvc["stages"].values() for p in s.get("plots", [])]
    return {re.sub(r"[!@#$%^&*()\[\]{};,<>?\\/:.|`~=_+ ]", "_", name) for name in names}


def test_dvc_plots_page_shows_every_plot_offline(repo, pipeline_env, tmp_path):
    sh(repo, pipeline_env, "dvc", "plots", "show", "-o", str(tmp_path / "plots"))
    page = tmp_path / "plots" / "index.html"
    html = page.read_text(encoding="utf-8")
    found = set(re.findall(r'<div id = "([^"]+)"', html))
    assert declared_plot_ids(repo) <= found, f"missing plots: {declared_plot_ids(repo) - found}"
    assert not re.search(r"<script[^>]*\bsrc=", html), "the page loads a script from elsewhere"
    assert "window.vegaEmbed" in html and '<meta charset="utf-8">' in html
    if CHROMIUM:
        errors = [line for line in headless(page, tmp_path / "plots.png") if "Uncaught" in line or "Failed" in line]
        assert errors == []


def guide_exp_show() -> tuple[str, str]:
    """The `DROP=…` line and the `dvc exp show` command of docs/experiments.md's "Compare runs at a glance"."""
    guide = (ROOT / "docs" / "experiments.md").read_text()
    block = re.search(r"^## Compare runs at a glance\n.*?^```\n(.*?)^```", guide, re.DOTALL | re.MULTILINE)
    lines = block.group(1).splitlines()
    drop = next(line for line in lines if line.startswith("DROP="))
    show = next(line.split("#")[0].strip() for line in lines if line.startswith("dvc exp show"))
    return drop, show


def test_exp_show_of_two_experiments_fits_in_200_columns(repo, pipeline_env, tmp_path):
    copy = tmp_path / "repo"  # a copy: the experiments must not change the session's repo
    shutil.copytree(repo, copy, symlinks=True)
    sh(copy, pipeline_env, "git", "add", "-A")
    sh(copy, pipeline_env, "git", "commit", "-qm", "baseline run")
    # The learning rate, not beta: tiny DPO's 12 steps at beta 0.2 and 0.3 can end equal at the headline's 4
    # decimals on some CPUs, and --only-changed then rightly drops the column this test looks for.
    for lr in ("0.001", "0.003"):
        sh(copy, pipeline_env, "dvc", "exp", "run", "-n", f"lr{lr}", "-S", f"dpo.lr={lr}")
    drop, show = guide_exp_show()
    out = sh(copy, pipeline_env, "bash", "-c", f"{drop}; {show} --no-pager")
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) >= 5, out  # header, rule, workspace, baseline, two experiments
    assert max(map(len, table)) <= 200, "\n".join(table)
    header = table[0]
    assert "dpo.lr" in header and "headline.dpo_bpb" in header, header
    assert "wall_time_s" not in header and "tokens_per_s" not in header
    assert "lr0.001" in out and "lr0.003" in out
