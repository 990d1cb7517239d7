"""The stage registry agrees with the params schema, and every list of stages derives from it."""

from __future__ import annotations

import pytest

from llmpipe import stages
from llmpipe.config import Params, TrainParams, parse_params


def test_every_training_stage_has_its_section_in_params():
    for name in stages.TRAINING_TASKS:
        field = Params.model_fields.get(name)
        assert field is not None, f"add `{name}: {stages.REGISTRY[name].section.__name__}` to Params (config/params.py)"
        assert field.annotation is stages.REGISTRY[name].section, f"Params.{name} is not the registry's section class"


def test_every_section_that_inherits_train_is_a_registered_training_stage():
    inheriting = {n for n, f in Params.model_fields.items() if n != "train" and issubclass(f.annotation, TrainParams)}
    assert inheriting == set(stages.TRAINING_TASKS), (
        f"register {sorted(inheriting - set(stages.TRAINING_TASKS))} as training stages in llmpipe/stages/__init__.py"
    )


@pytest.mark.parametrize("name", stages.TRAINING_TASKS)
def test_training_sections_inherit_train(name):
    params = parse_params({"train": {"lr": 0.123, "seed": 7}})
    assert params.stage(name).lr == 0.123 and params.stage(name).seed == 7


def test_derived_lists_follow_the_registry():
    kinds = {name: s.kind for name, s in stages.REGISTRY.items()}
    assert set(stages.TRAINING_TASKS) == {n for n, k in kinds.items() if k == "training"}
    assert "regression" not in stages.DVC_STAGES and "evaluate" in stages.DVC_STAGES
    assert set(stages.METRICS_STAGES) == {n for n, k in kinds.items() if k in ("data", "training")}
    assert stages.resolve("lm") == "pretrain"
    with pytest.raises(ValueError, match="registered tasks"):
        stages.resolve("nope")


def test_input_paths_resolve_params_templates():
    params = parse_params({"grpo": {"policy": "dpo"}, "paths": {"models": "m"}})
    assert [str(p) for p in stages.input_paths("grpo", params)] == ["data/sft", "artifacts/tokenizer", "m/dpo"]
