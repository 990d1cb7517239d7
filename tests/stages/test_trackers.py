"""`<stage>.report_to`: the HF Trainer's trackers beside TensorBoard, each kept on this machine under paths.logs.

A tiny real pretrain logs to TensorBoard and to MLflow (its SQLite store under logs/mlflow); a tracker that is not
installed, or a list without TensorBoard, is a params error naming the key and the fix.
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from llmpipe.config import parse_params
from llmpipe.config.loading import ParamsError


@pytest.fixture(scope="module")
def tracked_pretrain(workdir, tmp_path_factory):
    """A tiny pretrain run in-process (12 steps, a log line every 4) with ``pretrain.report_to: [tensorboard,
    mlflow]``; its output root."""
    from llmpipe.stages import pretrain

    out = tmp_path_factory.mktemp("tracked")
    raw = yaml.safe_load((workdir / "params.yaml").read_text())
    raw["paths"] = {"data": str(workdir / "data"), "tokenizer": str(workdir / "artifacts" / "tokenizer"),
                    "output_root": str(out)}  # fmt: skip
    raw["pretrain"] = {**raw.get("pretrain", {}), "report_to": ["tensorboard", "mlflow"]}
    pretrain.run(parse_params(raw))
    return out


@pytest.mark.slow
def test_pretrain_logs_to_tensorboard_and_to_a_local_mlflow_store(tracked_pretrain):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = tracked_pretrain / "logs" / "mlflow" / "mlflow.db"
    assert store.is_file(), "MLflow's store is a file under paths.logs, nowhere else"
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("llmpipe")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "pretrain" and run.info.status == "FINISHED"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [4, 8, 12], "every logging step (logging_steps 4 of 12)"
    assert run.data.params["learning_rate"] == "0.001"

    (run_dir,) = (tracked_pretrain / "logs" / "pretrain" / "tensorboard").iterdir()  # one folder per run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [4, 8, 12], "TensorBoard still gets every step"
    assert not (tracked_pretrain / "mlruns").exists()


@pytest.mark.parametrize(
    ("report_to", "message"),
    [(["tensorboard", "wandb"], r"train\.report_to: wandb not installed: pip install wandb \(or leave it out"),
     (["mlflow"], r"train\.report_to: must list tensorboard \(logs/<stage>/tensorboard is a DVC output\)"),
     (["tensorboard", "comet"], r"train\.report_to\.1: Input should be 'tensorboard', 'wandb', 'mlflow' or 'trackio'")],
)  # fmt: skip
def test_a_tracker_that_cannot_be_used_is_a_params_error(report_to, message):
    if "wandb" in report_to and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ParamsError, match=message):
        parse_params({"train": {"report_to": report_to}})


def test_a_stage_names_its_own_tracker_key():
    with pytest.raises(ParamsError, match=r"grpo\.report_to: trackio not installed: pip install trackio"):
        if importlib.util.find_spec("trackio") is not None:
            pytest.skip("trackio is installed here")
        parse_params({"grpo": {"report_to": ["tensorboard", "trackio"]}})


def test_every_tracker_store_is_local_and_under_the_logs_folder(tmp_path):
    from llmpipe.train.trackers import store_environment

    env = store_environment(["wandb", "mlflow", "trackio"], tmp_path / "logs")
    assert env["WANDB_MODE"] == "offline", "W&B never uploads from a run (wandb sync does, by hand)"
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'logs' / 'mlflow' / 'mlflow.db'}"
    stores = [env["WANDB_DIR"], env["MLFLOW_TRACKING_URI"].removeprefix("sqlite:///"), env["TRACKIO_DIR"]]
    assert all(s.startswith(str(tmp_path / "logs")) for s in stores), stores
    assert store_environment([], tmp_path / "logs") == {}, "TensorBoard alone sets nothing"
