"""Special-token text in data stays text (`llmpipe.data.special`): typed in a chat message it is not a role switch,
while the chat template's own markers stay single ids — through TRL's path (tokenized with assistant masks), the
string path (rendered, then tokenized: PPO prompts, lm-eval) and a saved and reloaded tokenizer."""

from __future__ import annotations

import pytest

from llmpipe.data.special import SENTINEL, escape, escapes
from llmpipe.evaluation.documents import render_perplexity, render_sft_chat
from llmpipe.models import load_tokenizer
from llmpipe.stages.tokenizer import train_bpe

CORPUS = ["def f(x):\n    return x + 1\n" * 20, "what does the user mean by this marker, assistant? <s> </s>\n" * 20]
CHAT = [
    {"role": "user", "content": "why does <|user|> end with </s>?"},
    {"role": "assistant", "content": "<|assistant|> and <s> are text here"},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The pipeline's BPE (its chat template and normalizer), saved and reloaded as every stage loads it."""
    folder = tmp_path_factory.mktemp("tok")
    train_bpe(iter(CORPUS), vocab_size=300, min_frequency=2, model_max_length=256).save_pretrained(folder)
    return load_tokenizer(folder)


def control_ids(tok, ids: list[int]) -> list[str]:
    special = set(tok.all_special_ids)
    return [tok.convert_ids_to_tokens(i) for i in ids if i in special]


def test_a_message_with_special_token_text_is_not_a_role_switch(tok):
    out = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert control_ids(tok, ids) == ["<s>", "<|user|>", "<|assistant|>", "</s>"], "only the template's markers"
    assert tok.decode(ids) == "<s><|user|>why does <|user|> end with </s>?\n<|assistant|><|assistant|> and <s> are " \
                              "text here</s>\n"
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == CHAT[1]["content"] + "</s>", "the assistant mask covers the answer and its eos"


def test_the_rendered_string_tokenizes_to_the_same_ids(tok):
    """PPO renders its prompts, and lm-eval its contexts, to a string before tokenizing."""
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    direct = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert tok(rendered, add_special_tokens=False)["input_ids"] == direct


def test_the_template_markers_stay_single_ids(tok):
    ids = tok.apply_chat_template(CHAT[:1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|user|>")]
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")


def test_escaped_text_is_the_plain_characters_and_lm_eval_documents_get_it(tok):
    text = "x = '(?P<s>a)' </s> <|user|> <pad>"
    assert escapes(tok) and SENTINEL not in text
    plain = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert tok(escape(text, tok.all_special_tokens), add_special_tokens=False)["input_ids"] == plain
    assert tok(render_perplexity({"text": text}, tok)["text"], add_special_tokens=False)["input_ids"] == plain
    doc = render_sft_chat({"messages": CHAT}, tok)
    continuation = tok(doc["continuation"], add_special_tokens=False)["input_ids"]
    assert control_ids(tok, continuation) == ["</s>"] and doc["num_bytes"] == len(CHAT[1]["content"].encode())
