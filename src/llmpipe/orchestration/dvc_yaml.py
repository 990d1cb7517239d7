"""dvc.yaml with llmpipe's blocks rendered from the registry (`llmpipe.orchestration.dag`) and everything else kept as
written: the comments above a stage, the users' own stages and plots (at their place: after the stage they follow),
and any other top-level section. `llm-train dvc-yaml --write` rewrites the file; ``--check`` (and a fast test) fails
while it differs from its rendering.

dvc.yaml is read as text, section by section (a top-level key at column 0), stage by stage (a key indented two
spaces under ``stages:``) and chart by chart (``  - name:`` under ``plots:``); comment lines directly above one
belong to it. YAML is written with PyYAML, sequences indented under their key.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmpipe.config.stages import DVC_STAGES
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_file
from llmpipe.orchestration.dag import plots_block, stage_block

_SECTION = re.compile(r"^([A-Za-z_][\w-]*):")
_STAGE = re.compile(r"^  ([^\s#-][^:]*):\s*$")
_CHART = re.compile(r"^  - (.+?):\s*$")

PLOTS_NOTE = """\
# Top-level plots (`dvc plots show`, `dvc plots diff <exp>`): per stage its loss (training and validation on one
# chart) and learning rate, for the RL stages reward, KL and response length; validation loss across stages. The
# files are the training stages' plots outputs above (tokens/s and the validation curves alone are drawn from those).
"""
"""The comment above a new ``plots:`` section."""


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper with a list indented under its key, as dvc.yaml is written."""

    def increase_indent(self, flow: bool = False, indentless: bool = False):
        return super().increase_indent(flow, False)


def dump(value: Any, indent: int) -> str:
    """`value` as block YAML, every line indented by `indent` spaces."""
    text = yaml.dump(value, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)
    return "".join(" " * indent + line if line.strip() else line for line in text.splitlines(keepends=True))


@dataclass
class Chunk:
    """A stage or chart as written: its name, the comment lines above it, and its text (name line included)."""

    name: str | None
    comments: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "".join(self.comments + self.lines).rstrip("\n") + "\n"


def split(lines: list[str], header: re.Pattern[str]) -> list[Chunk]:
    """`lines` cut before every `header` line; the comment lines right above a header go with it. A first chunk
    without a name holds what comes before the first header."""
    chunks, pending = [Chunk(None)], []
    for line in lines:
        match = header.match(line)
        if match:
            while pending and not pending[0].strip():  # blank lines separate; comments and what follows stay
                pending.pop(0)
            chunks.append(Chunk(match.group(1).strip(), pending, [line]))
            pending = []
        elif not line.strip() or line.lstrip().startswith("#"):
            pending.append(line)
        else:
            chunks[-1].lines += pending + [line]
            pending = []
    chunks[-1].lines += [p for p in pending if p.strip()]
    return chunks


def merge(chunks: list[Chunk], ours: dict[str, str]) -> list[str]:
    """The chunks' texts with ours (name → rendered text) in our order, each of theirs after the chunk it followed
    (theirs before all of ours first); a chunk of ours keeps the comments written above it."""
    comments = {c.name: c.comments for c in chunks if c.name in ours}
    after: dict[str | None, list[str]] = {None: []}
    last = None
    for chunk in chunks:
        if chunk.name in ours:
            last = chunk.name
        elif chunk.name is not None or "".join(chunk.lines).strip():
            after.setdefault(last, []).append(chunk.text())
    texts = list(after[None])
    for name, text in ours.items():
        texts += ["".join(comments.get(name, [])) + text, *after.get(name, [])]
    return texts


def render(text: str) -> str:
    """dvc.yaml `text` with llmpipe's stages and charts rendered (module docstring).

    Raises:
        UserError: `text` is not YAML.
    """
    try:
        yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UserError(f"dvc.yaml is not valid YAML: {' '.join(str(err).split())}") from None
    sections = split(text.splitlines(keepends=True), _SECTION)
    preamble, named = sections[0], {s.name: s for s in sections[1:]}
    stages = {name: dump({name: stage_block(name)}, 2) for name in DVC_STAGES}
    charts = {next(iter(c)): dump([c], 2) for c in plots_block()}
    own = named.get("stages", Chunk("stages", [], ["stages:\n"]))
    plots = named.get("plots", Chunk("plots", PLOTS_NOTE.splitlines(keepends=True), ["plots:\n"]))
    body = {
        "stages": "".join(own.comments) + "stages:\n" + "\n".join(merge(split(own.lines[1:], _STAGE), stages)),
        "plots": "".join(plots.comments) + "plots:\n" + "".join(merge(split(plots.lines[1:], _CHART), charts)),
    }
    out = [preamble.text()] if "".join(preamble.lines).strip() else []
    order = [s.name for s in sections[1:]] + [n for n in body if n not in named]
    out += [body[name] if name in body else named[name].text() for name in order]
    return "\n".join(out)


def difference(path: Path) -> str:
    """How `path` differs from its rendering, as a unified diff; empty when it is as rendered.

    Raises:
        UserError: No such file, or not YAML.
    """
    if not path.is_file():
        raise UserError(f"{path}: no such file; run from the repository root or pass --path")
    text = path.read_text()
    return "".join(difflib.unified_diff(text.splitlines(keepends=True), render(text).splitlines(keepends=True),
                                        f"{path} (as written)", f"{path} (rendered)"))  # fmt: skip


def write(path: Path) -> bool:
    """Rewrite `path` as rendered (atomically); whether it changed.

    Raises:
        UserError: No such file, or not YAML.
    """
    if not difference(path):
        return False
    with atomic_file(path) as fh:
        fh.write(render(path.read_text()))
    return True
