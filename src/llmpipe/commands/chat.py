"""`llm-train chat --model DIR`: talk to a model, turn by turn, in its own chat template; tokens print as they come.

Type a message and press Enter. ``/clear`` forgets the conversation (a ``--system`` message stays), ``/quit`` or
Ctrl-D ends; Ctrl-C stops an answer and takes its message back. Each answer is followed, on stderr, by
``[N prompt tokens, M new tokens, X tokens/s]``. When the conversation outgrows the model's context, its oldest
turns are left out (and a line says so). Over a pipe, stdin gives one message per line and stdout carries the
answers alone. With ``--image PATH`` and a vision-language model folder (``models/vlm``), the image goes with the
first message of the conversation (again after ``/clear``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.commands.generation import (
    Sampling,
    add_generation_arguments,
    chat_ids,
    context_length,
    generate,
    load_for_generation,
)
from llmpipe.core.errors import UserError

PROMPT = "you> "
"""Shown before each message when stdin is a terminal."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train chat` flags: the model, sampling, and an optional system message."""
    add_generation_arguments(parser)
    parser.add_argument("--system", help="a system message that opens the conversation (kept by /clear)")
    parser.add_argument("--image", metavar="PATH", help="an image to talk about (a vision-language model folder)")


class Conversation:
    """The messages so far, rendered by the chat template within the model's context.

    Args:
        render: Messages → the prompt's token ids up to the assistant's turn, and any other model inputs.
        system: An opening system message (kept by :meth:`clear`), or None.
        limit: Prompt tokens allowed (context minus the answer's budget), or None for no limit.
        image_token: Put this placeholder before the first user message (an image goes with it), or None.
    """

    def __init__(self, render: Callable[[list], tuple[list[int], dict[str, Any]]], system: str | None,
                 limit: int | None, image_token: str | None = None):
        self.render, self.limit, self.image_token = render, limit, image_token
        self.head = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict[str, str]] = []

    def clear(self) -> None:
        """Forget every turn but the system message."""
        self.turns = []

    def prompt_ids(self, message: str) -> tuple[list[int], dict[str, Any], int]:
        """Add the user's `message`; the ids of the whole conversation up to the assistant's turn, the other model
        inputs, and how many of the oldest messages were left out to fit the context (they stay left out).

        Raises:
            UserError: The message alone (with the system message) does not fit; the conversation is unchanged.
        """
        if self.image_token is not None and not self.turns:
            message = self.image_token + message
        turns = [*self.turns, {"role": "user", "content": message}]
        dropped = 0
        while True:
            ids, inputs = self.render(self.head + turns)
            if self.limit is None or len(ids) <= self.limit:
                self.turns = turns
                return ids, inputs, dropped
            if len(turns) == 1:
                raise UserError(f"this message is {len(ids)} tokens with the template, over the {self.limit} the "
                                "context leaves beside --max-new-tokens; send a shorter one or lower --max-new-tokens")
            gone = min(2, len(turns) - 1)  # the oldest user message and its answer; never the new message
            turns = turns[gone:]
            dropped += gone

    def answer(self, text: str) -> None:
        """Record the assistant's answer."""
        self.turns.append({"role": "assistant", "content": text})

    def retract(self) -> None:
        """Take back the last user message (its answer was interrupted)."""
        self.turns.pop()


def _reply(model, tokenizer, ids: list[int], inputs: dict[str, Any], sampling: Sampling) -> str:
    """Stream one answer to stdout; its statistics to stderr; returns its text."""
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    new = generate(model, tokenizer, [ids], sampling, streamer=streamer, **inputs)[0]
    seconds = time.perf_counter() - start
    sys.stdout.flush()
    print(f"[{len(ids)} prompt tokens, {len(new)} new tokens, {len(new) / seconds:.1f} tokens/s]", file=sys.stderr,
          flush=True)  # fmt: skip
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def _load(args: argparse.Namespace):
    """The model, its tokenizer, how a conversation becomes inputs, and the image placeholder (None: no image).

    Raises:
        UserError: A folder that cannot be loaded, no chat template, or ``--image`` with a text-only model.
    """
    from llmpipe.commands.vision import image_inputs, is_vision_model, load_vision_model, open_image

    if is_vision_model(args.model):
        model, processor = load_vision_model(args.model, args.trust_remote_code)
        image = open_image(args.image) if args.image else None
        token = processor.image_token if image is not None else None
        return model, processor.tokenizer, lambda messages: image_inputs(processor, messages, image), token
    if args.image and Path(args.model).is_dir():  # a missing folder: load_for_generation says so
        raise UserError(f"--image {args.image}: {args.model} is a text-only model (no vision_config in its config.json)"
                        "; give a vision-language model folder such as models/vlm")  # fmt: skip
    model, tokenizer = load_for_generation(args.model, args.trust_remote_code)
    if not tokenizer.chat_template:
        raise UserError(f"{args.model}: its tokenizer has no chat template, so there is no turn format to talk in; "
                        f"continue plain text with llm-train generate --model {args.model} --prompt TEXT")
    return model, tokenizer, lambda messages: (chat_ids(tokenizer, messages), {}), None


def run(args: argparse.Namespace) -> int:
    """Load the model, then answer each line of stdin until ``/quit`` or end of input.

    Raises:
        UserError: Bad flags, a model folder that cannot be loaded, or a tokenizer without a chat template.
    """
    import transformers

    sampling = Sampling.from_args(args)
    model, tokenizer, render, image_token = _load(args)
    limit = context_length(model, tokenizer)
    conversation = Conversation(render, args.system, None if limit is None else limit - sampling.max_new_tokens,
                                image_token)  # fmt: skip
    transformers.set_seed(args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
    print(f"chatting with {args.model}; /clear forgets the conversation, /quit ends", file=sys.stderr, flush=True)
    while True:
        try:
            line = input(PROMPT if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        message = line.strip()
        if message == "/quit":
            return 0
        if message == "/clear":
            conversation.clear()
            print("[conversation cleared]", file=sys.stderr, flush=True)
            continue
        if not message or message.startswith("/"):
            if message:
                print(f"[unknown command {message}; /clear or /quit]", file=sys.stderr, flush=True)
            continue
        try:
            ids, inputs, dropped = conversation.prompt_ids(message)
        except UserError as err:  # one message too long: say so and keep the conversation going
            print(f"[{err}]", file=sys.stderr, flush=True)
            continue
        if dropped:
            print(f"[the {dropped} oldest messages no longer fit the context and were left out]", file=sys.stderr)
        try:
            conversation.answer(_reply(model, tokenizer, ids, inputs, sampling))
        except KeyboardInterrupt:  # Ctrl-C stops this answer, not the conversation
            conversation.retract()
            print("\n[answer interrupted; the message is taken back]", file=sys.stderr, flush=True)
