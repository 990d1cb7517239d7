"""Special-token text in data stays text: ``<|user|>`` typed in a message, ``</s>`` in a file or ``(?P<s>…)`` in
the stdlib corpus is encoded as the characters it is, while the control tokens a chat template writes stay single
ids.

A tokenizer matches special tokens in whatever string it is given, so a string alone cannot say which ``<s>`` the
template wrote and which the user typed. Data text is therefore escaped where it enters a string that is later
tokenized — message contents inside the chat template, raw documents handed to lm-eval — by putting
:data:`SENTINEL` after the first character of every special token in it (``<s>`` → ``<\\ufdd0s>``, which no
special token matches), and the pipeline tokenizer's normalizer deletes :data:`SENTINEL` again after special tokens
have been split off (`tokenizers` matches ``normalized=False`` added tokens on the raw text, then normalizes the
rest), so the escaped text becomes the plain characters ``<s>``. Offsets skip the sentinel, so TRL's assistant masks
stay exact. Pretraining text is encoded with special tokens split instead (`llmpipe.data.tokens.pack_ids`).

Why not transformers' own `apply_chat_template(..., sanitize_control_tokens=True)` (5.24): it refuses
``return_assistant_tokens_mask`` (TRL's SFT ``assistant_only_loss``) and needs ``tokenize=True``, while the
evaluation tasks and the PPO prompts render the chat to a string first (docs/LOG.md).
"""

from __future__ import annotations

from collections.abc import Sequence

SENTINEL = "\ufdd0"
"""A Unicode noncharacter: never meant to be in text; the normalizer deletes it wherever it appears."""


def escape(text: str, special_tokens: Sequence[str]) -> str:
    """`text` with :data:`SENTINEL` put after the first character of each occurrence of a special token.

    Args:
        text: Data text (a message's content, a document).
        special_tokens: The tokenizer's special tokens (``tokenizer.all_special_tokens``).
    """
    for token in sorted(special_tokens, key=len, reverse=True):  # longest first: a token inside another stays whole
        if len(token) > 1:
            text = text.replace(token, token[0] + SENTINEL + token[1:])
    return text


def jinja_escape(expression: str, special_tokens: Sequence[str]) -> str:
    """A Jinja expression: `expression` passed through `replace` filters doing what :func:`escape` does.

    Raises:
        ValueError: A special token holds a quote or a backslash (it would break the literal).
    """
    for token in sorted(special_tokens, key=len, reverse=True):
        if len(token) > 1:
            if "'" in token or "\\" in token:
                raise ValueError(f"special token {token!r} cannot be written as a Jinja string literal")
            expression += f" | replace('{token}', '{token[0] + SENTINEL + token[1:]}')"  # the sentinel itself, not an escape
    return f"({expression})"


def install(tokenizer) -> None:
    """Make a fast tokenizer's normalizer delete :data:`SENTINEL` first (before any normalizer it already has).

    Raises:
        ValueError: The tokenizer has no `tokenizers` backend.
    """
    from tokenizers import normalizers

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} has no tokenizers backend to delete the escape with")
    strip = normalizers.Replace(SENTINEL, "")
    backend.normalizer = strip if backend.normalizer is None else normalizers.Sequence([strip, backend.normalizer])


def escapes(tokenizer) -> bool:
    """Whether `tokenizer` deletes :data:`SENTINEL` (:func:`install` was applied), so escaped text is safe to give it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and backend.normalizer is not None and backend.normalizer.normalize_str(SENTINEL) == ""
