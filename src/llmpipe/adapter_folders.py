"""peft adapter folders (``peft.merge: false``) as model folders: what makes one, the base it was trained on, its
config, and loading it over that base (`llmpipe.models.load_model` calls :func:`load_adapter`).

A stage trained on an adapter folder saves an adapter whose base is that folder (`llmpipe.train.adapters.wrap`), so
``peft.merge: false`` in several stages in a row makes a chain: loading its last folder loads the root model, then
every adapter in order, each merged before the next applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
"""What makes a folder a peft adapter (``peft.merge: false``) rather than a model."""


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is an adapter folder: ``adapter_config.json`` and no ``config.json`` of its own."""
    return (Path(path) / ADAPTER_CONFIG).exists() and not (Path(path) / "config.json").exists()


def adapter_base(path: Path) -> Path:
    """The model folder an adapter folder was trained on (its ``base_model_name_or_path``; relative paths are from
    the repository root, where stages run).

    Raises:
        UserError: The adapter config names no base.
    """
    from llmpipe.models import read_config

    base = read_config(path / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{path / ADAPTER_CONFIG}: no base_model_name_or_path; save the adapter again")
    return Path(base)


def model_config(path: str | Path) -> dict[str, Any]:
    """A model folder's ``config.json`` (a pointer's: its source's), or for an adapter folder its base model's."""
    from llmpipe.model_source import weights_dir
    from llmpipe.models import read_config

    path = Path(path)
    return model_config(adapter_base(path)) if is_adapter(path) else read_config(weights_dir(path) / "config.json")


def _base_what(path: Path) -> str:
    """The fix named when an adapter's base folder is missing or refused."""
    return (f"it is the base model (base_model_name_or_path) of the adapter {path}: run from the folder its stage ran "
            f"in (the path is relative to that folder), or set base_model_name_or_path in {path / ADAPTER_CONFIG}")


def check_adapter(path: Path, what: str, trust_remote_code: bool) -> None:
    """`llmpipe.models.check_model_dir` for an adapter folder: its safetensors weights whole, then its base.

    Raises:
        UserError: The adapter weights are missing or damaged (names `what`, the fix), or its base is refused.
    """
    from llmpipe.core.io import safetensors_problem
    from llmpipe.models import check_model_dir

    weights = path / "adapter_model.safetensors"
    if problem := safetensors_problem(weights) if weights.exists() else "no such file":
        raise UserError(f"{weights}: damaged or missing adapter ({problem}); {what}")
    check_model_dir(adapter_base(path), _base_what(path), trust_remote_code)


def load_adapter(path: Path, what: str, num_labels: int | None, trust_remote_code: bool, **kwargs):
    """An adapter folder over its base model (itself loaded by `llmpipe.models.load_model`, so adapters chain),
    merged into the weights; a virtual-token adapter (prefix or prompt tuning) cannot merge and stays a
    `peft.PeftModel`. The folder's ``generation_config.json``, where a stage wrote one (`llmpipe.saved_folder`: the
    end-of-turn eos), replaces the base's.

    Raises:
        UserError: The folder or its base is refused by the safe loaders or missing.
    """
    from peft import PeftModel

    from llmpipe.models import check_model_dir, load_model

    check_model_dir(path, what, trust_remote_code)
    base = load_model(adapter_base(path), _base_what(path), num_labels, trust_remote_code, **kwargs)
    model = PeftModel.from_pretrained(base, path)
    model = model if model.peft_config["default"].is_prompt_learning else model.merge_and_unload()
    if (path / "generation_config.json").exists() and num_labels is None:
        from transformers import GenerationConfig

        target = model.get_base_model() if isinstance(model, PeftModel) else model
        target.generation_config = GenerationConfig.from_pretrained(path)
    return model
