"""What a chat template says about turns, read by rendering it: the token that ends an assistant turn, the tokens
each assistant turn adds (assistant masks for any template), and the template without its training-only
``{% generation %}`` tags.

TRL's `assistant_only_loss` needs ``{% generation %}`` markers in the template; most hub templates have none and TRL
keeps marked copies only of the common families'. The masks here need no markers: an assistant turn's tokens are the
text that rendering the conversation up to and including that turn adds after the conversation up to it with the
generation prompt (the assistant header), cut after the template's end-of-turn token (what follows it, a newline
before the next header, is the template's between-turns text, which the model never generates). For the marked
templates TRL ships, these masks equal the markers' (tests/unit/test_chat_turns.py). A template that renders earlier
turns differently once a later one follows (not prefix-preserving) has no such masks: refused, naming the row.
"""

from __future__ import annotations

import re
from typing import Any

PROBE_ANSWER = "Probe answer 7."
"""The assistant content rendered to find what a template appends after an assistant message."""

_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")


def has_markers(template: str | None) -> bool:
    """Whether `template` has ``{% generation %}`` markers (any whitespace-control variant)."""
    return bool(template) and _TAG.search(template) is not None


def require_markers(template: str | None, where: str, stage: str) -> None:
    """Refuse a chat template without ``{% generation %}`` markers for a stage whose loss TRL masks by them.

    Raises:
        UserError: No markers in `template` (the template of the tokenizer in `where`).
    """
    from llmpipe.core.errors import UserError

    if not has_markers(template):
        raise UserError(f"{stage}: the chat template in {where} has no {{% generation %}} markers, which {stage}'s "
                        "answer-only loss (TRL's assistant_only_loss) needs, and TRL keeps no marked copy of it "
                        "(sft's turn-by-turn masks do not reach TRL's image collator); wrap the assistant content "
                        "of the template in {% generation %} … {% endgeneration %}, or leave the stage out of what "
                        "you run (docs/finetune.md)")


def plain_template(template: str | None) -> str | None:
    """`template` without its ``{% generation %}`` / ``{% endgeneration %}`` tags, rendering the same text.

    The tags are a transformers-only Jinja extension that plain Jinja2 (llama.cpp, llama-cpp-python, Ollama's
    importers) rejects. Each becomes the block tag ``{% if true %}`` / ``{% endif %}`` with the same whitespace
    control: a block tag still, so ``trim_blocks`` and ``lstrip_blocks`` (transformers' settings) act on it as they
    did, and harmless text where a template's comment mentions the markers (a comment there would close it).
    """
    if not template:
        return template
    return _TAG.sub(lambda m: "{%" + m.group(1) + (" endif " if m.group(2) else " if true ") + m.group(3) + "%}",
                    template)  # fmt: skip


def _special_tokens(tokenizer) -> list[str]:
    """Every special token's text: the named ones and the added tokens marked special."""
    added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special]
    return sorted({*tokenizer.all_special_tokens, *added}, key=len, reverse=True)


def _render(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant message's content, or None.

    ``<|im_end|>`` for ChatML (Qwen), ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma, the eos for llmpipe's
    own template; None for a template without a chat template, or one that ends a turn with plain text only (the
    model then has no token to stop on).
    """
    if not tokenizer.chat_template:
        return None
    text = _render(tokenizer, [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": PROBE_ANSWER}])
    if PROBE_ANSWER not in text:
        return None
    suffix = text[text.rindex(PROBE_ANSWER) + len(PROBE_ANSWER):]
    found = [(suffix.find(t), t) for t in _special_tokens(tokenizer) if t in suffix]
    return min(found, key=lambda f: f[0])[1] if found else None  # longest first among ties: sorted by length


def _assistant_spans(tokenizer, messages: list[dict[str, Any]], text: str, eot: str | None) -> list[tuple[int, int]]:
    """The character spans of `text` (the whole conversation rendered) that its assistant turns add.

    Raises:
        ValueError: The template renders an earlier part of the conversation differently once more follows.
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1])
        added = upto[len(prompt):]
        end = len(prompt) + (added.rindex(eot) + len(eot) if eot and eot in added else len(added))
        # Up to the turn's end only: a template may close the whole conversation after its last turn (Phi-3's eos).
        if not (upto.startswith(prompt) and text[:end] == upto[:end]):
            raise ValueError(f"the chat template renders the conversation before message {i + 1} differently once "
                             "that message follows (it is not prefix-preserving)")  # fmt: skip
        spans.append((len(prompt), end))
    return spans


def rendered_masks(tokenizer, messages: list[dict[str, Any]]) -> dict[str, list[int]]:
    """`messages` tokenised by the chat template, with the assistant mask computed by rendering (module docstring).

    A token is in the mask when its characters overlap an assistant span: transformers' rule for the spans of
    ``{% generation %}`` markers, so the two masks agree wherever the spans do.

    Returns:
        ``input_ids`` and ``assistant_masks`` (1 on the assistant's tokens), lists of the same length.

    Raises:
        ValueError: The template is not prefix-preserving on `messages` (see :func:`_assistant_spans`).
    """
    text = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text, end_of_turn(tokenizer))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask, k = [], 0
    for start, end in encoded["offset_mapping"]:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(int(k < len(spans) and end > spans[k][0]))
    return {"input_ids": list(encoded["input_ids"]), "assistant_masks": mask}


def assistant_masks(tokenizer, messages: list[dict[str, Any]]) -> dict[str, list[int]]:
    """`messages` tokenised with their assistant mask: the template's ``{% generation %}`` markers where it has
    them (transformers' masks), else :func:`rendered_masks`.

    Raises:
        ValueError: No markers, and the template is not prefix-preserving on `messages`.
    """
    if has_markers(tokenizer.chat_template):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)  # fmt: skip
        return {"input_ids": list(out["input_ids"]), "assistant_masks": list(out["assistant_masks"])}
    return rendered_masks(tokenizer, messages)
