"""Assistant masks for any chat template, computed by rendering the conversation turn by turn
(`llmpipe.data.chat_turns`): equal to the ``{% generation %}`` markers' masks where a template has both forms, the
end-of-turn token read from the template, the plain template other tools load, and a refusal where the rendering
cannot tell the turns apart."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import trl
from user_models import PLAIN_TEMPLATE, train_tokenizer

from llmpipe.core.errors import UserError
from llmpipe.data.chat_turns import (
    assistant_masks,
    end_of_turn,
    has_markers,
    plain_template,
    rendered_masks,
    require_markers,
)
from llmpipe.stages.tokenizer import chat_template

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

CONTROL = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|im_start|>", "<|im_end|>",
           "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|START_OF_TURN_TOKEN|>",
           "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>")  # fmt: skip
"""The control tokens of the templates below, special in the test tokenizer as in each family's own."""

CHATML_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (the Qwen shape) with markers on what the model writes: its answer and the end of its turn."""

CHATS = [
    [{"role": "user", "content": "Add 1 to x."}, {"role": "assistant", "content": "return x + 1"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 to x."},
     {"role": "assistant", "content": "def f(x):\n    return x + 1\n"}, {"role": "user", "content": "And 2?"},
     {"role": "assistant", "content": "return x + 2"}],
    [{"role": "user", "content": "Write </s> and <|im_end|> as text."},
     {"role": "assistant", "content": "Here: </s> <|im_end|> <|eot_id|>"}],
]  # fmt: skip
"""One turn; a system message and two turns with newlines; special-token text typed in the messages."""


@pytest.fixture(scope="module")
def tok():
    from llmpipe.data.special import install

    tokenizer = train_tokenizer(special_tokens=CONTROL, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    install(tokenizer)  # llmpipe's template escapes special-token text in contents; its normalizer deletes the escape
    return tokenizer


def marked_templates(tok) -> dict[str, str]:
    return {"llmpipe": chat_template(tuple(tok.all_special_tokens)), "chatml": CHATML_MARKED,
            "llama3": (TRL_TEMPLATES / "llama3_training.jinja").read_text(),
            "cohere": (TRL_TEMPLATES / "cohere_training.jinja").read_text()}  # fmt: skip


@pytest.mark.parametrize("name", ["llmpipe", "chatml", "llama3", "cohere"])
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_rendered_masks_equal_the_markers_masks(tok, name, chat):
    marked = marked_templates(tok)[name]
    messages = CHATS[chat]
    tok.chat_template = marked
    want = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tok.chat_template = plain_template(marked)
    assert not has_markers(tok.chat_template) and has_markers(marked)
    got = rendered_masks(tok, messages)
    assert got["input_ids"] == list(want["input_ids"]), "the plain template renders the same tokens"
    assert got["assistant_masks"] == list(want["assistant_masks"])
    assert 0 < sum(got["assistant_masks"]) < len(got["input_ids"])
    assert assistant_masks(tok, messages) == got, "without markers, assistant_masks renders"


def test_trl_chatml_markers_also_take_what_follows_the_end_of_turn(tok):
    """TRL's marked Qwen 2.5 template puts the newline after ``<|im_start|>assistant`` and after ``<|im_end|>`` in
    the mask too: text around the answer that the prompt holds or that the model never writes (it stops at
    ``<|im_end|>``). The rendered mask is the answer and its end of turn, inside the markers' mask."""
    marked = (TRL_TEMPLATES / "qwen2_5_training.jinja").read_text()
    messages = CHATS[1]
    tok.chat_template = marked
    want = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    tok.chat_template = plain_template(marked)
    got = rendered_masks(tok, messages)
    assert got["input_ids"] == list(want["input_ids"])
    extra = [i for i, (g, w) in enumerate(zip(got["assistant_masks"], want["assistant_masks"], strict=True)) if g != w]
    assert extra and all(want["assistant_masks"][i] == 1 for i in extra), "the rendered mask is inside the markers'"
    assert {tok.decode([got["input_ids"][i]]) for i in extra} == {"\n"}
    masked = tok.decode([t for t, m in zip(got["input_ids"], got["assistant_masks"], strict=True) if m])
    assert masked == "def f(x):\n    return x + 1\n<|im_end|>return x + 2<|im_end|>"


def test_the_end_of_turn_token_is_read_from_the_template(tok):
    cases = {"llmpipe": "</s>", "chatml": "<|im_end|>", "llama3": "<|eot_id|>", "cohere": "<|END_OF_TURN_TOKEN|>"}
    for name, template in marked_templates(tok).items():
        tok.chat_template = plain_template(template)
        assert end_of_turn(tok) == cases[name], name
    tok.chat_template = PLAIN_TEMPLATE
    assert end_of_turn(tok) is None, "a template that ends turns with a newline gives the model no token to stop on"
    masked = rendered_masks(tok, CHATS[0])
    text = tok.decode([t for t, m in zip(masked["input_ids"], masked["assistant_masks"], strict=True) if m])
    # without an end-of-turn token, the whole turn the template adds (the first token takes the prompt's last space)
    assert text == " return x + 1\n"


def test_a_template_that_renders_history_differently_is_refused(tok):
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                         "{{ '<|assistant|>(earlier answer)</s>' }}{% else %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
                         "{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")  # fmt: skip
    assert rendered_masks(tok, CHATS[0])["assistant_masks"].count(1) > 0, "one turn: nothing to render differently"
    with pytest.raises(ValueError, match="before message 3 differently .*not prefix-preserving"):
        rendered_masks(tok, CHATS[1])


@pytest.mark.parametrize("name", ["llmpipe", "chatml", "llama3", "cohere"])
def test_the_plain_template_renders_in_plain_jinja2(tok, name):
    marked = marked_templates(tok)[name]
    plain = plain_template(marked)
    with pytest.raises(jinja2.TemplateSyntaxError):
        jinja2.Environment().from_string(marked)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    env.globals["raise_exception"] = lambda message: pytest.fail(message)
    for messages in CHATS[:2]:
        text = env.from_string(plain).render(messages=messages, add_generation_prompt=True, bos_token="<s>",
                                             eos_token="</s>")  # fmt: skip
        tok.chat_template = marked
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_a_stage_masking_by_markers_refuses_a_template_without_them():
    """vlm trains with TRL's assistant_only_loss: a plain ChatML template is refused before training, naming the
    stage, the tokenizer folder and the fix (a new user's run failed inside TRL after four other stages)."""
    with pytest.raises(UserError, match=r"vlm: the chat template in artifacts/tokenizer has no \{% generation %\}"):
        require_markers(PLAIN_TEMPLATE, "artifacts/tokenizer", "vlm")
    require_markers("{% generation %}{{ m }}{% endgeneration %}", "artifacts/tokenizer", "vlm")
