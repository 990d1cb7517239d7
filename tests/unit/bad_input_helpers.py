"""What the bad-input table needs besides its rows: the small workspace every row starts from (the module-scoped
``template`` fixture), the params it is made with (:data:`BASE`), the data builders, the row set-up helpers
(``write``, ``remove``, ``pickled_weights``, ``auto_map``, …) and :class:`Bad`, one row.

Shared by ``test_bad_input.py`` and ``test_safe_loading.py``; importable by plain name because pytest puts this
folder on ``sys.path``. A test module that uses the fixtures binds them to names of its own
(``template = bad_input_helpers.template``) so that pytest finds them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import TINY_PARAMS

from llmpipe.cli import main
from llmpipe.orchestration.scratch import deep_merge

# TINY_PARAMS with users' own small data and a model small enough to save in milliseconds.
BASE: dict[str, Any] = deep_merge(
    yaml.safe_load(TINY_PARAMS),
    {
        "data": {"source": "local",
                 "local": {"pretrain": "in/docs.jsonl", "sft": "in/sft.jsonl", "preference": "in/pref.jsonl"}},
        "tokenizer": {"vocab_size": 300},
        "model": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                  "intermediate_size": 32, "max_position_embeddings": 128},
    },
)


def documents(n: int) -> list[dict[str, Any]]:
    return [{"text": f"document {i}: " + "some words " * (i % 5 + 1)} for i in range(n)]


def chats(n: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(n)]


def pairs(n: int) -> list[dict[str, Any]]:
    return [{"prompt": f"prompt {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]


def jsonl(rows: list[Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def run_cli(argv: list[str]) -> int:
    """`llm-train` in this process; argparse's own errors exit before `main` can return a code."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def snapshot(root: Path) -> dict[str, str]:
    """Every folder and file under `root` (relative path → sha256 of its bytes; folders → "dir")."""
    return {p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


@pytest.fixture(autouse=True)
def _restore_logging():
    """`main` points the root logger at the captured stderr; give the next test its own handlers back."""
    handlers = logging.getLogger().handlers[:]
    yield
    logging.getLogger().handlers[:] = handlers


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A complete small workspace: raw data in ``in/``, prepared ``data/`` with its token files,
    ``artifacts/tokenizer``, tiny safetensors models in ``models/{pretrain,sft,reward}`` and the metrics of the
    stages that made them."""
    from transformers import AutoModelForSequenceClassification

    from llmpipe.config import load_params
    from llmpipe.models import build_model, load_tokenizer, save_model

    root = tmp_path_factory.mktemp("workspace")
    (root / "in").mkdir()
    (root / "in" / "docs.jsonl").write_text(jsonl(documents(30)))
    (root / "in" / "sft.jsonl").write_text(jsonl(chats(12)))
    (root / "in" / "pref.jsonl").write_text(jsonl(pairs(12)))
    (root / "params.yaml").write_text(yaml.safe_dump(BASE))
    with contextlib.chdir(root):
        assert main(["--task", "prepare"]) == 0
        assert main(["--task", "tokenizer"]) == 0
        assert main(["--task", "tokenize"]) == 0
        params = load_params("params.yaml")
        tok = load_tokenizer(params.paths.tokenizer)
        for name in ("pretrain", "sft"):
            save_model(build_model(params.model, tok), tok, Path("models", name))
        reward = AutoModelForSequenceClassification.from_pretrained("models/sft", num_labels=1)
        save_model(reward, tok, Path("models", "reward"))
    logging.getLogger().handlers.clear()
    return root


# --- what a row sets up --------------------------------------------------------------------------------------


def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    """Write `content` to ``root/rel``."""

    def setup(root: Path) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)

    return setup


def remove(rel: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        shutil.rmtree(root / rel)

    return setup


def empty_parquet(rel: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), root / rel)

    return setup


def pickled_weights(model: str, name: str = "pytorch_model.bin") -> Callable[[Path], None]:
    """Replace the safetensors weights of ``models/<model>`` by the same tensors pickled with `torch.save`."""

    def setup(root: Path) -> None:
        import torch
        from safetensors.torch import load_file

        folder = root / "models" / model
        state = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / name)

    return setup


def auto_map(rel: str, auto_class: str) -> Callable[[Path], None]:
    """Point `auto_class` in the JSON config ``root/rel`` at a Python file beside it that leaves a trace when run."""

    def setup(root: Path) -> None:
        path = root / rel
        config = json.loads(path.read_text())
        config["auto_map"] = {auto_class: "custom_code.Custom"}
        path.write_text(json.dumps(config))
        (path.parent / "custom_code.py").write_text("open('CODE_RAN', 'w').close()\n")

    return setup


def patch_json(rel: str, **entries: Any) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        path = root / rel
        path.write_text(json.dumps({**json.loads(path.read_text()), **entries}))

    return setup


def copy(src: str, dest: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        shutil.copytree(root / src, root / dest)

    return setup


def vlm_records(**splits: list[tuple[str, list[str]]]) -> Callable[[Path], None]:
    """A `data.local.vlm` folder ``in/vlm``: the given rows (user text, image names) per split, valid rows
    in the splits not given, and a real ``a.png``; names other than ``a.png`` are left for the row to create."""
    from PIL import Image

    def setup(root: Path) -> None:
        folder = root / "in" / "vlm"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (255, 0, 0)).save(folder / "a.png")
        for split in ("train", "validation"):
            rows = splits.get(split, [("<image>What colour?", ["a.png"])])
            (folder / f"{split}.jsonl").write_text(jsonl(
                [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "red"}],
                  "images": images} for text, images in rows]))

    return setup


def chain(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        for step in setups:
            step(root)

    return setup


@dataclass(frozen=True)
class Bad:
    """One bad input: what to set up, which command to run, and what the message must say."""

    task: str
    expect: tuple[str, ...]
    """Substrings of the error message: the location (key path, file:line, model file) and the fix."""
    params: dict[str, Any] = field(default_factory=dict)
    """Merged into :data:`BASE` to make params.yaml."""
    params_text: str | None = None
    """params.yaml verbatim instead."""
    setup: Callable[[Path], None] | None = None
    argv: tuple[str, ...] = ()
    multiline: bool = False
    """A params error may list one key per line."""


def local(**paths: str) -> dict[str, Any]:
    return {"data": {"local": paths}}
