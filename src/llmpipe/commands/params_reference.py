"""`llm-train params-reference [OUT]`: docs/params.md, the reference of every params.yaml key, generated from the
schema: each section's docstring, and per key its type (with its bounds), default and `Field` description, so that
they are written once, in code.

It writes ``docs/params.md`` by default; `tests/unit/test_params_reference.py` fails when the file and the schema
differ. Imports pydantic and the schema only (no torch).
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from llmpipe.config.params import Params
from llmpipe.config.stages import REGISTRY
from llmpipe.config.training import TrainParams
from llmpipe.core.io import atomic_file

DEFAULT_OUT = Path("docs/params.md")
COMMAND = "llm-train params-reference"


@dataclass
class Row:
    """One key of a section: its name and the three cells the table shows."""

    key: str
    type: str
    default: str
    description: str


@dataclass
class Block:
    """One section of params.yaml (top level or nested): its dotted path, its docstring, its keys, and the section
    whose keys it also has (a subclass: only its own keys and changed defaults are listed)."""

    path: str
    model: type[BaseModel]
    doc: str
    rows: list[Row] = field(default_factory=list)
    inherits: str | None = None


def sections_in(annotation: object) -> list[type[BaseModel]]:
    """The params sections a field's type holds: itself, an optional one, or the items of a list or mapping."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [s for arg in typing.get_args(annotation) for s in sections_in(arg)]


def _type_name(annotation: object, links: dict[type, str]) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [_type_name(a, links) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_name(args[0], links)}"
    if origin is dict:
        return f"mapping of {_type_name(args[0], links)} to {_type_name(args[1], links)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        path = links[annotation]
        return f"section [{path}](#{_anchor(path)})"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = ((at.Gt, "gt", ">"), (at.Ge, "ge", "≥"), (at.Lt, "lt", "<"), (at.Le, "le", "≤"))


def _bounds(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        parts += [f"{sign} {getattr(meta, attr)}" for kind, attr, sign in _BOUNDS if isinstance(meta, kind)]
        if isinstance(meta, at.MinLen):
            parts.append(f"at least {meta.min_length} long")
    return f", {', '.join(parts)}" if parts else ""


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "—"
    plain = [v.model_dump() if isinstance(v, BaseModel) else v for v in value] if isinstance(value, list) else value
    text = yaml.safe_dump(plain, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return f"`{text.removesuffix('...').strip()}`"


def _plain(text: str) -> str:
    """Sphinx roles (``:mod:`x` ``) as the plain code spans markdown shows."""
    return re.sub(r":(?:mod|class|func|data|meth|attr):`~?", "`", text)


def _cell(text: str) -> str:
    return _plain(" ".join(text.split())).replace("|", "\\|")


def _anchor(path: str) -> str:
    """GitHub's id of a heading with this text: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


def _same(a: FieldInfo, b: FieldInfo) -> bool:
    return (a.annotation, a.description, a.metadata, repr(a.get_default(call_default_factory=True))) == (
        b.annotation, b.description, b.metadata, repr(b.get_default(call_default_factory=True)))


def blocks() -> list[Block]:
    """Every section of :class:`Params`, parents before the sections they hold, in the order params.yaml has them.

    A section whose class was listed already (``sft.peft`` is ``train.peft``'s class) is not listed again; its key's
    type links to the first. A subclass of a listed section (``sft`` of ``train``) lists only its own keys and the
    ones it declares anew.
    """
    links: dict[type, str] = {}
    out: list[Block] = []

    def visit(model: type[BaseModel], path: str) -> None:
        links[model] = path
        base = next((b for b in model.__mro__[1:] if b in links), None)
        block = Block(path, model, _plain(inspect.cleandoc(model.__doc__ or "")), inherits=links.get(base))
        out.append(block)
        nested = []
        for name, info in model.model_fields.items():
            if base is not None and name in base.model_fields and _same(info, base.model_fields[name]):
                continue
            for section in sections_in(info.annotation):
                if section not in links:
                    suffix = "" if section is info.annotation or _is_optional(info.annotation) else " (each)"
                    links[section] = f"{path}.{name}{suffix}"
                    nested.append(section)
            held = sections_in(info.annotation)
            description = info.description or (inspect.getdoc(held[0]) if held else "").split("\n\n")[0]
            block.rows.append(Row(name, _type_name(info.annotation, links) + _bounds(info), _default(info),
                                  _cell(description)))
        for section in nested:
            visit(section, links.pop(section))

    for name, info in Params.model_fields.items():
        visit(info.annotation, name)
    return out


def _is_optional(annotation: object) -> bool:
    return type(None) in typing.get_args(annotation)


def _training_sections() -> list[str]:
    return [name for name, info in Params.model_fields.items()
            if issubclass(info.annotation, TrainParams) and info.annotation is not TrainParams]


def render() -> str:
    """The whole of docs/params.md."""
    sections = blocks()
    lines = [
        "# params.yaml reference",
        "",
        f"Generated from the schema (`llmpipe.config`) by `{COMMAND}`: edit the `Field` descriptions",
        "and section docstrings there, then rerun it (`tests/unit/test_params_reference.py` fails while this file is",
        "stale). How the sections work together, with examples: [params-guide.md](params-guide.md).",
        "",
        f"A training stage's section ({', '.join(f'`{n}`' for n in _training_sections())}) has every key of `train`",
        "as well: a key it leaves unset takes the value under `train` (`peft` only in the stages that take an",
        "adapter), else the stage's own default, listed under it. A choice lists its values: `sdpa` | `eager`.",
        "",
        "Sections: " + ", ".join(f"[{b.path}](#{_anchor(b.path)})" for b in sections if "." not in b.path) + ".",
    ]
    for block in sections:
        lines += ["", f"{'#' * min(2 + block.path.count('.'), 4)} {block.path}", ""]
        if block.doc:
            lines += [block.doc, ""]
        if block.inherits:
            lines += [f"Every key of [{block.inherits}](#{_anchor(block.inherits)}) too; below, the keys of its own and "
                      "the defaults it changes.", ""]
        if parent := getattr(REGISTRY.get(block.path), "inherits", None):
            lines += [f"A key it shares with [{parent}](#{_anchor(parent)}) and leaves unset takes the value under "
                      f"`{parent}` (params.yaml's, or an override's) before `train`'s.", ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{r.key}` | {r.type} | {r.default} | {r.description} |" for r in block.rows]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`llm-train params-reference` flags."""
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"where to write (default {DEFAULT_OUT})")


def run(args: argparse.Namespace) -> int:
    """Write the reference to ``args.out``, atomically."""
    with atomic_file(args.out) as fh:
        fh.write(render())
    print(f"wrote {args.out}")
    return 0
