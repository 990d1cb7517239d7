"""`llm-train eval-tasks --out DIR [--model NAME]`: the task YAMLs and data the evaluate stage uses for a model,
written into DIR, and the ``lm_eval`` commands that reproduce the stage's numbers with them.

The stage renders the same files into a temporary folder (`llmpipe.stages.evaluate.prepare`): llmpipe's tasks in
the model's chat format, lm-eval's own tasks with a local copy (``eval.task_data``) redirected to it. The printed
commands (also in ``DIR/lm_eval.sh``) give lm-eval the stage's context length, batch size, document limit, seeds,
dtype and per-task options, one command per set of ``eval.task_options``; each reports the same
``<task>.<metric>`` values as ``metrics/eval/<model>.json``.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
from pathlib import Path

from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train eval-tasks` flags."""
    parser.add_argument("--out", type=Path, required=True, help="folder to write (new, or empty)")
    parser.add_argument("--model", help="a name in eval.models (default: the first); its tokenizer renders the "
                                        "llmpipe tasks")  # fmt: skip
    parser.add_argument("--config-path", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="as llm-train --task evaluate --trust-remote-code")


def lm_eval_commands(params, prep, out: Path, trust_remote_code: bool = False) -> list[list[str]]:
    """The ``lm_eval`` command lines that evaluate `prep`'s tasks from `out` as `llmpipe.evaluation.harness.evaluate`
    does: one per group of tasks with the same ``eval.task_options``.

    Args:
        params: Validated params (``eval``, ``model.attn_implementation``).
        prep: From `llmpipe.stages.evaluate.prepare` into `out`.
        out: The folder written (lm-eval's ``--include_path``).
        trust_remote_code: Add lm-eval's ``trust_remote_code=True`` model argument.
    """
    from llmpipe.evaluation.harness import SEED
    from llmpipe.evaluation.options import cli_arguments, option_groups

    model_args = [f"pretrained={prep.path}", f"max_length={prep.max_length}", "dtype=float32"]  # the stage: fp32
    if params.model.attn_implementation:
        model_args.append(f"attn_implementation={params.model.attn_implementation}")
    if trust_remote_code:
        model_args.append("trust_remote_code=True")
    common = ["lm_eval", "--model", "hf", "--model_args", ",".join(model_args), "--include_path", str(out),
              "--batch_size", str(params.eval.batch_size), "--seed", str(SEED)]  # fmt: skip
    if params.eval.limit is not None:
        common += ["--limit", str(params.eval.limit)]
    return [[*common, "--tasks", ",".join(group), *cli_arguments(options)]
            for options, group in option_groups(prep.names, params.eval.task_options)]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Write the tasks into ``args.out`` and print the commands; the exit code.

    Raises:
        UserError: ``--out`` is a file or a folder with files in it, ``--model`` is not in ``eval.models``, or
            anything the evaluate stage would refuse before loading the model (the folder is then removed).
    """
    from llmpipe.config import load_params
    from llmpipe.stages.evaluate import prepare

    params = load_params(args.config_path)
    out: Path = args.out.resolve()  # the YAMLs name their data by absolute path: written where they stay
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {args.out}: exists and is not an empty folder; give a new folder")
    model = args.model or params.eval.models[0]
    out.mkdir(parents=True, exist_ok=True)
    try:
        prep = prepare(params, model, out, args.trust_remote_code)
    except BaseException:
        shutil.rmtree(out)  # nothing half-written
        raise
    if not prep.names:
        print(f"llm-train eval-tasks: no task left to evaluate for {model} (see the warnings above)", file=sys.stderr)
        return 1
    commands = [shlex.join(c) for c in lm_eval_commands(params, prep, out, args.trust_remote_code)]
    with atomic_file(out / "lm_eval.sh") as f:
        f.write(f"#!/bin/sh\n# The evaluate stage's numbers for {model} by lm-eval's own command (llm-train "
                "eval-tasks)\nset -e\n" + "".join(f"{c}\n" for c in commands))  # fmt: skip
    print("\n".join(commands))
    print(f"{out}: tasks {', '.join(prep.names)} for {model}; the commands above are in {out / 'lm_eval.sh'}",
          file=sys.stderr)  # fmt: skip
    return 0
