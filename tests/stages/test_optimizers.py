"""`train.optim` and `train.lr_scheduler_type` through llmpipe's mapping onto a real HF Trainer on a tiny Llama: each
optimiser this machine runs trains every parameter; each schedule's logged rate is its formula at every step;
Muon steps the hidden weight matrices only and resumes from a checkpoint exactly (the stages' kill-and-resume test
with the default optimiser: test_resume.py)."""

from __future__ import annotations

import importlib.util
import math
import typing
from pathlib import Path

import pytest
import torch

from llmpipe.config import parse_params
from llmpipe.config.optim import OPTIM_REQUIRES, OptimName
from llmpipe.train.arguments import training_kwargs
from llmpipe.train.optimizers import MuonWithAdamW, attach, hidden_weights, muon_with_adamw

VOCAB, LENGTH = 64, 16


def _llama(seed: int = 0, cls_name: str = "LlamaForCausalLM", **extra):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
                                      tie_word_embeddings=False, pad_token_id=0, **extra)  # fmt: skip
    return getattr(transformers, cls_name)(config)


class Blocks(torch.utils.data.Dataset):
    """Seeded random token blocks, their own labels (a causal-LM batch as pretrain's packed blocks give)."""

    def __init__(self, n: int = 64) -> None:
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(out: Path, **train):
    """A Trainer of `pretrain` params (tiny defaults, fp32, `train` overrides) with llmpipe's mapping and factory."""
    from transformers import Trainer, TrainingArguments

    raw = {"max_steps": 4, "warmup_steps": 0, "lr": 1e-3, "per_device_train_batch_size": 4, "logging_steps": 1,
           "eval_steps": 1000, "save_steps": 1000, "precision": "fp32", **train}  # fmt: skip
    params = parse_params({"pretrain": raw})
    trainer = Trainer(model=_llama(), args=TrainingArguments(**training_kwargs(params, "pretrain", out)),
                      train_dataset=Blocks(), eval_dataset=Blocks(8))  # fmt: skip
    attach(trainer, params.pretrain)
    return trainer, params.pretrain


def _runnable(optim: str) -> bool:
    module, needs_cuda = OPTIM_REQUIRES.get(optim, (None, False))
    return (module is None or importlib.util.find_spec(module) is not None) and (torch.cuda.is_available()
                                                                               or not needs_cuda)  # fmt: skip


@pytest.mark.parametrize("optim", [o for o in typing.get_args(OptimName) if _runnable(o)])
def test_each_optimiser_trains_every_parameter(optim, tmp_path):
    trainer, _ = _trainer(tmp_path, optim=optim, max_steps=8)  # schedule_free_radam's own warmup skips ~5 steps
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p, before[n])]
    assert not unchanged, f"{optim} left {unchanged} as they were"
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert isinstance(inner, MuonWithAdamW) == (optim == "muon")


def _factor(t, s: int, n: int) -> float:
    """The schedule's multiplier of the peak rate after `s` optimizer steps of `n`, from its definition (linear
    warmup from 0, then the decay; WSD's warmup starts from its floor: transformers' `get_wsd_schedule`)."""
    w, kind, floor = t.warmup_steps, t.lr_scheduler_type, t.min_lr / t.lr
    if kind == "constant":
        return 1.0
    if kind == "warmup_stable_decay":
        decay = round(t.decay_fraction * n)
        if s < w:
            return floor + (1 - floor) * s / w
        if s < n - decay:
            return 1.0
        if s >= n:
            return floor
        p = (s - (n - decay)) / decay
        shape = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(p)}
        return floor + (1 - floor) * shape[t.decay_type]
    if s < w:
        return s / w
    p = (s - w) / (n - w)
    cosine = 0.5 * (1 + math.cos(math.pi * p))
    return {
        "constant_with_warmup": 1.0,
        "linear": max(0.0, 1 - p),
        "cosine": cosine,
        "cosine_with_min_lr": floor + (1 - floor) * cosine,
        "cosine_with_restarts": 0.0 if p >= 1 else 0.5 * (1 + math.cos(math.pi * ((t.num_cycles * p) % 1))),
    }[kind]


SCHEDULES = [
    {"lr_scheduler_type": "linear"},
    {"lr_scheduler_type": "cosine"},
    {"lr_scheduler_type": "cosine_with_restarts", "num_cycles": 3},
    {"lr_scheduler_type": "cosine_with_min_lr", "min_lr": 1e-4},
    {"lr_scheduler_type": "constant"},
    {"lr_scheduler_type": "constant_with_warmup"},
    {"lr_scheduler_type": "warmup_stable_decay", "decay_fraction": 0.25, "decay_type": "linear", "min_lr": 1e-4},
    {"lr_scheduler_type": "warmup_stable_decay", "decay_fraction": 0.5, "decay_type": "1-sqrt"},
    {"lr_scheduler_type": "warmup_stable_decay", "min_lr": 1e-4, "optim": "muon"},
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_logged_rate_is_the_schedule_formula_at_every_step(schedule, tmp_path):
    trainer, t = _trainer(tmp_path, max_steps=12, warmup_steps=3, **schedule)
    trainer.train()
    logged = {r["step"]: r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r}
    assert sorted(logged) == list(range(1, 13))
    # the rate logged at step s is the one that step took: after s - 1 scheduler steps
    for s, lr in logged.items():
        assert lr == pytest.approx(t.lr * _factor(t, s - 1, 12), abs=1e-9), f"step {s}"
    if t.optim == "muon":  # both groups follow the schedule, each from its own peak
        assert trainer.lr_scheduler.base_lrs == [t.lr, t.lr, t.muon_lr]
        muon = trainer.optimizer.optimizer.muon.param_groups[0]["lr"]
        assert muon == pytest.approx(t.muon_lr * _factor(t, 12, 12), abs=1e-9)


def _names(model, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


HIDDEN = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")}  # fmt: skip


def test_muon_steps_the_hidden_weight_matrices_only():
    from transformers import GPT2Config, GPT2LMHeadModel

    policy, value = _llama(), _llama(cls_name="LlamaForSequenceClassification", num_labels=1)
    t = parse_params({"train": {"optim": "muon"}}).ppo
    opt = muon_with_adamw(t, [policy])
    assert _names(policy, opt.muon.param_groups[0]["params"]) == HIDDEN
    assert _names(policy, [p for g in opt.adamw.param_groups for p in g["params"]]) == (
        {n for n, _ in policy.named_parameters()} - HIDDEN
    ), "embeddings, lm_head and norms go to AdamW"
    assert all(a is b for a, b in zip(opt.param_groups, [*opt.adamw.param_groups, *opt.muon.param_groups]))
    assert _names(value, [p for p in value.parameters() if id(p) in hidden_weights(value)]) == HIDDEN, (
        "a value/reward model's score head stays with AdamW"
    )
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=LENGTH))
    names = _names(gpt2, [p for p in gpt2.parameters() if id(p) in hidden_weights(gpt2)])
    assert names == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                     for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}, "GPT-2's Conv1D matrices"  # fmt: skip

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    muon = _names(lora, [p for p in lora.parameters() if id(p) in hidden_weights(lora)]) & trainable
    assert muon == {n for n in trainable if ".lora_" in n}, "under peft: the adapter matrices, not a saved head"

    # one step with AdamW's rate at 0 moves the hidden weights only
    opt = muon_with_adamw(parse_params({"train": {"optim": "muon", "weight_decay": 0.0}}).ppo, [policy])
    for g in opt.adamw.param_groups:
        g["lr"] = 0.0
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, LENGTH))
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    moved = {n for n, p in policy.named_parameters() if not torch.equal(p, before[n])}
    assert moved == HIDDEN


def test_ppo_builds_muon_for_policy_and_value_model(tmp_path):
    from llmpipe.rl.ppo.build import make_optimizer, value_section

    policy, value = _llama(), _llama(cls_name="LlamaForSequenceClassification", num_labels=1)
    params = parse_params({"ppo": {"optim": "muon", "value_lr": 3e-4}})
    opts = {"policy": make_optimizer(params, tmp_path, policy, params.ppo),
            "value": make_optimizer(params, tmp_path, value, value_section(params.ppo))}  # fmt: skip
    assert all(isinstance(opt, MuonWithAdamW) for opt in opts.values())
    adamw = {name: {id(p) for g in opt.adamw.param_groups for p in g["params"]} for name, opt in opts.items()}
    assert id(value.score.weight) in adamw["value"] and id(policy.lm_head.weight) in adamw["policy"]
    assert all(len(opt.muon.param_groups[0]["params"]) == len(HIDDEN) for opt in opts.values())
    # the value model's rates: value_lr for AdamW, and muon_lr scaled by value_lr / lr alike
    assert opts["value"].adamw.param_groups[0]["lr"] == 3e-4
    assert opts["value"].muon.param_groups[0]["lr"] == pytest.approx(params.ppo.muon_lr * 3e-4 / params.ppo.lr)


def test_muon_resumes_exactly_from_a_checkpoint(tmp_path):
    whole, _ = _trainer(tmp_path / "whole", optim="muon", max_steps=6, save_steps=3, warmup_steps=2)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert set(state) == {"adamw", "muon"}
    assert all("momentum_buffer" in s for s in state["muon"]["state"].values()), "Muon's momentum is saved"
    resumed, _ = _trainer(tmp_path / "resumed", optim="muon", max_steps=6, save_steps=3, warmup_steps=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    def losses(trainer):
        return {r["step"]: r["loss"] for r in trainer.state.log_history if "loss" in r and r["step"] > 3}

    assert losses(resumed) == pytest.approx(losses(whole), abs=1e-6)
    for a, b in zip(resumed.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_muon_state_survives_accelerate_save_and_load_state(tmp_path):
    """PPO's checkpoints (`accelerator.save_state` / `load_state`) carry Muon's momentum and the schedule."""
    from accelerate import Accelerator
    from transformers import get_scheduler

    t = parse_params({"train": {"optim": "muon"}}).ppo
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(0))

    def built():
        acc = Accelerator(cpu=True)
        model = _llama()
        opt = muon_with_adamw(t, [model])
        return (acc, *acc.prepare(model, opt, get_scheduler("cosine", opt, 1, 10)))

    def step(model, opt, sched):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    acc, model, opt, sched = built()
    for _ in range(2):
        step(model, opt, sched)
    acc.save_state(str(tmp_path / "ckpt"))
    step(model, opt, sched)
    acc2, model2, opt2, sched2 = built()
    acc2.load_state(str(tmp_path / "ckpt"))
    step(model2, opt2, sched2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert opt2.optimizer.param_groups[-1] is opt2.optimizer.muon.param_groups[0]
