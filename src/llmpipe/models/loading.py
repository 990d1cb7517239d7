"""Load a model folder — the one way the pipeline does: a saved model, a pointer to ``model.init_from``
(`llmpipe.models.source`), or a peft adapter over its base — and the pipeline's tokenizer, each checked first by
`llmpipe.models.folders` (safe loading: no pickles, no ``auto_map`` code unless trusted); and the model a pipeline
starts from (:func:`init_model`: built from params or ``model.init_from``).

Every loader resolves a pointer, so a stage, the baseline and evaluation read a pointer and a full folder alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmpipe.config import ModelParams
from llmpipe.core.errors import UserError, root_cause
from llmpipe.models.build import attn_kwargs, build_model, fit_embeddings
from llmpipe.models.folders import adapter_base, base_what, check_model_dir, check_tokenizer_configs, is_adapter
from llmpipe.models.source import checked_source, read_pointer, weights_dir
from llmpipe.models.virtual_tokens import fix_virtual_tokens


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
    folder (``adapter_config.json``) loads over its base model (:func:`load_adapter`).

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


def load_adapter(path: Path, what: str, num_labels: int | None, trust_remote_code: bool, **kwargs):
    """An adapter folder over its base model (itself loaded by :func:`load_model`, so adapters chain),
    merged into the weights; a virtual-token adapter (prefix or prompt tuning) cannot merge and stays a
    `peft.PeftModel`. The folder's ``generation_config.json``, where a stage wrote one
    (`llmpipe.models.saved_folder`: the end-of-turn eos), replaces the base's.

    Raises:
        UserError: The folder or its base is refused by the safe loaders or missing.
    """
    from peft import PeftModel

    check_model_dir(path, what, trust_remote_code)
    base = load_model(adapter_base(path), base_what(path), num_labels, trust_remote_code, **kwargs)
    model = PeftModel.from_pretrained(base, path)
    model = fix_virtual_tokens(model) if model.peft_config["default"].is_prompt_learning else model.merge_and_unload()
    if (path / "generation_config.json").exists() and num_labels is None:
        from transformers import GenerationConfig

        target = model.get_base_model() if isinstance(model, PeftModel) else model
        target.generation_config = GenerationConfig.from_pretrained(path)
    return model


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
