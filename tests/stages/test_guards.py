"""The silent-failure guards (`llmpipe.train.guards`, `callbacks.NonFiniteLossGuard`, the ppo loop's check, lm-eval's
truncation count), each triggered by a small real input: a BPE trained here, a random 2-layer Llama, a few
hand-written chat and preference rows, and the real trainers. Without its guard, each test's run would train
or evaluate on without an error.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
import torch

from llmpipe.config import ModelParams, parse_params
from llmpipe.config import stages as registry
from llmpipe.core.errors import UserError
from llmpipe.core.io import write_jsonl
from llmpipe.models import build_model, load_tokenizer, save_model
from llmpipe.stages.tokenizer import train_bpe

TINY_MODEL = ModelParams(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
TRAIN = {"per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "max_steps": 2, "logging_steps": 1,
         "eval_steps": 100, "save_steps": 100, "warmup_steps": 0, "max_length": 64, "precision": "fp32",
         "lr": 1e-3, "weight_decay": 0.0, "max_eval_samples": 256}
FUNCTIONS = [
    ("def add(a, b):", "Return the sum.", "    return a + b"),
    ("def greet(name):", "Say hello.", "    print('hello ' + name)"),
    ("def is_even(n):", "True when even.", "    return n % 2 == 0"),
    ("def first(items):", "The first item.", "    return items[0]"),
]
LONG_DOC = "Explain at length. " * 60  # ~1,100 characters: a prompt far longer than max_length=64 tokens


def stdlib_text(*modules: str) -> list[str]:
    return [Path(importlib.import_module(m).__file__).read_text() for m in modules]


def chat(sig: str, doc: str, body: str) -> dict:
    return {"messages": [{"role": "user", "content": f'{sig}\n    """{doc}"""'},
                         {"role": "assistant", "content": body}], "name": sig[4:].split("(")[0]}


def pair(sig: str, doc: str, chosen: str, rejected: str) -> dict:
    return {"prompt": [{"role": "user", "content": f'{sig}\n    """{doc}"""'}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tokenizer (artifacts/tokenizer), one random tiny Llama saved as models/pretrain and models/sft, a one-label
    models/reward on its backbone, SFT rows (one of four, and one of three validation rows, with a prompt longer
    than max_length) and evaluation rows."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("guards")
    tok = train_bpe(iter(stdlib_text("textwrap", "string", "argparse")), vocab_size=512, min_frequency=2,
                    model_max_length=256)
    tok.save_pretrained(root / "artifacts" / "tokenizer")
    model = build_model(TINY_MODEL, tok)
    for stage in ("pretrain", "sft"):
        save_model(model, tok, root / "models" / stage)
    reward = AutoModelForSequenceClassification.from_pretrained(root / "models" / "sft", num_labels=1)
    save_model(reward, tok, root / "models" / "reward")
    rows = [chat(*f) for f in FUNCTIONS]
    long = chat("def long(x):", LONG_DOC, "    return x")
    write_jsonl(root / "data" / "sft" / "train.jsonl", [*rows[:3], long])
    write_jsonl(root / "data" / "sft" / "validation.jsonl", [rows[3], long, rows[0]])
    write_jsonl(root / "data" / "eval" / "sft.jsonl", rows)
    write_jsonl(root / "data" / "eval" / "perplexity.jsonl", [{"text": t[:2000]} for t in stdlib_text("shlex")])
    return root


RL = {"ppo": {"num_ppo_epochs": 4, "rewards": [], "generation": {"max_new_tokens": 4}},
      "grpo": {"num_generations": 2, "beta": 0.04, "generation": {"max_new_tokens": 4, "temperature": 1.0}},
      "dpo": {"loss_type": ["sigmoid"]}}
"""Sampling short enough for max_length=64 (each key may be overridden by a test). With TRAIN's lr, weight_decay
and max_eval_samples, the other keys pin the values these tests were written with, from before the code's defaults
became the shipped params.yaml's."""


def make_params(out: Path, **sections):
    """Tiny params: inputs relative to the working directory (the test chdirs to `root`), outputs under `out`;
    each section of `sections` is merged over the defaults here, key by key."""
    raw = {"paths": {"output_root": str(out)}, "model": TINY_MODEL.model_dump(), "train": TRAIN, **RL}
    for name, section in sections.items():
        raw[name] = {**raw.get(name, {}), **section}
    return parse_params(raw)


@pytest.fixture
def in_root(root, monkeypatch) -> Path:
    monkeypatch.chdir(root)
    return root


def write_preference(root: Path, train: list[dict], validation: list[dict]) -> None:
    write_jsonl(root / "data" / "preference" / "train.jsonl", train)
    write_jsonl(root / "data" / "preference" / "validation.jsonl", validation)


# --- pad token ----------------------------------------------------------------------------------------------


def test_pad_token_equal_to_eos_or_missing_is_refused_naming_the_tokenizer(root, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "artifacts" / "tokenizer")
    tok.pad_token = tok.eos_token
    tok.save_pretrained(tmp_path / "pad_is_eos")
    with pytest.raises(UserError, match=r"pad_is_eos: the pad token is the eos token .*never learn to stop.*"
                                        r"dvc repro tokenizer"):
        load_tokenizer(tmp_path / "pad_is_eos")
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "no_pad")
    with pytest.raises(UserError, match=r"no_pad: the tokenizer has no pad token.*dvc repro tokenizer"):
        load_tokenizer(tmp_path / "no_pad")
    assert load_tokenizer(root / "artifacts" / "tokenizer").pad_token == "<pad>"


# --- the input model's tokenizer ----------------------------------------------------------------------------


def test_model_dir_with_another_tokenizer_or_chat_template_is_refused(root, tmp_path):
    from llmpipe.models.tokenizer_identity import check_same_tokenizer

    tok = load_tokenizer(root / "artifacts" / "tokenizer")
    check_same_tokenizer(root / "models" / "sft", tok, root / "artifacts" / "tokenizer")  # the same: passes

    other = train_bpe(iter(stdlib_text("json.decoder", "shlex")), vocab_size=400, min_frequency=2,
                      model_max_length=256)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(UserError, match=rf"{root / 'models' / 'sft'} and {tmp_path / 'other'} are different "
                                        r"tokenizers \(they differ in: vocab, .*probe\).*dvc repro"):
        check_same_tokenizer(root / "models" / "sft", other, tmp_path / "other")

    templated = load_tokenizer(root / "artifacts" / "tokenizer")
    templated.chat_template = templated.chat_template.replace("'\\n'", "'\\n\\n'")  # a blank line after each turn
    with pytest.raises(UserError, match=r"differ in: chat_template, probe"):
        check_same_tokenizer(root / "models" / "sft", templated, "edited")


@pytest.mark.parametrize("stage", [s for s in registry.TRAINING_TASKS if s != "pretrain"])  # pretrain builds its model
def test_every_stage_refuses_an_input_model_trained_with_another_tokenizer(in_root, tmp_path, stage):
    """paths.tokenizer now names another tokenizer than the one models/<input> was trained with."""
    write_preference(in_root, [pair(*f[:3], "    pass") for f in FUNCTIONS], [pair(*FUNCTIONS[0][:3], "    pass")])
    other = train_bpe(iter(stdlib_text("json.decoder", "shlex")), vocab_size=400, min_frequency=2,
                      model_max_length=256)
    other.save_pretrained(tmp_path / "other_tokenizer")
    own = {}
    if stage == "vlm":  # its records are read (and must fit) before any model loads
        from llmpipe.config.data import ImagesParams
        from llmpipe.data.images import write_image_set

        if not (in_root / "data" / "vlm").exists():
            write_image_set(in_root / "data" / "vlm", ImagesParams(num_train=3, num_validation=3, num_test=3))
        own = {"vlm": {"max_length": 128}}
    params = make_params(tmp_path, paths={"tokenizer": str(tmp_path / "other_tokenizer")}, **own)
    run = importlib.import_module(f"llmpipe.stages.{stage}").run
    with pytest.raises(UserError, match=rf"models/(pretrain|sft|reward) and {tmp_path / 'other_tokenizer'} are "
                                        "different tokenizers"):
        run(params)


# --- SFT: samples truncated to no label ---------------------------------------------------------------------


def test_sft_refuses_to_train_when_most_samples_keep_no_completion_token(in_root, tmp_path):
    from llmpipe.stages import sft

    with pytest.raises(UserError, match=r"sft: training samples with no completion token within "
                                        r"sft.max_length=8: 4 of 4 \(100%\).*raise sft.max_length"):
        sft.run(make_params(tmp_path, sft={"max_length": 8}))


@pytest.mark.slow
def test_sft_reports_fully_truncated_samples_in_its_metrics(in_root, tmp_path, caplog):
    from llmpipe.stages import sft

    metrics = sft.run(make_params(tmp_path))
    assert metrics["num_fully_truncated"] == 1 and metrics["num_fully_truncated_eval"] == 1
    assert math.isfinite(metrics["train_loss"]) and metrics["steps"] == 2
    assert "sft: training samples with no completion token within sft.max_length=64: 1 of 4 (25%)" in caplog.text


@pytest.mark.slow
def test_sft_refuses_a_packed_batch_whose_labels_are_all_masked(in_root, tmp_path):
    """Packed, the long sample is one pack of prompt tokens only; at one pack per batch it is a whole batch."""
    from llmpipe.stages import sft

    params = make_params(tmp_path, sft={"packing": True, "per_device_train_batch_size": 1, "max_steps": -1})
    with pytest.raises(UserError, match=r"a batch of 1 sample\(s\) has every label masked.*raise sft.max_length"):
        sft.run(params)


# --- NaN / inf loss -----------------------------------------------------------------------------------------


class Blocks(torch.utils.data.IterableDataset):
    """Fixed token blocks in order (an iterable dataset is not shuffled): step ``bad_step``'s batch has every
    label masked, so its mean loss is 0/0 = NaN while its gradient is zero."""

    def __init__(self, batch_size: int, bad_step: int | None = None, num_blocks: int = 16, length: int = 16):
        gen = torch.Generator().manual_seed(0)
        self.blocks = torch.randint(10, 500, (num_blocks, length), generator=gen)
        self.masked = set(range((bad_step - 1) * batch_size, bad_step * batch_size)) if bad_step else set()

    def __iter__(self):
        for i, block in enumerate(self.blocks):
            yield {"input_ids": block, "labels": torch.full_like(block, -100) if i in self.masked else block}


def pretrain_trainer(params, run_dir: Path, train, callbacks=()):
    from llmpipe.stages.pretrain import make_trainer

    tok = load_tokenizer("artifacts/tokenizer")
    model = build_model(params.model, tok)
    valid = list(Blocks(2, num_blocks=2))
    return make_trainer(params, model, train, valid, run_dir, callbacks), tok


def pretrain_params(out: Path):
    return make_params(out, pretrain={"max_steps": 4, "save_steps": 1, "logging_steps": 10, "max_length": 16})


@pytest.mark.slow
def test_nan_loss_stops_training_at_its_step_before_that_steps_checkpoint(in_root, tmp_path):
    from llmpipe.train.checkpoints import Run
    from llmpipe.train.loop import train_stage

    params = pretrain_params(tmp_path)
    run_dir = tmp_path / "run"
    trainer, tok = pretrain_trainer(params, run_dir, Blocks(2, bad_step=3))
    with pytest.raises(UserError, match=rf"pretrain: the training loss is nan at step 3; .*newest kept: "
                                        rf"{run_dir / 'checkpoint-2'}\). Lower pretrain.lr"):
        train_stage(trainer, params, "pretrain", Run(run_dir, None), tok)
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert not (tmp_path / "models" / "pretrain").exists()


@pytest.mark.slow
def test_non_finite_gradient_is_refused_before_the_optimizer_applies_it(in_root, tmp_path):
    """The fault: the final norm's weights blow up to inf as step 2 begins (what a divergence does), so step 2's
    loss and every gradient are NaN; the guard must stop before the optimizer writes them into the weights."""
    from transformers import TrainerCallback

    from llmpipe.train.checkpoints import Run
    from llmpipe.train.loop import train_stage

    snapshot = {}

    class BlowUp(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                with torch.no_grad():
                    model.model.norm.weight.fill_(math.inf)
                snapshot["mlp"] = model.model.layers[0].mlp.down_proj.weight.detach().clone()

    params = pretrain_params(tmp_path)
    run_dir = tmp_path / "run"
    trainer, tok = pretrain_trainer(params, run_dir, Blocks(2), [BlowUp()])
    with pytest.raises(UserError, match=r"pretrain: the gradient norm is nan \(not applied\) at step 2"):
        train_stage(trainer, params, "pretrain", Run(run_dir, None), tok)
    assert torch.equal(trainer.model.model.layers[0].mlp.down_proj.weight, snapshot["mlp"]), "NaN update applied"
    assert [p.name for p in run_dir.glob("checkpoint-*")] == ["checkpoint-1"]


@pytest.mark.slow
def test_ppo_stops_at_a_nan_loss_before_its_update_and_its_checkpoint(in_root, tmp_path):
    """Two good PPO steps (checkpointed), then the value model's head turns NaN: step 3 must stop before any
    backward pass, leave the policy as it was and write no checkpoint-3."""
    from llmpipe.callbacks import Callback, RunInfo
    from llmpipe.rl.ppo import loop
    from llmpipe.rl.ppo.build import build
    from llmpipe.rl.prompts import load_prompts

    params = make_params(tmp_path, ppo={
        "max_steps": 3, "save_steps": 1, "eval_steps": 100, "num_ppo_epochs": 1, "max_eval_samples": 2,
        "reward_model": False, "rewards": [{"name": "parsable_prefix"}], "generation": {"max_new_tokens": 4}})
    tok = load_tokenizer("artifacts/tokenizer")
    train = load_prompts(Path("data/sft/train.jsonl"), tok, 60, None, "ppo.max_length")
    valid = load_prompts(Path("data/sft/validation.jsonl"), tok, 60, 2, "ppo.max_length")
    run_dir = tmp_path / "run"
    run, _ = build(params, tok, train, valid, None, run_dir)
    state = {"step": 0, "history": [], "log_history": []}
    quiet, info = Callback(), RunInfo("ppo", run.policy, tok, 3, 0, tmp_path / "logs", "test")  # no-op callbacks
    loop.train(run, state, 2, run_dir, quiet, info, None)

    with torch.no_grad():
        run.value_model.score.weight.fill_(math.nan)
    policy = {k: v.clone() for k, v in run.policy.state_dict().items()}
    with pytest.raises(UserError, match=rf"ppo: loss nan, policy_loss nan, value_loss nan at step 3; .*newest kept: "
                                        rf"{run_dir / 'checkpoint-2'}\)"):
        loop.train(run, state, 3, run_dir, quiet, info, None)
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert all(torch.equal(v, policy[k]) for k, v in run.policy.state_dict().items()), "the NaN step was applied"


# --- preference pairs identical after truncation ------------------------------------------------------------

SHARED = "    total = 0\n    for item in items:\n        total = total + item\n    return total"  # ~30 tokens


def test_dpo_refuses_when_most_pairs_are_identical_within_max_length(in_root, tmp_path):
    """The bodies differ only after 64 tokens of prompt + shared start: DPO would see the same sequence twice."""
    from llmpipe.stages import dpo

    same = [pair(sig, doc, SHARED * 2 + "\n    x = 1", SHARED * 2 + "\n    y = 2") for sig, doc, _ in FUNCTIONS]
    distinct = pair(*FUNCTIONS[3][:3], "    pass")
    write_preference(in_root, [*same[:3], distinct], [same[0], distinct])
    with pytest.raises(UserError, match=r"dpo: training pairs whose chosen and rejected are the same tokens within "
                                        r"dpo.max_length=64: 3 of 4 \(75%\).*raise dpo.max_length"):
        dpo.run(make_params(tmp_path))


@pytest.mark.slow
def test_dpo_reports_identical_and_fully_truncated_pairs_in_its_metrics(in_root, tmp_path):
    from llmpipe.stages import dpo

    identical = pair(*FUNCTIONS[0][:2], SHARED * 2 + "\n    x = 1", SHARED * 2 + "\n    y = 2")
    too_long = pair("def long(x):", LONG_DOC, "    return x", "    pass")
    distinct = [pair(*f[:3], "    pass") for f in FUNCTIONS[1:]]
    write_preference(in_root, [identical, too_long, *distinct], distinct[:2])
    metrics = dpo.run(make_params(tmp_path, dpo={"max_steps": 1}))
    assert (metrics["num_identical_pairs"], metrics["num_fully_truncated"]) == (1, 1)
    assert (metrics["num_identical_pairs_eval"], metrics["num_fully_truncated_eval"]) == (0, 0)


def test_reward_refuses_pairs_whose_chosen_is_their_rejected(in_root, tmp_path):
    from llmpipe.stages import reward

    same = [pair(sig, doc, body, body) for sig, doc, body in FUNCTIONS]
    write_preference(in_root, same, [pair(*FUNCTIONS[0][:3], "    pass")])
    with pytest.raises(UserError, match=r"reward: training pairs whose chosen and rejected are the same tokens: 4 of 4"
                                        r" \(100%\).*fix the preference data"):
        reward.run(make_params(tmp_path))


# --- evaluation inputs longer than the context --------------------------------------------------------------


@pytest.mark.slow
def test_evaluation_counts_the_requests_lm_eval_cuts_to_fit_the_context(root, tmp_path):
    """Tasks rendered for a 4096-token context, scored in 24 tokens: every sft_chat request (context + body over
    25 tokens) and every generation prompt (over 24 - 16 tokens) is cut; perplexity's rolling windows always fit."""
    from llmpipe.evaluation import harness
    from llmpipe.evaluation.tasks import render_tasks

    names = ["llmpipe_perplexity", "llmpipe_sft_chat", "llmpipe_generation"]
    tok = load_tokenizer(root / "models" / "sft")
    render_tasks(names, root / "data" / "eval", tok, tmp_path, 4096, 16)
    cfg = parse_params({"eval": {"limit": 3, "batch_size": 4, "max_length": 24, "max_new_tokens": 16}}).eval
    metrics = harness.evaluate(root / "models" / "sft", names, harness.task_manager(names, tmp_path), cfg)
    assert metrics["num_truncated_requests"] == 6
    assert metrics["llmpipe_sft_chat.num_docs"] == 3
