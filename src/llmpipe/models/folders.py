"""A model folder on disk, checked before transformers reads it: its JSON configs, the refusals of safe loading
(pickled weights, ``auto_map`` code), and peft adapter folders (``peft.merge: false``): what makes one, the base it
was trained on, its config.

A stage trained on an adapter folder saves an adapter whose base is that folder (`llmpipe.train.adapters.wrap`), so
``peft.merge: false`` in several stages in a row makes a chain: loading its last folder loads the root model, then
every adapter in order, each merged before the next applies (`llmpipe.models.loading.load_adapter`).

Safe loading: every model and tokenizer folder the pipeline reads goes through :func:`check_model_dir` (models, by
`llmpipe.models.loading`) or :func:`check_tokenizer_configs` (tokenizers), which refuse, unless the caller trusts
the folder (``llm-train --trust-remote-code``, passed down as ``trust_remote_code``), what loading could execute:

- weights only as pickles (:data:`PICKLE_SUFFIXES`), since unpickling can run code — otherwise weights are
  read with ``use_safetensors=True``; a trusted ``pytorch_model.bin`` still goes through transformers'
  ``torch.load(weights_only=True)``;
- an ``auto_map`` in ``config.json`` / ``tokenizer_config.json``, which points transformers at a ``.py``
  file in the folder to import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.core.io import safetensors_problem
from llmpipe.models.source import weights_dir

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Weight files `torch.load` would unpickle: loaded only from a trusted folder."""

TRUST_FLAG = "--trust-remote-code"
"""The `llm-train` flag that sets ``trust_remote_code`` (named in refusals)."""

ADAPTER_CONFIG = "adapter_config.json"
"""What makes a folder a peft adapter (``peft.merge: false``) rather than a model."""


def read_config(path: Path) -> dict[str, Any]:
    """A folder's JSON config (``config.json``, ``tokenizer_config.json``).

    Raises:
        UserError: The file is not UTF-8 JSON (names file, line and column) or not a JSON object.
    """
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: line {err.lineno}, column {err.colno}: not valid JSON ({err.msg}); fix the file or "
                        "save the folder again") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8; fix the file or save the folder again") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _refuse_auto_map(config_path: Path, trust_remote_code: bool) -> None:
    """Refuse a config whose ``auto_map`` names Python code, unless trusted."""
    auto_map = read_config(config_path).get("auto_map")
    if not auto_map or trust_remote_code:
        return
    refs = [r for v in (auto_map.values() if isinstance(auto_map, dict) else [auto_map])
            for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    files = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs})
    raise UserError(f"{config_path}: auto_map points transformers at Python code ({', '.join(files) or auto_map}) that "
                    f"loading would run; pass {TRUST_FLAG} only if you trust this folder's source")


def check_model_dir(path: str | Path, what: str, trust_remote_code: bool = False) -> None:
    """Check a model folder before transformers reads it (see the module docstring).

    Args:
        path: A `save_pretrained` directory.
        what: The fix to name when it is missing, e.g. "run the sft stage first (dvc repro sft)".
        trust_remote_code: Let pickled weights and ``auto_map`` code through.

    Raises:
        UserError: No ``config.json``, a broken one, an untrusted ``auto_map``, no weights, a truncated
            safetensors file, or (untrusted) weights only as pickles; the message names the file and the fix.
    """
    path = weights_dir(path)
    config = path / "config.json"
    if is_adapter(path):
        return check_adapter(path, what, trust_remote_code)
    if not config.exists():
        raise UserError(f"{path}: no model there; {what}")
    check_not_adapter_twice(path)
    _refuse_auto_map(config, trust_remote_code)
    names = sorted(f.name for f in path.iterdir() if f.is_file())
    if any(n.endswith(".safetensors") for n in names):
        for name in (n for n in names if n.endswith(".safetensors")):
            if problem := safetensors_problem(path / name):
                raise UserError(f"{path / name}: damaged weights ({problem}); {what}")
        return
    pickles = [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
    if not pickles:
        raise UserError(f"{path}: no weights (model.safetensors) beside config.json; {what}")
    if not trust_remote_code:
        raise UserError(
            f"{path / pickles[0]}: weights only as a pickle ({', '.join(pickles)}), which can run code when loaded; "
            f"save the model with safetensors (save_pretrained(dir, safe_serialization=True)), or pass {TRUST_FLAG} "
            "only if you trust its source"
        )


def check_not_adapter_twice(path: Path) -> None:
    """Refuse a folder holding a model's own weights and a top-level peft ``adapter_config.json``.

    transformers loads such a folder's weights and then applies the adapter over them; when the weights are already
    the merged model (what some tools write), the adapter is applied twice, silently. Loading the weights alone
    instead would be as silent the other way, when the weights are the base the adapter was trained on. Which one the
    folder means only its writer knows, so it is refused, naming both layouts llmpipe loads.

    Raises:
        UserError: The folder has both; names the folder and the two fixes.
    """
    if (path / ADAPTER_CONFIG).exists():
        raise UserError(
            f"{path}: holds a model's weights (config.json) and a peft {ADAPTER_CONFIG} beside them, so loading it "
            "would apply the adapter over those weights: twice, if they are the merged model. If the weights are merged, "
            f"move {ADAPTER_CONFIG} and adapter_model.safetensors into {path / 'adapter'}/ (llmpipe's layout) or delete "
            "them; if the folder is the adapter, keep only its adapter files and the tokenizer (its "
            "base_model_name_or_path names the base)"
        )


def check_tokenizer_configs(path: Path, trust_remote_code: bool) -> None:
    """Refuse a tokenizer folder whose ``tokenizer_config.json`` or ``config.json`` maps to code, unless trusted.

    Raises:
        UserError: A config is broken, or (untrusted) has an ``auto_map``.
    """
    for name in ("tokenizer_config.json", "config.json"):  # AutoTokenizer reads the auto_map of either
        if (path / name).exists():
            _refuse_auto_map(path / name, trust_remote_code)


def is_adapter(path: str | Path) -> bool:
    """Whether `path` is an adapter folder: ``adapter_config.json`` and no ``config.json`` of its own."""
    return (Path(path) / ADAPTER_CONFIG).exists() and not (Path(path) / "config.json").exists()


def adapter_base(path: Path) -> Path:
    """The model folder an adapter folder was trained on (its ``base_model_name_or_path``; relative paths are from
    the repository root, where stages run).

    Raises:
        UserError: The adapter config names no base.
    """
    base = read_config(path / ADAPTER_CONFIG).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{path / ADAPTER_CONFIG}: no base_model_name_or_path; save the adapter again")
    return Path(base)


def model_config(path: str | Path) -> dict[str, Any]:
    """A model folder's ``config.json`` (a pointer's: its source's), or for an adapter folder its base model's."""
    path = Path(path)
    return model_config(adapter_base(path)) if is_adapter(path) else read_config(weights_dir(path) / "config.json")


def base_what(path: Path) -> str:
    """The fix named when an adapter's base folder is missing or refused."""
    return (f"it is the base model (base_model_name_or_path) of the adapter {path}: run from the folder its stage ran "
            f"in (the path is relative to that folder), or set base_model_name_or_path in {path / ADAPTER_CONFIG}")


def check_adapter(path: Path, what: str, trust_remote_code: bool) -> None:
    """:func:`check_model_dir` for an adapter folder: its safetensors weights whole, then its base.

    Raises:
        UserError: The adapter weights are missing or damaged (names `what`, the fix), or its base is refused.
    """
    weights = path / "adapter_model.safetensors"
    if problem := safetensors_problem(weights) if weights.exists() else "no such file":
        raise UserError(f"{weights}: damaged or missing adapter ({problem}); {what}")
    check_model_dir(adapter_base(path), base_what(path), trust_remote_code)
