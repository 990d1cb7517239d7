"""Typed, validated view of ``params.yaml``: the single source of every hyperparameter and path.

Every section is a pydantic v2 model with ``extra="forbid"``, so a mistyped key is an error that
names the key path and, where one is close, the key that was meant. The ``train`` section holds
training defaults; each training stage's section (one per training stage of the registry,
:mod:`~llmpipe.config.stages`) may override any of them and adds its own keys. :func:`load_params` merges ``train``
under each stage section before validation, so ``params.sft.lr`` is the value SFT really uses.

One module per family of sections; the names other packages use are re-exported here (import from
``llmpipe.config``):

- :mod:`~llmpipe.config.paths`: ``paths``.
- :mod:`~llmpipe.config.data`: ``data`` (sources, stream, dedup) and ``tokenizer``.
- :mod:`~llmpipe.config.training`: ``model``, ``train``, ``pretrain``, ``sft``, ``reward``, ``dpo``.
- :mod:`~llmpipe.config.peft`: ``peft`` (in ``train`` and each adapter stage's section).
- :mod:`~llmpipe.config.rl`: the RL stages' sections and their generation and reward specs.
- :mod:`~llmpipe.config.runtime`: ``profile``, ``regression``, ``eval``, ``orchestration``.
- :mod:`~llmpipe.config.params`: :class:`Params`, the root, with the rules that cross sections.
- :mod:`~llmpipe.config.stages`: the registry of stages.
- :mod:`~llmpipe.config.loading`: :func:`load_params`, :func:`parse_params`, :class:`ParamsError`.
"""

from __future__ import annotations

from llmpipe.config.data import (
    DataParams,
    DedupParams,
    HFPreferenceParams,
    HFRecordsParams,
    HFSFTParams,
    HFSourceParams,
    LocalSourceParams,
    MixtureSourceParams,
    PreferenceFormat,
    SFTFormat,
    StdlibSourceParams,
    StreamParams,
    TokenizerParams,
)
from llmpipe.config.loading import ParamsError, load_params, parse_params, set_dotted
from llmpipe.config.params import Params
from llmpipe.config.paths import PathsParams
from llmpipe.config.peft import PeftParams
from llmpipe.config.rl import GenerationParams, GRPOLossType, GRPOParams, PPOParams, RewardName, RewardSpec
from llmpipe.config.runtime import (
    EVAL_TASKS,
    EvalParams,
    OrchestrationParams,
    ProfileParams,
    RegressionParams,
    ReportParams,
    TaskOptions,
)
from llmpipe.config.training import (
    BUDGET_KEYS,
    DPOLossType,
    DPOParams,
    ModelParams,
    PretrainParams,
    RewardParams,
    SFTParams,
    TrainParams,
)

__all__ = [
    "BUDGET_KEYS",
    "EVAL_TASKS",
    "DPOLossType",
    "DPOParams",
    "DataParams",
    "DedupParams",
    "EvalParams",
    "GRPOLossType",
    "GRPOParams",
    "GenerationParams",
    "HFPreferenceParams",
    "HFRecordsParams",
    "HFSFTParams",
    "HFSourceParams",
    "LocalSourceParams",
    "MixtureSourceParams",
    "ModelParams",
    "OrchestrationParams",
    "ReportParams",
    "PPOParams",
    "Params",
    "ParamsError",
    "PathsParams",
    "PeftParams",
    "PreferenceFormat",
    "PretrainParams",
    "ProfileParams",
    "RegressionParams",
    "RewardName",
    "RewardParams",
    "RewardSpec",
    "SFTFormat",
    "SFTParams",
    "StdlibSourceParams",
    "StreamParams",
    "TaskOptions",
    "TokenizerParams",
    "TrainParams",
    "load_params",
    "parse_params",
    "set_dotted",
]
