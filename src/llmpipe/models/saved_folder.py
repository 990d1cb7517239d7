"""What a saved model folder tells the tools that load it (transformers, vLLM, llama.cpp's converter, Ollama's
importers): generate with a KV cache, render chats with a plain Jinja2 template, and stop at the end of a turn.

Every stage's folder is finished here inside its temporary folder, before the rename that publishes it:

- ``config.json`` says ``"use_cache": true``. Training turns the cache off in memory (gradient checkpointing), and
  ``save_pretrained`` writes the config as it is, so every user of the folder would generate without a cache.
- The tokenizer (or processor) is saved with its chat template stripped of ``{% generation %}`` tags
  (`llmpipe.data.chat_turns.plain_template`): a transformers-only tag that plain Jinja2 rejects. The marked copy
  stays in ``paths.tokenizer``, where training reads it.
- A chat stage's folder (sft and every stage after it) names the template's end-of-turn token as an eos when it is
  not the tokenizer's eos (a base model whose eos is ``<|endoftext|>`` with a ChatML template ending turns with
  ``<|im_end|>``), as Qwen's instruct models do: ``generation_config.json`` ``eos_token_id`` lists both (end of turn
  first), ``config.json`` ``eos_token_id`` is the end of turn, and the tokenizer's ``eos_token`` too (unless the
  template writes ``eos_token`` itself, which the change would alter). Otherwise greedy generation runs to
  ``max_new_tokens`` after every answer. The pipeline tokenizer is not changed: pretraining still ends documents
  with its eos, and `llmpipe.models.tokenizer_identity` counts the two as the same tokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmpipe.data.chat_turns import end_of_turn, plain_template

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"


def _text_tokenizer(tokenizer):
    """The text tokenizer of a tokenizer or of a processor (its ``tokenizer``)."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def turn_eos(tokenizer) -> str | None:
    """The end-of-turn token a chat stage's saved tokenizer takes as its eos: the template's
    (`llmpipe.data.chat_turns.end_of_turn`) when it differs from the eos and swapping it in renders chats alike;
    else None."""
    tok = _text_tokenizer(tokenizer)
    eot = end_of_turn(tok)
    if eot is None or eot == tok.eos_token:
        return None
    chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    with saved_as(tok, eot):
        swapped = tok.apply_chat_template(chat, tokenize=False)
    return eot if swapped == tok.apply_chat_template(chat, tokenize=False) else None


@contextmanager
def saved_as(tokenizer, eos_token: str | None = None) -> Iterator[Any]:
    """`tokenizer` (or a processor) with its plain chat template, and `eos_token` as eos when given, restored after.

    Yields:
        `tokenizer` itself, changed until the block ends.
    """
    holders = [o for o in {id(o): o for o in (tokenizer, _text_tokenizer(tokenizer))}.values()
               if getattr(o, "chat_template", None)]  # fmt: skip
    templates = [o.chat_template for o in holders]
    tok = _text_tokenizer(tokenizer)
    eos = tok.eos_token
    try:
        for holder, template in zip(holders, templates, strict=True):
            holder.chat_template = plain_template(template)
        if eos_token is not None:
            tok.eos_token = eos_token
        yield tokenizer
    finally:
        for holder, template in zip(holders, templates, strict=True):
            holder.chat_template = template
        tok.eos_token = eos


def save_tokenizer(tokenizer, dest: str | Path, eos_token: str | None = None) -> None:
    """``tokenizer.save_pretrained(dest)`` with the plain chat template (and `eos_token` as eos when given)."""
    with saved_as(tokenizer, eos_token) as tok:
        tok.save_pretrained(dest)


def _update_json(path: Path, update) -> None:
    data = json.loads(path.read_text())
    update(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def finish(folder: str | Path, tokenizer, chat: bool, what: str = "") -> None:
    """Finish a model folder written by ``save_pretrained`` (the module docstring): save `tokenizer` there and fix
    ``config.json`` and ``generation_config.json``.

    Args:
        folder: The (temporary) model folder: a full model, a merged one with ``adapter/``, or an adapter alone
            (no ``config.json``: the loader applies its ``generation_config.json`` over the base's,
            `llmpipe.models.loading.load_adapter`).
        tokenizer: The tokenizer or processor saved beside the model.
        chat: A chat stage (sft and after): name the end-of-turn token as an eos.
        what: The folder as the log line names it (``models/sft``).
    """
    folder = Path(folder)
    tok = _text_tokenizer(tokenizer)
    eot = end_of_turn(tok) if chat else None
    eot = None if eot == tok.eos_token else eot
    eot_id = tok.convert_tokens_to_ids(eot) if eot else None
    eos_token = turn_eos(tokenizer) if eot else None
    save_tokenizer(tokenizer, folder, eos_token)

    def config(data: dict[str, Any]) -> None:
        for part in (data, data.get("text_config")):
            if isinstance(part, dict):
                part["use_cache"] = True
                if eot_id is not None:
                    part["eos_token_id"] = eot_id

    if (folder / "config.json").exists():
        _update_json(folder / "config.json", config)
    if eot_id is None:
        return
    ids = [eot_id, tok.eos_token_id]
    if not (folder / GENERATION_CONFIG).exists() and not (folder / "config.json").exists():  # an adapter alone
        (folder / GENERATION_CONFIG).write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                            "pad_token_id": tok.pad_token_id}) + "\n")  # fmt: skip
    if (folder / GENERATION_CONFIG).exists():
        _update_json(folder / GENERATION_CONFIG, lambda data: data.update(eos_token_id=ids))
    log.info("%s: %r ends an assistant turn in the chat template but the eos is %r: the folder names it as an eos, so "
             "generation stops at the end of a turn (generation_config.json eos_token_id %s, config.json eos_token_id "
             "%d, tokenizer eos_token %r)", what or folder, eot, tok.eos_token, ids, eot_id, eos_token or tok.eos_token)
