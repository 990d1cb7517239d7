"""The stage registry agrees with the params schema, and every list of stages derives from it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

from llmpipe.config import EvalParams, Params, ParamsError, TrainParams, parse_params
from llmpipe.config import stages as registry


def test_params_has_every_training_stages_section_in_pipeline_order():
    sections = [n for n, f in Params.model_fields.items() if issubclass(f.annotation, TrainParams) and n != "train"]
    assert sections == list(registry.TRAINING_TASKS)
    assert all(Params.model_fields[n].annotation is registry.REGISTRY[n].section for n in sections)


def test_every_stage_module_is_registered():
    modules = {f.stem for f in (ROOT / "src" / "llmpipe" / "stages").glob("*.py")} - {"__init__", "base"}
    unregistered = sorted(modules - set(registry.REGISTRY))
    assert not unregistered, (f"register {unregistered} in REGISTRY (src/llmpipe/config/stages.py: _training(...) or "
                              "_rl(...), docs/ARCHITECTURE.md)")


@pytest.mark.parametrize("name", registry.TRAINING_TASKS)
def test_training_sections_inherit_train(name):
    params = parse_params({"train": {"lr": 0.123, "seed": 7}})
    assert params.stage(name).lr == 0.123 and params.stage(name).seed == 7


def test_derived_lists_follow_the_registry():
    kinds = {name: s.kind for name, s in registry.REGISTRY.items()}
    assert set(registry.TRAINING_TASKS) == {n for n, k in kinds.items() if k == "training"}
    assert "regression" not in registry.DVC_STAGES and "evaluate" in registry.DVC_STAGES
    assert set(registry.METRICS_STAGES) == {n for n, k in kinds.items() if k in ("data", "training")}
    assert registry.resolve("lm") == "pretrain"
    with pytest.raises(ValueError, match="registered tasks"):
        registry.resolve("nope")


def test_input_paths_resolve_params_templates():
    params = parse_params({"grpo": {"policy": "dpo"}, "paths": {"models": "m"}})
    assert [str(p) for p in registry.input_paths("grpo", params)] == ["data/sft", "artifacts/tokenizer", "m/dpo"]


@pytest.mark.parametrize("name", registry.RL_TASKS)
def test_an_rl_stage_gets_its_checks_headline_figure_and_evaluation_from_its_traits(name):
    from llmpipe.evaluation.task_checks import run_task_checks
    from llmpipe.stages.report import RL_KL_UNITS, input_models, kl_targets

    params = parse_params({})
    metrics = [c.metric for c in run_task_checks({}, {}, input_models(params), kl_targets(params))]
    assert {f"check_{name}_pass1_delta", f"check_{name}_distinct_delta", f"check_{name}_bpb_ratio"} <= set(metrics)
    assert f"check_{name}_reward_gain_se" not in metrics, "its own training reward is shown, never a check"
    assert (f"{name}_reward", "stage", name, "eval_reward") in registry.HEADLINE
    assert RL_KL_UNITS[name] == registry.REGISTRY[name].kl_unit  # its RL figure and the report's RL table
    assert name in EvalParams().models and registry.REGISTRY[name].best_metric == ("eval_reward", True)
    has_target = "kl_target" in registry.REGISTRY[name].section.model_fields
    assert (f"check_{name}_kl_ratio" in metrics) == has_target == (f"{name}.kl_target" in registry.report_params())


def test_a_verifiable_rl_stage_gets_the_generation_headline():
    for name in registry.VERIFIABLE_TASKS:
        assert {f"{name}_gen_score", f"{name}_distinct"} <= {key for key, *_ in registry.HEADLINE}


def test_an_rl_stage_rewarded_by_the_tasks_tests_keeps_the_best_checkpoint_by_them():
    from llmpipe.config import RewardSpec
    from llmpipe.config.stages import SELECTION_REWARD
    from llmpipe.train.arguments import training_kwargs

    params = parse_params({})
    for name in registry.RL_TASKS:
        section = params.stage(name)
        assert registry.best_metric(name, section) == registry.REGISTRY[name].best_metric
        tests_pass = RewardSpec(name=SELECTION_REWARD, weight=1.0)
        rewarded = section.model_copy(update={"rewards": [*section.rewards, tests_pass]})
        assert registry.best_metric(name, rewarded) == (f"eval_rewards/{SELECTION_REWARD}/mean", True)
    sft = params.stage("sft")
    assert registry.best_metric("sft", sft) == ("eval_loss", False)
    grpo = params.grpo.model_copy(update={"rewards": [RewardSpec.model_construct(name=SELECTION_REWARD, weight=1.0)]})
    kwargs = training_kwargs(params.model_copy(update={"grpo": grpo}), "grpo", Path("run"))
    assert (kwargs["metric_for_best_model"], kwargs["greater_is_better"]) == ("eval_rewards/tests_pass/mean", True)


def test_a_section_with_rewards_is_an_rl_stage_and_a_group_section_is_grouped():
    from llmpipe.config.rl import GroupParams

    for name in registry.TRAINING_TASKS:
        stage = registry.REGISTRY[name]
        rewarded = "rewards" in stage.section.model_fields
        assert stage.rl == rewarded, (f"{name}: its section {'has' if rewarded else 'has no'} rewards; register it "
                                      f"with {'_rl(..., kl_unit=...)' if rewarded else '_training'} in config/stages.py")
        assert stage.grouped == issubclass(stage.section, GroupParams), f"{name}: grouped is for GroupParams sections"


def test_group_rules_name_each_grouped_section():
    for name in registry.GROUPED_TASKS:
        with pytest.raises(ParamsError, match=rf"{name}\.save_steps \(3\) × {name}\.gradient_accumulation_steps"):
            parse_params({name: {"save_steps": 3, "steps_per_generation": 2}})


@pytest.mark.parametrize("name", registry.REGISTRY)
def test_every_registered_stage_has_its_module_with_run(name):
    path = ROOT / "src" / "llmpipe" / "stages" / f"{name}.py"
    assert path.is_file(), f"add src/llmpipe/stages/{name}.py with run(params, ...) (docs/ARCHITECTURE.md)"
    functions = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}
    assert "run" in functions, f"src/llmpipe/stages/{name}.py: add run(params, ...), the function its task calls"
