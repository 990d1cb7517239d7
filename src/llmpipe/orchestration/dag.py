"""llmpipe's stages of dvc.yaml, from the registry (`llmpipe.config.stages`): each stage's cmd, deps, params, outs,
metrics and plots, and the top-level charts. `llm-train dvc-yaml` writes them into dvc.yaml
(`llmpipe.orchestration.dvc_yaml`), so a stage's block is never copied by hand and cannot drift from the code.

A stage's code deps are the llmpipe packages its process imports (`llm-train --task <stage>`: `llmpipe.cli` and
the stage's module), read from the source's import statements the way Python runs them: module level only (a
function's import runs when it is called, not when its module loads), a package's ``__init__`` with every module
in it; plus `distributed`, which the CLI imports at run time for every task. A stage module and a top-level module
count by themselves, any other module as its package. `tests/unit/test_dag.py` checks the same set against a real
import.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Any

import llmpipe
from llmpipe.config.curves import Chart
from llmpipe.config.stages import METRICS_STAGES, REGISTRY, RL_TASKS, TRAINING_TASKS, report_params

PACKAGE = Path(llmpipe.__file__).parent
SRC = "src/llmpipe"
"""How dvc.yaml names the package's folder (from the repository root)."""

ALWAYS = ("distributed",)
"""Packages every task imports at run time (the CLI's launcher check), beyond what its modules import at load."""


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package: dotted name → file."""
    names = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts).removesuffix(".__init__")] = file
    return names


def _load_time_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module loads: at module level, in classes and in module-level
    control flow; not in functions, and not under ``if TYPE_CHECKING``."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return found


@cache
def _imports(name: str) -> frozenset[str]:
    """The package's modules that loading module `name` imports directly (with the packages above each)."""
    modules, file = _modules(), _modules()[name]
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    targets = []
    for node in _load_time_imports(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = set()
    for target in targets:
        parts = target.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules}
    return frozenset(found)


def loaded_modules(*roots: str) -> set[str]:
    """Every module of the package that importing `roots` loads."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            parts = name.split(".")
            todo += [*_imports(name), *(".".join(parts[:i]) for i in range(1, len(parts)))]
    return seen


def code_deps(task: str) -> list[str]:
    """The dvc.yaml code deps of `task` (module docstring), the package's files first, then its stage modules."""
    units = {f"{SRC}/{unit}" for unit in ALWAYS}
    for name in loaded_modules("llmpipe.cli", f"llmpipe.stages.{task}"):
        rel = _modules()[name].relative_to(PACKAGE).parts
        single = rel[0] == "stages" or len(rel) == 1
        units.add("/".join([SRC, *(rel if single else rel[:1])]))
    return sorted(units, key=lambda u: (u.startswith(f"{SRC}/stages/"), u))


def _uncached(path: str) -> dict[str, dict[str, bool]]:
    return {path: {"cache": False}}


def _log(stage: str, log: str) -> str:
    return f"${{paths.logs}}/{stage}/{log}.csv"


def _stage_plots(name: str) -> list[dict[str, Any]]:
    plots = []
    for plot in REGISTRY[name].curves.plots:
        props: dict[str, Any] = {"cache": False}
        if plot.title is not None:
            props["title"] = f"{name}: {plot.title}"
        props |= {"x": "step", "y": plot.y}
        if plot.title is not None:
            props |= {"x_label": "optimizer step", "y_label": plot.y_label}
        plots.append({_log(name, plot.log): props})
    return plots


def _outs(name: str) -> list[Any]:
    stage = REGISTRY[name]
    if stage.kind == "report":  # small files git keeps beside the metrics
        return [_uncached(out) for out in stage.outs]
    if stage.kind != "training":
        return list(stage.outs)
    logs = f"${{paths.logs}}/{name}"
    own = [f"{logs}/tensorboard", *([f"{logs}/samples.jsonl"] if stage.samples else []), f"{logs}/batches.csv"]
    return [stage.output, *own, *stage.outs]


def _metrics(name: str) -> list[dict[str, Any]]:
    kind = REGISTRY[name].kind
    if kind == "evaluation":
        return [_uncached("${paths.metrics}/eval/${item.model}.json")]
    if kind == "report":
        return [_uncached("${paths.metrics}/headline.json"), _uncached("${paths.metrics}/report.json")]
    return [_uncached(f"${{paths.metrics}}/{name}.json")]


def stage_block(name: str) -> dict[str, Any]:
    """The dvc.yaml stage `name`: cmd, deps (code, then inputs), params, outs, metrics, plots.

    Raises:
        KeyError: `name` is not a stage of dvc.yaml (a hand-run one, or unknown).
    """
    stage = REGISTRY[name]
    block: dict[str, Any] = {}
    cmd = f"llm-train --task {name}"
    if stage.kind == "evaluation":  # DVC cannot template a list into deps: one stage per model (evaluate@sft, …)
        block["matrix"] = {"model": "${eval.models}"}
        cmd += " --model ${item.model}"
    inputs = list(stage.inputs)
    if stage.kind == "report":  # every metrics file it reads, so a stage's new metrics rerun it
        inputs = ["${paths.metrics}/eval", *(f"${{paths.metrics}}/{s}.json" for s in METRICS_STAGES)]
    block |= {"cmd": cmd, "deps": code_deps(name) + inputs,
              "params": list(report_params() if stage.kind == "report" else stage.params)}
    if outs := _outs(name):
        block["outs"] = outs
    block["metrics"] = _metrics(name)
    if stage.kind == "training":
        block["plots"] = _stage_plots(name)
    return block


def _chart(y_label: str, columns: dict[str, str | list[str]]) -> dict[str, Any]:
    return {"x": "step", "x_label": "optimizer step", "y_label": y_label, "y": columns}


def _columns(name: str, chart: Chart) -> dict[str, str | list[str]]:
    """A chart's ``y``: per log file its column, or its columns as a list when it draws several of one file."""
    per_log: dict[str, list[str]] = {}
    for log, column in chart.columns:
        per_log.setdefault(_log(name, log), []).append(column)
    return {log: cols[0] if len(cols) == 1 else cols for log, cols in per_log.items()}


def _rl_charts(name: str) -> list[dict[str, Any]]:
    curves, unit = REGISTRY[name].curves, REGISTRY[name].kl_unit
    (reward, eval_reward), (length, eval_length, length_label) = curves.reward, curves.length
    evals = {_log(name, "eval"): eval_reward} if eval_reward else {}
    charts = [{f"{name} reward": _chart("mean reward", {_log(name, "train"): reward, **evals})},
              {f"{name} KL": _chart(f"KL to the reference ({unit})", {_log(name, "train"): curves.kl})}]
    evals = {_log(name, "eval"): eval_length} if eval_length else {}
    return [*charts, {f"{name} response length": _chart(length_label, {_log(name, "train"): length, **evals})}]


def plots_block() -> list[dict[str, Any]]:
    """The top-level plots: every training stage's charts, each RL stage's reward, KL and response length, and
    the validation loss of every stage that charts it."""
    charts = [{f"{name} {chart.name}": _chart(chart.y_label, _columns(name, chart))}
              for name in TRAINING_TASKS for chart in REGISTRY[name].curves.charts]
    charts += [chart for name in RL_TASKS for chart in _rl_charts(name)]
    across = {_log(name, "eval"): "eval_loss" for name in TRAINING_TASKS
              if any(("eval", "eval_loss") in chart.columns for chart in REGISTRY[name].curves.charts)}
    return [*charts, {"validation loss across stages": _chart("validation loss", across)}]
