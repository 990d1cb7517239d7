"""Held-out accuracy of a vision-language model on image questions, by question type.

Each question is scored as multiple choice over the answers its type takes in the scored split (closed-set
answers, as VQA's multiple-choice setting): the model's choice is the candidate with the highest summed
log-probability of its answer tokens (answer and end of turn, the chat template's assistant mask), given the
image and question. Chance is one over the number of candidates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from llmpipe.data.image_records import typed_content


def _answer(row: dict[str, Any]) -> str:
    return next(m["content"] for m in reversed(row["messages"]) if m["role"] == "assistant")


def candidates_by_type(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per question type (a record's ``type``, else ``all``), its distinct answers, sorted."""
    out: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        out[row.get("type", "all")].add(_answer(row))
    return {kind: sorted(answers) for kind, answers in out.items()}


def _conversations(row: dict[str, Any], folder: Path, answers: list[str]) -> list[list[dict[str, Any]]]:
    """One conversation per candidate: the record's turns up to its last answer, with each candidate as the answer
    and the images in their parts."""
    from PIL import Image
    from trl.data_utils import prepare_multimodal_messages

    images = [Image.open(folder / p).convert("RGB") for p in row["images"]]
    last = max(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    turns = [{**m, "content": typed_content(m["content"])} for m in row["messages"][:last]]
    return [prepare_multimodal_messages([*turns, {"role": "assistant", "content": [{"type": "text", "text": a}]}],
                                        images) for a in answers]  # fmt: skip


def answer_logprobs(model, processor, conversations: list[list[dict[str, Any]]]):
    """Summed log-probability of each conversation's assistant tokens.

    Returns:
        A float tensor of shape ``(N,)`` for N conversations, in nats.
    """
    import torch

    batch = processor.apply_chat_template(conversations, tokenize=True, return_dict=True, return_tensors="pt",
                                          return_assistant_tokens_mask=True,
                                          processor_kwargs={"padding": True})  # fmt: skip
    mask = batch.pop("assistant_masks")[:, 1:].bool()  # (N, T-1): the tokens predicted, answer only
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1].float()  # (N, T-1, V)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]  # (N, T-1)
    return (logp * mask).sum(-1)


def accuracy_by_type(model, processor, rows: list[dict[str, Any]], folder: Path) -> dict[str, float]:
    """Multiple-choice accuracy of `model` on `rows` (records of `llmpipe.data.image_records`, images under `folder`).

    Returns:
        Per question type ``t``: ``accuracy_<t>``, ``accuracy_<t>_se`` (binomial standard error
        ``sqrt(p(1-p)/n)``), ``chance_<t>`` and ``num_<t>``; and ``accuracy`` over all rows.
    """
    model.eval()
    candidates = candidates_by_type(rows)
    correct: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        kind = row.get("type", "all")
        answers = candidates[kind]
        scores = answer_logprobs(model, processor, _conversations(row, folder, answers))
        correct[kind].append(answers[int(scores.argmax())] == _answer(row))
    out: dict[str, float] = {}
    for kind, hits in sorted(correct.items()):
        p = sum(hits) / len(hits)
        out |= {f"accuracy_{kind}": round(p, 4), f"accuracy_{kind}_se": round(math.sqrt(p * (1 - p) / len(hits)), 4),
                f"chance_{kind}": round(1 / len(candidates[kind]), 4), f"num_{kind}": len(hits)}  # fmt: skip
    out["accuracy"] = round(sum(sum(h) for h in correct.values()) / len(rows), 4)
    return out
