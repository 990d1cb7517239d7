"""Safe loading on its own: pickled weights and ``auto_map`` code are refused unless the caller trusts the
folder, and with ``--trust-remote-code`` a ``pytorch_model.bin`` really loads (still through
``torch.load(weights_only=True)`` inside transformers). The same refusals as whole ``llm-train`` runs are rows of
the table in ``test_bad_input.py``.
"""

from __future__ import annotations

import inspect
import shutil

import bad_input_helpers
import pytest
from bad_input_helpers import auto_map, pickled_weights

from llmpipe import stages
from llmpipe.config import stages as registry
from llmpipe.core.errors import UserError

# The shared fixtures, as names of this module so that pytest finds them.
template = bad_input_helpers.template
_restore_logging = bad_input_helpers._restore_logging


def test_trusted_pickled_weights_load_and_equal_the_saved_ones(template, tmp_path):
    """--trust-remote-code lets a pytorch_model.bin past our check; transformers loads it (weights_only=True)."""
    import torch

    from llmpipe.models import load_model

    shutil.copytree(template / "models", tmp_path / "models")
    safe = load_model(tmp_path / "models" / "pretrain", "unused")
    pickled_weights("pretrain")(tmp_path)
    with pytest.raises(UserError, match=r"pytorch_model\.bin.*--trust-remote-code"):
        load_model(tmp_path / "models" / "pretrain", "unused")
    trusted = load_model(tmp_path / "models" / "pretrain", "unused", trust_remote_code=True)
    for (name, a), (_, b) in zip(safe.state_dict().items(), trusted.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_trust_lets_auto_map_past_the_check_and_asks_transformers_for_it(template, tmp_path):
    """With trust, our check passes an auto_map folder and transformers is told trust_remote_code=True (it then
    imports the mapped file itself; that import is transformers' code path, not exercised here)."""
    from llmpipe.models import check_model_dir, pretrained_kwargs

    shutil.copytree(template / "models" / "sft", tmp_path / "sft")
    auto_map("sft/config.json", "AutoModelForCausalLM")(tmp_path)
    with pytest.raises(UserError, match="auto_map"):
        check_model_dir(tmp_path / "sft", "unused", trust_remote_code=False)
    check_model_dir(tmp_path / "sft", "unused", trust_remote_code=True)
    assert pretrained_kwargs(False) == {"use_safetensors": True, "weights_only": True, "trust_remote_code": False}
    assert pretrained_kwargs(True) == {"use_safetensors": None, "weights_only": True, "trust_remote_code": True}


def test_safetensors_beside_a_pickle_loads_the_safetensors(template, tmp_path):
    """A folder with both formats (common on the hub) needs no trust: only model.safetensors is read."""
    import torch

    from llmpipe.models import load_model

    folder = tmp_path / "sft"
    shutil.copytree(template / "models" / "sft", folder)
    torch.save({"not": torch.zeros(1)}, folder / "pytorch_model.bin")
    load_model(folder, "unused")


def test_every_loading_stage_takes_the_trust_flag():
    """`llm-train --trust-remote-code` passes it to exactly the tasks that load a model or tokenizer folder."""
    for task in registry.REGISTRY:
        takes = "trust_remote_code" in inspect.signature(stages.runner(task)).parameters
        assert takes == (task in registry.LOADING_TASKS), task
