"""The stages a `full-pipeline` run executes, read from DVC's own stage graph (dvc.yaml is the only list)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class PlannedStage:
    """One DVC stage to run, with what it writes."""

    name: str
    """DVC addressing, e.g. `pretrain` or `evaluate@sft`."""
    outs: tuple[str, ...]
    """Output paths (models, data, report), relative to the working copy."""
    metrics: tuple[str, ...]
    """Metrics files, relative to the working copy."""


def stage_plan(workdir: Path, targets: list[str] | None = None) -> list[PlannedStage]:
    """The stages to run, in topological order, read from DVC's stage graph.

    Args:
        workdir: The repository (or working copy) whose dvc.yaml is read.
        targets: Stage names (`pretrain`, `evaluate@sft`, or a matrix group like `evaluate`); each brings
            the stages it needs. None: every stage.

    Raises:
        ValueError: A target is not a stage of dvc.yaml (the message lists the stages).
    """
    import networkx as nx
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    workdir = workdir.resolve()
    with Repo(str(workdir)) as repo:
        graph = repo.index.graph  # an edge points from a stage to a stage it depends on
        position = {stage: i for i, stage in enumerate(graph.nodes)}  # dvc.yaml order breaks ties
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=False), key=position.__getitem__))
        if targets:
            wanted = set()
            for target in targets:
                try:
                    wanted.update(repo.stage.collect(f"{workdir / 'dvc.yaml'}:{target}", with_deps=True, graph=graph))
                except DvcException as err:
                    known = ", ".join(_stage_name(s, workdir) for s in order)
                    raise ValueError(f"stages: {target!r} is not a stage of dvc.yaml ({err}); stages: {known}") from err
            order = [s for s in order if s in wanted]
        return [
            PlannedStage(
                name=_stage_name(s, workdir),
                outs=tuple(str(o.def_path) for o in s.outs if not o.metric and not o.plot),
                metrics=tuple(str(o.def_path) for o in s.outs if o.metric),
            )
            for s in order
        ]


def _stage_name(stage: Any, workdir: Path) -> str:
    """`pretrain`, `evaluate@sft`; `sub/dvc.yaml:name` for a stage of a dvc.yaml below the root."""
    dvcfile = Path(stage.path)
    return stage.name if dvcfile.parent == workdir else f"{dvcfile.relative_to(workdir)}:{stage.name}"
