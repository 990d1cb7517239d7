"""Training checkpoints: a run's folder ``checkpoints/<stage>/<fingerprint>/``, which checkpoint a run resumes,
and the checks that a checkpoint is whole before it is trusted.

A run's identity is its params (step/epoch budgets and launch positions excluded), the bytes of its inputs and
the llmpipe code that trains it; its fingerprint is a hash of that identity, and ``fingerprint.json`` in the run
folder keeps the identity itself, so a refused resume can name the keys, inputs and code that differ.

A checkpoint counts only when it is whole: its ``trainer_state.json`` exists (the HF Trainer writes it last, and
our PPO loop renames a finished temp folder into place, so a kill during a save leaves no such file) and every
weight and optimizer file matches the sizes its own format declares (a safetensors header, a torch zip archive's
central directory). A truncated or damaged newest checkpoint is skipped with a warning naming it, and the
previous one is resumed (the Trainer deletes older checkpoints only after a new one is whole, so there is one);
training then writes the skipped step's folder anew. Nothing here deletes a checkpoint or a run folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmpipe.config import BUDGET_KEYS, Params
from llmpipe.config.distributed import LAUNCH_KEYS
from llmpipe.core.errors import UserError
from llmpipe.core.io import hash_paths, safetensors_problem, write_json
from llmpipe.distributed.launch import is_main_process

log = logging.getLogger(__name__)

FINGERPRINT_FILE = "fingerprint.json"
STATE_FILE = "trainer_state.json"
PREFIX = "checkpoint-"
BATCH_LAYOUT_KEYS = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps"})
"""Keys whose change, even at the same global batch, makes a checkpoint another run (named in the refusal)."""


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def code_hash(package: Path = Path(__file__).parents[1]) -> str:
    """SHA-256 over the relative names and bytes of the ``*.py`` files of the llmpipe package (bytecode left out).

    Part of a run's identity: when DVC reruns a training stage because its code changed, the stage must train
    with the new code, not find the finished checkpoint of the old code and save it again. It covers the whole
    package rather than the stage's own dvc.yaml deps (llm-train does not read dvc.yaml), so any edit to llmpipe
    starts new runs; ``--resume-from`` still resumes a checkpoint whose run differs only in code.
    """
    h = hashlib.sha256()
    for f in sorted(package.rglob("*.py")):
        h.update(str(f.relative_to(package)).encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def identity(params: Params, stage: str, inputs: list[Path]) -> dict[str, Any]:
    """What makes a training run the run it is, as flat ``{"sft.lr": 1e-4, …, "input data/sft": "<sha256>"}``.

    The stage's params minus `BUDGET_KEYS` (raising `max_steps` continues the same run), the model shape for
    pretrain (and `data` when it streams), `distributed` minus `LAUNCH_KEYS` (every machine of a multi-node run computes the same one),
    `profile` when enabled, and one content hash per input path (data, tokenizer, base model: they carry all
    that is upstream, so upstream params need not be listed), and ``code llmpipe``: :func:`code_hash`.
    """
    out: dict[str, Any] = {"stage": stage}
    _flat(stage, {k: v for k, v in params.stage(stage).model_dump().items() if k not in BUDGET_KEYS}, out)
    if stage == "pretrain":
        _flat("model", params.model.model_dump(), out)
        if params.data.streaming:  # the stream is read from the source itself, not from an input path
            _flat("data", params.data.model_dump(), out)
    _flat("distributed", params.distributed.model_dump(exclude=set(LAUNCH_KEYS)), out)
    if params.profile.enabled:
        _flat("profile", params.profile.model_dump(), out)
    for path in inputs:
        out[f"input {path}"] = hash_paths([Path(path)])
    out["code llmpipe"] = code_hash()
    return out


def machine_identity(params: Params, stage: str, inputs: list[Path]) -> dict[str, Any]:
    """What every machine of a multi-machine run must have alike (`llmpipe.distributed.join`): the run's
    :func:`identity` (which leaves out where a machine sits) and its step and epoch budget (a machine that trains
    longer would wait in a collective for ever)."""
    out = identity(params, stage, inputs)
    _flat(stage, {k: v for k, v in params.stage(stage).model_dump().items() if k in BUDGET_KEYS}, out)
    return out


def fingerprint_of(ident: dict[str, Any]) -> str:
    """16 hex characters of SHA-256 over an :func:`identity`."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(params: Params, stage: str, inputs: list[Path]) -> str:
    """The fingerprint of a run: two runs with the same one are the same run, and one may resume the other."""
    return fingerprint_of(identity(params, stage, inputs))


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per key whose value differs between two identities: ``key: <stored> → <current>`` (inputs and
    code: ``key changed``)."""
    lines = []
    for key in sorted(stored.keys() | current.keys()):
        a, b = stored.get(key, "<absent>"), current.get(key, "<absent>")
        if a != b:
            lines.append(f"{key} changed" if key.startswith(("input ", "code ")) else f"{key}: {a!r} → {b!r}")
    return lines


def step_of(checkpoint: Path) -> int | None:
    """The step of a ``checkpoint-<step>`` folder, else None."""
    tail = checkpoint.name[len(PREFIX) :]
    return int(tail) if checkpoint.name.startswith(PREFIX) and tail.isdigit() else None


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why `checkpoint` cannot be resumed (incomplete, or a file truncated or damaged), or None when it is whole.

    Checks every ``*.safetensors`` against its header's sizes and every torch archive (``*.pt``, ``*.pth``,
    ``*.bin``) for a readable zip directory; cheap (no tensor is read), so it catches truncation, not bit flips
    inside the data.
    """
    state = checkpoint / STATE_FILE
    if not state.is_file():
        return f"no {STATE_FILE} (the save did not finish)"
    try:
        json.loads(state.read_text())
    except ValueError:
        return f"{STATE_FILE} is not valid JSON"
    for f in sorted(checkpoint.rglob("*")):
        if not f.is_file():
            continue
        problem = None
        if f.suffix == ".safetensors":
            problem = safetensors_problem(f)
        elif f.suffix in (".pt", ".pth", ".bin"):
            try:
                with zipfile.ZipFile(f):
                    pass
            except (zipfile.BadZipFile, OSError) as err:
                problem = f"not a whole torch archive ({err})"
        if problem:
            return f"{f.relative_to(checkpoint)}: {problem}"
    return None


def _finished(checkpoint: Path) -> tuple[float, int]:
    """Sort key of "newest": when the checkpoint's save finished (``trainer_state.json``'s mtime), then its step;
    an unfinished one sorts first."""
    state = checkpoint / STATE_FILE
    return (state.stat().st_mtime if state.exists() else 0.0, step_of(checkpoint) or 0)


def newest_whole(run_dir: Path) -> Path | None:
    """The newest whole checkpoint in `run_dir` (the most recently finished, so after a rewind with
    ``--resume-from`` the abandoned later ones are not picked up again), warning about each damaged newer one it
    skips (every rank of a distributed run reads the same folder and so makes the same choice)."""
    if not run_dir.is_dir():
        return None
    for ckpt in sorted((p for p in run_dir.iterdir() if step_of(p) is not None), key=_finished, reverse=True):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt
        log.warning("skipping damaged checkpoint %s (%s); falling back to the previous one", ckpt, problem)
    return None


def rotate(run_dir: Path, keep: int, protect: list[Path | None]) -> list[Path]:
    """Delete all but the `keep` newest checkpoints of `run_dir` and those in `protect` (the one just written,
    the best by validation); returns what was deleted.

    Newest means most recently finished (``trainer_state.json``'s mtime, then step), not highest step: after a
    rewind (``--resume-from`` an earlier checkpoint) the abandoned later ones go first. Unfinished folders count
    as oldest. The HF Trainer's own rotation counts the best checkpoint inside its limit; this keeps it beside.
    """
    kept = {Path(p).resolve() for p in protect if p is not None}
    ckpts = sorted((p for p in run_dir.iterdir() if step_of(p) is not None), key=_finished, reverse=True)
    gone = [p for p in ckpts[keep:] if p.resolve() not in kept]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


@dataclass(frozen=True)
class ResumeRequest:
    """What the command line asked about resuming.

    Attributes:
        from_path: ``--resume-from``: a ``checkpoint-<step>`` folder (or a run folder: its newest whole one).
        restart: ``--restart``: train from step 0 even where a checkpoint of the same run exists; that run's
            folder is moved aside (``<fingerprint>-restarted-<time>``), never deleted.
    """

    from_path: Path | None = None
    restart: bool = False


@dataclass(frozen=True)
class Run:
    """A training run's folder and where it starts.

    Attributes:
        path: ``checkpoints/<stage>/<fingerprint>/``: the Trainer's `output_dir`.
        resume: The checkpoint to resume, or None for a fresh run.
    """

    path: Path
    resume: Path | None

    @property
    def resumed_step(self) -> int:
        """The step training continues after (0 for a fresh run)."""
        return step_of(self.resume) if self.resume else 0


def _explicit(request: ResumeRequest, stage: str, ident: dict[str, Any], flag: str = "--resume-from") -> Path:
    path = Path(request.from_path)
    if step_of(path) is None and path.is_dir():
        newest = newest_whole(path)
        if newest is None:
            raise UserError(f"{flag} {path}: no whole checkpoint-<step> folder in it")
        path = newest
    problem = checkpoint_problem(path) if path.is_dir() else "no such checkpoint folder"
    if problem:
        raise UserError(f"{flag} {path}: {problem}; name another checkpoint, or pass --restart to train from step 0")
    stored_file = path.parent / FINGERPRINT_FILE
    if not stored_file.is_file():
        raise UserError(
            f"{flag} {path}: no {FINGERPRINT_FILE} beside it, so which params and inputs it was trained with is "
            f"unknown; name a checkpoint inside its run folder (checkpoints/{stage}/<fingerprint>/), or pass --restart"
        )
    diff = differences(json.loads(stored_file.read_text()), ident)
    if "code llmpipe changed" in diff:  # asked for by name: a fix to llmpipe may resume a killed run
        diff.remove("code llmpipe changed")
        log.warning("%s: %s %s was trained by other llmpipe code; resuming it as asked", stage, flag, path)
    if diff:
        layout = any(line.split(":")[0].split(".")[-1] in BATCH_LAYOUT_KEYS for line in diff)
        why = (" (another batch layout would shift the data position and the gradient-accumulation boundaries, "
               "so llmpipe does not resume across it)") if layout else ""  # fmt: skip
        raise UserError(
            f"{flag} {path} is another run of {stage}: " + "; ".join(diff) + why
            + ". Resuming it would continue other params or data; restore them, or pass --restart (without "
            f"{flag}) to train {stage} from step 0"
        )
    return path


def _longer_run(checkpoint: Path | None, budget: int) -> int | None:
    """The step of `checkpoint` when it belongs to a run longer than `budget` steps (its step is past the budget,
    and so is the ``max_steps`` its Trainer state planned, when it records one), else None.

    The planned ``max_steps`` keeps a finished FSDP/DeepSpeed run, which the HF Trainer resumes one step past its
    budget, the same run.
    """
    step = step_of(checkpoint) if checkpoint is not None and budget > 0 else None
    if step is None or step <= budget:
        return None
    planned = json.loads((checkpoint / STATE_FILE).read_text()).get("max_steps", step)
    return step if planned > budget else None


def _shorter_run(path: Path, stage: str, budget: int, newest: Path, step: int) -> Path:
    """The folder of a `budget`-step run beside the longer run `path` (whose newest checkpoint is `newest` at
    `step`): ``<fingerprint>-steps-<budget>``, logged in one line."""
    short = path.with_name(f"{path.name}-steps-{budget}")
    log.info("%s: %s.max_steps (%d) is below step %d of this run's newest checkpoint %s: training a %d-step run "
             "from step 0 in %s; the longer run's checkpoints stay (raise %s.max_steps to %d or more to go on "
             "with it)", stage, stage, budget, step, newest, budget, short, stage, step)  # fmt: skip
    return short


def open_run(params: Params, stage: str, inputs: list[Path], request: ResumeRequest | None = None) -> Run:
    """The run folder of `stage` with these params and inputs, and the checkpoint to resume.

    By default the newest whole checkpoint of the same fingerprint is resumed (another fingerprint trains in its
    own folder from step 0); ``--resume-from`` names one, which must belong to the same run up to its code (a
    run of other llmpipe code is resumed with a warning); ``--restart`` moves
    the run's folder aside and trains from step 0. The identity is written to ``fingerprint.json``.

    A step budget (``max_steps``) below the newest checkpoint of the run, without ``--resume-from``, is another,
    shorter run: it trains from step 0 in ``<fingerprint>-steps-<max_steps>/`` (its schedule is not the longer
    run's, so no checkpoint of that run would continue it), resuming that folder when it exists; the longer run's
    folder is left untouched, so raising the budget back resumes it (``--restart`` moves aside the shorter run's
    folder, not the longer one). A DVC experiment cannot pass ``--restart``, so this is what
    ``dvc exp run -S <stage>.max_steps=<fewer>`` gets.

    Raises:
        UserError: ``--resume-from`` names a missing or damaged checkpoint, or one of another run (the message
            lists every key and input that differs, and the way to proceed).
    """
    request = request or ResumeRequest()
    ident = identity(params, stage, inputs)
    path = params.paths.out(params.paths.checkpoints, stage, fingerprint_of(ident))
    resume = _explicit(request, stage, ident) if request.from_path else None
    longer, newest = path, None if resume else newest_whole(path)
    budget = params.stage(stage).resolved_max_steps
    if (step := _longer_run(newest, budget)) is not None:
        path = _shorter_run(path, stage, budget, newest, step)
        newest = newest_whole(path)
    if request.restart and path.exists() and is_main_process():
        aside = path.with_name(f"{path.name}-restarted-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        log.warning("%s: --restart: the run's earlier checkpoints are kept in %s", stage, aside)
    elif resume is None and not request.restart:
        resume = newest
    others = [p.name for p in path.parent.iterdir() if p.is_dir() and p not in (path, longer)] \
        if path.parent.is_dir() else []  # fmt: skip
    if resume is None and others:
        log.info("%s: %d other run folder(s) beside this one, with other params, inputs or code (not resumed); "
                 "llm-train --task %s --list-checkpoints shows how they differ", stage, len(others), stage)  # fmt: skip
    if is_main_process():  # a machine other than 0 writes nothing of the run (the Trainer makes the folder it saves in)
        path.mkdir(parents=True, exist_ok=True)
        if not (path / FINGERPRINT_FILE).exists():
            write_json(path / FINGERPRINT_FILE, ident)
    return Run(path=path, resume=resume)


def describe_runs(params: Params, stage: str, inputs: list[Path]) -> str:
    """``llm-train --task X --list-checkpoints``: every run folder of `stage`, newest first, with its whole and
    damaged checkpoints, and how its identity differs from the current params and inputs."""
    try:
        current: dict[str, Any] = identity(params, stage, inputs)
    except UserError as err:  # an input is missing: list the folders all the same
        current = {}
        log.warning("%s; no folder can be marked as the current run", err)
    root = params.paths.out(params.paths.checkpoints, stage)
    folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True) \
        if root.is_dir() else []  # fmt: skip
    if not folders:
        return f"{stage}: no checkpoints under {root}"
    lines = [f"{stage}: {len(folders)} run folder(s) under {root}, newest first (llmpipe never deletes a run folder; "
             "in a run, only checkpoints beyond save_total_limit)"]  # fmt: skip
    for folder in folders:
        stored_file = folder / FINGERPRINT_FILE
        stored = json.loads(stored_file.read_text()) if stored_file.is_file() else None
        steps = sorted(s for s in map(step_of, folder.iterdir()) if s is not None)
        damaged = [s for s in steps if checkpoint_problem(folder / f"{PREFIX}{s}")]
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(folder.stat().st_mtime))
        if stored is None:
            how = "no fingerprint.json"
        elif not current:
            how = "not compared (an input of the current params is missing)"
        elif (diff := differences(stored, current)):
            how = "differs: " + "; ".join(diff)
        else:
            how = "current params and inputs (resumed by the next run)"
        lines.append(f"  {folder.name}  {when}  checkpoints at steps {steps or 'none'}"
                     + (f" (damaged: {damaged})" if damaged else "") + f"\n      {how}")  # fmt: skip
    return "\n".join(lines)
