"""`llm-train --task NAME`: the one entry point DVC, Prefect and people call.

DVC stages call it with no overrides, so a stage reads params.yaml alone and writes its declared
outputs. A hand run with overrides (``--lr``, ``--epochs`` …) writes under ``runs/<task>-<time>/``
(or ``--output-dir``) instead, never into the DVC outputs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from llmpipe import stages
from llmpipe.config import stages as registry
from llmpipe.core.errors import UserError

log = logging.getLogger("llmpipe")


def _parser() -> argparse.ArgumentParser:
    tasks = "\n".join(f"  {name:<10} {s.description}" for name, s in registry.REGISTRY.items())
    p = argparse.ArgumentParser(
        prog="llm-train",
        description="Run one llmpipe stage (--task NAME), or one of the commands listed below.",
        epilog=f"registered tasks:\n{tasks}\n  lm         alias of pretrain\n"
        "  stream_lm  alias of pretrain that requires data.streaming: true\n\n"
        "commands: llm-train {chat,generate,inspect,plot-lr,intermediate-size,params-reference,dvc-yaml,eval-tasks} …  (llm-train COMMAND --help)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", help="stage to run (see below)")
    p.add_argument("--list-presets", action="store_true",
                   help="list the data.hf.preset names with their hub dataset, config and text column, and exit")
    p.add_argument("--config-path", default="params.yaml", help="params file (default: params.yaml)")
    p.add_argument("--model", help="evaluate: which model under paths.models to evaluate")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="load model/tokenizer folders whose weights are pickles (*.bin/*.pt/*.pkl) or whose config maps to "
        "Python code (auto_map); off by default: only safetensors and no code",
    )
    resume = p.add_argument_group("checkpoints (training tasks; by default a run resumes its newest whole checkpoint)")
    resume.add_argument("--resume-from", metavar="PATH",
                        help="resume this checkpoint-<step> folder (or a run folder's newest); it must be of the "
                             "same params and inputs, else the error names what differs")  # fmt: skip
    resume.add_argument("--restart", action="store_true",
                        help="train from step 0; the run's earlier checkpoints are moved aside, not deleted")
    resume.add_argument("--list-checkpoints", action="store_true",
                        help="list the task's run folders and checkpoints, and how each differs from params.yaml")
    hand = p.add_argument_group("hand-run overrides (output goes to runs/<task>-<time>/ or --output-dir)")
    hand.add_argument("--epochs", type=float,
                      help="num_train_epochs of the stage (without --steps-per-epoch, its max_steps is dropped)")
    hand.add_argument("--batch-size", type=int, help="per_device_train_batch_size of the stage")
    hand.add_argument("--lr", type=float, help="peak learning rate of the stage")
    hand.add_argument("--num-samples", type=int, help="train on at most this many examples")
    hand.add_argument("--steps-per-epoch", type=int, help="optimizer steps per epoch (sets max_steps = this × epochs)")
    hand.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model")
    hand.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None, help="mixed precision (auto) or fp32")
    hand.add_argument("--output-dir", help="where a hand run writes (default runs/<task>-<time>/)")
    return p


def overrides_from_args(args: argparse.Namespace, task: str) -> dict[str, Any]:
    """Dotted params overrides for the hand-run flags that were given.

    Raises:
        UserError: A training flag was given to a task that does not train.
    """
    section = {
        "epochs": "num_train_epochs",
        "batch_size": "per_device_train_batch_size",
        "lr": "lr",
        "num_samples": "num_samples",
    }
    out: dict[str, Any] = {}
    for flag, key in section.items():
        if getattr(args, flag) is not None:
            out[f"{task}.{key}"] = getattr(args, flag)
    if args.steps_per_epoch is not None:
        out[f"{task}.max_steps"] = args.steps_per_epoch * math.ceil(args.epochs or 1)
    elif args.epochs is not None:
        out[f"{task}.max_steps"] = -1  # a step budget would override the epochs (every shipped stage has one)
    if args.amp is not None:
        out[f"{task}.precision"] = "auto" if args.amp else "fp32"
    if args.compile is not None:
        out["distributed.torch_compile"] = args.compile
    if out and task not in registry.TRAINING_TASKS:
        flags = ", ".join(k.split(".")[-1] for k in out)
        raise UserError(f"--task {task} does not train; training overrides ({flags}) apply to "
                        f"{registry.TRAINING_TASKS}")
    return out


def quiet_library_bars() -> None:
    """Turn off the progress bars of `datasets` (map, filter) and huggingface_hub (downloads; transformers' model
    shards) when stdout is not a terminal (CI, DVC, Prefect logs): they redraw with carriage returns, which a log
    keeps as noise; `llmpipe.train.progress` prints plain lines there instead. Through the libraries' environment
    switches, set only where unset, so it costs no import and holds for the libraries a stage imports later."""
    if not sys.stdout.isatty():
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def metrics_path(params: Any, task: str, model: str | None) -> Path:
    """Where the CLI writes a stage's metrics: metrics/<task>.json, metrics/eval/<model>.json for evaluate."""
    if task == "evaluate":
        return params.paths.out(params.paths.metrics, "eval", f"{model}.json")
    return params.paths.out(params.paths.metrics, f"{task}.json")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, validate params, run the stage, write its metrics. Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-"):  # llm-train chat|generate|inspect|…: the hand tools, which a stage
        from llmpipe import commands  # run never imports (so dvc.yaml's code deps leave them out)

        return commands.main(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list_presets:
        from llmpipe.config.presets import listing

        print(listing())
        return 0
    if not args.task:
        parser.error("the following arguments are required: --task")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    quiet_library_bars()
    try:
        return _run(args, argv)
    except UserError as err:
        print(f"llm-train: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"llm-train: interrupted; run `{resume_command(argv, args.output_dir)}` to resume {args.task} from its "
              "newest checkpoint", file=sys.stderr)  # fmt: skip
        return 130


def resume_command(argv: list[str], output_dir: str | None) -> str:
    """The command that resumes an interrupted run of `argv`: the same one without ``--restart``, and for a hand run
    with overrides, with the ``--output-dir`` it wrote to (run again without it, it would start a new
    ``runs/<task>-<time>/`` folder, whose checkpoints are none)."""
    words = [a for a in argv if a != "--restart"]
    if output_dir and not any(a == "--output-dir" or a.startswith("--output-dir=") for a in words):
        words += ["--output-dir", output_dir]
    return shlex.join(["llm-train", *words])


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from llmpipe.config import load_params
    from llmpipe.core.io import write_json
    from llmpipe.distributed.launch import finish, is_main_process, needs_launch, relaunch, under_launcher
    from llmpipe.train.arguments import check_device_params
    from llmpipe.train.checkpoints import ResumeRequest, describe_runs, machine_identity

    try:
        task = registry.resolve(args.task)
    except ValueError as err:
        raise UserError(str(err)) from None
    overrides = overrides_from_args(args, task)
    if overrides or args.output_dir:
        root = args.output_dir or str(Path("runs", f"{task}-{time.strftime('%Y%m%d-%H%M%S')}"))
        overrides["paths.output_root"] = root
        if not args.output_dir:  # a relaunched copy of this command must write to the same folder, and a resume
            argv = [*argv, "--output-dir", root]
            args.output_dir = root
        log.info("hand run with overrides %s: writing under %s", overrides, root)
    try:
        params = load_params(args.config_path, overrides)
    except UserError as err:
        if not overrides:
            raise
        raise UserError(f"{err}\n  (these values came from the command line: {overrides})") from None
    if args.task == "stream_lm" and not params.data.streaming:
        raise UserError("--task stream_lm streams the pretraining text: set data.streaming: true in params.yaml "
                        "(with data.hf or data.mixture), or run --task pretrain")
    check_device_params(params, task)  # before a model loads or a run folder is made, and before a relaunch;
    # also under --list-checkpoints, which then checks a whole params edit without training
    kwargs: dict[str, Any] = {}
    if args.resume_from or args.restart or args.list_checkpoints:
        if task not in registry.TRAINING_TASKS:
            raise UserError(
                f"--resume-from, --restart and --list-checkpoints apply to {registry.TRAINING_TASKS}, not {task}"
            )
        if args.resume_from and args.restart:
            raise UserError("--resume-from and --restart contradict each other: give one")
        if args.list_checkpoints:
            print(describe_runs(params, task, stages.run_inputs(task, params)))
            return 0
        kwargs["resume"] = ResumeRequest(Path(args.resume_from) if args.resume_from else None, args.restart)
    if task == "evaluate":
        if not args.model:
            raise UserError(f"--task evaluate needs --model NAME (one of eval.models: {params.eval.models})")
        kwargs["model"] = args.model
    elif args.model:
        raise UserError(f"--model applies to --task evaluate only, not {task}")
    if args.trust_remote_code:  # stays in argv, so a copy relaunched under accelerate launch trusts the same
        if task not in registry.LOADING_TASKS:
            raise UserError(f"--trust-remote-code: --task {task} loads no model or tokenizer; drop the flag")
        kwargs["trust_remote_code"] = True
    if task in registry.DISTRIBUTED_TASKS and needs_launch(params.distributed) and not under_launcher():
        many = params.distributed.num_machines > 1  # the machines compare what they would train before launching
        identity = machine_identity(params, task, stages.run_inputs(task, params)) if many else None
        relaunch(params, task, argv, identity)  # does not return: the same command, under accelerate launch
    run = stages.runner(task)
    start = time.perf_counter()
    metrics = dict(run(params, **kwargs))
    metrics["wall_time_s"] = round(time.perf_counter() - start, 3)
    if is_main_process():
        from llmpipe.config.identity import IDENTITY_KEY, run_identity

        path = metrics_path(params, task, args.model)
        metrics[IDENTITY_KEY] = run_identity(params, task, args.model)  # the report leaves out files of other runs
        write_json(path, metrics)
        log.info("%s done in %.1f s; metrics in %s", task, metrics["wall_time_s"], path)
    else:
        log.info("%s done in %.1f s on rank %s; rank 0 (machine 0) writes the outputs", task, metrics["wall_time_s"],
                 os.environ.get("RANK"))  # fmt: skip
    finish()  # every rank of a multi-process run leaves together
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
