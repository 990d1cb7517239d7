"""`llm-train COMMAND …`: the hand tools beside the stages — talk to a model, inspect a checkpoint, draw a schedule.

`llm-train --task X` runs a stage; `llm-train <command>` runs one of :data:`COMMANDS`. Each command is the module
``llmpipe.commands.<module>`` exposing ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when
its command runs, and imports torch and transformers only inside its functions, so `llm-train --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass

from llmpipe.core.errors import UserError


@dataclass(frozen=True)
class Command:
    """One subcommand of `llm-train`.

    Attributes:
        name: What the user types after ``llm-train``.
        module: The module under ``llmpipe.commands`` that implements it.
        description: One line for `llm-train --help`.
    """

    name: str
    module: str
    description: str


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("chat", "chat", "talk to a model folder (its chat template, streamed tokens, /clear, /quit)"),
    Command("generate", "generate", "answer --prompt / --file prompts with a model folder, one jsonl line each"),
    Command("inspect", "inspect", "a checkpoint's step, losses, data position, and its run against params.yaml"),
    Command("plot-lr", "schedule", "a training stage's learning-rate schedule from params, as a PNG"),
    Command("intermediate-size", "sizing", "the SwiGLU MLP width for a hidden size (2/3 of 4x, rounded up)"),
    Command("params-reference", "params_reference", "write docs/params.md: every params.yaml key, from the schema"),
    Command("dvc-yaml", "dvc_yaml", "check (or --write) llmpipe's stages and plots in dvc.yaml, from the registry"),
    Command("eval-tasks", "eval_tasks", "the evaluate stage's task YAMLs and data in a folder, and the lm_eval command "
            "that reproduces its numbers"),
)}  # fmt: skip
"""Every subcommand, in the order `llm-train --help` names them."""


def main(argv: list[str]) -> int:
    """Run ``llm-train <argv[0]> <argv[1:]>``; returns the exit code (2 for a user's mistake, one line on stderr).

    Args:
        argv: The command name (a key of :data:`COMMANDS`) and its arguments.
    """
    if argv[0] not in COMMANDS:
        listing = "\n".join(f"  {c.name:<18} {c.description}" for c in COMMANDS.values())
        print(f"llm-train: error: no command {argv[0]!r}; a stage runs as llm-train --task NAME, and the commands "
              f"are:\n{listing}", file=sys.stderr)  # fmt: skip
        return 2
    command = COMMANDS[argv[0]]
    module = importlib.import_module(f"{__name__}.{command.module}")
    parser = argparse.ArgumentParser(prog=f"llm-train {command.name}", description=module.__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    # Warnings only: these commands print their own results, and library INFO lines would bury them.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", force=True)
    try:
        return module.run(args)
    except UserError as err:
        print(f"llm-train {command.name}: error: {err}", file=sys.stderr)
        return 2
