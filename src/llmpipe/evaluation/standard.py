"""lm-eval's own tasks in ``eval.tasks`` (hellaswag, arc_easy, gsm8k, mmlu and its subtasks …): their data found
offline before any model loads, from a local copy (``eval.task_data``) or the Hugging Face cache.

A task with a local copy gets a YAML of its own in the work folder, under lm-eval's name for it, that includes
lm-eval's YAML by absolute path and changes only where the data comes from (``dataset_path``, ``dataset_name``,
``dataset_kwargs``): prompts, choices, metrics, filters and ``!function`` hooks stay lm-eval's. lm-eval's index lets
an ``include_path`` task replace a built-in one of the same name, and groups and tags name their tasks, so
``mmlu`` picks the copies of its subtasks up. The same folder given to ``lm_eval --include_path`` runs the same
tasks on the same files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from llmpipe.core.errors import UserError
from llmpipe.evaluation.harness import quiet_lm_eval, task_manager
from llmpipe.evaluation.tasks import LOCAL_TASKS

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""A local copy's file suffix → the `datasets` builder that reads it (one builder per task: one format)."""

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
"""The keys of an lm-eval task config that name the splits it reads (lm-eval opens each while building the task)."""


def standard_names(names: Sequence[str]) -> list[str]:
    """The names in `names` that are not llmpipe tasks: lm-eval's own tasks, groups and tags."""
    return [n for n in names if n not in LOCAL_TASKS]


def leaf_tasks(manager, name: str) -> list[str]:
    """The tasks `name` stands for in `manager`'s index: itself, a tag's tasks, or a group's members, recursively.

    Read from the index, as lm-eval's factory resolves them by name (building them would load their data).
    Members defined inline in a group's YAML have no name of their own in the index and are left out.
    """
    entry = manager.task_index.get(name)
    if entry is None:
        return []
    if entry.kind.name == "TAG":
        return sorted(entry.tags)
    if entry.kind.name != "GROUP":
        return [name]
    out: list[str] = []
    for member in (entry.cfg or {}).get("task", []):
        ref = member if isinstance(member, str) else member.get("group") or member.get("task")
        if isinstance(ref, str) and ref != name:
            out += leaf_tasks(manager, ref)
    return list(dict.fromkeys(out))


def split_files(source: str | Mapping[str, str], dataset_name: str | None, key: str) -> dict[str, list[Path]]:
    """The files of each split of a local copy (one ``eval.task_data`` entry).

    A folder holds one or more files per split, named by it (``test.jsonl``, ``test-00000-of-00001.parquet``:
    the split is the name up to the first ``-`` or ``.``); when it has a ``<dataset_name>/`` subfolder (a Hub
    download of a dataset with several configs, as allenai/ai2_arc and cais/mmlu are laid out), that is read.
    `datasets`' own inference of splits from file names is not used: it maps ``dev`` to ``validation``, where
    lm-eval's configs name ``dev`` (mmlu's few-shot split).

    Raises:
        UserError: A missing folder or file, no file of a known format, or several formats; names
            ``eval.task_data.<key>``.
    """
    where = f"eval.task_data.{key}"
    if isinstance(source, Mapping):
        files = {split: [Path(path)] for split, path in source.items()}
    else:
        folder = Path(source)
        if dataset_name and (folder / dataset_name).is_dir():
            folder = folder / dataset_name
        if not folder.is_dir():
            raise UserError(f"{where}: {folder} is not a folder; give a folder of split files (test.jsonl, …) "
                            "or {split: file}")  # fmt: skip
        files = {}
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.suffix in FORMATS:
                files.setdefault(re.split(r"[-.]", path.name, maxsplit=1)[0], []).append(path)
        if not files:
            raise UserError(f"{where}: {folder} holds no {'/'.join(FORMATS)} file named by its split (test.jsonl, …)")
    for path in (p for paths in files.values() for p in paths):
        if not path.is_file():
            raise UserError(f"{where}: {path} does not exist")
        if path.suffix not in FORMATS:
            raise UserError(f"{where}: {path}: not a {'/'.join(FORMATS)} file")
    if len(kinds := {FORMATS[p.suffix] for paths in files.values() for p in paths}) > 1:
        raise UserError(f"{where}: files of several formats ({', '.join(sorted(kinds))}); give one format")
    return {split: [p.resolve() for p in paths] for split, paths in files.items()}


def redirect_config(manager, task: str, files: Mapping[str, Sequence[Path]], cache_dir: Path, key: str) -> str:
    """The YAML of lm-eval's `task` with its data read from `files` (absolute paths) instead.

    Raises:
        UserError: The local copy lacks a split the task's config names (lm-eval opens every one it names
            while building the task); names ``eval.task_data.<key>``.
    """
    import lm_eval

    entry = manager.task_index[task]
    if entry.yaml_path is None:
        raise UserError(f"eval.task_data.{key}: lm-eval's task {task} has no YAML config (a Python task) whose "
                        "data could be redirected; put its dataset in the Hugging Face cache instead")  # fmt: skip
    config = entry.cfg or {}
    needed = list(dict.fromkeys(config[k] for k in SPLIT_KEYS if config.get(k)))
    if missing := [s for s in needed if s not in files]:
        raise UserError(f"eval.task_data.{key}: lm-eval's task {task} reads split(s) {', '.join(needed)} "
                        f"({', '.join(k for k in SPLIT_KEYS if config.get(k))}); the local copy has "
                        f"{', '.join(files)}: add {', '.join(missing)}")  # fmt: skip
    (builder,) = {FORMATS[p.suffix] for paths in files.values() for p in paths}
    override: dict[str, Any] = {
        "include": str(Path(entry.yaml_path).resolve()),
        "task": task,
        "tag": [],  # its tags stay lm-eval's (a tag here would replace lm-eval's tag with this one task)
        "dataset_path": builder,
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {s: [str(p) for p in files[s]] for s in needed},
                           "cache_dir": str(cache_dir.resolve())},
    }  # fmt: skip
    head = (f"# lm-eval {lm_eval.__version__}'s task {task}, its data from eval.task_data.{key} (llmpipe); "
            "everything else as lm-eval defines it\n")  # fmt: skip
    return head + yaml.safe_dump(override, sort_keys=False, allow_unicode=True)


def write_redirects(manager, names: Sequence[str], task_data: Mapping[str, Any], work_dir: Path) -> list[str]:
    """Write ``<task>.yaml`` into `work_dir` for each standard task that ``eval.task_data`` gives a local copy.

    An entry names a task of `names`, or a group or tag of `names` (then it stands for each of its tasks that
    has no entry of its own; the most specific entry wins).

    Returns:
        The tasks redirected.

    Raises:
        UserError: An entry names no standard task of ``eval.tasks``, or a copy is unusable (:func:`split_files`,
            :func:`redirect_config`).
    """
    wanted = {leaf for name in names for leaf in leaf_tasks(manager, name)}
    owner: dict[str, str] = {}
    for key in sorted(task_data, key=lambda k: -len(leaf_tasks(manager, k))):  # the broadest first: overwritten
        leaves = [t for t in leaf_tasks(manager, key) if t in wanted]
        if not leaves:
            raise UserError(f"eval.task_data.{key}: not a standard task of eval.tasks ({', '.join(names) or 'none'}) "
                            "nor a task of one of its groups; add it to eval.tasks or remove the entry")  # fmt: skip
        owner |= dict.fromkeys(leaves, key)
    for task, key in owner.items():
        files = split_files(task_data[key], (manager.task_index[task].cfg or {}).get("dataset_name"), key)
        (work_dir / f"{task}.yaml").write_text(redirect_config(manager, task, files, work_dir / "hf_cache", key))
    return sorted(owner)


def check_available(manager, names: Sequence[str]) -> None:
    """Build each standard task of `names` (which loads its data, as `simple_evaluate` will) before the model loads.

    Raises:
        UserError: A task's data is neither in a local copy nor in the Hugging Face cache (offline) or cannot be
            read; names the task, its dataset and both ways to provide it.
    """
    for name in names:
        for task in leaf_tasks(manager, name) or [name]:
            try:
                with quiet_lm_eval():
                    manager.load([task])
            except OSError as err:  # datasets offline: ConnectionError; absent files: FileNotFoundError
                config = manager.task_index[task].cfg or {}
                path, config_name = config.get("dataset_path"), config.get("dataset_name")
                dataset = f"{path}{f' ({config_name})' if config_name else ''}"
                fetch = ", ".join(repr(a) for a in (path, config_name) if a)
                splits = ", ".join(dict.fromkeys(config[k] for k in SPLIT_KEYS if config.get(k)))
                raise UserError(
                    f"eval.tasks: {name}: lm-eval's task {task} reads dataset {dataset}, which cannot be loaded "
                    f"({type(err).__name__}: {err}); give a local copy in eval.task_data ({task}: a folder with a "
                    f"file per split {splits}, e.g. {splits.split(', ')[0]}.jsonl, rows in the dataset's columns; "
                    f"or {{split: file}}), or put the dataset in the Hugging Face cache (online, once: python -c "
                    f"\"import datasets; datasets.load_dataset({fetch})\")"
                ) from None


def prepare(manager, names: Sequence[str], task_data: Mapping[str, Any], work_dir: str | Path):
    """Redirect the standard tasks of `names` that have local copies (:func:`write_redirects`) and check that
    every standard task's data loads (:func:`check_available`); the `TaskManager` to evaluate with.

    Args:
        manager: From :func:`llmpipe.evaluation.harness.task_manager` over `work_dir`.
        names: ``eval.tasks`` as evaluated (llmpipe tasks are left alone).
        task_data: ``eval.task_data``.
        work_dir: The folder of the rendered tasks (lm-eval's ``include_path``).

    Raises:
        UserError: See :func:`write_redirects` and :func:`check_available`; ``eval.task_data`` given while
            ``eval.tasks`` has no standard task.
    """
    standard = standard_names(names)
    if task_data and not standard:
        raise UserError(f"eval.task_data: {', '.join(task_data)} given, but eval.tasks has no standard lm-eval task; "
                        "add the tasks to eval.tasks or remove eval.task_data")  # fmt: skip
    if task_data and write_redirects(manager, standard, task_data, Path(work_dir)):
        manager = task_manager(names, work_dir)  # indexed again, to see the redirected tasks
    check_available(manager, standard)
    return manager
