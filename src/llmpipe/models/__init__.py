"""A model folder on disk, from building one to loading it: the one way the pipeline reads and writes models.

- :mod:`~llmpipe.models.build`: a random-init Llama from ``model:`` params, embedding fitting, parameter counts.
- :mod:`~llmpipe.models.source`: where weights come from (``model.init_from``: a folder or a hub id) and the
  pointer (``init_from.json``) a stage writes instead of a copy of them.
- :mod:`~llmpipe.models.folders`: a folder checked before transformers reads it (safe loading) and peft adapter
  folders.
- :mod:`~llmpipe.models.loading`: load a model (a folder, a pointer or an adapter over its base) or a tokenizer.
- :mod:`~llmpipe.models.saving`: save a model and its tokenizer atomically.
- :mod:`~llmpipe.models.tokenizer_identity`: whether a model folder was trained with the pipeline's tokenizer.

The names stages use most are re-exported here (``from llmpipe.models import load_model``). Nothing here imports
torch or transformers at import time.
"""

from __future__ import annotations

from llmpipe.models.build import build_model, count_parameters, fit_embeddings
from llmpipe.models.folders import PICKLE_SUFFIXES, TRUST_FLAG, check_model_dir, check_tokenizer_configs, read_config
from llmpipe.models.loading import (
    check_pad_token,
    init_model,
    load_model,
    load_pretrained,
    load_tokenizer,
    pretrained_kwargs,
)
from llmpipe.models.saving import save_model

__all__ = [
    "PICKLE_SUFFIXES",
    "TRUST_FLAG",
    "build_model",
    "check_model_dir",
    "check_pad_token",
    "check_tokenizer_configs",
    "count_parameters",
    "fit_embeddings",
    "init_model",
    "load_model",
    "load_pretrained",
    "load_tokenizer",
    "pretrained_kwargs",
    "read_config",
    "save_model",
]
