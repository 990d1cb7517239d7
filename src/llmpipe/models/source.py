"""Where a model's weights come from: ``model.init_from`` (``scratch``, a local folder, or a hub id at
``model.revision``), the checks on it, and the pointer a stage writes instead of a copy of its weights.

A stage that only passes the given model on — ``pretrain`` with ``pretrain.enabled: false``, ``baseline`` with a
model to start from — writes :data:`POINTER` (a few hundred bytes naming the source) and the pipeline tokenizer
into its output folder instead of gigabytes of weights that DVC would cache a second time. `llmpipe.models.loading`
resolves a pointer wherever it loads a model (:func:`weights_dir`), so the stages after it, the baseline row and
evaluation all read the source through the same loader. The pointer names the source as params name it (a hub
id also by the commit it resolved to), so the folder means the same on another machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from llmpipe.config import ModelParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import atomic_dir, write_json

log = logging.getLogger(__name__)

POINTER = "init_from.json"
"""The file that makes a model folder a pointer to ``model.init_from`` (beside it: the pipeline tokenizer)."""

HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a hub download fetches: config, safetensors weights, tokenizer files; never pickles or code."""


def resolve(init_from: str, revision: str | None = None) -> Path:
    """The local folder of `init_from`: the folder itself, or the hub snapshot in the Hugging Face cache
    (`huggingface_hub.snapshot_download`: downloaded once, read from the cache offline).

    Args:
        init_from: ``model.init_from`` (not ``scratch``).
        revision: ``model.revision`` (a hub branch, tag or commit); None = main.

    Raises:
        UserError: Not a local folder, and not a hub id the hub (or, offline, the cache) has at that revision.
    """
    path = Path(init_from).expanduser()
    if path.is_dir():
        return path
    if path.exists() or init_from.startswith((".", "/", "~")):
        raise UserError(f"model.init_from: {init_from} is not a folder; give a model folder (config.json, "
                        "*.safetensors, tokenizer files) or a hub id such as org/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(init_from, revision=revision, allow_patterns=HUB_FILES))
    except Exception as err:  # noqa: BLE001 — hub, cache and validation errors all mean "cannot get it"
        raise UserError(
            f"model.init_from: {init_from!r} (revision {revision or 'main'}) is no local folder, and the hub or its "
            f"local cache does not have it ({root_cause(err)}); check the path or id, or download it once online"
        ) from None


def source_label(source: Path) -> str | None:
    """The hub commit a snapshot folder holds (its name under ``snapshots/``); None for a local folder."""
    return source.name if source.parent.name == "snapshots" else None


def checked_source(model: ModelParams, tokenizer, trust_remote_code: bool = False) -> Path:
    """The folder of ``model.init_from`` (:func:`resolve`), after :func:`check_architecture` and
    :func:`check_vocabulary` against the pipeline `tokenizer`.

    Raises:
        UserError: See those functions; every message names ``model.init_from``.
    """
    source = resolve(model.init_from, model.revision)
    config = check_architecture(source, trust_remote_code)
    check_vocabulary(source, tokenizer, config.get_text_config().vocab_size)
    return source


def num_parameters(source: Path) -> int:
    """Parameters of the model in `source`, counted on the meta device (no weight is read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source))
    return sum(p.numel() for p in model.parameters())


def check_architecture(source: Path, trust_remote_code: bool = False):
    """Refuse a source transformers cannot load as a causal LM, before any weight is read.

    Returns:
        Its `transformers.PretrainedConfig`.

    Raises:
        UserError: ``config.json`` is missing or names a ``model_type`` transformers does not know, or one with no
            `AutoModelForCausalLM` class; names ``model.init_from``.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if not (source / "config.json").exists():
        raise UserError(f"model.init_from: {source} has no config.json; give a folder saved with save_pretrained")
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"model.init_from: {source}: transformers cannot read this architecture ({root_cause(err)}); "
                        "give a model of a family this transformers version knows") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(config, "auto_map", None):
        raise UserError(f"model.init_from: {source} is a {config.model_type!r} model, which transformers cannot load "
                        "as a causal LM (AutoModelForCausalLM); give a decoder language model")
    return config


def check_vocabulary(source: Path, tokenizer, config_vocab_size: int) -> None:
    """Refuse a pipeline tokenizer that does not encode as `source`'s own does, or that the model cannot embed.

    The pipeline tokenizer is the source's, adopted by the tokenizer stage, with at most a pad token (and role
    tokens when it had no chat template) added after its vocabulary: every token of the source keeps its id.

    Args:
        source: The ``model.init_from`` folder (its own tokenizer files beside the weights).
        tokenizer: The pipeline tokenizer.
        config_vocab_size: The model's embedding rows (``config.json`` ``vocab_size``).

    Raises:
        UserError: The source has no tokenizer, its vocabulary does not fit its own embedding, or a token of it has
            another id (or none) in the pipeline tokenizer; names ``model.init_from`` and the fix.
    """
    from transformers import AutoTokenizer

    if not (source / "tokenizer_config.json").exists():
        raise UserError(f"model.init_from: {source} has no tokenizer (tokenizer_config.json); save the model's "
                        "tokenizer beside it (tokenizer.save_pretrained)")
    own = AutoTokenizer.from_pretrained(source).get_vocab()
    if max(own.values()) >= config_vocab_size:
        raise UserError(f"model.init_from: {source}'s tokenizer has ids up to {max(own.values())} but the model "
                        f"embeds only {config_vocab_size} tokens: the tokenizer saved with it is not the model's")
    ours = tokenizer.get_vocab()
    moved = [t for t, i in own.items() if ours.get(t) != i]
    if moved:
        raise UserError(f"model.init_from: {source}'s vocabulary does not match the pipeline tokenizer "
                        f"({len(moved)} tokens differ, e.g. {moved[0]!r}); rerun the tokenizer stage (dvc repro "
                        "tokenizer), which adopts the model's tokenizer")


def write_pointer(dest: str | Path, model: ModelParams, tokenizer, trust_remote_code: bool = False) -> dict[str, Any]:
    """Write a pointer to ``model.init_from`` (:func:`checked_source`) and the pipeline tokenizer into `dest`,
    atomically.

    Args:
        dest: The stage's model folder (``models/pretrain``, ``models/baseline``).
        model: ``model`` params (`init_from`, `revision`).
        tokenizer: The pipeline tokenizer, saved beside the pointer (later stages check it as they check any
            model's, `llmpipe.models.tokenizer_identity.check_same_tokenizer`).

    Returns:
        The pointer's contents: ``init_from``, ``revision`` (a hub id: the commit it resolved to), ``vocab_size``
        (the embedding rows the loader resizes the model to) and ``files`` (name → bytes of the source's files, so a
        changed source changes the pointer and the run fingerprints that hash it).

    Raises:
        UserError: See :func:`checked_source`.
    """
    source = checked_source(model, tokenizer, trust_remote_code)
    pointer = {"init_from": model.init_from, "revision": source_label(source) or model.revision,
               "vocab_size": len(tokenizer),
               "files": {f.name: f.stat().st_size for f in sorted(source.iterdir()) if f.is_file()}}
    from llmpipe.models.saved_folder import save_tokenizer

    with atomic_dir(dest) as tmp:
        save_tokenizer(tokenizer, tmp)  # the plain chat template, as in every model folder
        write_json(Path(tmp, POINTER), pointer)
    log.info("%s: a pointer to %s (no weights copied)", dest, model.init_from)
    return pointer


def read_pointer(path: str | Path) -> dict[str, Any] | None:
    """The pointer in model folder `path`, or None when it holds its own weights."""
    file = Path(path, POINTER)
    return json.loads(file.read_text()) if file.exists() else None


def weights_dir(path: str | Path) -> Path:
    """The folder that holds the weights of model folder `path`: `path` itself, or a pointer's source.

    Raises:
        UserError: A pointer whose source cannot be found any more (:func:`resolve`).
    """
    pointer = read_pointer(path)
    return Path(path) if pointer is None else resolve(pointer["init_from"], pointer["revision"])


