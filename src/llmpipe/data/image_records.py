"""Image question/answer records: read, check and normalise them, and copy a user's set into ``data/vlm``.

A record is an SFT record with images: ``messages`` (``role``/``content`` turns) and ``images`` (paths relative to
the records file). An image's place in a turn is either an ``<image>`` placeholder in a string content
(LLaMA-Factory / ShareGPT style) or a typed content part ``{"type": "image"}`` among ``{"type": "text", "text":
…}`` parts (TRL style). Optional ``type`` (the question type the vlm stage reports accuracy by). Every mistake is
refused with the file and row before any model loads.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir, decode_line, write_jsonl

IMAGE_TAG = "<image>"
SPLITS = ("train", "validation", "test")
_TAG = re.compile(re.escape(IMAGE_TAG))


def typed_content(content: Any) -> list[dict[str, Any]]:
    """A turn's content as typed parts: a string is cut at each ``<image>`` into text and image parts (empty text
    parts dropped); a list of parts is returned as it is."""
    if not isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(_TAG.split(content)):
        if i:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts


def _count_images(messages: list[dict[str, Any]]) -> int:
    return sum(part.get("type") == "image" for m in messages for part in typed_content(m["content"]))


def _check_row(row: Any, where: str, folder: Path) -> dict[str, Any]:
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise UserError(f"{where}: a record needs `messages`, a list of {{role, content}} turns")
    images = row.get("images")
    if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
        raise UserError(f"{where}: a record needs `images`, a list of image paths relative to the file")
    for m in row["messages"]:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str | list):
            raise UserError(f"{where}: every turn needs `role` and `content` (a string, or a list of typed parts)")
    if not any(m["role"] == "assistant" for m in row["messages"]):
        raise UserError(f"{where}: no assistant turn, so nothing to learn or score; add the answer as an assistant "
                        "turn")  # fmt: skip
    tags = _count_images(row["messages"])
    if tags != len(images):
        raise UserError(f"{where}: {tags} image placeholder(s) ({IMAGE_TAG} or {{\"type\": \"image\"}}) but "
                        f"{len(images)} image(s) in `images`; give one image per placeholder")  # fmt: skip
    for p in images:
        _check_image(folder / p, where)
    return row


def _check_image(path: Path, where: str) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except FileNotFoundError:
        raise UserError(f"{where}: image {path} does not exist; fix the path (relative to the records file)") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise UserError(f"{where}: image {path} cannot be read as an image ({err}); replace or remove it") from None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The checked records of a jsonl file, in order.

    Raises:
        UserError: The file is missing, a line is not a JSON object, a record lacks `messages`/`images` or an
            assistant turn, its placeholders do not match its images, or an image is missing or unreadable;
            the message gives the file and row (line number).
    """
    if not path.is_file():
        raise UserError(f"{path}: no such records file; a vlm data folder holds train.jsonl and validation.jsonl")
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = decode_line(raw, path, lineno)
            if not line.strip():
                continue
            where = f"{path}: row {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: not valid JSON ({err.msg}); fix or remove that line") from None
            rows.append(_check_row(row, where, path.parent))
    if not rows:
        raise UserError(f"{path}: no records")
    return rows


def import_records(source: Path, dest: Path) -> dict[str, int]:
    """Check a user's record folder (`data.local.vlm`) and copy it, images included, to `dest` atomically.

    ``train.jsonl`` and ``validation.jsonl`` are required; ``test.jsonl`` is optional (the validation records
    are scored when it is missing). Images are copied under ``images/<split>/`` and the paths rewritten.

    Returns:
        ``num_vlm_<split>`` per split written.

    Raises:
        UserError: As :func:`read_records`, naming ``data.local.vlm`` when the folder is missing.
    """
    if not source.is_dir():
        raise UserError(f"data.local.vlm: {source} is not a folder; point it at a folder with train.jsonl and "
                        "validation.jsonl")  # fmt: skip
    splits = {s: read_records(source / f"{s}.jsonl") for s in SPLITS if s != "test" or (source / "test.jsonl").exists()}
    splits.setdefault("test", splits["validation"])
    counts = {}
    with atomic_dir(dest) as tmp:
        for split, rows in splits.items():
            (tmp / "images" / split).mkdir(parents=True)
            origin = source / ("validation.jsonl" if split == "test" and not (source / "test.jsonl").exists()
                               else f"{split}.jsonl")  # fmt: skip
            out = []
            for i, row in enumerate(rows):
                paths = []
                for j, p in enumerate(row["images"]):
                    new = f"images/{split}/{i:05d}-{j}{Path(p).suffix}"
                    shutil.copyfile(origin.parent / p, tmp / new)
                    paths.append(new)
                out.append({**row, "images": paths})
            write_jsonl(tmp / f"{split}.jsonl", out)
            counts[f"num_vlm_{split}"] = len(out)
    return counts
