"""docs/params.md is what the schema generates now, and it lists every key of every params section."""

from __future__ import annotations

from conftest import ROOT
from pydantic import BaseModel

from llmpipe.commands import main as command
from llmpipe.commands import params_reference as reference
from llmpipe.commands.params_reference import sections_in
from llmpipe.config import Params


def test_docs_params_md_is_up_to_date():
    committed = (ROOT / "docs" / "params.md").read_text()
    assert committed == reference.render(), (
        f"docs/params.md is stale (a params Field, its default or a section docstring changed): run "
        f"`{reference.COMMAND}` from the repository root and commit docs/params.md"
    )


def test_every_key_of_every_section_has_its_row():
    blocks = {b.model: b for b in reference.blocks()}
    by_path = {b.path: b for b in blocks.values()}

    def listed(block) -> set[str]:  # its own rows and, for a subclass, those of the section it extends
        return {r.key for r in block.rows} | (listed(by_path[block.inherits]) if block.inherits else set())

    todo: list[type[BaseModel]] = [Params]
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        seen.add(model)
        if model is not Params:
            assert model in blocks, f"no section of docs/params.md lists {model.__name__}'s keys"
            missing = set(model.model_fields) - listed(blocks[model])
            assert not missing, f"{blocks[model].path}: keys missing from docs/params.md: {sorted(missing)}"
        todo += [s for f in model.model_fields.values() for s in sections_in(f.annotation) if s not in seen]
    assert len(seen) == len(blocks) + 1  # no section listed that the schema does not hold


def test_the_command_writes_the_file(tmp_path):
    assert command(["params-reference", str(tmp_path / "params.md")]) == 0
    assert (tmp_path / "params.md").read_text() == reference.render()
