"""The synthetic image set of the default run: shapes drawn with PIL, each image with one question about its
colour, its shape or how many shapes it holds, split into train / validation / test.

Every record is an SFT record with images (`llmpipe.data.image_records`): ``messages`` (the user turn holds one
``<image>`` placeholder), ``images`` (one path relative to the records file) and ``type`` (the question type, by
which the vlm stage reports accuracy). The drawing is seeded, so the same `data.images` params give the same set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmpipe.config.data import ImagesParams

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 40),
           "purple": (140, 60, 180)}  # fmt: skip
"""Colour names and their RGB fill."""

SHAPES = ("circle", "square", "triangle")
MAX_COUNT = 3
QUESTION_TYPES = ("colour", "shape", "count")


def _draw_shape(draw, shape: str, cx: float, cy: float, r: float, fill: tuple[int, int, int]) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(((cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)), fill=fill)


def _background(rng, size: int):
    from PIL import Image

    if rng.random() < 0.5:
        grey = int(rng.integers(200, 256))
        return Image.new("RGB", (size, size), (grey, grey, grey))
    noise = rng.integers(170, 256, size=(size, size, 3), dtype="uint8")
    return Image.fromarray(noise, "RGB")


def _centres(rng, size: int, r: float, count: int) -> list[tuple[float, float]]:
    """`count` centres at least 2r apart within the canvas (rejection sampling; shapes do not overlap)."""
    centres: list[tuple[float, float]] = []
    while len(centres) < count:
        c = (float(rng.uniform(r, size - r)), float(rng.uniform(r, size - r)))
        if all((c[0] - x) ** 2 + (c[1] - y) ** 2 >= (2.2 * r) ** 2 for x, y in centres):
            centres.append(c)
    return centres


def draw_example(rng, size: int, kind: str):
    """One image and its question/answer.

    Args:
        rng: A `numpy.random.Generator`.
        size: Image side in pixels.
        kind: ``colour`` (one shape: its colour), ``shape`` (one shape: which) or ``count`` (1 to
            :data:`MAX_COUNT` shapes of one kind in any colours: how many).

    Returns:
        ``(image, question, answer)``: an RGB `PIL.Image` of `size` × `size`, and two strings.
    """
    from PIL import ImageDraw

    image = _background(rng, size)
    draw = ImageDraw.Draw(image)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    names = list(COLOURS)
    if kind == "count":
        count, r = int(rng.integers(1, MAX_COUNT + 1)), size * 0.13
        for cx, cy in _centres(rng, size, r, count):
            _draw_shape(draw, shape, cx, cy, r, COLOURS[names[int(rng.integers(len(names)))]])
        return image, f"How many {shape}s are there?", str(count)
    colour = names[int(rng.integers(len(names)))]
    r = float(rng.uniform(0.22, 0.38)) * size
    ((cx, cy),) = _centres(rng, size, r, 1)
    _draw_shape(draw, shape, cx, cy, r, COLOURS[colour])
    if kind == "colour":
        return image, f"What colour is the {shape}?", colour
    return image, "What shape is in the picture?", shape


def write_image_set(folder: Path, cfg: ImagesParams) -> dict[str, int]:
    """Draw the set and write ``<folder>/<split>.jsonl`` and ``<folder>/images/<split>/<n>.png``.

    Question types cycle colour, shape, count, so each split holds them in equal shares.

    Returns:
        The number of records per split, as ``num_vlm_<split>``.
    """
    import numpy as np

    rng = np.random.default_rng(cfg.seed)
    counts = {}
    for split, n in (("train", cfg.num_train), ("validation", cfg.num_validation), ("test", cfg.num_test)):
        (folder / "images" / split).mkdir(parents=True)
        rows: list[dict[str, Any]] = []
        for i in range(n):
            kind = QUESTION_TYPES[i % len(QUESTION_TYPES)]
            image, question, answer = draw_example(rng, cfg.image_size, kind)
            path = f"images/{split}/{i:05d}.png"
            image.save(folder / path)
            rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                      {"role": "assistant", "content": answer}],
                         "images": [path], "type": kind})  # fmt: skip
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
        counts[f"num_vlm_{split}"] = n
    return counts
