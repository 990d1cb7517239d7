"""The report card's section on the `vlm` stage: held-out accuracy per question type against chance and the model
before training, and a few held-out images with the trained model's answers (``logs/vlm/answers/``)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from llmpipe.report.tables import fmt, table

SCALE = 4
"""The answered images are drawn this many times larger (the synthetic ones are 32 pixels a side)."""


def copy_images(answers: Path, dest: Path) -> dict[int, str]:
    """Copy each answered image of ``<answers>/<n>.png`` to ``<dest>/vlm-<n>.png``, enlarged without smoothing;
    returns ``{n: file name}`` (empty when the vlm stage left no answers)."""
    from PIL import Image

    names = {}
    for path in sorted(answers.glob("*.png")) if answers.is_dir() else []:
        with Image.open(path) as img:
            big = img.resize((img.width * SCALE, img.height * SCALE), Image.Resampling.NEAREST)
        names[int(path.stem)] = f"vlm-{path.stem}.png"
        big.save(dest / names[int(path.stem)])
    return names


def section(metrics: dict[str, Any] | None, answers: Path, images: dict[int, str]) -> list[str]:
    """Markdown lines of the section; none when the vlm stage did not run."""
    if metrics is None:
        return []
    kinds = sorted(k.removeprefix("test_chance_") for k in metrics if k.startswith("test_chance_"))
    rows = [[kind, f"{fmt(metrics[f'test_accuracy_{kind}'])} ± {fmt(metrics[f'test_accuracy_{kind}_se'])}",
             fmt(metrics.get(f"untrained_accuracy_{kind}")), fmt(metrics[f"test_chance_{kind}"]),
             fmt(metrics[f"test_num_{kind}"])] for kind in kinds]  # fmt: skip
    intro = ("Held-out multiple-choice accuracy per question type (± one standard error), against the same model "
             "before training and against chance.")
    lines = ["## Images (vlm)", "", intro, "",
             *table(["question type", "vlm", "untrained", "chance", "n"], rows), ""]  # fmt: skip
    path = answers / "answers.jsonl"
    if path.exists():
        answered = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [[f"![held-out image {i}](figures/{images[i]})" if i in images else "–", a["type"],
                 html.escape(a["question"]), html.escape(a["expected"]), html.escape(a["answer"]) or "(empty)"]
                for i, a in enumerate(answered)]  # fmt: skip
        lines += ["Held-out images answered by the trained model (greedy):", "",
                  *table(["image", "type", "question", "expected", "answer"], rows), ""]  # fmt: skip
    return lines
