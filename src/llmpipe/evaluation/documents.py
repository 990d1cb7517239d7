"""How a prepared evaluation row becomes an lm-eval document of one of llmpipe's tasks (:mod:`llmpipe.evaluation.tasks`),
rendered with the evaluated model's own tokenizer: its chat template and its eos token.

Text from the data stays text where a tokenizer would read special-token text in it as the special token
(:mod:`llmpipe.data.special`).
"""

from __future__ import annotations

from typing import Any

from llmpipe.data.special import escape, escapes

Row = dict[str, Any]


def eos_text(tokenizer) -> str:
    """The eos token's text, or "" for a tokenizer without one."""
    return tokenizer.eos_token or ""


def _chat_prompt(messages: list[dict[str, str]], tokenizer) -> str:
    """The prompt turns in the model's chat format, ending where the assistant's answer starts."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _content(messages: list[dict[str, str]]) -> str:
    return "".join(m["content"] for m in messages)


def _text(text: str, tokenizer) -> str:
    """Data text as lm-eval must get it so that special-token text in it stays text (`llmpipe.data.special`), for a
    tokenizer that deletes the escape; other tokenizers get it unchanged."""
    return escape(text, tokenizer.all_special_tokens) if escapes(tokenizer) else text


def _prompt_and_response(row: Row) -> tuple[list[dict[str, str]], str]:
    """Split an SFT chat row into its prompt turns and the final assistant turn's text."""
    *prompt, last = row["messages"]
    if last["role"] != "assistant" or not prompt:
        raise ValueError("the last message must be an assistant turn, after at least one prompt turn")
    return prompt, last["content"]


def render_perplexity(row: Row, tokenizer) -> Row:
    """``{"text"}``: the document, scored whole (rolling windows of the context length)."""
    return {"text": _text(row["text"], tokenizer)}


def render_signature_mc(row: Row, tokenizer) -> Row:
    """``{"context", "choices": [def line × 4], "label"}``; the context is the docstring as Python source (in
    triple quotes, then a newline)."""
    choices = [_text(c, tokenizer) for c in row["choices"]]
    return {"context": _text(f'"""{row["query"]}"""\n', tokenizer), "choices": choices, "label": int(row["label"])}


def _sft_document(context: str, continuation: str, response: str) -> Row:
    return {"context": context, "continuation": continuation, "num_bytes": len(response.encode("utf-8"))}


def render_sft_chat(row: Row, tokenizer) -> Row:
    """``{"context": chat prompt, "continuation": response + eos, "num_bytes": UTF-8 bytes of the response}``."""
    prompt, response = _prompt_and_response(row)
    return _sft_document(_chat_prompt(prompt, tokenizer), _text(response, tokenizer) + eos_text(tokenizer), response)


def render_sft_plain(row: Row, tokenizer) -> Row:
    """``{"context": prompt + "\\n", "continuation": response, "num_bytes"}``: no chat tokens, no eos."""
    prompt, response = _prompt_and_response(row)
    return _sft_document(_text(_content(prompt), tokenizer) + "\n", _text(response, tokenizer), response)


def render_generation(row: Row, tokenizer) -> Row:
    """``{"context": chat prompt, "prompt": def line(s) + docstring, "name": requested function}``."""
    prompt, _ = _prompt_and_response(row)
    return {"context": _chat_prompt(prompt, tokenizer), "prompt": _content(prompt), "name": row["name"]}


def render_answers(row: Row, tokenizer) -> Row:
    """``{"context": chat prompt, "prompt": the prompt turns' text, "reference": the held-out response}``."""
    prompt, response = _prompt_and_response(row)
    return {"context": _chat_prompt(prompt, tokenizer), "prompt": _content(prompt), "reference": response}


def render_preference(row: Row, tokenizer) -> Row:
    """``{"context": chat prompt, "choices": [chosen + eos, rejected + eos], "label": 0, "corruption"}``
    (`corruption` is None for data without that column)."""
    eos = eos_text(tokenizer)
    return {
        "context": _chat_prompt(row["prompt"], tokenizer),
        "choices": [_text(_content(row[key]), tokenizer) + eos for key in ("chosen", "rejected")],
        "label": 0,
        "corruption": row.get("corruption"),
    }


def render_task(row: Row, tokenizer) -> Row:
    """``{"context": chat prompt, "prompt", "name": entry point, "tests"}`` of an executable task (`data/eval/tasks.jsonl`):
    the prompt as the one user turn, as the task's SFT row has it."""
    return {"context": _chat_prompt([{"role": "user", "content": row["prompt"]}], tokenizer), "prompt": row["prompt"],
            "name": row["entry_point"], "tests": list(row["tests"])}
