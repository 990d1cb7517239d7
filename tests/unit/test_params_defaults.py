"""The code's defaults are the shipped params.yaml: `Params()` (every pydantic `Field` default) equals the
validated file leaf by leaf, so a test's partial `parse_params({...})` and a user's short params.yaml train like
the default run wherever they say nothing."""

from __future__ import annotations

from typing import Any

import yaml
from conftest import ROOT

from llmpipe.config import Params, parse_params
from llmpipe.config import stages as registry

NOT_COMPARED: frozenset[str] = frozenset()
"""Dotted keys whose code default deliberately differs from the shipped file, each with its reason in a comment.
None at present: every stage section's own values are its params class's defaults (`SFTParams.lr` is 3e-4)."""


def leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"sft.lr": 0.0003, ...}``: every leaf of a dumped params mapping under its dotted key (lists are leaves)."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(leaves(value, f"{prefix}.{key}" if prefix else key))
    return out


def test_code_defaults_are_the_shipped_params():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    shipped = leaves(parse_params(raw).model_dump())  # stage sections after the `train` merge
    code = leaves(Params().model_dump())
    missing = [s for s in ("train", *registry.TRAINING_TASKS) if s not in raw]
    assert not missing, f"params.yaml has no section for {missing}: add one (with every key whose value is its own)"
    differ = [
        f"{key}: params.yaml {shipped[key]!r}, code {code[key]!r}"
        for key in shipped
        if key not in NOT_COMPARED and shipped[key] != code[key]
    ]
    assert not differ, (
        "code defaults differ from params.yaml: make them agree, either in params.yaml (a stage section's own key, "
        "else the value it inherits from train:) or in the section's Field default in src/llmpipe/config/:\n"
        + "\n".join(differ)
    )


def test_exceptions_name_real_keys():
    """A renamed key must not leave a stale exception behind that silently compares nothing."""
    assert NOT_COMPARED <= leaves(Params().model_dump()).keys()
