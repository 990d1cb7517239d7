"""Optimisers and schedules from params: what each `train.optim` needs from the machine, Muon for the hidden
weights with AdamW for the rest, and each `lr_scheduler_type`'s own keywords for transformers' `get_scheduler`.

Every `optim` but ``muon`` is built by transformers' Trainer from its name (`TrainingArguments.optim`); ``muon``
reaches the Trainer as an optimizer factory (`Trainer.optimizer_cls_and_kwargs`, which transformers calls with
the model) and PPO's own loop through :func:`muon_with_adamw`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from llmpipe.config import TrainParams
from llmpipe.config.optim import OPTIM_REQUIRES
from llmpipe.core.errors import UserError


def check_optimizer(optim: str, key: str, strategy: str = "none") -> None:
    """Refuse an optimiser this machine cannot run, before any work.

    Args:
        optim: A `train.optim` value.
        key: The params key it was set under, for messages (``sft.optim``).
        strategy: ``distributed.strategy``.

    Raises:
        UserError: The optimiser needs a package that is not installed, or a CUDA GPU this machine lacks, or
            (``muon``) a sharding strategy: `torch.optim.Muon` orthogonalises whole matrices, not shards.
    """
    module, needs_cuda = OPTIM_REQUIRES.get(optim, (None, False))
    if module is not None and importlib.util.find_spec(module) is None:
        raise UserError(f"{key}: {optim} needs the {module} package, which is not installed; install it or pick "
                        "another optimizer (adamw_torch runs everywhere)")  # fmt: skip
    if needs_cuda and not torch.cuda.is_available():
        raise UserError(f"{key}: {optim} runs on a CUDA GPU only ({module}); on this machine use adamw_torch, "
                        "adafactor, sgd, a schedule_free_* optimizer or muon")  # fmt: skip
    if optim == "muon" and strategy in ("fsdp", "deepspeed"):
        raise UserError(f"{key}: muon orthogonalises whole weight matrices and cannot step the shards of "
                        f"distributed.strategy {strategy}; use ddp or none, or another optimizer")  # fmt: skip


def trainer_optim(t: TrainParams) -> str:
    """`TrainingArguments.optim` for `t`: its own name, or for ``muon`` (not a transformers name) ``adamw_torch``,
    which the factory :func:`attach` sets replaces."""
    return "adamw_torch" if t.optim == "muon" else t.optim


def schedule_kwargs(t: TrainParams, num_training_steps: int) -> dict[str, Any]:
    """The `scheduler_specific_kwargs` of transformers' `get_scheduler` (`TrainingArguments.lr_scheduler_kwargs`).

    Args:
        t: The stage's params.
        num_training_steps: The run's optimizer steps (needed by ``warmup_stable_decay``, which params validation
            guarantees a budget).

    Returns:
        ``min_lr_rate`` (``min_lr / lr``, so a second parameter group at another rate, Muon's, keeps the same
        floor ratio), ``num_cycles``, or ``num_decay_steps`` / ``decay_type`` / ``min_lr_ratio``; empty otherwise.
    """
    kind = t.lr_scheduler_type
    if kind == "cosine_with_min_lr":
        return {"min_lr_rate": t.min_lr / t.lr}
    if kind == "cosine_with_restarts":
        return {"num_cycles": t.num_cycles}
    if kind == "warmup_stable_decay":
        return {"num_decay_steps": max(1, round(t.decay_fraction * num_training_steps)),
                "decay_type": t.decay_type, "min_lr_ratio": t.min_lr / t.lr}  # fmt: skip
    return {}


def hidden_weights(model) -> set[int]:
    """The ids of `model`'s hidden weight matrices: 2-D parameters inside its transformer body (``model.base_model``)
    with both sides over 1, outside its embeddings. The LM head, a classification or value head (outside the body)
    and the embeddings stay with AdamW, as in the Muon write-up (Jordan et al. 2024) and nanochat.

    Under peft, the trainable adapter matrices inside the body are hidden weights (LoRA's and AdaLoRA's A and B);
    not a `modules_to_save` head, not LoRA's ``lora_embedding_A/B`` (parameters of an embedding: AdamW, like the
    embedding), and not a vector stored as a matrix (AdaLoRA's singular values ``lora_E``, (r, 1); IA³'s scales,
    (d, 1) or (1, d)), which Muon's orthogonalisation would only normalise."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: the model it wraps
    body = inner.base_model
    embeddings = {id(p) for m in body.modules()
                  if isinstance(m, torch.nn.Embedding) or isinstance(getattr(m, "base_layer", None), torch.nn.Embedding)
                  for p in m.parameters()}  # fmt: skip (peft's LoRA embedding layer wraps the embedding as base_layer)
    return {id(p) for p in body.parameters() if p.ndim == 2 and min(p.shape) > 1 and id(p) not in embeddings}


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` on the hidden weight matrices and `torch.optim.AdamW` on everything else, as one
    optimizer (one state to checkpoint, one schedule).

    Its `param_groups` are the AdamW groups then the Muon group, the same dicts the two inner optimizers step
    with, so a schedule scales both (each from its own peak: `lr` and `muon_lr`) and the Trainer logs the AdamW
    rate. With nothing for AdamW (LoRA without `modules_to_save`: every trainable parameter is an adapter matrix)
    there is no AdamW and the Muon rate is logged. Not torch's own: torch keeps Muon 2-D only and leaves the
    pairing to the user.

    Args:
        hidden: The hidden weight matrices.
        rest: AdamW parameter groups (``params``, ``weight_decay``).
        lr: AdamW peak learning rate.
        muon_lr: Muon peak learning rate.
        momentum: Muon momentum (Nesterov).
        weight_decay: Muon's decoupled weight decay.
        betas: AdamW betas.
        eps: AdamW epsilon.
    """

    def __init__(self, hidden: list, rest: list[dict], *, lr: float, muon_lr: float, momentum: float,
                 weight_decay: float, betas: tuple[float, float], eps: float) -> None:  # fmt: skip
        rest = [g for g in rest if g["params"]]
        # LoRA's A and B are often every trainable parameter: then no AdamW (torch refuses an empty one)
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, eps=eps) if rest else None
        self.muon = torch.optim.Muon(hidden, lr=muon_lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(self._groups(), {})

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.adamw, self.muon) if o is not None]

    def _groups(self) -> list[dict]:
        return [g for o in self._optimizers() for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self._optimizers():
            optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.adamw.state_dict() if self.adamw else None, "muon": self.muon.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.adamw:
            self.adamw.load_state_dict(state_dict["adamw"])
        self.muon.load_state_dict(state_dict["muon"])
        self.param_groups = self._groups()  # loading replaces the inner group dicts: share the new ones


def muon_with_adamw(t: TrainParams, models: list, betas: tuple[float, float] | None = None) -> MuonWithAdamW:
    """:class:`MuonWithAdamW` over the trainable parameters of `models`: their :func:`hidden_weights` to Muon,
    the rest to AdamW (weight decay on the embeddings and heads, none on norms and biases).

    Raises:
        UserError: No trainable hidden weight matrix (Muon would have nothing to step).
    """
    hidden_ids = set().union(*(hidden_weights(m) for m in models))
    params = list({id(p): p for m in models for p in m.parameters() if p.requires_grad}.values())
    hidden = [p for p in params if id(p) in hidden_ids]
    if not hidden:
        raise UserError("optim muon: the model has no trainable hidden weight matrix (peft target_modules that are "
                        "embeddings or heads only?); adapt linear layers of the body, or use another optimizer")
    rest = [p for p in params if id(p) not in hidden_ids]
    groups = [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]  # fmt: skip
    return MuonWithAdamW(hidden, groups, lr=t.lr, muon_lr=t.muon_lr, momentum=t.muon_momentum,
                         weight_decay=t.weight_decay, betas=betas or (t.adam_beta1, t.adam_beta2), eps=1e-8)  # fmt: skip


class MuonFactory:
    """The factory transformers' Trainer calls as ``MuonFactory()(model, **kwargs)`` (see
    `transformers.trainer_optimizer.is_optimizer_factory`); `kwargs` holds the stage's params."""

    def __call__(self, model, t: TrainParams) -> MuonWithAdamW:
        return muon_with_adamw(t, [model])


def attach(trainer, t: TrainParams) -> None:
    """Give `trainer` the ``muon`` optimizer factory when `t.optim` is muon (before `train` builds the optimizer);
    every other optimiser the Trainer builds from `TrainingArguments.optim`."""
    if t.optim == "muon":
        trainer.optimizer_cls_and_kwargs = (MuonFactory, {"t": t})

