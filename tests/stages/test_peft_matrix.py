"""The peft × stage × optim matrix, its training half: every cell the checks take (tests/unit/test_peft_checks.py)
trains a step on a tiny Llama and saves a model that loads; where the trainer keeps a reference in the policy's
weights, that reference is the starting policy (DPO's implicit rewards, KTO's and GRPO's KL are 0 at the first
step). Beside it, the model-level facts behind its fixes and refusals: virtual-token adapters answer alike alone and
in a left-padded batch, and generate as their forward defines; in a sequence classifier they fail or score a pad (why
reward refuses them); Muon gets the adapter matrices, AdamW the rest, and no optimizer is left empty."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY_PARAMS
from peft_cells import CELLS, METHODS, VIRTUAL_TOKENS, refusal

from llmpipe.config import PeftParams, load_params, parse_params
from llmpipe.models import load_model
from llmpipe.train.adapters import wrap
from llmpipe.train.optimizers import muon_with_adamw

VOCAB, LENGTH = 64, 32


def _llama(cls_name: str = "LlamaForCausalLM", **extra):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                                      pad_token_id=0, eos_token_id=1, bos_token_id=2, **extra)  # fmt: skip
    return getattr(transformers, cls_name)(config)


def _virtual(method: str, cls_name: str = "LlamaForCausalLM", task: str = "CAUSAL_LM"):
    """A tiny model under a virtual-token adapter, as a stage wraps it, its virtual tokens scaled up so they matter."""
    model = wrap(_llama(cls_name, num_labels=1) if task == "SEQ_CLS" else _llama(cls_name),
                 PeftParams(method=method, num_virtual_tokens=4, merge=False), "sft", Path("models/x"), task)  # fmt: skip
    with torch.no_grad():
        for p in model.prompt_encoder.parameters():
            p.mul_(5)
    return model.eval()


PROMPTS = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 5, 9, 2)]


def _padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:data:`PROMPTS` as one batch padded on `side`: ids and attention mask, (4, 9)."""
    width = max(p.shape[1] for p in PROMPTS)
    rows, masks = [], []
    for p in PROMPTS:
        pad = torch.zeros(1, width - p.shape[1], dtype=torch.long)
        rows.append(torch.cat([pad, p] if side == "left" else [p, pad], 1))
        masks.append(torch.cat([pad, torch.ones_like(p)] if side == "left" else [torch.ones_like(p), pad], 1))
    return torch.cat(rows), torch.cat(masks)


def _greedy_without_cache(model, ids: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens, each from a whole forward of the text so far: the answer as the forward defines it."""
    for _ in range(n):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[0, -n:].tolist()


@pytest.mark.parametrize("method", ["prefix_tuning", "prompt_tuning"])
@torch.no_grad()
def test_virtual_tokens_answer_alike_alone_and_in_a_left_padded_batch(method):
    model = _virtual(method)
    ids, mask = _padded("left")
    batch = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for row, prompt in enumerate(PROMPTS):
        n = prompt.shape[1]
        alone = model(input_ids=prompt, attention_mask=torch.ones_like(prompt)).logits[0, -n:]
        torch.testing.assert_close(batch[row, -n:], alone, atol=1e-5, rtol=0)
        reference = _greedy_without_cache(model, prompt, 6)
        single = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                do_sample=False, pad_token_id=0)[0, -6:].tolist()  # fmt: skip
        assert single == reference, f"{method}: generate {single} != its forward's greedy answer {reference}"
        assert generated[row, -6:].tolist() == reference, f"{method}: prompt {row} answers otherwise in a batch"


@torch.no_grad()
def test_a_saved_virtual_token_adapter_loads_answering_as_trained(tmp_path):
    model = _virtual("prefix_tuning")
    base = _llama()
    base.save_pretrained(tmp_path / "base")
    model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    loaded = load_model(tmp_path / "adapter", "").eval()  # what evaluation and generate/chat load
    ids, mask = _padded("left")
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert loaded.generate(input_ids=ids, attention_mask=mask, **kwargs).tolist() == model.generate(
        input_ids=ids, attention_mask=mask, **kwargs
    ).tolist()
    assert loaded.generate(input_ids=PROMPTS[0], **kwargs)[0, -6:].tolist() == _greedy_without_cache(
        loaded, PROMPTS[0], 6
    )


@torch.no_grad()
def test_virtual_tokens_cannot_score_in_a_sequence_classifier():
    """Why reward refuses them: peft 0.21's prefix tuning of a transformers 5 classifier fails, and a prompt-tuned
    classifier, given embeddings and no ids, scores the last position (a pad in a right-padded batch)."""
    ids, mask = _padded("right")  # as TRL's reward collator pads
    with pytest.raises(ValueError, match="past key values"):
        _virtual("prefix_tuning", "LlamaForSequenceClassification", "SEQ_CLS")(input_ids=ids, attention_mask=mask)
    model = _virtual("prompt_tuning", "LlamaForSequenceClassification", "SEQ_CLS")
    batch = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    alone = torch.cat([model(input_ids=p, attention_mask=torch.ones_like(p)).logits[:, 0] for p in PROMPTS])
    assert not torch.allclose(batch, alone, atol=1e-3), "prompt tuning scores as alone: lift reward's refusal"


MUON_CASES = {
    "none": {"method": "none"},
    "lora": {"method": "lora", "r": 4, "target_modules": "all-linear"},
    "lora_embeddings": {"method": "lora", "r": 4, "target_modules": ["embed_tokens", "q_proj", "v_proj"]},
    "dora": {"method": "lora", "r": 4, "use_dora": True, "target_modules": ["q_proj", "v_proj"]},
    "adalora": {"method": "adalora", "init_r": 4, "target_r": 2},
    "lora_head": {"method": "lora", "r": 4, "modules_to_save": ["lm_head"]},
}


@pytest.mark.parametrize("case", list(MUON_CASES))
def test_muon_gets_the_adapter_matrices_and_adamw_the_rest(case):
    model = wrap(_llama(), PeftParams(**MUON_CASES[case]), "sft", Path("models/x"), max_steps=4)
    opt = muon_with_adamw(parse_params({"train": {"optim": "muon"}}).sft, [model])
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for p in opt.muon.param_groups[0]["params"]}
    adamw = {names[id(p)] for g in (opt.adamw.param_groups if opt.adamw else []) for p in g["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert muon | adamw == trainable and not muon & adamw
    params = dict(model.named_parameters())
    assert all(params[n].ndim == 2 and min(params[n].shape) > 1 for n in muon), "Muon steps matrices only"
    assert not {n for n in muon if "embed" in n or "lora_E" in n or "lm_head" in n}, "embeddings, vectors, heads"
    if case == "lora_embeddings":
        assert {n for n in adamw if "lora_embedding_" in n}, "LoRA's embedding matrices go to AdamW"
    if case == "lora":
        assert opt.adamw is None, "nothing but adapter matrices: no (empty) AdamW"
    if case in ("adalora", "dora"):
        assert {n for n in adamw if "lora_E" in n or "magnitude" in n}, "AdaLoRA's singular values, DoRA's norms"
    before = {n: params[n].detach().clone() for n in trainable}
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # AdaLoRA's A and B get gradients once its singular values left zero
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(params[n]).all() for n in trainable)
    assert any(not torch.equal(before[n], params[n]) for n in muon), "Muon moved its matrices"


# --- the matrix: one step per cell the checks take -------------------------------------------------------------

STEP = {"max_steps": 1, "eval_steps": 1, "save_steps": 1, "logging_steps": 1, "warmup_steps": 0, "num_samples": 8,
        "num_eval_prompts": 1, "eval_max_new_tokens": 4}  # fmt: skip
RL_STEP = {"ppo": {"num_mini_batches": 1, "num_ppo_epochs": 1, "max_eval_samples": 4}, "grpo": {"max_eval_samples": 4}}
REFERENCE_LOG = {"dpo": "rewards/margins", "kto": "kl", "grpo": "kl"}
"""Per column whose trainer keeps a reference, a logged figure that is 0 while the policy is the reference."""
OTHER_OPTIMS = {
    "muon": [*(("sft", case) for case in METHODS), ("reward", "lora"), ("ppo", "lora")],
    "schedule_free_adamw": [(column, case) for column in ("sft", "reward", "ppo") for case in ("none", "lora")],
}
"""The cells other optimisers train a step in: what an optimiser meets is the trainable parameters and the loop
that steps them, not the stage's loss. Muon's parameters depend on the method (each in sft; its grouping under
every method: test_muon_gets_the_adapter_matrices_and_adamw_the_rest), then a classifier with its score head
(reward) and ppo's own loop over two models; a schedule-free optimiser's train/eval switch is the loop's (the
Trainer's, ppo's), over full weights or an adapter."""

TAKEN = [
    *((case, column, "adamw_torch") for column in CELLS for case in METHODS
      if column != "sft_unpacked" or case in VIRTUAL_TOKENS),
    *((case, column, optim) for optim, cells in OTHER_OPTIMS.items() for column, case in cells),
]
TAKEN = [cell for cell in TAKEN if not refusal(*cell)]


@pytest.fixture(scope="module")
def matrixdir(workdir):
    """`workdir` with the tiny Llama (with biases, for bitfit) as models/pretrain, models/sft and a reward model of
    it as models/reward: the inputs of every adapter stage."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM

    from llmpipe.models import load_tokenizer, save_model

    params = load_params(workdir / "params.yaml")
    tok, m = load_tokenizer(workdir / params.paths.tokenizer), params.model
    config = LlamaConfig(vocab_size=len(tok), hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
                         num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
                         intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings,
                         attention_bias=True, mlp_bias=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    for name in ("pretrain", "sft"):
        save_model(LlamaForCausalLM(config), tok, workdir / "models" / name)
    reward = AutoModelForSequenceClassification.from_pretrained(workdir / "models" / "sft", num_labels=1)
    save_model(reward, tok, workdir / "models" / "reward")
    return workdir


def _first_logged(path: Path) -> dict[str, str]:
    return next(csv.DictReader(path.open()))


@pytest.mark.slow
@pytest.mark.parametrize(("case", "column", "optim"), TAKEN, ids=["-".join(c) for c in TAKEN])
def test_cell_trains_a_step(matrixdir, case, column, optim, monkeypatch):
    from llmpipe import stages
    from llmpipe.train.arguments import check_device_params

    section, own = CELLS[column]
    raw = yaml.safe_load(TINY_PARAMS)
    peft = dict(METHODS[case])
    if case == "adalora":
        peft.update(tinit=0, tfinal=0)  # a budget of one step
    raw[section] = {**raw.get(section, {}), **own, **STEP, **RL_STEP.get(section, {}), "optim": optim, "peft": peft}
    name = f"{case}-{column}-{optim}"
    (matrixdir / f"params-{name}.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(matrixdir / f"params-{name}.yaml", {"paths.output_root": str(matrixdir / f"out-{name}")})
    monkeypatch.chdir(matrixdir)
    check_device_params(params, section)
    metrics = stages.runner(section)(params)

    assert metrics["steps"] == 1
    out = matrixdir / f"out-{name}"
    first = _first_logged(out / "logs" / section / "train.csv")
    assert math.isfinite(float(first["loss"])), first
    if key := REFERENCE_LOG.get(column):  # the reference inside the policy's weights is the starting policy
        assert abs(float(first[key])) < 1e-5, f"{key} {first[key]} at the first step: the reference is not the start"
    load_model(out / "models" / section, "", num_labels=1 if section == "reward" else None)
