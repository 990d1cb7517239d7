"""`peft:` in the training stages: each method trains exactly its own parameters for a few SFT steps, with a logged
loss and the trainable count peft reports; LoRA sft → dpo changes no base tensor, holds one copy of the base, and
writes an adapter beside a merged model whose logits are base + adapter's; merge: false leaves an adapter folder
that later stages and evaluation load; params mistakes are refused at load."""

from __future__ import annotations

import csv
import json
import re

import pytest
import torch
import yaml
from conftest import TINY_PARAMS

from llmpipe.config import ParamsError, load_params, parse_params
from llmpipe.core.errors import UserError
from llmpipe.models import load_model

STEPS = {"max_steps": 3, "eval_steps": 3, "save_steps": 3, "logging_steps": 1, "warmup_steps": 0, "lr": 0.01}

METHODS = {
    "lora": {"method": "lora", "r": 4, "target_modules": "all-linear"},
    "dora": {"method": "lora", "r": 4, "use_dora": True, "use_rslora": True},
    "adalora": {"method": "adalora", "init_r": 4, "target_r": 2, "tinit": 1, "tfinal": 1},
    "ia3": {"method": "ia3"},
    "prefix_tuning": {"method": "prefix_tuning", "num_virtual_tokens": 4, "merge": False},
    "prompt_tuning": {"method": "prompt_tuning", "num_virtual_tokens": 4, "merge": False},
    "bitfit": {"method": "bitfit"},
}
"""Per case, the `sft.peft` block; adapter names in the trained parameters' names (bitfit: the biases)."""


@pytest.fixture(scope="module")
def peftdir(workdir):
    """`workdir` with a tiny Llama whose attention and MLP have biases (so bitfit has something to train) saved as
    models/pretrain."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmpipe.models import load_tokenizer, save_model

    params = load_params(workdir / "params.yaml")
    tok, m = load_tokenizer(workdir / params.paths.tokenizer), params.model
    config = LlamaConfig(vocab_size=len(tok), hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                         num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                         intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings,
                         attention_bias=True, mlp_bias=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    save_model(LlamaForCausalLM(config), tok, workdir / "models" / "pretrain")
    return workdir


def stage_params(root, name: str, **sections):
    """TINY_PARAMS with `sections` merged over theirs (each with the few logged `STEPS`), writing to root/out-<name>."""
    raw = yaml.safe_load(TINY_PARAMS)
    for section, over in sections.items():
        raw[section] = {**raw.get(section, {}), **STEPS, **over}
    (root / f"params-{name}.yaml").write_text(yaml.safe_dump(raw))
    return load_params(root / f"params-{name}.yaml", {"paths.output_root": str(root / f"out-{name}")})


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, t in after.items() if not torch.equal(before[n], t)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(METHODS))
def test_method_trains_its_own_parameters_only(peftdir, case, monkeypatch):
    from peft import PeftModel, get_peft_model
    from transformers import set_seed

    from llmpipe.stages import sft
    from llmpipe.train.adapters import peft_config

    monkeypatch.chdir(peftdir)
    # fp32: under bf16 autocast (precision auto on a CPU with bf16) merged and adapter logits differ by a bf16 step
    # (0.0039), which the exact bound below is not about; virtual-token methods refuse packing.
    own = {"peft": METHODS[case], "precision": "fp32",
           "packing": METHODS[case]["method"] not in ("prefix_tuning", "prompt_tuning")}
    params = stage_params(peftdir, case, sft=own)
    metrics = sft.run(params)
    out = peftdir / f"out-{case}"
    rows = list(csv.DictReader((out / "logs" / "sft" / "train.csv").open()))
    assert len(rows) == STEPS["max_steps"] and all(float(r["loss"]) > 0 for r in rows)
    base = load_model(peftdir / "models" / "pretrain", "")
    original = {n: p.detach().clone() for n, p in base.named_parameters()}
    cfg = params.sft.peft

    if cfg.method == "bitfit":
        trained = dict(load_model(out / "models" / "sft", "").named_parameters())
        assert changed(original, trained) == {n for n in original if n.endswith(".bias")}
        assert metrics["num_trainable_parameters"] == sum(t.numel() for n, t in original.items() if n.endswith(".bias"))
        return
    adapter_dir = out / "models" / "sft" / ("adapter" if cfg.merge else "")
    assert (adapter_dir / "adapter_model.safetensors").exists() and (adapter_dir / "adapter_config.json").exists()
    if cfg.merge:  # the merged model saved is the trained one: scored on the held-out batches after the save
        assert metrics["merge_scored_tokens"] > 0 and metrics["merge_logits_max_abs_diff"] < 1e-4
        assert abs(metrics["eval_loss_merged"] - metrics["eval_loss_trained"]) < 1e-5
        assert "eval_loss_4bit" not in metrics, "full-precision LoRA: eval_loss is the trainer's own"
    else:
        assert "merge_logits_max_abs_diff" not in metrics, "nothing merged, nothing to compare"
    set_seed(params.sft.seed)  # the adapter's initial values, as the stage drew them
    fresh = get_peft_model(load_model(peftdir / "models" / "pretrain", ""), peft_config(cfg, "CAUSAL_LM", 3))
    initial = {n: p.detach().clone() for n, p in fresh.named_parameters() if p.requires_grad}
    assert metrics["num_trainable_parameters"] == fresh.get_nb_trainable_parameters()[0] == sum(
        t.numel() for t in initial.values()
    )
    loaded = PeftModel.from_pretrained(base, adapter_dir)
    now = {n: p.detach() for n, p in loaded.named_parameters()}
    assert initial and changed(initial, {n: now[n] for n in initial}) == set(initial), "every adapter tensor trained"
    adapter_ids = {id(p) for n, p in loaded.named_parameters() if n in initial}
    base_now = {n.replace(".base_layer.", "."): p for n, p in base.named_parameters()
                if id(p) not in adapter_ids and ".default" not in n}  # fmt: skip (AdaLoRA's fixed ranknum aside)
    assert base_now.keys() == original.keys()
    assert not changed(original, base_now), "a base tensor changed"
    if case == "adalora":
        assert all(0 < float(r["adalora_rank"]) <= 4 for r in rows)


@pytest.mark.slow
def test_lora_sft_then_dpo_changes_only_adapters_with_one_base_copy(peftdir, monkeypatch):
    from peft import PeftModel

    from llmpipe.stages import dpo, sft

    monkeypatch.chdir(peftdir)
    lora = {"peft": {"method": "lora", "r": 4, "target_modules": "all-linear"}}
    params = stage_params(peftdir, "chain", sft=lora, dpo=lora)
    sft.run(params)
    out = peftdir / "out-chain" / "models"
    (peftdir / "models" / "sft").mkdir(exist_ok=True)
    for f in (out / "sft").rglob("*"):  # the DAG's models/sft, which dpo reads
        if f.is_file():
            (peftdir / "models" / "sft" / f.relative_to(out / "sft")).parent.mkdir(parents=True, exist_ok=True)
            (peftdir / "models" / "sft" / f.relative_to(out / "sft")).write_bytes(f.read_bytes())
    loads = []
    monkeypatch.setattr("llmpipe.stages.base.load_model", lambda *a, **k: loads.append(a[0]) or load_model(*a, **k))
    metrics = dpo.run(params)
    assert len(loads) == 2, "dpo loads models/sft once to train and once to merge on save, never a reference copy"
    assert metrics["steps"] == STEPS["max_steps"]

    top = sorted(p.name for p in (out / "dpo").iterdir())
    assert "adapter_config.json" not in top and (out / "dpo" / "adapter" / "adapter_config.json").exists()
    sft_model = load_model(peftdir / "models" / "sft", "")
    before = {n: p.detach().clone() for n, p in sft_model.named_parameters()}
    with_adapter = PeftModel.from_pretrained(sft_model, out / "dpo" / "adapter")
    for name, p in with_adapter.named_parameters():
        key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if "lora_" not in name:
            assert torch.equal(before[key], p), f"base tensor {key} changed"
    merged = load_model(out / "dpo", "")  # a plain transformers model: no peft involved
    assert type(merged).__module__.startswith("transformers.")
    ids = torch.randint(0, merged.config.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (merged(ids).logits - with_adapter.eval()(ids).logits).abs().max().item()
    assert diff < 1e-5, diff
    size = (out / "dpo" / "adapter" / "adapter_model.safetensors").stat().st_size
    print(f"\nlora dpo: adapter {size} bytes, merged logits max |diff| {diff:.2e}")


@pytest.mark.slow
def test_unmerged_adapter_is_what_later_stages_and_evaluation_load(peftdir, monkeypatch):
    from llmpipe.evaluation import harness
    from llmpipe.models import check_model_dir
    from llmpipe.models.folders import model_config

    monkeypatch.chdir(peftdir)
    params = stage_params(peftdir, "unmerged", sft={"peft": {"method": "lora", "r": 4, "merge": False}})
    from llmpipe.stages import sft

    sft.run(params)
    folder = peftdir / "out-unmerged" / "models" / "sft"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "config.json").exists() and not (folder / "model.safetensors").exists()
    check_model_dir(folder, "")
    model = load_model(folder, "")
    assert type(model).__module__.startswith("transformers."), "merged on load: a plain model for later stages"
    assert model_config(folder)["vocab_size"] == model.config.vocab_size
    assert harness.context_length(folder, 10_000) == model.config.max_position_embeddings
    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/pretrain"


def test_peft_params_inherit_from_train_and_are_checked():
    raw = yaml.safe_load(TINY_PARAMS)
    raw["train"]["peft"] = {"method": "lora", "r": 16}
    raw["sft"]["peft"] = {"lora_alpha": 64}
    raw["dpo"]["peft"] = {"method": "ia3"}
    p = parse_params(raw)
    assert (p.sft.peft.method, p.sft.peft.r, p.sft.peft.lora_alpha) == ("lora", 16, 64)
    assert (p.reward.peft.r, p.grpo.peft.method, p.ppo.peft.method) == (16, "lora", "lora")
    assert (p.dpo.peft.method, p.dpo.peft.r) == ("ia3", 8), "another method starts from its own defaults"
    assert p.pretrain.peft.method == "none", "pretrain trains in full"
    for bad, needle in [
        ({"sft": {"peft": {"method": "ia3", "r": 4}}}, "peft.r (4) applies to peft.method lora"),
        ({"pretrain": {"peft": {"method": "lora"}}}, "pretrain trains the base model in full"),
        ({"sft": {"peft": {"method": "prefix_tuning"}}}, "set peft.merge: false"),
        ({"sft": {"peft": {"method": "adalora"}, "max_steps": -1}}, "sft.max_steps"),
        ({"ppo": {"peft": {"method": "adalora"}}}, "set ppo.peft.method to lora or ia3"),
        ({"sft": {"peft": {"lora_alpa": 4}}}, "sft.peft.lora_alpa: unknown key; did you mean 'lora_alpha'?"),
    ]:
        with pytest.raises(ParamsError, match=re.escape(needle)):
            parse_params(bad)


def test_qlora_without_a_gpu_is_a_clear_error():
    from llmpipe.train.adapters import load_kwargs

    cfg = parse_params({"sft": {"peft": {"method": "lora", "load_in_4bit": True}}}).sft.peft
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: QLoRA applies")
    with pytest.raises(UserError, match=r"sft\.peft\.load_in_4bit: .* needs a CUDA GPU"):
        load_kwargs(cfg, "sft")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "over"), [("reward", {}), ("grpo", {"beta": 0.04}), ("ppo", {}),
                                             ("dpo", {"method": "kto"})])  # fmt: skip
def test_every_adapter_stage_trains_lora_and_writes_a_merged_model(peftdir, stage, over, monkeypatch):
    """reward (score head in full), grpo and kto (reference = the adapter-disabled policy inside TRL), ppo (its own
    loop: the reference is `DisabledAdapter`, the value model trains an adapter too)."""
    from transformers import AutoModelForSequenceClassification

    from llmpipe import stages
    from llmpipe.models import load_tokenizer, save_model

    monkeypatch.chdir(peftdir)
    tok = load_tokenizer(peftdir / "artifacts" / "tokenizer")
    if not (peftdir / "models" / "reward").exists():
        save_model(load_model(peftdir / "models" / "pretrain", ""), tok, peftdir / "models" / "sft")
        reward = AutoModelForSequenceClassification.from_pretrained(peftdir / "models" / "sft", num_labels=1)
        save_model(reward, tok, peftdir / "models" / "reward")
    schedule = {"max_steps": 2, "save_steps": 2, "eval_steps": 2} if stage in ("grpo", "ppo") else {}
    params = stage_params(peftdir, f"rl-{stage}", **{stage: {"peft": {"method": "lora", "r": 4}, **over, **schedule}})
    metrics = stages.runner(stage)(params)
    out = peftdir / f"out-rl-{stage}" / "models" / stage
    assert metrics["steps"] == params.stage(stage).max_steps
    assert (out / "adapter" / "adapter_model.safetensors").exists() and not (out / "adapter_config.json").exists()
    merged = load_model(out, "", num_labels=1 if stage == "reward" else None)
    assert type(merged).__module__.startswith("transformers.")
    if stage == "reward":
        from transformers import set_seed

        set_seed(params.reward.seed)  # the new score head, as the stage drew it
        initial = load_model(peftdir / "models" / "sft", "", num_labels=1)
        assert not torch.equal(merged.score.weight, initial.score.weight), "the score head trains in full"
        from llmpipe.rl.ppo.build import load_value_model

        as_adapter = load_value_model(out / "adapter")  # what ppo reads from a reward.peft.merge: false run
        assert torch.equal(as_adapter.score.weight, merged.score.weight)
