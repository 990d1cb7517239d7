"""Functions with a docstring cut out of Python source: the unit of the stdlib SFT, preference and MC data."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Function:
    """One function or method, split into what a model is shown and what it should write.

    Text fields have no trailing newline, and ``prompt + "\\n" + body`` is the function's source (dedented).

    Attributes:
        name: Qualified name, e.g. ``Path.read_text`` or ``outer.<locals>.inner``.
        source: Relative path of the module it comes from.
        signature: The ``def`` line(s), as in the source, dedented to column 0.
        docstring: The docstring text, cleaned (``ast.get_docstring``).
        prompt: The ``def`` line(s) plus the docstring exactly as in the source, dedented to column 0.
        body: The lines after the docstring, dedented the same way (indented by 4 under a top-level def).
        num_body_lines: Lines in `body`.
    """

    name: str
    source: str
    signature: str
    docstring: str
    prompt: str
    body: str
    num_body_lines: int


def extract_functions(source: str, tree: ast.Module, path: str) -> list[Function]:
    """Every function or method of a module with a docstring and a body after it, in source order.

    Functions whose docstring shares a line with the ``def`` or with the first statement, or whose text
    does not dedent to column 0 (a multi-line string less indented than the ``def``), are left out.

    Args:
        source: The module text, with ``\\n`` line ends.
        tree: ``ast.parse(source)``.
        path: The module's relative path, recorded in :attr:`Function.source`.
    """
    lines = source.split("\n")
    found = (_cut(lines, node, name, path) for name, node in _walk(tree, ""))
    return [fn for fn in found if fn is not None]


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")
"""Fields holding statement lists: the only places a ``def`` can be (expressions never hold one)."""


def _walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    children = (c for f in _BLOCKS for c in getattr(node, f, None) or () if isinstance(c, ast.AST))
    for child in children:
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + child.name, child
            yield from _walk(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, f"{prefix}{child.name}.")
        else:
            yield from _walk(child, prefix)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _first_line(stmt: ast.stmt) -> int:
    decorators = getattr(stmt, "decorator_list", [])
    return min([stmt.lineno, *(d.lineno for d in decorators)])


def _cut(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, name: str, path: str) -> Function | None:
    body = node.body
    if len(body) < 2 or not _is_docstring(body[0]):
        return None
    doc = body[0]
    if doc.lineno <= node.lineno or _first_line(body[1]) <= doc.end_lineno:
        return None
    text = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    if text[:1].isspace():
        return None
    own = text.split("\n")
    num_header = doc.lineno - node.lineno
    num_prompt = doc.end_lineno - node.lineno + 1
    rest = own[num_prompt:]
    while rest and not rest[0].strip():
        rest.pop(0)
    prompt, body_text = "\n".join(own[:num_prompt]), "\n".join(rest).rstrip()
    try:
        ast.parse(prompt + "\n" + body_text)
    except SyntaxError:
        return None
    return Function(
        name=name,
        source=path,
        signature="\n".join(own[:num_header]).rstrip(),
        docstring=ast.get_docstring(node) or "",
        prompt=prompt,
        body=body_text,
        num_body_lines=body_text.count("\n") + 1,
    )
