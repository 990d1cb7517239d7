"""`baseline` stage: the untrained model of the configured shape, saved like any other stage's model so
`evaluate` scores it as the reference row (what training must beat)."""

from __future__ import annotations

from llmpipe.config import Params
from llmpipe.models import build_model, count_parameters, load_tokenizer, save_model


def run(params: Params, trust_remote_code: bool = False) -> dict[str, float]:
    """Save a random-init model (seed ``model.init_seed``, the init pretraining starts from) to models/baseline.

    Args:
        params: Validated params; reads ``paths`` and ``model``.
        trust_remote_code: Load a tokenizer folder that maps to Python code (``--trust-remote-code``).
    """
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    model = build_model(params.model, tokenizer)
    save_model(model, tokenizer, params.paths.out(params.paths.models, "baseline"))
    return {"num_parameters": count_parameters(model)}
