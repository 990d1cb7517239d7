"""`baseline` stage: the model training starts from, saved like any other stage's model so `evaluate` scores it as
the reference row (what training must beat): the untrained model of the configured shape, or a pointer to
``model.init_from`` (`llmpipe.models.source`: the given model, not a copy of it)."""

from __future__ import annotations

from llmpipe.config import Params
from llmpipe.models import build_model, count_parameters, load_tokenizer, save_model
from llmpipe.models.source import num_parameters, weights_dir, write_pointer


def run(params: Params, trust_remote_code: bool = False) -> dict[str, float]:
    """Save a random-init model (seed ``model.init_seed``, the init pretraining starts from) to models/baseline, or
    a pointer to ``model.init_from``.

    Args:
        params: Validated params; reads ``paths`` and ``model``.
        trust_remote_code: Load a tokenizer folder that maps to Python code (``--trust-remote-code``).

    Raises:
        UserError: The tokenizer is missing, or ``model.init_from`` cannot be found, loaded or does not match it.
    """
    tokenizer = load_tokenizer(params.paths.tokenizer, trust_remote_code)
    out = params.paths.out(params.paths.models, "baseline")
    if not params.model.scratch:
        write_pointer(out, params.model, tokenizer, trust_remote_code)
        return {"num_parameters": num_parameters(weights_dir(out))}
    model = build_model(params.model, tokenizer)
    save_model(model, tokenizer, out)
    return {"num_parameters": count_parameters(model)}
