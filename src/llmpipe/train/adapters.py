"""A stage's `peft:` params applied to its loaded model: the adapter through the `peft` library (or BitFit's bias-only
training, which peft has no method for), AdaLoRA's rank schedule as a Trainer callback, and the adapter's outputs.

The one entry for every training stage that fine-tunes (the Trainer-stage base and PPO's build): a stage loads its
model as without adapters, then :func:`wrap` makes it trainable as `peft:` says. The wrapped model is what the
trainer gets, with no reference model: TRL's DPO, KTO and GRPO trainers then keep the reference inside the same
weights (`trl` 1.16 adds a frozen ``ref`` copy of the freshly initialised adapter, so the reference is the input
model itself for LoRA and IA³, whose adapters start as the identity) — one copy of the base in memory.

AdaLoRA is the exception (:func:`for_trainer`): peft's AdaLoRA model holds one trainable adapter only, so TRL's
``ref`` copy fails ("AdaLoraModel supports only 1 trainable adapter"). Such a trainer gets the model unwrapped with
the AdaLoRA config, wraps it itself and takes the adapter-disabled model as the reference, which is the same model
(AdaLoRA's singular values start at zero).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmpipe.config import PeftParams
from llmpipe.core.errors import UserError
from llmpipe.core.io import atomic_dir
from llmpipe.models.saved_folder import finish
from llmpipe.models.virtual_tokens import fix_virtual_tokens

log = logging.getLogger(__name__)

ADAPTER = "default"
"""The name of the adapter a stage trains (peft's default); others (TRL's frozen ``ref``) are never saved."""


def is_peft_model(model) -> bool:
    """Whether `model` (unwrapped) is a `peft.PeftModel`."""
    return type(model).__module__.startswith("peft.")


def peft_config(cfg: PeftParams, task: str, max_steps: int):
    """Our `peft:` params → the `peft` config of `cfg.method`, field by field.

    Args:
        cfg: The stage's merged `peft:` section (a method other than none and bitfit).
        task: peft's task type: ``CAUSAL_LM`` (a policy) or ``SEQ_CLS`` (reward and value models: peft then trains
            their ``score`` head in full).
        max_steps: The stage's optimizer steps (AdaLoRA's ``total_step``).
    """
    import peft

    common = {"task_type": task, "modules_to_save": cfg.modules_to_save}
    if cfg.method == "lora":
        return peft.LoraConfig(**common, r=cfg.r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                               target_modules=cfg.target_modules, use_dora=cfg.use_dora,
                               use_rslora=cfg.use_rslora)  # fmt: skip
    if cfg.method == "adalora":
        return peft.AdaLoraConfig(**common, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                  target_modules=cfg.target_modules, init_r=cfg.init_r, target_r=cfg.target_r,
                                  tinit=cfg.tinit, tfinal=cfg.tfinal, deltaT=cfg.deltaT, beta1=cfg.beta1,
                                  beta2=cfg.beta2, orth_reg_weight=cfg.orth_reg_weight, total_step=max_steps)  # fmt: skip
    if cfg.method == "ia3":
        return peft.IA3Config(**common, target_modules=cfg.target_modules, feedforward_modules=cfg.feedforward_modules)
    if cfg.method == "prefix_tuning":
        return peft.PrefixTuningConfig(**common, num_virtual_tokens=cfg.num_virtual_tokens,
                                       prefix_projection=cfg.prefix_projection,
                                       encoder_hidden_size=cfg.encoder_hidden_size)  # fmt: skip
    return peft.PromptTuningConfig(**common, num_virtual_tokens=cfg.num_virtual_tokens,
                                   prompt_tuning_init=cfg.prompt_tuning_init,
                                   prompt_tuning_init_text=cfg.prompt_tuning_init_text)  # fmt: skip


def load_kwargs(cfg: PeftParams, stage: str) -> dict[str, Any]:
    """`from_pretrained` keywords for the model a stage trains: a 4-bit base for QLoRA (`peft.load_in_4bit`).

    Raises:
        UserError: QLoRA asked for with no CUDA GPU, or without bitsandbytes installed.
    """
    if not cfg.load_in_4bit:
        return {}
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{stage}.peft.load_in_4bit: QLoRA's 4-bit base (bitsandbytes) needs a CUDA GPU and this "
                        "machine has none; set it to false (LoRA on the full-precision base)")  # fmt: skip
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(f"{stage}.peft.load_in_4bit needs bitsandbytes: pip install bitsandbytes") from None
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_use_double_quant=True)  # fmt: skip
    return {"quantization_config": quant}


def _bitfit(model, cfg: PeftParams, stage: str):
    """Train only the biases (and `modules_to_save`), Ben Zaken et al. 2022; the rest frozen in place."""
    keep = tuple(cfg.modules_to_save or ())
    biases = 0
    for name, param in model.named_parameters():
        bias = name.endswith(".bias")
        biases += bias
        param.requires_grad_(bias or any(f"{m}." in f".{name}" for m in keep))
    if not biases:
        raise UserError(f"{stage}.peft.method bitfit trains only biases, and this {type(model).__name__} has none "
                        "(Llama's linear layers have no bias); use lora, or a model with biases")  # fmt: skip
    return model


def wrap(model, cfg: PeftParams, stage: str, source: Path, task: str = "CAUSAL_LM", max_steps: int = -1,
         seed: int = 0):  # fmt: skip
    """The loaded model made trainable as `cfg` says (see the module docstring).

    Args:
        model: The stage's input model, as loaded (4-bit for QLoRA).
        cfg: The stage's merged `peft:` section.
        stage: The stage, named in messages.
        source: The folder the model came from (named in messages; the adapter's base model).
        task: ``CAUSAL_LM`` or ``SEQ_CLS`` (:func:`peft_config`).
        max_steps: The stage's optimizer steps (AdaLoRA's schedule).
        seed: Seeds the adapter's initial values (a resumed run's frozen reference copy of them is the same).

    Returns:
        `model` itself (method none; bitfit with every non-bias frozen) or a `peft.PeftModel` around it.

    Raises:
        UserError: The input is a virtual-token adapter (nothing to train on top of), bitfit on a model without
            biases, or peft refuses the config (e.g. a `target_modules` name the model does not have).
    """
    if is_peft_model(model):
        raise UserError(f"{source} holds a {model.peft_config[ADAPTER].peft_type.value.lower()} adapter of virtual "
                        "tokens, which cannot be merged into the weights, so no stage can train on top of it: "
                        "evaluate it, or train that stage with another peft.method")  # fmt: skip
    if cfg.method == "none":
        return model
    if cfg.method == "bitfit":
        return _bitfit(model, cfg, stage)
    import peft

    model = _prepare(model, cfg, source, seed)
    try:
        wrapped = peft.get_peft_model(model, peft_config(cfg, task, max_steps))
    except ValueError as err:
        raise UserError(f"{stage}.peft: peft refuses {cfg.method} on {type(model).__name__}: {err}; check "
                        f"{stage}.peft.target_modules (module names of the model, or all-linear)") from None  # fmt: skip
    # The adapter's base is the stage's input folder, so an adapter over an unmerged adapter (peft.merge: false twice)
    # loads over that chain (`llmpipe.models.folders`). peft would name the folder the weights were read from: for a
    # chain, its root model, which would silently drop every adapter between.
    wrapped.peft_config[ADAPTER].base_model_name_or_path = str(source)
    trainable, total = wrapped.get_nb_trainable_parameters()
    log.info("%s: %s adapter, %d trainable of %d parameters (%.3f%%)", stage, cfg.method, trainable, total,
             100 * trainable / total)  # fmt: skip
    return fix_virtual_tokens(wrapped)  # prefix or prompt tuning: the same answers in any batch


def _prepare(model, cfg: PeftParams, source: Path, seed: int):
    """The input model ready for its adapter: seeded (the adapter's initial values), named (peft writes the name as
    the adapter's ``base_model_name_or_path``), a 4-bit base prepared for training (QLoRA)."""
    import peft
    from transformers import set_seed

    set_seed(seed)
    model.config._name_or_path = str(source)
    if cfg.load_in_4bit:
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return model


def for_trainer(model, cfg: PeftParams, stage: str, source: Path, copies_reference: bool, task: str = "CAUSAL_LM",
                max_steps: int = -1, seed: int = 0):  # fmt: skip
    """What a stage hands its TRL trainer: ``(model, peft_config)``.

    Args:
        model, cfg, stage, source, task, max_steps, seed: As :func:`wrap` takes them.
        copies_reference: Whether the trainer copies a peft model's adapter as its frozen reference (DPO and KTO;
            GRPO with ``beta`` > 0).

    Returns:
        ``(wrap(model, ...), None)``; for AdaLoRA under a trainer that copies its reference, ``(model, config)``:
        the input model and its peft config, which the trainer wraps itself (the module docstring).

    Raises:
        UserError: As :func:`wrap`.
    """
    if copies_reference and cfg.method == "adalora" and not is_peft_model(model):
        return _prepare(model, cfg, source, seed), peft_config(cfg, task, max_steps)
    return wrap(model, cfg, stage, source, task, max_steps, seed), None


class DisabledAdapter:
    """The frozen reference inside a peft policy's own weights: calls the policy with its adapter disabled (PPO's
    reference; TRL's trainers do the same for DPO, KTO and GRPO).

    Args:
        policy: The trained peft policy, as the `Accelerator` prepared it.
        accelerator: Unwraps it to reach peft's `disable_adapter`.
    """

    def __init__(self, policy, accelerator) -> None:
        self.policy, self.accelerator = policy, accelerator

    def __call__(self, *args, **kwargs):
        with self.accelerator.unwrap_model(self.policy).disable_adapter():
            return self.policy(*args, **kwargs)


def effective_rank(model) -> float:
    """AdaLoRA's mean rank over its adapted matrices: the singular values its budget schedule left non-zero."""
    ranks = [int((e != 0).sum()) for name, e in model.named_parameters() if f"lora_E.{ADAPTER}" in name]
    return sum(ranks) / len(ranks) if ranks else 0.0


def adalora_callback():
    """A Trainer callback running AdaLoRA's rank reallocation after each optimizer step (before the gradients are
    cleared, as peft requires) and logging ``adalora_rank`` (:func:`effective_rank`) with every log line."""
    from transformers import TrainerCallback

    class AdaLoraSchedule(TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            model.base_model.update_and_allocate(state.global_step)

        def on_log(self, args, state, control, model=None, logs=None, **kwargs):
            if logs is not None and "loss" in logs:  # the Trainer has appended its copy of `logs`: update both
                logs["adalora_rank"] = effective_rank(model)
                state.log_history[-1]["adalora_rank"] = logs["adalora_rank"]

    return AdaLoraSchedule()


def save(model, tokenizer, final: Path, merge: bool, load_base: Callable[..., Any] | None, state_dict=None,
         chat: bool = False, quantized: bool = False):  # fmt: skip
    """Write a trained model atomically; for an adapter, ``final`` = the merged full model with the adapter in
    ``final/adapter/`` (`merge`), or the adapter itself (``adapter_model.safetensors``, ``adapter_config.json``, the
    tokenizer). Any other model (method none, bitfit) is saved whole. The folder is finished for the tools that load
    it (`llmpipe.models.saved_folder.finish`: ``use_cache``, the plain chat template, a chat stage's end-of-turn eos).

    The adapter sits in a subfolder of a merged model because transformers loads a folder's top-level
    ``adapter_config.json`` as an adapter over the folder's own weights, which would apply it twice.

    Args:
        model: The unwrapped model.
        tokenizer: Saved beside the model.
        final: ``models/<stage>``.
        merge: `peft.merge`.
        load_base: Loads the stage's input model afresh, full precision (keywords go to `from_pretrained`): the
            merge is made on it, so the trained model (sharded, or 4-bit) is left as it is for the final evaluation.
        state_dict: The gathered state dict under sharding (FSDP, ZeRO-3); None reads the model's own.
        chat: A chat stage (sft and after): the folder names the template's end-of-turn token as an eos.
        quantized: The trained base is 4-bit (QLoRA): the adapter is merged into the base reloaded in bf16, its
            compute dtype, never into the 4-bit weights.

    Returns:
        The merged model as saved (`llmpipe.train.merge_check` scores it against the trained one), else None.
    """
    from peft import PeftModel

    merged = None
    with atomic_dir(final) as tmp:
        if not is_peft_model(model):
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        else:
            adapter_dir = tmp / "adapter" if merge else tmp
            model.save_pretrained(adapter_dir, state_dict=state_dict, selected_adapters=[ADAPTER],
                                  save_embedding_layers=False, safe_serialization=True)  # fmt: skip
            if merge:
                import torch

                base = load_base(dtype=torch.bfloat16) if quantized else load_base()
                merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
                merged.save_pretrained(tmp, safe_serialization=True)
        finish(tmp, tokenizer, chat, str(final))
    return merged
