"""Build a transformers causal LM from ``model:`` params, or load a saved one (or ``model.init_from``); save models as
standard Hugging Face directories (safetensors + config + tokenizer with its chat template).

A model folder may be a pointer to ``model.init_from`` instead (`llmpipe.model_source`): every loader here
resolves it, so a stage, the baseline and evaluation read a pointer and a full folder alike.

Safe loading: every model and tokenizer folder the pipeline reads goes through :func:`load_model` /
:func:`load_tokenizer` (or :func:`load_pretrained`), which refuse, unless the caller trusts the folder
(``llm-train --trust-remote-code``, passed down as ``trust_remote_code``), what loading could execute:

- weights only as pickles (:data:`PICKLE_SUFFIXES`), since unpickling can run code — otherwise weights are
  read with ``use_safetensors=True``; a trusted ``pytorch_model.bin`` still goes through transformers'
  ``torch.load(weights_only=True)``;
- an ``auto_map`` in ``config.json`` / ``tokenizer_config.json``, which points transformers at a ``.py``
  file in the folder to import.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from llmpipe.adapter_folders import check_adapter, is_adapter, load_adapter
from llmpipe.config import ModelParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import atomic_dir, safetensors_problem
from llmpipe.model_source import attn_kwargs, checked_source, read_pointer, weights_dir

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Weight files `torch.load` would unpickle: loaded only from a trusted folder."""

TRUST_FLAG = "--trust-remote-code"
"""The `llm-train` flag that sets ``trust_remote_code`` (named in refusals)."""


def build_model(cfg: ModelParams, tokenizer):
    """A randomly initialised `LlamaForCausalLM` (RoPE, SwiGLU, RMSNorm; GQA via `num_key_value_heads`).

    Args:
        cfg: Architecture and `init_seed` (same seed → same weights).
        tokenizer: Gives the vocabulary size and the bos/eos/pad ids.

    Returns:
        The model in fp32, on CPU.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        initializer_range=cfg.initializer_range,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **attn_kwargs(cfg.attn_implementation),
    )
    torch.manual_seed(cfg.init_seed)
    return LlamaForCausalLM(config)


def init_model(cfg: ModelParams, tokenizer, trust_remote_code: bool = False):
    """The model the pipeline starts from: :func:`build_model` for ``init_from: scratch``, else the
    ``model.init_from`` model, checked (architecture, vocabulary) and fitted to the pipeline tokenizer.

    Args:
        cfg: ``model`` params.
        tokenizer: The pipeline tokenizer (for a loaded model: the one the tokenizer stage adopted from it).
        trust_remote_code: Let pickled weights and ``auto_map`` code through.

    Raises:
        UserError: The source cannot be found, transformers cannot load its architecture, or its vocabulary does
            not match the tokenizer (each names ``model.init_from``); ``model.attn_implementation`` is unavailable.
    """
    from transformers import AutoModelForCausalLM

    if cfg.scratch:
        return build_model(cfg, tokenizer)
    source = checked_source(cfg, tokenizer, trust_remote_code)
    model = load_pretrained(AutoModelForCausalLM, source, "model.init_from: give a saved model folder",
                            trust_remote_code, **attn_kwargs(cfg.attn_implementation))
    return fit_embeddings(model, len(tokenizer))


def fit_embeddings(model, num_tokens: int):
    """`model` with at least `num_tokens` embedding rows: rows for the tokens the tokenizer stage added to an adopted
    tokenizer (a pad token, role tokens), initialised at the mean of the others (transformers' `mean_resizing`)."""
    if model.get_input_embeddings().num_embeddings < num_tokens:
        log.info("resizing the embedding from %d to %d rows for the tokens the pipeline tokenizer adds",
                 model.get_input_embeddings().num_embeddings, num_tokens)
        model.resize_token_embeddings(num_tokens, mean_resizing=True)
    return model


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
    from llmpipe.adapter_folders import ADAPTER_CONFIG

    if (path / ADAPTER_CONFIG).exists():
        raise UserError(
            f"{path}: holds a model's weights (config.json) and a peft {ADAPTER_CONFIG} beside them, so loading it "
            "would apply the adapter over those weights: twice, if they are the merged model. If the weights are merged, "
            f"move {ADAPTER_CONFIG} and adapter_model.safetensors into {path / 'adapter'}/ (llmpipe's layout) or delete "
            "them; if the folder is the adapter, keep only its adapter files and the tokenizer (its "
            "base_model_name_or_path names the base)"
        )


def pretrained_kwargs(trust_remote_code: bool) -> dict[str, Any]:
    """Keywords of every model `from_pretrained`: safetensors only unless trusted; pickles never unrestricted."""
    return {
        "use_safetensors": None if trust_remote_code else True,
        "weights_only": True,
        "trust_remote_code": trust_remote_code,
    }


def load_pretrained(auto_class, path: str | Path, what: str, trust_remote_code: bool = False, **kwargs):
    """``auto_class.from_pretrained(path)`` after :func:`check_model_dir`, with :func:`pretrained_kwargs`.

    Args:
        auto_class: A transformers auto class, e.g. `AutoModelForSequenceClassification`.
        path: A `save_pretrained` directory, or a pointer to ``model.init_from`` (loaded from there, its embedding
            resized to the pointer's ``vocab_size``).
        what: The fix to name when it is missing.
        trust_remote_code: Let pickled weights and ``auto_map`` code through.
        **kwargs: More `from_pretrained` keywords (e.g. ``num_labels``, ``attn_implementation``).

    Raises:
        UserError: The folder fails :func:`check_model_dir`, or transformers cannot load it (one line).
    """
    check_model_dir(path, what, trust_remote_code)
    pointer, source = read_pointer(path), weights_dir(path)
    try:
        model = auto_class.from_pretrained(source, **pretrained_kwargs(trust_remote_code), **kwargs)
    except (OSError, ValueError) as err:  # transformers' errors for folders it cannot read
        raise UserError(f"{path}: cannot load the model: {root_cause(err)}") from None
    return model if pointer is None else fit_embeddings(model, pointer["vocab_size"])


def load_model(path: str | Path, what: str, num_labels: int | None = None, trust_remote_code: bool = False,
               attn_implementation: str | None = None, **kwargs):
    """Load a saved model from a directory: a causal LM, or with `num_labels` a sequence classifier; a peft adapter
    folder (``adapter_config.json``) loads over its base model (`llmpipe.adapter_folders`).

    Args:
        path: A `save_pretrained` directory, a pointer to ``model.init_from`` (:func:`load_pretrained`), or an
            adapter's.
        what: The fix to name when it is missing, e.g. "run the sft stage first (dvc repro sft)".
        num_labels: Load `AutoModelForSequenceClassification` with this many outputs (1 for a reward model);
            from a causal LM the score head is new and initialised from the torch RNG, so seed first.
        trust_remote_code: Let pickled weights and ``auto_map`` code through (``--trust-remote-code``).
        attn_implementation: ``model.attn_implementation``; None = transformers' default.
        **kwargs: More `from_pretrained` keywords (QLoRA's ``quantization_config``).

    Raises:
        UserError: The directory is missing (names the stage that makes it), or is refused or unreadable
            (see :func:`load_pretrained`), or the attention implementation is unavailable here.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if attn_implementation:
        kwargs |= attn_kwargs(attn_implementation)
    if is_adapter(path):
        return load_adapter(Path(path), what, num_labels, trust_remote_code, **kwargs)
    if num_labels is None:
        return load_pretrained(AutoModelForCausalLM, path, what, trust_remote_code, **kwargs)
    return load_pretrained(AutoModelForSequenceClassification, path, what, trust_remote_code, num_labels=num_labels,
                           **kwargs)  # fmt: skip


def check_tokenizer_configs(path: Path, trust_remote_code: bool) -> None:
    """Refuse a tokenizer folder whose ``tokenizer_config.json`` or ``config.json`` maps to code, unless trusted.

    Raises:
        UserError: A config is broken, or (untrusted) has an ``auto_map``.
    """
    for name in ("tokenizer_config.json", "config.json"):  # AutoTokenizer reads the auto_map of either
        if (path / name).exists():
            _refuse_auto_map(path / name, trust_remote_code)


def load_tokenizer(
    path: str | Path,
    trust_remote_code: bool = False,
    what: str = "run the tokenizer stage first (dvc repro tokenizer)",
    check_pad: bool = True,
):
    """Load the pipeline's tokenizer (or a model folder's), checked for a pad token distinct from eos.

    Args:
        path: A tokenizer `save_pretrained` directory.
        trust_remote_code: Let an ``auto_map`` in ``tokenizer_config.json`` through (``--trust-remote-code``).
        what: The fix to name when it is missing.
        check_pad: Apply :func:`check_pad_token` (training); off for generation, which never trains on padding.

    Raises:
        UserError: The tokenizer directory is missing, its config is broken or maps to code (untrusted),
            transformers cannot load it, or (`check_pad`) its pad token is missing or is the eos token
            (:func:`check_pad_token`).
    """
    from transformers import AutoTokenizer

    path = Path(path)
    config = path / "tokenizer_config.json"
    if not config.exists():
        raise UserError(f"{path}: no tokenizer there; {what}")
    check_tokenizer_configs(path, trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot load the tokenizer: {root_cause(err)}") from None
    if check_pad:
        check_pad_token(tokenizer, path)
    return tokenizer


def save_model(model, tokenizer, final: str | Path, state_dict=None) -> None:
    """Save model (safetensors) and tokenizer to `final` atomically (temp dir, then rename), as other tools load it
    (`llmpipe.saved_folder.finish`).

    Args:
        model: The (unwrapped) model; its config and class name go into config.json.
        tokenizer: Saved beside it.
        final: The model directory.
        state_dict: Weights to save instead of ``model.state_dict()`` (a consolidated one under sharding).
    """
    from llmpipe.saved_folder import finish

    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        finish(tmp, tokenizer, chat=False)  # use_cache true, the plain chat template


def count_parameters(model, trainable_only: bool = False) -> int:
    """Number of parameters (tied weights counted once), or of those that train; a peft model's as peft counts
    them (its `get_nb_trainable_parameters`: 4-bit weights at their full count)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        trainable, total = model.get_nb_trainable_parameters()
        return trainable if trainable_only else total
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def check_pad_token(tokenizer, path: str | Path) -> None:
    """Refuse a tokenizer with no pad token, or whose pad token is its eos token.

    With pad == eos, collators that mask padding by id (transformers' `DataCollatorForLanguageModeling`,
    generation padding) mask every eos too: the model never sees the end of a turn as a target and never
    learns to stop, and nothing fails.

    Args:
        tokenizer: A loaded tokenizer.
        path: Where it was loaded from (named in the message).

    Raises:
        UserError: No pad token, no eos token, or pad id == eos id; names `path` and the fix.
    """
    fix = ("give it a distinct pad token: rebuild it with the tokenizer stage (dvc repro tokenizer), which adds "
           "'<pad>' to a tokenizer that has none or shares it with eos")
    if tokenizer.eos_token_id is None:
        raise UserError(f"{path}: the tokenizer has no eos token; training needs one to end each sequence; "
                        "rebuild it with the tokenizer stage (dvc repro tokenizer)")
    if tokenizer.pad_token_id is None:
        raise UserError(f"{path}: the tokenizer has no pad token, so batches cannot be padded; {fix}")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise UserError(
            f"{path}: the pad token is the eos token ({tokenizer.eos_token!r}, id {tokenizer.eos_token_id}): padding "
            f"is masked out of the labels, so the eos would be too and the model would never learn to stop; {fix}"
        )
