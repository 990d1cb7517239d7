"""``peft.merge: false`` in stage after stage (sft → dpo → grpo) keeps every stage: each adapter's base is the
stage's input folder, and loading the last folder applies the whole chain in order (logits within 1e-5 of applying
the adapters one by one by hand); each folder names the end-of-turn eos and keeps the plain template; a folder
holding merged weights and a top-level adapter config is refused rather than given the adapter twice."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import torch
from user_models import QWEN_TEMPLATE, chat_tokenizer, params_at, run_stages, save_user_model

from llmpipe.core.errors import UserError
from llmpipe.models import load_model, load_tokenizer

LORA = {"method": "lora", "merge": False, "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
STEPS = {"max_steps": 3, "eval_steps": 3, "save_steps": 3, "warmup_steps": 0, "logging_steps": 1, "lr": 2e-2,
         "peft": LORA}  # fmt: skip
"""A few steps at a high rate: enough for each adapter to move the logits well past the 1e-5 the chain is held to."""


def completion_length(prompts, completions, **kwargs) -> list[float]:
    """A graded reward (TRL's signature): a random model's completions differ in length, so a group has a gradient."""
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 32 for c in completions]  # samples: plain text


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A user's Llama (Qwen2.5's template: TRL's marked copy trains), then sft, dpo and grpo, each an unmerged LoRA
    adapter over the one before."""
    root = tmp_path_factory.mktemp("chain")
    source = save_user_model(root / "user_model", "llama", chat_tokenizer(QWEN_TEMPLATE))
    params = params_at(root, str(source), sft=STEPS, dpo=STEPS,
                       grpo={**STEPS, "policy": "dpo", "max_steps": 2, "eval_steps": 2, "save_steps": 2,
                             "rewards": [{"name": f"{__name__}:completion_length", "weight": 1.0}],
                             "generation": {"max_new_tokens": 8, "temperature": 1.0}})  # fmt: skip
    run_stages(params, "prepare", "tokenizer", "pretrain", "sft", "dpo", "grpo")
    return source, params


@pytest.mark.slow
def test_a_chain_of_two_and_of_three_adapters_loads_as_every_adapter_in_order(chain):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source, params = chain
    models = Path(params.paths.models)
    names = ("sft", "dpo", "grpo")
    bases = {n: json.loads((models / n / "adapter_config.json").read_text())["base_model_name_or_path"] for n in names}
    assert bases == {"sft": str(models / "pretrain"), "dpo": str(models / "sft"), "grpo": str(models / "dpo")}
    ids = torch.tensor([load_tokenizer(params.paths.tokenizer)("def f(x):\n    return x + 1")["input_ids"]])
    by_hand = AutoModelForCausalLM.from_pretrained(source)
    steps = [logits(by_hand, ids)]
    for depth, name in enumerate(names, 1):
        by_hand = PeftModel.from_pretrained(by_hand, models / name).merge_and_unload()
        steps.append(logits(by_hand, ids))
        loaded = logits(load_model(models / name, "?"), ids)
        assert (loaded - steps[-1]).abs().max() < 1e-5, f"{name}: base + {depth} adapters in order"
        assert (steps[-1] - steps[-2]).abs().max() > 1e-3, f"{name}'s adapter changed the model"
    last_only = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), models / "grpo")
    assert (logits(last_only.merge_and_unload(), ids) - steps[-1]).abs().max() > 1e-3, "the earlier stages count"

    from llmpipe.commands.generation import load_for_generation

    model, _ = load_for_generation(models / "grpo")  # llm-train generate and chat load the same chain
    assert (logits(model, ids) - steps[-1]).abs().max() < 1e-5


@pytest.mark.slow
def test_every_stage_after_sft_saves_the_end_of_turn_eos_and_the_plain_template(chain):
    _, params = chain
    pipeline = load_tokenizer(params.paths.tokenizer)
    assert "generation %}" in pipeline.chat_template, "training reads TRL's marked copy of Qwen 2.5's template"
    eot = pipeline.convert_tokens_to_ids("<|im_end|>")
    for name in ("sft", "dpo", "grpo"):
        folder = Path(params.paths.models, name)
        saved = load_tokenizer(folder)
        assert saved.eos_token == "<|im_end|>" and "generation %}" not in saved.chat_template, name
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [eot, pipeline.eos_token_id]
        assert load_model(folder, "?").generation_config.eos_token_id == [eot, pipeline.eos_token_id], name
    chat = [{"role": "user", "content": "Add 1 to x."}, {"role": "assistant", "content": "return x + 1"}]
    template = (Path(params.paths.models, "sft") / "chat_template.jinja").read_text()
    text = jinja2.Environment().from_string(template).render(messages=chat, add_generation_prompt=False)
    assert text == pipeline.apply_chat_template(chat, tokenize=False), "plain Jinja2 renders what training rendered"


def test_merged_weights_with_a_top_level_adapter_config_are_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from llmpipe.commands.generation import load_for_generation

    tok = chat_tokenizer(QWEN_TEMPLATE)
    base = save_user_model(tmp_path / "base", "llama", tok)
    lora = LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base), lora)
    folder = tmp_path / "merged"
    adapted.save_pretrained(folder)  # adapter_config.json + adapter_model.safetensors, as another tool leaves them
    merged = adapted.merge_and_unload()
    merged.save_pretrained(folder)
    tok.save_pretrained(folder)
    ids = torch.tensor([tok("return x")["input_ids"]])
    twice = AutoModelForCausalLM.from_pretrained(folder)  # transformers applies the adapter over the merged weights
    assert (logits(twice, ids) - logits(merged, ids)).abs().max() > 1e-3, "what the refusal prevents"
    message = rf"{folder}: holds a model's weights .* adapter_config.json .* twice.* {folder / 'adapter'}/"
    with pytest.raises(UserError, match=message):
        load_model(folder, "?")
    with pytest.raises(UserError, match=message):
        load_for_generation(folder)
    (folder / "adapter").mkdir()  # the fix the message names: llmpipe's own merged layout
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / name).rename(folder / "adapter" / name)
    assert (logits(load_model(folder, "?"), ids) - logits(merged, ids)).abs().max() < 1e-5
