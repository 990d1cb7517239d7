"""The report card's markdown: checks, figures, per-stage statistics, RL drift, samples side by side,
provenance and the estimated cost. Tables of evaluation results come from :mod:`llmpipe.report.tables`."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from llmpipe.evaluation.checks import Check
from llmpipe.report.figures import read_log, series
from llmpipe.report.provenance import Provenance
from llmpipe.report.tables import fmt, table

MARKS = {True: "✓", False: "✗", None: "–"}

FIGURE_CAPTIONS = {
    "loss": "Training loss (line) and validation loss (points) per stage",
    "rl": "RL stages: reward, KL to the reference and response length per step",
    "lr": "Learning-rate schedule per stage",
}

NUM_SAMPLE_PROMPTS = 3
"""Prompts shown side by side (the first of the earliest stage that logged samples)."""

SAMPLE_CHARS = 240
"""Characters of a completion shown in the side-by-side table."""


NOT_RUN = "**not run for these params**"
"""What the card says in place of the results of a stage whose metrics are of another run, or missing."""


def not_run_section(not_run: dict[str, str]) -> list[str]:
    """The stages and evaluations whose metrics are not of the current params and inputs
    (:mod:`llmpipe.report.current`), first on the card so that no reader takes another run's numbers for these."""
    if not not_run:
        return []
    count = "1 stage or evaluation did" if len(not_run) == 1 else f"{len(not_run)} stages and evaluations did"
    warning = (f"**{count} not run for the current params and inputs. This card "
               "shows none of their results**: their checks are skipped, their rows, figures and samples left out, "
               "and `metrics/headline.json` omits them. Run them (`dvc repro <stage>`, `dvc repro "
               "evaluate@<model>`) to include them.")
    return ["## ⚠ Not run for these params", "", warning, "", *(f"- **{name}**: {why}" for name, why in not_run.items()),
            ""]


def checks_section(checks: list[Check]) -> list[str]:
    """Every check, one line each: ✓ passed, ✗ failed, – skipped (and why)."""
    note = ("Each post-training stage is checked on the held-out executable tasks against the model it started "
            "from: pass@1 up, distinct answers not down, held-out bits per byte kept (and, for an RL stage with a "
            "KL target, its KL to the reference within twice that target). A rising training reward is shown under "
            "RL stages, not checked.")
    return ["## Checks", "", note, "", *(f"- {MARKS[c.passed]} {c.claim}: {c.detail}" for c in checks), ""]


def figures_section(figures: dict[str, str]) -> list[str]:
    """Markdown image links, relative to the report (GitHub renders them; the HTML page embeds them)."""
    lines = ["## Figures", ""]
    for name, link in figures.items():
        lines += [f"![{FIGURE_CAPTIONS[name]}]({link})", "", f"*{FIGURE_CAPTIONS[name]}.*", ""]
    return lines if figures else []


def _tokens_seen(train: dict[str, list[float]]) -> float | None:
    found = series(train, "num_input_tokens_seen", "num_tokens")
    return found[1][-1] if found else None


def stage_rows(stage_metrics: dict[str, dict[str, Any]], logs_dir: Path) -> list[list[str]]:
    """Per training stage: wall time, tokens, throughput, MFU, peak memory, last training loss, final and best
    validation loss (or reward, for the RL stages)."""
    rows = []
    for stage, m in stage_metrics.items():
        if "steps" not in m:
            continue
        train, evals = read_log(logs_dir / stage / "train.csv"), read_log(logs_dir / stage / "eval.csv")
        last_loss = series(train, "loss")
        target, best = ("eval_reward", max) if "eval_reward" in m else ("eval_loss", min)
        history = series(evals, target)
        rows.append([
            stage, fmt(m.get("wall_time_s")), fmt(m["steps"]), fmt(_tokens_seen(train)), fmt(m.get("tokens_per_s")),
            fmt(m.get("mfu")), fmt(m.get("peak_memory_gb")), fmt(last_loss[1][-1] if last_loss else None),
            f"{target.removeprefix('eval_')} {fmt(m.get(target))}", fmt(best(history[1]) if history else None),
        ])
    return rows


def stages_section(stage_metrics: dict[str, dict[str, Any]], logs_dir: Path, not_run: list[str]) -> list[str]:
    """The training stages' table: a row of figures per stage that ran for these params, a row saying
    :data:`NOT_RUN` for each training stage in `not_run`."""
    rows = stage_rows(stage_metrics, logs_dir)
    if not rows and not not_run:
        return []
    rows += [[stage, NOT_RUN, *(["–"] * 8)] for stage in not_run]
    header = ["stage", "wall time (s)", "steps", "tokens", "tokens/s", "MFU", "peak memory (GB)", "last train loss",
              "final validation", "best validation"]
    note = ("Tokens: input tokens the trainer counted (`num_input_tokens_seen`); MFU only on a GPU whose peak is "
            "known; peak memory: CUDA's peak allocation, or the process's peak RSS on a CPU.")
    return ["## Training stages", "", note, "", *table(header, rows), ""]


def reward_rise(m: dict[str, Any]) -> str:
    """How far an RL stage's training reward rose, last 10% of steps over the first, in standard errors of the
    difference; shown beside the checks, never one (a policy can raise its own reward without getting better)."""
    if m.get("frac_zero_std_groups", 0.0) >= 1.0:  # GRPO's advantages all 0: loss and gradient 0 on every step
        return "none: every group's rewards were equal on every step (no gradient)"
    if "reward_first_se" not in m or "reward_last_se" not in m:  # one logged step per tenth: no spread (nan, dropped)
        return "– (too few logged steps for a standard error)"
    se = (m["reward_first_se"] ** 2 + m["reward_last_se"] ** 2) ** 0.5
    gain = m.get("reward_last", m["reward_first"]) - m["reward_first"]
    return f"{gain / se:+.1f} s.e." if se > 0 else f"{gain:+.3g} (standard error 0)"


def rl_section(stage_metrics: dict[str, dict[str, Any]], kl_units: dict[str, str], stdlib: bool = True) -> list[str]:
    """The RL stages' drift from where they started: reward and its rise (:func:`reward_rise`), KL to the
    reference, response length."""
    header = ["stage", "reward first 10%", "reward last 10%", "rise", "KL to reference (end)",
              "response tokens first → last"]
    rows = []
    for stage, kl_unit in kl_units.items():
        m = stage_metrics.get(stage)
        if m is None or "reward_first" not in m:
            continue
        rows.append([
            stage,
            f"{fmt(m['reward_first'])} ± {fmt(m.get('reward_first_se'))}",
            f"{fmt(m.get('reward_last'))} ± {fmt(m.get('reward_last_se'))}",
            reward_rise(m),
            f"{fmt(m.get('kl_final'))} {kl_unit}" if "kl_final" in m else "–",
            f"{fmt(m.get('response_length_first'))} → {fmt(m.get('response_length_last'))}",
        ])
    if not rows:
        return []
    note = ("The training reward is the stage's own: it can rise while the model gets no better at the tasks, so "
            "it is shown, not checked (the checks above read held-out pass@1). Reward hacking shows as reward up "
            "while pass@1 stays flat, the share of distinct answers falls (one answer written for every prompt)"
            + (", the share of trivial bodies (llmpipe_generation.trivial) rises" if stdlib else "")
            + ", or responses shrink or grow far from where they started.")
    return ["## RL stages", "", *table(header, rows), "", note, ""]


def last_samples(path: Path) -> tuple[float, dict[str, str]] | None:
    """``(step, {prompt: completion})`` of the last step logged in a ``samples.jsonl``; None when there is none."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r, dict) and {"step", "prompt", "completion"} <= set(r)]
    if not rows:
        return None
    step = max(r["step"] for r in rows)
    return step, {str(r["prompt"]): str(r["completion"]) for r in rows if r["step"] == step}


def _cell(text: str) -> str:
    """Text for a markdown table cell: clipped, HTML-escaped, pipes escaped, line breaks as <br>."""
    clipped = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " …"
    return html.escape(clipped, quote=False).replace("|", "\\|").replace("\n", "<br>") or "(empty)"


def _side_by_side(found: dict[str, dict[str, str]], who: str, what: str) -> list[str]:
    """The first :data:`NUM_SAMPLE_PROMPTS` prompts of the first entry of `found` (``{row label: {prompt:
    answer}}``), each with every entry's answer in a table of columns `who` and `what`."""
    lines = []
    for i, prompt in enumerate(list(next(iter(found.values())))[:NUM_SAMPLE_PROMPTS], 1):
        rows = [[label, _cell(answers[prompt]) if prompt in answers else "–"] for label, answers in found.items()]
        lines += [f"### Prompt {i}", "", "```", prompt.strip(), "```", "", *table([who, what], rows), ""]
    return lines


def samples_section(stages: tuple[str, ...], logs_dir: Path) -> list[str]:
    """A few fixed prompts answered by every stage that logged samples (``logs/<stage>/samples.jsonl``, its last
    step), side by side."""
    found = {s: got for s in stages if (got := last_samples(logs_dir / s / "samples.jsonl"))}
    lines = ["## Samples", ""]
    if not found:
        return [*lines, f"No stage logged samples ({logs_dir}/<stage>/samples.jsonl) in this run.", ""]
    return lines + _side_by_side({f"{s} (step {fmt(step)})": answers for s, (step, answers) in found.items()},
                                 "stage", "completion")


def answers_section(files: dict[str, Path]) -> list[str]:
    """The evaluated models' greedy answers to the same held-out prompts, side by side (each model's
    ``answers.jsonl`` of the evaluate stage: `llmpipe.evaluation.harness.answers_path`)."""
    found = {}
    for model, path in files.items():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        if rows:
            found[model] = {str(r["prompt"]): str(r["answer"]) for r in rows}
    if not found:
        return []
    note = ("The evaluated models' greedy answers (the evaluation's generation task, up to eval.max_new_tokens) to "
            "the first held-out prompts.")
    return ["## Greedy answers", "", note, "", *_side_by_side(found, "model", "answer")]


def provenance_section(prov: Provenance, cost_per_hour: float, total_wall_s: float) -> list[str]:
    """Git, params, dvc.lock hashes, packages, hardware and the estimated cost of the run."""
    if prov.dirty is None:
        state = ""
    else:
        more = " …" if len(prov.dirty) > 5 else ""
        state = f" (dirty: {', '.join(f'`{p}`' for p in prov.dirty[:5])}{more})" if prov.dirty else " (clean)"
    hours = total_wall_s / 3600
    lines = [
        "## Provenance", "",
        f"- git commit: `{prov.commit or 'none (not a git repository)'}`{state}",
        f"- params hash: `{prov.params_hash or 'none (no dvc.lock: not a DVC run)'}` (sha256 of every stage's params "
        "as dvc.lock records them)",
        f"- estimated cost: {cost_per_hour * hours:.2f} at {cost_per_hour:g} per hour (`report.cost_per_hour`) for "
        f"{hours:.2f} h of stage wall time",
        "- packages: " + ", ".join(f"{n} {v}" for n, v in prov.packages.items()),
        "- hardware: " + "; ".join(f"{k}: {v}" for k, v in prov.hardware.items()),
        "",
    ]
    if prov.outputs:
        rows = [[f"`{path}`", f"`{md5}`"] for path, md5 in prov.outputs.items()]
        lines += ["Data and model hashes (DVC's md5, from `dvc.lock`):", "", *table(["output", "md5"], rows), ""]
    return lines


def wall_times(stage_metrics: dict[str, dict[str, Any]], evals: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Wall time in seconds of every stage that ran, evaluations as ``evaluate@<model>``."""
    times = {stage: m["wall_time_s"] for stage, m in stage_metrics.items() if "wall_time_s" in m}
    return times | {f"evaluate@{model}": m["wall_time_s"] for model, m in evals.items() if "wall_time_s" in m}


def wall_time_section(times: dict[str, float]) -> list[str]:
    if not times:
        return []
    rows = [[name, f"{t:.1f}"] for name, t in times.items()] + [["**total**", f"**{sum(times.values()):.1f}**"]]
    return ["## Wall time", "", *table(["stage", "wall time (s)"], rows), ""]
