"""params.yaml: the shipped file validates, dvc.yaml names only keys that exist, and mistakes fail early
with the key path and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from pydantic import BaseModel

from llmpipe.config import ParamsError, load_params, parse_params
from llmpipe.orchestration.scratch import deep_merge


def test_shipped_params_validate():
    params = load_params(ROOT / "params.yaml")
    assert params.sft.lr != params.train.lr, "sft overrides lr in the shipped file"
    assert params.pretrain.weight_decay == 0.1


def test_shipped_tiny_config_validates_over_the_shipped_params():
    """configs/tiny.yaml (`make smoke`, TINY_PARAMS) merged over params.yaml as make_pipeline_repo does."""
    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    params = parse_params(deep_merge(shipped, tiny))
    assert params.model.num_hidden_layers == tiny["model"]["num_hidden_layers"]
    assert params.pretrain.max_steps == tiny["pretrain"]["max_steps"]
    assert params.eval.models == tiny["eval"]["models"]


def test_train_lr_sets_the_pretraining_lr_of_the_shipped_file():
    """`dvc exp run -S train.lr=…` must change training, not be shadowed by a stage section."""
    assert load_params(ROOT / "params.yaml", {"train.lr": 5e-4}).pretrain.lr == 5e-4


def test_every_params_key_named_in_dvc_yaml_exists():
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    for name, stage in dvc["stages"].items():
        for key in stage.get("params", []):
            node = raw
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, (
                    f"dvc.yaml stage {name} reads params key {key}, which params.yaml does not write: add it there")
                node = node[part]


def test_shipped_file_lists_every_knob():
    """`dvc exp show` shows every value only if params.yaml writes every field out."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = load_params(ROOT / "params.yaml")

    def missing(model, node, prefix):
        for name in type(model).model_fields:
            value = getattr(model, name)
            if name not in node:
                yield f"{prefix}{name}"
            elif isinstance(value, BaseModel) and isinstance(node[name], dict):
                yield from missing(value, node[name], f"{prefix}{name}.")

    assert list(missing(params.train, raw["train"], "train.")) == []
    for section in ("paths", "data", "tokenizer", "model", "distributed", "profile", "regression", "eval",
                    "orchestration"):
        assert list(missing(getattr(params, section), raw[section], f"{section}.")) == [], section


def test_train_defaults_flow_into_stages_unless_overridden():
    params = parse_params({"train": {"lr": 5e-4, "seed": 7}, "sft": {"lr": 1e-4}})
    assert params.pretrain.lr == 5e-4 and params.dpo.lr == 5e-4
    assert params.sft.lr == 1e-4
    assert params.sft.seed == params.dpo.seed == 7


def test_unknown_key_names_the_path_and_suggests():
    with pytest.raises(ParamsError, match=r"sft\.lrr: unknown key; did you mean 'lr'\?"):
        parse_params({"sft": {"lrr": 1e-4}})


def test_unknown_train_key_is_reported_once_under_train():
    with pytest.raises(ParamsError) as err:
        parse_params({"train": {"max_step": 3}})
    message = str(err.value)
    assert "train.max_step: unknown key; did you mean 'max_steps'?" in message
    assert message.count("max_step:") == 1


def test_wrong_type_and_range_name_the_key():
    with pytest.raises(ParamsError, match=r"train\.lr"):
        parse_params({"train": {"lr": "fast"}})
    with pytest.raises(ParamsError, match=r"dpo\.beta"):
        parse_params({"dpo": {"beta": -1}})
    with pytest.raises(ParamsError, match=r"dpo\.loss_type"):
        parse_params({"dpo": {"loss_type": ["sigmoid", "nonsense"]}})


def test_cross_field_rules():
    with pytest.raises(ParamsError, match="num_attention_heads .* must divide model.hidden_size"):
        parse_params({"model": {"hidden_size": 100, "num_attention_heads": 8}})
    with pytest.raises(ParamsError, match="num_key_value_heads"):
        parse_params({"model": {"num_attention_heads": 8, "num_key_value_heads": 3}})
    with pytest.raises(ParamsError, match="loss_weights"):
        parse_params({"dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}})
    ok = parse_params({"dpo": {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}})
    assert ok.dpo.loss_type == ["sigmoid", "sft"]


def test_yaml_syntax_error_gives_the_line(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  lr: 0.001\n  seed: [1, 2\nsft: {}\n")
    with pytest.raises(ParamsError, match=r"params\.yaml: line \d+, column \d+: YAML syntax error"):
        load_params(bad)


def test_cli_fails_before_any_work(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(f"paths: {{output_root: {tmp_path}}}\nsft:\n  lrr: 0.1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "llmpipe.cli", "--task", "sft", "--config-path", str(bad)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "sft.lrr: unknown key; did you mean 'lr'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"], "nothing written"


def test_cli_help_lists_tasks():
    proc = subprocess.run([sys.executable, "-m", "llmpipe.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for task in ("prepare", "tokenizer", "pretrain", "sft", "dpo", "evaluate", "report", "lm"):
        assert f"\n  {task} " in proc.stdout


def test_cli_overrides_go_to_a_run_dir_and_validate():
    from llmpipe.cli import _parser, overrides_from_args

    args = _parser().parse_args(["--task", "lm", "--lr", "1e-4", "--steps-per-epoch", "5", "--epochs", "2", "--no-amp"])
    assert overrides_from_args(args, "pretrain") == {
        "pretrain.lr": 1e-4,
        "pretrain.num_train_epochs": 2.0,
        "pretrain.max_steps": 10,
        "pretrain.precision": "fp32",
    }
    with pytest.raises(ValueError, match="does not train"):
        overrides_from_args(_parser().parse_args(["--task", "prepare", "--lr", "1"]), "prepare")


def test_orchestration_cron_is_checked():
    assert parse_params({"orchestration": {"cron": "0 3 * * 1-5"}}).orchestration.cron == "0 3 * * 1-5"
    with pytest.raises(ParamsError, match=r"orchestration\.cron 'every day' is not a 5-field cron string"):
        parse_params({"orchestration": {"cron": "every day"}})
    with pytest.raises(ParamsError, match=r"orchestration\.retries"):
        parse_params({"orchestration": {"retries": -1}})


def test_a_train_key_every_stage_sets_for_itself_is_named_in_a_warning(caplog):
    """The README's trap: `train: {per_device_train_batch_size: 4}` under the shipped sections, which all set
    their own, changes nothing; the shipped file itself (every key listed, at its default) warns of none."""
    import logging

    shipped = yaml.safe_load((ROOT / "params.yaml").read_text())
    with caplog.at_level(logging.WARNING, logger="llmpipe.config.loading"):
        parse_params(shipped)
        assert not caplog.records
        params = parse_params(deep_merge(shipped, {"train": {"per_device_train_batch_size": 4, "lr": 1e-3}}))
    assert params.sft.per_device_train_batch_size == shipped["sft"]["per_device_train_batch_size"] != 4
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith("params.yaml: train.per_device_train_batch_size (4) is read by no stage: every stage "
                              "that inherits it sets its own (pretrain.per_device_train_batch_size: ")
    assert "sft.per_device_train_batch_size: 8" in warning and "set it in those sections instead" in warning
