"""Whether a model folder was trained with the pipeline's tokenizer: short hashes of what makes two tokenizers
encode alike, and the check every stage runs on its input model."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from llmpipe.core.errors import UserError
from llmpipe.models.folders import is_adapter, model_config

log = logging.getLogger(__name__)

PROBE = "def f(x):\n    return x  # héllo, wörld 🙂 \t<s> </s>"
"""Text encoded by both tokenizers of :func:`check_same_tokenizer`: code, non-ASCII and special-token text."""


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def tokenizer_digest(tokenizer) -> dict[str, str]:
    """Short hashes of what makes two tokenizers encode alike, one per part.

    Returns:
        ``vocab`` (the backend's model — vocabulary and merges — normalizer, pre-tokenizer and added tokens;
        for a tokenizer without a `tokenizers` backend, its vocabulary), ``special_tokens`` (bos/eos/pad/unk
        text and ids), ``chat_template``, and ``probe``: the ids of :data:`PROBE` encoded plain and as a
        user + assistant chat. The chat template is hashed without ``{% generation %}`` tags, which render nothing.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        vocab = {k: state.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    else:
        vocab = sorted(tokenizer.get_vocab().items())
    special = {f"{k}_token": [getattr(tokenizer, f"{k}_token"), getattr(tokenizer, f"{k}_token_id")]
               for k in ("bos", "eos", "pad", "unk")}
    probe: list[Any] = [tokenizer(PROBE, add_special_tokens=False)["input_ids"]]
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": PROBE}, {"role": "assistant", "content": PROBE}]
        probe.append(tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"])
    from llmpipe.data.chat_turns import plain_template

    # the plain template: model folders are saved without the training-only {% generation %} tags (saved_folder)
    return {"vocab": _sha(vocab), "special_tokens": _sha(special),
            "chat_template": _sha(plain_template(tokenizer.chat_template)), "probe": _sha(probe)}


def check_same_tokenizer(model_dir: str | Path, tokenizer, tokenizer_dir: str | Path, fix: str | None = None,
                         require_tokenizer: bool = False) -> None:
    """Refuse a stage's input model whose tokenizer or chat template is not the pipeline's.

    Every stage saves its tokenizer beside its model (`llmpipe.models.save_model`), so a model directory says which
    tokenizer it was trained with. A model from before a tokenizer change reads the same ids as other text
    (or renders chats in another format) and trains on without an error. A directory without tokenizer files
    is checked only for an embedding large enough for the pipeline's vocabulary.

    Args:
        model_dir: The input model directory (e.g. ``models/sft``).
        tokenizer: The pipeline tokenizer, loaded from `tokenizer_dir`.
        tokenizer_dir: ``paths.tokenizer``.
        fix: What the messages tell to do (default: rerun the stages after the tokenizer, or point
            ``paths.tokenizer`` at the model's; a distillation teacher names ``sft.distill.teacher`` instead).
        require_tokenizer: Refuse a directory without tokenizer files rather than check only its embedding size.

    Raises:
        UserError: The two differ (the message names both paths, the parts that differ — vocab,
            special_tokens, chat_template, probe — and the fix), the model's ``vocab_size`` is smaller than
            the tokenizer's, or (`require_tokenizer`) it has no tokenizer files.
    """
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    fix = fix or (f"rerun the stages after the tokenizer (dvc repro), or point paths.tokenizer at the tokenizer "
                  f"{model_dir} was trained with")
    known = (model_dir / "config.json").exists() or is_adapter(model_dir)
    vocab_size = model_config(model_dir).get("vocab_size") if known else None
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise UserError(f"{model_dir} has {vocab_size} embedding rows but {tokenizer_dir} has {len(tokenizer)} "
                        f"tokens: the model was trained with another tokenizer; {fix}")
    if not (model_dir / "tokenizer_config.json").exists() and require_tokenizer:
        raise UserError(f"{model_dir}: no tokenizer saved beside the model (tokenizer_config.json), so whether it "
                        f"reads token ids as {tokenizer_dir} does cannot be checked; {fix}")
    if not (model_dir / "tokenizer_config.json").exists():
        log.warning("%s: no tokenizer saved beside the model; cannot check it matches %s", model_dir, tokenizer_dir)
        return
    own = tokenizer_digest(AutoTokenizer.from_pretrained(model_dir))
    ours = tokenizer_digest(tokenizer)
    differ = [k for k in ours if own[k] != ours[k]]
    if differ == ["special_tokens"]:  # a chat stage's folder names the end-of-turn token as its eos (saved_folder)
        from llmpipe.models.saved_folder import saved_as, turn_eos

        if (eot := turn_eos(tokenizer)) is not None:
            with saved_as(tokenizer, eot):
                differ = [k for k, v in tokenizer_digest(tokenizer).items() if own[k] != v]
    if differ:
        raise UserError(f"{model_dir} and {tokenizer_dir} are different tokenizers (they differ in: "
                        f"{', '.join(differ)}): {model_dir} was trained with another tokenizer or chat template; {fix}")
